#!/usr/bin/env bash
# The recipe's shape on one GPU: `longqa train configs/loongrl-qwen3-8b.yaml` on a random-weight Qwen3-8B with
# 16,384-token prompts and responses of drawn lengths up to 2,048 tokens (`rollout.response_lengths=lognormal`: a
# random model never samples EOS), 8 prompts x 8 samples a step, ZeRO-3 with the optimizer offloaded to the host.
# Prints `longqa plan`'s prediction for the same settings, then the run's steps (per-phase times, tokens/s, the GPU's
# and the host's peak memory per step: metrics.jsonl), and the run's peak host memory (its largest resident size).
#
# Usage, from the repository root:  bash benchmarks/recipe_shape_gpu.sh [OUTPUT_DIR]
# Needs one CUDA GPU of about 140 GB (an H200), DeepSpeed (pip install 'longqa[deepspeed]'; its CPU Adam compiles
# on first use with g++ and ninja), about 128 GiB of host memory, and disk for the model folder (16 GB). Writes
# OUTPUT_DIR/model (the random model and the tokenizer), OUTPUT_DIR/data (the questions), OUTPUT_DIR/run (the run).
# Environment (defaults in brackets):
#   SHAPE [qwen3-8b], PROMPT [16384], RESPONSE [2048], N [8], PROMPTS [8] (prompts a step), STEPS [7]
#   TOKENIZER [../shared/tokenizers/qwen2.5]  the tokenizer that measures the prompts and goes with the model
#   STRATEGY [deepspeed]  actor.strategy; EXTRA: more overrides, e.g. "actor.cpu_offload_ratio=0.85"
#   CHECKPOINT [0]  1: also save after step STEPS-1 and resume from it in a second run, whose last step must log
#              what the uninterrupted run's did. An 8B ZeRO-3 checkpoint (float32 masters and two AdamW moments) takes
#              about 98 GB of disk: `longqa train` refuses the run if the first does not fit.
#   RESTART [0]  1: then start the same run again for one step as on another machine: a new folder holding only the
#              first run's compile_cache.bin (what a run folder carries), and empty user caches (OUTPUT_DIR/
#              compile-cache-elsewhere; the first start's are OUTPUT_DIR/compile-cache, emptied at the start so that
#              it is cold). Prints each start's seconds to its update compiled and to its first step's end.
#   Every line of a run is prefixed with the seconds since it began (and kept in OUTPUT_DIR/NAME.log).
#   RANKS [1]  processes under torchrun, one per GPU; with EXTRA="rollout.sampler_ranks=S rollout.mode=one_step_off"
#              the last S of them only sample (`longqa plan CONFIG --gpus RANKS --split` says which S): run once
#              without and once with it to compare the steady steps' tokens/s per GPU, printed at the end.
#   DEVICE [cuda]; DEVICE=cpu SHAPE=qwen3-tiny PROMPT=512 RESPONSE=16 STEPS=3 STRATEGY=fsdp2 checks the harness
#              without a GPU.
set -uo pipefail
out=${1:-${OUT:-/tmp/longqa-recipe-shape}}
shape=${SHAPE:-qwen3-8b}; prompt=${PROMPT:-16384}; response=${RESPONSE:-2048}; n=${N:-8}; prompts=${PROMPTS:-8}
steps=${STEPS:-7}; tokenizer=${TOKENIZER:-../shared/tokenizers/qwen2.5}; strategy=${STRATEGY:-deepspeed}
checkpoint=${CHECKPOINT:-0}; device=${DEVICE:-cuda}; ranks=${RANKS:-1}; restart=${RESTART:-0}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XDG_CACHE_HOME=$out/compile-cache  # (longqa's compile caches are under it: the first start is cold)
unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR
longqa() { python -m longqa.cli "$@"; }
mkdir -p "$out"
rm -rf "$XDG_CACHE_HOME"
[ "$device" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

echo "== a random-weight $shape with the tokenizer of $tokenizer"
python - "$shape" "$out/model" "$tokenizer" "$device" <<'PY' || exit 1
import shutil, sys, time
from pathlib import Path

import torch

from longqa.bench.speed import random_model
from longqa.model.tokenizer import load_tokenizer

shape, folder, tokenizer, device = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
start = time.perf_counter()
model = random_model(shape, device, torch.bfloat16, min_vocab=len(load_tokenizer(str(tokenizer))))
model.save_pretrained(folder)
for file in tokenizer.iterdir():
    if file.is_file():
        shutil.copy(file, folder / file.name)
billions = sum(p.numel() for p in model.parameters()) / 1e9
print(f"saved {billions:.2f}B parameters in {time.perf_counter() - start:.0f} s")
PY

context=$((prompt - 1024 > prompt / 2 ? prompt - 1024 : prompt / 2))  # (room for the question and the chat template)
echo "== questions with $context-token contexts, for $prompt-token prompts"
longqa data synth --output-dir "$out/data" --tokenizer "$tokenizer" --context-tokens "$context" \
    --rows-per-task $((prompts * (steps + 1))) --test-ratio 0.01 --workers 4 | tail -2 || exit 1

settings=("model.path=$out/model" "data.train_files=[$out/data/merged/train.parquet]" "data.val_files=[]"
          "data.cache_dir=$out/cache" "data.max_prompt_length=$prompt" "data.max_response_length=$response"
          "rollout.n=$n" "data.train_batch_size=$prompts" "actor.ppo_mini_batch_size=$prompts"
          "rollout.response_lengths=lognormal" "actor.strategy=$strategy" "actor.cpu_offload=true"
          "trainer.max_steps=$steps" "trainer.test_freq=0" "trainer.logger=[console,jsonl]" "trainer.device=$device"
          ${EXTRA:-})
echo "== the plan"
if [ "$ranks" -gt 1 ]; then  # every split of the GPUs between sampling and training, beside the synchronous step
    longqa plan configs/loongrl-qwen3-8b.yaml --gpus "$ranks" --split --shape "$shape" "${settings[@]}"
else
    longqa plan configs/loongrl-qwen3-8b.yaml --gpus 1 --shape "$shape" "${settings[@]}"
fi

launch=(python -m longqa.cli)
[ "$ranks" -gt 1 ] && launch=(python -m torch.distributed.run --nproc_per_node="$ranks"
                              --master_port=$((29500 + RANDOM % 1000)) -m longqa.cli)
stamp() {  # each line prefixed with the seconds since the pipe began
    python -u -c 'import sys, time
start = time.time()
for line in sys.stdin:
    print(f"{time.time() - start:8.1f}  {line}", end="", flush=True)'
}
peak() {  # peak COMMAND...: run it, then its peak host memory (as /usr/bin/time's %M, which a GPU image may lack)
    python -c 'import resource, subprocess, sys, time
start = time.time()
code = subprocess.call(sys.argv[1:])
kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(f"peak host memory of the run: {kb} KB, {time.time() - start:.2f} s", flush=True)
sys.exit(code)' "$@"
}
train() {  # train RUN_DIR [more overrides]: the run, its peak host memory, its steps (also in RUN_DIR.log)
    local run=$1; shift
    peak "${launch[@]}" train configs/loongrl-qwen3-8b.yaml "${settings[@]}" "trainer.output_dir=$run" "$@" 2>&1 | stamp \
        | tee "$run.log"
}
started() {  # started LOG: the seconds from a start to its update compiled and to its first step's end
    awk -v name="$(basename "$1" .log)" '/compiled the update/ && !c {c = $1} / step 1\// && !s {s = $1}
        END {printf "%s: update compiled at %s s, first step done at %s s\n", name, c ? c : "-", s ? s : "-"}' "$1"
}
echo "== $steps steps"
save=0; [ "$checkpoint" = 1 ] && save=$((steps - 1))
train "$out/run" "trainer.save_freq=$save" || exit 1
python - "$out/run/metrics.jsonl" "$ranks" <<'PY'
import json, sys

steps = [json.loads(line) for line in open(sys.argv[1])][1:]  # (step 1 compiles and captures)
rate = [row["perf/tokens_per_s"] for row in steps]
print(f"steady steps 2-{len(steps) + 1}: {min(rate):,.0f}-{max(rate):,.0f} tokens/s, "
      f"{sum(rate) / len(rate) / int(sys.argv[2]):,.0f} tokens/s per GPU ({sys.argv[2]} ranks)")
PY
if [ "$checkpoint" = 1 ]; then
    echo "== resumed from step $save"
    du -sh "$out/run/checkpoints/step_$(printf %08d "$save")"
    train "$out/resumed" "trainer.resume=$out/run/checkpoints/step_$(printf %08d "$save")" "trainer.save_freq=0" \
        || exit 1
    python - "$out/run/metrics.jsonl" "$out/resumed/metrics.jsonl" <<'PY'
import json, sys

def last(path):  # the last step's metrics, without times, throughput and memory
    row = json.loads(open(path).read().splitlines()[-1])
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))}

straight, resumed = last(sys.argv[1]), last(sys.argv[2])
print("the resumed run's last step logs the uninterrupted run's:", straight == resumed)
PY
fi
if [ "$restart" = 1 ]; then
    echo "== the same run started as on another machine: its run folder's compiled graphs, empty user caches"
    du -sh "$XDG_CACHE_HOME"
    export XDG_CACHE_HOME=$out/compile-cache-elsewhere
    rm -rf "$XDG_CACHE_HOME" "$out/restart"
    mkdir -p "$out/restart"
    if [ -f "$out/run/compile_cache.bin" ]; then du -sh "$out/run/compile_cache.bin"; cp "$out/run/compile_cache.bin" "$out/restart/"
    else echo "the run folder holds no compile_cache.bin (nothing compiled: $device)"; fi
    train "$out/restart" "trainer.max_steps=1" "trainer.save_freq=0" || exit 1
    started "$out/run.log"
    started "$out/restart.log"
fi
du -sh "$XDG_CACHE_HOME"
