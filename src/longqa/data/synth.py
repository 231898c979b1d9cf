r"""An offline generator of long-context multi-hop QA in the recipe's row schema and folder layout.

The LoongRL data needs the Hugging Face Hub and a GPU-filtered pipeline; this generator needs nothing, so
every longqa command can run anywhere, on data of the same shape.

Each row is its own small fictional world (people, cities, countries, companies, films, books and the
years that tie them together), drawn from a ``random.Random`` seeded by (seed, task, row index): no model
can answer from prior knowledge, rows are independent, and any number of worker processes give the same
bytes. A question composes relations of that world in the style of one source dataset:

=========  =====================================================================================
hotpotqa   ``bridge`` (2 hops: "In which city is the company that employs X headquartered?") and
           ``comparison`` ("Who was born first, A or B?")
2wikimqa   ``compositional`` ("Who is the father of the director of F?"), ``inference`` ("Who is
           the paternal grandfather of X?"), ``comparison`` and ``bridge_comparison`` (4 hops:
           "Which film has the director born first, F or G?")
musique    ``chain``: min_hops..max_hops relations composed into one nested question
=========  =====================================================================================

The context holds one Wikipedia-like passage (a title line, then a few sentences) per entity on the
question's path; a "sibling" passage per hop, about an entity of the same kind whose same relation points
elsewhere, so that spotting a passage with the right kind of fact is not enough and the right one must be
read; then passages about the rest of the world, shuffled, until the prompt reaches ``context_tokens``.
Every fact of an entity is stated once, in that entity's own passage, so each hop has exactly one
sentence that proves it and nothing contradicts it.

With ``near_misses=True`` (``--near-misses``) the siblings of a chain question become near misses of its
answer chain: at each link, an entity of the same kind whose name shares a part with that link's subject (a
family name, a company's first word, a title's adjective) and whose same relation points elsewhere, and from
there the question's remaining relations through new entities, every passage of it in the context, to a
wrong answer of the answer's type that no other chain reaches. A reader who takes one wrong turn can then
finish a whole, consistent chain. Their passages are the first distractors added, the last link's first;
``extra_info`` lists each near miss the context holds whole (``near_miss_facts``, ``near_miss_answers``).

With ``keychain=True`` the question is hidden the way LoongRL's KeyChain does it: ``4 * L / 1024`` chains
of four ``{"key": "value"}.`` pairs, with keys of 8 hex digits (the key form of LoongRL's 4-per-1024
variant), are put between sentences at random. The chain that starts at the key named in the instruction
ends at the real question; the others end at distractor questions drawn the same way from the same world
(their passages join the context while they fit), so the real question does not stand out by its look.

Prompt lengths are counted passage by passage and summed, never by re-tokenizing the growing context:
with the tokenizer given, else with ``approx_tokens`` (within about 5% of Qwen2.5's tokenizer on this
text). A context is full when the next passages no longer fit, so it ends a fraction of one passage
short of the target; only the question's own passages and the keychain, which are always included, can
push a short context past it. A context within ``LENGTH_TOLERANCE`` (10%) of its target meets it;
``generate`` says how many of each target's contexts did not, and how far they are from it (at 256 tokens
most questions' own passages alone take more).

With ``context_lengths`` (``longqa data synth --context-lengths 1024 4096 16384``) every row is written
at each length, so that accuracy can be measured against length with nothing else changing. The rows of
one question share their world, question, answer, hop count and supporting passages; the context of
each length is the one of the length below plus more distractor passages (with ``keychain``, also
more chains: the same ones first, the real chain always), shuffled anew. ``extra_info`` then also holds
``target_tokens`` (the length asked for; ``context_tokens`` stays the measured one) and ``question_id``
(``<task>/<index>``, the same at every length). Each length splits its questions alike, so a question
is held out at every length or at none. The files::

    ctx1024/<task>/{train,test}.parquet   ctx1024/merged/{train,test}.parquet   (and so on per length)
    merged/{train,test}.parquet           every length's merged rows, shortest length first
"""

from __future__ import annotations

import collections
import functools
import itertools
import multiprocessing
import os
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from longqa.config.command_options import MAX_HOPS, MIN_CONTEXT_TOKENS, check_synth_options  # noqa: F401 (the limits of its options)
from longqa.config.command_options import SYNTH_TASKS as TASKS
from longqa.model.tokenizer import TokenizerError

from .io import task_splits, write_splits, write_task_splits
from .schema import QA_PREFIX, SYSTEM_PROMPT, make_row, question_suffix, with_system_prompt

__all__ = [
    "STYLES",
    "TASKS",
    "SynthConfig",
    "approx_tokens",
    "generate",
    "generate_rows",
    "keychain_count",
    "length_folder",
    "length_misses",
    "make_synth_row",
    "make_synth_rows",
    "token_counter",
]

STYLES = {  # the question styles of each of TASKS (the tasks the options may name)
    "hotpotqa": ("bridge", "comparison"),
    "musique": ("chain",),
    "2wikimqa": ("compositional", "inference", "comparison", "bridge_comparison"),
}
COMPARISON_STYLES = ("comparison", "bridge_comparison")

DEFAULT_ROWS_PER_TASK = 200
DEFAULT_CONTEXT_TOKENS = 1024
KEYCHAIN_HOPS = 4  # key:value pairs per chain, the last value being a question
KEY_HEX_DIGITS = 8
MAX_MISSES = 16  # passages in a row that did not fit before the context counts as full
LENGTH_TOLERANCE = 0.10  # a context within 10% of its target length meets it; `generate` says how many did not

KEYCHAIN_PREFIX = "Please read the following text.\n"
KEYCHAIN_INSTRUCTION = (
    "Exactly one of the questions hidden in the text above is the one to answer. It is found by "
    "following the correct consecutive chain of key:value pairs encoded with UUID strings, starting "
    "from {head}; the last value of that chain is the question. Find the question first, then answer it."
)


# ----------------------------------------------------------------------------------------------------
# Vocabulary: invented words that never contain one another


_ONSETS = (
    "b",
    "d",
    "f",
    "g",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "tr",
    "st",
    "th",
    "kl",
    "gr",
)
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ei", "ou")
_CODAS = ("", "", "", "n", "r", "l", "s", "th", "nd", "rk", "x", "m")

TITLE_ADJECTIVES = (
    "Silent",
    "Hidden",
    "Crimson",
    "Golden",
    "Broken",
    "Distant",
    "Hollow",
    "Frozen",
    "Burning",
    "Quiet",
    "Scarlet",
    "Wandering",
    "Forgotten",
    "Bitter",
    "Gentle",
    "Restless",
    "Pale",
    "Wild",
    "Secret",
    "Endless",
    "Northern",
    "Velvet",
    "Amber",
    "Lonely",
    "Shattered",
    "Sunken",
    "Painted",
    "Midnight",
    "Emerald",
    "Vanishing",
)
TITLE_NOUNS = (
    "Harbor",
    "Orchard",
    "Lantern",
    "Meridian",
    "Archive",
    "Compass",
    "Garden",
    "Tide",
    "Citadel",
    "Voyage",
    "Mirror",
    "River",
    "Kingdom",
    "Covenant",
    "Ledger",
    "Beacon",
    "Horizon",
    "Labyrinth",
    "Monarch",
    "Season",
    "Frontier",
    "Chorus",
    "Tapestry",
    "Threshold",
    "Winter",
    "Signal",
    "Echo",
    "Harvest",
    "Embers",
    "Crossing",
)
COMPANY_SUFFIXES = (
    "Holdings",
    "Industries",
    "Systems",
    "Laboratories",
    "Group",
    "Works",
    "Motors",
    "Foods",
    "Media",
    "Energy",
    "Partners",
    "Logistics",
    "Textiles",
    "Shipping",
)

