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
`--data-dir DIR` with a local copy), `files:SRC,TGT` (aligned UTF-8 files for
training) or `files:train=SRC,TGT;val=SRC,TGT;test=SRC,TGT` (any of the splits:
`evaluate --data "files:test=T.en,T.de" --split test` scores your own test set).
Problems with the input print one line `keras-transformer: error: ...` and
exit with status 2 (also: a directory that another process is writing, a
corrupt checkpoint); a training run stopped by a NaN loss, and a save that the
storage refused (a full disk), exit with status 1; a training run stopped by
SIGTERM or SIGINT exits with status 75 once its state is saved (the same
command with `--resume` continues it).
"""

import argparse
import dataclasses
import os
import re
import sys
import time

from keras_transformer.decoding import policy
from keras_transformer.training.options import FIELDS, flag
from keras_transformer.utils.arguments import (  # noqa: F401  (public: the export command uses them)
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from keras_transformer.utils.checks import UserError


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
    from keras_transformer.training.trainer import train

    result = train(training_options(args))
    if result.status == "preempted":
        from keras_transformer.training.preemption import EXIT_PREEMPTED

        return EXIT_PREEMPTED
    return 0 if result.status == "finished" else 1


def _load(args):
    from keras_transformer.decoding.translator import Translator
    from keras_transformer.training.run_directory import load_run_models

    run, model = load_run_models(args.model, args.checkpoint)
    translator = Translator(
        model,
        run.tokenizer(),
        beam_size=args.beam_size,
        length_penalty=args.length_penalty,
        max_extra_length=getattr(args, "max_extra_length", policy.MAX_EXTRA_LENGTH),
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
    from keras_transformer.decoding.alignments import pharaoh

    options, prefixes, sequences = _request(args)  # checked before the model loads
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
    if prefixes is not None and len(prefixes) != len(lines):
        raise UserError(
            f"--prefix-file has {len(prefixes)} lines and the input {len(lines)}: give one prefix "
            f"line (empty for none) per input line."
        )
    progress = _Progress(len(lines))
    try:
        found = translator.translate_hypotheses(
            lines, progress, target_prefix=prefixes, suppress_sequences=sequences, **options
        )
    except ValueError as error:
        raise UserError(str(error)) from None
    progress.close()
    output = sys.stdout
    for index, hypotheses in enumerate(found):
        for hypothesis in hypotheses if args.n_best else hypotheses[:1]:
            alignment = pharaoh(hypothesis.alignment) if args.alignments else None
            text = one_line(hypothesis.text)
            if args.n_best:  # Marian's and fairseq's n-best format
                fields = [str(index), text, f"{hypothesis.score:.4f}"]
                output.write(" ||| ".join(fields + ([alignment] if args.alignments else [])) + "\n")
            else:
                fields = [text] + ([f"{hypothesis.score:.4f}"] if args.scores else [])
                output.write("\t".join(fields + ([alignment] if args.alignments else [])) + "\n")
    output.flush()
    return 0


# What could split an output line: every line boundary of str.splitlines, and the tab that
# separates --scores and --alignments. A model can emit them through byte-fallback pieces (an
# undertrained or sampled one does): one line out per line in must hold for aligned files.
_LINE_BREAKING = re.compile("[\t\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def one_line(text):
    """`text` with every character that would split its output line (or its tab-separated fields)
    read as a space."""
    return _LINE_BREAKING.sub(" ", text)


def _request(args):
    """`(options, prefixes, banned sequences)` of `translate`'s arguments, checked (`UserError`)."""
    from keras_transformer.decoding.controls import DecodingOptions

    values = {
        "length_penalty": args.length_penalty,
        "max_extra_length": args.max_extra_length,
        "min_length": args.min_length,
        "num_return": args.n_best or 1,
        "disable_unk": args.disable_unk,
        "no_repeat_ngram_size": args.no_repeat_ngram_size,
        "repetition_penalty": args.repetition_penalty,
        "sampling_topk": args.sampling_topk,
        "sampling_topp": args.sampling_topp,
        "sampling_temperature": args.sampling_temperature,
        "seed": args.seed,
        "return_alignments": args.alignments,
        "early_stopping": args.early_stopping,
    }
    try:
        DecodingOptions(**values).check(args.beam_size)
    except ValueError as error:
        flag = "--n-best" if str(error).startswith("num_return") else None
        raise UserError(f"{flag}: {error}" if flag else str(error)) from None
    return (
        values,
        _lines(args.prefix_file, "--prefix-file"),
        _lines(args.suppress_file, "--suppress-file", True),
    )


