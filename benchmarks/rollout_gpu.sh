#!/usr/bin/env bash
# The rollout ledger in one run (benchmarks/RESULTS.md, "Rollout" and "Whole GRPO step"): the fast engine's
# CUDA tests, sampling speed (transformers generate vs the fast engine, 1 and 16 groups of 8, 8,192-token
# prompts, 1,024 new tokens), whole GRPO steps per phase (16 x 8, and 2 x 8 with and without gradient
# checkpointing) and TRL's GRPOTrainer on the same 2 x 8 work.
#
# Needs a CUDA GPU with about 80 GiB free (the 16 x 8 step peaks at 76.5 GiB); TRL needs
# `pip install trl datasets` (without them its rows are skipped). With two visible GPUs TRL runs on the
# second while longqa runs on the first, so both are measured in the same run; with one GPU TRL runs last.
# Pick the GPUs with CUDA_VISIBLE_DEVICES.
#
# Usage, from the repository root:  bash benchmarks/rollout_gpu.sh [OUTPUT_DIR]   (default /tmp/longqa-bench)
set -uo pipefail
out=${1:-/tmp/longqa-bench}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$out"
gpus=$(python -c "import torch; print(','.join(map(str, range(torch.cuda.device_count()))))")
[ -n "$gpus" ] || { echo "rollout_gpu.sh needs a CUDA GPU (torch sees none)" >&2; exit 1; }
IFS=, read -ra ids <<< "${CUDA_VISIBLE_DEVICES:-$gpus}"
if python -c "import trl, datasets" 2>/dev/null; then have_trl=1; else
    have_trl=0; echo "TRL's rows skipped: pip install trl datasets" >&2
fi
trl() {
    timeout 330 python benchmarks/trl_grpo_step.py --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --prompts 2 \
        --steps 4 --json "$out/trl_2x8.json" > "$out/trl.log" 2>&1
}
if [ "$have_trl" = 1 ] && [ "${#ids[@]}" -ge 2 ]; then CUDA_VISIBLE_DEVICES=${ids[1]} trl & fi
export CUDA_VISIBLE_DEVICES=${ids[0]}
timeout 150 python -m pytest -q tests/test_rollout_fast.py tests/test_decode_kernel.py -k "cuda or engine" 2>&1 | tail -2
python -m longqa.cli bench rollout --shape qwen3-1.7b --prompt 8192 --new-tokens 1024 -n 8 --groups 1 16 --lengths max \
    --json "$out/rollout_1.7b.json" 2>&1 | grep '^{'
python -m longqa.cli bench step --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --prompts 16 --steps 2 --lengths max \
    --json "$out/step_16x8.json" 2>&1 | grep '^{'
python -m longqa.cli bench step --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --prompts 2 --steps 4 --lengths max \
    --json "$out/step_2x8.json" 2>&1 | grep '^{'
python -m longqa.cli bench step --shape qwen3-1.7b --prompt 8192 --response 1024 -n 8 --prompts 2 --steps 3 --lengths max \
    --gradient-checkpointing --json "$out/step_2x8_checkpointing.json" 2>&1 | grep '^{'
if [ "$have_trl" = 1 ]; then
    if [ "${#ids[@]}" -ge 2 ]; then wait; else trl; fi
    grep -o '{"engine".*}' "$out/trl.log"  # TRL's progress bar shares the line
fi
echo "results in $out"
