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
    3. Several boxes in the answer part must all name the same answer (equal in one reading, below);
       otherwise it is hedging: 0.
    4. Words are compared after normalisation: the benchmarks' own (SQuAD's, HotpotQA's and LongBench's
       ``normalize_answer``: lower case, punctuation removed, the articles a/an/the dropped, whitespace
       collapsed; the articles stay when nothing else is left, so the answer "A" still works), plus NFKC,
       case folding, accents removed and Unicode punctuation and symbols removed, on both sides. Numbers
       keep what gives their value, where the benchmarks' normalisation runs "3.5" and "35" together: a
       decimal point, a minus sign, a time's colon, a fraction's slash, a range's dash, a percent sign
       ("50 percent" is "50%"); a decimal is written one way ("3.50" and "3.5", ".5" and "0.5", "3500.0"
       and "3500"). A date's or version's separators count as one ("12.05.1990" is "12/05/1990"), and a
       date with a month's name reads day first ("July 4, 1776" is "4 July 1776"); thousands separators
       and a plus sign carry no value ("+1,000" is "1000"). LaTeX in a box reads as its text:
       ``\text{Paris}`` is "Paris", ``\frac{1}{2}`` is "1/2", ``\pi`` is "π", ``Fran\c{c}ois`` is "François".
       An answer has two readings: joined, punctuation removed as the benchmarks do ("X-Men" is "xmen",
       "AT&T" is "att"), and separated, where a dash is a space, "&" is "and" and "/" is "or"
       ("Saint-Étienne" is "saint etienne", "Paris & London" is "paris and london"). An empty
       prediction scores 0.
    5. Against each ground truth (the best one counts), the prediction scores 1.0 when, in either reading,
       it equals the answer, and 0 otherwise: exact match, as the benchmarks score it, but for numbers
       (where the benchmarks' normalisation matches two answers without digits, this does too). A
       fragment ("World War" for "World War II", "Van Houten" for "Milhouse Van Houten") and an answer
       with more words ("Paris, France" or "Paris London Rome" for "Paris", "less than 13" for "13") score
       0: a string rule cannot tell a qualifier from a second candidate, or a shortened name from one
       that covers several answers, and any such allowance is a way to hedge that a policy learns. With
       exact match, naming the one most likely answer is always the best a policy can do.

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
    "ENVIRONMENT_VARIABLES",
    "REWARD_MODES",
    "RewardResult",
    "compute_score",
    "exact_match",
    "extract_answer",
    "load_reward_function",
    "normalize_answer",
    "overlap_f1",
    "score_detailed",
    "token_f1",
    "validate_mode",
]

DEFAULT_MODE = "hardened"
MODE_ENV = "REWARD_CALC_TYPE"
# The recipe's knobs, read from the environment each time its modes score, with their defaults.
RECIPE_ENV_DEFAULTS = {
    "MAX_BOXED_LIMIT": 1,
    "PUNISH_MULTIPLE_BRACES": 1,
    "ANSWER_OVER_FLOW_LIMIT": 128,
    "EOT_OVER_FLOW_LIMIT": 32,
    "F1_SCORE_THRESHOLD": 0.5,
}
# Every environment variable this file reads when it scores (the recipe's reward file reads the same ones). A run
# whose processes start elsewhere (Ray workers) takes them from the driver's environment, or it would score with
# other values than the ones it was started with.
ENVIRONMENT_VARIABLES: tuple[str, ...] = (MODE_ENV, *RECIPE_ENV_DEFAULTS)
# Words that make an answer with the ground truth in it a hedge rather than a wordy answer (a failure reason only:
# either scores 0).
HEDGE_WORDS = frozenset(
    {"or", "and", "nor", "either", "neither", "not", "no", "maybe", "perhaps", "possibly", "probably"}
)
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