def _lines(path, flag, drop_empty=False):
    """The lines of a UTF-8 file (None without a path); a missing or unreadable one is a `UserError`."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            lines = [line.rstrip("\r\n") for line in handle]
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"{flag} {path}: cannot read it ({error.__class__.__name__}: {error}).") from None
    return [line for line in lines if line.strip()] if drop_empty else lines


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
        checkpoint=args.checkpoint,
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


def add_model_arguments(parser, beam=True, batch=True, ensemble=False):
    help = "a run directory (uses its model.keras) or a .keras file inside one"
    if ensemble:
        parser.add_argument(
            "--model",
            required=True,
            nargs="+",
            action="extend",
            metavar="MODEL",
            help=f"{help}; several: an ensemble (their mean next-token probability; one vocabulary)",
        )
    else:
        parser.add_argument("--model", required=True, help=help)
    parser.add_argument(
        "--checkpoint",
        type=positive_int,
        metavar="EPOCH",
        help="the run's checkpoint of that epoch (RUN/checkpoints/) instead of its model.keras",
    )
    if beam:
        parser.add_argument(
            "--beam-size",
            type=positive_int,
            default=policy.BEAM_SIZE,
            metavar="K",
            help=f"hypotheses kept per sentence (default {policy.BEAM_SIZE}; 1: greedy)",
        )
        parser.add_argument(
            "--length-penalty",
            type=non_negative_float,
            default=policy.LENGTH_PENALTY,
            help="alpha of the GNMT length penalty ((5 + length) / 6)^alpha (default 0.6; 0: none)",
        )
    if batch:
        parser.add_argument(
            "--batch-size",
            type=positive_int,
            default=64,
            metavar="N",
            help="sentences translated together, sorted by length (default 64)",
        )


def _decoding_arguments(parser):
    """`translate`'s decoding controls (keras_transformer.decoding.controls; docs/decoding.md)."""
    add = parser.add_argument
    add(
        "--n-best",
        type=positive_int,
        metavar="K",
        help="print the K best (or K samples) per line as "
        "'index ||| text ||| score' (K <= --beam-size unless sampling)",
    )
    add(
        "--max-extra-length",
        type=non_negative_int,
        default=policy.MAX_EXTRA_LENGTH,
        metavar="N",
        help="output tokens beyond the source length, EOS included (default 50)",
    )
    add(
        "--min-length",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="no EOS before N output tokens, EOS included (default 0)",
    )
    add(
        "--prefix-file",
        metavar="F",
        help="a prefix per input line (empty: none): each translation starts with it",
    )
    add("--suppress-file", metavar="F", help="strings, one per line, that no translation may contain")
    add("--disable-unk", action="store_true", help="never output <unk>")
    add(
        "--early-stopping",
        action="store_true",
        help="end a sentence's beam search once it has --beam-size finished hypotheses "
        "(CTranslate2's rule: fewer steps) instead of when none can be beaten",
    )
    add(
        "--no-repeat-ngram-size",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="no n-gram of N tokens twice in an output (default 0: off)",
    )
    add(
        "--repetition-penalty",
        type=positive_float,
        default=1.0,
        metavar="P",
        help="CTranslate2's penalty on the logits of tokens already output (default 1.0: off)",
    )
    add(
        "--sampling-topk",
        type=non_negative_int,
        default=1,
        metavar="K",
        help="sample from the K likeliest tokens (0: all) instead of searching (default 1: beam search)",
    )
    add(
        "--sampling-topp",
        type=float,
        default=1.0,
        metavar="P",
        help="sample from the smallest set of tokens whose probability reaches P (default 1.0)",
    )
    add(
        "--sampling-temperature",
        type=positive_float,
        default=1.0,
        metavar="T",
        help="divide the log-probabilities by T before sampling (default 1.0)",
    )
    add(
        "--seed",
        type=non_negative_int,
        default=0,
        metavar="S",
        help="the samples' seed: the same seed gives the same samples in every runtime (default 0)",
    )
    add(
        "--alignments",
        action="store_true",
        help="append the word alignment as Pharaoh 'i-j' pairs (source word i, target word j)",
    )


