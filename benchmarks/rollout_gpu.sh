#!/usr/bin/env bash
# Issue 5 on one H200: the fast engine's CUDA tests, rollout speed (transformers generate vs the fast
# engine, 1 and 16 groups of 8, 8192-token prompts, 1024 new tokens) and a whole GRPO step per phase.
# Usage (device tool, repo root): bash benchmarks/rollout_gpu.sh   (results in $OUT/)
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/longqa-bench}
mkdir -p "$OUT"
python -m pytest -q tests/test_rollout_fast.py 2>&1 | tail -2
python -m longqa.cli bench rollout --shape qwen3-1.7b --prompt 8192 --new-tokens 1024 -n 8 --groups 1 16 \
    --json "$OUT/rollout_1.7b.json" 2>&1 | grep '^{'
python -m longqa.cli bench step --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --prompts 16 --steps 2 \
    --json "$OUT/step_1.7b.json" 2>&1 | grep '^{'
