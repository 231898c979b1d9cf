#!/usr/bin/env bash
# An offloaded optimizer on one GPU, FSDP2 against DeepSpeed ZeRO-3 (about 3 minutes for the optimizer benchmark
# on an H200 host with 16 cores, then up to STEP_LIMIT seconds per whole-step run). First the host-side optimizer
# step alone, for a Qwen3-8B shape: torch's AdamW on the host under FSDP2's offload against DeepSpeed's CPU Adam
# under ZeRO-3's, time per step and host memory, one process each (benchmarks/optimizer_step.py). Then whole GRPO
# steps (`longqa bench step`) with each backend on the same work.
#
# Usage, from the repository root:
#   bash benchmarks/optimizer_step_gpu.sh [OUTPUT_DIR]            (default /tmp/longqa-optimizer-step)
# Writes OUTPUT_DIR/results.jsonl (JSON lines: the environment, CPU Adam's build, one line per optimizer
# benchmark and per whole step, and one per phase with its seconds and exit status) and OUTPUT_DIR/log.txt.
#
# Needs a CUDA GPU (pick it with CUDA_VISIBLE_DEVICES), DeepSpeed (pip install 'longqa[deepspeed]'), and g++,
# ninja and Python's headers, with which DeepSpeed compiles its CPU Adam on first use. Environment:
#   LAYERS     decoder layers of the optimizer benchmark's shape (default 8, 2.85B parameters). Step time and
#              host memory grow with the parameters, and each result also gives seconds per billion: the
#              whole Qwen3-8B (36 layers, 8.19B) needs about 137 GiB of host memory for its offloaded state,
#              more than a host of 128 GiB has.
#   SHAPE      the optimizer benchmark's shape (qwen3-8b); STEP_SHAPE the whole steps' model (qwen3-1.7b)
#   STEP_RUNS  the whole steps' backends, of fsdp2-offload, deepspeed-offload, deepspeed (ZeRO-3, optimizer on
#              the GPU) and unsharded (the bf16 default) (default "fsdp2-offload deepspeed-offload")
#   PARTS      what to run, of "optimizer" (the optimizer step alone) and "steps" (whole steps) (default both)
#   STEPS      whole GRPO steps per run (default 4: the first warms up, the others are the ones to compare)
#   STEP_LIMIT seconds each whole-step run may take (default 600: on one H200 the fsdp2-offload run took
#              129 s to set up and 62, then 40 s a step; the deepspeed-offload run 69 s to set up, 9, then 5 s)
#   DEVICE     cuda; cpu with SHAPE=qwen3-tiny STEP_SHAPE=qwen3-tiny checks the harness without a GPU
#   PYTHON     the interpreter (python3)
# Each phase runs under a time limit, so that a slower host ends the run with what it measured.
set -uo pipefail
out=${1:-/tmp/longqa-optimizer-step}
shape=${SHAPE:-qwen3-8b}
layers=${LAYERS:-8}
step_shape=${STEP_SHAPE:-qwen3-1.7b}
step_runs=${STEP_RUNS:-fsdp2-offload deepspeed-offload}
parts=${PARTS:-optimizer steps}
steps=${STEPS:-4}
step_limit=${STEP_LIMIT:-600}
device=${DEVICE:-cuda}
python=${PYTHON:-python3}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
fail() { echo "optimizer_step_gpu.sh: $*" >&2; exit 1; }

# pip install --target DIR puts ninja's binary in DIR/bin, which is not on PATH: look beside PYTHONPATH.
if ! command -v ninja >/dev/null; then
    IFS=: read -ra dirs <<< "$PYTHONPATH"
    for dir in "${dirs[@]}"; do [ -x "$dir/bin/ninja" ] && export PATH=$dir/bin:$PATH && break; done
fi
command -v g++ >/dev/null || fail "DeepSpeed compiles its CPU Adam with g++, which is not on PATH: install it" \
    "(apt-get install g++)"
command -v ninja >/dev/null || fail "DeepSpeed compiles its CPU Adam with ninja, which is not on PATH nor in a" \
    "bin/ folder beside PYTHONPATH: pip install ninja"
