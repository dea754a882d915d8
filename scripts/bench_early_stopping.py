"""Early stopping (CTranslate2's stop rule) against our exact rule, on one ONNX export, side by side.

`DecodingOptions.early_stopping`: a sentence's beam search ends as soon as its pool holds `beam`
finished hypotheses, as CTranslate2's does, instead of when no live hypothesis can still beat
them (`policy.search_is_final`). This script measures what the option costs and saves on a
trained model, through `OnnxTranslator` (`--mode lean` by default: `translate_lean.onnx`, the
fastest of our graphs; `split`: the NumPy driver of the step graphs): sacreBLEU of both rules on
the split and how many translations are identical, batch-1 latency (each of `--single` sentences
translated alone under each rule in turn, 10 ms apart, `--rounds` times) and batch-32 time over
the split (each pass under each rule in turn). Tune on val, not on a test set.

    keras-transformer export --model runs/multi30k/member-0/averaged.keras --format onnx \\
        --onnx-kernels fused --out /tmp/m0-fused
    python scripts/bench_early_stopping.py /tmp/m0-fused [--split val] [--single 100] [--rounds 3]
        [--json results/bench_early_stopping.json]
"""

import statistics
import time

import harness
import numpy as np
import sacrebleu

RULES = {"exact": False, "early stopping": True}


def main():
    parser = harness.parser(__doc__, "bench_early_stopping")
    parser.add_argument("export_dir", help="an `export --format onnx` directory")
    parser.add_argument("--mode", default="lean", choices=("lean", "full", "split"))
    harness.add_sentences(parser, split="val")
    parser.add_argument("--target-lang", default="de")
    parser.add_argument("--single", type=int, default=100, help="sentences timed at batch 1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from keras_transformer_export.onnx_runtime import OnnxTranslator

    sources, references = harness.read_multi30k(args.data_dir, args.split, args.source_lang, args.target_lang)
    translator = OnnxTranslator(args.export_dir, args.mode, 32, args.threads)
    texts, batch32 = {}, {name: [] for name in RULES}
    for _ in range(args.rounds):
        for name, early in RULES.items():
            tick = time.perf_counter()
            texts[name] = translator.translate(sources, early_stopping=early)[0]
            batch32[name].append(time.perf_counter() - tick)
    single = sources[: args.single]
    for sentence in single[:10]:  # warm
        translator.translate([sentence])
    batch1 = {name: [] for name in RULES}
    for _ in range(args.rounds):
        for sentence in single:
            for name, early in RULES.items():
                time.sleep(0.01)
                tick = time.perf_counter()
                translator.translate([sentence], early_stopping=early)
                batch1[name].append(time.perf_counter() - tick)

    identical = sum(a == b for a, b in zip(texts["exact"], texts["early stopping"]))
    rows, results = [], {}
    for name in RULES:
        results[name] = {
            "bleu": round(sacrebleu.corpus_bleu(texts[name], [references]).score, 2),
            "batch1_median_ms": 1000 * statistics.median(batch1[name]),
            "batch1_mean_ms": 1000 * float(np.mean(batch1[name])),
            "batch32_seconds": statistics.median(batch32[name]),
            "batch32_seconds_passes": batch32[name],
        }
    for name, r in results.items():
        exact = results["exact"]
        rows.append(
            [
                name,
                f"{r['bleu']:.2f}",
                f"{r['batch1_median_ms']:.2f}",
                f"{exact['batch1_median_ms'] / r['batch1_median_ms']:.2f}x",
                f"{len(sources) / r['batch32_seconds']:.1f}",
                f"{exact['batch32_seconds'] / r['batch32_seconds']:.2f}x",
            ]
        )
    print(
        f"\n{args.export_dir} ({args.mode}), {args.split}: {len(sources)} sentences at batch 32, "
        f"{len(single)} at batch 1, {args.rounds} rounds; identical translations {identical}/{len(sources)}\n"
    )
    harness.print_table(
        ["stop rule", "sacreBLEU", "batch 1 median ms", "speed-up", "batch 32 sentences/s", "speed-up"], rows
    )
    harness.write_report(
        args.json, settings=vars(args), sentences=len(sources), identical=identical, results=results
    )


if __name__ == "__main__":
    main()
