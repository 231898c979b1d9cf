"""Tests for longqa.reward: the recipe's three modes give the recipe's numbers, exploits included, and the
hardened default closes those exploits."""

from __future__ import annotations

from dataclasses import FrozenInstanceError

import numpy as np
import pytest

from longqa.reward import (
    REWARD_MODES,
    RewardResult,
    compute_score,
    exact_match,
    extract_answer,
    load_reward_function,
    score_detailed,
    token_f1,
    validate_mode,
)

ENV_KNOBS = (
    "REWARD_CALC_TYPE",
    "MAX_BOXED_LIMIT",
    "PUNISH_MULTIPLE_BRACES",
    "ANSWER_OVER_FLOW_LIMIT",
    "EOT_OVER_FLOW_LIMIT",
    "F1_SCORE_THRESHOLD",
)
THINK = "<think>Bart's best friend is the son of Kirk and Luann; the article names him in full.</think>\n"
HEDGE = r"I am not sure; it could be \boxed{Paris} or \boxed{London}."


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for knob in ENV_KNOBS:
        monkeypatch.delenv(knob, raising=False)


def answered(box: str, tail: str = "") -> str:
    return THINK + "The answer is \\boxed{" + box + "}" + tail


# id, solution, ground truth, hardened (score, reason), pure_exact_match, format_exact_match, format_f1_score
CASES = [
    ("correct", answered("Milhouse Van Houten"), "Milhouse Van Houten", (1.0, None), 1.0, 1.0, 1.0),
    ("case_punct_article", answered("THE EIFFEL TOWER!"), "Eiffel Tower", (1.0, None), 1.0, 1.0, 1.0),
    ("article_in_truth", answered("Beatles"), "The Beatles", (1.0, None), 1.0, 1.0, 1.0),
    ("year", answered("1945"), "1945", (1.0, None), 1.0, 1.0, 1.0),
    ("wrong_year", answered("1944"), "1945", (0.0, "wrong"), 0.0, 0.0, 0.0),
    ("title", answered("The Return of the King"), "Return of the King", (1.0, None), 1.0, 1.0, 1.0),
    ("list_truth_alias", answered("JFK"), ["John F. Kennedy", "JFK"], (1.0, None), 1.0, 1.0, 1.0),
    ("list_truth_none", answered("Nixon"), ["John F. Kennedy", "JFK"], (0.0, "wrong"), 0.0, 0.0, 0.0),
    ("article_only_answer", answered("A"), "A", (1.0, None), 1.0, 1.0, 0.0),
    # Exploits the recipe rewards and the hardened mode refuses.
    ("empty_box", answered(""), "Milhouse Van Houten", (0.0, "empty_answer"), 1.0, 1.0, 0.0),
    ("dot_box", answered("."), "Milhouse Van Houten", (0.0, "empty_answer"), 1.0, 1.0, 0.0),
    ("fragment_van", answered("van"), "Milhouse Van Houten", (0.0, "wrong"), 1.0, 1.0, 0.0),
    ("first_name_only", answered("Milhouse"), "Milhouse Van Houten", (0.0, "wrong"), 1.0, 1.0, 0.0),
    ("surname_only", answered("Obama"), "Barack Obama", (0.0, "wrong"), 1.0, 1.0, 2 / 3),
    ("most_of_name", answered("Van Houten"), "Milhouse Van Houten", (0.0, "wrong"), 1.0, 1.0, 0.8),
    ("fragment_covering_two", answered("World War"), "World War II", (0.0, "wrong"), 1.0, 1.0, 0.8),
    ("qualified_place", answered("Paris, France"), "Paris", (0.0, "answer_overflow"), 1.0, 1.0, 2 / 3),
    ("three_candidates", answered("London Paris Rome"), "Paris", (0.0, "answer_overflow"), 1.0, 1.0, 0.0),
    ("qualified_number", answered("less than 13"), "13", (0.0, "answer_overflow"), 1.0, 1.0, 0.0),
    (
        "five_candidates",
        answered("Paris, London, Berlin, Madrid, Rome"),
        "Rome",
        (0.0, "answer_overflow"),
        1.0,
        1.0,
        0.0,
    ),
    ("or_in_box", answered("Paris or London"), "Paris", (0.0, "multiple_answers"), 1.0, 1.0, 0.0),
    ("two_boxes_hedge", THINK + HEDGE, "London", (0.0, "multiple_answers"), 1.0, 0.0, 0.0),
    ("repeated_box", THINK + r"So \boxed{Paris}. Final: \boxed{paris}", "Paris", (1.0, None), 1.0, 0.0, 0.0),
    (
        "answer_only_in_think",
        r"<think>It must be \boxed{Paris}.</think> The answer is Paris.",
        "Paris",
        (0.0, "boxed_in_think"),
        1.0,
        1.0,
        1.0,
    ),
    ("answer_outside_box", THINK + "The answer is Paris.", "Paris", (0.0, "no_boxed"), 0.0, 0.0, 0.0),
    (
        "unclosed_think",
        r"<think>Capital of France is Paris, so \boxed{Paris}",
        "Paris",
        (0.0, "unclosed_think"),
        1.0,
        1.0,
        1.0,
    ),
    ("think_reopened", THINK + r"\boxed{Paris}<think>wait, let me re", "Paris", (0.0, "unclosed_think"), 1.0, 1.0, 1.0),
    ("template_opened_think", r"Paris is the capital.</think>\boxed{Paris}", "Paris", (1.0, None), 1.0, 1.0, 1.0),
    ("unclosed_box", THINK + r"\boxed{Paris", "Paris", (0.0, "unclosed_boxed"), 0.0, 0.0, 0.0),
    ("space_form", THINK + r"The answer is $\boxed Paris$.", "Paris", (0.0, "no_boxed"), 1.0, 1.0, 1.0),
    ("space_form_essay", THINK + r"\boxed maybe Paris or London or Rome", "Rome", (0.0, "no_boxed"), 1.0, 1.0, 0.0),
    ("space_before_brace", THINK + r"\boxed {Paris}", "Paris", (1.0, None), 1.0, 1.0, 1.0),
    ("fbox", THINK + r"\fbox{Paris}", "Paris", (1.0, None), 0.0, 0.0, 0.0),
    ("text_in_box", answered(r"\text{Paris}"), "Paris", (1.0, None), 1.0, 1.0, 0.0),
    ("deep_latex_in_box", answered(r"\text{\textbf{Paris}}"), "Paris", (1.0, None), 1.0, 0.0, 0.0),
    ("accent", answered("Beyoncé"), "Beyonce", (1.0, None), 0.0, 0.0, 0.0),
    ("fullwidth", answered("ＰＡＲＩＳ"), "Paris", (1.0, None), 0.0, 0.0, 0.0),
    ("long_boxed_text", answered("Paris " * 500), "Paris", (0.0, "answer_overflow"), 1.0, 0.0, 0.0),
    (
        "text_after_answer",
        answered("Paris", ". Let me double-check the second paragraph once more, then stop."),
        "Paris",
        (1.0, None),
        1.0,
        0.0,
        0.0,
    ),
]