_RECIPE_SPECIAL = ",.:\"'[]-=+\\|!@#$%^&*();<>?/！￥…（）—{}：“”《》？"
_RECIPE_TABLE = str.maketrans({ch: " " for ch in _RECIPE_SPECIAL})
# The recipe's normalisation then deletes an `import X as Y` line (a leftover of its code-task origins), after its
# punctuation became spaces, so a dotted module no longer matches; kept so that its modes score as it does.
_RECIPE_IMPORT = re.compile(r"import\s[a-zA-Z.]+(\sas\s[a-zA-Z.]+)\n")
_SQUAD_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ASCII_PUNCT_REMOVAL = str.maketrans("", "", string.punctuation)
# Number punctuation is carried through normalisation as private-use characters (neither punctuation nor
# symbols, so the removal of those passes them by) and written back at the end.
_STAND_IN = {".": "\ue000", ":": "\ue001", "/": "\ue002", "-": "\ue003", "%": "\ue004"}
_STAND_IN_RESTORE = str.maketrans({stand_in: mark for mark, stand_in in _STAND_IN.items()})
_STAND_IN_REMOVAL = str.maketrans({stand_in: None for stand_in in _STAND_IN.values()})
_DASHES = "-\u2010\u2011\u2012\u2013\u2014\u2015\u2212"  # hyphens, figure/en/em dashes, minus sign
_DIGIT_MARKS = {
    ".": _STAND_IN["."],
    ":": _STAND_IN[":"],
    "/": _STAND_IN["/"],
    "\u2044": _STAND_IN["/"],
    **{dash: _STAND_IN["-"] for dash in _DASHES},
}
_DIGIT = re.compile(r"\d")
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_BETWEEN_DIGITS = re.compile(r"(?<=\d)[^\w\s](?=\d)")
_SIGN = re.compile(rf"(?<!\w)[{_DASHES}](?=\.?\d)")
_LEADING_POINT = re.compile(r"(?<!\w)\.(?=\d)")
_PERCENT = re.compile(r"(?<=\d)\s*(?:%|percent\b|per\s+cent\b)")
# Possessive digit runs that start a run: linear in a long string of digits (backtracking was quadratic).
_DATE = re.compile(f"(?<!\\d)\\d++([{_STAND_IN['.']}{_STAND_IN['/']}{_STAND_IN['-']}])\\d++(?:\\1\\d++)+")
_NUMBER_MARKS = "".join(_STAND_IN.values())
_DECIMAL = re.compile(
    f"(?<![\\w{_NUMBER_MARKS}])({_STAND_IN['-']}?)(\\d*+){_STAND_IN['.']}(\\d++)"
    f"(?![\\w{_NUMBER_MARKS.replace(_STAND_IN['%'], '')}])"
)  # a percent may follow
_NEGATIVE_ZERO = re.compile(f"(?<![\\w{_NUMBER_MARKS}]){_STAND_IN['-']}(?=0++(?![\\w{_NUMBER_MARKS}]))")
_MONTHS = (
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
)
_MONTH_NAMES = {**{name: name for name in _MONTHS}, **{name[:3]: name for name in _MONTHS}, "sept": "september"}
_MONTH = "|".join(sorted(_MONTH_NAMES, key=len, reverse=True))
_DAY = r"(\d{1,2})(?:st|nd|rd|th)?"
_MONTH_FIRST = re.compile(rf"\b({_MONTH})\.?\s+{_DAY}\b(?:\s*,)?(\s+\d{{1,4}}\b)?")
_DAY_FIRST = re.compile(rf"\b{_DAY}\s+(?:of\s+)?({_MONTH})\b\.?(?:\s*,)?(\s+\d{{1,4}}\b)?")
_SEPARATORS = re.compile(f"[{_DASHES}&/]")
_SEPARATOR_WORDS = {"&": " and ", "/": " or "}
_BRACE = re.compile(r"[{}]")
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_LATEX_SPACE = re.compile(r"\\\\|\\[,;:! ]|(?<!\\)~")  # a line break, spacing commands, a tie (not the accent \~)
_LATEX_FRACTION = re.compile(r"\\[dt]?frac\s*")
_LATEX_ACCENT = re.compile(r"\\(?:[\'\"`^~=.]|[cvuHkrdb](?![A-Za-z]))\s*(?:\{(\w*)\}|(\w))")
_LATEX_COMMAND = re.compile(r"\\([A-Za-z]+)\s*(\{)?")
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


