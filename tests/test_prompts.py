import json
import os

import numpy as np
import pytest
from conftest import CORPUS, qa_row

from longqa.data.io import DataFileError, write_rows
from longqa.data.prompts import PromptOptions, prepare_prompts


def reference_ids(tokenizer, row) -> list[int]:
    """What transformers itself gives for the chat-templated prompt (verl does the same)."""
    return list(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"])


@pytest.fixture
def files(tmp_path):
    a = write_rows([qa_row(i, words=5 + 3 * i) for i in range(70)], tmp_path / "a.parquet")
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps(qa_row(100 + i, source="musique")) + "\n" for i in range(5)))
    return [a, b]


def test_ids_equal_the_tokenizer_reference_in_file_order(files, tokenizer):
    prompts = prepare_prompts(files, tokenizer, PromptOptions(max_prompt_length=10_000))
    rows = [qa_row(i, words=5 + 3 * i) for i in range(70)] + [qa_row(100 + i, source="musique") for i in range(5)]
    assert len(prompts) == 75 and prompts.stats.kept == 75 and prompts.stats.rows_read == 75
    for i, row in enumerate(rows):
        assert prompts.ids(i).tolist() == reference_ids(tokenizer, row)
        assert prompts.meta[i]["ground_truth"] == row["reward_model"]["ground_truth"]
        assert prompts.meta[i]["data_source"] == row["data_source"]
    assert prompts.meta[70]["file"] == 1 and prompts.meta[70]["row"] == 0
    assert prompts.stats.prompt_tokens == int(prompts.lengths.sum())
    assert prompts.stats.max_prompt_tokens == int(prompts.lengths.max())


def test_overlong_prompts_filtered_or_truncated(files, tokenizer):
    full = prepare_prompts(files, tokenizer, PromptOptions(max_prompt_length=10_000))
    limit = int(np.median(full.lengths))
    over = int((full.lengths > limit).sum())
    assert over > 0

    filtered = prepare_prompts(files, tokenizer, PromptOptions(limit))
    assert filtered.stats.overlong_filtered == over and len(filtered) == len(full) - over
    assert int(filtered.lengths.max()) <= limit

    for side in ("left", "right"):
        cut = prepare_prompts(files, tokenizer, PromptOptions(limit, filter_overlong_prompts=False, truncation=side))
        assert len(cut) == len(full) and cut.stats.truncated == over
        for i in range(len(full)):
            ids = full.ids(i).tolist()
            want = ids if len(ids) <= limit else (ids[-limit:] if side == "left" else ids[:limit])
            assert cut.ids(i).tolist() == want

    with pytest.raises(DataFileError, match=r"a.parquet, row \d+: prompt has \d+ tokens, over data.max_prompt_length"):
        prepare_prompts(files, tokenizer, PromptOptions(limit, filter_overlong_prompts=False, truncation="error"))
    with pytest.raises(DataFileError, match="no prompt left: 75 rows read, 75 over"):
        prepare_prompts(files, tokenizer, PromptOptions(3))


@pytest.mark.parametrize(
    "breakage, reason",
    [
        (lambda r: r.update(prompt=[]), "'prompt' must be a non-empty list"),
        (lambda r: r.update(prompt=[{"role": "robot", "content": "x"}]), "'prompt[0].role' is 'robot'"),
        (
            lambda r: r["reward_model"].update(ground_truth=None),
            "'reward_model.ground_truth' must be a string or a list",
        ),
        (
            lambda r: r["reward_model"].update(ground_truth=["ok", ""]),
            "'reward_model.ground_truth' must be a non-empty list of non-empty strings",
        ),
        (lambda r: r.pop("data_source"), "'data_source' must be a non-empty string"),
        (
            lambda r: r.update(prompt=[{"role": "system", "content": "only a system message"}]),
            "'prompt' has no user message",
        ),
    ],
)
def test_bad_rows_stop_with_file_row_reason_or_are_skipped(tmp_path, tokenizer, breakage, reason):
    rows = [qa_row(i) for i in range(6)]
    breakage(rows[4])
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataFileError) as e:
        prepare_prompts([path], tokenizer, PromptOptions(1000))
    assert f"bad.jsonl, row 4: {reason}" in str(e.value)
    skipped = prepare_prompts([path], tokenizer, PromptOptions(1000, skip_bad_rows=True))
    assert skipped.stats.bad_rows == 1 and len(skipped) == 5 and [m["row"] for m in skipped.meta] == [0, 1, 2, 3, 5]


