"""`make demo`: the whole pipeline on the built-in synthetic language pair,
through the same code as the `keras-transformer` commands it prints. It writes
the pair as aligned text files (`data/demo/{train,val,test}.{en,de}`, as a
user's own corpus would be) and runs the README's quick start on them, exactly
(`QUICK_START`; tests/test_demo.py checks that the README shows these commands):

    keras-transformer train     --data "files:train=...;val=..." --preset tiny ... --out runs/demo --overwrite
    keras-transformer translate --model runs/demo < (3 test sentences)
    keras-transformer evaluate  --model runs/demo --data "files:test=..." --split test

then draws one sentence's attention and exports the run:

    keras-transformer attention --model runs/demo --text ... --out runs/demo/attention.png
    keras-transformer export    --model runs/demo --format saved_model --out runs/demo/exports --overwrite
    keras-transformer export    --model runs/demo --format onnx --out runs/demo/onnx --overwrite

and translates 100 test sentences with Keras, the reloaded SavedModel and
ONNX Runtime (full graph, encoder/decoder-step pair, lean graph, text graph) to check
that they agree (`keras_transformer_export.parity`). It fails (exit 1) unless the test-split
BLEU reaches 90 (the synthetic task is learnable, so a lower score is a bug)
and every runtime gives Keras's translations. `make demo` runs it from the
repository root; `.ci/run` runs `make demo` after `make test`.

    python scripts/demo.py [--data data/demo] [--out runs/demo]
"""

import argparse
import io
import json
import os
import shlex
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from keras_transformer import cli  # noqa: E402
from keras_transformer.data.corpora import load_corpus  # noqa: E402

BLEU_FLOOR = 90.0
PARITY_SENTENCES = 100


def run(*arguments):
    print(f"\n$ keras-transformer {shlex.join(arguments)}", flush=True)
    status = cli.main(list(arguments))
    if status != 0:
        raise SystemExit(f"demo FAILED: keras-transformer {arguments[0]} exited with {status}")


def quick_start(data="data/demo", out="runs/demo"):
    """The README's quick start: `(train arguments, translate arguments, evaluate arguments)`."""
    train = [
        "train",
        "--data",
        f"files:train={data}/train.en,{data}/train.de;val={data}/val.en,{data}/val.de",
        "--preset",
        "tiny",
        "--vocab-size",
        "1000",
        "--warmup-steps",
        "400",
        "--epochs",
        "10",
        "--out",
        out,
        "--overwrite",
    ]
    translate = ["translate", "--model", out]
    evaluate = [
        "evaluate",
        "--model",
        out,
        "--data",
        f"files:test={data}/test.en,{data}/test.de",
        "--split",
        "test",
    ]
    return train, translate, evaluate


def write_corpus(data):
    """The synthetic pair's splits as aligned UTF-8 files in `data`."""
    os.makedirs(data, exist_ok=True)
    for split, (sources, targets) in load_corpus("synthetic").splits.items():
        for language, lines in (("en", sources), ("de", targets)):
            with open(os.path.join(data, f"{split}.{language}"), "w", encoding="utf-8") as file:
                file.write("".join(f"{line}\n" for line in lines))
    print(f"\n$ (the synthetic pair written as aligned text files: {data}/{{train,val,test}}.{{en,de}})")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default="data/demo")
    parser.add_argument("--out", default="runs/demo")
    args = parser.parse_args()
    start = time.perf_counter()
    # tiny preset (2+2 layers, d_model 64): 10 epochs of 113 batches of ~4096 tokens on
    # 20,000 synthetic pairs.
    write_corpus(args.data)
    train, translate, evaluate = quick_start(args.data, args.out)
    run(*train)
    run(*evaluate)
    with open(os.path.join(args.out, "eval-files-test.json"), encoding="utf-8") as file:
        bleu = json.load(file)["bleu"]

    sources, references = load_corpus("synthetic")["test"]
    print(f"\n$ keras-transformer {shlex.join(translate)} < (3 test sentences)")
    stdin, sys.stdin = sys.stdin, io.TextIOWrapper(io.BytesIO("\n".join(sources[:3]).encode() + b"\n"))
    output, sys.stdout = sys.stdout, io.StringIO()
    try:
        cli.main(translate)
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
        saved_model=os.path.join(run_dir, "exports", "demo", "1"),
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