def _truth_text(truth: Any) -> str | None:
    """A ground truth as text: a string, or a finite number written as Python writes it (42, 3.5; 5.0 is "5").
    A bool is no number here: ``True`` as an answer is a data bug, not "1"."""
    if isinstance(truth, str):
        return truth
    if isinstance(truth, numbers.Real) and not isinstance(truth, bool) and math.isfinite(truth):
        return str(int(truth)) if float(truth).is_integer() else repr(float(truth))
    return None


def _truth_list(ground_truth: Any) -> list[str] | None:
    """Accept what verl passes (a str, a list, or a numpy array after a parquet round trip) and what a Python
    caller may (a number, a list of them), or None.

    The rule matches the data schema, plus numbers: a non-blank answer or a non-empty list of them. A blank
    truth would be a substring of every prediction, so it is refused rather than rewarded.
    """
    if hasattr(ground_truth, "tolist"):  # numpy arrays and scalars
        ground_truth = ground_truth.tolist()
    if not isinstance(ground_truth, (list, tuple)):
        ground_truth = [ground_truth]
    truths = [_truth_text(truth) for truth in ground_truth]
    if not truths or not all(truth and truth.strip() for truth in truths):
        return None
    return truths


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


def normalize_answer(text: str) -> str:
    """The benchmarks' answer normalisation (SQuAD v1.1, HotpotQA, LongBench): lower case, ASCII punctuation
    removed, the articles a/an/the replaced by spaces, whitespace collapsed, in that order. Kept exact so
    EM/F1 numbers compare with published ones; it reads "3.5" as "35", which is why the hardened mode
    does not compare with it alone."""
    text = text.lower().translate(_ASCII_PUNCT_REMOVAL)
    return " ".join(_SQUAD_ARTICLES.sub(" ", text).split())


def overlap_f1(prediction_tokens: list[str], truth_tokens: list[str]) -> float:
    """The benchmarks' token F1: overlap counted as a multiset; no token in common (or none at all) is 0."""
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


def _env_int(name: str) -> int:
    return int(os.getenv(name, RECIPE_ENV_DEFAULTS[name]))


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
    return solution[start + len("\\boxed{") : end], None


def _recipe_normalize(text: str) -> str:
    return " ".join(_RECIPE_IMPORT.sub(" ", text.lower().translate(_RECIPE_TABLE)).split())


def _recipe_is_match(prediction: str, truth: str) -> bool:
    """Two-way substring: the reason an empty prediction, or any fragment of the answer, matches."""
    prediction, truth = _recipe_normalize(prediction), _recipe_normalize(truth)
    return truth in prediction or prediction in truth


def _recipe_gated_prediction(solution: str) -> tuple[str | None, str | None]:
    """The format modes' prediction, after the box-count and brace gates that zero a response."""
    max_boxed = _env_int("MAX_BOXED_LIMIT")
    if max_boxed > 0 and solution.count("\\boxed") > max_boxed:
        return None, "too_many_boxed"
    prediction, reason = _recipe_prediction(solution)
    if prediction is None:
        return None, reason
    if _env_int("PUNISH_MULTIPLE_BRACES") > 0 and (
        prediction.count("{") > 1 or prediction.count("}") > 1 or prediction.count("\\") > 1
    ):
        return None, "multiple_braces"
    return prediction, None


