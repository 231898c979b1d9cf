#!/usr/bin/env bash
# Speculative decoding (rollout.speculative=prompt_lookup) on one GPU:
#   (a) wall-clock rollouts of a trained model's real samples with and without speculation, k = 2, 4, 8:
#       the embedded model (or MODEL=<folder>, e.g. a model trained on the GPU) at its longest contexts
#       (synthetic questions of CONTEXT tokens, default 768, the longest the embedded model was trained
#       on), 256 prompts x 8 samples, temperature 1, EOS stops; drafts, kept drafts and sameness per k;
#   (b) at the Qwen3-1.7B shape (random weights, 16 groups x 8, 8,192-token prompts, 1,024 new tokens):
#       the cost of a decode step verifying k + 1 tokens per sample against a one-token step. Random
#       prompts give no right drafts, so every speculating step computes k + 1 tokens per row and keeps
#       one: its ms per step over the plain run's is that cost;
#   and from both the projected speed-up at 1.7B (tokens a row-step makes in (a) over the cost in (b))
#   and the projected fraction of the one-token floor beside the measured one.
# Then runs the CUDA tests of the speculating engine and of the several-token decode attention.
#
# Needs a CUDA GPU with about 80 GiB free (an H200; pick it with CUDA_VISIBLE_DEVICES).
# Usage, from the repository root:  bash benchmarks/speculative_gpu.sh [OUTPUT_DIR]   (default /tmp/longqa-speculative)
set -uo pipefail
out=${1:-/tmp/longqa-speculative}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python benchmarks/speculative_rollout.py ${MODEL:+--model "$MODEL"} --context-tokens "${CONTEXT:-768}" \
    --rows-per-task 344 --longest --prompts 256 -n 8 --max-new-tokens 256 --k 2 4 8 --device cuda \
    --work-dir "$out/data" --json "$out/real_samples.json" 2>&1 | grep '^{'
longqa() { python -m longqa.cli "$@" 2>&1 | grep '^{'; }
common=(--shape qwen3-1.7b --prompt 8192 --new-tokens 1024 -n 8 --groups 16 --lengths max --hf-new-tokens 0)
longqa bench rollout "${common[@]}" --json "$out/step_1.7b_k0.json"
for k in 2 4 8; do
    longqa bench rollout "${common[@]}" --speculative prompt_lookup --num-speculative-tokens "$k" \
        --json "$out/step_1.7b_k$k.json"
done
python - "$out" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
real = {row["k"]: row for row in json.loads((out / "real_samples.json").read_text())}
plain = json.loads((out / "step_1.7b_k0.json").read_text())[0]
for k in (2, 4, 8):
    step = json.loads((out / f"step_1.7b_k{k}.json").read_text())[0]
    cost = step["decode_ms_per_step"] / plain["decode_ms_per_step"]  # a (k+1)-token step over a one-token step
    speedup = real[k]["tokens_per_row_step"] / cost
    print(json.dumps({"k": k, "step_cost_vs_one_token": round(cost, 3),
                      "tokens_per_row_step": real[k]["tokens_per_row_step"],
                      "real_samples_speedup_measured": real[k]["speedup"],
                      "projected_speedup_1.7b": round(speedup, 3),
                      "fraction_of_floor_measured_1.7b": plain["fraction_of_floor"],
                      "fraction_of_floor_projected_1.7b": round(plain["fraction_of_floor"] * speedup, 3)}))
EOF
timeout 300 python -m pytest -q tests/test_speculative.py tests/test_decode_kernel.py -k "cuda or several" 2>&1 | tail -2
echo "results in $out"