@pytest.mark.parametrize("mode_index, mode", enumerate(REWARD_MODES))
@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_scores_per_mode(case, mode_index, mode):
    _, solution, truth, hardened, *recipe = case
    expected = (hardened[0], *recipe)[mode_index]
    assert compute_score("hotpotqa", solution, truth, mode=mode) == pytest.approx(expected)


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_hardened_reason(case):
    _, solution, truth, hardened, *_ = case
    assert score_detailed("hotpotqa", solution, truth) == RewardResult(*hardened)


def test_modes_are_listed_with_hardened_first():
    assert REWARD_MODES == ("hardened", "pure_exact_match", "format_exact_match", "format_f1_score")


@pytest.mark.parametrize(
    "solution, truth, mode, reason",
    [
        (THINK + HEDGE, "London", "format_exact_match", "too_many_boxed"),
        (answered(r"\text{\textbf{Paris}}"), "Paris", "format_f1_score", "multiple_braces"),
        (THINK + r"\fbox{Paris}", "Paris", "pure_exact_match", "error:bad_boxed"),
        (answered("Paris", " " + "x" * 40), "Paris", "format_exact_match", "eot_overflow"),
        (answered("Paris " * 500), "Paris", "format_exact_match", "answer_overflow"),
        (answered("Van Houten"), "Milhouse Van Houten", "format_f1_score", "partial"),
        (answered("Berlin"), ["Paris", "London"], "format_f1_score", "wrong"),
        (THINK + "no box at all", "Paris", "pure_exact_match", "no_boxed"),
    ],
)
def test_recipe_reasons(solution, truth, mode, reason):
    assert score_detailed("hotpotqa", solution, truth, mode=mode).reason == reason


