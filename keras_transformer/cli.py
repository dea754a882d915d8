"""The `keras-transformer` command line.

    keras-transformer train     --data DATASET --preset small --out runs/NAME [--epochs N]
                                [--strategy auto|default|mirrored|multi-worker]
                                [--mixed-precision] [--xla] [--grad-accum N] [--resume | --overwrite]
    keras-transformer translate --model runs/NAME [--beam-size 4] < input.txt > output.txt
    keras-transformer evaluate  --model runs/NAME --data DATASET --split test
    keras-transformer export    --model runs/NAME --format saved_model|onnx|ctranslate2 --out DIR
                                [--name NAME] [--version N] [--quantization float32|int8]
                                [--max-bleu-drop 1.0] [--force] [--overwrite]
    keras-transformer average   --model runs/NAME --last 5
    keras-transformer attention --model runs/NAME --text "A sentence." --out attention.png
    keras-transformer presets   [--vocab-size N]
    keras-transformer --version

DATASET: `synthetic` (built in), `multi30k` (downloaded into a cache, or
`--data-dir DIR` with a local copy), `files:SRC,TGT` (aligned UTF-8 files).
Problems with the input print one line `keras-transformer: error: ...` and
exit with status 2 (also: a directory that another process is writing, a
corrupt checkpoint); a training run stopped by a NaN loss, and a save that the
storage refused (a full disk), exit with status 1; a training run stopped by
SIGTERM or SIGINT exits with status 75 once its state is saved (the same
command with `--resume` continues it).
"""

import argparse
import ast
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up chatter


def _presets(args):
    from keras_transformer.model.config import PRESETS
    from keras_transformer.model.transformer import Transformer

    print(f"Presets with a shared vocabulary of {args.vocab_size} tokens:\n")
    print("| preset | layers | d_model | heads | d_ff | dropout | max_length | parameters |")
    print("|--------|--------|---------|-------|------|---------|------------|------------|")
    for name, values in PRESETS.items():
        count = Transformer.from_preset(name, vocab_size=args.vocab_size).count_params()
        print(
            f"| {name:<6} | {values['num_layers']:>3}+{values['num_layers']:<2} | "
            f"{values['d_model']:>7} | {values['num_heads']:>5} | {values['d_ff']:>4} | "
            f"{values['dropout_rate']:>7} | {values['max_length']:>10} | {count:>10,} |"
        )
    return 0


def _train(args):
    from keras_transformer.training.trainer import TrainingOptions, train

    options = TrainingOptions(
        out=args.out,
        data=args.data,
        data_dir=args.data_dir,
        source_lang=args.source_lang,
        target_lang=args.target_lang,
        preset=args.preset,
        overrides=dict(args.set),
        vocab_size=args.vocab_size,
        epochs=args.epochs,
        batch_tokens=args.batch_tokens,
        max_length=args.max_length,
        warmup_steps=args.warmup_steps,
        learning_rate_scale=args.learning_rate_scale,
        learning_rate=args.learning_rate,
        clip_norm=args.clip_norm,
        label_smoothing=args.label_smoothing,
        strategy=args.strategy,
        mixed_precision=args.mixed_precision,
        xla=args.xla,
        grad_accum=args.grad_accum,
        max_minutes=args.max_minutes,
        keep_checkpoints=args.keep_checkpoints,
        average_last=args.average_last,
        val_bleu=args.val_bleu,
        save_every_steps=args.save_every_steps,
        resume=args.resume,
        overwrite=args.overwrite,
        seed=args.seed,
    )
    result = train(options)
    if result.status == "preempted":
        from keras_transformer.training.preemption import EXIT_PREEMPTED

        return EXIT_PREEMPTED
    return 0 if result.status == "finished" else 1


def _load(args):
    from keras_transformer.decoding.translator import Translator
    from keras_transformer.training.run_directory import load_model, resolve_model

    run, model_path = resolve_model(args.model)
    model = load_model(model_path)
    translator = Translator(
        model,
        run.tokenizer(),
        beam_size=args.beam_size,
        length_penalty=args.length_penalty,
        batch_size=args.batch_size,
    )
    return run, model, translator


