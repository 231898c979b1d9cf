#!/usr/bin/env bash
# Scale-out on two GPUs of one host (benchmarks/RESULTS.md, "Scale-out"): the same short GRPO run
# (random-weight Qwen3 shape, same global batch) on one GPU, then on two with FSDP2 over NCCL; prints the
# step time and tokens/s of the last step of each. Needs two CUDA GPUs (pick them with CUDA_VISIBLE_DEVICES).
#
# Usage, from the repository root:
#   bash benchmarks/scale_gpu.sh [OUTPUT_DIR [SHAPE [KEY=VALUE...]]]   (default /tmp/longqa-scale-out, qwen3-1.7b)
# KEY=VALUE pairs are config overrides applied to both runs.
set -euo pipefail
out=${1:-/tmp/longqa-scale-out}
shape=${2:-qwen3-1.7b}
shift 2 || shift $#  # the rest: config overrides for both runs
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
[ "$gpus" -ge 2 ] || { echo "scale_gpu.sh needs two CUDA GPUs (torch sees $gpus)" >&2; exit 1; }
common=(--shape "$shape" --context-tokens 4096 --response 512 --prompts 16 -n 8 --steps 3 --lengths max --root "$out/shared")
python benchmarks/scale_run.py "${common[@]}" --out "$out/one" "$@" 2>&1 | tail -1
python -m torch.distributed.run --nproc_per_node 2 benchmarks/scale_run.py "${common[@]}" --out "$out/two" "$@" 2>&1 | tail -1
