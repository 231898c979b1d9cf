#!/usr/bin/env bash
# The longest group one GPU trains, against `longqa plan`: for each prompt length, a two-step run of the recipe's
# shape at that length (benchmarks/recipe_shape_gpu.sh: a random-weight Qwen3-8B, one prompt of N samples a step,
# ZeRO-3 with the optimizer offloaded) and the plan's verdict for the same settings, which that script prints first.
# The table at the end sets them side by side: the plan's GPU total (or its refusal) and the run's GPU peak (or how
# it failed), so the planner's longest trainable prompt can be read against the measured one.
#
# Usage, from the repository root:  bash benchmarks/long_group_gpu.sh [OUTPUT_DIR]
# Needs what benchmarks/recipe_shape_gpu.sh needs (an H200, DeepSpeed, about 128 GiB of host memory). Each length's
# output is in OUTPUT_DIR/LENGTH.log, its run in OUTPUT_DIR/LENGTH/.
# Environment (defaults in brackets):
#   LENGTHS [32768 49152 65536 98304 131072]  prompt lengths, tried in this order
#   EXTRA ["actor.cpu_offload_ratio=0.85"]  overrides for every run (a whole offload of the 8B optimizer needs more
#          than a 128 GiB host at these lengths; e.g. add "model.activation_offload=0.5")
#   SHAPE, N, RESPONSE, TOKENIZER, STRATEGY, DEVICE: as benchmarks/recipe_shape_gpu.sh takes them.
#   DEVICE=cpu SHAPE=qwen3-tiny LENGTHS="512 1024" RESPONSE=16 N=2 STRATEGY=fsdp2 EXTRA= checks the harness
#   without a GPU.
set -uo pipefail
out=${1:-${OUT:-/tmp/longqa-long-group}}
lengths=${LENGTHS:-32768 49152 65536 98304 131072}
export EXTRA=${EXTRA-actor.cpu_offload_ratio=0.85}
mkdir -p "$out"
for length in $lengths; do
    echo "== $length-token prompts"
    PROMPT=$length PROMPTS=1 STEPS=2 bash benchmarks/recipe_shape_gpu.sh "$out/$length" > "$out/$length.log" 2>&1
    echo "exit status $?" >> "$out/$length.log"
    tail -2 "$out/$length.log"
done
python - "$out" $lengths <<'PY'
import json, re, sys
from pathlib import Path

out, lengths = Path(sys.argv[1]), sys.argv[2:]
print(f"\n{'prompt':>8}  {'the plan':<44}  the run")
for length in lengths:
    log = (out / f"{length}.log").read_text()
    plan = log.split("== the plan", 1)[-1].split("== ", 1)[0]
    total = re.search(r"^  total\s+([\d.]+ GiB)", plan, re.M)
    refused = re.search(r"longqa: error: (.{0,40})", plan)
    said = f"refused: {refused.group(1)}..." if refused else f"fits, {total.group(1)} on the GPU" if total else "?"
    metrics = out / length / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    steps = [row for row in rows if "perf/tokens_per_s" in row]
    if steps:
        peak = max(row.get("perf/max_memory_allocated_gb", 0.0) for row in steps)
        ran = f"trained {len(steps)} steps, GPU peak {peak:.1f} GiB allocated"
    else:
        errors = [line for line in log.splitlines() if "Error" in line or "error:" in line]
        ran = "failed: " + (errors[-1].strip()[:80] if errors else log.splitlines()[-1])
    print(f"{length:>8}  {said:<44}  {ran}")
PY
