#!/usr/bin/env bash
# Issue 6 on two H200s (device kind nvidia-h200-x2): the same short GRPO run (random-weight Qwen3
# shape, same global batch) on one GPU, then on two with FSDP2 over NCCL; prints step time and
# tokens/s of the last step of each. Usage (repo root): bash benchmarks/scale_gpu.sh [SHAPE [KEY=VALUE...]]
set -euo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/longqa-scale-out}
shape=${1:-qwen3-1.7b}
shift || true  # the rest: config overrides for both runs
common=(--shape "$shape" --context-tokens 4096 --response 512 --prompts 16 -n 8 --steps 3 --root /tmp/longqa-scale)
python benchmarks/scale_run.py "${common[@]}" --out "$OUT/one" "$@" 2>&1 | tail -1
python -m torch.distributed.run --nproc_per_node 2 benchmarks/scale_run.py "${common[@]}" --out "$OUT/two" "$@" 2>&1 | tail -1
