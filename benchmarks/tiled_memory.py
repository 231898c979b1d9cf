"""Peak memory of a forward and backward pass at long rows, with the decoder layers' MLPs tiled and not.

``model.mlp_tile_tokens`` (``longqa/model/tiled_mlp.py``) computes each MLP over tiles of the row, so the MLP's
intermediates (four of ``intermediate_size`` per token, kept for the backward pass, and three gradients of that
width while the backward pass crosses it) exist for one tile instead of the whole row. This script measures what
that saves: a random-weight Qwen3-architecture model of a few layers (no LM head: the decoder's hidden states
only, summed into a loss) runs one forward and backward pass over one row of each ``--tokens`` length, with the
layers keeping their activations and with every layer recomputed (``model.gradient_checkpointing``), untiled and
tiled. Each case runs in a fresh process, which takes two peaks, each in a pass of its own: first the process's
resident set (``resource.getrusage``'s ``ru_maxrss`` after the pass, less its value before; glibc is told to map
every block of 64 KiB or more on its own, ``MALLOC_MMAP_THRESHOLD_``, so a freed tensor leaves the resident set
instead of staying in the heap), then the CPU allocator's (the largest running total of torch's profiler
allocation events, ``longqa.bench.memory.peak_bytes``: exact, kernels' scratch included; the profiler's own
records would inflate the resident set, hence the order). Seconds are the first pass's wall time, for ratios on
the same machine only.

    python benchmarks/tiled_memory.py                             # 16K and 32K tokens, two layers
    python benchmarks/tiled_memory.py --tokens 65536 --layers 1   # one layer at 64K
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from fresh_process import case_in_fresh_process

MIB = 2**20


def run_case(args) -> dict:
    """One case in this process: the peak of one forward and backward pass above what was held before it."""
    import torch
    from transformers import AutoModelForCausalLM

    from longqa.bench.memory import peak_bytes
    from longqa.model.load import arrange_layer_memory, qwen3_config

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = qwen3_config(
        256,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.heads // 2,
        intermediate_size=args.intermediate,
        max_positions=max(args.case_tokens, 4096),
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().train()
    arrange_layer_memory(model, 1.0 if args.recompute else 0.0, 0.0, args.case_tile)
    ids = torch.randint(0, 256, (1, args.case_tokens))

    def step():
        hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
        hidden.pow(2).mean().backward()

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024  # ru_maxrss is in KiB on Linux
    grad = sum(float(p.grad.double().abs().sum()) for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    allocator = peak_bytes(step, torch.device("cpu"))
    return {"allocator": allocator, "rss": rss, "seconds": seconds, "grad_abs_sum": grad}


def measure(args, tokens: int, tile: int, recompute: bool) -> dict:
    """``run_case`` in a fresh process, so each peak starts from the same empty process."""
    command = ["--case-tokens", str(tokens), "--case-tile", str(tile)]
    command += ["--hidden", str(args.hidden), "--intermediate", str(args.intermediate), "--layers", str(args.layers)]
    command += ["--heads", str(args.heads), "--threads", str(args.threads)] + (["--recompute"] if recompute else [])
    return case_in_fresh_process(__file__, command)


def table(args) -> list[str]:
    lines = [
        "| tokens | layers | tile | allocator peak MiB | tiled / untiled | RSS peak MiB | tiled / untiled | "
        "seconds tiled / untiled | grad sums agree |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for recompute in (False, True):
        for tokens in args.tokens:
            untiled = measure(args, tokens, 0, recompute)
            tiled = measure(args, tokens, args.tile, recompute)
            agree = abs(tiled["grad_abs_sum"] - untiled["grad_abs_sum"]) <= 1e-5 * untiled["grad_abs_sum"]
            kind = "recomputed" if recompute else "kept"
            for tile, row in ((0, untiled), (args.tile, tiled)):
                ratio = tile != 0
                lines.append(
                    f"| {tokens:,} | {args.layers} {kind} | {tile or 'off'} | {row['allocator'] / MIB:,.1f} | "
                    f"{tiled['allocator'] / untiled['allocator'] if ratio else 1:.3f} | {row['rss'] / MIB:,.1f} | "
                    f"{tiled['rss'] / untiled['rss'] if ratio else 1:.3f} | "
                    f"{tiled['seconds'] / untiled['seconds'] if ratio else 1:.3f} | {'yes' if agree else 'NO'} |"
                )
            print(lines[-2], lines[-1], sep="\n", file=sys.stderr, flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--tile", type=int, default=1024, help="model.mlp_tile_tokens of the tiled cases")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case-tokens", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--case-tile", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case_tokens:
        print(json.dumps(run_case(args)))
        return
    print(
        f"Qwen3 shape: hidden {args.hidden}, intermediate {args.intermediate}, {args.heads} heads, float32, "
        f"sdpa, {args.threads} threads"
    )
    print("\n".join(table(args)))


if __name__ == "__main__":
    main()
