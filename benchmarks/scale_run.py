"""A short GRPO run on a random-weight model of a real shape, for scaling measurements (``scale_gpu.sh``).

Run it once per device count on the same global batch, then compare: the per-step time and tokens/s
are in each run's metrics.jsonl. One process:

    python benchmarks/scale_run.py --shape qwen3-1.7b --out /tmp/scale/1gpu
Two GPUs:

    torchrun --nproc_per_node 2 benchmarks/scale_run.py --shape qwen3-1.7b --out /tmp/scale/2gpu

The model is built from the shape (no download) and saved once with the embedded model's tokenizer
(a random model reads any ids below its vocabulary); the data is `longqa data synth` at the given
context length, shared by the runs. A random model never samples EOS, so each response ends at a length
drawn from a log-normal (``--lengths lognormal``, ``rollout.response_lengths=lognormal``: mean about 40%
of ``--response``) or runs to ``--response`` (``--lengths max``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def prepare(shape: str, context_tokens: int, root: Path) -> tuple[Path, Path]:
    """The model folder and the data folder, made by rank 0 only (the others wait for its marker)."""
    import time

    import torch

    model_dir, data_dir = root / f"model-{shape}", root / f"data-{context_tokens}"
    done = root / f"ready-{shape}-{context_tokens}"
    if int(os.environ.get("RANK", 0)) == 0 and not done.exists():
        from longqa.bench.speed import random_model
        from longqa.data.synth import generate
        from longqa.model.load import EMBEDDED_MODEL, load_model_tokenizer

        root.mkdir(parents=True, exist_ok=True)
        if not (data_dir / "merged" / "train.parquet").exists():
            generate(data_dir, rows_per_task=200, context_tokens=context_tokens, max_hops=3, test_ratio=0.05, seed=5)
        if not (model_dir / "config.json").exists():
            tokenizer = load_model_tokenizer(str(EMBEDDED_MODEL))
            model = random_model(shape, "cpu", torch.bfloat16, gradient_checkpointing=False, min_vocab=len(tokenizer))
            model.config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
            model.config.pad_token_id = tokenizer.pad_token_id
            model.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
        done.write_text("ok")
    while not done.exists():
        time.sleep(1)
    return model_dir, data_dir


def main() -> None:
    from longqa.rollout.lengths import LENGTH_KINDS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-1.7b")
    parser.add_argument("--context-tokens", type=int, default=4096)
    parser.add_argument("--response", type=int, default=512, help="most tokens of a response")
    parser.add_argument(
        "--lengths",
        choices=LENGTH_KINDS,
        default="lognormal",
        help="responses' lengths: drawn (default), or all --response",
    )
    parser.add_argument("--prompts", type=int, default=16, help="global prompts per step")
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--root", default="/tmp/longqa-scale", help="model and data, shared by the runs")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = parser.parse_args()
    model_dir, data_dir = prepare(args.shape, args.context_tokens, Path(args.root))
    from longqa.cli import main as longqa

    overrides = {
        "model.path": model_dir,
        "model.dtype": "bfloat16" if args.device != "cpu" else "float32",
        "model.gradient_checkpointing": "true",
        "data.train_files": data_dir / "merged/train.parquet",
        "data.val_files": data_dir / "merged/test.parquet",
        "data.max_prompt_length": 2 * args.context_tokens,
        "data.max_response_length": args.response,
        "data.train_batch_size": args.prompts,
        "data.cache_dir": Path(args.root) / "cache",
        "rollout.n": args.n,
        "actor.ppo_mini_batch_size": args.prompts,
        "actor.lr": 1e-6,
        "actor.max_tokens_per_micro_batch": 2 * args.context_tokens + args.n * args.response,
        "trainer.max_steps": args.steps,
        "trainer.test_freq": 0,
        "trainer.save_freq": 0,
        "trainer.output_dir": args.out,
        "trainer.device": args.device,
        "trainer.logger": "[console,jsonl]",
        "trainer.resume": "none",
        # the model's own EOS, which a random model never samples: every response runs to --response
        "rollout.response_lengths": "lognormal" if args.lengths == "lognormal" else "model",
    }
    code = longqa(["train", *[f"{k}={v}" for k, v in overrides.items()], *args.overrides])
    if code == 0 and int(os.environ.get("RANK", 0)) == 0:
        records = [json.loads(line) for line in (Path(args.out) / "metrics.jsonl").read_text().splitlines()]
        last = records[-1]
        keys = ("time/step_s", "time/rollout_s", "time/update_s", "perf/tokens_per_s")
        print(json.dumps({"ranks": int(os.environ.get("WORLD_SIZE", 1)), **{k: round(last[k], 3) for k in keys}}))
    raise SystemExit(code)


if __name__ == "__main__":
    main()