def _recipe_overflow(solution: str, prediction: str, truth: str) -> str | None:
    """Why the recipe voids a match: too long an answer, or too much text after it."""
    if len(prediction) - len(truth) > _env_int("ANSWER_OVER_FLOW_LIMIT"):
        return "answer_overflow"
    tail = len(solution) - (solution.rfind(prediction) + len(prediction))
    if tail > _env_int("EOT_OVER_FLOW_LIMIT"):
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
    threshold = float(os.getenv("F1_SCORE_THRESHOLD", RECIPE_ENV_DEFAULTS["F1_SCORE_THRESHOLD"]))
    tokens = normalize_answer(prediction).split()
    results = []
    for truth in truths:
        f1 = overlap_f1(tokens, normalize_answer(truth).split())
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
        contents.append(text[match.end() : end])
        position = end + 1
    return contents


def _latex_argument(text: str, start: int) -> tuple[str, int] | None:
    """A command's argument at ``start`` (spaces skipped): a braced group's content or one character, with
    the index after it; None when there is none."""
    while start < len(text) and text[start].isspace():
        start += 1
    if start >= len(text) or text[start] == "}":
        return None
    if text[start] != "{":
        return text[start], start + 1
    end = _balanced_end(text, start)
    return (text[start + 1 : end], end + 1) if end is not None else None


def _fractions(text: str) -> str:
    r"""``\frac{a}{b}`` (also ``\dfrac``, ``\tfrac``, ``\frac12``) as "a/b", nested ones included; one pass, so
    a box of many fractions costs linear time."""
    pieces, position = [], 0
    while match := _LATEX_FRACTION.search(text, position):
        pieces.append(text[position : match.start()])
        numerator = _latex_argument(text, match.end())
        denominator = numerator and _latex_argument(text, numerator[1])
        if not denominator:  # a fraction without its arguments: drop the command
            pieces.append(" ")
            position = match.end()
            continue
        pieces.append(f"{_fractions(numerator[0])}/{_fractions(denominator[0])}")
        position = denominator[1]
    return "".join(pieces) + text[position:]


def _latex_symbol(name: str) -> str:
    r"""A command without an argument: a Greek letter as itself (``\pi`` is "π"), anything else (spacing,
    ``\left``, ``\displaystyle``) a space."""
    for case in ("SMALL", "CAPITAL"):
        try:
            letter = unicodedata.lookup(f"GREEK {case} LETTER {name.upper()}")
        except KeyError:
            continue
        if (case == "SMALL") == name[0].islower():
            return letter
    return " "


def _unlatex(text: str) -> str:
    r"""Plain text of a box, as LaTeX would print it: ``\text{Paris}`` is "Paris" and ``P\text{aris}`` "Paris"
    (a command's braced argument continues the text), ``\frac{1}{2}`` is "1/2", ``\pi`` is "π",
    ``Fran\c{c}ois`` is "Francois" (accents go later anyway), ``AT\&T`` is "AT&T", ``~``, ``\,`` and
    ``\\`` are spaces."""
    text = _LATEX_SPACE.sub(" ", text)
    text = _fractions(text)
    text = _LATEX_ACCENT.sub(lambda match: match.group(1) or match.group(2) or "", text)
    text = _LATEX_COMMAND.sub(lambda match: "" if match.group(2) else _latex_symbol(match.group(1)), text)
    text = _LATEX_ESCAPE.sub(r"\1", text)
    return " ".join(text.replace("{", "").replace("}", "").split())


