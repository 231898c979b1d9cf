"""Watching a run: per-step metrics to the console, a JSONL file, TensorBoard or Weights & Biases, and a
report (plots and a summary table) made from the JSONL file afterwards.

The trainer logs a flat dict per step. These keys are the ones the console line and the report know:

``reward/mean``                         mean reward of the step's responses
``reward/full_fraction``                fraction of the step's responses that earned a full reward (1 or more);
                                        the console's "full reward". With a reward of 0 or 1 it is reward/mean
``val/<name>``                          validation metrics, on the steps that ran validation; ``val/accuracy``
                                        (and per source and length) is the accuracy: the mean score of the
                                        greedy answers, which is the fraction answered right where scores are
                                        0 or 1, as ``longqa eval``'s ``acc``
``val/accuracy@<length>``               validation accuracy at one context length, when the validation rows
                                        carry one (``longqa data synth --context-lengths``); a source or
                                        length that dropped rows (too long, or bad) ends in ``_whole_<k>_of_<n>``
``response_length/mean``, ``/max``      response lengths in tokens
``perf/tokens_per_s``                   sample tokens per second of the step: each sample's prompt and response,
                                        a prompt counted once per sample (n times a group, as verl counts
                                        throughput), over the step's whole time; the console's "sample tok/s".
                                        Fewer are computed: the engine prefills a group's prompt once, and
                                        actor.shared_prompt packs it once for the update
``perf/update_tflops_per_gpu``          the update's model FLOPs (forward and backward, recompute not counted) per
                                        second of the update phase, per training GPU; dense decoders only
``perf/recompiles``, ``/graph_captures`` graphs compiled / decode steps captured in the step (0 once warm, but
                                        for captures in the step after a validation, whose one answer a
                                        prompt re-sizes the fast engine's KV stores)
``perf/max_memory_allocated_gb``,      the GPU's peak memory allocated / reserved by torch during the step (GiB,
``/max_memory_reserved_gb``             CUDA only), the most of any rank
``perf/host_memory_peak_gb``            the most host memory a rank's process has held so far (peak resident, GiB)
``reward_errors``                       reward calls that failed (scored 0); on the console line when any did
``time/step_s``                         seconds since the previous step; added by the logger unless given

Every other key is stored and forwarded to the sinks as it is.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from longqa.outputs.layout import METRICS_FILE, REPORT_DIR, WANDB_ID_FILE

__all__ = ["LENGTH_ACCURACY", "MetricsLogger", "SINKS", "read_metrics", "write_report"]

SINKS = ("console", "jsonl", "tensorboard", "wandb")
REWARD, FULL_REWARD, VAL_PREFIX = "reward/mean", "reward/full_fraction", "val/"
LENGTH_MEAN, LENGTH_MAX = "response_length/mean", "response_length/max"
TOKENS_PER_S, STEP_TIME, REWARD_ERRORS = "perf/tokens_per_s", "time/step_s", "reward_errors"
LENGTH_ACCURACY, LENGTH_PLOT = "val/accuracy@", "accuracy_by_length.png"


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _plain(metrics: dict) -> dict:
    """Tensors and numpy scalars as Python numbers, so every sink (and JSON) accepts them."""
    return {key: value.item() if hasattr(value, "item") else value for key, value in metrics.items()}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl file, skipping a last line cut short by a crash."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def _truncate_jsonl(path: Path, resume_step: int | None) -> None:
    """Drop the records after ``resume_step`` (all of them for a fresh run), so no step appears twice."""
    kept = (
        []
        if resume_step is None or not path.exists()
        else [r for r in read_metrics(path) if r.get("step", math.inf) <= resume_step]
    )
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)


def _import_summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError("the 'tensorboard' logger needs the tensorboard package: pip install tensorboard") from exc
    return SummaryWriter


def _import_wandb():
    try:
        import wandb
    except ImportError as exc:
        raise ImportError("the 'wandb' logger needs the wandb package: pip install wandb") from exc
    return wandb


class ConsoleLine:
    """One progress line per step: rewritten in place on a terminal, one printed line per step otherwise."""

    FIELDS = (
        (REWARD, "reward {:.3f}"),
        (FULL_REWARD, "full reward {:.1%}"),
        (LENGTH_MEAN, "len {:.0f}"),
        (TOKENS_PER_S, "{:,.0f} sample tok/s"),
    )

    def __init__(self, total_steps: int | None):
        self.total_steps = total_steps
        self.step_times: deque[float] = deque(maxlen=10)
        self.open_width = 0  # width of a line left without its newline on a terminal

    def format(self, step: int, record: dict) -> str:
        parts = [f"step {step}/{self.total_steps}" if self.total_steps else f"step {step}"]
        parts += [form.format(record[key]) for key, form in self.FIELDS if _is_number(record.get(key))]
        if _is_number(errors := record.get(REWARD_ERRORS)) and errors:  # a reward function failing, not scoring 0
            parts.append(f"reward errors {errors}")
        parts += [
            f"{key} {value}" if isinstance(value, int) else f"{key} {value:.3f}"
            for key, value in record.items()
            if key.startswith(VAL_PREFIX) and _is_number(value)
        ]  # (counts as counts)
        if self.total_steps and self.step_times:
            remaining = max(self.total_steps - step, 0)
            parts.append(f"ETA {_hms(remaining * sum(self.step_times) / len(self.step_times))}")
        return " | ".join(parts)

    def write(self, step: int, record: dict) -> None:
        """On a terminal, a validation step keeps its line (newline) so its numbers stay on screen. Step 0 is the
        validation before training, no step: its time is not counted into the ETA (which it has none of yet)."""
        if step > 0:
            self.step_times.append(record[STEP_TIME])
        line = self.format(step, record)
        out = sys.stdout
        if out.isatty():
            keep = any(key.startswith(VAL_PREFIX) for key in record)
            out.write("\r" + line.ljust(self.open_width) + ("\n" if keep else ""))
            self.open_width = 0 if keep else len(line)
        else:
            out.write(line + "\n")
        out.flush()

    def close(self) -> None:
        if self.open_width:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.open_width = 0


class MetricsLogger:
    """Sends each step's metrics to the chosen sinks (see ``SINKS``).

    ``resume_step``: the step of the checkpoint the run resumed from, None for a fresh run. Records after it
    are dropped from metrics.jsonl (all records for a fresh run) and from TensorBoard, so the steps that are
    redone after a crash appear once; W&B continues the run whose id is stored in the run folder.
    ``project`` and ``name``: the W&B project and the run's name there.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        sinks: list[str],
        total_steps: int | None,
        config: dict | None = None,
        *,
        resume_step: int | None = None,
        project: str = "longqa",
        name: str | None = None,
    ):
        unknown = [s for s in sinks if s not in SINKS]
        if unknown:
            raise ValueError(f"unknown logger sink(s) {', '.join(unknown)}; allowed: {', '.join(SINKS)}")
        # Optional packages are imported before anything is touched, so a missing one changes nothing.
        summary_writer = _import_summary_writer() if "tensorboard" in sinks else None
        wandb = _import_wandb() if "wandb" in sinks else None
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.last_time = time.monotonic()
        self.console = ConsoleLine(total_steps) if "console" in sinks else None
        self.jsonl = None
        if "jsonl" in sinks:
            path = self.run_dir / METRICS_FILE
            _truncate_jsonl(path, resume_step)
            self.jsonl = open(path, "a", encoding="utf-8")
        self.tensorboard = None
        if summary_writer is not None:
            purge_step = None if resume_step is None else resume_step + 1
            self.tensorboard = summary_writer(log_dir=str(self.run_dir / "tensorboard"), purge_step=purge_step)
        self.wandb = None
        if wandb is not None:
            self.wandb = wandb.init(
                project=project,
                name=name,
                config=config,
                dir=str(self.run_dir),
                id=self._wandb_id(resume_step),
                resume="allow",
            )

    def _wandb_id(self, resume_step: int | None) -> str:
        """The stored W&B run id when resuming (one W&B run per training run), else a new stored one."""
        path = self.run_dir / WANDB_ID_FILE
        if resume_step is not None and path.is_file():
            return path.read_text().strip()
        run_id = uuid.uuid4().hex[:12]
        path.write_text(run_id + "\n")
        return run_id

    def log(self, step: int, metrics: dict) -> None:
        """Record one step; ``time/step_s`` is measured here unless ``metrics`` has it."""
        now = time.monotonic()
        record = {"step": step, STEP_TIME: round(now - self.last_time, 3), **_plain(metrics)}
        self.last_time = now
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        numbers = {k: v for k, v in record.items() if k != "step" and _is_number(v)}
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)
        if self.console is not None:
            self.console.write(step, record)

    def close(self) -> None:
        if self.console is not None:
            self.console.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- report


