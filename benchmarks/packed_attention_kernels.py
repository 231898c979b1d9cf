"""Which attention kernels could beat flex_attention on the packed update's groups at 64-dimension heads?

One GRPO group packed as the update packs it (a prompt, then n responses that each read the whole prompt and
their own earlier tokens), one layer, bfloat16, forward and forward+backward in ms per group:

- flex over the whole group (the default backend), with Inductor's launch settings and with the best backward
  setting of ``flex_attention_settings.py``;
- flex over the response rows only (queries: the responses; keys: the whole group): the part left to flex if
  the prompt's own causal attention went to a vendor kernel;
- the prompt's own causal attention alone through SDPA's cuDNN, FlashAttention and memory-efficient kernels
  (grouped-query heads passed as they are, or repeated to the query heads), one prompt at a time or four
  batched;
- FlashAttention's variable-length kernel (``torch.nn.attention.varlen``) over a micro-batch of four groups
  whose prompts and response blocks are its sequences (what one call per layer would do for the prompts).

    python benchmarks/packed_attention_kernels.py                      (SmolLM2-135M's heads: 9, 3, 64)
    python benchmarks/packed_attention_kernels.py --heads 16 --kv-heads 8 --dim 128   (Qwen3-1.7B's)

Needs a CUDA GPU. Prints one JSON line per kernel.
"""

from __future__ import annotations

import argparse
import inspect
import json

import torch
import torch.nn.functional as F
from flex_attention_settings import group_mask  # (this folder)

FLEX_BACKWARD = {
    "BLOCK_M1": 64,
    "BLOCK_N1": 64,
    "BLOCK_M2": 64,
    "BLOCK_N2": 64,
    "bwd_num_warps": 4,
    "bwd_num_stages": 3,
}


def timed(fn, reps: int = 10) -> float:
    """Milliseconds per call, after two warm-up calls."""
    fn(), fn()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / reps


def fwd_and_bwd(run) -> dict:
    """``run(backward)`` timed without and with its backward pass."""
    return {"fwd_ms": round(timed(lambda: run(False)), 3), "fwd_bwd_ms": round(timed(lambda: run(True)), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--response", type=int, default=160, help="each response's length")
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention
    from torch.nn.attention.varlen import varlen_attn

    P, R, n, H, KV, D = args.prompt, args.response, args.n, args.heads, args.kv_heads, args.dim
    whole, length = group_mask(P, R, n)
    responses, _ = group_mask(P, R, n, first_query=P)
    flex = torch.compile(flex_attention, dynamic=False)

    def tensor(heads, rows, batch=1):
        return torch.randn(batch, heads, rows, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = tensor(H, length), tensor(KV, length), tensor(KV, length)
    grad = torch.randn(1, H, length, D, device="cuda", dtype=torch.bfloat16)

    def report(kernel: str, row: dict) -> None:
        print(json.dumps({"kernel": kernel, **row}), flush=True)

    for name, options in (("flex, whole group", None), ("flex, whole group, backward 64/64/64/64", FLEX_BACKWARD)):

        def run(backward, options=options):
            out = flex(q, k, v, block_mask=whole, enable_gqa=True, kernel_options=options)
            if backward:
                out.backward(grad)

        report(name, fwd_and_bwd(run))

    def run_responses(backward):
        out = flex(q[:, :, P:], k, v, block_mask=responses, enable_gqa=True)
        if backward:
            out.backward(grad[:, :, P:])

    report("flex, response rows only", fwd_and_bwd(run_responses))

    backends = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    for name, backend in backends.items():
        for gqa in (True, False):
            for batch in (1, 4):
                qp, kp, vp = tensor(H, P, batch), tensor(KV if gqa else H, P, batch), tensor(KV if gqa else H, P, batch)
                gp = torch.randn_like(qp)

                def run_prompt(backward, qp=qp, kp=kp, vp=vp, gp=gp, backend=backend, gqa=gqa):
                    with sdpa_kernel([backend]):
                        out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=gqa)
                    if backward:
                        out.backward(gp)

                kernel = f"prompt only, {name}, {'grouped' if gqa else 'repeated'} heads, {batch} per call"
                try:
                    times = fwd_and_bwd(run_prompt)
                except RuntimeError as error:  # a kernel that does not take these inputs
                    report(kernel, {"error": str(error)[:200]})
                    continue
                report(kernel, {key: round(value / batch, 3) for key, value in times.items()})

    packs = 4
    rows = packs * length
    q_rows = torch.randn(rows, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k_rows, v_rows = (
        torch.randn(rows, KV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)
    )
    g_rows = torch.randn_like(q_rows)
    bounds = [b for pack in range(packs) for b in (pack * length, pack * length + P)] + [rows]
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")

    # (torch 2.11's varlen_attn takes grouped heads as they are; later versions want them named)
    grouped = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}

    def run_varlen(backward):
        out = varlen_attn(q_rows, k_rows, v_rows, cu, cu, max(P, n * R), max(P, n * R), window_size=(-1, 0), **grouped)
        if backward:
            out.backward(g_rows)

    report(
        "varlen flash, 4 groups' prompts and response blocks per call",
        {key: round(value / packs, 3) for key, value in fwd_and_bwd(run_varlen).items()},
    )


if __name__ == "__main__":
    main()