def _protect_numbers(text: str) -> str:
    """``text`` with the punctuation that is part of a number's value replaced by stand-ins that no later
    step removes: a decimal point ("3.5", ".5"), a minus sign ("-5"), a colon ("10:30"), a slash ("1/2"),
    a dash between digits ("1990-1995"), a percent sign ("50%", "50 percent"). A date or version with one
    separator used twice or more ("12.05.1990", "12-05-1990") takes "/" throughout, as its value does not
    depend on which. Thousands separators ("1,000") are dropped: they carry no value. Any other
    punctuation between digits ("1,5", "1+1") becomes a space, so digits never run together."""
    text = text.translate(_STAND_IN_REMOVAL)
    if not _DIGIT.search(text):
        return text
    text = _THOUSANDS_COMMA.sub("", text)
    text = _BETWEEN_DIGITS.sub(lambda match: _DIGIT_MARKS.get(match.group(), " "), text)
    text = _SIGN.sub(_STAND_IN["-"], text)
    text = _LEADING_POINT.sub(_STAND_IN["."], text)
    text = _PERCENT.sub(_STAND_IN["%"], text)
    text = _DATE.sub(lambda match: match.group().replace(match.group(1), _STAND_IN["/"]), text)
    text = _DECIMAL.sub(_canonical_decimal, text)
    return _NEGATIVE_ZERO.sub("", text)


def _canonical_decimal(match: re.Match) -> str:
    """One spelling per decimal value: no trailing zeros after the point, a zero before it ("3.50" and
    "3.5", ".5" and "0.5", "3500.0" and "3500"), no sign on zero. Integers keep their leading zeros: "007"
    is a name, not 7."""
    sign, whole, fraction = match.groups()
    whole, fraction = whole or "0", fraction.rstrip("0")
    if not fraction and not whole.strip("0"):
        return "0"
    return sign + whole + (_STAND_IN["."] + fraction if fraction else "")


def _day_first_dates(text: str) -> str:
    """Dates with a month's name, day first ("July 4, 1776" and "4th of July 1776" are "4 july 1776"), so the
    order a style guide picks does not decide the score. ``text`` is case-folded."""

    def day_first(day: str, month: str, year: str | None) -> str:
        return f"{int(day)} {_MONTH_NAMES[month]}{' ' + year.strip() if year else ''}"

    text = _MONTH_FIRST.sub(lambda match: day_first(match.group(2), match.group(1), match.group(3)), text)
    return _DAY_FIRST.sub(lambda match: day_first(match.group(1), match.group(2), match.group(3)), text)


class _FoldTable(dict):
    """``str.translate`` table of :func:`_fold`, filled once per character met: one lookup per character
    instead of a Python loop, which a megabyte-long box would feel. Decomposing character by character is
    NFKD but for the order of combining marks, and those are dropped."""

    def __missing__(self, code: int) -> str:
        kept = "".join(
            ch
            for ch in unicodedata.normalize("NFKD", chr(code))
            if not unicodedata.combining(ch) and unicodedata.category(ch)[0] not in "PS"
        )
        self[code] = kept
        return kept


_FOLD_TABLE = _FoldTable(_STAND_IN_RESTORE)


def _fold(text: str) -> str:
    """Accents, and Unicode punctuation and symbols, removed; the number stand-ins written back."""
    return text.translate(_FOLD_TABLE)


def _words(text: str) -> tuple[str, ...]:
    """:func:`normalize_answer` of a protected text, then :func:`_fold`: the articles go before the Unicode
    punctuation, as the benchmarks do it, so two answers they normalise alike stay alike here. An answer
    of articles only ("A", "The The") keeps them rather than becoming empty."""
    return tuple(_fold(normalize_answer(text)).split() or _fold(text).split())