class _Progress:
    """A progress bar on stderr (drawn only on a terminal; elsewhere one closing line)."""

    def __init__(self, total, what="sentences"):
        self.total, self.what, self.start = total, what, time.perf_counter()
        self.drawn = sys.stderr.isatty()

    def __call__(self, done):
        if self.drawn:
            filled = int(30 * done / max(1, self.total))
            rate = done / max(1e-9, time.perf_counter() - self.start)
            sys.stderr.write(
                f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} {self.what} ({rate:.1f}/s)"
            )
            sys.stderr.flush()

    def close(self):
        seconds = time.perf_counter() - self.start
        end = "\n" if self.drawn else ""
        sys.stderr.write(f"{end}Translated {self.total} {self.what} in {seconds:.1f}s.\n")


def _translate(args):
    _, _, translator = _load(args)
    lines = []
    for number, raw in enumerate(sys.stdin.buffer, start=1):
        text = raw.rstrip(b"\r\n")
        try:
            lines.append(text.decode("utf-8"))
        except UnicodeDecodeError:
            print(
                f"keras-transformer: warning: input line {number} is not valid UTF-8; invalid "
                f"bytes replaced by U+FFFD.",
                file=sys.stderr,
            )
            lines.append(text.decode("utf-8", errors="replace"))
    progress = _Progress(len(lines))
    texts, scores = translator.translate(lines, progress)
    progress.close()
    output = sys.stdout
    for text, score in zip(texts, scores):
        output.write(f"{text}\t{score:.4f}\n" if args.scores else f"{text}\n")
    output.flush()
    return 0


def _evaluate(args):
    from keras_transformer.data.corpora import load_corpus
    from keras_transformer.evaluation import score_translations
    from keras_transformer.utils.files import atomic_write

    run, _, translator = _load(args)
    settings = run.settings()
    source_lang = args.source_lang or settings.get("source_lang", "en")
    target_lang = args.target_lang or settings.get("target_lang", "de")
    sources, references = load_corpus(args.data, args.data_dir, source_lang, target_lang)[args.split]
    if args.limit:
        sources, references = sources[: args.limit], references[: args.limit]
    progress = _Progress(len(sources))
    hypotheses, _ = translator.translate(sources, progress)
    progress.close()
    seconds = time.perf_counter() - progress.start
    scores = score_translations(hypotheses, references, target_lang)
    name = f"{args.data.split(':')[0]}-{args.split}"
    output = args.output or str(run.path / f"translations-{name}.txt")
    atomic_write(output, "".join(f"{line}\n" for line in hypotheses))
    run.write_json(
        run.path / f"eval-{name}.json",
        {
            "model": str(args.model),
            "data": args.data,
            "split": args.split,
            "sentences": len(sources),
            "beam_size": args.beam_size,
            "length_penalty": args.length_penalty,
            "bleu": scores.bleu,
            "bleu_signature": scores.bleu_signature,
            "chrf": scores.chrf,
            "chrf_signature": scores.chrf_signature,
            "paper_bleu": scores.paper_bleu,
            "paper_signature": scores.paper_signature,
            "seconds": round(seconds, 1),
        },
    )
    missing = (
        ""
        if scores.paper_bleu is not None
        else ("\n(The paper metric needs sacremoses: pip install sacremoses.)")
    )
    print(
        f"{args.data} {args.split} ({len(sources)} sentences, beam {args.beam_size}, "
        f"alpha {args.length_penalty}):\n{scores}{missing}\nTranslations: {output}"
    )
    return 0