_POOL_SIZES = {"female": 300, "male": 300, "last": 700, "city": 800, "country": 200, "company": 400}
_POOL_ENDINGS = {
    "female": ("", "a", "ia", "ine", "elle", "a"),
    "male": ("", "", "or", "an", "us", "ek"),
    "last": ("", "", "ton", "ard", "ley", "mark", "wick"),
    "city": ("", "", "holm", "grad", "ford", "mere", "vale"),
    "country": ("ia", "ar", "esh", "and", "ora", "istan"),
    "company": ("", "ex", "ion", "ar", "o"),
}


@functools.cache
def vocabulary() -> dict[str, tuple[str, ...]]:
    """Name pools, built once per process from a fixed seed.

    No word of any pool contains another (case-insensitively), English title and company words included.
    That keeps every two-word name out of every other name, so a wrong entity can never pass a
    substring-matching reward (the recipe's two-way substring match) as the right one.
    """
    rng = random.Random("longqa-synth-vocabulary")
    accepted: set[str] = set()
    fragments: set[str] = set()  # every substring of every accepted word

    def accept(word: str) -> bool:
        low = word.lower()
        inner = {low[i:j] for i in range(len(low)) for j in range(i + 1, len(low) + 1)}
        if low in fragments or not accepted.isdisjoint(inner):
            return False
        accepted.add(low)
        fragments.update(inner)
        return True

    for word in (*TITLE_ADJECTIVES, *TITLE_NOUNS, *COMPANY_SUFFIXES):
        accept(word)
    pools = {}
    for pool, size in _POOL_SIZES.items():
        words: list[str] = []
        while len(words) < size:
            word = _invented_word(rng, _POOL_ENDINGS[pool])
            if 4 <= len(word) <= 10 and accept(word):
                words.append(word)
        pools[pool] = tuple(words)
    pools["adjective"] = tuple(w for w in TITLE_ADJECTIVES if w.lower() in accepted)
    pools["noun"] = tuple(w for w in TITLE_NOUNS if w.lower() in accepted)
    pools["suffix"] = tuple(w for w in COMPANY_SUFFIXES if w.lower() in accepted)
    return pools


def _invented_word(rng: random.Random, endings: tuple[str, ...]) -> str:
    """Open syllables and an optional closing consonant: pronounceable, and unlike real names."""
    syllables = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.choice((1, 2, 2, 3))))
    return (syllables + rng.choice(_CODAS) + rng.choice(endings)).capitalize()


# ----------------------------------------------------------------------------------------------------
# Token counting


# A capitalised word is cut into pieces of up to three letters (BPE splits invented names about that
# finely); every other letter run, every digit and every punctuation mark is one piece.
_PIECES = re.compile(r"[A-Z][a-z]{0,2}|(?<=[A-Za-z])[a-z]{1,3}|[a-z]+|\d|[^\sA-Za-z\d]")


def approx_tokens(text: str) -> int:
    """Approximate BPE count without a tokenizer, for when none is given.

    Lowercase words count one token, digits one each (as Qwen's tokenizers split them), capitalised words
    one per three letters. On this generator's prompts it is within about 5% of the Qwen2.5 tokenizer;
    on ordinary English prose it reduces to a word-and-punctuation count, close to any BPE count.
    """
    return len(_PIECES.findall(text))


# GGUF files' tokenizers as tokenizer.json text, by resolved path: reading one from its GGUF takes seconds (the
# file's whole metadata is parsed), so the text read once goes to every worker process with its jobs.
_GGUF_TOKENIZERS: dict[str, str] = {}


def _gguf_tokenizer_json(path: Path) -> str:
    key = str(path.resolve())
    if key not in _GGUF_TOKENIZERS:
        from longqa.model.tokenizer import load_tokenizer

        _GGUF_TOKENIZERS[key] = load_tokenizer(str(path.parent), gguf_file=path.name).backend_tokenizer.to_str()
    return _GGUF_TOKENIZERS[key]


def _know_gguf_tokenizers(known: dict[str, str]) -> None:
    """A worker process's start: the GGUF tokenizers its parent has read."""
    _GGUF_TOKENIZERS.update(known)


@functools.lru_cache(maxsize=4)
def token_counter(tokenizer: str | None = None) -> Callable[[str], int]:
    """A function counting the tokens of a text: ``approx_tokens``, or a Hugging Face tokenizer's count.

    ``tokenizer`` is a ``tokenizer.json`` file, a model's GGUF file (``.gguf``, whose tokenizer it holds) or a
    folder. A folder with a ``tokenizer.json`` is read by the ``tokenizers`` library (fast, and it needs no
    model config); any other folder goes through ``transformers.AutoTokenizer``. Special tokens are not
    counted: the chat template adds them later.
    """
    if tokenizer is None:
        return approx_tokens
    path = Path(tokenizer)
    if path.suffix == ".gguf" and path.is_file():
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(_gguf_tokenizer_json(path))
        return lambda text: len(backend.encode(text, add_special_tokens=False).ids)
    json_file = path if path.is_file() else path / "tokenizer.json"
    try:
        if json_file.is_file():
            from tokenizers import Tokenizer

            fast = Tokenizer.from_file(str(json_file))
            return lambda text: len(fast.encode(text, add_special_tokens=False).ids)
        if path.is_dir():
            from transformers import AutoTokenizer

            slow = AutoTokenizer.from_pretrained(str(path))
            return lambda text: len(slow.encode(text, add_special_tokens=False))
    except Exception as e:  # a file or folder that holds no tokenizer these libraries read
        raise TokenizerError(f"cannot read a tokenizer from {path}: {type(e).__name__}: {e}") from None
    raise TokenizerError(f"tokenizer {path} is neither a tokenizer.json file nor a tokenizer folder")


# ----------------------------------------------------------------------------------------------------
# The fictional world


@dataclass(frozen=True)
class Relation:
    """A fact kind: the sentences stating it, the questions asking for its object, and the noun phrases
    naming its object inside a longer question (empty when nothing can follow it in a chain)."""

    subject: str
    object: str
    facts: tuple[str, ...]
    asks: tuple[str, ...]
    phrases: tuple[str, ...] = ()