@pytest.mark.parametrize(
    "answer, truth, expected",
    [
        ("import os as o\nLondon", "Paris London", 1.0),  # the line deleted: "london" is in the answer
        ("import os as o London", "Paris London", 0.0),  # no newline, no deletion
        ("import os.path as p\nLondon", "Paris London", 0.0),  # the dot became a space first: no module name
        ("London", "import os as o\nParis London", 1.0),  # the answer's side too
        ("IMPORT OS AS O\nLondon", "Paris London", 1.0),  # after lower-casing
    ],
)
@pytest.mark.parametrize("mode", ["pure_exact_match", "format_exact_match"])
def test_recipe_modes_delete_an_import_as_line_as_the_recipe_does(answer, truth, expected, mode):
    """The recipe's normalisation (its reward.py's normalize_text) deletes `import X as Y` followed by a newline,
    after turning punctuation into spaces; its exact-match modes then compare by two-way substring."""
    assert compute_score("hotpotqa", answered(answer), truth, mode=mode) == expected


def test_recipe_strips_before_counting_text_after_answer():
    padded = answered("Paris") + " " * 100
    assert compute_score("hotpotqa", padded, "Paris", mode="format_exact_match") == 1.0


def test_space_form_wins_over_a_later_braced_box():
    solution = THINK + r"first $\boxed Paris$ then \boxed{London}"
    assert compute_score("hotpotqa", solution, "Paris", mode="pure_exact_match") == 1.0
    assert compute_score("hotpotqa", solution, "London", mode="pure_exact_match") == 0.0


def test_overflow_on_one_truth_does_not_hide_a_match_on_another(monkeypatch):
    monkeypatch.setenv("ANSWER_OVER_FLOW_LIMIT", "10")  # "Paris, France" is 12 longer than "P", 8 than "Paris"
    solution = answered("Paris, France")
    assert score_detailed("x", solution, ["P", "Paris"], mode="format_exact_match") == RewardResult(1.0, None)
    assert score_detailed("x", solution, ["P", "Berlin"], mode="format_exact_match") == RewardResult(
        0.0, "answer_overflow"
    )


# --- environment knobs ---------------------------------------------------------------------------


def test_mode_from_environment_and_argument_override(monkeypatch):
    monkeypatch.setenv("REWARD_CALC_TYPE", "pure_exact_match")
    assert compute_score("x", answered(""), "Paris") == 1.0
    assert compute_score("x", answered(""), "Paris", mode="hardened") == 0.0


def test_max_boxed_limit(monkeypatch):
    monkeypatch.setenv("MAX_BOXED_LIMIT", "2")
    assert compute_score("x", THINK + HEDGE, "London", mode="format_exact_match") == 1.0
    monkeypatch.setenv("MAX_BOXED_LIMIT", "0")
    assert compute_score("x", THINK + HEDGE, "London", mode="format_f1_score") == 1.0
    monkeypatch.setenv("MAX_BOXED_LIMIT", "1")
    assert compute_score("x", THINK + HEDGE, "London", mode="format_exact_match") == 0.0


def test_punish_multiple_braces(monkeypatch):
    solution = answered(r"\text{\textbf{Paris}}")
    assert compute_score("x", solution, "Paris", mode="format_exact_match") == 0.0
    monkeypatch.setenv("PUNISH_MULTIPLE_BRACES", "0")
    assert compute_score("x", solution, "Paris", mode="format_exact_match") == 1.0


def test_answer_overflow_limit(monkeypatch):
    solution = answered("Paris, France")
    monkeypatch.setenv("ANSWER_OVER_FLOW_LIMIT", "5")
    assert score_detailed("x", solution, "Paris", mode="format_exact_match") == RewardResult(0.0, "answer_overflow")
    monkeypatch.setenv("ANSWER_OVER_FLOW_LIMIT", "8")
    assert compute_score("x", solution, "Paris", mode="format_exact_match") == 1.0


def test_eot_overflow_limit(monkeypatch):
    solution = answered("Paris", ". Let me double-check the second paragraph once more, then stop.")
    monkeypatch.setenv("EOT_OVER_FLOW_LIMIT", "1000")
    assert compute_score("x", solution, "Paris", mode="format_exact_match") == 1.0
    assert compute_score("x", solution, "Paris", mode="format_f1_score") == 1.0


def test_f1_threshold(monkeypatch):
    solution = answered("Van Houten")
    monkeypatch.setenv("F1_SCORE_THRESHOLD", "0.9")
    assert compute_score("x", solution, "Milhouse Van Houten", mode="format_f1_score") == 0.0
    monkeypatch.setenv("F1_SCORE_THRESHOLD", "0.3")
    assert compute_score("x", answered("Milhouse"), "Milhouse Van Houten", mode="format_f1_score") == 0.5


