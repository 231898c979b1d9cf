#!/usr/bin/env bash
# Packed training vs the naive padded layout (benchmarks/RESULTS.md, "Packed training"): exactness of the
# compiled flex backend on CUDA, then naive vs packed forward+backward per group at the Qwen3-1.7B shape
# (eager and with compiled decoder layers), then the Qwen3-8B packed group at 16K + 4K x 8.
# Needs one CUDA GPU with about 40 GB free (pick it with CUDA_VISIBLE_DEVICES).
#
# Usage, from the repository root:  bash benchmarks/train_layouts_gpu.sh [OUTPUT_DIR]   (default /tmp/longqa-bench)
set -uo pipefail
out=${1:-/tmp/longqa-bench}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
    || { echo "train_layouts_gpu.sh needs a CUDA GPU (torch sees none)" >&2; exit 1; }
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -m pytest -q tests/test_packing.py 2>&1 | tail -2
bench() { python -m longqa.cli bench train "$@" 2>&1 | grep '^{'; }
bench --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --repeat 3 --json "$out/train_1.7b_eager.json"
bench --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --repeat 3 --compile --json "$out/train_1.7b_compiled.json"
bench --shape qwen3-8b --prompt 16384 --response 4096 -n 8 --layouts packed --repeat 2 --compile \
    --json "$out/train_8b_compiled.json"
echo "results in $out"
