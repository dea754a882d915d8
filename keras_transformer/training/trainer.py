"""`keras-transformer train` as a function: corpus -> vocabulary -> batches ->
`model.fit` under a `tf.distribute` strategy, into a run directory
(`run_directory.py`), resumable after a crash.

    result = train(TrainingOptions(data="synthetic", preset="tiny", out="runs/demo", epochs=10))

Order of work: every input is checked (run directory, strategy, corpus,
vocabulary, model config) before the run directory is created, so bad input
leaves nothing behind. A resumed run reuses the stored vocabulary and config,
restores weights, optimizer, dropout RNG, epoch and step from the newest intact
snapshot (`checkpoints.restore_latest`), and replays the interrupted epoch's
remaining batches in the same order (`TokenizedPairs.epoch`).

Faults: the run directory's writer lock admits one `train` at a time
(`locking.py`); a full disk stops the run with a `StorageError` and the last
complete state intact; SIGTERM/SIGINT stop it at the next step boundary with
the state saved and status `preempted` (`preemption.py`).
"""

import dataclasses
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from keras_transformer.data.batching import TokenizedPairs
from keras_transformer.data.corpora import load_corpus
from keras_transformer.data.tokenizer import Tokenizer
from keras_transformer.model.config import TransformerConfig
from keras_transformer.model.transformer import Transformer
from keras_transformer.training.checkpoints import (
    CHECKPOINT_PATTERN,
    EpochCheckpoints,
    TrainingState,
    epoch_checkpoints,
    logs_are_finite,
    restore_latest,
)
from keras_transformer.training.distribution import select_strategy, worker_index
from keras_transformer.training.optimizer import build_for_fit, compile_transformer
from keras_transformer.training.options import (  # noqa: F401  (TrainingOptions: re-exported, the argument of train)
    RUN_DEFINING,
    TrainingOptions,
    check_options,
)
from keras_transformer.training.preemption import Preempted, StopAtStepBoundary, StopSignals
from keras_transformer.training.run_directory import RunDirectory, save_model
from keras_transformer.utils.checks import UserError
from keras_transformer.utils.files import StorageError


@dataclasses.dataclass
class TrainingResult:
    status: str  # "finished", "preempted" or "stopped: ..."
    run: RunDirectory
    epochs: list
    model: object


class NonFiniteLoss(keras.callbacks.Callback):
    """Stops training at the first NaN/inf loss and remembers where (like `TerminateOnNaN`)."""

    def __init__(self):
        super().__init__()
        self.epoch, self.where = 0, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if logs and "loss" in logs and not np.isfinite(logs["loss"]):
            self.where = (self.epoch + 1, batch + 1)
            self.model.stop_training = True


class TimeBudget(keras.callbacks.Callback):
    """Stops after the epoch past which the next one would overrun `seconds` of training.

    `spent`: seconds already used by earlier runs of the same training (the
    finished epochs of a resumed run), so that a killed and resumed run keeps
    to the budget it was given.
    """

    def __init__(self, seconds, spent=0.0):
        super().__init__()
        self.seconds, self.epoch_started = seconds, None
        self.started = time.perf_counter() - spent
        self.exhausted = False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_started = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        now = time.perf_counter()
        if now - self.started + (now - self.epoch_started) > self.seconds:
            self.exhausted = self.model.stop_training = True


class ValidationBleu(keras.callbacks.Callback):
    """Greedy-decodes a fixed list of validation sources after every epoch and adds
    `val_bleu` (corpus sacreBLEU against `references`) to the epoch's logs.

    Greedy search, not the final beam: it tracks progress at a fraction of the
    cost (`--val-bleu N` picks how many pairs). The time it takes is counted
    in the epoch's `seconds` and logged alone as `val_bleu_seconds`.
    """

    def __init__(self, sources, references, tokenizer, batch_size=128):
        super().__init__()
        self.sources, self.references = list(sources), list(references)
        self.tokenizer, self.batch_size, self.translator = tokenizer, batch_size, None

    def on_epoch_end(self, epoch, logs=None):
        from keras_transformer.decoding.translator import Translator
        from keras_transformer.evaluation import score_translations

        if logs is None or not logs_are_finite(logs):  # NonFiniteLoss stops the run
            return
        if self.translator is None:  # traced once, reused every epoch
            self.translator = Translator(self.model, self.tokenizer, beam_size=1, batch_size=self.batch_size)
        start = time.perf_counter()
        hypotheses, _ = self.translator.translate(self.sources)
        logs["val_bleu"] = score_translations(hypotheses, self.references).bleu
        logs["val_bleu_seconds"] = time.perf_counter() - start


