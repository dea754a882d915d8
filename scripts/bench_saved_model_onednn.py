"""A SavedModel's `serving_default` with TensorFlow's oneDNN kernels on and off: the same
translations? And which is faster on this CPU?

TensorFlow's Linux x86 wheels run oneDNN kernels by default on CPUs with AVX512_VNNI, AVX512_BF16
or AMX (`TF_ENABLE_ONEDNN_OPTS`, read once when TensorFlow is imported; `_MklMatMul`,
`_MklBatchMatMulV2`, `_MklSoftmax`, ... in a profile); a TF Serving binary runs the kernels it
was built with. At the recipe's width a decoding step is many small products, softmaxes and
transposes. Each setting runs in a Python process of its own, and the two take turns, `--rounds`
times: batch 1 over the split's first `--single` sentences, batch 32 over its first `--limit`
(medians printed and written to `--json`); the batch-32 translations of the two settings are
compared.

    python scripts/bench_saved_model_onednn.py VERSION_DIR --data-dir ../shared/data/multi30k \\
        [--single 30] [--limit 320] [--rounds 2] [--json results/saved_model_onednn.json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import harness

SETTINGS = {"oneDNN on (TensorFlow's default here)": "1", "oneDNN off": "0"}


def worker(version_dir, sentences, single, limit):
    """One setting's timings in this process: `{"batch1_ms", "batch32_sentences_per_s", "texts"}`."""
    tf = harness.tensorflow()
    import tensorflow_text  # noqa: F401 - the SavedModel's tokenizer ops

    signature = tf.saved_model.load(version_dir).signatures["serving_default"]

    def translate(texts, batch):
        found = []
        for start in range(0, len(texts), batch):
            out = signature(text=tf.constant(texts[start : start + batch]))["translation"].numpy()
            found += [t.decode("utf-8") for t in out]
        return found

    translate(sentences[:64], 32)  # warm-up: traced functions, kernels, allocator
    translate(sentences[:5], 1)
    tick = time.perf_counter()
    translate(sentences[:single], 1)
    batch1 = (time.perf_counter() - tick) / single * 1000
    tick = time.perf_counter()
    texts = translate(sentences[:limit], 32)
    batch32 = limit / (time.perf_counter() - tick)
    return {"batch1_ms": batch1, "batch32_sentences_per_s": batch32, "texts": texts}


def main():
    parser = harness.parser(__doc__, "saved_model_onednn")
    parser.add_argument("version_dir", help="a SavedModel version directory (OUT/NAME/VERSION)")
    harness.add_sentences(parser)
    parser.add_argument("--single", type=int, default=30, help="sentences timed at batch 1")
    parser.add_argument("--limit", type=int, default=320, help="sentences timed at batch 32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # the sentences are read here, in each setting's own process
        print(json.dumps(worker(args.version_dir, harness.sentences(args), args.single, args.limit)))
        return
    passes = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, value in SETTINGS.items():
            command = [sys.executable, __file__, args.version_dir, "--worker"]
            command += ["--split", args.split, "--source-lang", args.source_lang]
            command += ["--single", str(args.single), "--limit", str(args.limit)]
            if args.data_dir:
                command += ["--data-dir", args.data_dir]
            env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": value, "TF_CPP_MIN_LOG_LEVEL": "2"}
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            passes[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    names = list(SETTINGS)
    first, second = (passes[name][0]["texts"] for name in names)
    identical = sum(a == b for a, b in zip(first, second))
    rows, results = [], {}
    for name in names:
        batch1 = [p["batch1_ms"] for p in passes[name]]
        batch32 = [p["batch32_sentences_per_s"] for p in passes[name]]
        results[name] = {
            "batch1_ms": statistics.median(batch1),
            "batch1_ms_passes": batch1,
            "batch32_sentences_per_s": statistics.median(batch32),
            "batch32_sentences_per_s_passes": batch32,
        }
        rows.append(
            [
                name,
                f"{statistics.median(batch1):.1f} ({', '.join(f'{x:.1f}' for x in batch1)})",
                f"{statistics.median(batch32):.1f} ({', '.join(f'{x:.1f}' for x in batch32)})",
            ]
        )
    harness.print_table(["setting", "batch 1 ms (passes)", "batch 32 sentences/s (passes)"], rows)
    print(f"\nBatch-32 translations identical between the settings: {identical}/{len(first)}")
    harness.write_report(
        args.json, settings=vars(args), identical=identical, sentences=len(first), results=results
    )


if __name__ == "__main__":
    main()