def _export(args):
    # The exporters live in the top-level `export` package (the library never imports it).
    from keras_transformer.training.run_directory import load_model, resolve_model
    from keras_transformer.utils.checks import UserError
    from keras_transformer_export.layout import check_free, check_model_name, export_lock

    if args.quantization != "float32" and args.format == "saved_model":
        raise UserError(
            f"--quantization {args.quantization} is available for --format onnx and "
            f"ctranslate2; saved_model exports are float32 (TF Serving has no int8 path "
            f"for them)."
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
    run, model_path = resolve_model(args.model)
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
        model, tokenizer = load_model(model_path), run.tokenizer()
        if args.format == "ctranslate2":
            return _write_ctranslate2(args, model, tokenizer)
        from keras_transformer_export.graphs import TranslationGraphs

        graphs = TranslationGraphs(
            model,
            tokenizer,
            beam_size=args.beam_size,
            length_penalty=args.length_penalty,
            max_extra_length=args.max_extra_length,
        )
        return _write_export(args, graphs, name, run)


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


def _write_export(args, graphs, name, run):
    start = time.perf_counter()
    if args.format == "saved_model":
        from keras_transformer_export.saved_model import export_saved_model

        path = export_saved_model(graphs, args.out, name, version=args.version, overwrite=args.overwrite)
        print(
            f"Wrote the SavedModel {path} in {time.perf_counter() - start:.0f}s (signatures "
            f"serving_default, translate_ids, score) and {os.path.join(args.out, 'models.config')}.\n"
            f"Serve it: docker run -p 8501:8501 -v {os.path.abspath(args.out)}:/models "
            f"-e MODEL_NAME={name} tensorflow/serving",
            file=sys.stderr,
        )
    else:
        from keras_transformer_export.onnx import export_onnx

        def log(line):
            print(line, file=sys.stderr)

        gate = _int8_gate(args, run, log) if args.quantization == "int8" else None
        path = export_onnx(
            graphs, args.out, overwrite=args.overwrite, log=log, quantization=args.quantization, gate=gate
        )
        print(
            f"Wrote the {args.quantization} ONNX graphs to {path} in {time.perf_counter() - start:.0f}s.",
            file=sys.stderr,
        )
    return 0


def _int8_gate(args, run, log):
    """`keras_transformer_export.quantization.BleuGate` on the run's validation pairs (or those of --data)."""
    from keras_transformer.data.corpora import load_corpus
    from keras_transformer.training.trainer import validation_pairs
    from keras_transformer_export.quantization import DEFAULT_MAX_BLEU_DROP, BleuGate

    options = run.settings()["options"]
    data = args.data or options["data"]
    data_dir = args.data_dir or (options.get("data_dir") if args.data is None else None)
    corpus = load_corpus(data, data_dir, options.get("source_lang", "en"), options.get("target_lang", "de"))
    sources, references = validation_pairs(corpus)
    if args.gate_sentences:
        sources, references = sources[: args.gate_sentences], references[: args.gate_sentences]
    max_drop = DEFAULT_MAX_BLEU_DROP if args.max_bleu_drop is None else args.max_bleu_drop
    log(
        f"int8: translating {len(sources)} validation pairs ({data}) with float32 and int8 to "
        f"compare BLEU (allowed drop {max_drop:g})"
    )
    return BleuGate(sources, references, corpus.target_lang, max_drop=max_drop, force=args.force, log=log)


def _average(args):
    from keras_transformer.training.run_directory import RunDirectory, average_last_checkpoints

    run = RunDirectory(args.model)
    run.settings()  # a run directory, or one line saying what is wrong
    with run.lock:  # not while `train` writes the checkpoints
        output, checkpoints = average_last_checkpoints(run, args.last, args.output)
    names = ", ".join(os.path.basename(path) for path in checkpoints)
    print(f"Averaged {names} into {output}")
    return 0


def _attention(args):
    import numpy as np

    from keras_transformer.data.tokenizer import BOS_ID
    from keras_transformer.plots import plot_attention

    _, model, translator = _load(args)
    tokenizer = translator.tokenizer
    source_ids = translator.encode([args.text]).numpy()
    target = args.target if args.target is not None else translator.translate([args.text])[0][0]
    target_ids = np.concatenate([[BOS_ID], tokenizer.tokenize([target]).numpy()[0]])[None]
    weights = model.attention_weights({"source_ids": source_ids, "target_ids": target_ids.astype("int32")})
    pieces = tokenizer.processor.id_to_piece
    plot_attention(
        weights, [pieces(int(i)) for i in source_ids[0]], [pieces(int(i)) for i in target_ids[0]], args.out
    )
    print(f"Translation: {target}\nAttention heads drawn in {args.out}")
    return 0


def _number(kind, lowest, inclusive, description):
    """An argparse type: a finite `kind` (int or float) above `lowest` (or equal, if `inclusive`)."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not (value >= lowest if inclusive else value > lowest) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected {description}, got {text!r}")
        return value

    return parse


_positive_int = _number(int, 0, False, "a positive integer")
_non_negative_int = _number(int, 0, True, "an integer >= 0")
_positive_float = _number(float, 0, False, "a number > 0")
_non_negative_float = _number(float, 0, True, "a number >= 0")


def _setting(text):
    key, separator, value = text.partition("=")
    if not separator or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _add_model_arguments(parser, beam=True, batch=True):
    parser.add_argument(
        "--model", required=True, help="a run directory (uses its model.keras) or a .keras file inside one"
    )
    if beam:
        parser.add_argument("--beam-size", type=_positive_int, default=4)
        parser.add_argument(
            "--length-penalty",
            type=_non_negative_float,
            default=0.6,
            help="alpha of the GNMT length penalty ((5 + length) / 6)^alpha (default 0.6; 0: none)",
        )
    if batch:
        parser.add_argument("--batch-size", type=_positive_int, default=64)


def _add_data_arguments(parser, default=None):
    parser.add_argument(
        "--data", required=default is None, default=default, help="synthetic | multi30k | files:SRC,TGT"
    )
    parser.add_argument("--data-dir", help="local copy of the dataset (multi30k)")


def _train_parser(commands):
    train = commands.add_parser("train", help="train a model into a run directory")
    _add_data_arguments(train, default="synthetic")
    train.add_argument("--source-lang", default="en")
    train.add_argument("--target-lang", default="de")
    train.add_argument(
        "--preset",
        default="small",
        help="tiny | mini | small | base | big (`keras-transformer presets` lists them)",
    )
    train.add_argument(
        "--set",
        type=_setting,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a TransformerConfig field, e.g. --set dropout_rate=0.3",
    )
    train.add_argument("--out", required=True, help="the run directory")
    train.add_argument("--epochs", type=_positive_int, default=10)
    train.add_argument(
        "--vocab-size",
        type=_positive_int,
        help="shared SentencePiece vocabulary (default 8000, or as many pieces as "
        "the corpus supports if fewer)",
    )
    train.add_argument(
        "--batch-tokens", type=_positive_int, default=4096, help="tokens per batch (the paper: ~25000)"
    )
    train.add_argument(
        "--max-length",
        type=_positive_int,
        help="drop training pairs longer than this (default: the model's max)",
    )
    train.add_argument("--warmup-steps", type=_positive_int, default=4000)
    train.add_argument(
        "--learning-rate",
        type=_positive_float,
        help="peak learning rate, reached after --warmup-steps and then decayed "
        "with 1/sqrt(step) (default: the paper's, d_model^-0.5 "
        "warmup^-0.5)",
    )
    train.add_argument(
        "--learning-rate-scale",
        type=_positive_float,
        default=1.0,
        help="a factor on the paper's schedule (instead of --learning-rate)",
    )
    train.add_argument(
        "--clip-norm",
        type=_positive_float,
        help="clip each update's gradients to this global norm (default: no clipping)",
    )
    train.add_argument("--label-smoothing", type=float, default=0.1, help="in [0, 1) (default 0.1)")
    train.add_argument("--strategy", default="auto", choices=("auto", "default", "mirrored", "multi-worker"))
    train.add_argument(
        "--mixed-precision",
        action="store_true",
        help="float16 compute on GPU, bfloat16 on CPU (weights stay float32)",
    )
    train.add_argument("--xla", action="store_true", help="compile the train step with XLA")
    train.add_argument(
        "--grad-accum", type=_positive_int, default=1, help="batches whose gradients make one update"
    )
    train.add_argument(
        "--max-minutes", type=_positive_float, help="time budget: stop after the last epoch that fits in it"
    )
    train.add_argument("--keep-checkpoints", type=_positive_int, default=5)
    train.add_argument(
        "--average-last",
        type=_positive_int,
        metavar="N",
        help="at the end, average the last N epoch checkpoints into "
        "RUN/averaged.keras (N <= --keep-checkpoints)",
    )
    train.add_argument(
        "--val-bleu",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="after every epoch, greedy-translate the first N validation pairs and "
        "record their BLEU (val_bleu in metrics.json; default 0: off)",
    )
    train.add_argument(
        "--save-every-steps",
        type=_positive_int,
        help="save the resumable state this often (default: 4 times per epoch)",
    )
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--resume", action="store_true", help="continue the run in --out if there is one (else start it)"
    )
    train.add_argument("--overwrite", action="store_true", help="replace the run in --out")
    train.set_defaults(handler=_train)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (no usage dump), exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser():
    from keras_transformer import __version__

    parser = _Parser(
        prog="keras-transformer", description="The Transformer of 'Attention Is All You Need' in Keras 3."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    _train_parser(commands)

    translate = commands.add_parser("translate", help="translate stdin to stdout, one line each")
    _add_model_arguments(translate)
    translate.add_argument("--scores", action="store_true", help="append a tab and the score")
    translate.set_defaults(handler=_translate)

    evaluate = commands.add_parser("evaluate", help="sacreBLEU and chrF on a split")
    _add_model_arguments(evaluate)
    _add_data_arguments(evaluate)
    evaluate.add_argument("--split", default="test", help="train | val | test (default test)")
    evaluate.add_argument("--source-lang", help="default: the run's")
    evaluate.add_argument("--target-lang", help="default: the run's")
    evaluate.add_argument("--limit", type=_positive_int, help="only the first N sentences")
    evaluate.add_argument("--output", help="translations file (default RUN/translations-DATA-SPLIT.txt)")
    evaluate.set_defaults(handler=_evaluate)

    export = commands.add_parser(
        "export", help="write a TF Serving SavedModel, ONNX graphs or a CTranslate2 model"
    )
    _add_model_arguments(export, batch=False)
    export.add_argument(
        "--max-extra-length",
        type=int,
        default=50,
        help="output length limit = source length + this (default 50)",
    )
    export.add_argument("--format", required=True, choices=["saved_model", "onnx", "ctranslate2"])
    export.add_argument(
        "--quantization",
        "--quantize",
        choices=["float32", "int8"],
        default="float32",
        help="onnx, ctranslate2: the matrix weights' type (default float32). onnx int8 "
        "is checked on the validation pairs first (see --max-bleu-drop)",
    )
    export.add_argument(
        "--max-bleu-drop",
        type=_non_negative_float,
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
        type=_positive_int,
        help="onnx int8: check on the first N validation pairs (default: all)",
    )
    export.add_argument(
        "--data", help="onnx int8: the corpus whose validation pairs are checked (default: the run's)"
    )
    export.add_argument("--data-dir", help="onnx int8: its local copy (default: the run's)")
    export.add_argument(
        "--out",
        required=True,
        help="saved_model: the TF Serving base directory (writes OUT/NAME/VERSION and "
        "OUT/models.config); onnx, ctranslate2: the directory to write",
    )
    export.add_argument("--name", help="saved_model: the model name (default: the run's directory name)")
    export.add_argument(
        "--version",
        type=_positive_int,
        help="saved_model: the version (default: one more than the highest there)",
    )
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing version (saved_model) or directory (onnx, ctranslate2)",
    )
    export.set_defaults(handler=_export)

    average = commands.add_parser("average", help="average the last N epoch checkpoints")
    average.add_argument("--model", required=True, help="the run directory")
    average.add_argument("--last", type=_positive_int, default=5)
    average.add_argument("--output", help="default: RUN/averaged.keras")
    average.set_defaults(handler=_average)

    attention = commands.add_parser("attention", help="draw a sentence's attention heads")
    _add_model_arguments(attention)
    attention.add_argument("--text", required=True, help="the source sentence")
    attention.add_argument("--target", help="the target sentence (default: the model's translation)")
    attention.add_argument("--out", default="attention.png")
    attention.set_defaults(handler=_attention)

    presets = commands.add_parser("presets", help="list the model presets and their parameter counts")
    presets.add_argument(
        "--vocab-size",
        type=_positive_int,
        default=37000,
        help="shared vocabulary size (default: 37000, the paper's EN-DE)",
    )
    presets.set_defaults(handler=_presets)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    from keras_transformer.utils.checks import UserError
    from keras_transformer.utils.files import StorageError

    try:
        return args.handler(args)
    except UserError as error:
        print(f"keras-transformer: error: {error}", file=sys.stderr)
        return 2
    except StorageError as error:
        print(f"keras-transformer: error: {error}; {error.hint}.", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C while `train` was stopping, or any Ctrl-C elsewhere
        print("keras-transformer: interrupted; the last saved state is intact.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
