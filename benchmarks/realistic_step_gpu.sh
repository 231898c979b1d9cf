#!/usr/bin/env bash
# GRPO steps with realistic response lengths, and the packed update's MFU (benchmarks/RESULTS.md, "Realistic
# steps"). Needs one CUDA GPU with about 140 GB (an H200; pick it with CUDA_VISIBLE_DEVICES).
#
# Usage, from the repository root:  bash benchmarks/realistic_step_gpu.sh step|profile|train [OUTPUT_DIR]
#   step:  20 steps of Qwen3-1.7B, 16 prompts x 8 samples, 8,192-token prompts, responses drawn from the
#          clipped log-normal (mean about 40% of 1,024 tokens); recompilations and graph captures per step.
#   profile: the same steps, 7 of them, once with the update's packed attention on flex (the default) and once
#          on split, one after the other, each profiling its last step (per phase: the device's busy time and
#          its costliest kernels).
#   train: forward+backward of one group in the packed layout (the split attention backend) and the naive
#          padded layout (every layer recomputed, else it does not fit), decoder layers compiled as in
#          training: Qwen3-8B 16,384 + 2,048 x 8 (its first quarter of the layers offloaded to host memory,
#          the least that fits) and Qwen3-1.7B 8,192 + 1,024 x 8 (nothing recomputed or offloaded).
set -uo pipefail
what=${1:?step, profile or train}; out=${2:-${OUT:-/tmp/longqa-realistic}}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
longqa() { python -m longqa.cli "$@" 2>&1 | grep '^{'; }
if [ "$what" = step ]; then
    longqa bench step --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --prompts 16 --steps 20 \
        --lengths lognormal --json "$out/step_1.7b_lognormal.json"
    exit
fi
if [ "$what" = profile ]; then
    for backend in flex split; do
        longqa bench step --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --prompts 16 --steps 7 \
            --lengths lognormal --backend "$backend" --profile --json "$out/step_1.7b_lognormal_$backend.json"
    done
    exit
fi
E8=(--shape qwen3-8b --prompt 16384 --response 2048 -n 8 --compile)
E17=(--shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --compile)
longqa bench train "${E8[@]}" --layouts packed --backend split --checkpoint-fraction 0 --activation-offload 0.25 \
    --repeat 2 --json "$out/train_8b_packed.json"
longqa bench train "${E17[@]}" --layouts packed --backend split --checkpoint-fraction 0 --json "$out/train_1.7b_packed.json"
longqa bench train "${E17[@]}" --layouts naive --repeat 2 --json "$out/train_1.7b_naive.json"
longqa bench train "${E8[@]}" --layouts naive --repeat 1 --json "$out/train_8b_naive.json"
