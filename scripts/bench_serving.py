"""Serving speed, side by side in one run: the Keras model, the reloaded
SavedModel, and ONNX Runtime (the full translate graph with its `Loop`, and
the encoder + decoder-step pair driven by NumPy beam search).

Every runtime does the whole job, text in and text out, with beam 4 and
alpha 0.6:

| runtime       | what runs                                                            |
|---------------|----------------------------------------------------------------------|
| keras         | `keras_transformer.Translator`: tf-text tokenization, beam search in one compiled `tf.function` (no XLA), detokenization |
| saved_model   | `tf.saved_model.load(...).signatures["serving_default"]` (what TF Serving runs) |
| onnx_full     | `export.onnx_runtime.OnnxTranslator(mode="full")`: sentencepiece + `translate.onnx` |
| onnx_split    | `OnnxTranslator(mode="split")`: sentencepiece + `encoder.onnx` / `decoder_step.onnx` |

First all four translate the same sentences and must give identical
translations (checked again on every timed translation; the script stops
before printing timings if they differ). Then:
latency at batch 1 (median and 90th percentile over `--single` sentences,
each translated alone) and throughput at batch 32 (sentences/s over
`--batches` batches). The `translate_text.onnx` text graph is not timed: its
SentencePiece custom op crashes in a process that has loaded TensorFlow
(`export.onnx_runtime.make_session`).

    python scripts/bench_serving.py [--model runs/multi30k-small] [--data-dir ../shared/data/multi30k]
                                    [--single 30] [--batches 4] [--json bench_results/serving.json]
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from export.graphs import TranslationGraphs  # noqa: E402
from export.onnx import export_onnx  # noqa: E402
from export.onnx_runtime import OnnxTranslator  # noqa: E402
from export.saved_model import export_saved_model  # noqa: E402
from keras_transformer.run_directory import load_model, resolve_model  # noqa: E402
from keras_transformer.translator import Translator  # noqa: E402
from keras_transformer.validation import UserError  # noqa: E402

BATCH = 32


def runtimes(model, tokenizer, directory):
    """`{name: translate(list of str) -> list of str}` for the four runtimes."""
    graphs = TranslationGraphs(model, tokenizer)
    saved = export_saved_model(graphs, os.path.join(directory, "serving"), "bench")
    onnx_dir = export_onnx(graphs, os.path.join(directory, "onnx"))
    keras_translator = Translator(model, tokenizer, batch_size=BATCH)
    signature = tf.saved_model.load(saved).signatures["serving_default"]
    full = OnnxTranslator(onnx_dir, "full", batch_size=BATCH)
    split = OnnxTranslator(onnx_dir, "split", batch_size=BATCH)

    def saved_model(sentences):
        out = signature(text=tf.constant(sentences))["translation"].numpy()
        return [t.decode("utf-8") for t in out]

    return {
        "keras": lambda s: keras_translator.translate(s)[0],
        "saved_model": saved_model,
        "onnx_full": lambda s: full.translate(s)[0],
        "onnx_split": lambda s: split.translate(s)[0],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/multi30k-small",
                        help="a trained run directory or .keras file (default runs/multi30k-small)")
    parser.add_argument("--data-dir", default=os.path.join("..", "shared", "data", "multi30k"))
    parser.add_argument("--split", default="test2016")
    parser.add_argument("--single", type=int, default=30, help="sentences timed at batch 1")
    parser.add_argument("--batches", type=int, default=4, help="batches of 32 timed")
    parser.add_argument("--json", default="bench_results/serving.json")
    args = parser.parse_args()

    try:
        run, model_path = resolve_model(args.model)
    except UserError as error:
        raise SystemExit(f"bench_serving: {error} Train a small model first "
                         f"(scripts/reproduce_multi30k.sh) or pass --model.") from None
    model, tokenizer = load_model(model_path), run.tokenizer()
    with open(os.path.join(args.data_dir, f"{args.split}.{run.settings()['options']['source_lang']}"),
              encoding="utf-8") as handle:
        sentences = [line.rstrip("\n") for line in handle]
    single = sentences[: args.single]
    batched = sentences[args.single: args.single + BATCH * args.batches]

    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        translate = runtimes(model, tokenizer, directory)
        export_seconds = time.perf_counter() - start

        # Same translations everywhere (this also warms up / traces every runtime).
        outputs = {name: f(batched[:BATCH]) + [f([s])[0] for s in single[:3]]
                   for name, f in translate.items()}
        reference = outputs["keras"]
        agreement = {name: sum(a == b for a, b in zip(reference, texts))
                     for name, texts in outputs.items()}
        print(f"Identical translations ({len(reference)} sentences): {agreement}")
        if any(count != len(reference) for count in agreement.values()):
            raise SystemExit("bench_serving: the runtimes disagree; no timings printed.")

        results, timed_outputs = {}, {}
        for name, f in translate.items():
            latencies, texts = [], []
            for sentence in single:
                tick = time.perf_counter()
                texts += f([sentence])
                latencies.append(time.perf_counter() - tick)
            tick = time.perf_counter()
            for b in range(args.batches):
                texts += f(batched[b * BATCH:(b + 1) * BATCH])
            seconds = time.perf_counter() - tick
            timed_outputs[name] = texts
            results[name] = {
                "batch1_median_ms": 1000 * statistics.median(latencies),
                "batch1_p90_ms": 1000 * float(np.percentile(latencies, 90)),
                "batch32_sentences_per_s": len(batched) / seconds,
            }
            print(f"  timed {name}", flush=True)

    # The timed runs, too, must have translated identically.
    agreement = {name: sum(a == b for a, b in zip(timed_outputs["keras"], texts))
                 for name, texts in timed_outputs.items()}
    print(f"Identical translations in the timed runs ({len(timed_outputs['keras'])} sentences): "
          f"{agreement}")
    if any(count != len(timed_outputs["keras"]) for count in agreement.values()):
        raise SystemExit("bench_serving: the runtimes disagree; no timings printed.")
    base = results["saved_model"]
    print(f"\nModel {model_path} ({model.count_params():,} parameters), beam 4, alpha 0.6; "
          f"{len(single)} sentences at batch 1, {len(batched)} at batch {BATCH}; "
          f"{os.cpu_count()} CPU cores.\n")
    print("| runtime | batch 1 median ms | batch 1 p90 ms | vs SavedModel (batch 1) "
          "| batch 32 sentences/s | vs SavedModel (batch 32) |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        r["batch1_speedup_vs_saved_model"] = base["batch1_median_ms"] / r["batch1_median_ms"]
        r["batch32_speedup_vs_saved_model"] = r["batch32_sentences_per_s"] / base["batch32_sentences_per_s"]
        print(f"| {name} | {r['batch1_median_ms']:.0f} | {r['batch1_p90_ms']:.0f} | "
              f"{r['batch1_speedup_vs_saved_model']:.2f}x | {r['batch32_sentences_per_s']:.1f} | "
              f"{r['batch32_speedup_vs_saved_model']:.2f}x |")
    report = {
        "model": str(model_path), "parameters": model.count_params(), "split": args.split,
        "single_sentences": len(single), "batched_sentences": len(batched), "batch": BATCH,
        "identical_translations": agreement, "export_seconds": export_seconds,
        "cpu_count": os.cpu_count(), "machine": platform.platform(),
        "tensorflow": tf.__version__, "onnxruntime": __import__("onnxruntime").__version__,
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)
    print(f"\nWrote {args.json}")


if __name__ == "__main__":
    main()
