"""Predicted against measured peak memory of one training micro-batch, on the current device.

For a grid of random-weight models built from shapes (``longqa.model.shapes``: SmolLM2-135M's
``smollm2-135m``, Qwen3's; with vocabularies from 1K to 152K entries and fewer layers where asked), it runs
one micro-batch of the GRPO update (the actor's packed micro-batch, forward, PPO-clip loss, backward) and
one ``longqa sft`` step (the chunked loss and its backward), each once to warm up and once measured, and
prints a table: the bytes ``activation_bytes`` predicts (``planning/activations.py``: the activations and
LM-head terms that ``longqa train``'s and ``longqa sft``'s memory checks count), the peak measured above the
weights and their gradients, and their ratio. The count is meant as an upper bound that is not far above:
every row should have a ratio from 1 to 1.5, and the script exits with status 1 when one does not.

How the peak is measured (``longqa.bench.memory.peak_bytes``): on CUDA, ``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats``, less what was allocated before; on the CPU, the largest running total of
the CPU allocator that torch's profiler reports with its allocation events (``profile_memory=True``), which
counts only blocks allocated while it records: exact to the byte, kernels' scratch tensors included.

    python benchmarks/memory_check.py                       # the CPU grid: about two minutes on two cores
    python benchmarks/memory_check.py --device cuda --grid gpu --output runs/memory-check  # one GPU (H200)
    python benchmarks/memory_check.py --rows 0 4                # rows 0 and 4 of the grid alone

``--output`` writes ``memory_check.json`` (every row, its parts and settings) and ``memory_check.md`` (the
table) into that folder. On a GPU a row whose prediction is over the free memory is skipped, and an
out-of-memory error is recorded as such (an under-count: the row fails); a row that fails otherwise is
recorded and the others run.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

MIB = 2**20
TINY = "qwen3-tiny"
SMOL = "smollm2-135m"

# (path, settings): grpo takes prompt, response, n (and groups, budget, vocab, layers, recomputed, dtype, backend,
# compiled); sft takes batch_tokens and longest (and vocab, layers, autocast).
CPU_GRID = [
    ("grpo", dict(shape=TINY, vocab=1024, prompt=256, response=64, n=4)),
    ("grpo", dict(shape=TINY, vocab=1024, prompt=1024, response=128, n=8)),
    ("grpo", dict(shape=TINY, vocab=1024, prompt=1024, response=128, n=8, recomputed=1.0)),
    ("grpo", dict(shape=TINY, vocab=32768, prompt=512, response=64, n=8, recomputed=0.5)),
    ("grpo", dict(shape=TINY, vocab=151936, prompt=256, response=32, n=4)),
    ("grpo", dict(shape=TINY, vocab=4096, prompt=256, response=64, n=4, dtype="bfloat16")),
    ("grpo", dict(shape=TINY, vocab=1024, prompt=256, response=64, n=8, budget=512)),
    ("grpo", dict(shape=TINY, vocab=1024, prompt=128, response=32, n=4, groups=3)),
    ("grpo", dict(shape=SMOL, layers=2, vocab=1024, prompt=256, response=32, n=4)),
    ("grpo", dict(shape=SMOL, layers=2, prompt=256, response=32, n=4)),
    ("grpo", dict(shape=SMOL, layers=2, prompt=256, response=32, n=4, recomputed=1.0)),
    ("sft", dict(shape=TINY, vocab=1024, batch_tokens=2048, longest=512)),
    ("sft", dict(shape=TINY, vocab=1024, batch_tokens=2048, longest=512, autocast=True)),
    ("sft", dict(shape=TINY, vocab=32768, batch_tokens=2048, longest=512)),
    ("sft", dict(shape=SMOL, layers=2, batch_tokens=1024, longest=256)),
]


def gpu_grid() -> list[tuple[str, dict]]:
    """Whole models at the token budgets of real runs: SmolLM2-135M (the model the checks were first wrong for),
    Qwen3-0.6B and Qwen3-1.7B, compiled and eager layers, flex and dense attention, bf16 and float32, with and
    without recomputation; vocabularies from 1K to 152K; sft at its default budget and below."""
    rows = []
    for vocab in (1024, 49152, 151936):
        rows.append(("grpo", dict(shape=SMOL, vocab=vocab, prompt=8192, response=384, n=8, compiled=True)))
    for groups, recomputed in ((2, 0.0), (5, 0.0), (5, 1.0)):  # 5 groups: 56,320 tokens
        rows.append(
            (
                "grpo",
                dict(shape=SMOL, prompt=8192, response=384, n=8, groups=groups, recomputed=recomputed, compiled=True),
            )
        )
    # configs/gpu-long.yaml's update: float32, eager layers, the dense backend (per-pack masks in every layer, and
    # with grouped heads SDPA's math kernel and its scores; at 8K prompts one group needs more than an H200)
    for groups in (1, 2, 4):  # 4,096 tokens a group
        rows.append(
            ("grpo", dict(shape=SMOL, prompt=2048, response=256, n=8, groups=groups, dtype="float32", backend="dense"))
        )
    rows.append(("grpo", dict(shape=SMOL, prompt=8192, response=384, n=8, groups=3, dtype="float32", backend="flex")))
    rows.append(("grpo", dict(shape=SMOL, prompt=4096, response=1024, n=8, groups=2, budget=16384, backend="dense")))
    for shape in ("qwen3-0.6b", "qwen3-1.7b"):
        for recomputed in (0.0, 1.0):
            rows.append(
                ("grpo", dict(shape=shape, prompt=8192, response=1024, n=8, recomputed=recomputed, compiled=True))
            )
        rows.append(("grpo", dict(shape=shape, prompt=8192, response=1024, n=8, recomputed=0.5)))
    for batch_tokens, longest in ((16384, 2048), (65536, 4400), (131072, 4400)):
        rows.append(("sft", dict(shape=SMOL, batch_tokens=batch_tokens, longest=longest)))
    rows.append(("sft", dict(shape=SMOL, vocab=151936, batch_tokens=65536, longest=2048)))
    rows.append(("sft", dict(shape="qwen3-0.6b", batch_tokens=32768, longest=4096)))
    return rows


def run_row(path: str, settings: dict, device: str):
    """One measured case (``longqa.bench.memory``)."""
    from longqa.bench.memory import grpo_case, sft_case

    return (grpo_case if path == "grpo" else sft_case)(**settings, device=device)


def predicted_need(path: str, settings: dict) -> int:
    """Bytes a row will hold on its device, by the count under test: its activations, and its weights and their
    gradients (float32 for sft, which also keeps AdamW out of the measured step)."""
    from transformers import Qwen3Config

    from longqa.model.shapes import SHAPES
    from longqa.planning.activations import Compute, sft_activations, update_activations
    from longqa.planning.planner import ModelSizes

    shape = {
        **SHAPES[settings["shape"]],
        **({"vocab_size": settings["vocab"]} if settings.get("vocab") else {}),
        **({"num_hidden_layers": settings["layers"]} if settings.get("layers") else {}),
    }
    sizes = ModelSizes.from_config(Qwen3Config(**shape))
    if path == "sft":
        return (
            8 * sizes.params
            + sft_activations(
                sizes,
                Compute(dtype_bytes=2, param_bytes=4, autocast=True),
                batch_tokens=settings["batch_tokens"],
                longest=settings["longest"],
            ).total
        )
    size = 4 if settings.get("dtype") == "float32" else 2
    backend = settings.get("backend", "auto")
    groups = settings.get("groups", 1)
    return (
        2 * size * sizes.params
        + update_activations(
            sizes,
            Compute(dtype_bytes=size, param_bytes=size, compiled=settings.get("compiled", False)),
            budget=settings.get("budget") or groups * (settings["prompt"] + settings["n"] * settings["response"]),
            prompt_length=settings["prompt"],
            response_length=settings["response"],
            n=settings["n"],
            backend="flex" if backend == "auto" else backend,
            recomputed=settings.get("recomputed", 0.0),
        ).total
    )


def fits_device(path: str, settings: dict, device: str) -> str | None:
    """Why a GPU row would not fit the free memory, or None; the CPU runs every row."""
    if device != "cuda":
        return None
    need, (free, _) = predicted_need(path, settings), torch.cuda.mem_get_info()
    return None if need < free - 2 * 2**30 else f"needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"


COLUMNS = (
    "path",
    "shape",
    "layers",
    "vocab",
    "tokens",
    "span",
    "recomputed",
    "precision",
    "backend",
    "predicted MiB",
    "measured MiB",
    "ratio",
    "layers MiB",
    "masks MiB",
    "head+transient MiB",
)


def table_row(case) -> list[str]:
    """One case as the table's cells: MiB throughout, so CPU and GPU tables read alike."""
    p = case.predicted
    precision = f"{case.dtype}{' +autocast' if case.autocast else ''}{' compiled' if case.compiled else ''}"
    return [
        case.path,
        case.shape,
        str(case.layers),
        f"{case.vocab:,}",
        f"{case.tokens:,}",
        f"{case.span:,}",
        f"{case.recomputed:g}",
        precision,
        case.backend,
        f"{p.total / MIB:,.1f}",
        f"{case.measured / MIB:,.1f}",
        f"{case.ratio:.3f}",
        f"{p.layers / MIB:,.1f}",
        f"{p.masks / MIB:,.1f}",
        f"{(p.head + p.transient) / MIB:,.1f}",
    ]


