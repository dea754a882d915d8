#!/usr/bin/env bash
# The recipe's evaluation of a trained Multi30k run (scripts/reproduce_multi30k.sh calls it
# after training; any run directory with an averaged.keras can be given, or one whose
# member-*/averaged.keras are an ensemble's models): the beam size and the length penalty
# alpha are chosen on val, then test2016 is scored once with them.
#
#   scripts/evaluate_multi30k_run.sh RUN_DIR [DATA_DIR]
#
# Candidates: BEAMS (default "5 8") x ALPHAS (default "0.6 0.8 1.0 1.2 1.4": 0.8 and 1.2 since
# 2026-12-07, when the recipe's ensemble read val 42.02 / 41.98 at them against 41.89 at the
# chosen 1.0, ~45 s a candidate, docs/results.md); each one's val scores
# go to RUN_DIR/eval-val-beamB-alphaA.json (translations beside it), the chosen one's to
# RUN_DIR/eval-multi30k-val.json, test2016's to RUN_DIR/eval-multi30k-test.json. Beam 8
# joined the candidates at 85 epochs with dropout 0.2: val 41.12 at alpha 1.0 against 40.93
# at beam 5 (docs/results.md); beam 12 gave nothing more (41.05). An ensemble's search costs
# a model's times its members: its candidates are beam 8 alone (BEAMS default "8"), the beam
# val chose in each of the recipe's last three single-model runs.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:?usage: scripts/evaluate_multi30k_run.sh RUN_DIR [DATA_DIR]}
DATA_DIR=${2:--}
BIN=${BIN:-.venv/bin}
if [ -e "$RUN/averaged.keras" ]; then
    MODELS=("$RUN/averaged.keras")
    BEAMS=${BEAMS:-5 8}
else
    MODELS=("$RUN"/member-*/averaged.keras)
    [ -e "${MODELS[0]}" ] || { echo "$RUN holds no averaged.keras (nor member-*/averaged.keras)" >&2; exit 2; }
    BEAMS=${BEAMS:-8}
fi
REPORTS=$(dirname "${MODELS[0]}")  # where `evaluate` writes eval-multi30k-SPLIT.json: the first model's run
ALPHAS=${ALPHAS:-0.6 0.8 1.0 1.2 1.4}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
DATA=(--data multi30k)
[ "$DATA_DIR" != "-" ] && DATA+=(--data-dir "$DATA_DIR")

# The paper metric tokenizes with sacremoses (not a dependency of the package).
"$BIN/python" -c "import sacremoses" 2>/dev/null || "$BIN/python" -m pip install --quiet sacremoses
best=""; best_bleu=-1
for beam in $BEAMS; do
    for alpha in $ALPHAS; do
        name="beam$beam-alpha$alpha"
        "$BIN/keras-transformer" evaluate --model "${MODELS[@]}" "${DATA[@]}" --split val \
            --beam-size "$beam" --length-penalty "$alpha" --output "$RUN/translations-val-$name.txt"
        cp "$REPORTS/eval-multi30k-val.json" "$RUN/eval-val-$name.json"
        bleu=$("$BIN/python" -c "import json,sys; print(json.load(open(sys.argv[1]))['bleu'])" \
               "$RUN/eval-val-$name.json")
        if "$BIN/python" -c "import sys; sys.exit(not float(sys.argv[1]) > float(sys.argv[2]))" \
               "$bleu" "$best_bleu"; then
            best=$name; best_beam=$beam; best_alpha=$alpha; best_bleu=$bleu
        fi
    done
done
cp "$RUN/eval-val-$best.json" "$RUN/eval-multi30k-val.json"
echo "chosen on val: beam $best_beam, alpha $best_alpha (BLEU $best_bleu)"
"$BIN/keras-transformer" evaluate --model "${MODELS[@]}" "${DATA[@]}" --split test \
    --beam-size "$best_beam" --length-penalty "$best_alpha" --output "$RUN/translations-multi30k-test.txt"
[ "$REPORTS" = "$RUN" ] || cp "$REPORTS/eval-multi30k-test.json" "$RUN/eval-multi30k-test.json"