def _readings(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """An answer's two readings as words: (joined, separated).

    Joined reads punctuation as the benchmarks do, by removing it ("X-Men" is "xmen", "AT&T" is "att").
    Separated reads the marks that stand between words as what they say: a dash as a space
    ("Saint-Étienne" is "saint etienne"), "&" as "and", "/" as "or", so a list written with them is a list
    in both directions ("Paris & London" hedges like "Paris and London"). Both keep numbers whole.
    """
    text = _protect_numbers(_day_first_dates(unicodedata.normalize("NFKC", text).casefold()))
    separated = _SEPARATORS.sub(lambda match: _SEPARATOR_WORDS.get(match.group(), " "), text)
    return _words(text), _words(separated)


def _contains_run(words: tuple[str, ...], run: tuple[str, ...]) -> bool:
    """Whether ``run`` occurs in ``words`` as contiguous whole words (a string search, so it is fast)."""
    return f" {' '.join(run)} " in f" {' '.join(words)} "


def _failure(prediction: tuple[str, ...], truth: tuple[str, ...]) -> str:
    """Why a prediction that is not the answer failed: the answer with a hedge word beside it, the answer
    with other words, or something else."""
    if len(prediction) > len(truth) and _contains_run(prediction, truth):
        return (
            "multiple_answers" if HEDGE_WORDS.intersection(Counter(prediction) - Counter(truth)) else "answer_overflow"
        )
    return "wrong"


def _hardened_match(prediction: tuple[tuple[str, ...], ...], truth: tuple[tuple[str, ...], ...]) -> str | None:
    """None when the prediction equals the answer in either reading (see :func:`_readings`); otherwise the
    failure reason."""
    if any(ours == theirs for ours, theirs in zip(prediction, truth)):
        return None
    return min(map(_failure, prediction, truth), key=_FAILURE_ORDER.index)


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
    readings = [_readings(content) for content in contents]
    if all(len(set(reading)) > 1 for reading in zip(*readings)):
        return _fail("multiple_answers")
    prediction = readings[-1]
    if not prediction[0]:
        return _fail("empty_answer")
    truth_readings = [reading for reading in map(_readings, truths) if reading[0]]
    if not truth_readings:
        return _fail("bad_ground_truth")
    results = []
    for truth in truth_readings:
        failure = _hardened_match(prediction, truth)
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


def score_detailed(
    data_source: Any,
    solution_str: Any,
    ground_truth: Any,
    extra_info: Any = None,
    mode: str | None = None,
    **kwargs: Any,
) -> RewardResult:
    """Score one response with the reason for any shortfall; never raises, so one odd sample can't stop training."""
    try:
        return _score(solution_str, ground_truth, mode)
    except Exception as exc:  # noqa: BLE001 - a reward crash must cost one sample, not the run
        return _fail(f"error:{type(exc).__name__}")


def compute_score(
    data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> float:
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
        raise ValueError(
            f"ground_truth must be a non-blank string or a finite number, or a non-empty list of them, "
            f"got {ground_truth!r}"
        )
    return truths


def exact_match(prediction: str | None, ground_truth: str | list[str]) -> float:
    """SQuAD exact match, best over the ground truths; a missing prediction scores 0."""
    truths = _eval_truths(ground_truth)
    if prediction is None:
        return 0.0
    normalized = normalize_answer(prediction)
    return float(any(normalized == normalize_answer(truth) for truth in truths))


def token_f1(prediction: str | None, ground_truth: str | list[str]) -> float:
    """SQuAD token F1, best over the ground truths; a missing prediction scores 0."""
    truths = _eval_truths(ground_truth)
    if prediction is None:
        return 0.0
    tokens = normalize_answer(prediction).split()
    return max(overlap_f1(tokens, normalize_answer(truth).split()) for truth in truths)


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
    did. Anything unusable (an exception, None, a string, NaN or inf) becomes 0 with an ``error:`` reason;
    the wrapper's ``last_error`` keeps the latest exception's text, for a caller to show.
    """
    function = _import_function(Path(path), name)

    def score(
        data_source: Any,
        solution_str: Any,
        ground_truth: Any,
        extra_info: Any = None,
        mode: str | None = None,
        **kwargs: Any,
    ) -> RewardResult:
        """``mode`` is accepted and ignored, so callers can swap this for score_detailed."""
        try:
            return _as_result(
                function(
                    data_source=data_source,
                    solution_str=solution_str,
                    ground_truth=ground_truth,
                    extra_info=extra_info,
                    **kwargs,
                )
            )
        except Exception as exc:  # noqa: BLE001 - a user's bug must cost one sample, not the run
            score.last_error = f"{type(exc).__name__}: {exc}"
            return _fail(f"error:{type(exc).__name__}")

    score.last_error = None
    return score