def markdown(rows: list[list[str]]) -> str:
    """The table in Markdown, for benchmarks/RESULTS.md."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the grid, print and write the table; status 1 when a row is outside a ratio of 1 to 1.5 or fails."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (cuda when there is one), cpu or cuda")
    parser.add_argument("--grid", choices=("cpu", "gpu"), default=None, help="default: gpu on cuda, cpu on the CPU")
    parser.add_argument("--output", default=None, help="folder for memory_check.json and memory_check.md")
    parser.add_argument("--rows", type=int, nargs="+", default=None, help="run only these rows of the grid (from 0)")
    args = parser.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    grid = CPU_GRID if (args.grid or ("gpu" if device == "cuda" else "cpu")) == "cpu" else gpu_grid()
    if args.rows is not None:
        grid = [grid[i] for i in args.rows]
    records, rows, failed = [], [], 0
    print(" | ".join(COLUMNS), flush=True)
    for path, settings in grid:
        start = time.perf_counter()
        reason = fits_device(path, settings, device)
        if reason:
            print(f"skipped {path} {settings}: {reason}", flush=True)
            records.append({"path": path, "settings": settings, "skipped": reason})
            continue
        try:
            case = run_row(path, settings, device)
        except torch.cuda.OutOfMemoryError as e:  # the prediction said it fits: an under-count
            failed += 1
            print(f"out of memory: {path} {settings}: {str(e).splitlines()[0]}", flush=True)
            records.append({"path": path, "settings": settings, "out_of_memory": True})
            continue
        except Exception as e:  # one row's failure (a compile error, say) leaves the others to run
            failed += 1
            print(f"failed: {path} {settings}: {type(e).__name__}: {e}", flush=True)
            records.append({"path": path, "settings": settings, "error": f"{type(e).__name__}: {e}"})
            continue
        finally:
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append(table_row(case))
        failed += not 1 <= case.ratio <= 1.5
        records.append({"settings": settings, "seconds": round(time.perf_counter() - start, 1), **case.row()})
        print(" | ".join(rows[-1]), flush=True)
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
        (out / "memory_check.json").write_text(json.dumps({**meta, "rows": records}, indent=1))
        (out / "memory_check.md").write_text(f"{meta['device']}, torch {meta['torch']}\n\n" + markdown(rows))
        print(f"wrote {out / 'memory_check.json'} and {out / 'memory_check.md'}")
    if failed:
        print(f"{failed} row(s) outside a ratio of 1 to 1.5 (or out of memory)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
