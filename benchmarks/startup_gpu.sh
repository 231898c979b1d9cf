#!/usr/bin/env bash
# Start-up: how long a start takes to reach its first GRPO step with nothing compiled yet (cold) and when the
# same run starts again on the same machine (warm), the second finding the first's compiled graphs and Triton
# kernels in the user's compile cache (`longqa/model/compile_cache.py`). Each start is a `longqa bench step` of
# Qwen3-1.7B (16 prompts x 8 samples, 8,192-token prompts, drawn response lengths up to 1,024 tokens, 2 steps),
# which sets up as `longqa train` does: model, engine, the update's decoder layers compiled at every packed
# length, then step 0 (whose rollout compiles the engine's functions and captures its CUDA graphs).
#
# Usage, from the repository root:  bash benchmarks/startup_gpu.sh [OUTPUT_DIR]
# Needs one CUDA GPU with about 80 GB. The compile cache used is OUTPUT_DIR/cache, emptied first, so the first
# start is cold whatever the machine compiled before. Prints each start's set-up stages (seconds since it
# began) and its steps' phases.
set -uo pipefail
out=${1:-${OUT:-/tmp/longqa-startup}}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XDG_CACHE_HOME=$out/cache
unset TORCHINDUCTOR_CACHE_DIR
mkdir -p "$out"
rm -rf "$XDG_CACHE_HOME"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for start in cold warm; do
    echo "== $start start"
    python -m longqa.cli bench step --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --prompts 16 --steps 2 \
        --lengths lognormal > "$out/$start.jsonl" 2> "$out/$start.err"
    grep '^bench step:' "$out/$start.err"
    python - "$out/$start.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"step {r['step']}: rollout {r['rollout_s']} s, update {r['update_s']} s, step {r['step_s']} s, "
          f"recompiles {r['recompiles']}, graph captures {r['graph_captures']}")
PY
done
du -sh "$XDG_CACHE_HOME"
