"""Do a model's exports translate a whole split exactly like Keras? One model or an ensemble.

`keras_transformer_export.parity.check_parity` (what `make demo` runs on 100 sentences) on the
sentences of a Multi30k split: Keras's `Translator` is the reference, then the SavedModel's
`serving_default` (`--saved-model VERSION_DIR`; its `translate_xla` too where `export --xla`
wrote one) and ONNX Runtime's every search over
`--onnx DIR` (`translate.onnx`, `encoder.onnx` + `decoder_step.onnx`, `translate_lean.onnx`, and
`translate_text.onnx` in a process without TensorFlow), and `forward.onnx`'s largest logit
difference, `--chunk` sentences at a time (the SavedModel takes each chunk in one call); and
the sacreBLEU of every runtime's translations. Several `--model`s: their `Ensemble`,
as `keras-transformer export --model A B` exports it. The exports must have been made with the
beam size and length penalty given here (the export's defaults: beam 4, alpha 0.6).

    python scripts/check_export_parity.py --model runs/multi30k/member-0/averaged.keras \\
        runs/multi30k/member-1/averaged.keras --onnx exports/multi30k-onnx \\
        [--saved-model exports/multi30k/1] [--split test2016] [--limit N] \\
        [--json results/export_parity.json]
"""

import time

import harness

harness.tensorflow()


def main():
    import sacrebleu
    import tensorflow as tf

    from keras_transformer.decoding import policy
    from keras_transformer.training.run_directory import load_run_models
    from keras_transformer_export.parity import check_parity

    parser = harness.parser(__doc__, "export_parity")
    parser.add_argument(
        "--model", required=True, nargs="+", help="one run or .keras file; several: an ensemble"
    )
    parser.add_argument("--onnx", help="an `export --format onnx` directory")
    parser.add_argument("--saved-model", help="a SavedModel version directory (OUT/NAME/VERSION)")
    parser.add_argument("--beam-size", type=int, default=policy.BEAM_SIZE)
    parser.add_argument("--length-penalty", type=float, default=policy.LENGTH_PENALTY)
    parser.add_argument("--limit", type=int, help="the split's first N sentences (default: all)")
    parser.add_argument("--chunk", type=int, default=100, help="sentences per call of each runtime (100)")
    harness.add_sentences(parser)
    args = parser.parse_args()
    if not (args.onnx or args.saved_model):
        parser.error("give --onnx, --saved-model or both.")

    sources, references = harness.read_multi30k(args.data_dir, args.split, args.source_lang)
    sources, references = sources[: args.limit], references[: args.limit]
    run, model = load_run_models(args.model)
    tokenizer = run.tokenizer()
    # Loaded once for every chunk: `translate_xla` compiles a program per shape bucket per load.
    saved_model = tf.saved_model.load(args.saved_model) if args.saved_model else None
    start = time.perf_counter()
    report, translations = {"sentences": len(sources), "runtimes": {}}, {}
    for first in range(0, len(sources), args.chunk):  # one call per runtime holds a chunk in memory
        part = check_parity(
            model, tokenizer, sources[first : first + args.chunk], saved_model, args.onnx,
            args.beam_size, args.length_penalty, keep_translations=True,
        )  # fmt: skip
        for name, texts in part.pop("translations").items():
            translations.setdefault(name, []).extend(texts)
        for name, found in part["runtimes"].items():
            total = report["runtimes"].setdefault(name, {"identical": 0, "first_difference": None})
            total["identical"] += found["identical"]
            if total["first_difference"] is None and found["first_difference"] is not None:
                total["first_difference"] = {
                    **found["first_difference"],
                    "index": first + found["first_difference"]["index"],
                }
        if "max_logit_difference" in part:
            report["max_logit_difference"] = max(
                report.get("max_logit_difference", 0.0), part["max_logit_difference"]
            )
    seconds = time.perf_counter() - start
    bleu = {name: sacrebleu.corpus_bleu(texts, [references]).score for name, texts in translations.items()}
    rows = [
        [name, f"{found['identical']}/{report['sentences']}", found["first_difference"] or ""]
        for name, found in report["runtimes"].items()
    ]
    harness.print_table(["runtime", "identical to Keras", "first difference"], rows)
    print(
        f"\n{len(args.model)} model(s), {args.split}, beam {args.beam_size}, alpha {args.length_penalty}: "
        f"sacreBLEU {', '.join(f'{k} {v:.2f}' for k, v in bleu.items())}; largest forward.onnx logit "
        f"difference {report.get('max_logit_difference', float('nan')):.2e}; {seconds:.0f} s"
    )
    harness.write_report(
        args.json, settings=vars(args), results={**report, "bleu": bleu, "seconds": round(seconds, 1)}
    )


if __name__ == "__main__":
    main()
