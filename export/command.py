"""`keras-transformer export`: the subcommand this package adds to the library's CLI
(entry point `keras_transformer.commands`; the library never imports this package).

    keras-transformer export --model runs/NAME --format saved_model|onnx|ctranslate2 --out DIR
                             [--name NAME] [--version N] [--quantization float32|int8]
                             [--onnx-kernels portable|fused]
                             [--max-bleu-drop 1.0] [--force] [--overwrite]
                             [--xla [--xla-batch-sizes 1,2,4,8,16,32] [--xla-source-lengths 16,32,64,128]]
"""

import os
import sys
import time

from keras_transformer.cli import add_model_arguments, non_negative_float, positive_int
from keras_transformer.decoding import policy


def add_export_command(commands):
    """Adds `export` to the `keras-transformer` subparsers `commands`."""
    export = commands.add_parser(
        "export", help="write a TF Serving SavedModel, ONNX graphs or a CTranslate2 model"
    )
    add_model_arguments(export, batch=False, ensemble=True)
    export.add_argument(
        "--max-extra-length",
        type=int,
        default=policy.MAX_EXTRA_LENGTH,
        help="output length limit = source length + this (default 50)",
    )
    export.add_argument(
        "--early-stopping",
        action="store_true",
        help="saved_model, onnx: by default, end a sentence's beam search once it has --beam-size "
        "finished hypotheses (CTranslate2's rule, which its own search always follows)",
    )
    export.add_argument(
        "--format",
        required=True,
        choices=["saved_model", "onnx", "ctranslate2"],
        help="TF Serving's SavedModel layout, ONNX graphs with the search inside, or a CTranslate2 model",
    )
    export.add_argument(
        "--quantization",
        "--quantize",
        choices=["float32", "int8"],
        default="float32",
        help="onnx, ctranslate2: the matrix weights' type (default float32). onnx int8 "
        "is checked on the validation pairs first (see --max-bleu-drop)",
    )
    export.add_argument(
        "--onnx-kernels",
        choices=["portable", "fused"],
        default="portable",
        help="onnx: portable (default: standard ONNX ops, any runtime) or fused (ONNX "
        "Runtime's com.microsoft cross-attention and skip-LayerNorm kernels; ONNX Runtime only)",
    )
    export.add_argument(
        "--max-bleu-drop",
        type=non_negative_float,
        help="onnx int8: refuse to write int8 graphs that lose more validation "
        "sacreBLEU than this against float32 (default 1.0)",
    )
    export.add_argument(
        "--force",
        action="store_true",
        help="onnx int8: write the int8 graphs even if they fail the BLEU check",
    )
    export.add_argument(
        "--gate-sentences",
        type=positive_int,
        help="onnx int8: check on the first N validation pairs (default: all)",
    )
    export.add_argument(
        "--data", help="onnx int8: the corpus whose validation pairs are checked (default: the run's)"
    )
    export.add_argument("--data-dir", help="onnx int8: its local copy (default: the run's)")
    export.add_argument(
        "--xla",
        action="store_true",
        help="saved_model: add the translate_xla signature, its search compiled by XLA on "
        "bucketed shapes, with a warmup record per bucket (serve with TF Serving's "
        "--xla_cpu_compilation_enabled=true; docs/deployment.md)",
    )
    export.add_argument(
        "--xla-batch-sizes",
        type=_sizes,
        help="--xla: the batch sizes compiled, comma-separated (default 1,2,4,8,16,32; "
        "larger batches run in chunks of the largest)",
    )
    export.add_argument(
        "--xla-source-lengths",
        type=_sizes,
        help="--xla: the source lengths in tokens compiled, comma-separated (default "
        "16,32,64,128; the model's max_length is always added)",
    )
    export.add_argument(
        "--out",
        required=True,
        help="saved_model: the TF Serving base directory (writes OUT/NAME/VERSION and "
        "OUT/models.config); onnx, ctranslate2: the directory to write",
    )
    export.add_argument("--name", help="saved_model: the model name (default: the run's directory name)")
    export.add_argument(
        "--version",
        type=positive_int,
        help="saved_model: the version (default: one more than the highest there)",
    )
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing version (saved_model) or directory (onnx, ctranslate2)",
    )
    export.set_defaults(handler=_export)