def test_malformed_knob_is_an_error_not_a_crash(monkeypatch):
    monkeypatch.setenv("MAX_BOXED_LIMIT", "many")
    assert score_detailed("x", answered("Paris"), "Paris", mode="format_exact_match") == RewardResult(
        0.0, "error:ValueError"
    )


# --- robustness ----------------------------------------------------------------------------------

GARBAGE_SOLUTIONS = [None, 42, 3.5, {"text": "Paris"}, b"\\boxed{Paris}", ["\\boxed{Paris}"], object()]
GARBAGE_TRUTHS = [
    None,
    True,
    float("nan"),
    [],
    [None],
    ["Paris", float("inf")],
    [""],
    "   ",
    {"answer": "Paris"},
    b"Paris",
    object(),
]


@pytest.mark.parametrize("mode", REWARD_MODES)
@pytest.mark.parametrize("solution", GARBAGE_SOLUTIONS, ids=lambda value: type(value).__name__)
def test_garbage_solution_scores_zero(mode, solution):
    assert score_detailed("x", solution, "Paris", mode=mode) == RewardResult(0.0, "bad_solution")


@pytest.mark.parametrize("mode", REWARD_MODES)
@pytest.mark.parametrize("truth", GARBAGE_TRUTHS, ids=lambda v: repr(v) if type(v) is not object else "object()")
def test_garbage_ground_truth_scores_zero(mode, truth):
    assert score_detailed("x", answered("Paris"), truth, mode=mode) == RewardResult(0.0, "bad_ground_truth")


@pytest.mark.parametrize("mode", REWARD_MODES)
@pytest.mark.parametrize(
    "truth, box",
    [(42, "42"), (5.0, "5"), (3.5, "3.5"), (np.int64(7), "7"), ([5, "five"], "5"), (np.array([1990]), "1990")],
    ids=repr,
)
def test_a_number_is_a_ground_truth(mode, truth, box):
    """A Python caller's number scores like its text (verl's parquet files hold strings, but a script need not)."""
    assert score_detailed("x", answered(box), truth, mode=mode) == RewardResult(1.0)
    assert score_detailed("x", answered("x"), truth, mode=mode).score == 0.0


@pytest.mark.parametrize("mode", REWARD_MODES)
@pytest.mark.parametrize(
    "solution",
    [
        THINK + "\\boxed{" + "Paris " * 200_000 + "}",
        "{" * 200_000 + "\\boxed{Paris}",
        "\\boxed{" * 100_000,
        "</think>" * 50_000 + "\\boxed{Paris}",
        "\x00\ud800\\boxed{\x00}",
    ],
    ids=["huge_box", "deep_braces", "many_open_boxes", "many_think_ends", "odd_characters"],
)
def test_huge_and_odd_strings_never_raise(mode, solution):
    score = compute_score("x", solution, "Paris", mode=mode)
    assert isinstance(score, float) and 0.0 <= score <= 1.0


def test_numpy_like_ground_truth_is_accepted():
    class ArrayLike:
        def tolist(self):
            return ["John F. Kennedy", "JFK"]

    assert compute_score("x", answered("JFK"), ArrayLike()) == 1.0


def test_verl_keyword_call_with_extra_kwargs():
    score = compute_score(
        data_source="hotpotqa",
        solution_str=answered("Paris"),
        ground_truth="Paris",
        extra_info={"index": 3},
        reward_router_address=None,
    )
    assert score == 1.0 and isinstance(score, float)


def test_unknown_mode_scores_zero_and_validate_mode_raises(monkeypatch):
    result = score_detailed("x", answered("Paris"), "Paris", mode="f1_score")
    assert result.score == 0.0 and result.reason.startswith("error:unknown_mode")
    monkeypatch.setenv("REWARD_CALC_TYPE", "typo")
    assert compute_score("x", answered("Paris"), "Paris") == 0.0
    with pytest.raises(ValueError) as error:
        validate_mode("typo")
    assert all(mode in str(error.value) for mode in REWARD_MODES)
    assert validate_mode("format_f1_score") == "format_f1_score"


def test_reward_result_is_frozen():
    result = RewardResult(1.0)
    with pytest.raises(FrozenInstanceError):
        result.score = 0.0


