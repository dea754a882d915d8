"""The settings of a training run (`keras-transformer train`), declared once.

Each field of `TrainingOptions` carries its command-line help, parser and
flag (`option`): the CLI builds `train`'s arguments from them
(`cli.add_option`), and `check_options` checks a `TrainingOptions` built in
Python against the same parsers, so defaults, help and limits live here only.
This module imports neither Keras nor TensorFlow (the CLI reads it to build
its parser).
"""

import dataclasses

from keras_transformer.utils.arguments import (
    non_negative_int,
    parts_of,
    positive_float,
    positive_int,
    setting,
)
from keras_transformer.utils.checks import UserError

STRATEGIES = ("auto", "default", "mirrored", "multi-worker")


def option(
    default=None,
    help="",
    *,
    parse=None,
    flag=None,
    choices=None,
    metavar=None,
    required=False,
    defines_run=False,
    command_line=True,
    default_factory=None,
):
    """A `TrainingOptions` field and what the command line needs to know of it.

    Args:
        default: the default value (`default_factory` for a mutable one).
        help: the `--help` line; the default is appended where it is not None.
        parse: argparse `type` (e.g. `positive_int`); a `Number` also checks
            values given in Python (`check_options`).
        flag: the command-line flag (default `--field-name`).
        choices, metavar: as argparse's (the metavar defaults to N for an int,
            X for a float).
        required: no default; the command line requires it.
        defines_run: a resumed run must be given the same value.
        command_line: False for a setting only Python callers give.
    """
    metadata = dict(
        help=help,
        parse=parse,
        flag=flag,
        choices=choices,
        metavar=metavar,
        defines_run=defines_run,
        command_line=command_line,
    )
    if required:
        return dataclasses.field(metadata=metadata)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class TrainingOptions:
    """The settings of `keras_transformer.training.trainer.train` (= `keras-transformer train`).

    Example:
    >>> TrainingOptions(out="runs/demo", preset="tiny", epochs=2).batch_tokens
    4096
    """

    out: str = option(required=True, help="the run directory", metavar="DIR")
    data: str = option(
        "synthetic",
        "synthetic | multi30k | files:SRC,TGT | files:train=SRC,TGT;val=SRC,TGT;test=SRC,TGT",
        metavar="DATASET",
        defines_run=True,
    )
    data_dir: str = option(
        help="local copy of the dataset (multi30k; default: download into the cache)", metavar="DIR"
    )
    source_lang: str = option("en", "source language of the corpus", metavar="LANG", defines_run=True)
    target_lang: str = option("de", "target language of the corpus", metavar="LANG", defines_run=True)
    preset: str = option(
        "small",
        "tiny | mini | small | base | big (`keras-transformer presets` lists them)",
        metavar="NAME",
        defines_run=True,
    )
    overrides: dict = option(
        default_factory=dict,
        help="override a TransformerConfig field, e.g. --set dropout_rate=0.3 (repeatable)",
        parse=setting,
        flag="--set",
        metavar="KEY=VALUE",
        defines_run=True,
    )
    vocab_size: int = option(
        help="shared SentencePiece vocabulary (default 8000, or as many pieces as the corpus "
        "supports if fewer)",
        parse=positive_int,
        defines_run=True,
    )
    init_from: str = option(
        help="fine-tune: start from this trained model (a run directory or a .keras file in one), "
        "with its vocabulary and architecture, a fresh optimizer and schedule",
        metavar="RUN_OR_KERAS",
        defines_run=True,
    )
    freeze: list = option(
        help="keep these parts of the model fixed: embeddings, encoder or embeddings,encoder "
        "(tied embeddings freeze the output projection too)",
        parse=parts_of("embeddings", "encoder"),
        metavar="PARTS",
        defines_run=True,
    )
    tokenizer: str = option(
        help="use this SentencePiece model instead of training one (special ids <pad> 0, <unk> 1, "
        "<s> 2, </s> 3)",
        metavar="FILE.model",
        defines_run=True,
    )
    epochs: int = option(10, "training epochs (passes over the training pairs)", parse=positive_int)
    steps: int = option(
        help="train this many updates in all instead of --epochs (an update is --grad-accum batches)",
        parse=positive_int,
    )
    val_every_steps: int = option(
        help="validate, checkpoint and log metrics.json every N updates instead of every epoch "
        "(an 'epoch' in metrics.json, checkpoints/ and --val-bleu-every is then N updates)",
        parse=positive_int,
        metavar="N",
        defines_run=True,
    )
    batch_tokens: int = option(
        4096, "tokens per batch, source or target (the paper: ~25000)", parse=positive_int, defines_run=True
    )
    max_length: int = option(
        help="drop training pairs longer than this (default: the model's max_length)",
        parse=positive_int,
        defines_run=True,
    )
    warmup_steps: int = option(
        4000, "steps of linear learning-rate warmup (§5.3)", parse=positive_int, defines_run=True
    )
    learning_rate_scale: float = option(
        1.0,
        "a factor on the paper's schedule (instead of --learning-rate)",
        parse=positive_float,
        defines_run=True,
    )
    learning_rate: float = option(
        help="peak learning rate, reached after --warmup-steps and then decayed with 1/sqrt(step) "
        "(default: the paper's, d_model^-0.5 warmup^-0.5)",
        parse=positive_float,
        defines_run=True,
    )
    cooldown: float = option(
        help="over this fraction of the run's updates at its end (e.g. 0.2), the learning rate "
        "also falls linearly to zero (not in the paper; default: none). Counted from --epochs or "
        "--steps: a run that --max-minutes or --early-stopping ends sooner never gets there",
        parse=positive_float,
        metavar="FRACTION",
        defines_run=True,
    )
    clip_norm: float = option(
        help="clip each update's gradients to this global norm (default: no clipping)",
        parse=positive_float,
        defines_run=True,
    )
    label_smoothing: float = option(0.1, "epsilon_ls of §5.4, in [0, 1)", parse=float, defines_run=True)
    strategy: str = option(
        "auto",
        "tf.distribute strategy: default (one device), mirrored (all local GPUs, or the CPU), "
        "multi-worker (the cluster in TF_CONFIG), auto (mirrored on several GPUs, else default)",
        choices=STRATEGIES,
    )
    mixed_precision: bool = option(
        False, "float16 compute on GPU, bfloat16 on CPU (weights stay float32)", defines_run=True
    )
    xla: bool = option(False, "compile the train step with XLA")
    grad_accum: int = option(
        1, "batches whose gradients make one update", parse=positive_int, defines_run=True
    )
    token_cache: str = option(
        help="where a corpus read from files is kept tokenized, to be reused by the next run on it "
        "(default: token_cache in $KERAS_TRANSFORMER_CACHE, else ~/.cache/keras_transformer)",
        metavar="DIR",
    )
    max_minutes: float = option(
        help="time budget: stop after the last epoch that fits in it", parse=positive_float
    )
    keep_checkpoints: int = option(5, "epoch checkpoints kept", parse=positive_int)
    average_last: int = option(
        help="at the end, average the last N epoch checkpoints into RUN/averaged.keras "
        "(N <= --keep-checkpoints)",
        parse=positive_int,
    )
    val_bleu: int = option(
        0,
        "after every epoch, greedy-translate the first N validation pairs and record their BLEU "
        "(val_bleu in metrics.json; 0: off)",
        parse=non_negative_int,
    )
    val_bleu_every: int = option(
        1, "with --val-bleu: measure it every N epochs (and after the last)", parse=positive_int
    )
    early_stopping: int = option(
        help="stop after N measurements of --best-metric in a row without a gain (default: off); "
        "keeps RUN/best.keras",
        parse=positive_int,
        metavar="PATIENCE",
    )
    best_metric: str = option(
        help="what --early-stopping and --keep-best compare: val_bleu (needs --val-bleu N) or "
        "val_loss (default: val_bleu when --val-bleu is on, else val_loss)",
        choices=("val_bleu", "val_loss"),
        metavar="METRIC",
    )
    keep_best: bool = option(False, "keep RUN/best.keras, the model of the epoch with the best --best-metric")
    save_every_steps: int = option(
        help="save the resumable state this often (default: 4 times per epoch)", parse=positive_int
    )
    resume: bool = option(False, "continue the run in --out if there is one (else start it)")
    overwrite: bool = option(False, "replace the run in --out")
    seed: int = option(0, "seed of the initialization, dropout and batch order", parse=int, defines_run=True)
    verbose: int = option(
        help="Keras fit verbosity (default: a progress bar on a terminal)", command_line=False
    )


