"""Validation curves of training runs against wall-clock minutes, in one PNG.

For each run directory: validation loss (left) and, where the run measured it
(`train --val-bleu N`), greedy validation BLEU (right), at the end of every
epoch, against the run's cumulative epoch time (training, validation and the
BLEU decoding: what `metrics.json` records as each epoch's `seconds`).
Validation losses compare between runs only when they share a vocabulary.

    python scripts/plot_multi30k_curves.py --out docs/multi30k_curves.png \
        "final recipe=runs/multi30k" "today's recipe=runs/ablation/small-today"
"""

import argparse
import json
import sys
from pathlib import Path

from keras_transformer.plots import plot_validation_curves


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args()
    runs = []
    for item in args.runs:
        label, _, run = item.rpartition("=")
        runs.append((label or run, json.loads((Path(run) / "metrics.json").read_text())["epochs"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    plot_validation_curves(runs, args.out)
    print(f"Wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
