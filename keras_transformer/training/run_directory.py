"""A training run's directory: everything `train` writes and the other
commands read.

    runs/NAME/
      run.json              the settings of the run and the model config
      tokenizer.model       the shared SentencePiece vocabulary
      checkpoints/          epoch-NNNN.weights.h5, the last K epochs
      state/                state.json + weights and optimizer for --resume
      logs/                 TensorBoard
      metrics.json          per-epoch loss, accuracy, learning rate, tokens/s, val BLEU; status
      learning_curve.png    loss, accuracy and val BLEU per epoch (at the end)
      model.keras           the final model (only once training finished)
      averaged.keras        the mean of the last N epoch checkpoints (`train
                            --average-last N`, or `keras-transformer average`)
      best.keras            the model of the epoch with the best validation BLEU or
                            loss (`train --keep-best` or `--early-stopping N`)

Every file is written atomically (temporary name + rename). A directory
appears only once the input has been checked, so a run that fails on bad
input leaves nothing that could pass for a result. A writer (`train`,
`average`) holds the directory's `WriterLock` (`.keras-transformer.lock`) while
it writes; a second writer is refused.
"""

import json
import os
import pathlib
import shutil
import zipfile

from keras_transformer.training.locking import LOCK_NAME, WriterLock
from keras_transformer.utils.checks import UserError
from keras_transformer.utils.files import atomic_write
from keras_transformer.utils.keras_compat import model_bytes


class RunDirectory:
    """Paths and checks for one run directory (see the module docstring)."""

    def __init__(self, path):
        self.path = pathlib.Path(path)
        self.settings_path = self.path / "run.json"
        self.tokenizer_path = self.path / "tokenizer.model"
        self.checkpoints_dir = self.path / "checkpoints"
        self.state_dir = self.path / "state"
        self.logs_dir = self.path / "logs"
        self.metrics_path = self.path / "metrics.json"
        self.curve_path = self.path / "learning_curve.png"
        self.model_path = self.path / "model.keras"
        self.averaged_path = self.path / "averaged.keras"
        self.best_path = self.path / "best.keras"
        self.lock = WriterLock(self.path)

    def exists(self):
        """True when the directory holds anything besides the writer lock file."""
        return self.path.is_dir() and any(entry.name != LOCK_NAME for entry in self.path.iterdir())

    def lock_if_present(self):
        """Takes the writer lock now if the directory exists (a second writer fails fast)."""
        if self.path.is_dir():
            self.lock.acquire()

    def check_can_start(self, resume=False, overwrite=False):
        """Raises `UserError` when `path` holds something we must not silently reuse."""
        if resume and overwrite:
            raise UserError("--resume and --overwrite contradict each other; pass one.")
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"{self.path} exists and is not a directory; choose another --out.")
        if not self.exists() or overwrite:
            return
        if not resume:
            raise UserError(
                f"{self.path} already holds a run; pass --resume to continue it, "
                f"--overwrite to replace it, or choose another --out."
            )
        if not self.settings_path.exists():
            raise UserError(
                f"{self.path} is not empty but holds no run.json, so it is not a "
                f"run to resume; choose another --out."
            )

    def create(self, resume=False, overwrite=False):
        """Makes the directory and takes its writer lock; removes an old run when `overwrite`.

        The checks of `check_can_start` are repeated under the lock: another
        writer may have filled the directory since they were first made.
        """
        self.lock.acquire()
        self.check_can_start(resume, overwrite)
        if overwrite:
            for entry in self.path.iterdir():
                if entry.name == LOCK_NAME:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()

    def write_json(self, path, value):
        atomic_write(path, json.dumps(value, indent=2, sort_keys=True) + "\n")

    def read_json(self, path):
        with open(path, encoding="utf-8") as file:
            return json.load(file)

    def settings(self):
        """`run.json` as a dict; `UserError` when this is not a run directory."""
        if not self.settings_path.exists():
            raise UserError(
                f"{self.path} is not a run directory (no run.json); pass the --out "
                f"of a `keras-transformer train` run."
            )
        return self.read_json(self.settings_path)

    def tokenizer(self):
        from keras_transformer.data.tokenizer import Tokenizer

        if not self.tokenizer_path.exists():
            raise UserError(f"{self.tokenizer_path} is missing; the run directory is incomplete.")
        return Tokenizer.load(self.tokenizer_path)


