r"""The hardened reward's answer normalisation against the benchmarks' own (HotpotQA's hotpot_evaluate_v1.py and
LongBench's metrics.py share one ``normalize_answer``, written out again below). Wherever theirs says two answers
without digits match, the reward matches them; for numbers, which theirs runs together ("3.5" and "35" both
become "35"), the reward keeps apart exactly the answers that differ in value."""

from __future__ import annotations

import random
import re
import string
from fractions import Fraction
from itertools import product

import pytest

from longqa.reward import RewardResult, score_detailed


def official_normalize(s: str) -> str:
    """HotpotQA's hotpot_evaluate_v1.py ``normalize_answer``, line for line (LongBench's metrics.py has the same)."""

    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


def result(answer: str, gold: str | list[str]) -> RewardResult:
    return score_detailed("hotpotqa", f"<think>Reading the passages.</think> The answer is \\boxed{{{answer}}}", gold)


def reward(answer: str, gold: str) -> float:
    return result(answer, gold).score


def official_pairs(texts: list[str]) -> list[tuple[str, str]]:
    """Ordered pairs of different texts that the benchmarks normalise alike, leaving out those they normalise
    to no word at all ("The" and "A" both become ""): the reward refuses an empty answer on purpose."""
    return [
        (a, b)
        for a, b in product(texts, repeat=2)
        if a != b and official_normalize(a) == official_normalize(b) and re.search(r"\w", official_normalize(a))
    ]


# --- answers without digits: the benchmarks' matches are kept --------------------------------------------

NAMES = [
    "Saint-Étienne",
    "Saint Etienne",
    "saint-etienne",
    "SAINT ÉTIENNE",
    "Saint-Etienne!",
    "SaintEtienne",
    "Milhouse Van Houten",
    "milhouse van houten.",
    "Milhouse Van-Houten",
    "Milhouse VanHouten",
    "The Beatles",
    "Beatles",
    "the beatles!",
    "Beatles, The",
    "A Tribe Called Quest",
    "Tribe Called Quest",
    "AT&T",
    "AT & T",
    "ATT",
    "AT and T",
    "A.T.&T.",
    "Simon & Garfunkel",
    "Simon and Garfunkel",
    "Simon Garfunkel",
    "Simon, Garfunkel",
    "simon & garfunkel.",
    "Paris & London",
    "Paris and London",
    "Paris London",
    "Paris, London",
    "Paris/London",
    "Paris",
    "London",
    "J.R.R. Tolkien",
    "JRR Tolkien",
    "J. R. R. Tolkien",
    "J R R Tolkien",
    "O'Brien",
    "OBrien",
    "O’Brien",
    "X-Men",
    "XMen",
    "X Men",
    "AC/DC",
    "ACDC",
    "AC-DC",
    "U.S.",
    "US",
    "the U.S.",
    "U.S.A.",
    "USA",
    "Beyoncé",
    "Beyonce",
    "Beyoncé!",
    "Mötley Crüe",
    "Motley Crue",
    "Jean-Paul Sartre",
    "Jean Paul Sartre",
    "JeanPaul Sartre",
    "Jean-Paul",
    "Sartre",
    "Ireland's",
    "Irelands",
    "Guns N' Roses",
    "Guns N Roses",
    "Guns 'N' Roses",
    "Guns & Roses",
    "Dr. Jekyll and Mr. Hyde",
    "Dr Jekyll and Mr Hyde",
    "Dr. Jekyll & Mr. Hyde",
    "Dr Jekyll Mr Hyde",
    "an apple",
    "apple",
    "Apple!",
    "The Return of the King",
    "Return of the King",
    "(The) Return of the King",
    "the Who",
    "Who?",
    '"Who"',
    "The The",
    "Rock 'n' roll",
    "rock n roll",
    "rock-n-roll",
]