def _figure():
    """A figure drawn by the Agg canvas directly: no display needed, and pyplot's global backend untouched."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("write_report needs matplotlib: pip install matplotlib") from exc
    fig = Figure(figsize=(7, 4), tight_layout=True)
    FigureCanvasAgg(fig)
    return fig


def _finite(value: Any) -> bool:
    """A number that can be drawn and ranked (a NaN from a bad step would hide the best value)."""
    return _is_number(value) and math.isfinite(value)


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of ``key``."""
    points = [(r["step"], r[key]) for r in records if _finite(r.get(key))]
    return [s for s, _ in points], [v for _, v in points]


def _plot(path: Path, title: str, ylabel: str, records: list[dict], keys: list[str]) -> bool:
    """One line per key that has values; no file when none has."""
    series = {key: _series(records, key) for key in keys}
    series = {key: xy for key, xy in series.items() if xy[0]}
    if not series:
        return False
    fig = _figure()
    ax = fig.add_subplot()
    for key, (steps, values) in series.items():
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=100)
    return True


def _length_of(key: str) -> int:
    return int(key[len(LENGTH_ACCURACY) :])


def _length_keys(records: list[dict]) -> list[str]:
    """The ``val/accuracy@<length>`` keys logged, shortest length first."""
    keys = {k for r in records for k in r if k.startswith(LENGTH_ACCURACY) and k[len(LENGTH_ACCURACY) :].isdigit()}
    return sorted(keys, key=_length_of)