def resolve_model(path):
    """`(RunDirectory, model file)` for `--model`: a run directory or a `.keras` file in one."""
    path = pathlib.Path(path)
    if path.suffix == ".keras":
        if not path.exists():
            raise UserError(f"{path} does not exist (--model takes a run directory or a .keras file).")
        run, model_path = RunDirectory(path.parent), path
    else:
        run = RunDirectory(path)
        model_path = run.model_path
    run.settings()
    if not model_path.exists():
        if model_path == run.model_path and run.state_dir.exists():
            raise UserError(
                f"{model_path} does not exist: the run has not finished. Finish it with "
                f"`keras-transformer train ... --out {run.path} --resume`."
            )
        raise UserError(f"{model_path} does not exist.")
    return run, model_path


def load_model(path):
    """The `Transformer` saved at `path` (a `.keras` file, or a run directory: its
    `model.keras`), loaded without its optimizer, in Keras' safe mode.

    Example:
        model = keras_transformer.load_model("runs/multi30k/averaged.keras")
    """
    import keras

    import keras_transformer.model  # noqa: F401  (registers the model and its layers)

    if os.path.isdir(path):
        _, path = resolve_model(path)
    try:
        return keras.saving.load_model(os.fspath(path), compile=False, safe_mode=True)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise UserError(
            f"{path} cannot be loaded ({detail}); it is damaged or not a "
            f"keras-transformer model. Train or average it again."
        ) from None


def load_translator(path, **options):
    """The `Translator` (strings in, strings out) of a trained run, as `keras-transformer translate`
    makes it.

    Args:
        path: a run directory (its `model.keras`) or a `.keras` file inside one
            (e.g. `runs/NAME/averaged.keras`); a list of them: their `Ensemble`
            (`load_run_models`).
        **options: of `Translator` (`beam_size`, `length_penalty`,
            `max_extra_length`, `batch_size`, `jit_compile`, `cache_policy`);
            the defaults are the CLI's (`keras_transformer.decoding.policy`).

    Example:
        translator = keras_transformer.load_translator("runs/multi30k")
        texts, scores = translator.translate(["A dog runs on the beach."])
        log_likelihoods = translator.score(["A dog."], ["Ein Hund."])
    """
    from keras_transformer.decoding.translator import Translator

    run, model = load_run_models(path)
    return Translator(model, run.tokenizer(), **options)


def save_model(model, path):
    """`model.save(path)` atomically: a `.keras` file is complete or absent.

    The file is made in memory and written with plain file I/O, so a full disk
    raises `files.StorageError` instead of crashing inside HDF5.
    """
    atomic_write(os.fspath(path), model_bytes(model))


def average_last_checkpoints(run, last, output=None):
    """Averages the run's last `last` epoch checkpoints into a `.keras` model; returns
    `(output path, the checkpoints averaged)`.

    Like OpenNMT-tf's `average_last_checkpoints`: the element-wise mean of the
    model weights (not the optimizer slots), saved as `output` (default
    `RUN/averaged.keras`). `UserError` when the run holds fewer checkpoints;
    `checkpoints.CorruptCheckpoint` (a `UserError`) when one is damaged.
    """
    from keras_transformer.training.checkpoints import epoch_checkpoints

    checkpoints = epoch_checkpoints(run.checkpoints_dir)
    if len(checkpoints) < last:
        raise UserError(
            f"--last {last}, but {run.checkpoints_dir} holds {len(checkpoints)} "
            f"epoch checkpoint(s) (train keeps --keep-checkpoints of them)."
        )
    averaged = _model_of_checkpoints(run, checkpoints[-last:])
    output = output or run.averaged_path
    save_model(averaged, output)
    return output, checkpoints[-last:]