def test_missing_and_unreadable_files(tmp_path, tokenizer):
    with pytest.raises(DataFileError, match="nope.parquet: no such file"):
        prepare_prompts([tmp_path / "nope.parquet"], tokenizer, PromptOptions(100))
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not a parquet file")
    with pytest.raises(DataFileError, match="junk.parquet: cannot be read"):
        prepare_prompts([junk], tokenizer, PromptOptions(100))
    with pytest.raises(DataFileError, match="no data files given"):
        prepare_prompts([], tokenizer, PromptOptions(100))


def test_cache_hits_only_when_files_tokenizer_and_options_match(files, tokenizer, tmp_path):
    from longqa.model.tokenizer import train_tokenizer

    cache = tmp_path / "cache"
    options = PromptOptions(10_000)
    cold = prepare_prompts(files, tokenizer, options, cache_dir=cache)
    warm = prepare_prompts(files, tokenizer, options, cache_dir=cache)
    assert not cold.stats.cache_hit and warm.stats.cache_hit
    assert np.array_equal(cold.token_ids, warm.token_ids) and cold.meta == warm.meta
    assert np.array_equal(cold.offsets, warm.offsets) and warm.stats.kept == cold.stats.kept

    assert not prepare_prompts(files, tokenizer, PromptOptions(9_999), cache_dir=cache).stats.cache_hit
    other = train_tokenizer(CORPUS[:3], vocab_size=300)
    assert not prepare_prompts(files, other, options, cache_dir=cache).stats.cache_hit

    rows = [qa_row(i, words=5 + 3 * i) for i in range(70)]
    rows[3]["reward_model"]["ground_truth"] = ["changed"]
    write_rows(rows, files[0])  # same name, new content
    changed = prepare_prompts(files, tokenizer, options, cache_dir=cache)
    assert not changed.stats.cache_hit and changed.meta[3]["ground_truth"] == ["changed"]


def test_interrupted_cache_entry_is_not_trusted(files, tokenizer, tmp_path):
    cache = tmp_path / "cache"
    first = prepare_prompts(files, tokenizer, PromptOptions(10_000), cache_dir=cache)
    entry = cache / "prompts" / first.stats.cache_path.rsplit("/", 1)[-1]
    (entry / "stats.json").unlink()  # what a kill during the final write leaves
    again = prepare_prompts(files, tokenizer, PromptOptions(10_000), cache_dir=cache)
    assert not again.stats.cache_hit and np.array_equal(first.token_ids, again.token_ids)


def test_ranks_preparing_one_cache_entry_at_once_keep_the_first(files, tokenizer, tmp_path, monkeypatch):
    """Two ranks start on a cold cache; while the second tokenizes, the first commits its entry and opens
    it. The second must then keep that entry (it once deleted it under the first: "No such file")."""
    import longqa.data.prompts as prompts_module

    cache, options = tmp_path / "cache", PromptOptions(10_000)
    tokenize, first = prompts_module._tokenize, []

    def slow_tokenize(*args):
        stats = tokenize(*args)
        if not first:  # the other rank (tokenizing at normal speed) finishes meanwhile
            first.append(None)
            with monkeypatch.context() as other_rank:  # its own process id, so its own work folder
                other_rank.setattr(os, "getpid", lambda: 1)
                first[0] = prepare_prompts(files, tokenizer, options, cache_dir=cache)
            first.append(os.stat(first[0].token_ids.filename).st_ino)  # the file the first rank has open
        return stats

    monkeypatch.setattr(prompts_module, "_tokenize", slow_tokenize)
    second = prepare_prompts(files, tokenizer, options, cache_dir=cache)
    entry = cache / "prompts" / first[0].stats.cache_path.rsplit("/", 1)[-1]
    assert os.stat(entry / "tokens.int32").st_ino == first[1]  # still the first rank's file, not replaced
    assert np.array_equal(first[0].token_ids, second.token_ids) and first[0].meta == second.meta
    assert [p.name for p in (cache / "prompts").iterdir()] == [entry.name]  # the second's copy is gone


