"""The fast engine sampling one group of a very long prompt: memory against the plan, tokens against transformers.

A prompt longer than one prefill forward (``rollout/fast.py``'s ``prefill_tokens``: 65,536 tokens for a small
model, 21,845 for Qwen3-8B) is prefilled in pieces, and each piece after the first attends to the whole prompt
so far under a causal mask. Attended in one call, such a piece forms the scores of all its queries against all
those keys wherever the kernel materialises a masked attention (the CPU's does): 64 GiB at a 131,072-token prompt
for a model of two query heads. The engine attends a block of query rows at a time instead, no call forming more
than ``PREFILL_SCORES_BYTES`` of scores. This script runs one group (``--n`` greedy samples of ``--new`` tokens)
of a random prompt of each ``--tokens`` length through a random-weight Qwen3-architecture model, blocked (the
engine as it is) and unblocked (the bound lifted), each in a fresh process under an address-space limit
(``--limit-gib``), and reports:

- the seconds and the resident-set peak of ``generate`` above what the process held before it
  (``resource.getrusage``'s ``ru_maxrss``, with glibc mapping blocks of 64 KiB or more apart so freed tensors
  leave the resident set),
- the engine's KV stores against the planner's KV of one group (``planning.planner.kv_bytes_per_group``: the
  prompt once, ``n`` responses), the engine built with exactly that KV budget (``rollout.kv_cache_bytes``),
- whether the samples are transformers' greedy tokens (one forward over the prompt with its KV cache, then one
  token at a time), computed after the engine's peak was taken.

    python benchmarks/long_prompt_rollout.py                          # 131,072 tokens
    python benchmarks/long_prompt_rollout.py --tokens 32768 65536
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from fresh_process import case_in_fresh_process

MIB = 2**20
NO_BOUND = 1 << 62


def model_for(args):
    import torch
    from transformers import AutoModelForCausalLM

    from longqa.model.load import qwen3_config

    torch.manual_seed(0)
    config = qwen3_config(
        256,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=max(1, args.heads // 2),
        intermediate_size=2 * args.hidden,
        max_positions=args.case_tokens + args.new,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()


def reference_tokens(model, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy tokens: the prompt in one forward with its KV cache, then a token at a time."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(new - 1):
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def run_case(args) -> dict:
    """One group in this process, blocked or not (``--case-unblocked``)."""
    import torch

    import longqa.rollout.fast as fast
    from longqa.planning.planner import ModelSizes, kv_bytes_per_group
    from longqa.rollout.base import SamplingParams

    resource.setrlimit(resource.RLIMIT_AS, (args.limit_gib << 30, args.limit_gib << 30))
    torch.set_num_threads(args.threads)
    if args.case_unblocked:
        fast.PREFILL_SCORES_BYTES = NO_BOUND
    model = model_for(args)
    prompt = torch.randint(3, 256, (args.case_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    plan_kv = kv_bytes_per_group(ModelSizes.from_config(model.config), args.case_tokens, args.new, args.n, 4)
    engine = fast.FastRolloutEngine(model, kv_cache_bytes=plan_kv, sync_every=4)
    params = SamplingParams(n=args.n, temperature=0, max_new_tokens=args.new, stop_token_ids=())
    row = {"pieces": -(-args.case_tokens // engine.prefill_chunk), "plan_kv": plan_kv}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        group = engine.generate([prompt], params)[0]
    except (RuntimeError, MemoryError) as e:  # the allocation the unblocked piece asks for
        return {**row, "failed": str(e).split("\n")[0][:300], "seconds": time.perf_counter() - start}
    row["seconds"] = time.perf_counter() - start
    row["rss"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024  # KiB on Linux
    kv = engine.kv
    row["engine_kv"] = sum(t.nbytes for t in (kv.prefix_k, kv.prefix_v, kv.suffix_k, kv.suffix_v))
    expected = reference_tokens(model, prompt, args.new)
    row["same_tokens"] = all(sample.token_ids == expected for sample in group)
    return row


def measure(args, tokens: int, unblocked: bool) -> dict:
    """``run_case`` in a fresh process, so each peak starts from the same empty process."""
    command = ["--case-tokens", str(tokens)] + (["--case-unblocked"] if unblocked else [])
    for flag in ("hidden", "layers", "heads", "n", "new", "threads", "limit_gib"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return case_in_fresh_process(__file__, command)


def table(args) -> list[str]:
    lines = [
        "| prompt tokens | prefill pieces | later pieces attend | seconds | RSS peak MiB | engine KV MiB | "
        "plan's group KV MiB | transformers' tokens |",
        "|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for tokens in args.tokens:
        for unblocked in (False, True):
            row = measure(args, tokens, unblocked)
            how = "whole (unbounded)" if unblocked else "in blocks (bounded)"
            if "failed" in row:
                lines.append(
                    f"| {tokens:,} | {row['pieces']} | {how} | failed after {row['seconds']:.1f} s: "
                    f"{row['failed']} | | | {row['plan_kv'] / MIB:,.1f} | |"
                )
            else:
                lines.append(
                    f"| {tokens:,} | {row['pieces']} | {how} | {row['seconds']:.1f} | {row['rss'] / MIB:,.1f} | "
                    f"{row['engine_kv'] / MIB:,.1f} | {row['plan_kv'] / MIB:,.1f} | "
                    f"{'same' if row['same_tokens'] else 'DIFFERENT'} |"
                )
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[131072])
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2, help="query heads of hidden / heads (half as many key/value)")
    parser.add_argument("--n", type=int, default=4, help="samples of the group")
    parser.add_argument("--new", type=int, default=4, help="tokens each sample generates")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit-gib", type=int, default=20, help="each case's address-space limit")
    parser.add_argument("--case-tokens", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--case-unblocked", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case_tokens:
        print(json.dumps(run_case(args)))
        return
    print(
        f"Qwen3 shape: hidden {args.hidden}, {args.layers} layer(s), {args.heads} query heads of "
        f"{args.hidden // args.heads}, float32, a group of {args.n} greedy samples of {args.new} tokens, "
        f"{args.threads} threads"
    )
    print("\n".join(table(args)))


if __name__ == "__main__":
    main()
