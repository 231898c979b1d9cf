"""Where a fast-engine decode step's GPU time goes: kernels per step and the costliest kernels.

Runs the decode step eagerly (no CUDA graph, so each kernel is visible to the profiler) for a few
steps after a warm-up, on a random-weight model of a real shape:

    python benchmarks/decode_profile.py --shape qwen3-1.7b --prompt 8192 -n 8 --groups 1 16

Needs a CUDA GPU (pick it with CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import argparse
import json

import torch


def profile(shape: str, prompt: int, n: int, groups: int, steps: int, options: dict) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from longqa.bench.speed import random_model
    from longqa.rollout.base import SamplingParams
    from longqa.rollout.fast import FastRolloutEngine

    model = random_model(shape, "cuda", torch.bfloat16, False).eval()
    engine = FastRolloutEngine(model, cuda_graphs=False, **options)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (prompt,), generator=g).tolist() for _ in range(groups)]
    warm = SamplingParams(n=n, temperature=1.0, max_new_tokens=2 * engine.sync_every)
    engine.generate(prompts, warm, seeds=list(range(groups)))  # compiles

    def kernels(max_new_tokens: int) -> dict[str, list[float]]:
        """GPU time of each kernel name over one generate call."""
        params = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new_tokens)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params, seeds=list(range(groups)))
            torch.cuda.synchronize()
        times: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times.setdefault(e.name, []).append(e.device_time)
        return times

    # The decode steps alone: a run of `steps` more tokens minus a run of the prefill and first token.
    prefill, run = kernels(1), kernels(steps + 1)
    decode = {
        name: (len(t) - len(prefill.get(name, [])), sum(t) - sum(prefill.get(name, []))) for name, t in run.items()
    }
    top = sorted(decode.items(), key=lambda kv: -kv[1][1])[:12]
    result = {
        "shape": shape,
        "prompt": prompt,
        "n": n,
        "groups": groups,
        **options,
        "kernels_per_step": round(sum(c for c, _ in decode.values()) / steps),
        "kernel_ms_per_step": round(sum(t for _, t in decode.values()) / steps / 1e3, 3),
        "top": [
            {"kernel": name[:90], "calls_per_step": round(c / steps, 1), "ms_per_step": round(t / steps / 1e3, 3)}
            for name, (c, t) in top
        ],
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-1.7b")
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--decode-kernel", default="auto")
    parser.add_argument("--no-fused-decode", action="store_true")
    args = parser.parse_args()
    options = {"decode_kernel": args.decode_kernel, **({"fused_decode": False} if args.no_fused_decode else {})}
    for groups in args.groups:
        print(json.dumps(profile(args.shape, args.prompt, args.n, groups, args.steps, options)), flush=True)


if __name__ == "__main__":
    main()
