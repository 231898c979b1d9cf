r"""Rule-based rewards for long-context multi-hop QA answered as ``<think>...</think> \boxed{answer}``.

verl can use this file directly (``custom_reward_function.path=<this file>``,
``custom_reward_function.name=compute_score``); ``data_source`` and ``extra_info`` are accepted for that
call convention and otherwise unused. verl's ``reward_kwargs`` may pass ``mode=...``.

Modes (the ``mode`` argument, else the ``REWARD_CALC_TYPE`` environment variable, else ``hardened``):

``pure_exact_match``, ``format_exact_match``, ``format_f1_score``
    The LoongRL / Arctic ``long_context_qa`` recipe, re-implemented to give the same numbers, with its
    knobs read from the environment on every call: ``MAX_BOXED_LIMIT`` (1), ``PUNISH_MULTIPLE_BRACES`` (1),
    ``ANSWER_OVER_FLOW_LIMIT`` (128), ``EOT_OVER_FLOW_LIMIT`` (32), ``F1_SCORE_THRESHOLD`` (0.5). Its
    answer is the last ``\boxed`` anywhere in the response and it matches by two-way substring, so
    ``\boxed{}``, ``\boxed{.}`` and ``\boxed{van}`` (for "Milhouse Van Houten") all score 1.0 in
    ``pure_exact_match``. That is kept on purpose: these modes exist to reproduce the recipe. The recipe's
    overflow penalties can push one ground truth's score to -1, but its best-over-truths starts at 0, so
    any overflow simply yields 0 here.

``hardened`` (default)
    1. The answer part is the text after the last ``</think>`` (the whole response when there is none, as
       with chat templates that open ``<think>`` in the prompt). A ``<think>`` that is never closed, or is
       reopened after the last ``</think>``, means the reasoning was cut off: 0.
    2. The answer is a braced box in the answer part: ``\boxed{...}``, ``\boxed {...}`` or ``\fbox{...}``
       with nested braces allowed; LaTeX commands inside are dropped (``\text{Paris}`` is "Paris"). The
       recipe's brace-less ``\boxed X`` form is not accepted because its extent is a guess (the recipe reads
       up to the next ``$``, which lets an essay containing the answer score). A box only inside the
       reasoning, an answer in plain text, or a box that never closes scores 0.
    3. Several boxes in the answer part must all normalise to the same words; otherwise it is hedging: 0.
    4. Words are compared after normalisation: NFKC, case folding, accents removed, Unicode punctuation and
       symbols removed, the articles a/an/the dropped (unless nothing else is left, so the answer "A"
       still works), whitespace collapsed. An empty prediction scores 0.
    5. Against each ground truth (the best one counts), the prediction scores 1.0 when it
       - equals the answer; or
       - is shorter and is a contiguous run of whole answer words covering strictly more than half of
         them ("Van Houten" for "Milhouse Van Houten", but not "van", "Milhouse", or "Obama" for
         "Barack Obama"); or
       - is longer, contains the whole answer as a contiguous run of whole words, adds at most
         ``MAX_EXTRA_WORDS`` (2) words, none of which is a hedge word such as "or", "and", "not",
         "maybe" ("Paris, France" for "Paris"; not "Paris or London", not a list of five names).
       Otherwise 0. Known residue: a longer prediction like "Paris, London" (a second candidate without a
       hedge word, within two words) still counts; a qualifier and an alternative look alike to a
       string rule, and the word cap limits how much can be hedged this way.

Every score comes with a reason (``RewardResult.reason``), None for a full success, so training can count
failure kinds: ``bad_solution``, ``bad_ground_truth``, ``unclosed_think``, ``no_boxed``,
``boxed_in_think``, ``unclosed_boxed``, ``empty_answer``, ``multiple_answers``, ``too_many_boxed``,
``multiple_braces``, ``answer_overflow``, ``eot_overflow``, ``partial`` (an F1 score between 0 and 1),
``wrong``, ``error:bad_boxed`` (the recipe cannot unwrap its last box, e.g. ``\fbox``),
``error:unknown_mode '<name>'``, ``error:<ExceptionType>``, and for custom functions
``error:not_a_number`` and ``error:not_finite``.
"""

