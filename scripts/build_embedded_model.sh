#!/usr/bin/env bash
# Builds the embedded default model on one GPU: synthetic data, then `longqa sft` for a few model shapes
# side by side (a tiny model leaves an H200 mostly idle, so three share it), each writing its folder.
# Usage: bash scripts/build_embedded_model.sh OUT_DIR MINUTES
set -euo pipefail
out=${1:?out dir}; minutes=${2:-6.5}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
longqa() { python -m longqa.cli "$@"; }
data=/tmp/longqa-sft-data
for spec in "256 40000 11" "512 60000 12" "768 40000 13"; do
  set -- $spec
  [ -f $data/c$1/merged/train.parquet ] || longqa data synth --output-dir $data/c$1 --context-tokens $1 \
      --rows-per-task $2 --seed $3 --max-hops 3 --workers "$(nproc)" > /dev/null
done
train="$data/c256/merged/train.parquet $data/c512/merged/train.parquet $data/c768/merged/train.parquet"
run() {  # name, then sft flags
  local name=$1; shift
  longqa sft --train-files $train --eval-files $data/c512/merged/test.parquet --output-dir $out/$name \
      --max-minutes "$minutes" --eval-every 500 --eval-rows 512 "$@" > $out/$name.log 2>&1
}
mkdir -p $out
run a --hidden-size 256 --num-layers 6 --num-heads 8 --num-kv-heads 4 --lr 1e-3 &
run b --hidden-size 256 --num-layers 8 --num-heads 8 --num-kv-heads 4 --lr 7e-4 &
run c --hidden-size 256 --num-layers 4 --num-heads 8 --num-kv-heads 4 --lr 1.5e-3 &
wait