RELATIONS = {
    "birth_year": Relation(
        "person",
        "year",
        ("{s} was born in {o}.", "{s} was born in the year {o}."),
        ("In which year was {x} born?", "When was {x} born?"),
    ),
    "born_in": Relation(
        "person",
        "city",
        ("{s} was born in the city of {o}.", "{s} is a native of {o}."),
        ("In which city was {x} born?", "Where was {x} born?"),
        ("the birthplace of {x}", "the city where {x} was born"),
    ),
    "works_for": Relation(
        "person",
        "company",
        ("{s} works for {o}.", "{s} is employed by {o}."),
        ("Which company employs {x}?", "Who is the employer of {x}?"),
        ("the company that employs {x}", "the employer of {x}"),
    ),
    "father": Relation(
        "person",
        "person",
        ("The father of {s} is {o}.", "{s}'s father is {o}."),
        ("Who is the father of {x}?",),
        ("the father of {x}",),
    ),
    "mother": Relation(
        "person",
        "person",
        ("The mother of {s} is {o}.", "{s}'s mother is {o}."),
        ("Who is the mother of {x}?",),
        ("the mother of {x}",),
    ),
    "spouse": Relation(
        "person",
        "person",
        ("{s} is married to {o}.", "The spouse of {s} is {o}."),
        ("Who is the spouse of {x}?", "Who is {x} married to?"),
        ("the spouse of {x}",),
    ),
    "founded_year": Relation(
        "company",
        "year",
        ("{s} was founded in {o}.", "{s} was established in {o}."),
        ("In which year was {x} founded?", "When was {x} founded?"),
    ),
    "founder": Relation(
        "company",
        "person",
        ("{s} was founded by {o}.", "The founder of {s} is {o}."),
        ("Who founded {x}?", "Who is the founder of {x}?"),
        ("the founder of {x}",),
    ),
    "headquartered_in": Relation(
        "company",
        "city",
        ("{s} is headquartered in {o}.", "The headquarters of {s} are in {o}."),
        ("In which city is {x} headquartered?", "Where is {x} headquartered?"),
        ("the city where {x} is headquartered", "the headquarters city of {x}"),
    ),
    "located_in": Relation(
        "city",
        "country",
        ("{s} is a city in {o}.", "{s} is located in {o}."),
        ("In which country is {x} located?", "In which country does {x} lie?"),
    ),
    "release_year": Relation(
        "film",
        "year",
        ("{s} was released in {o}.", "{s} premiered in {o}."),
        ("In which year was {x} released?", "When was {x} released?"),
    ),
    "director": Relation(
        "film",
        "person",
        ("{s} is a film directed by {o}.", "{s} was directed by {o}."),
        ("Who directed {x}?", "Who is the director of {x}?"),
        ("the director of {x}",),
    ),
    "publication_year": Relation(
        "book",
        "year",
        ("{s} was first published in {o}.", "{s} was published in {o}."),
        ("In which year was {x} published?", "When was {x} first published?"),
    ),
    "author": Relation(
        "book",
        "person",
        ("{s} is a novel written by {o}.", "{s} was written by {o}."),
        ("Who wrote {x}?", "Who is the author of {x}?"),
        ("the author of {x}",),
    ),
}
RELATIONS_OF = {
    kind: tuple(name for name, r in RELATIONS.items() if r.subject == kind)
    for kind in ("person", "company", "city", "country", "film", "book", "year")
}
# Relations every passage of a kind states, then those a person's passage states only sometimes.
ALWAYS_STATED = {
    "person": ("birth_year", "born_in", "works_for"),
    "company": ("founded_year", "founder", "headquartered_in"),
    "city": ("located_in",),
    "film": ("release_year", "director"),
    "book": ("publication_year", "author"),
}
SOMETIMES_STATED = {"father": 0.4, "mother": 0.3, "spouse": 0.35}
DOCUMENTED_KINDS = tuple(ALWAYS_STATED)


class Entity:
    """A fictional person, place, organisation or work. Facts are filled in lazily, on first use."""

    __slots__ = ("kind", "name", "facts", "female", "documented")

    def __init__(self, kind: str, name: str, female: bool = False):
        self.kind, self.name, self.female = kind, name, female
        self.facts: dict[str, Entity | int | None] = {}  # None: known to be absent (a spouse's spouse)
        self.documented = False

    def __repr__(self) -> str:
        return f"Entity({self.kind}, {self.name!r})"


class World:
    """All entities of one row. Names are unique within the world; places and companies are shared by
    many people, so bridge entities recur across passages as they do in Wikipedia."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.words = vocabulary()
        self.names: set[str] = set()
        self.pools: dict[str, list[Entity]] = {"company": [], "city": [], "country": []}
        self.mentioned: list[Entity] = []  # named in the context but without a passage yet
        self.titles = 0  # films and books, which share one space of names

    def crowded(self, kind: str) -> bool:
        """Whether half the names for ``kind`` are taken. Past that, places and companies are reused and
        no new works are made up, so that drawing a fresh name never takes long, even at 128K tokens."""
        words = self.words
        if kind in ("film", "book"):
            return 2 * self.titles > len(words["adjective"]) * len(words["noun"])
        if kind == "company":
            return 2 * len(self.pools[kind]) > len(words["company"]) * len(words["suffix"])
        return kind in self.pools and 2 * len(self.pools[kind]) > len(words[kind])

    def _named(self, make: Callable[[], str]) -> str:
        while (name := make()) in self.names:
            pass
        self.names.add(name)
        return name

    def person(self, female: bool | None = None, last: str | None = None, birth: int | None = None) -> Entity:
        rng, words = self.rng, self.words
        female = rng.random() < 0.5 if female is None else female
        first_names = words["female" if female else "male"]
        name = self._named(lambda: f"{rng.choice(first_names)} {last or rng.choice(words['last'])}")
        entity = Entity("person", name, female)
        if birth is not None:
            entity.facts["birth_year"] = birth
        return entity

    def new(self, kind: str) -> Entity:
        rng, words = self.rng, self.words
        if kind == "person":
            return self.person()
        if kind in ("film", "book"):
            self.titles += 1
            name = self._named(lambda: f"The {rng.choice(words['adjective'])} {rng.choice(words['noun'])}")
        elif kind == "company":
            name = self._named(lambda: f"{rng.choice(words['company'])} {rng.choice(words['suffix'])}")
        else:
            name = self._named(lambda: rng.choice(words[kind]))
        entity = Entity(kind, name)
        if kind in self.pools:
            self.pools[kind].append(entity)
        return entity

    def pick(self, kind: str, reuse: float, exclude: object = None) -> Entity:
        """An existing place or company (with probability ``reuse``), else a new one. The pool is not copied to leave
        ``exclude`` out: at 128K-token contexts it holds thousands of entities and a row picks tens of thousands of
        times. The draw is ``rng.choice``'s over the pool without ``exclude`` (one ``randrange`` of its length)."""
        pool = self.pools[kind]
        skip = None if exclude is None else next((i for i, e in enumerate(pool) if e is exclude), None)
        size = len(pool) - (skip is not None)
        if size and (self.rng.random() < reuse or self.crowded(kind)):
            index = self.rng.randrange(size)
            return pool[index + 1 if skip is not None and index >= skip else index]
        return self.new(kind)

    def get(self, entity: Entity, relation: str) -> Entity | int | None:
        if relation not in entity.facts:
            entity.facts[relation] = self._draw(entity, relation)
        return entity.facts[relation]

    def _draw(self, entity: Entity, relation: str) -> Entity | int:
        """A new fact, drawn so that years stay plausible (parents older than children, founders older
        than their companies)."""
        rng = self.rng
        if relation == "birth_year":
            return rng.randint(1890, 1995)
        if relation == "founded_year":
            return rng.randint(1820, 2015)
        if relation in ("release_year", "publication_year"):
            return rng.randint(1920 if relation == "release_year" else 1820, 2022)
        if relation == "born_in":
            return self.pick("city", reuse=0.6)
        if relation == "works_for":
            return self.pick("company", reuse=0.6)
        if relation == "headquartered_in":
            return self.pick("city", reuse=0.5)
        if relation == "located_in":
            return self.pick("country", reuse=0.8)
        if relation == "spouse":
            spouse = self.person(female=not entity.female, birth=self.get(entity, "birth_year") + rng.randint(-8, 8))
            spouse.facts["spouse"] = None  # the marriage is stated once, in this entity's passage
            return spouse
        if relation in ("father", "mother"):
            gap = rng.randint(20, 45) if relation == "father" else rng.randint(18, 40)
            last = entity.name.split(" ")[1] if relation == "father" else None
            return self.person(female=relation == "mother", last=last, birth=self.get(entity, "birth_year") - gap)
        start = {"founder": "founded_year", "director": "release_year", "author": "publication_year"}[relation]
        return self.person(birth=self.get(entity, start) - rng.randint(25, 60))

    def look_alike(self, entity: Entity) -> Entity:
        """A new entity of the same kind whose name shares a part with ``entity``'s: a person's family name, a
        company's first word, a title's adjective. Places have one-word names: theirs is simply new."""
        rng, words = self.rng, self.words
        if entity.kind == "person":
            return self.person(last=entity.name.split(" ")[1])
        first = entity.name.rpartition(" ")[0]
        others = {"company": words["suffix"], "film": words["noun"], "book": words["noun"]}.get(entity.kind, ())
        names = [f"{first} {word}" for word in others if f"{first} {word}" not in self.names]
        if not names:
            return self.new(entity.kind)
        name = rng.choice(names)
        self.names.add(name)
        other = Entity(entity.kind, name)
        if entity.kind in self.pools:
            self.pools[entity.kind].append(other)
        else:
            self.titles += 1
        return other

    def sibling(self, entity: Entity, relation: str, look_alike: bool = False) -> Entity:
        """A new entity of the same kind whose ``relation`` points elsewhere: a hard distractor. With
        ``look_alike``, its name also shares a part with ``entity``'s."""
        other = self.look_alike(entity) if look_alike or entity.kind == "person" else self.new(entity.kind)
        target, value = self.get(entity, relation), self.get(other, relation)
        if isinstance(target, int):
            if value == target:
                other.facts[relation] = value + self.rng.choice((-1, 1)) * self.rng.randint(1, 12)
        elif value is target:
            other.facts[relation] = self.pick(target.kind, reuse=0.7, exclude=target)
        return other