def test_names_and_lists_the_benchmarks_match_score_full():
    assert not any(re.search(r"\d", name) for name in NAMES)  # numbers have their own rule, below
    pairs = official_pairs(NAMES)
    assert len(pairs) > 100  # the list has many spellings of each answer
    assert [(a, b) for a, b in pairs if reward(a, b) != 1.0] == []


# Marks that are LaTeX inside a box (a group, a command, a tie) are not answer text and are not inserted.
INSERTED_MARKS = "".join(mark for mark in string.punctuation if mark not in "{}\\~")


def edited(text: str, rng: random.Random) -> str:
    """``text`` with edits that the benchmarks' normalisation undoes: case, punctuation anywhere, articles
    and spaces between words."""
    chars = [ch.upper() if rng.random() < 0.3 else ch for ch in text]
    for _ in range(rng.randint(0, 3)):
        chars.insert(rng.randint(0, len(chars)), rng.choice(INSERTED_MARKS))
    words = "".join(chars).split(" ")
    for _ in range(rng.randint(0, 2)):
        words.insert(rng.randint(0, len(words)), rng.choice(["the", "a", "an", "The", ""]))
    return " ".join(words)


def test_random_spellings_the_benchmarks_match_score_full():
    rng = random.Random(0)
    pairs = [(edited(name, rng), edited(name, rng)) for name in NAMES for _ in range(25)]
    pairs = [
        (a, b)
        for a, b in pairs
        if a != b and official_normalize(a) == official_normalize(b) and re.search(r"\w", official_normalize(a))
    ]
    assert len(pairs) > 1000
    assert [(a, b) for a, b in pairs if reward(a, b) != 1.0] == []


@pytest.mark.parametrize(
    "answer, gold",
    [
        ("Beyoncé", "Beyonce"),
        ("Beyonce", "Beyoncé"),
        ("Mötley Crüe", "Motley Crue"),
        ("Motley Crue", "Mötley Crüe"),
        ("Saint-Étienne", "Saint-Etienne"),
        ("Dvořák", "Dvorak"),
        ("Ångström", "Angstrom"),
        ("Zürich", "ZURICH"),
    ],
)
def test_accents_are_folded_on_both_sides(answer, gold):
    assert reward(answer, gold) == 1.0


@pytest.mark.parametrize(
    "answer, gold",
    [
        ("Saint-Étienne", "Saint Etienne"),
        ("Saint Etienne", "Saint-Étienne"),
        ("SAINT–ÉTIENNE", "saint etienne"),
        ("SaintEtienne", "Saint-Étienne"),  # as the benchmarks read it
        ("X Men", "X-Men"),
        ("XMen", "X-Men"),
        ("Jean Paul Sartre", "Jean-Paul Sartre"),
    ],
)
def test_a_dash_between_words_joins_them_or_separates_them(answer, gold):
    assert reward(answer, gold) == 1.0


@pytest.mark.parametrize(
    "answer, gold, expected",
    [
        ("Simon & Garfunkel", "Simon and Garfunkel", RewardResult(1.0)),
        ("Simon and Garfunkel", "Simon & Garfunkel", RewardResult(1.0)),
        ("Simon Garfunkel", "Simon & Garfunkel", RewardResult(1.0)),  # the benchmarks drop the "&"
        ("Simon & Garfunkel", "Simon Garfunkel", RewardResult(1.0)),
        ("AT and T", "AT&T", RewardResult(1.0)),
        ("Paris & London", "Paris and London", RewardResult(1.0)),
        # a second candidate joined by "&" is the same hedge as one joined by "and"
        ("Paris & London", "Paris", RewardResult(0.0, "multiple_answers")),
        ("Paris and London", "Paris", RewardResult(0.0, "multiple_answers")),
        ("Paris & London & Berlin", "Berlin", RewardResult(0.0, "multiple_answers")),
        ("Paris / London", "Paris", RewardResult(0.0, "multiple_answers")),
        ("Garfunkel", "Simon & Garfunkel", RewardResult(0.0, "wrong")),
    ],
)
def test_ampersand_and_and_are_one_word_in_lists(answer, gold, expected):
    assert result(answer, gold) == expected


