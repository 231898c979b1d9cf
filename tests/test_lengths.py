"""The response lengths benchmarks draw: their shape, their bounds, their seeds."""

import numpy as np
import pytest

from longqa.rollout.lengths import draw_response_lengths


def test_lognormal_lengths_average_about_forty_percent_of_the_limit():
    lengths = np.array(draw_response_lengths("lognormal", 200_000, 1024, 0))
    assert lengths.min() >= 1 and lengths.max() == 1024
    assert 0.35 < lengths.mean() / 1024 < 0.45
    assert 0.02 < (lengths == 1024).mean() < 0.15  # a few run into the limit, as truncated responses do
    assert np.median(lengths) < lengths.mean()  # skewed: most responses are short


def test_lengths_are_a_function_of_the_seed():
    assert draw_response_lengths("lognormal", 50, 300, (7, 2, 11)) == draw_response_lengths(
        "lognormal", 50, 300, (7, 2, 11)
    )
    assert draw_response_lengths("lognormal", 50, 300, (7, 2, 11)) != draw_response_lengths(
        "lognormal", 50, 300, (7, 2, 12)
    )
    assert all(isinstance(x, int) and 1 <= x <= 3 for x in draw_response_lengths("lognormal", 100, 3, 1))


def test_max_lengths_and_bad_requests():
    assert draw_response_lengths("max", 4, 17, 0) == [17] * 4
    assert draw_response_lengths("lognormal", 0, 17, 0) == []
    with pytest.raises(ValueError, match="one of lognormal, max"):
        draw_response_lengths("uniform", 4, 17, 0)
    with pytest.raises(ValueError, match="max_length >= 1"):
        draw_response_lengths("max", 4, 0, 0)