def _sizes(text):
    """A comma-separated list of integers >= 1, for argparse."""
    import argparse

    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"expected integers >= 1 separated by commas, e.g. 1,8,32; got {text!r}"
        )
    return sizes


def _xla_buckets(args):
    """The `XlaBuckets` that `--xla` and its sizes ask for, None without `--xla`."""
    from keras_transformer.utils.checks import UserError

    sizes = [
        flag
        for flag, value in (
            ("--xla-batch-sizes", args.xla_batch_sizes),
            ("--xla-source-lengths", args.xla_source_lengths),
        )
        if value
    ]
    if (args.xla or sizes) and args.format != "saved_model":
        raise UserError(
            f"--xla is for --format saved_model (TF Serving); drop it for --format {args.format}."
        )
    if sizes and not args.xla:
        verb, them = ("needs", "it") if len(sizes) == 1 else ("need", "them")
        raise UserError(f"{' and '.join(sizes)} {verb} --xla; add --xla, or drop {them}.")
    if not args.xla:
        return None
    from keras_transformer_export.xla_serving import XlaBuckets

    given = {"batch_sizes": args.xla_batch_sizes, "source_lengths": args.xla_source_lengths}
    return XlaBuckets(**{name: value for name, value in given.items() if value})


def _export(args):
    from keras_transformer.training.run_directory import RunDirectory, load_run_models, resolve_model
    from keras_transformer.utils.checks import UserError
    from keras_transformer_export.layout import check_free, check_model_name, export_lock

    if args.quantization != "float32" and args.format == "saved_model":
        raise UserError(
            f"--quantization {args.quantization} is available for --format onnx and "
            f"ctranslate2; saved_model exports are float32 (TF Serving has no int8 path "
            f"for them)."
        )
    if args.onnx_kernels != "portable" and args.format != "onnx":
        raise UserError(
            f"--onnx-kernels {args.onnx_kernels} is for --format onnx only; drop it or use --format onnx."
        )
    gate_options = [
        flag
        for flag, given in (
            ("--max-bleu-drop", args.max_bleu_drop is not None),
            ("--force", args.force),
            ("--gate-sentences", args.gate_sentences is not None),
            ("--data", args.data is not None),
            ("--data-dir", args.data_dir is not None),
        )
        if given
    ]
    if gate_options and not (args.format == "onnx" and args.quantization == "int8"):
        raise UserError(
            f"{' and '.join(gate_options)} {'is' if len(gate_options) == 1 else 'are'} "
            f"for --format onnx --quantization int8 only (the int8 check on validation "
            f"BLEU); drop {'it' if len(gate_options) == 1 else 'them'} or add "
            f"--quantization int8."
        )
    if args.format == "ctranslate2" and len(args.model) > 1:
        raise UserError(
            f"--format ctranslate2 takes one model (CTranslate2 has no ensembles); got {len(args.model)}. "
            f"Export an ensemble with --format onnx or saved_model."
        )
    xla = _xla_buckets(args)
    if args.checkpoint is None:  # the runs and their model files, or one line on what is missing
        runs = [resolve_model(path)[0] for path in args.model]
    else:  # the checkpoint is looked for once the destination is known to be free
        runs = [RunDirectory(path) for path in args.model]
        for run in runs:
            run.settings()
    run = runs[0]  # an ensemble's tokenizer, settings and validation data: its first model's
    if args.format == "saved_model" and len(runs) > 1 and not args.name:
        raise UserError(
            "--format saved_model with several --model (an ensemble) needs --name: the TF Serving "
            "model name (one model's default is its run directory's name)."
        )
    name = check_model_name(args.name or os.path.basename(os.path.abspath(run.path)))
    # One exporter at a time per destination: the TF Serving base directory
    # (versions and models.config), or the ONNX/CTranslate2 directory's parent.
    out = os.path.abspath(args.out)
    with export_lock(args.format, out):
        # Refuse an occupied destination before the slow part (loading and tracing).
        if args.format != "saved_model":
            check_free(out, args.overwrite)
        elif args.version is not None:
            check_free(os.path.join(out, name, str(args.version)), args.overwrite)
        model = load_run_models(args.model, args.checkpoint)[1]  # several: their Ensemble
        tokenizer = run.tokenizer()
        if args.format == "ctranslate2":
            return _write_ctranslate2(args, model, tokenizer)
        from keras_transformer_export.graphs import TranslationGraphs

        graphs = TranslationGraphs(
            model,
            tokenizer,
            beam_size=args.beam_size,
            length_penalty=args.length_penalty,
            max_extra_length=args.max_extra_length,
            early_stopping=args.early_stopping,
        )
        return _write_export(args, graphs, name, run, xla)


