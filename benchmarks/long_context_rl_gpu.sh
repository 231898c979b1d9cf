#!/usr/bin/env bash
# GRPO past the supervised ceiling at long contexts: one command on one GPU, from a starting model to the table
# and the curves. By default the starting model is the embedded longqa-tiny, about 9 minutes on an H200 (data
# 30 s, sft 2.5-3 min, GRPO about 4.5 min for 30 steps, evaluations 30-40 s each: benchmarks/RESULTS.md,
# "Long contexts"); with MODEL=<a model folder or .gguf file> a pretrained model (see "A real model" below).
#   data       `longqa data synth` with the starting model's tokenizer: supervised-training questions at every
#              length, and GRPO questions at every length whose held-out split (405 questions, the same at
#              every length) is the evaluation set
#   sft        `longqa sft --init MODEL`: always reasoning, on contexts up to the longest length, its position
#              limit raised to hold the config's prompt and response limits; MINUTES_SFT minutes (default
#              2.5; 0: no supervised stage, GRPO starts from MODEL itself). Meanwhile `longqa eval` scores the
#              starting model on the held-out questions (eval_start)
#   eval_sft   `longqa eval` of the supervised model: accuracy per context length and per hop count
#   grpo       `longqa train CONFIG` from the supervised model
#   eval_grpo  `longqa export` of its last checkpoint, then `longqa eval` of it on the same questions
#   summary    OUT_DIR/summary.{md,json} and accuracy_by_length.png (benchmarks/long_context_summary.py);
#              the training run's own report (reward, accuracy, lengths, accuracy by length at its first
#              and last validation) is copied to OUT_DIR/report/
# Each stage's output goes to the console and OUT_DIR/logs/<stage>.log; its wall time is printed and kept
# in OUT_DIR/timings.tsv. Nothing is downloaded.
#
# Usage:  bash benchmarks/long_context_rl_gpu.sh OUT_DIR [MINUTES_SFT [KEY=VALUE...]]
# KEY=VALUE pairs override CONFIG for the GRPO stage (actor.lr=1e-4 trainer.max_steps=40 ...).
# Environment (defaults in brackets):
#   MODEL [the embedded model]  the starting model: a model folder or a GGUF file
#   CONFIG [configs/gpu-long.yaml]  the GRPO config; its prompt and response limits also bound the evaluations
#   LENGTHS ["512 1024 2048 4096"]  the context lengths, in tokens of the starting model's tokenizer
#   SYNTH ["--max-hops 3"]  more `longqa data synth` flags, for both sets of questions
#   SFT ["--lr 5e-4 --warmup-steps 50"]  more `longqa sft` flags
#   RL_ROWS [600], SFT_ROWS [2000]  GRPO and supervised-training questions per task and length (135 of the
#              GRPO questions per task are the held-out ones)
# A real model: MODEL=$(python -c 'from longqa.model.load import smollm2_gguf_path; print(smollm2_gguf_path())')
# CONFIG=configs/smollm2-long.yaml LENGTHS="1024 2048 4096 8192" SYNTH="--min-hops 3 --max-hops 4 --near-misses
# --keychain" SFT="--lr 1e-4 --warmup-steps 50 --batch-tokens 16384" RL_ROWS=400 SFT_ROWS=300 trains
# SmolLM2-135M-Instruct on questions of up to 8,192 tokens, 120 GRPO steps: about 22 minutes on one H100
# (benchmarks/RESULTS.md, "A real model").
# With LONGQA_FROM=<an earlier OUT_DIR> the data, the supervised model and their evaluations are that run's
# (linked, not copied) and only GRPO, its evaluation and the summary run: another GRPO setting from the same
# start, about 4 minutes sooner. With MINUTES_SFT=0 as well, only the data and the starting model's
# evaluation are that run's, and GRPO starts from MODEL itself: both starts on the same questions.
# With STOP_AFTER=eval_sft the run ends after the supervised model's evaluation (a summary of the two models
# evaluated is still written): a question setting's difficulty, without the GRPO stage.
# With LONGQA_SMOKE=1 every stage runs at a tiny scale (two context lengths, a few questions, two steps of
# each training): the CPU check that the stages fit together (tests/test_long_context_rl.py).
set -euo pipefail
out=${1:?usage: bash benchmarks/long_context_rl_gpu.sh OUT_DIR [MINUTES_SFT [KEY=VALUE...]]}
minutes=${2:-2.5}
shift $(($# < 2 ? $# : 2))
grpo_overrides=("$@")
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$repo/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
longqa() { python -m longqa.cli "$@"; }

config=${CONFIG:-$repo/configs/gpu-long.yaml}
read -r -a lengths <<< "${LENGTHS:-512 1024 2048 4096}"
read -r -a synth_flags <<< "${SYNTH:---max-hops 3}"
read -r -a sft_flags <<< "${SFT:---lr 5e-4 --warmup-steps 50}"
read -r prompt_limit response_limit <<< "$(python -c "import sys; from longqa.config import load_config
c = load_config(sys.argv[1]).data; print(c.max_prompt_length, c.max_response_length)" "$config")"
if [ "${LONGQA_SMOKE:-0}" = 1 ]; then
    # One thread: matrices this small gain nothing from more, and on a busy CPU threads wait on each other.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    lengths=(256 512); sft_rows=2; rl_rows=4; rl_test=0.25; eval_batch=16 response_limit=48
    sft_scale=(--max-steps 1 --batch-tokens 4096 --warmup-steps 1)
    grpo_scale=(data.train_batch_size=2 rollout.n=2 actor.ppo_mini_batch_size=1 trainer.max_steps=2
                trainer.test_freq=2 trainer.save_freq=2 algo.max_sampling_rounds=1
                data.max_response_length=$response_limit)
else
    # 3 x RL_ROWS GRPO questions of which 135 per task are held out, 405 per length; 3 x SFT_ROWS
    # supervised-training questions at every length (2,000: 46M tokens at 4 lengths up to 4,096, one to three
    # passes of longqa-tiny in the supervised stage's minutes; a 135M model reads about a fifth of that).
    sft_rows=${SFT_ROWS:-2000}; rl_rows=${RL_ROWS:-600}; eval_batch=256
    rl_test=$(python -c "import sys; print(135 / int(sys.argv[1]))" "$rl_rows")
    sft_scale=()
    grpo_scale=()
fi
if [ -n "$(ls -A "$out" 2>/dev/null)" ]; then  # a training run there would resume, not start over
    echo "$out is not empty: give a new OUT_DIR" >&2
    exit 2
fi
mkdir -p "$out/logs"
: > "$out/timings.tsv"
now() { date +%s.%N; }

timed() {  # STAGE COMMAND...: run it, its output to the console and logs/STAGE.log; keep its start and end
    local stage=$1 start; shift
    start=$(now)
    "$@" 2>&1 | tee "$out/logs/$stage.log"
    printf '%s\t%s\t%s\n' "$stage" "$start" "$(now)" >> "$out/timings.tsv"
    echo "== $stage: $(awk -F'\t' -v s="$stage" '$1 == s { printf "%.0f", $3 - $2 }' "$out/timings.tsv") s"
}

evaluate() {  # A_MODEL OUTPUT_JSON: greedy answers to the held-out questions, scored per length and hop count
    longqa eval --model "$1" --data "$out/data/rl/merged/test.parquet" --max-prompt-length $prompt_limit \
        --max-new-tokens $response_limit --batch-size $eval_batch --output "$2" --samples "${2%.json}.jsonl"
}

make_data() {
    local common=("${synth_flags[@]}" --tokenizer "$model" --workers "$(nproc)" --context-lengths "${lengths[@]}")
    longqa data synth --output-dir "$out/data/rl" --rows-per-task $rl_rows --test-ratio $rl_test --seed 1 "${common[@]}"
    longqa data synth --output-dir "$out/data/sft" --rows-per-task $sft_rows --test-ratio 0.01 --seed 2 "${common[@]}"
}

supervised() {
    longqa sft --init "$model" --train-files "$out/data/sft/merged/train.parquet" --output-dir "$out/sft" \
        --max-positions "$positions" --max-prompt-length $prompt_limit --max-minutes "$minutes" \
        --no-think-fraction 0 "${sft_flags[@]}" "${sft_scale[@]}"
}

grpo() {
    longqa train "$config" model.path="$grpo_from" trainer.output_dir="$out/grpo" \
        data.train_files="$out/data/rl/merged/train.parquet" data.val_files="$out/data/rl/merged/test.parquet" \
        data.cache_dir="$out/cache" "${grpo_scale[@]}" "${grpo_overrides[@]}"
}

export_and_evaluate() {
    local last
    last=$(ls -d "$out"/grpo/checkpoints/step_* | sort | tail -n 1)
    longqa export "$last" "$out/grpo_hf"
    evaluate "$out/grpo_hf" "$out/eval_grpo.json"
}

summarize() {
    python "$repo/benchmarks/long_context_summary.py" "$out"
    rm -rf "$out/report" && cp -r "$out/grpo/report" "$out/report"
}

model=${MODEL:-$(python -c "from longqa.model.load import EMBEDDED_MODEL; print(EMBEDDED_MODEL)")}
grpo_from=$out/sft  # the model GRPO starts from
[ "$minutes" = 0 ] && grpo_from=$model
# The supervised model holds a whole prompt and response of the config's limits (rounded up to 512 positions),
# and never fewer positions than the starting model had.
positions=$(python -c "import sys; from longqa.model.load import load_model_config
need = -(-(int(sys.argv[2]) + int(sys.argv[3])) // 512) * 512
print(max(need, load_model_config(sys.argv[1]).max_position_embeddings))" "$model" $prompt_limit $response_limit)
if [ -n "${LONGQA_FROM:-}" ]; then
    from=$(cd "$LONGQA_FROM" && pwd)
    parts=(data eval_start.json eval_start.jsonl)
    [ "$minutes" = 0 ] || parts+=(sft eval_sft.json eval_sft.jsonl)
    for part in "${parts[@]}"; do
        [ -e "$from/$part" ] || { echo "LONGQA_FROM=$LONGQA_FROM has no $part: give a finished run's OUT_DIR" >&2; exit 2; }
        ln -s "$from/$part" "$out/$part"
    done
    echo "${parts[*]} from $from"
elif [ "$minutes" = 0 ]; then  # GRPO from the starting model itself
    timed data make_data
    timed eval_start evaluate "$model" "$out/eval_start.json"
else
    timed data make_data
    timed eval_start evaluate "$model" "$out/eval_start.json" > /dev/null &
    background=$!
    timed sft supervised
    wait $background
    timed eval_sft evaluate "$out/sft" "$out/eval_sft.json"
    if [ "${STOP_AFTER:-}" = eval_sft ]; then
        timed summary python "$repo/benchmarks/long_context_summary.py" "$out"
        exit 0
    fi
fi
timed grpo grpo
timed eval_grpo export_and_evaluate
timed summary summarize
