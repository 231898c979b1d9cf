"""Response lengths for benchmarks: random-weight models never sample EOS, so without a drawn length every
response would run to the maximum and every speed measured would be that of the worst case.

The fast engine ends a sample at a given length as if it had sampled EOS there (``generate(...,
stop_at=...)``); these functions say which lengths. GRPO responses on long-context QA are skewed: most
end well below the limit, a few run into it. A log-normal clipped to ``[1, max_length]`` has that shape;
its median of 0.32 x ``max_length`` (sigma 0.8) puts the clipped mean near 40% of the limit, with about
8% of the responses cut by it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

LENGTH_KINDS = ("lognormal", "max")
LOGNORMAL_SIGMA = 0.8
LOGNORMAL_MEDIAN = 0.32  # of max_length


def draw_response_lengths(kind: str, count: int, max_length: int, seed: int | Sequence[int]) -> list[int]:
    """``count`` response lengths in ``[1, max_length]``, a function of ``seed`` alone (an int, or a
    sequence such as (seed, step, prompt) so that each prompt's lengths survive a resume)."""
    if kind not in LENGTH_KINDS:
        raise ValueError(f"response lengths must be one of {', '.join(LENGTH_KINDS)}, got {kind!r}")
    if count < 0 or max_length < 1:
        raise ValueError(f"need count >= 0 and max_length >= 1, got {count} and {max_length}")
    if kind == "max":
        return [max_length] * count
    rng = np.random.default_rng(seed)
    drawn = rng.lognormal(math.log(LOGNORMAL_MEDIAN * max_length), LOGNORMAL_SIGMA, count)
    return np.clip(np.rint(drawn), 1, max_length).astype(np.int64).tolist()