# ----------------------------------------------------------------------------------------------------
# Passages


OCCUPATIONS = (
    "an architect",
    "a painter",
    "a surgeon",
    "an engineer",
    "a historian",
    "a composer",
    "a botanist",
    "a journalist",
    "a diplomat",
    "a chemist",
    "a sculptor",
    "a pilot",
    "a lawyer",
    "a cartographer",
    "a teacher",
    "an economist",
    "a photographer",
    "a geologist",
)
ACHIEVEMENTS = (
    "a series of public lectures",
    "pioneering work on coastal erosion",
    "a widely read memoir",
    "reforms to the local school system",
    "an award-winning documentary",
    "restoring old bridges",
    "a study of migratory birds",
    "designing public libraries",
    "a long career in radio",
)
HOBBIES = (
    "sailing",
    "chess",
    "beekeeping",
    "mountain climbing",
    "calligraphy",
    "amateur astronomy",
    "gardening",
    "fencing",
    "collecting maps",
)
TRAITS = ("patient", "meticulous", "generous", "outspoken", "reserved", "curious", "ambitious")
INDUSTRIES = (
    "shipbuilding",
    "textile",
    "software",
    "agricultural",
    "pharmaceutical",
    "mining",
    "publishing",
    "telecommunications",
    "food processing",
    "aviation",
    "renewable energy",
)
PRODUCTS = (
    "durable machinery",
    "affordable medicines",
    "cargo vessels",
    "weatherproof fabrics",
    "navigation software",
    "canned goods",
    "solar panels",
    "printing presses",
)
LANDMARKS = (
    "old stone bridge",
    "covered market",
    "clock tower",
    "botanical garden",
    "harbour walls",
    "annual lantern festival",
    "cathedral",
    "university library",
)
GENRES = ("drama", "comedy", "thriller", "mystery", "romance", "historical", "science fiction", "adventure")
ASPECTS = (
    "vivid characters",
    "careful pacing",
    "striking imagery",
    "sharp dialogue",
    "bleak humour",
    "ambitious structure",
)

# Filler sentences: (name, pronouns, rng) -> a sentence naming no other entity and no year.
FILLERS = {
    "person": (
        lambda s, p, r: f"{s} worked as {r.choice(OCCUPATIONS)} for {r.randint(3, 40)} years.",
        lambda s, p, r: f"{p[0]} is best known for {r.choice(ACHIEVEMENTS)}.",
        lambda s, p, r: f"In {p[1]} spare time, {s} enjoyed {r.choice(HOBBIES)}.",
        lambda s, p, r: f"Colleagues described {p[2]} as {r.choice(TRAITS)} and {r.choice(TRAITS)}.",
        lambda s, p, r: f"{p[0]} spoke {r.randint(2, 6)} languages fluently.",
    ),
    "company": (
        lambda s, p, r: f"{s} operates in the {r.choice(INDUSTRIES)} sector.",
        lambda s, p, r: f"{s} employs about {r.randint(40, 90000):,} people.",
        lambda s, p, r: f"The company is known for its {r.choice(PRODUCTS)}.",
        lambda s, p, r: f"Its annual revenue was last reported at {r.randint(3, 9000):,} million credits.",
        lambda s, p, r: f"{s} runs {r.randint(2, 60)} regional offices.",
    ),
    "city": (
        lambda s, p, r: f"{s} has a population of about {r.randint(8, 3000) * 1000:,}.",
        lambda s, p, r: f"The economy of {s} relies on the {r.choice(INDUSTRIES)} industry.",
        lambda s, p, r: f"{s} is known for its {r.choice(LANDMARKS)}.",
        lambda s, p, r: f"The city lies {r.randint(5, 400)} kilometres from the coast.",
    ),
    "film": (
        lambda s, p, r: f"{s} belongs to the {r.choice(GENRES)} genre.",
        lambda s, p, r: f"The film runs for {r.randint(80, 190)} minutes.",
        lambda s, p, r: f"It was shot over {r.randint(4, 30)} weeks for {r.randint(1, 900):,} million credits.",
        lambda s, p, r: f"Critics praised its {r.choice(ASPECTS)}.",
    ),
    "book": (
        lambda s, p, r: f"{s} belongs to the {r.choice(GENRES)} genre.",
        lambda s, p, r: f"The book has {r.randint(120, 900)} pages.",
        lambda s, p, r: f"It has been translated into {r.randint(2, 40)} languages.",
        lambda s, p, r: f"Reviewers noted its {r.choice(ASPECTS)}.",
    ),
}
PRONOUNS = {True: ("She", "her", "her"), False: ("He", "his", "him")}
NEUTRAL = ("It", "its", "it")


@dataclass
class Passage:
    """One entity's passage: its sentences (kept apart so keys can go between them), the sentence
    stating each relation, and what it names (for counting the answer's candidates)."""

    entity: Entity
    sentences: list[str]
    facts: dict[str, str]
    mentions: list[Entity | int]

    @property
    def text(self) -> str:
        return f"{self.entity.name}\n{' '.join(self.sentences)}"


def render(world: World, entity: Entity) -> Passage:
    """State every fact of ``entity`` once, plus a few filler sentences that name no other entity."""
    rng = world.rng
    relations = list(ALWAYS_STATED[entity.kind])
    if entity.kind == "person":
        relations += [r for r, p in SOMETIMES_STATED.items() if r in entity.facts or rng.random() < p]
    facts, mentions = {}, [entity]
    for relation in relations:
        value = world.get(entity, relation)
        if value is None:
            continue
        target = value.name if isinstance(value, Entity) else str(value)
        facts[relation] = rng.choice(RELATIONS[relation].facts).format(s=entity.name, o=target)
        mentions.append(value)
    pronouns = PRONOUNS[entity.female] if entity.kind == "person" else NEUTRAL
    fillers = [f(entity.name, pronouns, rng) for f in rng.sample(FILLERS[entity.kind], rng.randint(1, 3))]
    sentences = [*facts.values(), *fillers]
    rng.shuffle(sentences)
    return Passage(entity, sentences, facts, mentions)