gxx_version=$(g++ --version | head -1) && ninja_version=$(ninja --version) || fail "g++ or ninja does not run"
echo "g++: $gxx_version"
echo "ninja: $ninja_version"
"$python" -c "import deepspeed" 2>/dev/null || fail "needs DeepSpeed ($python cannot import it):" \
    "pip install 'longqa[deepspeed]'"
"$python" -c "import os, sysconfig, sys; sys.exit(not os.path.isfile(sysconfig.get_path('include') + '/Python.h'))" \
    || fail "DeepSpeed compiles its CPU Adam against Python's headers, and $python has none (Python.h):" \
    "install its development package (apt-get install python3-dev)"

mkdir -p "$out"
results=$out/results.jsonl log=$out/log.txt
: > "$results"
: > "$log"
GXX=$gxx_version NINJA=$ninja_version "$python" - >> "$results" 2>> "$log" <<'EOF'
import json, os, subprocess, sys

import deepspeed, psutil, torch, transformers

commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(json.dumps({
    "environment": True, "commit": commit or None,
    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    "host_cores": os.cpu_count(), "host_memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
    "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
    "deepspeed": deepspeed.__version__, "gxx": os.environ["GXX"], "ninja": os.environ["NINJA"]}))
EOF

phase() {  # NAME LIMIT_S COMMAND...: its JSON lines into results.jsonl, all its output into log.txt
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name: $*" >> "$log"
    timeout "$limit" "$@" 2>> "$log" | tee -a "$log" | grep '^{' >> "$results"
    local status=${PIPESTATUS[0]}
    echo "{\"phase\": \"$name\", \"seconds\": $((SECONDS - start)), \"exit\": $status," \
         "\"timed_out\": $([ "$status" = 124 ] && echo true || echo false)}" >> "$results"
    echo "$name: $((SECONDS - start)) s, exit status $status"
}

# CPU Adam's build (cached afterwards, under TORCH_EXTENSIONS_DIR), timed apart from the steps that use it.
phase cpu-adam-build 180 "$python" -c "
import json, time
start = time.perf_counter()
from longqa.distributed.deepspeed import load_cpu_adam
load_cpu_adam()
print(json.dumps({'cpu_adam_build_or_load_s': round(time.perf_counter() - start, 1)}))"

if [ "$device" = cpu ]; then small=(--prompt 24 --response 5 -n 3); else small=(); fi
if [[ " $parts " == *" optimizer "* ]]; then
    for backend in fsdp2 deepspeed; do  # one process each: the host memory each reports is its own
        phase "optimizer-step-$backend" 120 "$python" benchmarks/optimizer_step.py --backend "$backend" \
            --shape "$shape" --layers "$layers" --steps 2 --device "$device" "${small[@]}"
    done
fi

# Whole steps, the same prompts and drawn response lengths for every backend (the first step warms up).
# A small packed budget (prompt + n x response = 1,024 tokens) keeps the update's compiled lengths few (8), and
# the optimizer's step a large part of the whole.
if [ "$device" = cpu ]; then work=(--prompt 24 --response 5 -n 3 --prompts 2); else
    work=(--prompt 512 --response 64 -n 8 --prompts 8); fi
if [[ " $parts " == *" steps "* ]]; then
    for run in $step_runs; do
        case $run in
            fsdp2-offload) flags=(--cpu-offload) ;;
            deepspeed-offload) flags=(--strategy deepspeed --cpu-offload) ;;
            deepspeed) flags=(--strategy deepspeed) ;;
            unsharded) flags=() ;;
            *) fail "STEP_RUNS: unknown run '$run' (fsdp2-offload, deepspeed-offload, deepspeed or unsharded)" ;;
        esac
        phase "step-$run" "$step_limit" "$python" -m longqa.cli bench step --shape "$step_shape" "${work[@]}" \
            --steps "$steps" --device "$device" "${flags[@]}"
    done
fi
echo "results in $results"
