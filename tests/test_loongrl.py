import json
import math

import numpy as np
import pytest

from longqa.cli import main
from longqa.data.io import DataFileError, read_rows, write_rows
from longqa.data.loongrl import SUBSET_PAIRS, SourceError, prepare_loongrl
from longqa.data.schema import SYSTEM_PROMPT, with_system_prompt

SIZES = {
    "hotpotqa_qwen_0_2500": 31,
    "hotpotqa_distractor_2500_5000": 20,
    "musique_qwen_0_2500": 12,
    "musique_distractor_2500_5000": 9,
    "2wikipedia_qwen_0_2500": 40,
    "2wikipedia_distractor_2500_5000": 1,
}


def loongrl_row(subset: str, i: int) -> dict:
    """A row as the Hub subsets hold them: verl columns plus the raw columns the recipe drops."""
    return {
        "input": f"question {i}",
        "context": f"passages of {subset}",
        "answers": [f"answer {i}"],
        "data_source": f"custom_longcontext_needle_qa_{subset}",
        "prompt": [{"role": "user", "content": f"The following are given passages.\n...\n\nQuestion: {subset} {i}?"}],
        "ability": "longcontext_qa",
        "reward_model": {"style": "rule", "ground_truth": [f"{subset} answer {i}"]},
        "extra_info": {"index": i, "split": "train"},
    }


@pytest.fixture
def source(tmp_path):
    """Both layouts a local copy may have: a folder per subset (Hub style) and one jsonl file per subset."""
    root = tmp_path / "LoongRL-Train-Data"
    for k, (subset, n) in enumerate(SIZES.items()):
        rows = [loongrl_row(subset, i) for i in range(n)]
        if k % 2 == 0:
            write_rows(rows, root / subset / "train-00000-of-00001.parquet")
        else:
            root.mkdir(parents=True, exist_ok=True)
            (root / f"{subset}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_recipe_layout_counts_and_rows(source, tmp_path):
    out = tmp_path / "out"
    counts = prepare_loongrl(out, source=str(source), test_ratio=0.05, seed=42)
    merged = {"train": [], "test": []}
    for task, (first, second) in SUBSET_PAIRS.items():
        n = SIZES[first] + SIZES[second]
        n_test = math.ceil(0.05 * n)  # what datasets' train_test_split(test_size=0.05) gives
        assert counts[task] == {"train": n - n_test, "test": n_test}
        concatenated = [loongrl_row(first, i) for i in range(SIZES[first])] + [
            loongrl_row(second, i) for i in range(SIZES[second])
        ]
        permutation = np.random.default_rng(42).permutation(n)
        for split, idx in (("test", permutation[:n_test]), ("train", permutation[n_test:])):
            rows = read_rows(out / task / f"{split}.parquet")
            assert len(rows) == len(idx)
            for row, j in zip(rows, idx):
                want = concatenated[j]
                assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
                assert row["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPT}
                assert row["prompt"][1:] == want["prompt"]
                assert row["reward_model"] == want["reward_model"] and row["data_source"] == want["data_source"]
            merged[split] += rows
    for split in ("train", "test"):
        assert read_rows(out / "merged" / f"{split}.parquet") == merged[split]
    assert counts["merged"] == {"train": len(merged["train"]), "test": len(merged["test"])}


def test_split_matches_the_datasets_library(source, tmp_path):
    datasets = pytest.importorskip("datasets")
    prepare_loongrl(tmp_path / "out", source=str(source))
    first, second = SUBSET_PAIRS["hotpotqa"]
    rows = [loongrl_row(first, i) for i in range(SIZES[first])] + [loongrl_row(second, i) for i in range(SIZES[second])]
    split = datasets.Dataset.from_list(rows).train_test_split(test_size=0.05, seed=42)
    ours = read_rows(tmp_path / "out" / "hotpotqa" / "test.parquet")
    assert [r["prompt"][1:] for r in ours] == [r["prompt"] for r in split["test"]]


def test_same_seed_same_bytes_other_seed_other_split(source, tmp_path):
    prepare_loongrl(tmp_path / "a", source=str(source), seed=7)
    prepare_loongrl(tmp_path / "b", source=str(source), seed=7)
    prepare_loongrl(tmp_path / "c", source=str(source), seed=8)
    path = "hotpotqa/train.parquet"
    assert (tmp_path / "a" / path).read_bytes() == (tmp_path / "b" / path).read_bytes()
    assert read_rows(tmp_path / "a" / path) != read_rows(tmp_path / "c" / path)


def test_missing_subset_and_bad_row_are_named(source, tmp_path):
    (source / "musique_distractor_2500_5000.jsonl").unlink()
    with pytest.raises(SourceError, match="subset 'musique_distractor_2500_5000' not found"):
        prepare_loongrl(tmp_path / "out", source=str(source))
    bad = loongrl_row("musique_distractor_2500_5000", 0)
    bad["reward_model"] = {"style": "rule", "ground_truth": []}
    (source / "musique_distractor_2500_5000.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(DataFileError, match=r"musique_distractor_2500_5000.jsonl, row 0: 'reward_model.ground_truth'"):
        prepare_loongrl(tmp_path / "out", source=str(source))


def test_unreachable_hub_gives_one_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["data", "loongrl", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cannot download OldKingMeister/LoongRL-Train-Data" in err and "--source LOONGRL_DIR" in err
    assert main(["data", "loongrl", "--output-dir", str(tmp_path), "--source", str(tmp_path / "nope")]) == 2
    assert "neither a folder nor a Hub dataset id" in capsys.readouterr().err


def test_cli_writes_and_prints(source, tmp_path, capsys):
    assert main(["data", "loongrl", "--output-dir", str(tmp_path / "o"), "--source", str(source)]) == 0
    out = capsys.readouterr().out
    assert "merged/train.parquet" in out and (tmp_path / "o" / "2wikimqa" / "test.parquet").is_file()


def test_rows_with_a_system_message_keep_theirs_alone(source, tmp_path):
    """A local copy whose rows already open with a system message (prepared once already, say) gets no second
    one; every other row gets the recipe's."""
    prepared = tmp_path / "prepared"
    prepare_loongrl(prepared, source=str(source))
    again = tmp_path / "again"
    for subset in SIZES:
        rows = [
            dict(row, prompt=[{"role": "system", "content": "Answer briefly."}, *row["prompt"]]) if i % 2 else row
            for i, row in enumerate(loongrl_row(subset, i) for i in range(SIZES[subset]))
        ]
        write_rows(rows, again / f"{subset}.parquet")
    prepare_loongrl(tmp_path / "out", source=str(again))
    rows = read_rows(tmp_path / "out" / "merged" / "train.parquet")
    assert all([m["role"] for m in row["prompt"]].count("system") == 1 for row in rows)
    systems = {row["prompt"][0]["content"] for row in rows}
    assert systems == {SYSTEM_PROMPT, "Answer briefly."}
    prepared_row = read_rows(prepared / "merged" / "train.parquet")[0]
    assert with_system_prompt(prepared_row["prompt"]) == prepared_row["prompt"]  # prepared again: unchanged