# --- numbers: apart exactly when their values differ --------------------------------------------------------


def time(hours: int, minutes: int) -> tuple:
    return ("time", hours, minutes)


def date(*parts: int) -> tuple:
    return ("date", *parts)


def span(first: int, last: int) -> tuple:
    return ("span", first, last)


def percent(amount: str) -> tuple:
    return ("percent", Fraction(amount))


def ordinal(n: int) -> tuple:
    return ("ordinal", n)


def decade(year: int) -> tuple:
    return ("decade", year)


N = Fraction

# Each answer with the value it states, written by hand. A percentage, a time, a date, a span (a range or a
# score), an ordinal and a decade are values of their own kind: "50%" is not the answer "0.5", nor "1:30" "90".
NUMBER_CLASSES: dict[str, list[tuple[str, object]]] = {
    "decimals": [
        ("3.5", N("3.5")),
        ("35", N(35)),
        ("3.5.", N("3.5")),
        ("3.50", N("3.5")),
        ("350", N(350)),
        (".5", N("0.5")),
        ("0.5", N("0.5")),
        ("05", N(5)),
        ("5", N(5)),
        ("0.35", N("0.35")),
        ("035", N(35)),
        ("3.05", N("3.05")),
        ("30.5", N("30.5")),
        ("305", N(305)),
    ],
    "signs": [
        ("-5", N(-5)),
        ("5", N(5)),
        ("+5", N(5)),
        ("(-5)", N(-5)),
        ("\u22125", N(-5)),
        ("\u20135", N(-5)),
        ("-5.5", N("-5.5")),
        ("5.5", N("5.5")),
        ("55", N(55)),
        ("-55", N(-55)),
        ("-.5", N("-0.5")),
        ("minus 5", N(-5)),
        ("500 BC", N(-500)),
        ("500", N(500)),
    ],
    "times": [
        ("10:30", time(10, 30)),
        ("10:30.", time(10, 30)),
        ("1030", N(1030)),
        ("1:30", time(1, 30)),
        ("130", N(130)),
        ("12:45", time(12, 45)),
        ("1245", N(1245)),
        ("1:245", ("ratio", 1, 245)),
    ],
    "magnitudes": [
        ("2.5 million", N(2_500_000)),
        ("25 million", N(25_000_000)),
        ("$2.5 million", N(2_500_000)),
        ("2.5 Million", N(2_500_000)),
        ("2.5 billion", N(2_500_000_000)),
        ("2,500,000", N(2_500_000)),
        ("2500000", N(2_500_000)),
        ("2.5", N("2.5")),
        ("25", N(25)),
        ("2.5m", N(2_500_000)),
        ("25m", N(25_000_000)),
        ("5 million", N(5_000_000)),
        ("5", N(5)),
        ("5 thousand", N(5000)),
    ],
    "thousands separators": [
        ("1,000", N(1000)),
        ("1000", N(1000)),
        ("1.000", N(1)),
        ("1,000,000", N(10**6)),
        ("1000000", N(10**6)),
        ("10,000", N(10**4)),
        ("10000", N(10**4)),
        ("12,345", N(12345)),
        ("12345", N(12345)),
        ("123.45", N("123.45")),
        ("1,234.5", N("1234.5")),
        ("1234.5", N("1234.5")),
        ("12345.", N(12345)),
    ],
    "percentages": [
        ("50%", percent("50")),
        ("50 %", percent("50")),
        ("50 percent", percent("50")),
        ("50 per cent", percent("50")),
        ("50", N(50)),
        ("5.0%", percent("5")),
        ("5%", percent("5")),
        ("50.5%", percent("50.5")),
        ("505%", percent("505")),
        ("-5%", percent("-5")),
    ],
    "ordinals": [
        ("21st", ordinal(21)),
        ("21st.", ordinal(21)),
        ("the 21st", ordinal(21)),
        ("21", N(21)),
        ("2nd", ordinal(2)),
        ("12th", ordinal(12)),
        ("1st", ordinal(1)),
        ("1", N(1)),
    ],
    "dates": [
        ("12/05/1990", date(12, 5, 1990)),
        ("12-05-1990", date(12, 5, 1990)),
        ("12.05.1990", date(12, 5, 1990)),
        ("12051990", N(12051990)),
        ("1990-05-12", date(1990, 5, 12)),
        ("1990/05/12", date(1990, 5, 12)),
        ("19900512", N(19900512)),
        ("5/12/1990", date(5, 12, 1990)),
        ("1990s", decade(1990)),
        ("1990's", decade(1990)),
        ("the 1990s", decade(1990)),
        ("1990", N(1990)),
        ("1990.", N(1990)),
    ],
    "ranges and scores": [
        ("1990-1995", span(1990, 1995)),
        ("1990\u20131995", span(1990, 1995)),
        ("1990\u20141995", span(1990, 1995)),
        ("19901995", N(19901995)),
        ("2-1", span(2, 1)),
        ("2\u20131", span(2, 1)),
        ("21", N(21)),
        ("1-2", span(1, 2)),
        ("12", N(12)),
    ],
    "fractions": [
        ("1/2", N(1, 2)),
        ("\u00bd", N(1, 2)),
        ("12", N(12)),
        ("3/4", N(3, 4)),
        ("34", N(34)),
        ("0.5", N(1, 2)),
    ],
}
ALL_NUMBERS = sorted({item for items in NUMBER_CLASSES.values() for item in items}, key=str)