# ----------------------------------------------------------------------------------------------------
# Questions


@dataclass
class Question:
    """A question, its answer, and the (subject, relation) facts that prove it, in chain order."""

    style: str
    text: str
    answer: str
    answer_type: str
    hops: list[tuple[Entity, str]]
    conclusion: str


START_KINDS = ("person", "company", "film", "book")
ALL_RELATIONS = frozenset(RELATIONS)
KIN = frozenset({"father", "mother", "spouse"})
BRIDGE_RELATIONS = ALL_RELATIONS - KIN
COMPOSITIONAL_RELATIONS = frozenset({"director", "author", "born_in", "birth_year", "works_for"}) | KIN
INFERENCES = {
    ("father", "father"): "paternal grandfather",
    ("mother", "father"): "maternal grandfather",
    ("father", "mother"): "paternal grandmother",
    ("mother", "mother"): "maternal grandmother",
    ("spouse", "father"): "father-in-law",
    ("spouse", "mother"): "mother-in-law",
}
COMPARISONS = {  # kind: (year relation, question asking for the earlier one, ... for the later one)
    "person": ("birth_year", "Who was born first, {a} or {b}?", "Who was born later, {a} or {b}?"),
    "company": (
        "founded_year",
        "Which company was founded first, {a} or {b}?",
        "Which company was founded more recently, {a} or {b}?",
    ),
    "film": (
        "release_year",
        "Which film came out first, {a} or {b}?",
        "Which film came out more recently, {a} or {b}?",
    ),
    "book": (
        "publication_year",
        "Which book was published first, {a} or {b}?",
        "Which book was published more recently, {a} or {b}?",
    ),
}
BRIDGE_COMPARISONS = {  # kind: (relation to a person, question for the earlier-born, ... later-born)
    "film": (
        "director",
        "Which film has the director born first, {a} or {b}?",
        "Which film has the director born later, {a} or {b}?",
    ),
    "book": (
        "author",
        "Which book has the author born first, {a} or {b}?",
        "Which book has the author born later, {a} or {b}?",
    ),
    "company": (
        "founder",
        "Which company has the founder born first, {a} or {b}?",
        "Which company has the founder born later, {a} or {b}?",
    ),
}


@functools.cache
def _reaches(kind: str, hops: int, relations: frozenset[str]) -> bool:
    """Whether a chain of ``hops`` more relations can start at an entity of ``kind``."""
    return hops == 0 or any(_continues(r, hops, relations) for r in RELATIONS_OF[kind])


def _continues(relation: str, hops: int, relations: frozenset[str]) -> bool:
    """Whether ``relation`` can be the first of ``hops`` more: allowed, named by a noun phrase when
    something follows it, and leading to an entity from which the rest of the chain can go on."""
    rule = RELATIONS[relation]
    return relation in relations and (hops == 1 or bool(rule.phrases)) and _reaches(rule.object, hops - 1, relations)


def _walk(world: World, hops: int, relations: frozenset[str], start_kinds: tuple[str, ...]) -> list[tuple]:
    """A path (subject, relation, object) x hops through distinct entities, from a new start entity."""
    rng = world.rng
    while True:
        entity = world.new(rng.choice(start_kinds))
        path, seen = [], {id(entity)}
        for hop in range(hops):
            options = [r for r in RELATIONS_OF[entity.kind] if _continues(r, hops - hop, relations)]
            rng.shuffle(options)
            for relation in options:
                value = world.get(entity, relation)
                if value is not None and id(value) not in seen:
                    break
            else:
                break  # a dead end (every relation loops back): start over from a new entity
            path.append((entity, relation, value))
            seen.add(id(value))
            entity = value
        if len(path) == hops:
            return path


def _composed(world: World, style: str, path: list[tuple]) -> Question:
    """Nest the path's noun phrases: "the city where the company that employs X is headquartered"."""
    rng = world.rng
    phrase = path[0][0].name
    for _, relation, _ in path[:-1]:
        phrase = rng.choice(RELATIONS[relation].phrases).format(x=phrase)
    text = rng.choice(RELATIONS[path[-1][1]].asks).format(x=phrase)
    answer = path[-1][2]
    answer_text = answer.name if isinstance(answer, Entity) else str(answer)
    answer_type = answer.kind if isinstance(answer, Entity) else "year"
    return Question(
        style, text, answer_text, answer_type, [(s, r) for s, r, _ in path], f"So the answer is {answer_text}."
    )


def _inference(world: World) -> Question:
    """A kinship relation that is never stated but follows from two stated ones."""
    rng = world.rng
    (first, second), name = rng.choice(list(INFERENCES.items()))
    person = world.person()
    middle = world.get(person, first)
    answer = world.get(middle, second)
    return Question(
        "inference",
        f"Who is the {name} of {person.name}?",
        answer.name,
        "person",
        [(person, first), (middle, second)],
        f"So the {name} of {person.name} is {answer.name}.",
    )


def _comparison(world: World, style: str) -> Question:
    """Two entities compared on a year, directly or through a related person; years never tie."""
    rng = world.rng
    table = COMPARISONS if style == "comparison" else BRIDGE_COMPARISONS
    kind = rng.choice(list(table))
    link, ask_first, ask_later = table[kind]
    pair = [world.new(kind), world.new(kind)]
    hops, years = [], []
    for entity in pair:
        if style == "comparison":
            holder, relation = entity, link
        else:
            holder, relation = world.get(entity, link), "birth_year"
            hops.append((entity, link))
        hops.append((holder, relation))
        years.append(world.get(holder, relation))
    if years[0] == years[1]:
        holder, relation = hops[-1]
        years[1] = holder.facts[relation] = years[1] + rng.choice((-1, 1)) * rng.randint(1, 12)
    first = rng.random() < 0.5
    winner = years.index(min(years) if first else max(years))
    loser = 1 - winner
    text = (ask_first if first else ask_later).format(a=pair[0].name, b=pair[1].name)
    conclusion = (
        f"{years[winner]} is {'earlier' if first else 'later'} than {years[loser]}, "
        f"so the answer is {pair[winner].name}."
    )
    return Question(style, text, pair[winner].name, kind, hops, conclusion)


def make_question(world: World, style: str, hops: int) -> Question:
    """A question of ``style``; ``hops`` sets the length of musique-style chains only."""
    if style == "bridge":
        return _composed(world, style, _walk(world, 2, BRIDGE_RELATIONS, START_KINDS))
    if style == "chain":
        return _composed(world, style, _walk(world, hops, ALL_RELATIONS, START_KINDS))
    if style == "compositional":
        return _composed(world, style, _walk(world, 2, COMPOSITIONAL_RELATIONS, ("film", "book")))
    if style == "inference":
        return _inference(world)
    return _comparison(world, style)


# ----------------------------------------------------------------------------------------------------
# KeyChain


