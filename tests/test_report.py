"""Metric sinks (JSONL, console, TensorBoard, W&B) and the report made from metrics.jsonl."""

from __future__ import annotations

import io
import json
import struct
import sys
import types

import numpy as np
import pytest
import torch

from longqa.train.report import SINKS, MetricsLogger, read_metrics, write_report

STEP = {
    "reward/mean": 0.5,
    "reward/full_fraction": 0.375,
    "response_length/mean": 812.4,
    "response_length/max": 2048,
    "perf/tokens_per_s": 1234.4,
    "time/step_s": 2.0,
}


def jsonl_steps(run_dir) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]


def test_jsonl_holds_one_plain_record_per_step_flushed_at_once(tmp_path):
    with MetricsLogger(tmp_path, ["jsonl"], total_steps=10) as logger:
        logger.log(1, {"reward/mean": torch.tensor(0.5), "accuracy": np.float64(0.25), "note": "warmup"})
        first = (tmp_path / "metrics.jsonl").read_text()  # before close: flushed per step
        logger.log(2, {"reward/mean": 0.75, "time/step_s": 9.5})
    assert json.loads(first)["reward/mean"] == 0.5
    one, two = read_metrics(tmp_path / "metrics.jsonl")
    assert one["step"] == 1 and one["accuracy"] == 0.25 and one["note"] == "warmup"
    assert isinstance(one["time/step_s"], float)
    assert two == {"step": 2, "time/step_s": 9.5, "reward/mean": 0.75}


def test_resume_truncates_jsonl_to_the_resumed_step(tmp_path):
    with MetricsLogger(tmp_path, ["jsonl"], total_steps=10) as logger:
        for step in range(1, 6):
            logger.log(step, {"reward/mean": step / 10})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')  # the crash cut the last line short

    with MetricsLogger(tmp_path, ["jsonl"], total_steps=10, resume_step=3) as logger:
        assert jsonl_steps(tmp_path) == [1, 2, 3]
        logger.log(4, {"reward/mean": 0.9})
    assert jsonl_steps(tmp_path) == [1, 2, 3, 4]

    MetricsLogger(tmp_path, ["jsonl"], total_steps=10).close()  # a fresh run starts a fresh file
    assert jsonl_steps(tmp_path) == []


def test_console_prints_one_line_per_step_when_not_a_terminal(tmp_path, capsys):
    with MetricsLogger(tmp_path, ["console"], total_steps=10) as logger:
        logger.log(2, STEP)
        logger.log(3, {"reward/mean": 0.25, "val/accuracy": 0.5, "time/step_s": 4.0})
    assert capsys.readouterr().out.splitlines() == [
        "step 2/10 | reward 0.500 | full reward 37.5% | len 812 | 1,234 sample tok/s | ETA 0:00:16",
        "step 3/10 | reward 0.250 | val/accuracy 0.500 | ETA 0:00:21",  # 7 steps left at the mean of 2 s and 4 s
    ]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_eta_counts_training_steps_not_the_validation_before_them(tmp_path, capsys):
    """The validation before the first step (logged as step 0) takes longer than a step: counted as one, it made
    the first ETAs several times too long."""
    with MetricsLogger(tmp_path, ["console"], total_steps=40) as logger:
        logger.log(0, {"val/accuracy": 0.5, "time/step_s": 38.0})
        logger.log(1, {**STEP, "time/step_s": 9.0})
        logger.log(2, {**STEP, "time/step_s": 11.0})
    assert [line.rpartition(" | ")[2] for line in capsys.readouterr().out.splitlines()] == [
        "val/accuracy 0.500",
        "ETA 0:05:51",
        "ETA 0:06:20",
    ]  # 39 steps of 9 s, then 38 of the mean 10 s


def test_console_shows_reward_errors_when_there_are_any(tmp_path, capsys):
    with MetricsLogger(tmp_path, ["console"], total_steps=2) as logger:
        logger.log(1, {**STEP, "reward_errors": 3})
        logger.log(2, {**STEP, "reward_errors": 0})
    first, second = capsys.readouterr().out.splitlines()
    assert "| reward errors 3 |" in first and "reward errors" not in second


def test_console_rewrites_its_line_on_a_terminal(tmp_path, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    with MetricsLogger(tmp_path, ["console"], total_steps=None) as logger:
        logger.log(1, {"reward/mean": 0.125, "time/step_s": 1.0})
        logger.log(2, {"reward/mean": 0.25, "val/accuracy": 0.5, "time/step_s": 1.0})  # kept: ends its line
        logger.log(3, {"reward/mean": 0.5, "time/step_s": 1.0})
    assert screen.getvalue() == (
        "\rstep 1 | reward 0.125\rstep 2 | reward 0.250 | val/accuracy 0.500\n\rstep 3 | reward 0.500\n"
    )


def test_unknown_sink_is_refused_with_the_allowed_ones(tmp_path):
    assert SINKS == ("console", "jsonl", "tensorboard", "wandb")
    with pytest.raises(ValueError, match="unknown logger sink.*stdout; allowed: console, jsonl, tensorboard, wandb"):
        MetricsLogger(tmp_path, ["jsonl", "stdout"], total_steps=None)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, ["tensorboard"], total_steps=2) as logger:
        logger.log(1, STEP)
        logger.log(2, {**STEP, "note": "not a number"})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


