"""Two `translate.onnx` (or `translate_lean.onnx`) exports of one model, side by side: the same
translations and scores? And how long each takes (ONNX Runtime, `OnnxTranslator`), timed in
alternation in one process.

For a change to the exported graph that must not change any token (a rewrite, a cheaper
formulation of a rule): export the model before and after, then

    python scripts/compare_onnx_exports.py BEFORE_DIR AFTER_DIR [--data-dir DIR]
        [--split test2016] [--batch 32] [--single 100] [--rounds 2] [--threads 2]
        [--mode full|lean] [--json results/compare_onnx_exports.json]

`--mode lean` compares the exports' `translate_lean.onnx` (`OnnxTranslator(mode="lean")`).

prints how many of the split's translations are identical, the largest score difference, and
the seconds per pass at `--batch` sentences per call (all of the split) and one sentence per
call (the first `--single`).
"""

import statistics

import harness
import numpy as np

from keras_transformer_export.onnx_runtime import OnnxTranslator


def translate_all(translator, sentences, batch):
    texts, scores = [], []
    for start in range(0, len(sentences), batch):
        found, found_scores = translator.translate(sentences[start : start + batch])
        texts += found
        scores += list(found_scores)
    return texts, np.array(scores, np.float32)


def _medians(samples):
    return {name: statistics.median(values) for name, values in samples.items()}


def main():
    parser = harness.parser(__doc__, "compare_onnx_exports")
    parser.add_argument("before")
    parser.add_argument("after")
    harness.add_sentences(parser)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--single", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", choices=("full", "lean"), default="full", help="the graph compared")
    args = parser.parse_args()
    sentences = harness.sentences(args)
    translators = {
        name: OnnxTranslator(path, args.mode, threads=args.threads)
        for name, path in (("before", args.before), ("after", args.after))
    }
    # The compared outputs; this first pass is also each session's warm-up before the timing.
    outputs = {name: translate_all(t, sentences, args.batch) for name, t in translators.items()}
    batched = _medians(
        harness.interleaved(
            {name: lambda t=t: translate_all(t, sentences, args.batch) for name, t in translators.items()},
            rounds=args.rounds,
        )
    )
    single = _medians(
        harness.interleaved(
            {
                name: lambda t=t: [t.translate([s]) for s in sentences[: args.single]]
                for name, t in translators.items()
            },
            rounds=args.rounds,
        )
    )
    identical = sum(a == b for a, b in zip(outputs["before"][0], outputs["after"][0]))
    score_difference = float(np.max(np.abs(outputs["before"][1] - outputs["after"][1])))
    print(
        f"{identical}/{len(sentences)} identical translations; "
        f"largest score difference {score_difference:.3g}"
    )
    harness.print_table(
        ["export", f"s per {len(sentences)} at batch {args.batch}", f"s per {args.single} at batch 1"],
        [[name, f"{batched[name]:.2f}", f"{single[name]:.2f}"] for name in translators],
    )
    harness.write_report(
        args.json,
        settings=vars(args),
        sentences=len(sentences),
        identical=identical,
        largest_score_difference=score_difference,
        batch_seconds=batched,
        single_seconds=single,
        after_speedup={
            "batch": batched["before"] / batched["after"],
            "single": single["before"] / single["after"],
        },
    )


if __name__ == "__main__":
    main()