@dataclass
class KeyChain:
    """The pairs to scatter through the context (every chain's, shuffled together), the real chain's keys,
    the distractor questions, and each chain's own pairs (the real chain's first)."""

    pairs: list[str]
    keys: list[str]
    distractors: list[Question]
    chains: list[list[str]]

    def pairs_of(self, chains: int) -> list[str]:
        """The pairs of the first ``chains`` chains, in their shuffled order: a shorter context shows part of
        a longer one's keychain (the real chain, then the same distractor chains first)."""
        keep = {pair for chain in self.chains[:chains] for pair in chain}
        return [pair for pair in self.pairs if pair in keep]


def make_keychain(world: World, question: Question, chains: int, new_question: Callable[[], Question]) -> KeyChain:
    """``chains`` chains of ``KEYCHAIN_HOPS`` pairs; the first ends at ``question``, the rest at distractor
    questions of the same styles whose answers differ from the real one."""
    rng = world.rng
    distractors: list[Question] = []
    texts = {question.text}
    while len(distractors) < chains - 1:
        candidate = new_question()
        if candidate.answer != question.answer and candidate.text not in texts:
            distractors.append(candidate)
            texts.add(candidate.text)
    used: set[str] = set()
    chains_pairs, real_keys = [], []
    for target in (question, *distractors):
        keys = []
        while len(keys) < KEYCHAIN_HOPS:
            key = f"{rng.getrandbits(4 * KEY_HEX_DIGITS):0{KEY_HEX_DIGITS}x}"
            if key not in used:
                used.add(key)
                keys.append(key)
        values = [*keys[1:], target.text]
        chains_pairs.append([f'{{"{k}": "{v}"}}.' for k, v in zip(keys, values)])
        real_keys = real_keys or keys
    pairs = [pair for chain in chains_pairs for pair in chain]
    rng.shuffle(pairs)
    return KeyChain(pairs, real_keys, distractors, chains_pairs)


def keychain_count(context_tokens: int) -> int:
    """LoongRL's number of chains at a context length: 4 per 1024 tokens, at least one."""
    return max(1, round(4 * context_tokens / 1024))


# ----------------------------------------------------------------------------------------------------
# One row


@dataclass(frozen=True)
class SynthConfig:
    """Everything a row depends on besides its task and index (``tokenizer``: a path, or None)."""

    context_tokens: int = DEFAULT_CONTEXT_TOKENS
    min_hops: int = 2
    max_hops: int = 4
    keychain: bool = False
    seed: int = 42
    tokenizer: str | None = None
    near_misses: bool = False


@dataclass
class Context:
    """The passages chosen so far, the prompt's running token count, and the entities whose passages did
    not fit (tried again first when the context grows)."""

    world: World
    count: Callable[[str], int]
    budget: int
    total: int
    passages: list[Passage] = field(default_factory=list)
    missed: list[Entity] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)

    def add(self, passage: Passage, cost: int) -> None:
        passage.entity.documented = True
        self.passages.append(passage)
        self.total += cost
        self.world.mentioned += [
            m for m in passage.mentions if isinstance(m, Entity) and not m.documented and m.kind in DOCUMENTED_KINDS
        ]

    def passage(self, entity: Entity) -> tuple[Passage, int]:
        """A passage and what it adds to the prompt as the next one, "Passage N:" header included (the
        headers' total does not depend on the order the passages are shown in)."""
        passage = render(self.world, entity)
        header = _cached_count(self.count, f"\n\nPassage {len(self.passages) + 1}:\n")
        return passage, self.count(passage.text) + header

    def grow(self, budget: int, fixed: int) -> None:
        """Make room for a longer context, whose prompt has ``fixed`` more tokens besides passages (the
        pairs of its extra keychain chains)."""
        self.budget = budget
        self.total += fixed

    def fill(self, candidates: Iterator[Entity]) -> None:
        """Add passages while they fit; stop after ``MAX_MISSES`` passages in a row that did not. Those
        that did not fit are tried first by the next fill, so a grown context gets them before new ones."""
        retry, self.missed = collections.deque(self.missed), []
        misses = 0
        for entity in itertools.chain(_drain(retry), candidates):
            if entity.documented:
                continue
            passage, cost = self.passage(entity)
            if self.total + cost <= self.budget:
                self.add(passage, cost)
                misses = 0
            else:
                self.missed.append(entity)
                misses += 1
                if misses >= MAX_MISSES:
                    self.missed += retry
                    return


def _drain(queue: collections.deque) -> Iterator:
    """The queue's items, each removed as it is handed out, so what a stopped loop left stays queued."""
    while queue:
        yield queue.popleft()


def _random_entities(world: World) -> Iterator[Entity]:
    """Endless filler: entities already named in the context (so the world hangs together) or new ones."""
    rng = world.rng
    kinds, weights = ("person", "company", "city", "film", "book"), (8, 4, 3, 2, 2)
    while True:
        if world.mentioned and rng.random() < 0.5:
            i = rng.randrange(len(world.mentioned))
            world.mentioned[i], world.mentioned[-1] = world.mentioned[-1], world.mentioned[i]
            yield world.mentioned.pop()
        else:
            kind = rng.choices(kinds, weights)[0]
            yield world.new("person" if world.crowded(kind) else kind)


def _scatter(passages: list[Passage], pairs: list[str], rng: random.Random) -> list[str]:
    """Each passage's text with the pairs put after randomly chosen sentences (never inside one)."""
    slots = [(i, j) for i, p in enumerate(passages) for j in range(len(p.sentences))]
    after: dict[tuple[int, int], list[str]] = {}
    for pair in pairs:
        after.setdefault(rng.choice(slots), []).append(pair)
    texts = []
    for i, p in enumerate(passages):
        words = []
        for j, sentence in enumerate(p.sentences):
            words.append(sentence)
            words += after.get((i, j), ())
        texts.append(f"{p.entity.name}\n{' '.join(words)}")
    return texts


def _num_candidates(question: Question, passages: list[Passage]) -> int:
    """Distinct entities (or years) of the answer's type named in the context; 2 for comparisons,
    whose candidates are the two named in the question."""
    if question.style in COMPARISON_STYLES:
        return 2
    if question.answer_type == "year":
        return len({m for p in passages for m in p.mentions if isinstance(m, int)})
    return len(
        {id(m) for p in passages for m in p.mentions if isinstance(m, Entity) and m.kind == question.answer_type}
    )


@functools.lru_cache(maxsize=4096)
def _cached_count(count: Callable[[str], int], text: str) -> int:
    """Count texts that recur in every row (system prompt, prefixes, headers) once per process."""
    return count(text)


def _draw_question(world: World, task: str, config: SynthConfig, style: str | None = None) -> Question:
    styles = STYLES[task]
    hops = world.rng.randint(config.min_hops, config.max_hops)
    return make_question(world, style or world.rng.choice(styles), hops)


def _frame(question: Question, keychain: KeyChain | None) -> tuple[str, str]:
    """The user message's text before and after the passages, in the recipe's two prompt shapes."""
    if keychain is None:
        return QA_PREFIX, question_suffix(question.text)
    return KEYCHAIN_PREFIX, "\n\n" + KEYCHAIN_INSTRUCTION.format(head=keychain.keys[0])


@dataclass
class Draft:
    """What every context length of a row shares: its world (and random stream), the question, the
    keychain (with the longest length's chains) and the token counter."""

    world: World
    question: Question
    keychain: KeyChain | None
    count: Callable[[str], int]
    near_misses: bool = False


