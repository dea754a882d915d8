#!/usr/bin/env bash
# Multi30k EN->DE with the `small` preset on a CPU, in about two hours:
# train (time-boxed), average the last 5 epoch checkpoints, evaluate the
# averaged model with beam 4, alpha 0.6 on val and test2016 (sacreBLEU + chrF).
#
#   scripts/reproduce_multi30k.sh [DATA_DIR] [RUN_DIR] [TRAIN_MINUTES]
#
# DATA_DIR defaults to ../shared/data/multi30k (a local copy of the official
# files); without one, use `--data multi30k` with no --data-dir to download.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA_DIR=${1:-../shared/data/multi30k}
RUN=${2:-runs/multi30k-small}
MINUTES=${3:-100}
BIN=${BIN:-.venv/bin}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}

start=$(date +%s)
# small preset (3+3 layers, d_model 256, 4 heads, d_ff 1024) with dropout 0.3
# for a 29k-pair corpus; joint BPE 8000; ~4096 tokens per batch; Noam warmup
# 1000 steps (about 6 epochs).
"$BIN/keras-transformer" train --data multi30k --data-dir "$DATA_DIR" \
    --source-lang en --target-lang de --preset small --set dropout_rate=0.3 \
    --vocab-size 8000 --batch-tokens 4096 --warmup-steps 1000 --epochs 40 \
    --max-minutes "$MINUTES" --keep-checkpoints 5 --out "$RUN" --resume
"$BIN/keras-transformer" average --model "$RUN" --last 5
for split in val test; do
    "$BIN/keras-transformer" evaluate --model "$RUN/averaged.keras" --data multi30k \
        --data-dir "$DATA_DIR" --split "$split" --beam-size 4 --length-penalty 0.6
done
echo "Total wall time: $(( ($(date +%s) - start) / 60 )) min"
