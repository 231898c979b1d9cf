#!/usr/bin/env bash
# Model attention features on one CUDA GPU: the CUDA tests of sliding windows and soft-capping (compiled
# flex_attention in the packed update, the Triton decode attention, CUDA-graph replays of the engine), then
# Qwen3-1.7B rollout and packed-update speed for this tree and, in the same run, for an earlier source tree
# (to show that reading each model's attention features costs Qwen3 nothing).
# Usage: bash benchmarks/attention_spec_gpu.sh [tests|bench] BASELINE_SRC [OUTPUT_DIR]
#   BASELINE_SRC: the src/ folder of the version to compare with (e.g. from `git archive <commit> src`).
set -uo pipefail
what=${1:?tests or bench}; baseline=${2:-}; out=${3:-${OUT:-/tmp/longqa-attention}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ "$what" = tests ]; then
    PYTHONPATH=$PWD/src timeout 420 python -m pytest -q -p no:cacheprovider tests/test_packing.py tests/test_decode_kernel.py \
        tests/test_rollout_fast.py -k "cuda or compiled or sliding or engine_samples" 2>&1 | tee "$out/tests.log" | tail -15
    exit
fi
for tree in "$PWD/src" "$baseline"; do
    [ -n "$tree" ] || continue
    name=$([ "$tree" = "$PWD/src" ] && echo current || echo baseline)
    PYTHONPATH=$tree python -m longqa.cli bench rollout --shape qwen3-1.7b --prompt 8192 --new-tokens 1024 -n 8 --lengths max \
        --groups 1 16 --hf-new-tokens 0 --json "$out/rollout_$name.json" 2>&1 | grep '^{'
    PYTHONPATH=$tree python -m longqa.cli bench train --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 \
        --layouts packed --repeat 3 --compile --json "$out/train_$name.json" 2>&1 | grep '^{'
done