def _draft(task: str, index: int, config: SynthConfig, chains: int) -> Draft:
    """The question of row ``index``, and ``chains`` keychain chains when ``config.keychain``."""
    rng = random.Random(f"{config.seed}/{task}/{index}")
    world = World(rng)
    question = _draw_question(world, task, config, STYLES[task][index % len(STYLES[task])])
    keychain = None
    if config.keychain:
        keychain = make_keychain(world, question, chains, lambda: _draw_question(world, task, config))
    return Draft(world, question, keychain, token_counter(config.tokenizer), config.near_misses)


def _pairs(draft: Draft, length: int) -> list[str]:
    """The keychain pairs a context of ``length`` tokens shows: LoongRL's number of chains for that length."""
    return draft.keychain.pairs_of(keychain_count(length)) if draft.keychain else []


def _fixed_tokens(draft: Draft, pairs: list[str]) -> int:
    """The prompt's tokens besides its passages: system prompt, frame and keychain pairs."""
    count = draft.count
    prefix, suffix = _frame(draft.question, draft.keychain)
    return _cached_count(count, SYSTEM_PROMPT) + _cached_count(count, prefix) + count(suffix) + sum(map(count, pairs))


@dataclass
class NearMiss:
    """A wrong turn at one link of the answer chain, followed to its end: ``links`` (subject, relation) from a
    look-alike of that link's subject on, through the question's remaining relations, to ``answer``."""

    links: list[tuple[Entity, str]]
    answer: Entity | int


def near_miss(world: World, question: Question, link: int, taken: list) -> NearMiss | None:
    """The near miss at ``link`` of a chain question: a look-alike of that link's subject whose relation points
    elsewhere, then the question's later relations through new entities, so that the wrong turn leads, fact by
    fact, to an answer of the answer's type that is none of ``taken`` (the answer, the other near misses').
    None where a relation has no value."""
    relations = [r for _, r in question.hops[link:]]
    entity = world.sibling(question.hops[link][0], relations[0], look_alike=True)
    links = []
    for relation in relations:
        value = world.get(entity, relation)
        if value is None:
            return None
        links.append((entity, relation))
        if len(links) < len(relations):
            if value.kind in world.pools:  # a shared place or company would lead back among known entities
                value = entity.facts[relation] = world.new(value.kind)
            entity = value
    answer = value
    while answer in taken:  # the holder is new: its fact is not stated anywhere yet
        answer = (
            answer + world.rng.choice((-1, 1)) * world.rng.randint(1, 12)
            if isinstance(answer, int)
            else world.new(answer.kind)
        )
        entity.facts[relation] = answer
    return NearMiss(links, answer)


def _add_required(world: World, question: Question, context: Context, near_misses: bool) -> list[Entity]:
    """Add the passages every context of the row holds: the question's own, and its last hop's sibling so
    that the answer's type has a second candidate (comparisons name two already). Returns the other
    siblings, the first passages tried after these.

    With ``near_misses`` (chain questions only) each sibling is a look-alike starting a near miss, whose
    passages follow it among the first tried: the last link's first, then the link before it, and so on."""
    for subject in {id(s): s for s, _ in question.hops}.values():
        context.add(*context.passage(subject))
    if near_misses and question.style not in COMPARISON_STYLES:
        taken = [question.hops[-1][0].facts[question.hops[-1][1]]]
        for link in reversed(range(len(question.hops))):
            if (miss := near_miss(world, question, link, taken)) is not None:
                context.near_misses.append(miss)
                taken.append(miss.answer)
        siblings = [entity for m in context.near_misses for entity, _ in m.links]
    else:
        siblings = [world.sibling(s, r) for s, r in reversed(question.hops)]
    if question.style not in COMPARISON_STYLES:
        context.add(*context.passage(siblings.pop(0)))
    return siblings


def _contexts(draft: Draft, lengths: list[int]) -> Iterator[tuple[Context, list[str]]]:
    """The row's context and keychain pairs at each of ``lengths`` (ascending), each context grown from the
    one before with the other siblings, the distractor questions' passages and random passages, while
    they fit: a shorter context's passages are all in every longer one. The context is the same object
    at every length; take what is needed from it before asking for the next."""
    world, keychain = draft.world, draft.keychain
    pairs = {length: _pairs(draft, length) for length in lengths}
    fixed = {length: _fixed_tokens(draft, pairs[length]) for length in lengths}
    context = Context(world, draft.count, lengths[0], fixed[lengths[0]])
    siblings = _add_required(world, draft.question, context, draft.near_misses)
    distractor_subjects = [s for q in (keychain.distractors if keychain else ()) for s, _ in q.hops]
    candidates = itertools.chain(siblings, distractor_subjects, _random_entities(world))
    for previous, length in zip((lengths[0], *lengths), lengths):
        context.grow(length, fixed[length] - fixed[previous])
        context.fill(candidates)
        yield context, pairs[length]


def _reference(question: Question, supporting: list[str], keychain: KeyChain | None) -> str:
    """A short worked answer in the recipe's format, for a supervised warm-up."""
    steps = [*supporting, question.conclusion]
    if keychain is not None:
        steps.insert(0, f"Following the keys {', then '.join(keychain.keys)} leads to the question: {question.text}")
    return f"<think> {' '.join(steps)} </think> \\boxed{{{question.answer}}}"


def _near_miss_info(context: Context, by_entity: dict[int, Passage]) -> dict:
    """The near misses this context holds whole (every passage on them), each as the facts that state its links
    and the wrong answer it leads to; empty lists when it holds none (or none were made)."""
    whole = [m for m in context.near_misses if all(id(e) in by_entity for e, _ in m.links)]
    return {
        "near_miss_facts": [[by_entity[id(e)].facts[r] for e, r in m.links] for m in whole],
        "near_miss_answers": [m.answer.name if isinstance(m.answer, Entity) else str(m.answer) for m in whole],
    }


def _row(task: str, index: int, draft: Draft, context: Context, pairs: list[str]) -> dict:
    """The row for one context: its passages shuffled, the keychain's pairs put between their sentences."""
    question, keychain, rng = draft.question, draft.keychain, draft.world.rng
    by_entity = {id(p.entity): p for p in context.passages}
    supporting = [by_entity[id(s)].facts[r] for s, r in question.hops]
    passages = context.passages[:]
    rng.shuffle(passages)
    texts = _scatter(passages, pairs, rng) if keychain else [p.text for p in passages]
    body = "\n\n".join(f"Passage {i}:\n{text}" for i, text in enumerate(texts, 1))
    extra_info = {
        "index": index,
        "task": task,
        "style": question.style,
        "hops": len(question.hops),
        "question": question.text,
        "answer_type": question.answer_type,
        "num_candidates": _num_candidates(question, passages),
        "supporting_facts": supporting,
        "reference_response": _reference(question, supporting, keychain),
        "context_tokens": context.total,
        "keychain": keychain is not None,
        **_near_miss_info(context, by_entity),
    }
    prefix, suffix = _frame(question, keychain)
    messages = with_system_prompt([{"role": "user", "content": prefix + body + suffix}])
    return make_row(f"synth_{task}", messages, [question.answer], extra_info=extra_info)


def _rows(task: str, index: int, config: SynthConfig, lengths: list[int]) -> list[dict]:
    """Row ``index`` of ``task`` at each of ``lengths`` (ascending), from one draft."""
    draft = _draft(task, index, config, keychain_count(lengths[-1]))
    return [_row(task, index, draft, context, pairs) for context, pairs in _contexts(draft, lengths)]