def _length_curves(records: list[dict], keys: list[str]) -> dict[int, tuple[list[int], list[float]]]:
    """Step -> (lengths, accuracies) at the first and the last validation that measured accuracy by length:
    how much longer contexts cost at the start, and whether training narrowed the gap by the end."""
    validations = [r for r in records if any(_finite(r.get(k)) for k in keys)]
    curves = {}
    for record in validations if len(validations) <= 2 else (validations[0], validations[-1]):
        points = [(_length_of(k), record[k]) for k in keys if _finite(record.get(k))]
        curves[record["step"]] = ([n for n, _ in points], [v for _, v in points])
    return curves


def _plot_by_length(path: Path, records: list[dict], keys: list[str]) -> bool:
    """Accuracy against context length (log2 axis, a tick per length), one line per ``_length_curves``
    step; no file when no validation measured it."""
    curves = _length_curves(records, keys)
    if not curves:
        return False
    fig = _figure()
    ax = fig.add_subplot()
    for step, (lengths, values) in curves.items():
        ax.plot(lengths, values, marker="o", markersize=4, label=f"step {step}")
    lengths = sorted({n for ns, _ in curves.values() for n in ns})
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set(title="Validation accuracy by context length", xlabel="context tokens", ylabel="accuracy", ylim=(0, 1.05))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=100)
    return True


def _summary_row(records: list[dict], key: str, higher_is_better: bool) -> str | None:
    steps, values = _series(records, key)
    if not steps:
        return None
    best = "—"
    if higher_is_better:
        i = max(range(len(values)), key=lambda j: values[j])
        best = f"{values[i]:.4g} (step {steps[i]})"
    return f"| {key} | {values[0]:.4g} | {values[-1]:.4g} | {best} |"


def write_report(run_dir: str | os.PathLike) -> Path:
    """Plots and ``summary.md`` in ``run_dir/report/`` from ``run_dir/metrics.jsonl``; returns summary.md.

    Only what was logged is plotted; a step logged twice (an older file, resumed) counts once, the last.
    """
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}; log with the 'jsonl' sink to get a report")
    records = sorted({r["step"]: r for r in read_metrics(metrics) if "step" in r}.values(), key=lambda r: r["step"])
    out = run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    # Validation scores (accuracy, F1, overall and per data source) share the accuracy plot's 0-1 scale.
    val_keys = sorted(
        {k for r in records for k in r if k.startswith(VAL_PREFIX) and k.rsplit("/", 1)[-1] in ("accuracy", "f1")}
    )
    length_keys = _length_keys(records)  # their own plot: accuracy against length, not against step

    plots = {
        "reward.png": ("Reward", "reward", [REWARD, FULL_REWARD]),
        "accuracy.png": ("Validation accuracy", "accuracy", val_keys),
        "response_length.png": ("Response length", "tokens", [LENGTH_MEAN, LENGTH_MAX]),
    }
    written = [name for name, (title, ylabel, keys) in plots.items() if _plot(out / name, title, ylabel, records, keys)]
    if _plot_by_length(out / LENGTH_PLOT, records, length_keys):
        written.append(LENGTH_PLOT)

    rows = [
        (REWARD, True),
        (FULL_REWARD, True),
        *[(k, True) for k in (*val_keys, *length_keys)],
        (LENGTH_MEAN, False),
        (LENGTH_MAX, False),
        (TOKENS_PER_S, True),
    ]
    table = [row for key, better in rows if (row := _summary_row(records, key, better))]
    total_time = sum(r[STEP_TIME] for r in records if _is_number(r.get(STEP_TIME)))
    steps = [r for r in records if r["step"] > 0]  # step 0 holds the validation before the first step
    lines = [
        f"# Run report: {run_dir.name}",
        "",
        f"- steps: {len(steps)}" + (f" (last step {steps[-1]['step']})" if steps else ""),
        f"- total time: {_hms(total_time)}",
        "",
    ]
    if table:
        lines += ["| metric | first | last | best |", "|---|---|---|---|", *table, ""]
    lines += [f"![{name[:-4]}]({name})" for name in written]
    summary = out / "summary.md"
    summary.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return summary