def number_mistakes(items: list[tuple[str, object]]) -> list[tuple[str, str, float]]:
    """Pairs scored against their values: full credit for a different value, or no credit for the same value
    written in a way the benchmarks normalise alike."""
    mistakes = []
    for (answer, value), (gold, gold_value) in product(items, repeat=2):
        score = reward(answer, gold)
        same = official_normalize(answer) == official_normalize(gold)
        if (value != gold_value and score != 0.0) or (value == gold_value and same and score != 1.0):
            mistakes.append((answer, gold, score))
    return mistakes


@pytest.mark.parametrize("name", NUMBER_CLASSES)
def test_numbers_match_exactly_when_their_values_are_equal(name):
    assert number_mistakes(NUMBER_CLASSES[name]) == []


def test_numbers_of_different_classes_stay_apart():
    assert number_mistakes(ALL_NUMBERS) == []


@pytest.mark.parametrize("name", [name for name in NUMBER_CLASSES if name != "ordinals"])
def test_the_benchmarks_run_numbers_of_each_class_together(name):
    """The classes bite: in each, the benchmarks' normalisation equates answers of different values (ordinals
    hold no punctuation to lose: that class checks they stay whole)."""
    items = NUMBER_CLASSES[name]
    assert any(
        value != other and official_normalize(a) == official_normalize(b)
        for (a, value), (b, other) in product(items, repeat=2)
    )


