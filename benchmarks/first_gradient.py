"""Before GRPO from a model: do its sampled answers earn any reward, and how many groups would give a gradient?

GRPO learns only from a group whose samples are scored differently; a model that never writes a rewarded answer
(an instruct model that ignores the format, say) gets a zero advantage on every group and a training run that
logs reward 0 for as long as it runs. This samples ``-n`` answers per prompt at GRPO's temperature, as a training
step's rollout does, scores them with the run's reward, and counts:

- ``boxed``: answers holding a ``\\boxed{}`` (every reward mode reads the answer from one),
- ``rewarded``: answers scored above 0 (the mean reward a first step would log is ``mean_reward``),
- ``groups_with_gradient``: prompts whose answers were not all scored alike.

Prompt variants that a data file would hold (``--instruction`` after the question, ``--no-system``, an assistant
``--prefill``) say whether the prompt, not the model, is what gives no gradient.

    python benchmarks/first_gradient.py --model MODEL --data FILE.parquet [--prompts 8] [-n 8] [--temperature 1]
        [--max-new-tokens 160] [--mode hardened] [--instruction TEXT] [--no-system] [--prefill TEXT]
        [--device auto] [--samples OUT.jsonl]

prints one JSON line. The answers come from longqa's rollout engine, seeded per prompt (the same command
gives the same answers).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter


def prompt_ids(row: dict, tokenizer, instruction: str = "", system: bool = True, prefill: str = "") -> list[int]:
    """A data row's chat prompt as token ids, varied as asked: ``instruction`` appended to its last user message,
    its system message left out, ``prefill`` opening the assistant's answer."""
    messages = [dict(m) for m in row["prompt"] if system or m["role"] != "system"]
    if instruction:
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[last]["content"] += instruction
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefill
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model folder or GGUF file")
    p.add_argument("--data", required=True, help="a longqa/verl parquet file; its first --prompts rows are asked")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("-n", type=int, default=8, help="answers per prompt (the GRPO group)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--mode", default="hardened", help="the reward mode that scores the answers")
    p.add_argument("--instruction", default="", help="text appended to each question's user message")
    p.add_argument("--no-system", action="store_true", help="leave out the rows' system message")
    p.add_argument("--prefill", default="", help="text that opens the assistant's answer, scored as part of it")
    p.add_argument("--device", default="auto")
    p.add_argument("--samples", help="write every answer and its score as JSONL here")
    args = p.parse_args(argv)

    import pyarrow.parquet as pq

    from longqa.evaluation.evaluate import mode_reward, stop_token_ids
    from longqa.model.load import answer_dtype, load_model, pick_device
    from longqa.rollout.base import SamplingParams
    from longqa.rollout.fast import FastRolloutEngine

    rows = pq.read_table(args.data).to_pylist()[: args.prompts]
    device = pick_device(args.device, "--device")
    model, tokenizer = load_model(args.model, device=device, dtype=answer_dtype("auto", device))
    ids = [prompt_ids(r, tokenizer, args.instruction, not args.no_system, args.prefill) for r in rows]
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=tuple(stop_token_ids(tokenizer)),
        return_logprobs=False,
    )
    start = time.perf_counter()
    groups = FastRolloutEngine(model, tokenizer).generate(ids, params, seeds=list(range(len(ids))))
    seconds = time.perf_counter() - start

    score = mode_reward(args.mode)
    reasons, records, varied = Counter(), [], 0
    for row, group in zip(rows, groups):
        scores = []
        for sample in group:
            response = args.prefill + tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            result = score(row["data_source"], response, row["reward_model"]["ground_truth"], row.get("extra_info"))
            reasons[result.reason or "right"] += 1
            scores.append(result.score)
            records.append(
                {
                    "data_source": row["data_source"],
                    "ground_truth": row["reward_model"]["ground_truth"],
                    "score": result.score,
                    "reason": result.reason,
                    "response": response,
                }
            )
        varied += len(set(scores)) > 1
    summary = {
        "prompts": len(rows),
        "samples": len(records),
        "boxed": sum("\\boxed{" in r["response"] for r in records),
        "rewarded": sum(r["score"] > 0 for r in records),
        "mean_reward": sum(r["score"] for r in records) / max(1, len(records)),
        "groups_with_gradient": varied,
        "reasons": dict(reasons.most_common()),
        "seconds": round(seconds, 1),
        "settings": {k: v for k, v in vars(args).items() if k != "samples"},
    }
    if args.samples:
        with open(args.samples, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
