#!/usr/bin/env bash
# Issue 5 in one device call: the fast engine's CUDA tests, rollout speed (transformers generate vs the
# fast engine, 1 and 16 groups of 8, 8192-token prompts, 1024 new tokens), whole GRPO steps per phase
# (16 x 8, and 2 x 8: the work of TRL's step, with and without gradient checkpointing), and TRL's
# GRPOTrainer on that 2 x 8 work.
# On two GPUs (kind nvidia-h200-x2) TRL runs on the second one meanwhile; on one GPU it runs last.
# TRL needs wheels carried in .whl (trl, datasets, dill, multiprocess; see benchmarks/trl_grpo_step.py).
# Usage (device tool, repo root, carry [".whl"]): bash benchmarks/rollout_gpu.sh   (results in $OUT/)
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/longqa-bench}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
trl() {
    timeout 330 python benchmarks/trl_grpo_step.py --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --prompts 2 \
        --steps 4 --json "$OUT/trl_2x8.json" > "$OUT/trl.log" 2>&1
}
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then CUDA_VISIBLE_DEVICES=1 trl & fi
export CUDA_VISIBLE_DEVICES=0
timeout 150 python -m pytest -q tests/test_rollout_fast.py tests/test_decode_kernel.py -k "cuda or engine" 2>&1 | tail -2
python -m longqa.cli bench rollout --shape qwen3-1.7b --prompt 8192 --new-tokens 1024 -n 8 --groups 1 16 \
    --json "$OUT/rollout_1.7b.json" 2>&1 | grep '^{'
python -m longqa.cli bench step --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --prompts 16 --steps 2 \
    --json "$OUT/step_16x8.json" 2>&1 | grep '^{'
python -m longqa.cli bench step --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --prompts 2 --steps 4 \
    --json "$OUT/step_2x8.json" 2>&1 | grep '^{'
python -m longqa.cli bench step --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --prompts 2 --steps 3 \
    --gradient-checkpointing --json "$OUT/step_2x8_checkpointing.json" 2>&1 | grep '^{'
if [ "$gpus" -ge 2 ]; then wait; else trl; fi
grep -o '{"engine".*}' "$OUT/trl.log"  # TRL's progress bar shares the line
