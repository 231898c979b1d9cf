"""What prefilling several prompts per forward buys a small model: the fast engine's rollout of 64 prompts
x 8 samples at SmolLM2-135M's shape (random weights), with one prompt per prefill forward and with the
default (``prefill_tokens(model)``), timed twice: prefill alone (every sample stops at its first token)
and whole (response lengths drawn as in ``longqa bench step --lengths lognormal``).

    python benchmarks/rollout_admission.py [--prompt 8192] [--prompts 64] [-n 8] [--response 384]

Needs a CUDA GPU.
"""

import argparse
import json
import time

import torch

from longqa.bench.speed import random_model
from longqa.rollout.base import SamplingParams
from longqa.rollout.fast import FastRolloutEngine
from longqa.rollout.lengths import draw_response_lengths


def timed(engine, prompts, params, stop_at, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompts, params, seeds=list(range(len(prompts))), stop_at=stop_at)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--response", type=int, default=384)
    args = parser.parse_args()
    model = random_model(args.shape, torch.device("cuda"), torch.bfloat16, 0)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, model.config.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.prompts)
    ]
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.response)
    first_token_only = [[1] * args.n for _ in prompts]
    drawn = [draw_response_lengths("lognormal", args.n, args.response, (1, i)) for i in range(args.prompts)]
    for chunk in (args.prompt, None):
        engine = FastRolloutEngine(model, prefill_chunk=chunk)
        timed(engine, prompts, params, drawn, 1)  # compiles and captures
        row = {
            "prefill_tokens": engine.prefill_chunk,
            "prompts_per_forward": engine.prefill_chunk // args.prompt,
            "prefill_s": round(timed(engine, prompts, params, first_token_only, 3), 3),
            "rollout_s": round(timed(engine, prompts, params, drawn, 2), 3),
        }
        print(json.dumps(row), flush=True)
        del engine  # its KV stores, before the next engine sizes its own
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