# No ``from __future__ import annotations`` here: verl loads this file by path as a module it never registers
# in sys.modules, and dataclasses cannot resolve string annotations of such a module.
import hashlib
import importlib.util
import math
import numbers
import os
import re
import string
import sys
import unicodedata
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "REWARD_MODES",
    "RewardResult",
    "compute_score",
    "exact_match",
    "extract_answer",
    "load_reward_function",
    "score_detailed",
    "token_f1",
    "validate_mode",
]

DEFAULT_MODE = "hardened"
MODE_ENV = "REWARD_CALC_TYPE"
MAX_EXTRA_WORDS = 2
HEDGE_WORDS = frozenset(
    {"or", "and", "nor", "either", "neither", "not", "no", "maybe", "perhaps", "possibly", "probably"}
)
ARTICLES = frozenset({"a", "an", "the"})
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

_RECIPE_SPECIAL = ',.:"\'[]-=+\\|!@#$%^&*();<>?/！￥…（）—{}：“”《》？'
_RECIPE_TABLE = str.maketrans({ch: " " for ch in _RECIPE_SPECIAL})
_SQUAD_PUNCT = frozenset(string.punctuation)
_SQUAD_ARTICLES = re.compile(r"\b(a|an|the)\b")
_BRACE = re.compile(r"[{}]")
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_LATEX_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
# When every truth fails, the most specific failure is the one worth counting.
_FAILURE_ORDER = ("multiple_answers", "answer_overflow", "eot_overflow", "wrong")


@dataclass(frozen=True, slots=True)
class RewardResult:
    """A score with the reason it is not a full success (None when it is), for counting failure kinds."""

    score: float
    reason: str | None = None


def _fail(reason: str) -> RewardResult:
    return RewardResult(0.0, reason)


# --- shared text functions -----------------------------------------------------------------------


def _truth_list(ground_truth: Any) -> list[str] | None:
    """Accept what verl passes (a str, a list, or a numpy array after a parquet round trip), or None.

    The rule matches the data schema: a non-blank string or a non-empty list of non-blank strings. A blank
    truth would be a substring of every prediction, so it is refused rather than rewarded.
    """
    if not isinstance(ground_truth, str) and hasattr(ground_truth, "tolist"):
        ground_truth = ground_truth.tolist()
    if isinstance(ground_truth, str):
        ground_truth = [ground_truth]
    if not isinstance(ground_truth, (list, tuple)) or not ground_truth:
        return None
    if not all(isinstance(truth, str) and truth.strip() for truth in ground_truth):
        return None
    return list(ground_truth)


def _balanced_end(text: str, start: int) -> int | None:
    """Index of the brace that closes the first group at or after ``start``; None when it never closes.

    Jumps from brace to brace with a regex so a megabyte-long box costs no Python-level loop per character.
    """
    depth = 0
    for match in _BRACE.finditer(text, start):
        if match.group() == "{":
            depth += 1
            continue
        depth -= 1
        if depth == 0:
            return match.start()
    return None


def _squad_normalize(text: str) -> str:
    """SQuAD v1.1 answer normalisation, kept exact so EM/F1 numbers compare with published ones."""
    text = "".join(ch for ch in text.lower() if ch not in _SQUAD_PUNCT)
    return " ".join(_SQUAD_ARTICLES.sub(" ", text).split())


