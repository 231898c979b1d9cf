#!/usr/bin/env bash
# Issue 4 on one H200: exactness of the compiled flex backend on CUDA, then naive vs packed
# forward+backward per group at the Qwen3-1.7B shape (eager and with compiled decoder layers), then
# the Qwen3-8B packed group at 16K+4K. Usage (device tool, repo root): bash benchmarks/train_layouts_gpu.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/longqa-bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -m pytest -q tests/test_packing.py 2>&1 | tail -2
bench() { python -m longqa.cli bench train "$@" 2>&1 | grep '^{'; }
bench --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --repeat 3 --json "$OUT/train_1.7b_eager.json"
bench --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --repeat 3 --compile --json "$OUT/train_1.7b_compiled.json"
bench --shape qwen3-8b --prompt 16384 --response 4096 -n 8 --layouts packed --repeat 2 --compile \
    --json "$OUT/train_8b_compiled.json"
