"""flex_attention launch settings for the packed update's attention, measured: one layer of one GRPO group.

The update packs each prompt once with its n responses; attention is causal within the prompt and each
response, and every response also reads the whole prompt. This times flex_attention forward and
forward+backward on that mask (by default Qwen3-1.7B's heads: 16 query, 8 key/value, 128 dims; bfloat16)
for Inductor's default launch settings and a few given ones, then under max-autotune, and prints one JSON
line per setting:

    python benchmarks/flex_attention_settings.py --prompt 8192 --response 1024 -n 8
    python benchmarks/flex_attention_settings.py --prompt 8192 --response 384 -n 8 --heads 9 --kv-heads 3 --dim 64

(the second is SmolLM2-135M's heads, whose 64-dimension heads leave Inductor's defaults far from the
matrix units' rate).

Needs a CUDA GPU (pick it with CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SETTINGS = {
    "default": {},
    "tma": {"USE_TMA": True},
    "bwd 64/128/128/64, 8 warps, 3 stages": {
        "BLOCK_M1": 64,
        "BLOCK_N1": 128,
        "BLOCK_M2": 128,
        "BLOCK_N2": 64,
        "bwd_num_warps": 8,
        "bwd_num_stages": 3,
    },
    "bwd 32/128/128/32, 4 warps, 3 stages": {
        "BLOCK_M1": 32,
        "BLOCK_N1": 128,
        "BLOCK_M2": 128,
        "BLOCK_N2": 32,
        "bwd_num_warps": 4,
        "bwd_num_stages": 3,
    },
    "fwd 128/128, 8 warps, 3 stages": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 3},
    "fwd 128/64, 4 warps, 3 stages": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "fwd 128/128 8w 3s, bwd 64/128/128/64 8w 3s": {
        "fwd_BLOCK_M": 128,
        "fwd_BLOCK_N": 128,
        "fwd_num_warps": 8,
        "fwd_num_stages": 3,
        "BLOCK_M1": 64,
        "BLOCK_N1": 128,
        "BLOCK_M2": 128,
        "BLOCK_N2": 64,
        "bwd_num_warps": 8,
        "bwd_num_stages": 3,
    },
    "bwd 64/64/64/64, 4 warps, 3 stages": {
        "BLOCK_M1": 64,
        "BLOCK_N1": 64,
        "BLOCK_M2": 64,
        "BLOCK_N2": 64,
        "bwd_num_warps": 4,
        "bwd_num_stages": 3,
    },
}


def group_mask(prompt: int, response: int, n: int, first_query: int = 0):
    """The packed group's block mask: key k is visible to query q if k <= q and k is a prompt token or
    in q's own response; with ``first_query``, the queries are the group's rows from that one on (``prompt``:
    the responses alone). Returns the mask and the group's length."""
    from torch.nn.attention.flex_attention import create_block_mask

    length = prompt + n * response
    segment = torch.zeros(length, dtype=torch.int32, device="cuda")
    for j in range(n):
        segment[prompt + j * response : prompt + (j + 1) * response] = j + 1

    def visible(b, h, q, k):
        q = q + first_query
        return (k <= q) & ((segment[k] == 0) | (segment[k] == segment[q]))

    return create_block_mask(visible, 1, 1, length - first_query, length, device="cuda", BLOCK_SIZE=128), length


def time_setting(
    mask, length: int, options: dict, mode: str | None, heads=16, kv_heads=8, dim=128, reps: int = 5
) -> dict:
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    attend = torch.compile(flex_attention, mode=mode)
    q = torch.randn(1, heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(1, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)
    )
    grad = torch.randn_like(q)

    def run(backward: bool):
        out = attend(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options or None)
        if backward:
            out.backward(grad)

    start = time.time()
    run(True)
    torch.cuda.synchronize()
    row = {"compile_s": round(time.time() - start, 1)}
    for backward in (False, True):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(reps):
            run(backward)
        end.record()
        end.synchronize()
        row["fwd_bwd_ms" if backward else "fwd_ms"] = round(begin.elapsed_time(end) / reps, 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads")
    parser.add_argument("--dim", type=int, default=128, help="head dimension")
    parser.add_argument("--only", nargs="*", help="run only these settings (names as printed)")
    args = parser.parse_args()
    mask, length = group_mask(args.prompt, args.response, args.n)
    runs = [(name, options, None) for name, options in SETTINGS.items()] + [
        ("max-autotune", {}, "max-autotune-no-cudagraphs")
    ]
    for name, options, mode in runs:
        if args.only and name not in args.only:
            continue
        try:
            row = {"setting": name, **time_setting(mask, length, options, mode, args.heads, args.kv_heads, args.dim)}
        except Exception as err:  # a setting Triton cannot build: say so and go on
            row = {"setting": name, "error": repr(err)[:300]}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
