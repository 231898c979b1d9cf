"""Speculative decoding on a trained model's real rollouts: how often prompt lookup drafts, how many drafted
tokens are kept, the wall-clock time of the same rollouts with and without it, and that they are the same.

The model samples its own answers to long-context questions (the embedded model by default, at its
demo's sampling settings: temperature 1, 8 samples per prompt, at most 128 new tokens, EOS stops),
once plainly and once per draft count k, each run after a warm-up run of the same work:

    python benchmarks/speculative_rollout.py --data runs/demo-data/merged/train.parquet --prompts 64 --k 2 4 8

Without --data it writes synthetic questions like the model's training data (``--context-tokens``;
the embedded model was trained on contexts of 256 to 768 tokens) into --work-dir first. Each JSON row
has the run's seconds and tokens/s, ``decode_steps``, and with speculation ``draft_fraction`` (live
row-steps that had a draft), ``accepted_per_draft_step`` (drafted tokens kept per such step),
``tokens_per_row_step`` (tokens a live row-step made) and ``same_as_plain`` (the fraction of samples
token for token equal to the plain run's, and the largest log-prob difference).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def load_prompts(args, tokenizer) -> list[list[int]]:
    """``args.prompts`` prompts of the data spread evenly over it (merged files are ordered by task), or
    with ``--longest`` the longest, templated and tokenized as `longqa train` does."""
    from longqa.data.prompts import PromptOptions, prepare_prompts
    from longqa.data.synth import generate

    data = Path(args.data or Path(args.work_dir) / f"synth{args.context_tokens}" / "merged" / "test.parquet")
    if not data.is_file():
        generate(
            data.parent.parent,
            rows_per_task=args.rows_per_task,
            context_tokens=args.context_tokens,
            max_hops=3,
            test_ratio=0.25,
            seed=args.seed,
        )
    prompts = prepare_prompts(
        [data], tokenizer, PromptOptions(args.max_prompt_length), length_setting="--max-prompt-length"
    )
    if args.longest:
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts.ids(i)))[: args.prompts]
    else:
        order = range(0, len(prompts), max(1, len(prompts) // args.prompts))[: args.prompts]
    return [prompts.ids(i).tolist() for i in order]


def timed_run(engine, prompts, params, sync) -> tuple[list, float]:
    seeds = list(range(len(prompts)))
    engine.generate(prompts, params, seeds=seeds)  # warm-up: compilation, graphs, allocator
    sync()
    start = time.perf_counter()
    out = engine.generate(prompts, params, seeds=seeds)
    sync()
    return out, time.perf_counter() - start


def sameness(plain, out) -> dict:
    pairs = [(a, b) for ga, gb in zip(plain, out) for a, b in zip(ga, gb)]
    equal = sum(a.token_ids == b.token_ids for a, b in pairs)
    diff = max(
        (abs(x - y) for a, b in pairs if a.token_ids == b.token_ids for x, y in zip(a.logprobs, b.logprobs)),
        default=0.0,
    )
    return {"same_as_plain": round(equal / len(pairs), 4), "max_logprob_diff": diff}


def main(argv=None) -> list[dict]:
    from longqa.bench.speed import speculation_stats
    from longqa.evaluation.evaluate import stop_token_ids
    from longqa.model.load import load_model, pick_device
    from longqa.rollout.base import SamplingParams
    from longqa.rollout.fast import FastRolloutEngine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder (default: the embedded model)")
    p.add_argument("--data", help="a verl-schema parquet file (default: synthetic questions, see --context-tokens)")
    p.add_argument("--work-dir", default="/tmp/longqa-speculative", help="where synthetic questions are written")
    p.add_argument("--context-tokens", type=int, default=768, help="synthetic contexts' length (default 768)")
    p.add_argument("--rows-per-task", type=int, default=64, help="synthetic rows per task (default 64)")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--max-prompt-length", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=64, help="how many prompts (default 64)")
    p.add_argument("--longest", action="store_true", help="the longest prompts of the data (default: spread evenly)")
    p.add_argument("-n", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--k", type=int, nargs="+", default=[2, 4, 8], help="draft counts to run (default 2 4 8)")
    p.add_argument("--min-match", type=int, default=2, help="prompt_lookup_min (default 2)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on a GPU, else float32)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)

    device = pick_device(args.device, "--device")
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    prompts = load_prompts(args, tokenizer)
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=tuple(stop_token_ids(tokenizer)),
    )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    common = {
        "model": args.model or "embedded",
        "device": str(device),
        "dtype": dtype,
        "prompts": len(prompts),
        "prompt_mean": round(sum(map(len, prompts)) / len(prompts), 1),
        "prompt_max": max(map(len, prompts)),
        "n": args.n,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
    }
    rows, plain = [], None
    for k in [0, *args.k]:
        options = (
            {"speculative": "prompt_lookup", "num_speculative_tokens": k, "prompt_lookup_min": args.min_match}
            if k
            else {}
        )
        engine = FastRolloutEngine(model, tokenizer, **options)
        out, seconds = timed_run(engine, prompts, params, sync)
        made = sum(len(s.token_ids) for g in out for s in g)
        row = {
            **common,
            "k": k,
            "seconds": round(seconds, 3),
            "new_tokens": made,
            "new_tokens_per_s": round(made / seconds),
            "decode_steps": engine.last_run["decode_steps"],
            "live_row_steps": engine.last_run["live_row_steps"],
            **speculation_stats(engine.last_run),
        }
        if plain is None:
            plain, base = out, seconds
        else:
            row.update(sameness(plain, out), speedup=round(base / seconds, 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