class MetricsLog(keras.callbacks.Callback):
    """Writes `metrics.json` after every epoch: one entry per epoch (a re-run epoch replaces its entry)."""

    def __init__(self, run, summary, target_tokens):
        super().__init__()
        self.run, self.summary, self.target_tokens = run, summary, target_tokens
        self.first_step, self.steps_per_epoch, self.started = 0, 1, time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self.started
        share = 1.0 - self.first_step / self.steps_per_epoch
        entry = {
            "epoch": epoch + 1,
            "seconds": round(seconds, 2),
            "target_tokens_per_second": round(self.target_tokens * share / seconds, 1),
            "learning_rate": float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)),
            "optimizer_steps": int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)),
        }
        if self.first_step:
            entry["resumed_at_step"] = self.first_step
        # JSON has no NaN: a diverged value is recorded as null.
        entry.update(
            {key: float(value) if np.isfinite(value) else None for key, value in (logs or {}).items()}
        )
        self.summary["epochs"] = [e for e in self.summary["epochs"] if e["epoch"] != epoch + 1]
        self.summary["epochs"].append(entry)
        self.summary["epochs"].sort(key=lambda e: e["epoch"])
        self.first_step = 0
        self.write()

    def write(self):
        self.run.write_json(self.run.metrics_path, self.summary)


def train(options, callbacks=(), log=print):
    """Runs `options` (a `TrainingOptions`) to the end; returns a `TrainingResult`.

    `UserError` for bad input (nothing written) and for a run directory that
    another process is writing (`locking.DirectoryBusy`); `StorageError` when
    saving fails (full disk), the last complete state kept. A SIGTERM/SIGINT
    returns status `"preempted"`. `callbacks` are added to `fit`'s (tests use
    them to inject faults).
    """
    check_options(options)
    run = RunDirectory(options.out)
    try:
        run.check_can_start(options.resume, options.overwrite)  # leaves no lock file when refused
        run.lock_if_present()  # a second writer fails before any work
        return _train(run, options, callbacks, log)
    except StorageError as error:
        error.hint = "free space and run the same command with --resume"
        raise
    finally:
        run.lock.release()


def _train(run, options, callbacks, log):
    run.check_can_start(options.resume, options.overwrite)  # again, now under the lock
    strategy = select_strategy(options.strategy)  # before any TF op (multi-worker needs that)
    index, workers = worker_index(strategy)
    stored = run.settings() if options.resume and run.settings_path.exists() else None
    if stored is not None:
        _check_same_run(stored["options"], options)
    keras.utils.set_random_seed(options.seed)
    corpus = load_corpus(options.data, options.data_dir, options.source_lang, options.target_lang)
    train_pairs, val_pairs = corpus.train_and_validation(log)
    if stored is not None:
        tokenizer = run.tokenizer()
    else:
        tokenizer = _train_tokenizer(train_pairs, options.vocab_size, log)
    config = _model_config(options, tokenizer.vocab_size)
    max_length = min(options.max_length or config.max_length, config.max_length)
    batches = TokenizedPairs(*train_pairs, tokenizer, options.batch_tokens, max_length, row_multiple=workers)
    if batches.info.examples == 0:
        raise UserError(f"No training pair fits in {max_length} tokens; raise --max-length.")
    validation = TokenizedPairs(
        *val_pairs, tokenizer, options.batch_tokens, config.max_length, row_multiple=workers
    )

    run.create(resume=options.resume, overwrite=options.overwrite)
    if stored is None and run.settings_path.exists() and not options.overwrite:
        raise UserError(
            f"Another process started a run in {run.path} meanwhile; run the command again to resume it."
        )
    if stored is None:
        tokenizer.save(run.tokenizer_path)
        run.write_json(
            run.settings_path,
            {
                "options": _jsonable(options),
                "model": config.to_dict(),
                "source_lang": corpus.source_lang,
                "target_lang": corpus.target_lang,
            },
        )
    log(
        f"Training pairs: {batches.info.examples:,} kept, {batches.info.dropped:,} longer than "
        f"{max_length} tokens dropped; {batches.info.batches} batches per epoch; "
        f"{len(val_pairs[0]):,} validation pairs."
    )
    # The model's layers take the mixed policy when they are made; the caller's global policy is
    # restored afterwards (a Python caller's next model is not silently mixed).
    previous_policy = keras.config.dtype_policy()
    if options.mixed_precision:
        keras.config.set_dtype_policy(mixed_precision_policy())
    try:
        with strategy.scope():
            model = Transformer(config)
            model.build()
            compile_transformer(
                model,
                options.label_smoothing,
                options.warmup_steps,
                options.learning_rate_scale,
                grad_accum=options.grad_accum,
                peak_learning_rate=options.learning_rate,
                clip_norm=options.clip_norm,
                jit_compile=options.xla,
            )
            build_for_fit(model)
    finally:
        keras.config.set_dtype_policy(previous_policy)
    log(
        f"Model: preset {options.preset}, {model.count_params():,} parameters, "
        f"{strategy.num_replicas_in_sync} replica(s), --strategy {options.strategy}."
    )
    epoch, step = (
        restore_latest(model, run.state_dir, run.checkpoints_dir, log) if stored is not None else (0, 0)
    )
    extra = list(callbacks)
    if options.val_bleu:
        sources, references = val_pairs[0][: options.val_bleu], val_pairs[1][: options.val_bleu]
        extra.insert(0, ValidationBleu(sources, references, tokenizer))
    return _fit(options, run, strategy, model, batches, validation, epoch, step, extra, log, (index, workers))


