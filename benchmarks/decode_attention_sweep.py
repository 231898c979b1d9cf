"""Launch settings of the Triton decode attention (``rollout/decode_kernel.py``), measured.

Times one decode step's attention over all layers (each layer its own KV store, as in the engine, so
nothing is served from L2) for every combination of key block, warps, pipeline stages and split count,
and prints the best and the default per number of groups, with the HBM bandwidth they reach:

    python benchmarks/decode_attention_sweep.py --groups 1 2 16

Needs a CUDA GPU (the kernel is Triton's; pick the GPU with CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from longqa.rollout.decode_kernel import WAVES, shared_prefix_attention


def time_config(stores, q, prefix_len, own_len, n, prompt, own, config, reps: int = 10) -> float:
    """Milliseconds of one step's attention (every layer once), replayed as a CUDA graph."""

    def step():
        for pk, pv, sk, sv in stores:
            shared_prefix_attention(q, pk, pv, prefix_len, sk, sv, own_len, n, prompt, own, 0.088, **config)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def sweep(groups: int, n: int, prompt: int, own: int, layers: int, heads: int, kv_heads: int, d: int) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = groups * n
    stores = [
        (
            torch.randn(groups, kv_heads, prompt, d, device=dev, dtype=dt),
            torch.randn(groups, kv_heads, prompt, d, device=dev, dtype=dt),
            torch.randn(rows, kv_heads, own, d, device=dev, dtype=dt),
            torch.randn(rows, kv_heads, own, d, device=dev, dtype=dt),
        )
        for _ in range(layers)
    ]
    q = torch.randn(rows, heads, d, device=dev, dtype=dt)
    prefix_len = torch.full((groups,), prompt, device=dev)
    own_len = torch.full((rows,), own, device=dev)
    read = layers * 2 * kv_heads * d * 2 * (groups * prompt + rows * own)
    results = []
    for block_n, warps, stages, waves in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (1, 2, 4, 8)):
        config = dict(block_n=block_n, num_warps=warps, num_stages=stages, waves=waves)
        try:
            ms = time_config(stores, q, prefix_len, own_len, n, prompt, own, config)
        except Exception as err:  # a config Triton cannot build (shared memory): skip it
            results.append({**config, "error": type(err).__name__})
            continue
        results.append({**config, "ms": round(ms, 4), "TBps": round(read / ms / 1e9, 2)})
    timed = [r for r in results if "ms" in r]
    best = min(timed, key=lambda r: r["ms"])
    default = next(r for r in timed if (r["block_n"], r["num_warps"], r["num_stages"], r["waves"]) == (64, 4, 3, WAVES))
    return {
        "groups": groups,
        "n": n,
        "prompt": prompt,
        "own": own,
        "layers": layers,
        "best": best,
        "default": default,
        "top5": sorted(timed, key=lambda r: r["ms"])[:5],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2, 16])
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--own", type=int, default=512, help="tokens generated so far (mid-response)")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    for groups in args.groups:
        print(
            json.dumps(
                sweep(groups, args.n, args.prompt, args.own, args.layers, args.heads, args.kv_heads, args.head_dim)
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