FIELDS = {field.name: field for field in dataclasses.fields(TrainingOptions)}

# Settings that define the run: a resumed run must be given the same ones.
RUN_DEFINING = tuple(name for name, field in FIELDS.items() if field.metadata["defines_run"])


def best_metric(options):
    """The metric `--early-stopping` and `--keep-best` compare (`--best-metric` or its default)."""
    return options.best_metric or ("val_bleu" if options.val_bleu else "val_loss")


def flag(name):
    """The command-line flag of the option `name`, as error messages name it."""
    return FIELDS[name].metadata["flag"] or "--" + name.replace("_", "-")


def check_options(options):
    """`UserError` (one line, naming the option) for a setting no run could use."""
    for name, field in FIELDS.items():
        value, parse, choices = getattr(options, name), field.metadata["parse"], field.metadata["choices"]
        if value is None and field.default is None:  # an optional setting left unset
            continue
        if hasattr(parse, "accepts") and not parse.accepts(value):
            raise UserError(f"{flag(name)} must be {parse.description}; got {value!r}.")
        if choices and value not in choices:
            raise UserError(f"{flag(name)} must be one of {list(choices)}; got {value!r}.")
    if options.learning_rate is not None and options.learning_rate_scale != 1.0:
        raise UserError(
            "--learning-rate (the peak) and --learning-rate-scale both set the learning rate; "
            "give one of them."
        )
    if options.cooldown is not None and not options.cooldown < 1:
        raise UserError(
            f"--cooldown is a fraction of the run's updates, in (0, 1); got {options.cooldown!r}."
        )
    if not (isinstance(options.label_smoothing, (int, float)) and 0 <= options.label_smoothing < 1):
        raise UserError(f"--label-smoothing must be in [0, 1); got {options.label_smoothing!r}.")
    if options.best_metric == "val_bleu" and not options.val_bleu:
        raise UserError("--best-metric val_bleu needs --val-bleu N (how many validation pairs to translate).")
    if options.average_last is not None and options.average_last > options.keep_checkpoints:
        raise UserError(
            f"--average-last {options.average_last} needs at least that many epoch checkpoints; raise "
            f"--keep-checkpoints (now {options.keep_checkpoints})."
        )