# --- evaluation functions ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "solution, expected",
    [
        (answered(r"\text{AT\&T}~Inc"), "AT&T Inc"),
        (THINK + r"\boxed{Paris} then \boxed{London}", "London"),
        (r"<think>\boxed{Paris}</think> Paris", None),
        (r"<think>\boxed{Paris}", None),
        (THINK + r"\boxed{Paris", None),
        (None, None),
    ],
)
def test_extract_answer(solution, expected):
    assert extract_answer(solution) == expected


@pytest.mark.parametrize(
    "prediction, truth, expected",
    [
        ("The Eiffel Tower!", "eiffel tower", 1.0),
        ("Eiffel", "Eiffel Tower", 0.0),
        ("JFK", ["John F. Kennedy", "jfk"], 1.0),
        (None, "Paris", 0.0),
    ],
)
def test_exact_match(prediction, truth, expected):
    assert exact_match(prediction, truth) == expected


@pytest.mark.parametrize(
    "prediction, truth, expected",
    [
        ("Van Houten", "Milhouse Van Houten", 0.8),  # P=1, R=2/3
        ("Barack Obama president", "Barack Obama", 0.8),  # P=2/3, R=1
        ("Paris", ["London", "Paris, France"], 2 / 3),  # best of 0 and P=1, R=1/2
        ("the the", "The", 0.0),  # both normalise to nothing: no common token
        ("", "Paris", 0.0),
        (None, "Paris", 0.0),
    ],
)
def test_token_f1(prediction, truth, expected):
    assert token_f1(prediction, truth) == pytest.approx(expected)


def test_eval_functions_reject_malformed_truth():
    with pytest.raises(ValueError):
        exact_match("Paris", [])
    with pytest.raises(ValueError):
        token_f1("Paris", None)


# --- custom reward functions ---------------------------------------------------------------------


def write_reward(tmp_path, body: str):
    path = tmp_path / "my_reward.py"
    path.write_text(body)
    return path


@pytest.mark.parametrize(
    "body, expected",
    [
        (
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
            "    return 0.5 if ground_truth in solution_str else 0.0\n",
            RewardResult(0.5, None),
        ),
        ("def compute_score(**kw):\n    return {'score': 1, 'acc': True}\n", RewardResult(1.0, None)),
        ("def compute_score(**kw):\n    return True\n", RewardResult(1.0, None)),
        ("def compute_score(**kw):\n    raise RuntimeError('boom')\n", RewardResult(0.0, "error:RuntimeError")),
        ("def compute_score(**kw):\n    return float('nan')\n", RewardResult(0.0, "error:not_finite")),
        ("def compute_score(**kw):\n    return {'score': float('inf')}\n", RewardResult(0.0, "error:not_finite")),
        ("def compute_score(**kw):\n    return None\n", RewardResult(0.0, "error:not_a_number")),
        ("def compute_score(**kw):\n    return '1.0'\n", RewardResult(0.0, "error:not_a_number")),
        ("def compute_score(**kw):\n    return {'acc': 1.0}\n", RewardResult(0.0, "error:not_a_number")),
    ],
    ids=["float", "dict", "bool", "raises", "nan", "inf", "none", "string", "dict_without_score"],
)
def test_custom_reward_results(tmp_path, body, expected):
    score = load_reward_function(write_reward(tmp_path, body))
    assert score("hotpotqa", answered("Paris"), "Paris", mode="ignored") == expected


def test_custom_reward_receives_verl_arguments_and_named_function(tmp_path):
    body = (
        "from dataclasses import dataclass\n\n"
        "@dataclass\n"
        "class Seen:\n"
        "    source: str\n\n"
        "def my_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        "    return float(Seen(data_source).source == 'musique' and extra_info['hops'] + kw['bonus'])\n"
    )
    score = load_reward_function(str(write_reward(tmp_path, body)), name="my_score")
    assert score("musique", "s", "t", {"hops": 2}, bonus=1) == RewardResult(3.0, None)


def test_missing_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "nowhere.py"
    with pytest.raises(ValueError, match="nowhere.py"):
        load_reward_function(missing)


def test_missing_function_is_a_clear_error(tmp_path):
    path = write_reward(tmp_path, "def other(**kw):\n    return 1.0\n")
    with pytest.raises(ValueError) as error:
        load_reward_function(path, name="compute_score")
    assert "compute_score" in str(error.value) and str(path) in str(error.value)


def test_unimportable_file_is_a_clear_error(tmp_path):
    path = write_reward(tmp_path, "def compute_score(:\n")
    with pytest.raises(ValueError, match="my_reward.py"):
        load_reward_function(path)
