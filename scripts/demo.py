"""`make demo`: the whole pipeline on the built-in synthetic language pair,
through the same code as the `keras-transformer` commands it prints:

    keras-transformer train     --data synthetic --preset tiny ... --out runs/demo --overwrite
    keras-transformer evaluate  --model runs/demo --data synthetic --split test
    keras-transformer translate --model runs/demo < sentences
    keras-transformer attention --model runs/demo --text ... --out runs/demo/attention.png
    keras-transformer export    --model runs/demo --format saved_model --out runs/demo/exports --overwrite
    keras-transformer export    --model runs/demo --format onnx --out runs/demo/onnx --overwrite

then translates 100 test sentences with Keras, the reloaded SavedModel and
ONNX Runtime (full graph, encoder/decoder-step pair, text graph) and checks
that they agree (`keras_transformer_export.parity`). It fails (exit 1) unless the test-split
BLEU reaches 90 (the synthetic task is learnable, so a lower score is a bug)
and every runtime gives Keras's translations.

    python scripts/demo.py [--out runs/demo] [--epochs 10]
"""

import argparse
import io
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from keras_transformer import cli  # noqa: E402
from keras_transformer.data.corpora import load_corpus  # noqa: E402

BLEU_FLOOR = 90.0
PARITY_SENTENCES = 100


def run(*arguments):
    print(f"\n$ keras-transformer {' '.join(arguments)}", flush=True)
    status = cli.main(list(arguments))
    if status != 0:
        raise SystemExit(f"demo FAILED: keras-transformer {arguments[0]} exited with {status}")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/demo")
    parser.add_argument("--epochs", default="10")
    args = parser.parse_args()
    start = time.perf_counter()
    # tiny preset (2+2 layers, d_model 64): 10 epochs of 113 batches of ~4096
    # tokens on 20,000 synthetic pairs, about 45 s per epoch on 2 CPU cores.
    run(
        "train",
        "--data",
        "synthetic",
        "--preset",
        "tiny",
        "--vocab-size",
        "1000",
        "--batch-tokens",
        "4096",
        "--warmup-steps",
        "400",
        "--epochs",
        args.epochs,
        "--out",
        args.out,
        "--overwrite",
    )
    run("evaluate", "--model", args.out, "--data", "synthetic", "--split", "test")
    with open(os.path.join(args.out, "eval-synthetic-test.json"), encoding="utf-8") as file:
        bleu = json.load(file)["bleu"]

    sources, references = load_corpus("synthetic")["test"]
    print(f"\n$ keras-transformer translate --model {args.out} < (3 test sentences)")
    stdin, sys.stdin = sys.stdin, io.TextIOWrapper(io.BytesIO("\n".join(sources[:3]).encode() + b"\n"))
    output, sys.stdout = sys.stdout, io.StringIO()
    try:
        cli.main(["translate", "--model", args.out])
        translations = sys.stdout.getvalue().splitlines()
    finally:
        sys.stdin, sys.stdout = stdin, output
    for source, translation, reference in zip(sources, translations, references):
        print(f"  source:      {source}\n  translation: {translation}\n  reference:   {reference}\n")
    run(
        "attention",
        "--model",
        args.out,
        "--text",
        sources[0],
        "--out",
        os.path.join(args.out, "attention.png"),
    )

    run(
        "export",
        "--model",
        args.out,
        "--format",
        "saved_model",
        "--out",
        os.path.join(args.out, "exports"),
        "--name",
        "demo",
        "--version",
        "1",
        "--overwrite",
    )
    run(
        "export",
        "--model",
        args.out,
        "--format",
        "onnx",
        "--out",
        os.path.join(args.out, "onnx"),
        "--overwrite",
    )
    parity = _check_parity(args.out, sources[:PARITY_SENTENCES])

    print(f"\nDemo finished in {(time.perf_counter() - start) / 60:.1f} min. Artifacts in {args.out}/:")
    for name in sorted(os.listdir(args.out)):
        print(f"  {os.path.join(args.out, name)}")
    if bleu < BLEU_FLOOR:
        raise SystemExit(f"demo FAILED: test BLEU {bleu:.2f} < {BLEU_FLOOR}")
    print(f"Test BLEU {bleu:.2f} >= {BLEU_FLOOR}: OK")
    disagreeing = {name: r for name, r in parity["runtimes"].items() if r["identical"] != parity["sentences"]}
    if disagreeing or parity["max_logit_difference"] > 1e-4:
        raise SystemExit(
            f"demo FAILED: exported models disagree with Keras: {disagreeing}, "
            f"max logit difference {parity['max_logit_difference']:.2e}"
        )
    print("SavedModel and ONNX Runtime give Keras's translations: OK")


def _check_parity(run_dir, sentences):
    from keras_transformer.training.run_directory import RunDirectory, load_model
    from keras_transformer_export.parity import check_parity

    print(
        f"\n$ python -c 'keras_transformer_export.parity.check_parity(...)'  "
        f"({len(sentences)} test sentences)"
    )
    report = check_parity(
        load_model(os.path.join(run_dir, "model.keras")),
        RunDirectory(run_dir).tokenizer(),
        sentences,
        saved_model_dir=os.path.join(run_dir, "exports", "demo", "1"),
        onnx_dir=os.path.join(run_dir, "onnx"),
    )
    for name, result in report["runtimes"].items():
        print(f"  {name:<12} {result['identical']}/{report['sentences']} translations identical to Keras")
    print(f"  forward.onnx logits: max |difference| to Keras {report['max_logit_difference']:.2e}")
    with open(os.path.join(run_dir, "parity.json"), "w", encoding="utf-8") as file:
        json.dump(report, file, indent=2, ensure_ascii=False)
    return report


if __name__ == "__main__":
    main()