# --- what must stay at 0 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, gold, expected",
    [
        ("3.5", "35", RewardResult(0.0, "wrong")),
        ("-5", "5", RewardResult(0.0, "wrong")),
        ("2.5 million", "25 million", RewardResult(0.0, "wrong")),
        ("10:30", "1030", RewardResult(0.0, "wrong")),
        ("1,000", "1000", RewardResult(1.0)),
        ("Saint-Étienne", "Saint Etienne", RewardResult(1.0)),
        ("3.5 or 35", "35", RewardResult(0.0, "multiple_answers")),
        ("35, 3.5", "35", RewardResult(0.0, "answer_overflow")),  # a second number is a second candidate
        ("1990, 1995", "1990", RewardResult(0.0, "answer_overflow")),
        ("1990-1995", "1990", RewardResult(0.0, "wrong")),
        ("5 million", "5", RewardResult(0.0, "answer_overflow")),  # a magnitude is no qualifier
        ("million people", "2.5 million people", RewardResult(0.0, "wrong")),  # nor is a number left out
        ("March 1990", "5 March 1990", RewardResult(0.0, "wrong")),
        ("Paris-London", "Paris", RewardResult(0.0, "answer_overflow")),
        ("Paris/London", "Paris", RewardResult(0.0, "multiple_answers")),
        ("Jean-Paul", "Jean-Paul Sartre", RewardResult(0.0, "wrong")),  # a given name, like "Milhouse"
        ("J.R.R.", "J.R.R. Tolkien", RewardResult(0.0, "wrong")),
        ("&", "Paris", RewardResult(0.0, "empty_answer")),
        ("-", "Paris", RewardResult(0.0, "empty_answer")),
        ("%", "50%", RewardResult(0.0, "empty_answer")),
        # a word more or less is another answer: a unit, a qualifier, a part of a name
        ("5 km", "5", RewardResult(0.0, "answer_overflow")),
        ("about 5", "5", RewardResult(0.0, "answer_overflow")),
        ("over 13", "13", RewardResult(0.0, "answer_overflow")),
        ("2.5 million", "2.5 million people", RewardResult(0.0, "wrong")),
        ("Apollo 11", "Apollo 11 mission", RewardResult(0.0, "wrong")),
    ],
)
def test_number_and_list_exploits_stay_at_zero(answer, gold, expected):
    assert result(answer, gold) == expected


@pytest.mark.parametrize(
    "boxes, gold, expected",
    [
        (("3.5", "35"), "35", RewardResult(0.0, "multiple_answers")),
        (("-5", "5"), "5", RewardResult(0.0, "multiple_answers")),
        (("Saint-Étienne", "Saint Etienne"), "Saint Etienne", RewardResult(1.0)),
        (("1,000", "1000"), "1000", RewardResult(1.0)),
    ],
)
def test_boxes_agree_when_they_would_match_each_other(boxes, gold, expected):
    solution = "<think>Reading the passages.</think> " + " then ".join(f"\\boxed{{{box}}}" for box in boxes)
    assert score_detailed("hotpotqa", solution, gold) == expected


# --- exact match: no fragment, no second candidate, no qualifier ------------------------------------------

FRAGMENT_TRUTHS = [
    "World War II",
    "University of Oxford",
    "United States of America",
    "The Lord of the Rings",
    "Milhouse Van Houten",
    "July 4, 1776",
    "Bank of America",
    "2.5 million people",
]


def fragments(truth: str) -> list[str]:
    """Every proper contiguous run of the truth's words that is an answer of its own (not articles alone)."""
    words = truth.split()
    runs = {" ".join(words[i:j]) for i in range(len(words)) for j in range(i + 1, len(words) + 1)} - {truth}
    return sorted(run for run in runs if official_normalize(run) not in ("", official_normalize(truth)))


@pytest.mark.parametrize("truth", FRAGMENT_TRUTHS)
def test_no_fragment_of_an_answer_scores(truth):
    """A shorter answer can cover several ("World War" is I and II): the policy would learn to drop the word
    that decides."""
    assert {run: reward(run, truth) for run in fragments(truth)} == dict.fromkeys(fragments(truth), 0.0)


LIST_SEPARATORS = [
    " ",
    ", ",
    "; ",
    " | ",
    " / ",
    " \u2228 ",
    " \u2192 ",
    "\n",
    " vs ",
    " versus ",
    ", but ",
    ", else ",
    " or ",
    " and ",
    " & ",
    " then ",
    ", possibly ",
]


@pytest.mark.parametrize("separator", LIST_SEPARATORS, ids=repr)
def test_no_list_of_candidates_scores(separator):
    lists = [
        f"Paris{separator}London",
        f"London{separator}Paris",
        f"Paris{separator}London{separator}Rome",
        f"Rome{separator}Paris{separator}London",
        f"Paris{separator}etc",
    ]
    assert {answer: reward(answer, "Paris") for answer in lists} == dict.fromkeys(lists, 0.0)


