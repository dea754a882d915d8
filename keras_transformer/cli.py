"""The `keras-transformer` command line.

    keras-transformer presets [--vocab-size N]    the model presets and their sizes
    keras-transformer --version

(`train`, `translate`, `evaluate`, `export` and `average` arrive with the
translation pipeline; see README, "Roadmap".)
"""

import argparse
import os
import sys


def _presets(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from keras_transformer.config import PRESETS
    from keras_transformer.transformer import Transformer

    print(f"Presets with a shared vocabulary of {args.vocab_size} tokens:\n")
    print("| preset | layers | d_model | heads | d_ff | dropout | max_length | parameters |")
    print("|--------|--------|---------|-------|------|---------|------------|------------|")
    for name, values in PRESETS.items():
        count = Transformer.from_preset(name, vocab_size=args.vocab_size).count_params()
        print(f"| {name:<6} | {values['num_layers']:>3}+{values['num_layers']:<2} | "
              f"{values['d_model']:>7} | {values['num_heads']:>5} | {values['d_ff']:>4} | "
              f"{values['dropout_rate']:>7} | {values['max_length']:>10} | {count:>10,} |")
    return 0


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser():
    from keras_transformer import __version__

    parser = argparse.ArgumentParser(
        prog="keras-transformer",
        description="The Transformer of 'Attention Is All You Need' in Keras 3.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    presets = commands.add_parser("presets", help="list the model presets and their parameter counts")
    presets.add_argument("--vocab-size", type=_positive_int, default=37000,
                         help="shared vocabulary size (default: 37000, the paper's EN-DE)")
    presets.set_defaults(handler=_presets)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