def _fit(options, run, strategy, model, batches, validation, epoch, step, callbacks, log, worker):
    steps = batches.info.batches
    summary = (
        run.read_json(run.metrics_path)
        if run.metrics_path.exists()
        else {"epochs": [], "parameters": model.count_params()}
    )
    summary.update(
        status="running",
        examples=batches.info.examples,
        dropped=batches.info.dropped,
        batches_per_epoch=steps,
        replicas=strategy.num_replicas_in_sync,
    )
    summary.pop("preempted_at", None)
    target_tokens = int(np.sum(batches.target_ids.row_lengths().numpy()) + batches.info.examples)
    metrics_log, nan_guard = MetricsLog(run, summary, target_tokens), NonFiniteLoss()
    state = TrainingState(run.state_dir, options.save_every_steps or max(1, steps // 4))
    tensorboard, signals = keras.callbacks.TensorBoard(str(run.logs_dir)), StopSignals(log)
    # `callbacks` first: what they add to the epoch's logs (val_bleu) reaches metrics.json and TensorBoard.
    all_callbacks = [
        nan_guard,
        *callbacks,
        metrics_log,
        EpochCheckpoints(run.checkpoints_dir, options.keep_checkpoints),
        state,
        tensorboard,
    ]
    spent = sum(entry.get("seconds", 0.0) for entry in summary["epochs"])
    if options.max_minutes:  # the whole run's budget: a resumed run counts its finished epochs
        all_callbacks.append(TimeBudget(60 * options.max_minutes, spent))
    all_callbacks.append(StopAtStepBoundary(signals, state))  # last: the others have seen the batch
    verbose = options.verbose if options.verbose is not None else (1 if sys.stdout.isatty() else 2)
    validation_data = _distribute(validation.in_order(), worker[1])
    segments = []
    if step and epoch < options.epochs:  # finish the interrupted epoch first
        segments.append((epoch, epoch + 1, step))
        epoch += 1
    if epoch < options.epochs and not (options.max_minutes and spent >= 60 * options.max_minutes):
        segments.append((epoch, options.epochs, 0))  # (a resumed run may have used its budget)
    with signals:
        try:
            for first, stop, skip in segments:
                if signals.requested:
                    raise Preempted(signals.requested, first, skip)
                metrics_log.first_step = state.first_step = skip
                metrics_log.steps_per_epoch = steps
                dataset = _distribute(batches.epochs(first, stop, options.seed, skip), worker[1])
                # A skipping segment is one epoch long, so `steps - skip` is its length.
                model.fit(
                    dataset,
                    initial_epoch=first,
                    epochs=stop,
                    steps_per_epoch=steps - skip,
                    validation_data=validation_data,
                    shuffle=False,
                    verbose=verbose,
                    callbacks=all_callbacks,
                )
                if nan_guard.where or model.stop_training:
                    break
        except Preempted as stop:
            tensorboard.on_train_end()  # `fit` did not get there: close its event files
            return _preempted(run, model, summary, metrics_log, stop, log)
    return _finish(run, model, summary, metrics_log, nan_guard, log, options.average_last)


def _preempted(run, model, summary, metrics_log, stop, log):
    summary["status"] = "preempted"
    summary["preempted_at"] = {"epoch": stop.epoch + 1, "step": stop.step, "signal": stop.signal_name}
    metrics_log.write()
    log(
        f"Training {stop}; the state is saved in {run.state_dir}. Run the same command with "
        f"--resume to continue."
    )
    return TrainingResult("preempted", run, summary["epochs"], model)


def _finish(run, model, summary, metrics_log, nan_guard, log, average_last=None):
    from keras_transformer.plots import plot_learning_curve
    from keras_transformer.training.run_directory import average_last_checkpoints

    if nan_guard.where:
        epoch, step = nan_guard.where
        checkpoints = epoch_checkpoints(run.checkpoints_dir)
        last = checkpoints[-1] if checkpoints else "none (no epoch finished)"
        summary["status"] = f"stopped: non-finite loss at epoch {epoch}, step {step}"
        metrics_log.write()
        log(
            f"Training stopped: the loss became NaN/inf at epoch {epoch}, step {step}. "
            f"Last good checkpoint: {last}."
        )
        return TrainingResult(summary["status"], run, summary["epochs"], model)
    save_model(model, run.model_path)
    averaged = ""
    if average_last:
        available = len(epoch_checkpoints(run.checkpoints_dir))
        if available < average_last:  # a time budget that ended training early
            log(
                f"Averaging: only {available} epoch checkpoint(s), not --average-last "
                f"{average_last}; averaging those."
            )
        if available:
            path, used = average_last_checkpoints(run, min(average_last, available))
            summary["averaged"] = [int(CHECKPOINT_PATTERN.search(p).group(1)) for p in used]
            averaged = f", the average of epochs {summary['averaged']} in {path}"
    summary["status"] = "finished"
    metrics_log.write()
    if summary["epochs"]:
        plot_learning_curve(summary["epochs"], run.curve_path)
    log(f"Finished; the model is in {run.model_path}{averaged}, metrics in {run.metrics_path}.")
    return TrainingResult("finished", run, summary["epochs"], model)


def _distribute(dataset, workers):
    """Multi-worker: each batch is split by rows, every worker training on its share.

    Every worker builds the same batches (same seed), padded to a multiple of
    the worker count in rows (`TokenizedPairs(row_multiple=...)`); TF's
    rebatching hands worker i the i-th share of every batch, so all workers
    run the same number of steps on tensors of the same shapes.
    """
    if workers == 1:
        return dataset
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


DEFAULT_VOCAB_SIZE = 8000


def _train_tokenizer(train_pairs, vocab_size, log):
    """The shared vocabulary; an explicit size the corpus cannot support is an error, the default is
    capped."""
    texts = train_pairs[0] + train_pairs[1]
    if vocab_size is not None:
        return Tokenizer.train(texts, vocab_size)
    tokenizer = Tokenizer.train(texts, DEFAULT_VOCAB_SIZE, cap_to_corpus=True)
    if tokenizer.vocab_size < DEFAULT_VOCAB_SIZE:
        log(
            f"Vocabulary: {tokenizer.vocab_size} pieces, the most this corpus supports (the default "
            f"is {DEFAULT_VOCAB_SIZE}; --vocab-size sets it)."
        )
    return tokenizer


def _model_config(options, vocab_size):
    try:
        return TransformerConfig.from_preset(options.preset, vocab_size=vocab_size, **options.overrides)
    except (TypeError, ValueError) as error:
        raise UserError(f"Invalid model settings (--preset {options.preset}, --set): {error}") from None


def mixed_precision_policy():
    """`"mixed_float16"` where TensorFlow sees a GPU, else `"mixed_bfloat16"` (CPU)."""
    return "mixed_float16" if tf.config.list_logical_devices("GPU") else "mixed_bfloat16"


def _jsonable(options):
    return {
        key: value
        for key, value in dataclasses.asdict(options).items()
        if key not in ("resume", "overwrite", "verbose")
    }


def _check_same_run(stored, options):
    current = _jsonable(options)
    # No --vocab-size: the stored vocabulary is reused whatever its size (runs made
    # before the default became "8000, capped to the corpus" stored 8000).
    changed = [
        key
        for key in RUN_DEFINING
        if stored.get(key) != current.get(key) and not (key == "vocab_size" and current.get(key) is None)
    ]
    if changed:
        details = ", ".join(f"{key}: {stored.get(key)!r} -> {current.get(key)!r}" for key in changed)
        raise UserError(
            f"--resume with different settings than the stored run ({details}); "
            f"use the original settings or --overwrite."
        )