def make_synth_row(task: str, index: int, config: SynthConfig) -> dict:
    """Row ``index`` of ``task``: a function of (config, task, index) alone, so rows can be made in any
    order and in any process."""
    [row] = _rows(task, index, config, [config.context_tokens])
    return row


def make_synth_rows(task: str, index: int, config: SynthConfig, lengths: Sequence[int]) -> list[dict]:
    """Row ``index`` of ``task`` at each of ``lengths`` (they replace ``config.context_tokens``), shortest
    first: one question, answer and set of supporting passages, longer contexts adding only distractor
    passages (and keychain chains), so that length is the only thing that differs. ``extra_info`` also
    holds ``target_tokens``, the length asked for, and ``question_id``, the same at every length."""
    lengths = sorted(set(lengths))
    rows = _rows(task, index, config, lengths)
    for length, row in zip(lengths, rows):
        row["extra_info"].update(target_tokens=length, question_id=f"{task}/{index}")
    return rows


# ----------------------------------------------------------------------------------------------------
# Public API


def _check(tasks: tuple[str, ...], config: SynthConfig, lengths: tuple[int, ...] = ()) -> None:
    check_synth_options(tasks, config.min_hops, config.max_hops, lengths or (config.context_tokens,))
    token_counter(config.tokenizer)  # a tokenizer that cannot be read fails here, not in the first row (or worker)


def _make_rows(jobs: list[tuple[str, int]], config: SynthConfig, workers: int, lengths: tuple[int, ...] = ()) -> list:
    """For each (task, index) job, in job order, its row, or with ``lengths`` its list of rows (one per
    length), made by ``workers`` processes."""
    make = functools.partial(_make_job, config=config, lengths=lengths)
    if workers <= 1 or len(jobs) < 2:
        return [make(job) for job in jobs]
    # Workers are started fresh ("spawn"), not forked: a fork copies whatever locks the parent's other threads (a
    # tokenizer's, an I/O library's, a test runner's) hold at that moment, and a child that needs one waits forever.
    with multiprocessing.get_context("spawn").Pool(
        min(workers, os.cpu_count() or 1, len(jobs)), _know_gguf_tokenizers, (dict(_GGUF_TOKENIZERS),)
    ) as pool:
        return pool.map(make, jobs, chunksize=max(1, len(jobs) // (workers * 16)))


def _make_job(job: tuple[str, int], config: SynthConfig, lengths: tuple[int, ...]) -> dict | list[dict]:
    if lengths:
        return make_synth_rows(job[0], job[1], config, lengths)
    return make_synth_row(job[0], job[1], config)


def length_folder(length: int) -> str:
    """The folder of one length's files in a by-length set: ``ctx1024`` for 1024 tokens."""
    return f"ctx{length}"


def _length_splits(
    rows: dict[int, dict[str, list[dict]]], test_ratio: float, seed: int
) -> dict[str, dict[str, list[dict]]]:
    """Each length's recipe layout under its ``length_folder``, then ``merged``: every length's merged
    rows, shortest length first. Every length splits with the same seed and row counts, so a question
    is held out at all lengths or at none."""
    splits: dict[str, dict[str, list[dict]]] = {}
    merged: dict[str, list[dict]] = {"train": [], "test": []}
    for length, rows_by_task in rows.items():
        parts = task_splits(rows_by_task, test_ratio, seed)
        splits.update({f"{length_folder(length)}/{name}": part for name, part in parts.items()})
        for split, split_rows in parts["merged"].items():
            merged[split] += split_rows
    splits["merged"] = merged
    return splits


def length_misses(rows: list[dict], target: int, where: str = "") -> str | None:
    """A line saying how many of ``rows``' contexts are further than ``LENGTH_TOLERANCE`` from their ``target``
    tokens, and how far (None when every one is within it): a context must not pass for a length it is not,
    and a short target cannot hold the passages some questions need. ``where``: the target's folder."""
    counts = sorted(row["extra_info"]["context_tokens"] for row in rows)
    over = [n for n in counts if n > target * (1 + LENGTH_TOLERANCE)]
    under = [n for n in counts if n < target * (1 - LENGTH_TOLERANCE)]
    if not over and not under:
        return None
    misses = []
    if over:
        misses.append(
            f"{len(over)} of {len(rows)} are more than {LENGTH_TOLERANCE:.0%} over {target} (up to "
            f"{over[-1]}): the passages their questions need, with the prompt around them, take more"
        )
    if under:
        misses.append(
            f"{len(under)} of {len(rows)} are more than {LENGTH_TOLERANCE:.0%} under {target} (down to "
            f"{under[0]}): the next passages did not fit"
        )
    return f"note: the {target}-token contexts{where} (median {counts[len(counts) // 2]} tokens): " + "; ".join(misses)


def generate_rows(
    task: str,
    n: int,
    *,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    min_hops: int = 2,
    max_hops: int = 4,
    keychain: bool = False,
    seed: int = 42,
    tokenizer: str | os.PathLike | None = None,
    workers: int = 1,
    near_misses: bool = False,
) -> list[dict]:
    """``n`` rows of one task (``extra_info.index`` 0..n-1), without writing anything."""
    config = SynthConfig(
        context_tokens, min_hops, max_hops, keychain, seed, None if tokenizer is None else str(tokenizer), near_misses
    )
    _check((task,), config)
    return _make_rows([(task, i) for i in range(n)], config, workers)


def generate(
    output_dir: str | os.PathLike,
    *,
    rows_per_task: int = DEFAULT_ROWS_PER_TASK,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    tasks: tuple[str, ...] = TASKS,
    min_hops: int = 2,
    max_hops: int = 4,
    keychain: bool = False,
    test_ratio: float = 0.05,
    seed: int = 42,
    tokenizer: str | os.PathLike | None = None,
    workers: int = 1,
    context_lengths: Sequence[int] = (),
    near_misses: bool = False,
    say: Callable[[str], None] = print,
) -> dict[str, dict[str, int]]:
    """Write ``<task>/{train,test}.parquet`` and ``merged/{train,test}.parquet`` under ``output_dir``,
    as the recipe lays its data out, and return the row count of every file. How many contexts of each
    target missed it by more than ``LENGTH_TOLERANCE`` is said (``say``).

    With ``context_lengths`` (in place of ``context_tokens``) the same questions at each length: that
    layout for each length under ``ctx<length>/``, and ``merged/{train,test}.parquet`` with every length.
    """
    tasks = tuple(tasks)
    lengths = tuple(sorted(set(context_lengths)))
    config = SynthConfig(
        lengths[-1] if lengths else context_tokens,
        min_hops,
        max_hops,
        keychain,
        seed,
        None if tokenizer is None else str(tokenizer),
        near_misses,
    )
    _check(tasks, config, lengths)
    jobs = [(t, i) for t in tasks for i in range(rows_per_task)]
    made = _make_rows(jobs, config, workers, lengths)
    by_task = {t: made[k * rows_per_task : (k + 1) * rows_per_task] for k, t in enumerate(tasks)}
    if not lengths:
        if line := length_misses(made, context_tokens):
            say(line)
        return write_task_splits(by_task, output_dir, test_ratio, seed)
    rows = {
        length: {t: [group[k] for group in groups] for t, groups in by_task.items()} for k, length in enumerate(lengths)
    }
    for length, rows_by_task in rows.items():
        if line := length_misses(
            [r for part in rows_by_task.values() for r in part], length, f" of {length_folder(length)}/"
        ):
            say(line)
    return write_splits(_length_splits(rows, test_ratio, seed), output_dir)