def test_files_written_by_verl_recipes_load_unchanged(tmp_path, tokenizer):
    """verl's preprocessing scripts write parquet through `datasets` (and older ones through pandas)."""
    rows = [qa_row(i) for i in range(8)]
    for r in rows:
        r["reward_model"]["ground_truth"] = r["reward_model"]["ground_truth"][0]  # verl's gsm8k-style string
    paths = []
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "hf.parquet"))
    paths.append(tmp_path / "hf.parquet")
    pd = pytest.importorskip("pandas")
    pd.DataFrame(rows).to_parquet(tmp_path / "pd.parquet")
    paths.append(tmp_path / "pd.parquet")
    prompts = prepare_prompts(paths, tokenizer, PromptOptions(1000))
    assert len(prompts) == 16
    for i in range(16):
        assert prompts.ids(i).tolist() == reference_ids(tokenizer, rows[i % 8])
        assert prompts.meta[i]["ground_truth"] == f"Person {i % 8}"


def rows_at_lengths(lengths=(256, 512, 1024), sources=("hotpotqa", "musique", "2wikimqa")) -> list[dict]:
    """The same questions at several context lengths, as `longqa data synth --context-lengths` writes them:
    ``target_tokens`` in extra_info, longer contexts at longer lengths, a different length per question."""
    rows = []
    for length in lengths:
        for q, source in enumerate(sources):
            row = qa_row(q, words=length // 16 + 4 * q, source=source)
            row["extra_info"]["target_tokens"] = length
            rows.append(row)
    return rows


def expected_tallies(rows, limit: int, mode: str, tokenizer) -> dict[str, dict]:
    """From the tokenizer's own lengths: per data_source and per target_tokens, [rows, dropped, truncated]; a
    bad row (no user message here) counts as dropped, under the source and length it names."""
    out = {"data_source": {}, "target_tokens": {}}
    for row in rows:
        bad = not any(m["role"] == "user" for m in row["prompt"])
        over = not bad and len(reference_ids(tokenizer, row)) > limit
        for group, key in (
            ("data_source", row.get("data_source") or "(no data_source)"),
            ("target_tokens", row["extra_info"].get("target_tokens")),
        ):
            if key is None:
                continue
            counts = out[group].setdefault(key, [0, 0, 0])
            counts[0] += 1
            counts[1] += bad or (over and mode == "filter")
            counts[2] += over and mode == "truncate"
    return out


def said(key, rows: int, dropped: int, truncated: int) -> str:
    parts = ([f"{dropped} of {rows} dropped" + (", none left" if dropped == rows else "")] if dropped else []) + (
        [f"{truncated} of {rows} truncated"] if truncated else []
    )
    return f"{key}: {' and '.join(parts)}"


def limits_that_cut(rows, tokenizer) -> list[int]:
    """Every limit that keeps a different set of prompts whole: each good row's prompt length, longest first."""
    return sorted(
        {len(reference_ids(tokenizer, r)) for r in rows if any(m["role"] == "user" for m in r["prompt"])}, reverse=True
    )


@pytest.mark.parametrize("mode", ["filter", "truncate"])
def test_every_row_not_kept_whole_is_counted_per_source_and_length(tmp_path, tokenizer, mode):
    """At every limit that changes what is kept, overlong rows filtered or truncated and bad rows skipped are
    counted per data_source and per target_tokens, and the lines a run prints say each count."""
    from longqa.data.prompts import describe_losses, tally

    rows = rows_at_lengths()
    rows.append(qa_row(90, source="musique"))  # no target_tokens: counted per source alone
    broken = qa_row(91, source="hotpotqa")
    broken["prompt"] = broken["prompt"][:1]  # no user message: a bad row
    broken["extra_info"]["target_tokens"] = 512
    nameless = qa_row(92)
    nameless["prompt"], nameless["data_source"] = nameless["prompt"][:1], None
    rows += [broken, nameless]
    path = write_rows(rows, tmp_path / "rows.parquet")
    for limit in limits_that_cut(rows, tokenizer):
        options = PromptOptions(limit, filter_overlong_prompts=mode == "filter", skip_bad_rows=True)
        prompts = prepare_prompts([path], tokenizer, options)
        lines = describe_losses(prompts, "training prompts", options)
        expected = expected_tallies(rows, limit, mode, tokenizer)
        for group, by_key in expected.items():
            got = {key: [t.rows, t.dropped, t.truncated] for key, t in tally(prompts, group).items()}
            assert got == by_key, (limit, group)
            listed = [said(key, *counts) for key, counts in sorted(by_key.items()) if counts[1] or counts[2]]
            line = next((x for x in lines if x.startswith(f"  by {group}: ")), None)
            assert (line and line.removeprefix(f"  by {group}: ").split("; ")) == (listed or None), (limit, lines)
        dropped = sum(c[1] for c in expected["data_source"].values())
        truncated = sum(c[2] for c in expected["data_source"].values())
        assert lines[0].startswith(f"training prompts: {len(rows) - dropped} of {len(rows)} kept; ")
        assert "2 bad rows dropped (data.skip_bad_rows=true)" in lines[0]
        assert (f"{dropped - 2} dropped over data.max_prompt_length={limit}" in lines[0]) == (dropped > 2)
        assert (f"{truncated} truncated to data.max_prompt_length={limit}" in lines[0]) == (truncated > 0)


def test_a_set_that_lost_nothing_says_so(files, tokenizer):
    from longqa.data.prompts import describe_losses

    options = PromptOptions(10_000)
    assert describe_losses(prepare_prompts(files, tokenizer, options), "validation prompts", options) == [
        "validation prompts: all 75 kept whole"
    ]


@pytest.mark.parametrize("mode", ["filter", "truncate"])
def test_a_validation_set_that_loses_rows_is_said_and_named_in_its_metrics(tmp_path, tokenizer, mode):
    """At every limit that changes what is kept: what a validation set loses (dropped or cut rows, of any
    source, with a context length or without) is said per source and length before anything loads, and each
    source and length that dropped some rows but not all gets the metric suffix saying how many it scores (a
    bucket that dropped every row gets none: it is not scored; a cut row is scored, no loss). Training prompts
    are said alike."""
    from longqa.config import load_config
    from longqa.train.trainer import load_prompts, lost_row_suffixes, validation_metric

    rows = rows_at_lengths() + [qa_row(90 + i, words=30 + 30 * i, source="musique") for i in range(3)]
    val = write_rows(rows, tmp_path / "val.parquet")
    train = write_rows(rows_at_lengths(), tmp_path / "train.parquet")
    partial_limits = 0
    for limit in limits_that_cut(rows, tokenizer):
        base = [
            f"data.max_prompt_length={limit}",
            f"data.filter_overlong_prompts={mode == 'filter'}",
            "data.train_batch_size=1",
            "actor.ppo_mini_batch_size=1",
            f"data.cache_dir={tmp_path / 'cache'}",
        ]
        said_lines = []
        expected = expected_tallies(rows, limit, mode, tokenizer)
        sources = [said(k, *c) for k, c in sorted(expected["data_source"].items()) if c[1] or c[2]]
        cfg = load_config(None, [*base, f"data.train_files={train}", f"data.val_files={val}"])
        _, kept = load_prompts(cfg, tokenizer, say=said_lines.append)
        assert len(kept) == len(rows) - sum(c[1] for c in expected["data_source"].values())
        suffixes = {
            (group, key): f"_whole_{c[0] - c[1]}_of_{c[0]}"
            for group, counts in expected.items()
            for key, c in counts.items()
            if 0 < c[1] < c[0]
        }  # dropped some, not all
        assert lost_row_suffixes(kept) == suffixes
        val_lines = said_lines[said_lines.index(next(x for x in said_lines if x.startswith("validation"))) :]
        assert (f"  by data_source: {'; '.join(sources)}" in val_lines) == bool(sources)
        names = [
            validation_metric(group, key, suffix)
            for (group, key), suffix in sorted(  # in the order said: by group, key
                suffixes.items(), key=lambda item: (item[0][0] != "data_source", item[0][1])
            )
        ]
        if names:
            assert any(names[0] in line for line in val_lines)
        else:
            assert not any("validation logs" in line for line in val_lines)
        partial_limits += bool(suffixes)
        # training alone: what it lost is said
        said_lines.clear()
        load_prompts(load_config(None, [*base, f"data.train_files={train}"]), tokenizer, say=said_lines.append)
        assert said_lines[0].startswith("training prompts: ")
    # both outcomes were met (truncating drops no row: never a suffix)
    assert (0 < partial_limits < len(limits_that_cut(rows, tokenizer))) if mode == "filter" else not partial_limits
