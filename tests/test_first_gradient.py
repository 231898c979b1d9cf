"""``benchmarks/first_gradient.py``: the prompt variants it asks, and counts that agree with the answers it wrote."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq

from longqa.cli import main as longqa

ROOT = Path(__file__).resolve().parent.parent


def _probe():
    spec = importlib.util.spec_from_file_location("first_gradient", ROOT / "benchmarks" / "first_gradient.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _data(tmp_path) -> Path:
    assert (
        longqa(
            [
                "data",
                "synth",
                "--output-dir",
                str(tmp_path / "data"),
                "--rows-per-task",
                "2",
                "--tasks",
                "hotpotqa",
                "musique",
                "--context-lengths",
                "256",
                "--test-ratio",
                "0.5",
            ]
        )
        == 0
    )
    return tmp_path / "data" / "merged" / "test.parquet"


def test_prompt_variants_put_the_instruction_after_the_question_and_the_prefill_in_the_answer(tmp_path):
    from longqa.data.prompts import PromptOptions, prepare_prompts
    from longqa.model.load import EMBEDDED_MODEL, load_model_tokenizer

    tokenizer = load_model_tokenizer(EMBEDDED_MODEL)
    data = _data(tmp_path)
    row = pq.read_table(data).to_pylist()[0]
    system, question = row["prompt"][0]["content"], row["prompt"][-1]["content"]
    plain_ids = _probe().prompt_ids(row, tokenizer)
    assert plain_ids == prepare_prompts([str(data)], tokenizer, PromptOptions(16384)).ids(0).tolist()  # training's
    plain = tokenizer.decode(plain_ids)
    assert system in plain and plain.index(system) < plain.index(question)
    varied = tokenizer.decode(_probe().prompt_ids(row, tokenizer, " Box it.", system=False, prefill="<think>\n"))
    assert system not in varied and question + " Box it." in varied
    assert varied.endswith("<think>\n")  # after the question's end of turn and the assistant's opening:
    tail = plain[plain.rindex(question) + len(question) :]
    assert varied[varied.rindex(" Box it.") + len(" Box it.") :] == tail + "<think>\n"


def test_the_counts_are_those_of_the_answers_written_and_the_same_command_answers_alike(tmp_path, capsys):
    data = _data(tmp_path)
    from longqa.model.load import EMBEDDED_MODEL

    argv = [
        "--model",
        str(EMBEDDED_MODEL),
        "--data",
        str(data),
        "--prompts",
        "2",
        "-n",
        "3",
        "--max-new-tokens",
        "24",
        "--device",
        "cpu",
    ]
    summary = _probe().main([*argv, "--samples", str(tmp_path / "a.jsonl")])
    again = _probe().main([*argv, "--samples", str(tmp_path / "b.jsonl")])
    capsys.readouterr()
    records = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    assert summary["samples"] == len(records) == 6 and summary["prompts"] == 2
    assert summary["boxed"] == sum("\\boxed{" in r["response"] for r in records) > 0  # the embedded model boxes
    assert summary["rewarded"] == sum(r["score"] > 0 for r in records)
    assert summary["mean_reward"] == sum(r["score"] for r in records) / 6
    groups = [records[i : i + 3] for i in (0, 3)]
    assert summary["groups_with_gradient"] == sum(len({r["score"] for r in g}) > 1 for g in groups)
    assert sum(summary["reasons"].values()) == 6 and again["reasons"] == summary["reasons"]
