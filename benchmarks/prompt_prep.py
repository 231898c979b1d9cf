"""Prompt preparation speed: the raw tokenizer vs longqa's preparation (cold, then cached).

The recipe trains on ~14,000 prompts of 16K tokens. This script generates a synthetic set of that
size (``longqa.data.synth``, one parquet file), then times on the same rows:
  raw     the tokenizer alone on the already-rendered chat prompts (Rust, batches of 64, all cores);
  cold    ``prepare_prompts``: read parquet, validate, chat template, tokenize, filter, write the cache;
  cached  ``prepare_prompts`` again with nothing changed (content digest + memory map).

    python benchmarks/prompt_prep.py --rows 14000 --context-tokens 15900 \
        --tokenizer Qwen/Qwen2.5-7B-Instruct --workdir /tmp/longqa-prompt-bench

``--tokenizer`` is a Qwen2.5 tokenizer, as a Hub id or a local folder (the figures in RESULTS.md used a
local copy of one); any fast tokenizer with a chat template works, but moves the token counts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from longqa.data.io import iter_rows, write_rows
from longqa.data.prompts import BATCH_ROWS, PromptOptions, prepare_prompts
from longqa.data.synth import TASKS, generate_rows
from longqa.model.tokenizer import load_tokenizer


def make_data(path: Path, rows: int, context_tokens: int, workers: int) -> float:
    start = time.perf_counter()
    per_task = [rows // len(TASKS) + (i < rows % len(TASKS)) for i in range(len(TASKS))]
    data = [
        r
        for task, n in zip(TASKS, per_task)
        for r in generate_rows(task, n, context_tokens=context_tokens, workers=workers)
    ]
    write_rows(data, path)
    return time.perf_counter() - start


def time_raw_tokenizer(path: Path, tokenizer) -> tuple[float, int]:
    """Encode time only: templating and reading happen outside the clock."""
    backend, total, seconds, batch = tokenizer.backend_tokenizer, 0, 0.0, []

    def encode(prompts):
        nonlocal total, seconds
        texts = tokenizer.apply_chat_template(prompts, tokenize=False, add_generation_prompt=True)
        start = time.perf_counter()
        encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
        seconds += time.perf_counter() - start
        total += sum(len(e) for e in encodings)

    for row in iter_rows(path):
        batch.append(row["prompt"])
        if len(batch) == BATCH_ROWS:
            encode(batch)
            batch = []
    if batch:
        encode(batch)
    return seconds, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=14_000)
    parser.add_argument(
        "--context-tokens",
        type=int,
        default=15_900,
        help="synth target (approximate count), set so Qwen2.5 prompts land just under 16,384",
    )
    parser.add_argument("--max-prompt-length", type=int, default=16_384)
    parser.add_argument(
        "--tokenizer",
        required=True,
        help="tokenizer folder or Hub id with a chat template, e.g. Qwen/Qwen2.5-7B-Instruct",
    )
    parser.add_argument("--workdir", default="/tmp/longqa-prompt-bench")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    work = Path(args.workdir)
    data = work / f"synth-{args.rows}x{args.context_tokens}.parquet"
    generate_s = make_data(data, args.rows, args.context_tokens, args.workers) if not data.exists() else None
    tokenizer = load_tokenizer(args.tokenizer)
    options = PromptOptions(args.max_prompt_length)

    raw_s, tokens = time_raw_tokenizer(data, tokenizer)
    shutil.rmtree(work / "cache", ignore_errors=True)
    cold = prepare_prompts([data], tokenizer, options, cache_dir=work / "cache")
    cached = prepare_prompts([data], tokenizer, options, cache_dir=work / "cache")
    assert cached.stats.cache_hit and not cold.stats.cache_hit

    result = {
        "rows": args.rows,
        "tokens": tokens,
        "file_mb": round(data.stat().st_size / 2**20, 1),
        "generate_s": None if generate_s is None else round(generate_s, 1),
        "raw_tokenizer_s": round(raw_s, 1),
        "raw_mtok_per_s": round(tokens / raw_s / 1e6, 2),
        "cold_s": round(cold.stats.seconds, 1),
        "cold_mtok_per_s": round(tokens / cold.stats.seconds / 1e6, 2),
        "cold_over_raw": round(cold.stats.seconds / raw_s, 2),
        "cached_s": round(cached.stats.seconds, 2),
        "kept": cold.stats.kept,
        "overlong_filtered": cold.stats.overlong_filtered,
        "mean_prompt_tokens": round(cold.stats.prompt_tokens / max(cold.stats.kept, 1)),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
