"""`keras-transformer train` as a function: corpus -> vocabulary -> batches ->
`model.fit` under a `tf.distribute` strategy, into a run directory
(`run_directory.py`), resumable after a crash. The preparation (everything
before `fit`) is `setup.py`; the callbacks `fit` gets are `callbacks.py`.

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

import keras
import tensorflow as tf

from keras_transformer.training.callbacks import (
    BestModel,
    MetricsLog,
    NonFiniteLoss,
    TimeBudget,
    ValidationBleu,
)
from keras_transformer.training.checkpoints import (
    CHECKPOINT_PATTERN,
    EpochCheckpoints,
    TrainingState,
    epoch_checkpoints,
)
from keras_transformer.training.options import (  # noqa: F401  (TrainingOptions: re-exported, the argument of train)
    RUN_DEFINING,
    TrainingOptions,
    best_metric,
    check_options,
)
from keras_transformer.training.preemption import Preempted, StopAtStepBoundary, StopSignals
from keras_transformer.training.run_directory import RunDirectory, save_model
from keras_transformer.training.setup import prepare_run
from keras_transformer.utils.files import StorageError


@dataclasses.dataclass
class TrainingResult:
    status: str  # "finished", "preempted" or "stopped: ..."
    run: RunDirectory
    epochs: list
    model: object


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
    prepared = prepare_run(run, options, log)
    extra = list(callbacks)
    if options.val_bleu:
        sources, references = (pairs[: options.val_bleu] for pairs in prepared.val_pairs)
        extra.insert(
            0,
            ValidationBleu(
                sources,
                references,
                prepared.tokenizer,
                every=options.val_bleu_every,
                last=len(training_intervals(options, prepared.batches.info.batches)[1]),
            ),
        )
    summary = (
        run.read_json(run.metrics_path)
        if run.metrics_path.exists()
        else {"epochs": [], "parameters": prepared.model.count_params()}
    )
    summary.pop("early_stopped", None)  # a finished run resumed for more epochs goes on
    best = None
    if options.early_stopping or options.keep_best:
        finished = [entry for entry in summary["epochs"] if entry["epoch"] <= prepared.epoch]
        best = BestModel(run.best_path, best_metric(options), summary, options.early_stopping, finished)
        extra.append(best)  # after ValidationBleu, whose val_bleu it compares
    return _fit(run, options, prepared, summary, extra, log, best)


def _fit(run, options, prepared, summary, callbacks, log, best=None):
    """`model.fit` over the remaining epochs with the run's callbacks; a `TrainingResult`.

    The batches are one stream, the data's epochs back to back (`TokenizedPairs.stream`); what
    Keras calls an epoch is an *interval* of it: a data epoch, or `--val-every-steps` updates.
    Validation, epoch checkpoints and metrics.json's entries come once per interval; `--steps`
    ends the run after that many updates (the last interval may be shorter).
    """
    model, batches, strategy = prepared.model, prepared.batches, prepared.strategy
    epoch, step, workers = prepared.epoch, prepared.step, prepared.workers
    interval, lengths = training_intervals(options, batches.info.batches)
    summary.update(
        status="running",
        examples=batches.info.examples,
        dropped=batches.info.dropped,
        batches_per_epoch=batches.info.batches,
        batches_per_interval=interval,
        replicas=strategy.num_replicas_in_sync,
    )
    summary.pop("preempted_at", None)
    tokens_per_interval = batches.target_tokens * interval / batches.info.batches
    metrics_log, nan_guard = MetricsLog(run, summary, tokens_per_interval), NonFiniteLoss()
    state = TrainingState(run.state_dir, options.save_every_steps or max(1, interval // 4))
    # With --val-every-steps, TensorBoard also gets the training metrics by update, every N updates.
    tensorboard = keras.callbacks.TensorBoard(
        str(run.logs_dir), update_freq=options.val_every_steps or "epoch"
    )
    signals = StopSignals(log)
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
    validation_data = _distribute(prepared.validation.in_order(), workers)
    segments = []  # (first interval, stop, batches of the first already trained, batches per interval)
    if step and epoch < len(lengths):  # finish the interrupted interval first
        segments.append((epoch, epoch + 1, step, lengths[epoch]))
        epoch += 1
    if not (
        options.max_minutes and spent >= 60 * options.max_minutes
    ):  # (a resumed run's budget may be used)
        while epoch < len(lengths):  # runs of intervals of one length: full ones, then a short last one
            stop = epoch + lengths[epoch:].count(lengths[epoch])
            segments.append((epoch, stop, 0, lengths[epoch]))
            epoch = stop
    with signals:
        try:
            for first, stop, skip, length in segments:
                if signals.requested:
                    raise Preempted(signals.requested, first, skip)
                metrics_log.first_step = state.first_step = skip
                metrics_log.steps_per_epoch = length
                start = first * interval + skip
                dataset = batches.stream(start, (stop - first) * length - skip, options.seed)
                # A skipping segment is one interval long, so `length - skip` is its length.
                model.fit(
                    _distribute(dataset, workers),
                    initial_epoch=first,
                    epochs=stop,
                    steps_per_epoch=length - skip,
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
    if best is not None and best.stopped:
        log(
            f"Early stopping: {best.metric} has not improved in {best.patience} measurement(s); the "
            f"best, epoch {best.best_epoch} ({best.metric} {best.best:.4g}), is {run.best_path}."
        )
    by_step = bool(options.val_every_steps)
    return _finish(run, model, summary, metrics_log, nan_guard, log, options.average_last, by_step)


def training_intervals(options, batches_per_epoch):
    """`(batches per interval, [batches of each interval])` of a run: intervals of a data epoch, or
    of `--val-every-steps` updates, over `--epochs` data epochs or `--steps` updates (updates are
    `--grad-accum` batches each)."""
    accumulate = options.grad_accum
    interval = options.val_every_steps * accumulate if options.val_every_steps else batches_per_epoch
    total = options.steps * accumulate if options.steps else options.epochs * batches_per_epoch
    full, rest = divmod(total, interval)
    return interval, [interval] * full + ([rest] if rest else [])


def _preempted(run, model, summary, metrics_log, stop, log):
    summary["status"] = "preempted"
    summary["preempted_at"] = {"epoch": stop.epoch + 1, "step": stop.step, "signal": stop.signal_name}
    metrics_log.write()
    log(
        f"Training {stop}; the state is saved in {run.state_dir}. Run the same command with "
        f"--resume to continue."
    )
    return TrainingResult("preempted", run, summary["epochs"], model)


def _finish(run, model, summary, metrics_log, nan_guard, log, average_last=None, by_step=False):
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
        plot_learning_curve(summary["epochs"], run.curve_path, by_step)
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
