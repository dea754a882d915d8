#!/usr/bin/env bash
# How many epoch checkpoints to average: the recipe's ensemble, its members re-averaged over
# their last N epochs, scored on val (never test2016) at the ensemble's beam 8 and each alpha.
#
#   scripts/ablate_average_window.sh RUN_DIR [DATA_DIR]
#
# RUN_DIR: a run of scripts/reproduce_multi30k.sh's two members trained with --keep-checkpoints
# at least the largest N (WINDOWS, default "10 20 30"; ALPHAS default "1.0 0.6 1.4"). Training
# is deterministic on one machine, so the members are the recipe's own (their epoch checkpoints'
# sha256 can be compared with a recipe run's checkpoints/manifest.json). An evaluation already
# written (RUN_DIR/eval-val-avgN-beam8-alphaA.json) is kept, not re-run. Writes
# results/multi30k_average_window.json.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:?usage: scripts/ablate_average_window.sh RUN_DIR [DATA_DIR]}
DATA_DIR=${2:--}
BIN=${BIN:-.venv/bin}
WINDOWS=${WINDOWS:-10 20 30}
ALPHAS=${ALPHAS:-1.0 0.6 1.4}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
DATA=(--data multi30k)
[ "$DATA_DIR" != "-" ] && DATA+=(--data-dir "$DATA_DIR")
"$BIN/python" -c "import sacremoses" 2>/dev/null || "$BIN/python" -m pip install --quiet sacremoses
for N in $WINDOWS; do
    for member in "$RUN"/member-*; do
        [ -e "$member/averaged-$N.keras" ] ||
            "$BIN/keras-transformer" average --model "$member" --last "$N" --output "$member/averaged-$N.keras"
    done
    for alpha in $ALPHAS; do
        report="$RUN/eval-val-avg$N-beam8-alpha$alpha.json"
        [ -e "$report" ] && continue
        models=("$RUN"/member-*/averaged-"$N".keras)
        "$BIN/keras-transformer" evaluate --model "${models[@]}" "${DATA[@]}" --split val \
            --beam-size 8 --length-penalty "$alpha" --output "$RUN/translations-val-avg$N-beam8-alpha$alpha.txt"
        cp "$(dirname "${models[0]}")/eval-multi30k-val.json" "$report"
    done
done
"$BIN/python" - "$RUN" "$WINDOWS" "$ALPHAS" <<'PYTHON'
import json, sys
from pathlib import Path

sys.path.insert(0, "scripts")
import harness

run, windows, alphas = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3].split()
rows = {}
for n in windows:
    for alpha in alphas:
        found = json.loads((run / f"eval-val-avg{n}-beam8-alpha{alpha}.json").read_text())
        rows[f"last {n}, alpha {alpha}"] = {key: found[key] for key in ("bleu", "chrf", "paper_bleu", "bleu_signature")}
        print(f"average of the last {n:>2} epochs, beam 8, alpha {alpha}: val BLEU {found['bleu']:.2f}, chrF {found['chrf']:.2f}")
manifests = {m.name: json.loads((m / "checkpoints" / "manifest.json").read_text()) for m in sorted(run.glob("member-*"))}
last = {name: found[max(found)]["sha256"] for name, found in manifests.items()}
harness.write_report("results/multi30k_average_window.json", run=str(run), split="val", beam_size=8, rows=rows, last_checkpoint_sha256=last)
PYTHON