def add_option(parser, name, **changes):
    """Adds the `TrainingOptions` field `name` to `parser` as its metadata declares it
    (flag, parser, help, default); `changes` override argparse arguments."""
    field = FIELDS[name]
    meta = field.metadata
    arguments = {"help": meta["help"]}
    if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
        arguments["required"] = True
    elif field.type is bool:
        arguments["action"] = "store_true"
    elif field.default_factory is not dataclasses.MISSING:  # a repeatable KEY=VALUE option
        arguments.update(action="append", default=[], type=meta["parse"])
    else:
        arguments.update(default=field.default, type=meta["parse"])
    if meta["choices"] is not None:
        arguments["choices"] = meta["choices"]
    if meta["metavar"] is not None:
        arguments["metavar"] = meta["metavar"]
    elif "type" in arguments and field.type in (int, float):
        arguments["metavar"] = "N" if field.type is int else "X"
    arguments = {key: value for key, value in {**arguments, **changes}.items() if value is not None}
    default = arguments.get("default")
    if default is not None and "action" not in arguments and not arguments.get("required"):
        arguments["help"] += f" (default: {default})"  # the default this parser really has
    parser.add_argument(flag(name), dest=name, **arguments)


def training_options(args):
    """The `TrainingOptions` of parsed `train` arguments."""
    from keras_transformer.training.options import TrainingOptions

    values = {name: getattr(args, name) for name, field in FIELDS.items() if field.metadata["command_line"]}
    values["overrides"] = dict(values["overrides"])
    return TrainingOptions(**values)


def _train_parser(commands):
    train = commands.add_parser("train", help="train a model into a run directory")
    for name, field in FIELDS.items():
        if field.metadata["command_line"]:
            add_option(train, name)
    train.set_defaults(handler=_train)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line with the CLI's one prefix (no usage dump),
    exit status 2, and takes no abbreviated flags (`--epoch` is not `--epochs`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"keras-transformer: error: {message} (see {self.prog} --help)\n")


def build_parser():
    from keras_transformer import __version__

    parser = _Parser(
        prog="keras-transformer",
        description="The Transformer of 'Attention Is All You Need' in Keras 3.",
        epilog="TensorFlow's C++ start-up lines are hidden; KERAS_TRANSFORMER_TF_LOGS=1 shows them.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    _train_parser(commands)

    translate = commands.add_parser("translate", help="translate stdin to stdout, one line each")
    add_model_arguments(translate, ensemble=True)
    _decoding_arguments(translate)
    translate.add_argument("--scores", action="store_true", help="append a tab and the score")
    translate.set_defaults(handler=_translate)

    evaluate = commands.add_parser("evaluate", help="sacreBLEU and chrF on a split")
    add_model_arguments(evaluate, ensemble=True)
    add_option(evaluate, "data", required=True, default=None)
    add_option(evaluate, "data_dir")
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
    average.add_argument(
        "--last", type=positive_int, default=5, metavar="N", help="the last N epoch checkpoints (default 5)"
    )
    average.add_argument("--output", help="the averaged model (default: RUN/averaged.keras)")
    average.set_defaults(handler=_average)

    attention = commands.add_parser("attention", help="draw a sentence's attention heads")
    add_model_arguments(attention)
    attention.add_argument("--text", required=True, help="the source sentence")
    attention.add_argument("--target", help="the target sentence (default: the model's translation)")
    attention.add_argument("--out", default="attention.png", help="the image (default attention.png)")
    attention.set_defaults(handler=_attention)

    presets = commands.add_parser("presets", help="list the model presets and their parameter counts")
    presets.add_argument(
        "--vocab-size",
        type=positive_int,
        default=37000,
        help="shared vocabulary size (default: 37000, the paper's EN-DE)",
    )
    presets.set_defaults(handler=_presets)
    parser.command_parsers = commands.choices  # name -> the command's parser
    return parser


def _plugin_commands():
    """Subcommands other packages add (entry points `keras_transformer.commands`): `export`
    comes from `keras_transformer_export`, which the library never imports by name."""
    from importlib.metadata import entry_points

    return [entry.load() for entry in sorted(entry_points(group="keras_transformer.commands"), key=str)]


def _start_tensorflow():
    """Imports TensorFlow (where installed) without its C++ start-up lines, and keeps its
    later informational C++ logs off, unless KERAS_TRANSFORMER_TF_LOGS=1."""
    import importlib.util

    from keras_transformer.utils.tensorflow import SHOW_LOGS_VARIABLE, import_tensorflow_quietly

    if os.environ.get(SHOW_LOGS_VARIABLE) != "1":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if importlib.util.find_spec("tensorflow") is not None:
        import_tensorflow_quietly("keras-transformer")


def main(argv=None):
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)  # --help and usage errors end here, before TensorFlow
    if unknown:  # reported by the command's parser, whose --help lists what it takes
        parser.command_parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    from keras_transformer.utils.checks import UserError
    from keras_transformer.utils.files import StorageError

    _start_tensorflow()

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