@pytest.mark.parametrize(
    "sink, module, package", [("tensorboard", "torch.utils.tensorboard", "tensorboard"), ("wandb", "wandb", "wandb")]
)
def test_a_missing_optional_package_is_named_before_anything_changes(tmp_path, monkeypatch, sink, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail as if not installed
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ImportError, match=f"'{sink}' logger needs the {package} package: pip install {package}"):
        MetricsLogger(tmp_path, ["jsonl", sink], total_steps=None)
    assert jsonl_steps(tmp_path) == [1]


def fake_wandb(calls: list):
    def init(**kwargs):
        calls.append(("init", kwargs))
        return types.SimpleNamespace(
            log=lambda data, step: calls.append(("log", step, data)), finish=lambda: calls.append(("finish",))
        )

    return types.SimpleNamespace(init=init)


def test_wandb_gets_config_numbers_and_keeps_its_run_id_across_a_resume(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    config = {"trainer": {"seed": 1}}
    with MetricsLogger(tmp_path, ["wandb"], total_steps=5, config=config, project="p", name="run-1") as logger:
        logger.log(1, {"reward/mean": 0.5, "note": "text is not sent", "time/step_s": 1.0})
    (_, init), log, finish = calls
    assert init == {
        "project": "p",
        "name": "run-1",
        "config": config,
        "dir": str(tmp_path),
        "id": init["id"],
        "resume": "allow",
    }
    assert log == ("log", 1, {"time/step_s": 1.0, "reward/mean": 0.5}) and finish == ("finish",)

    calls.clear()
    MetricsLogger(tmp_path, ["wandb"], total_steps=5, resume_step=1).close()
    assert calls[0][1]["id"] == init["id"]
    calls.clear()
    MetricsLogger(tmp_path, ["wandb"], total_steps=5).close()
    assert calls[0][1]["id"] != init["id"]


def png_size(path) -> tuple[int, int]:
    """Width and height from a PNG's header, after checking its signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def write_metrics(run_dir, records, tail: str = "") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_write_report_plots_and_summarises(tmp_path):
    records = [
        {
            "step": s,
            "reward/mean": s / 20,
            "reward/full_fraction": s / 40,
            "response_length/mean": 100.0 + s,
            "response_length/max": 200 + 2 * s,
            "perf/tokens_per_s": 1000.0,
            "time/step_s": 3.0,
        }
        for s in range(1, 21)
    ]
    for r in records[4::5]:
        r["val/accuracy"] = r["step"] / 50
    records[9]["reward/mean"] = float("nan")  # a bad step must not become the "best"
    stale = {"step": 3, "reward/mean": 99.0, "time/step_s": 3.0}  # rewritten after a resume: the last counts
    write_metrics(tmp_path, [*records[:5], stale, *records[2:]], tail='{"step": 21, "re')

    summary = write_report(tmp_path)
    assert summary == tmp_path / "report" / "summary.md"
    for name in ("reward.png", "accuracy.png", "response_length.png"):
        assert png_size(tmp_path / "report" / name) == (700, 400)
    text = summary.read_text()
    assert "- steps: 20 (last step 20)" in text and "- total time: 0:01:00" in text
    assert "| reward/mean | 0.05 | 1 | 1 (step 20) |" in text
    assert "| val/accuracy | 0.1 | 0.4 | 0.4 (step 20) |" in text
    assert "| response_length/max | 202 | 240 | — |" in text
    assert "| reward/full_fraction | 0.025 | 0.5 | 0.5 (step 20) |" in text
    assert "![accuracy](accuracy.png)" in text


def test_the_report_counts_training_steps_not_the_validation_before_them(tmp_path):
    write_metrics(
        tmp_path,
        [
            {"step": 0, "val/accuracy": 0.1, "time/step_s": 1.0},
            *({"step": s, "reward/mean": 0.5, "time/step_s": 2.0} for s in (1, 2)),
        ],
    )
    assert "- steps: 2 (last step 2)" in write_report(tmp_path).read_text()


def test_write_report_draws_accuracy_by_length_at_the_first_and_last_validation(tmp_path):
    from longqa.train.report import _length_curves

    records = [{"step": s, "reward/mean": 0.5, "time/step_s": 1.0} for s in range(0, 31)]
    for r in records[::10]:  # validations at steps 0, 10, 20, 30; 30 measured no length
        r["val/accuracy"] = 0.5
        if r["step"] < 30:
            r.update({f"val/accuracy@{n}": (r["step"] + 10) / n for n in (4096, 512, 1024, 2048)})
    records[20]["val/accuracy@4096"] = float("nan")
    write_metrics(tmp_path, records)

    keys = ["val/accuracy@512", "val/accuracy@1024", "val/accuracy@2048", "val/accuracy@4096"]
    assert _length_curves(records, keys) == {
        0: ([512, 1024, 2048, 4096], [10 / 512, 10 / 1024, 10 / 2048, 10 / 4096]),
        20: ([512, 1024, 2048], [30 / 512, 30 / 1024, 30 / 2048]),
    }
    text = write_report(tmp_path).read_text()
    assert png_size(tmp_path / "report" / "accuracy_by_length.png") == (700, 400)
    assert text.splitlines()[-1] == "![accuracy_by_length](accuracy_by_length.png)"
    table = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| val/")]
    assert table == ["| val/accuracy", *[f"| {k}" for k in keys]]


def test_write_report_plots_only_what_was_logged(tmp_path):
    write_metrics(tmp_path, [{"step": s, "reward/mean": 0.1 * s} for s in (1, 2)])
    text = write_report(tmp_path).read_text()
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["reward.png", "summary.md"]
    assert "accuracy" not in text and "- total time: 0:00:00" in text

    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        write_report(tmp_path / "elsewhere")
