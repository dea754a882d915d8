"""Multi30k EN→DE ablations at equal epochs, scored on the validation set only.

Each variant is a `keras-transformer train` command (the recipe's settings
with one change) trained for the same number of epochs (`--epochs`, default
30), then averaged over its last 5 epoch checkpoints and evaluated on val
(beam 4, α 0.6; sacreBLEU, chrF, paper metric). Each row also keeps every
epoch's val loss and updates, so variants that differ in updates per epoch
(batch size) can be compared at equal updates too, and its seconds per epoch
(a row's speed compares only with rows run beside it). The decoding knobs
(beam size, α) and the number of checkpoints averaged need no training:
`--decoding` evaluates the recipe's own run (`mini, lr 5e-3`) on val for each
of them. test2016 is never touched here: the recipe is chosen on val.

Runs go two at a time, each pinned to one core (`taskset`, one TensorFlow
thread), so that every row of the table gets the same share of this 2-core
machine; the rows compare with each other, not with a run that has both
cores (the recipe itself, `scripts/reproduce_multi30k.sh`).

Every finished variant is appended to the JSON at once; running the script
again skips the variants that are there and resumes a half-trained one
(`train --resume`), so it survives being killed.

    python scripts/ablate_multi30k.py [--epochs 30] [--only NAME]... [--list]
        [--decoding] [--data-dir DIR] [--runs runs/ablation]
        [--json results/multi30k_ablation.json]

(The rows of the earlier wall-clock comparison, 40 minutes per variant, are in
`results/multi30k_ablation_40min.json`.)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]

COMMON = [
    "--data",
    "multi30k",
    "--source-lang",
    "en",
    "--target-lang",
    "de",
    "--keep-checkpoints",
    "10",
    "--average-last",
    "5",
]
# The reference point of the changes below: Transformer-Tiny's shape (`mini`),
# peak learning rate 5e-3 after 1000 warmup steps, ~4096-token batches, BPE 8000.
MINI = [
    "--preset",
    "mini",
    "--vocab-size",
    "8000",
    "--batch-tokens",
    "4096",
    "--warmup-steps",
    "1000",
    "--learning-rate",
    "5e-3",
]


def _replace(arguments, **changes):
    """`arguments` with the value after each `--flag` replaced (flag_name=value, None removes it)."""
    result, skip = [], False
    flags = {"--" + key.replace("_", "-"): value for key, value in changes.items()}
    for item in arguments:
        if skip:
            skip = False
            continue
        if item in flags:
            skip = True
            if flags[item] is not None:
                result += [item, str(flags.pop(item))]
            else:
                flags.pop(item)
            continue
        result.append(item)
    for flag, value in flags.items():
        if value is not None:
            result += [flag, str(value)]
    return result


VARIANTS = {
    # Today's recipe (scripts/reproduce_multi30k.sh before this change).
    "small (today)": [
        "--preset",
        "small",
        "--set",
        "dropout_rate=0.3",
        "--vocab-size",
        "8000",
        "--batch-tokens",
        "4096",
        "--warmup-steps",
        "1000",
    ],
    "mini, lr 5e-3": MINI,
    "mini, lr 2.5e-3": _replace(MINI, learning_rate="2.5e-3"),
    "mini 3+3 layers": MINI + ["--set", "num_layers=3"],
    "mini, 8192-token batches": _replace(MINI, batch_tokens=8192, warmup_steps=500),
    "mini, dropout 0.2": MINI + ["--set", "dropout_rate=0.2"],
    "mini, BPE 10000": _replace(MINI, vocab_size=10000),
    "mini, BPE 6000": _replace(MINI, vocab_size=6000),
    "mini, warmup 4000": _replace(MINI, warmup_steps=4000),
    "mini, clip-norm 1": MINI + ["--clip-norm", "1"],
}


def _slug(name):
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").replace("--", "-")


def _pinned(core, command):
    environment = dict(
        os.environ,
        TF_NUM_INTRAOP_THREADS="1",
        TF_NUM_INTEROP_THREADS="1",
        TF_CPP_MIN_LOG_LEVEL="2",
        CUDA_VISIBLE_DEVICES="",
    )
    return ["taskset", "-c", str(core), *command], environment


def _data_dir(args):
    return ["--data-dir", args.data_dir] if args.data_dir else []  # else: the download cache


def _train_command(binary, name, args):
    return [
        binary,
        "train",
        *COMMON,
        *_data_dir(args),
        *VARIANTS[name],
        "--epochs",
        str(args.epochs),
        "--out",
        str(Path(args.runs) / _slug(name)),
        "--resume",
    ]


def _val_scores(binary, model, args, core, beam_size=4, alpha=0.6):
    """sacreBLEU, chrF and the paper metric of `model` (a `.keras` file) on val."""
    command, environment = _pinned(
        core,
        [
            binary,
            "evaluate",
            "--model",
            str(model),
            "--data",
            "multi30k",
            *_data_dir(args),
            "--split",
            "val",
            "--beam-size",
            str(beam_size),
            "--length-penalty",
            str(alpha),
        ],
    )
    subprocess.run(command, env=environment, check=True, stdout=subprocess.DEVNULL)
    report = json.loads((Path(model).parent / "eval-multi30k-val.json").read_text())
    return {
        "val_bleu": round(report["bleu"], 2),
        "val_chrf": round(report["chrf"], 2),
        "val_paper_bleu": None if report.get("paper_bleu") is None else round(report["paper_bleu"], 2),
        "bleu_signature": report["bleu_signature"],
    }


def _evaluate(binary, name, args, core):
    run = Path(args.runs) / _slug(name)
    metrics = json.loads((run / "metrics.json").read_text())
    epochs = metrics["epochs"]
    return {
        "variant": name,
        "command": " ".join(["keras-transformer", "train", *VARIANTS[name], "--epochs", str(args.epochs)]),
        "epochs": len(epochs),
        "optimizer_steps": epochs[-1]["optimizer_steps"],
        "train_minutes": round(sum(e["seconds"] for e in epochs) / 60, 1),
        "seconds_per_epoch": round(statistics.median(e["seconds"] for e in epochs), 1),
        "target_tokens_per_second": round(
            sum(e["target_tokens_per_second"] * e["seconds"] for e in epochs)
            / sum(e["seconds"] for e in epochs),
            1,
        ),
        "parameters": metrics["parameters"],
        "averaged_epochs": metrics.get("averaged"),
        "last_val_loss": epochs[-1].get("val_loss"),
        "val_loss_by_epoch": [[e["optimizer_steps"], e.get("val_loss")] for e in epochs],
        "beam_size": 4,
        "length_penalty": 0.6,
        **_val_scores(binary, run / "averaged.keras", args, core),
    }


DECODING = [(1, 1.0), (4, 0.6), (5, 0.6), (5, 1.0), (5, 1.4), (8, 1.0)]  # (beam size, α)
AVERAGED = (1, 5, 10)  # last N epoch checkpoints averaged


def _decoding_rows(binary, args, results):
    """The decoding knobs and the checkpoints averaged, on the recipe's own run (no training)."""
    name = "mini, lr 5e-3"
    run = Path(args.runs) / _slug(name)
    if not (run / "metrics.json").exists():
        raise SystemExit(f"--decoding evaluates {run}; train it first (--only '{name}').")
    for last in AVERAGED:
        # train --average-last 5 (COMMON) wrote the last-5 average already.
        model = run / ("averaged.keras" if last == 5 else f"averaged-last{last}.keras")
        if not model.exists():
            subprocess.run(
                [binary, "average", "--model", str(run), "--last", str(last), "--output", str(model)],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        for beam_size, alpha in DECODING if last == 5 else [(4, 0.6)]:
            variant = f"{name}: average of {last}, beam {beam_size}, α {alpha}"
            if any(row["variant"] == variant for row in results["rows"]):
                continue
            row = {
                "variant": variant,
                "averaged_last": last,
                "beam_size": beam_size,
                "length_penalty": alpha,
                **_val_scores(binary, model, args, 0, beam_size, alpha),
            }
            results["rows"].append(row)
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
            print(f"  {variant}: val BLEU {row['val_bleu']}", flush=True)


def _run_pair(binary, names, args, results):
    processes = []
    for core, name in enumerate(names):
        log = open(Path(args.runs) / f"{_slug(name)}.log", "a")
        command, environment = _pinned(core, _train_command(binary, name, args))
        print(f"[{time.strftime('%H:%M')}] core {core}: {name}", flush=True)
        processes.append(
            (
                name,
                core,
                subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT),
                log,
            )
        )
    for name, core, process, log in processes:
        status = process.wait()
        log.close()
        if status != 0:
            print(f"  {name}: train exited with {status}; see its log", flush=True)
            continue
        row = _evaluate(binary, name, args, core)
        results["rows"] = [r for r in results["rows"] if r["variant"] != name] + [row]
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"  {name}: {row['epochs']} epochs, val BLEU {row['val_bleu']}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=30, help="epochs each variant trains")
    parser.add_argument(
        "--decoding",
        action="store_true",
        help="evaluate the recipe's run for each beam size, α and number of checkpoints averaged",
    )
    parser.add_argument(
        "--only", action="append", metavar="NAME", help="a variant to run (repeatable; default: all)"
    )
    parser.add_argument("--list", action="store_true", help="print the variants and exit")
    harness.add_data_dir(parser)
    parser.add_argument("--runs", default=str(ROOT / "runs" / "ablation"))
    parser.add_argument("--json", default=str(ROOT / "results" / "multi30k_ablation.json"))
    args = parser.parse_args()
    if args.list:
        for name, arguments in VARIANTS.items():
            print(f"{name}: {' '.join(arguments)}")
        return 0
    names = args.only or list(VARIANTS)
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; --list shows them")
    Path(args.runs).mkdir(parents=True, exist_ok=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    results = (
        json.loads(Path(args.json).read_text())
        if Path(args.json).exists()
        else {"epochs": args.epochs, "setting": "2 runs at a time, 1 core each", "rows": []}
    )
    if results.get("epochs") != args.epochs:
        parser.error(
            f"{args.json} holds rows at --epochs {results.get('epochs')}; use that or another --json"
        )
    binary = str(Path(sys.executable).parent / "keras-transformer")
    if args.decoding:
        _decoding_rows(binary, args, results)
        return 0
    done = {row["variant"] for row in results["rows"]}
    pending = [name for name in names if name not in done]
    for start in range(0, len(pending), 2):
        _run_pair(binary, pending[start : start + 2], args, results)
    print(f"{len(results['rows'])} rows in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
