#!/usr/bin/env bash
# An offloaded optimizer on one GPU, FSDP2 against DeepSpeed ZeRO-3: first the host-side optimizer step alone
# (torch's AdamW on the host under FSDP2's offload, DeepSpeed's CPU Adam under ZeRO-3) for a Qwen3-8B shape,
# its time per step and host memory (benchmarks/optimizer_step.py); then whole GRPO steps (`longqa bench step`)
# with each backend on the same work: the unsharded bf16 default, FSDP2 offload, ZeRO-3 offload, ZeRO-3.
# Needs a CUDA GPU (pick it with CUDA_VISIBLE_DEVICES), DeepSpeed (pip install 'longqa[deepspeed]') and a C++
# compiler for its CPU Adam, built on first use.
#
# Usage, from the repository root:
#   bash benchmarks/optimizer_step_gpu.sh [OUTPUT_DIR]            (default /tmp/longqa-optimizer-step)
# Environment: SHAPE (qwen3-8b), LAYERS (all of the shape's; the full Qwen3-8B offloads about 150 GiB to the
# host, so a host with less free memory needs fewer, e.g. LAYERS=18: step time and memory grow with the
# parameters), STEP_SHAPE (qwen3-1.7b, the whole steps' model), DEVICE (cuda; cpu with SHAPE=qwen3-tiny
# STEP_SHAPE=qwen3-tiny checks the harness on a machine without a GPU).
set -euo pipefail
out=${1:-/tmp/longqa-optimizer-step}
shape=${SHAPE:-qwen3-8b}
step_shape=${STEP_SHAPE:-qwen3-1.7b}
device=${DEVICE:-cuda}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python -c "import deepspeed" 2>/dev/null || { echo "optimizer_step_gpu.sh needs DeepSpeed: pip install 'longqa[deepspeed]'" >&2; exit 1; }
mkdir -p "$out"
rm -f "$out/optimizer_step.jsonl"
git rev-parse HEAD > "$out/commit" 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$out/device" 2>/dev/null || echo "$device" > "$out/device"
lscpu | grep -E "^(Model name|CPU\(s\)|Thread)" > "$out/host" 2>/dev/null || true
free -g >> "$out/host" 2>/dev/null || true

if [ "$device" = cpu ]; then small=(--prompt 24 --response 5 -n 3); else small=(); fi
layers=(); [ -n "${LAYERS:-}" ] && layers=(--layers "$LAYERS")
for backend in fsdp2 deepspeed; do  # one process each: the host memory each reports is its own
    python benchmarks/optimizer_step.py --backend "$backend" --shape "$shape" "${layers[@]}" --device "$device" \
        "${small[@]}" --json "$out/optimizer_step.jsonl" 2>"$out/optimizer_step_$backend.log" | tail -1
done

# Whole steps, the same prompts and drawn response lengths for every backend (2 steps: the first warms up).
if [ "$device" = cpu ]; then work=(--prompt 24 --response 5 -n 3 --prompts 2); else work=(--prompt 8192 --response 1024 -n 8 --prompts 16); fi
for run in "bf16-unsharded:" "fsdp2-offload:--cpu-offload" "deepspeed-offload:--strategy deepspeed --cpu-offload" \
           "deepspeed:--strategy deepspeed"; do
    name=${run%%:*} flags=${run#*:}
    # shellcheck disable=SC2086  # $flags is a list of flags
    python -m longqa.cli bench step --shape "$step_shape" "${work[@]}" --steps 2 --device "$device" $flags \
        --json "$out/step_$name.json" 2>"$out/step_$name.log" | tail -1
done
echo "results in $out"
