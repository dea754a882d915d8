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

    def __call__(self, done, total=None):
        self.total = self.total if total is None else total
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
    from keras_transformer.training.evaluate import evaluate_run

    progress = _Progress(None)
    result = evaluate_run(
        args.model,
        args.data,
        args.split,
        data_dir=args.data_dir,
        source_lang=args.source_lang,
        target_lang=args.target_lang,
        limit=args.limit,
        output=args.output,
        beam_size=args.beam_size,
        length_penalty=args.length_penalty,
        batch_size=args.batch_size,
        progress=progress,
    )
    progress.close()
    missing = (
        ""
        if result.scores.paper_bleu is not None
        else "\n(The paper metric needs sacremoses: pip install sacremoses.)"
    )
    print(
        f"{args.data} {args.split} ({result.sentences} sentences, beam {args.beam_size}, "
        f"alpha {args.length_penalty}):\n{result.scores}{missing}\nTranslations: {result.translations_path}"
    )
    return 0


def _average(args):
    from keras_transformer.training.run_directory import average_run

    output, checkpoints = average_run(args.model, args.last, args.output)
    names = ", ".join(os.path.basename(path) for path in checkpoints)
    print(f"Averaged {names} into {output}")
    return 0


def _attention(args):
    from keras_transformer.plots import plot_attention

    _, _, translator = _load(args)
    found = translator.attention(args.text, args.target)
    plot_attention(found.weights, found.source_pieces, found.target_pieces, args.out)
    print(f"Translation: {found.target}\nAttention heads drawn in {args.out}")
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


positive_int = _number(int, 0, False, "a positive integer")
non_negative_int = _number(int, 0, True, "an integer >= 0")
positive_float = _number(float, 0, False, "a number > 0")
non_negative_float = _number(float, 0, True, "a number >= 0")


def _setting(text):
    key, separator, value = text.partition("=")
    if not separator or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def add_model_arguments(parser, beam=True, batch=True):
    parser.add_argument(
        "--model", required=True, help="a run directory (uses its model.keras) or a .keras file inside one"
    )
    if beam:
        parser.add_argument("--beam-size", type=positive_int, default=4)
        parser.add_argument(
            "--length-penalty",
            type=non_negative_float,
            default=0.6,
            help="alpha of the GNMT length penalty ((5 + length) / 6)^alpha (default 0.6; 0: none)",
        )
    if batch:
        parser.add_argument("--batch-size", type=positive_int, default=64)


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
    train.add_argument("--epochs", type=positive_int, default=10)
    train.add_argument(
        "--vocab-size",
        type=positive_int,
        help="shared SentencePiece vocabulary (default 8000, or as many pieces as "
        "the corpus supports if fewer)",
    )
    train.add_argument(
        "--batch-tokens", type=positive_int, default=4096, help="tokens per batch (the paper: ~25000)"
    )
    train.add_argument(
        "--max-length",
        type=positive_int,
        help="drop training pairs longer than this (default: the model's max)",
    )
    train.add_argument("--warmup-steps", type=positive_int, default=4000)
    train.add_argument(
        "--learning-rate",
        type=positive_float,
        help="peak learning rate, reached after --warmup-steps and then decayed "
        "with 1/sqrt(step) (default: the paper's, d_model^-0.5 "
        "warmup^-0.5)",
    )
    train.add_argument(
        "--learning-rate-scale",
        type=positive_float,
        default=1.0,
        help="a factor on the paper's schedule (instead of --learning-rate)",
    )
    train.add_argument(
        "--clip-norm",
        type=positive_float,
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
        "--grad-accum", type=positive_int, default=1, help="batches whose gradients make one update"
    )
    train.add_argument(
        "--max-minutes", type=positive_float, help="time budget: stop after the last epoch that fits in it"
    )
    train.add_argument("--keep-checkpoints", type=positive_int, default=5)
    train.add_argument(
        "--average-last",
        type=positive_int,
        metavar="N",
        help="at the end, average the last N epoch checkpoints into "
        "RUN/averaged.keras (N <= --keep-checkpoints)",
    )
    train.add_argument(
        "--val-bleu",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="after every epoch, greedy-translate the first N validation pairs and "
        "record their BLEU (val_bleu in metrics.json; default 0: off)",
    )
    train.add_argument(
        "--save-every-steps",
        type=positive_int,
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
    add_model_arguments(translate)
    translate.add_argument("--scores", action="store_true", help="append a tab and the score")
    translate.set_defaults(handler=_translate)

    evaluate = commands.add_parser("evaluate", help="sacreBLEU and chrF on a split")
    add_model_arguments(evaluate)
    _add_data_arguments(evaluate)
    evaluate.add_argument("--split", default="test", help="train | val | test (default test)")
    evaluate.add_argument("--source-lang", help="default: the run's")
    evaluate.add_argument("--target-lang", help="default: the run's")
    evaluate.add_argument("--limit", type=positive_int, help="only the first N sentences")
    evaluate.add_argument("--output", help="translations file (default RUN/translations-DATA-SPLIT.txt)")
    evaluate.set_defaults(handler=_evaluate)

    for command in _plugin_commands():
        command(commands)

    average = commands.add_parser("average", help="average the last N epoch checkpoints")
    average.add_argument("--model", required=True, help="the run directory")
    average.add_argument("--last", type=positive_int, default=5)
    average.add_argument("--output", help="default: RUN/averaged.keras")
    average.set_defaults(handler=_average)

    attention = commands.add_parser("attention", help="draw a sentence's attention heads")
    add_model_arguments(attention)
    attention.add_argument("--text", required=True, help="the source sentence")
    attention.add_argument("--target", help="the target sentence (default: the model's translation)")
    attention.add_argument("--out", default="attention.png")
    attention.set_defaults(handler=_attention)

    presets = commands.add_parser("presets", help="list the model presets and their parameter counts")
    presets.add_argument(
        "--vocab-size",
        type=positive_int,
        default=37000,
        help="shared vocabulary size (default: 37000, the paper's EN-DE)",
    )
    presets.set_defaults(handler=_presets)
    return parser


def _plugin_commands():
    """Subcommands other packages add (entry points `keras_transformer.commands`): `export`
    comes from `keras_transformer_export`, which the library never imports by name."""
    from importlib.metadata import entry_points

    return [entry.load() for entry in sorted(entry_points(group="keras_transformer.commands"), key=str)]


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