@pytest.mark.parametrize(
    "qualifier",
    [
        "less than",
        "more than",
        "over",
        "under",
        "about",
        "at least",
        "at most",
        "nearly",
        "approximately",
        "not",
        "around",
    ],
)
def test_a_qualified_number_is_not_the_number(qualifier):
    assert reward(f"{qualifier} 13", "13") == 0.0


@pytest.mark.parametrize(
    "answer, gold, expected",
    [
        ("3.50", "3.5", 1.0),
        (".5", "0.5", 1.0),
        ("3500.0", "3500", 1.0),
        ("0", "0.0", 1.0),
        ("\u22120", "0", 1.0),
        ("-0.0", "0", 1.0),
        ("+3.500", "3.5", 1.0),
        ("3.05", "3.5", 0.0),
        ("30.5", "3.05", 0.0),
        ("007", "7", 0.0),
        ("-3.50", "3.5", 0.0),
        ("3.50%", "3.5%", 1.0),
        ("12.05.1990", "12.5.1990", 0.0),
    ],
)
def test_a_decimal_is_one_value_however_written(answer, gold, expected):
    """Trailing zeros after the point and a missing zero before it do not change a value; an integer's leading
    zeros stay ("007" is a name), and a date's parts are no decimals."""
    assert reward(answer, gold) == expected


@pytest.mark.parametrize(
    "answer, gold, expected",
    [
        ("July 4, 1776", "4 July 1776", 1.0),
        ("4th of July, 1776", "July 4, 1776", 1.0),
        ("Jul. 4, 1776", "4 July 1776", 1.0),
        ("March 05, 1990", "5 March 1990", 1.0),
        ("Sept 3", "3 September", 1.0),
        ("July 5, 1776", "4 July 1776", 0.0),
        ("July 4, 1777", "4 July 1776", 0.0),
        ("July 4", "4 July 1776", 0.0),
        ("June 4, 1776", "4 July 1776", 0.0),
        ("May", "May", 1.0),
    ],
)
def test_a_date_with_a_month_name_reads_the_same_in_either_order(answer, gold, expected):
    assert reward(answer, gold) == expected


@pytest.mark.parametrize(
    "answer, gold, expected",
    [
        (r"\frac{1}{2}", "1/2", 1.0),
        (r"\frac{1}{2}", "12", 0.0),
        (r"\dfrac{3}{4}", "3/4", 1.0),
        (r"\tfrac12", "1/2", 1.0),
        (r"\frac{1}{2}", "0.5", 0.0),
        (r"Paris\\London", "Paris", 0.0),
        (r"\pi", "\u03c0", 1.0),
        (r"\Gamma", "\u0393", 1.0),
        (r"\alpha", "", None),
        (r"\text{Fran\c{c}ois}", "Fran\u00e7ois", 1.0),
        (r"P\text{aris}", "Paris", 1.0),
        (r"Espa\~{n}a", "Espa\u00f1a", 1.0),
        (r"\'{E}cole", "\u00c9cole", 1.0),
        (r"5\,\text{km}", "5 km", 1.0),
        (r"\text{New}~\text{York}", "New York", 1.0),
        (r"AT\&T", "AT&T", 1.0),
    ],
)
def test_latex_in_a_box_reads_as_the_text_it_prints(answer, gold, expected):
    if expected is None:  # a box of a symbol is an answer, not an empty one
        assert result(answer, "alpha").reason == "wrong"
        return
    assert reward(answer, gold) == expected


def test_a_long_run_of_digits_scores_in_linear_time():
    """A degenerate rollout of digits must not stall scoring (the date pattern once backtracked quadratically:
    8,000 digits took 0.9 s, 200,000 did not finish in 300 s)."""
    import time

    start = time.perf_counter()
    assert reward("1" * 200_000, "1") == 0.0
    assert reward("1." * 100_000, "1") == 0.0
    assert time.perf_counter() - start < 10