def _write_ctranslate2(args, model, tokenizer):
    from keras_transformer_export.ctranslate2 import export_ctranslate2

    start = time.perf_counter()
    path = export_ctranslate2(
        model,
        tokenizer,
        args.out,
        quantization=args.quantization,
        beam_size=args.beam_size,
        length_penalty=args.length_penalty,
        max_extra_length=args.max_extra_length,
        overwrite=args.overwrite,
    )
    print(
        f"Wrote the CTranslate2 model ({args.quantization}) to {path} in "
        f"{time.perf_counter() - start:.0f}s.\nTranslate with it: "
        f"python -m keras_transformer_export.ctranslate2 {path} < input.txt",
        file=sys.stderr,
    )
    return 0


def _write_export(args, graphs, name, run, xla=None):
    start = time.perf_counter()
    if args.format == "saved_model":
        from keras_transformer_export.saved_model import export_saved_model

        path = export_saved_model(
            graphs, args.out, name, version=args.version, overwrite=args.overwrite, xla=xla
        )
        print(
            f"Wrote the SavedModel {path} in {time.perf_counter() - start:.0f}s (signatures "
            f"serving_default, translate_ids, score, translate_with_options"
            f"{'' if xla is None else ', translate_xla'}) and "
            f"{os.path.join(args.out, 'models.config')}.\n"
            f"Serve it: docker run -p 8501:8501 -v {os.path.abspath(args.out)}:/models "
            f"-e MODEL_NAME={name} tensorflow/serving"
            f"{'' if xla is None else ' --xla_cpu_compilation_enabled=true'}",
            file=sys.stderr,
        )
    else:
        from keras_transformer_export.onnx import export_onnx

        def log(line):
            print(line, file=sys.stderr)

        gate = _int8_gate(args, run, log) if args.quantization == "int8" else None
        path = export_onnx(
            graphs,
            args.out,
            overwrite=args.overwrite,
            log=log,
            quantization=args.quantization,
            gate=gate,
            kernels=args.onnx_kernels,
        )
        kind = "" if args.onnx_kernels == "portable" else f" ({args.onnx_kernels} kernels: ONNX Runtime only)"
        print(
            f"Wrote the {args.quantization} ONNX graphs{kind} to {path} in "
            f"{time.perf_counter() - start:.0f}s.",
            file=sys.stderr,
        )
    return 0


def _int8_gate(args, run, log):
    """`keras_transformer_export.quantization.BleuGate` on the run's validation pairs (or those of --data)."""
    from keras_transformer.data.corpora import load_corpus
    from keras_transformer_export.quantization import DEFAULT_MAX_BLEU_DROP, BleuGate

    options = run.settings()["options"]
    data = args.data or options["data"]
    data_dir = args.data_dir or (options.get("data_dir") if args.data is None else None)
    corpus = load_corpus(data, data_dir, options.get("source_lang", "en"), options.get("target_lang", "de"))
    sources, references = corpus.validation_pairs()
    if args.gate_sentences:
        sources, references = sources[: args.gate_sentences], references[: args.gate_sentences]
    max_drop = DEFAULT_MAX_BLEU_DROP if args.max_bleu_drop is None else args.max_bleu_drop
    log(
        f"int8: translating {len(sources)} validation pairs ({data}) with float32 and int8 to "
        f"compare BLEU (allowed drop {max_drop:g})"
    )
    return BleuGate(sources, references, corpus.target_lang, max_drop=max_drop, force=args.force, log=log)
