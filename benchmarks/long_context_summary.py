"""The summary of ``long_context_rl_gpu.sh``: held-out accuracy per context length of the starting model,
the supervised model and the GRPO-trained one, on the same questions, with the gain GRPO made over the model
it started from and each stage's wall time.

    python benchmarks/long_context_summary.py OUT_DIR

reads the script's ``longqa eval --output`` files (``eval_start.json``, ``eval_sft.json``, ``eval_grpo.json``;
a run stopped before GRPO has no ``eval_grpo.json``, a run without a supervised stage no ``eval_sft.json``) and
``timings.tsv`` in OUT_DIR, and writes ``summary.json``, ``summary.md`` and ``accuracy_by_length.png`` there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODELS = {"start": "eval_start.json", "sft": "eval_sft.json", "grpo": "eval_grpo.json"}
HEADINGS = {"start": "starting model", "sft": "supervised", "grpo": "after GRPO"}


def _groups(result: dict, grouping: str, key: str) -> dict[int, dict]:
    return {g[key]: g for g in result.get(grouping, ())}


def _compare(results: dict[str, dict], grouping: str, key: str) -> list[dict]:
    """One row per value of ``key``: each model's accuracy, and GRPO's gain over the supervised model. A
    value some model lacks, or was scored on with a different number of questions, means the evaluations
    did not ask the same questions: refused."""
    by_model = {name: _groups(r, grouping, key) for name, r in results.items()}
    values = sorted(set.union(*(set(groups) for groups in by_model.values())))
    rows = []
    for value in values:
        counts = {name: groups[value]["n"] if value in groups else None for name, groups in by_model.items()}
        if len(set(counts.values())) != 1 or None in counts.values():
            raise ValueError(f"{key}={value}: the evaluations answered different questions (counts {counts})")
        row = {key: value, "n": counts["start"]}
        row.update({name: groups[value]["accuracy"] for name, groups in by_model.items()})
        if "grpo" in row:
            row["gain"] = row["grpo"] - row[_baseline(row)]
        rows.append(row)
    return rows


def _baseline(accuracies: dict) -> str:
    """The model GRPO started from: the supervised one, or the starting model when there was no supervised stage."""
    return "sft" if "sft" in accuracies else "start"


def read_timings(path: Path) -> tuple[dict[str, float], float]:
    """Each stage's seconds, from ``stage<TAB>start<TAB>end`` lines (epoch seconds), and the wall time from
    the first start to the last end: stages that ran side by side count once."""
    spans = {}
    for line in path.read_text().splitlines():
        if line.strip():
            stage, start, end = line.split("\t")
            spans[stage] = (float(start), float(end))
    wall = max(e for _, e in spans.values()) - min(s for s, _ in spans.values()) if spans else 0.0
    return {stage: end - start for stage, (start, end) in spans.items()}, wall


def summarize(out_dir: str | Path) -> dict:
    out = Path(out_dir)
    results = {
        name: json.loads((out / file).read_text())
        for name, file in MODELS.items()
        if name == "start" or (out / file).is_file()
    }
    overall = {name: r["all"]["accuracy"] for name, r in results.items()}
    summary = {
        "by_length": _compare(results, "by_length", "target_tokens"),
        "by_hops": _compare(results, "by_hops", "hops"),
        "all": {"n": results["start"]["all"]["n"], **overall},
    }
    if "grpo" in overall:
        summary["all"]["gain"] = overall["grpo"] - overall[_baseline(overall)]
    summary["timings_s"], summary["wall_s"] = read_timings(out / "timings.tsv")
    return summary


def _table(rows: list[dict], key: str, label: str) -> list[str]:
    models = [m for m in MODELS if rows and m in rows[0]]
    gain = "gain" in rows[0] if rows else False
    start = "supervised" if "sft" in models else "starting model"
    columns = [label, "questions", *(HEADINGS[m] for m in models)] + ([f"GRPO - {start}"] if gain else [])
    lines = ["| " + " | ".join(columns) + " |", "|" + " ---: |" * len(columns)]
    for row in rows:
        cells = [str(row[key]), str(row["n"]), *(f"{row[m]:.3f}" for m in models)]
        lines.append("| " + " | ".join(cells + ([f"{100 * row['gain']:+.1f} points"] if gain else [])) + " |")
    return lines


def markdown(summary: dict) -> str:
    everything = {"target_tokens": "all", **summary["all"]}
    lines = [
        "# Long-context GRPO: held-out accuracy (greedy, hardened reward)",
        "",
        *_table([*summary["by_length"], everything], "target_tokens", "context tokens"),
        "",
        *_table(summary["by_hops"], "hops", "hops"),
        "",
        "| stage | seconds |",
        "| --- | ---: |",
    ]
    lines += [f"| {stage} | {seconds:.0f} |" for stage, seconds in summary["timings_s"].items()]
    lines.append(f"| **wall time** | **{summary['wall_s']:.0f}** |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    """Accuracy against context length, one line per model: what supervised training and GRPO each added."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["by_length"]
    lengths = [r["target_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, heading in HEADINGS.items():
        if rows and name in rows[0]:
            ax.plot(lengths, [r[name] for r in rows], marker="o", label=heading)
    ax.set(
        xscale="log",
        xlabel="context tokens",
        ylabel="held-out accuracy",
        ylim=(0, 1),
        title=f"Accuracy by context length ({rows[0]['n'] if rows else 0} questions each)",
    )
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    out = Path(parser.parse_args().out_dir)
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    text = markdown(summary)
    (out / "summary.md").write_text(text)
    plot(summary, out / "accuracy_by_length.png")
    print(text, end="")


if __name__ == "__main__":
    main()