def _f1(prediction_tokens: list[str], truth_tokens: list[str]) -> float:
    common = sum((Counter(prediction_tokens) & Counter(truth_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(prediction_tokens)
    recall = common / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def _best(results: list[RewardResult]) -> RewardResult:
    """The best score over ground truths; when all are 0, the most informative failure reason."""
    top = max(results, key=lambda result: result.score)
    if top.score > 0:
        return top
    return min(results, key=lambda result: _FAILURE_ORDER.index(result.reason))


# --- the recipe's modes --------------------------------------------------------------------------


def _env_int(name: str, default: int) -> int:
    return int(os.getenv(name, default))


def _recipe_prediction(solution: str) -> tuple[str | None, str | None]:
    """The recipe's ``last_boxed`` + ``remove_boxed``: (prediction, None) or (None, reason).

    Any ``"\\boxed "`` in the response wins, even before a later braced box; otherwise the last
    ``\\boxed``, falling back to the last ``\\fbox``, whose group the recipe then fails to unwrap.
    """
    if "\\boxed " in solution:
        return solution.split("\\boxed ")[-1].split("$")[0], None
    start = solution.rfind("\\boxed")
    if start < 0:
        start = solution.rfind("\\fbox")
    if start < 0:
        return None, "no_boxed"
    end = _balanced_end(solution, start)
    if end is None:
        return None, "unclosed_boxed"
    if not solution.startswith("\\boxed{", start):
        return None, "error:bad_boxed"
    return solution[start + len("\\boxed{"):end], None


def _recipe_normalize(text: str) -> str:
    return " ".join(text.lower().translate(_RECIPE_TABLE).split())


def _recipe_is_match(prediction: str, truth: str) -> bool:
    """Two-way substring: the reason an empty prediction, or any fragment of the answer, matches."""
    prediction, truth = _recipe_normalize(prediction), _recipe_normalize(truth)
    return truth in prediction or prediction in truth


def _recipe_gated_prediction(solution: str) -> tuple[str | None, str | None]:
    """The format modes' prediction, after the box-count and brace gates that zero a response."""
    max_boxed = _env_int("MAX_BOXED_LIMIT", 1)
    if max_boxed > 0 and solution.count("\\boxed") > max_boxed:
        return None, "too_many_boxed"
    prediction, reason = _recipe_prediction(solution)
    if prediction is None:
        return None, reason
    if _env_int("PUNISH_MULTIPLE_BRACES", 1) > 0 and (
        prediction.count("{") > 1 or prediction.count("}") > 1 or prediction.count("\\") > 1
    ):
        return None, "multiple_braces"
    return prediction, None


def _recipe_overflow(solution: str, prediction: str, truth: str) -> str | None:
    """Why the recipe voids a match: too long an answer, or too much text after it."""
    if len(prediction) - len(truth) > _env_int("ANSWER_OVER_FLOW_LIMIT", 128):
        return "answer_overflow"
    tail = len(solution) - (solution.rfind(prediction) + len(prediction))
    if tail > _env_int("EOT_OVER_FLOW_LIMIT", 32):
        return "eot_overflow"
    return None


def _score_pure_exact_match(solution: str, truths: list[str]) -> RewardResult:
    prediction, reason = _recipe_prediction(solution)
    if prediction is None:
        return _fail(reason)
    if any(_recipe_is_match(prediction, truth) for truth in truths):
        return RewardResult(1.0)
    return _fail("wrong")


def _score_format_exact_match(solution: str, truths: list[str]) -> RewardResult:
    prediction, reason = _recipe_gated_prediction(solution)
    if prediction is None:
        return _fail(reason)
    results = []
    for truth in truths:
        if not _recipe_is_match(prediction, truth):
            results.append(_fail("wrong"))
            continue
        overflow = _recipe_overflow(solution, prediction, truth)
        results.append(_fail(overflow) if overflow else RewardResult(1.0))
    return _best(results)


def _score_format_f1_score(solution: str, truths: list[str]) -> RewardResult:
    prediction, reason = _recipe_gated_prediction(solution)
    if prediction is None:
        return _fail(reason)
    threshold = float(os.getenv("F1_SCORE_THRESHOLD", 0.5))
    tokens = _squad_normalize(prediction).split()
    results = []
    for truth in truths:
        f1 = _f1(tokens, _squad_normalize(truth).split())
        if f1 <= threshold:
            results.append(_fail("wrong"))
            continue
        overflow = _recipe_overflow(solution, prediction, truth)
        if overflow:
            results.append(_fail(overflow))
        else:
            results.append(RewardResult(f1, None if f1 >= 1.0 else "partial"))
    return _best(results)


# --- the hardened mode ---------------------------------------------------------------------------


def _split_think(solution: str) -> tuple[str, str] | None:
    """(reasoning, answer part), or None when the reasoning was cut off before ``</think>``."""
    reasoning, _, answer_part = solution.rpartition(THINK_CLOSE)
    if THINK_OPEN in answer_part:
        return None
    return reasoning, answer_part


def _boxes(text: str) -> list[str] | None:
    """Contents of the braced boxes in ``text``, outermost only; None when one never closes."""
    contents = []
    position = 0
    while match := _BOX_OPEN.search(text, position):
        end = _balanced_end(text, match.end() - 1)
        if end is None:
            return None
        contents.append(text[match.end():end])
        position = end + 1
    return contents


def _unlatex(text: str) -> str:
    r"""Plain text of a box: ``\text{Paris}`` is "Paris", ``AT\&T`` is "AT&T", ``~`` is a space."""
    text = _LATEX_COMMAND.sub(" ", text)
    text = _LATEX_ESCAPE.sub(r"\1", text)
    return " ".join(text.replace("~", " ").replace("{", "").replace("}", "").split())


def _answer_words(text: str) -> tuple[str, ...]:
    """SQuAD-style words that also survive Unicode variants: width, case, accents, curly quotes."""
    text = unicodedata.normalize("NFKD", unicodedata.normalize("NFKC", text).casefold())
    text = "".join(
        ch for ch in text if not unicodedata.combining(ch) and unicodedata.category(ch)[0] not in "PS"
    )
    words = tuple(text.split())
    return tuple(word for word in words if word not in ARTICLES) or words


def _contains_run(words: tuple[str, ...], run: tuple[str, ...]) -> bool:
    """Whether ``run`` occurs in ``words`` as contiguous whole words (a string search, so it is fast)."""
    return f" {' '.join(run)} " in f" {' '.join(words)} "


def _hardened_match(prediction: tuple[str, ...], truth: tuple[str, ...]) -> str | None:
    """None when the prediction names the answer; otherwise the failure reason."""
    if prediction == truth:
        return None
    if len(prediction) < len(truth):
        covers_most = 2 * len(prediction) > len(truth)
        return None if covers_most and _contains_run(truth, prediction) else "wrong"
    if not _contains_run(prediction, truth):
        return "wrong"
    if HEDGE_WORDS.intersection(Counter(prediction) - Counter(truth)):
        return "multiple_answers"
    if len(prediction) - len(truth) > MAX_EXTRA_WORDS:
        return "answer_overflow"
    return None


def _hardened_boxes(solution: str) -> tuple[list[str] | None, str | None]:
    """The plain-text contents of the answer part's boxes, or (None, reason)."""
    parts = _split_think(solution)
    if parts is None:
        return None, "unclosed_think"
    reasoning, answer_part = parts
    contents = _boxes(answer_part)
    if contents is None:
        return None, "unclosed_boxed"
    if not contents:
        return None, "boxed_in_think" if _BOX_OPEN.search(reasoning) else "no_boxed"
    return [_unlatex(content) for content in contents], None


def _score_hardened(solution: str, truths: list[str]) -> RewardResult:
    contents, reason = _hardened_boxes(solution)
    if contents is None:
        return _fail(reason)
    predictions = {_answer_words(content) for content in contents}
    if len(predictions) > 1:
        return _fail("multiple_answers")
    prediction = predictions.pop()
    if not prediction:
        return _fail("empty_answer")
    truth_words = [words for words in map(_answer_words, truths) if words]
    if not truth_words:
        return _fail("bad_ground_truth")
    results = []
    for words in truth_words:
        failure = _hardened_match(prediction, words)
        results.append(_fail(failure) if failure else RewardResult(1.0))
    return _best(results)


# --- entry points --------------------------------------------------------------------------------

_SCORERS: dict[str, Callable[[str, list[str]], RewardResult]] = {
    "hardened": _score_hardened,
    "pure_exact_match": _score_pure_exact_match,
    "format_exact_match": _score_format_exact_match,
    "format_f1_score": _score_format_f1_score,
}
REWARD_MODES: tuple[str, ...] = tuple(_SCORERS)
_RECIPE_MODES = frozenset(REWARD_MODES) - {"hardened"}


def validate_mode(name: str) -> str:
    """Check a mode name up front (config load), so a typo fails before training instead of scoring 0."""
    if name not in _SCORERS:
        raise ValueError(f"unknown reward mode {name!r}; allowed: {', '.join(REWARD_MODES)}")
    return name


def _score(solution_str: Any, ground_truth: Any, mode: Any) -> RewardResult:
    name = mode or os.getenv(MODE_ENV) or DEFAULT_MODE
    if not isinstance(name, str) or name not in _SCORERS:
        return _fail(f"error:unknown_mode {name!r}")
    if not isinstance(solution_str, str):
        return _fail("bad_solution")
    truths = _truth_list(ground_truth)
    if truths is None:
        return _fail("bad_ground_truth")
    # The recipe strips the response before everything, which shifts its after-answer length count.
    solution = solution_str.strip() if name in _RECIPE_MODES else solution_str
    return _SCORERS[name](solution, truths)


def score_detailed(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None,
                   mode: str | None = None, **kwargs: Any) -> RewardResult:
    """Score one response with the reason for any shortfall; never raises, so one odd sample can't stop training."""
    try:
        return _score(solution_str, ground_truth, mode)
    except Exception as exc:  # noqa: BLE001 - a reward crash must cost one sample, not the run
        return _fail(f"error:{type(exc).__name__}")


def compute_score(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None,
                  **kwargs: Any) -> float:
    """verl's ``custom_reward_function`` entry point: the score of :func:`score_detailed`."""
    return score_detailed(data_source, solution_str, ground_truth, extra_info, **kwargs).score


# --- evaluation functions ------------------------------------------------------------------------


def extract_answer(solution_str: Any) -> str | None:
    """The answer the hardened mode reads (last box after ``</think>``, LaTeX removed), for evaluation logs."""
    if not isinstance(solution_str, str):
        return None
    contents, _ = _hardened_boxes(solution_str)
    return contents[-1] if contents else None


def _eval_truths(ground_truth: Any) -> list[str]:
    truths = _truth_list(ground_truth)
    if truths is None:
        raise ValueError(f"ground_truth must be a non-blank string or a non-empty list of them, got {ground_truth!r}")
    return truths


def exact_match(prediction: str | None, ground_truth: str | list[str]) -> float:
    """SQuAD exact match, best over the ground truths; a missing prediction scores 0."""
    truths = _eval_truths(ground_truth)
    if prediction is None:
        return 0.0
    normalized = _squad_normalize(prediction)
    return float(any(normalized == _squad_normalize(truth) for truth in truths))


def token_f1(prediction: str | None, ground_truth: str | list[str]) -> float:
    """SQuAD token F1, best over the ground truths; a missing prediction scores 0."""
    truths = _eval_truths(ground_truth)
    if prediction is None:
        return 0.0
    tokens = _squad_normalize(prediction).split()
    return max(_f1(tokens, _squad_normalize(truth).split()) for truth in truths)


# --- custom reward functions ---------------------------------------------------------------------


def _import_function(path: Path, name: str) -> Callable[..., Any]:
    """Import ``name`` from the file at ``path``, failing with the path and name before training starts."""
    if not path.is_file():
        raise ValueError(f"reward function file not found: {path}")
    # A per-path module name registered in sys.modules lets the user's file use dataclasses and pickling.
    digest = hashlib.sha1(str(path.resolve()).encode(), usedforsecurity=False).hexdigest()
    module_name = f"longqa_custom_reward_{digest[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import reward function file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ValueError(f"importing reward function file {path} failed: {type(exc).__name__}: {exc}") from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"reward function file {path} has no function {name!r}")
    return function


def _as_result(value: Any) -> RewardResult:
    """Accept what verl accepts from a reward function: a number, or a dict with a ``"score"``."""
    if isinstance(value, dict):
        value = value.get("score")
    if not isinstance(value, numbers.Real):
        return _fail("error:not_a_number")
    score = float(value)
    if not math.isfinite(score):
        return _fail("error:not_finite")
    return RewardResult(score)


def load_reward_function(path: str | os.PathLike[str], name: str = "compute_score") -> Callable[..., RewardResult]:
    """Wrap a user's verl-style reward function so it behaves like :func:`score_detailed`.

    A valid number comes back with reason None: longqa cannot know why a custom function scored as it
    did. Anything unusable (an exception, None, a string, NaN or inf) becomes 0 with an ``error:`` reason.
    """
    function = _import_function(Path(path), name)

    def score(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None,
              mode: str | None = None, **kwargs: Any) -> RewardResult:
        """``mode`` is accepted and ignored, so callers can swap this for score_detailed."""
        try:
            return _as_result(function(data_source=data_source, solution_str=solution_str,
                                       ground_truth=ground_truth, extra_info=extra_info, **kwargs))
        except Exception as exc:  # noqa: BLE001 - a user's bug must cost one sample, not the run
            return _fail(f"error:{type(exc).__name__}")

    return score