def _model_of_checkpoints(run, paths):
    """The run's `Transformer` (uncompiled) with the mean of the weights in the epoch checkpoints
    `paths` (one path: that checkpoint's weights)."""
    from keras_transformer.model.config import TransformerConfig
    from keras_transformer.model.transformer import Transformer
    from keras_transformer.training.checkpoints import average_checkpoints
    from keras_transformer.training.optimizer import compile_transformer

    settings = run.settings()
    config = TransformerConfig.from_dict(settings["model"])
    model = Transformer(config)
    model.build()
    # The checkpoints hold the optimizer slots too: load them into a model compiled alike.
    options = settings["options"]
    compile_transformer(model, grad_accum=options.get("grad_accum", 1), clip_norm=options.get("clip_norm"))
    average_checkpoints(model, paths)
    plain = Transformer(config)
    plain.build()
    plain.set_weights(model.get_weights())
    return plain


def load_run_model(path, checkpoint=None):
    """`(RunDirectory, Transformer)` for `--model PATH [--checkpoint EPOCH]`: the model file
    (`resolve_model`), or with `checkpoint` the run's epoch checkpoint of that epoch."""
    from keras_transformer.training.checkpoints import CHECKPOINT_PATTERN, epoch_checkpoints

    if checkpoint is None:
        run, model_path = resolve_model(path)
        return run, load_model(model_path)
    run = RunDirectory(path)
    if pathlib.Path(path).suffix == ".keras":
        raise UserError(f"--checkpoint needs --model RUN (a run directory), not the model file {path}.")
    run.settings()
    epochs = {int(CHECKPOINT_PATTERN.search(p).group(1)): p for p in epoch_checkpoints(run.checkpoints_dir)}
    if checkpoint not in epochs:
        raise UserError(
            f"--checkpoint {checkpoint}: {run.checkpoints_dir} holds no checkpoint of epoch {checkpoint}; "
            f"it holds epochs {sorted(epochs) or 'none'} (train keeps the last --keep-checkpoints)."
        )
    return run, _model_of_checkpoints(run, [epochs[checkpoint]])


def load_run_models(paths, checkpoint=None):
    """`(RunDirectory, model)` for one or more `--model PATH`: one path, `load_run_model`'s; more, an
    `Ensemble` of their models, with the first one's run (its tokenizer, its settings). The members
    must have one vocabulary (`train --tokenizer FIRST/tokenizer.model` gives the later ones the
    first's) and `ensemble.SHARED_CONFIG`; anything else is one line, before a search is built."""
    from keras_transformer.model.ensemble import Ensemble

    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    loaded = [load_run_model(path, checkpoint) for path in paths]
    if len(loaded) == 1:
        return loaded[0]
    runs, models = zip(*loaded)
    tokenizers = [run.tokenizer() for run in runs]
    for path, tokenizer in zip(paths[1:], tokenizers[1:]):
        if tokenizer.model_proto != tokenizers[0].model_proto:
            raise UserError(
                f"{path} and {paths[0]} have different vocabularies: an ensemble's models share one "
                f"(train the later ones with --tokenizer {runs[0].tokenizer_path})."
            )
    return runs[0], Ensemble(models, names=paths)


def average_run(path, last, output=None):
    """`keras-transformer average`: `average_last_checkpoints` of the run at `path`,
    holding its writer lock (not while `train` writes checkpoints). Returns
    `(output path, the checkpoints averaged)`."""
    run = RunDirectory(path)
    run.settings()  # a run directory, or one line saying what is wrong
    with run.lock:
        return average_last_checkpoints(run, last, output)
