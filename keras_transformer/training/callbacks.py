"""The callbacks a training run adds to `model.fit`, one job each: stop at the first
non-finite loss (`NonFiniteLoss`), keep to a time budget (`TimeBudget`), score greedy
validation BLEU every epoch (`ValidationBleu`), keep the best model and stop early
(`BestModel`), write `metrics.json` (`MetricsLog`).
Checkpoints and snapshots are in `checkpoints.py`, the stop at a signal in
`preemption.py`."""

import time

import keras
import numpy as np

from keras_transformer.training.checkpoints import logs_are_finite


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
    """Greedy-decodes a fixed list of validation sources after every `every`-th epoch
    (and after epoch `last`) and adds `val_bleu` (corpus sacreBLEU against
    `references`) to the epoch's logs.

    Greedy search, not the final beam: it tracks progress at a fraction of the
    cost (`--val-bleu N` picks how many pairs, `--val-bleu-every K` how often).
    The time it takes is counted in the epoch's `seconds` and logged alone as
    `val_bleu_seconds`.
    """

    def __init__(self, sources, references, tokenizer, batch_size=128, every=1, last=None):
        super().__init__()
        self.sources, self.references = list(sources), list(references)
        self.tokenizer, self.batch_size, self.translator = tokenizer, batch_size, None
        self.every, self.last = every, last

    def on_epoch_end(self, epoch, logs=None):
        from keras_transformer.decoding.translator import Translator
        from keras_transformer.evaluation import score_translations

        if logs is None or not logs_are_finite(logs):  # NonFiniteLoss stops the run
            return
        if (epoch + 1) % self.every and epoch + 1 != self.last:  # `epoch` counts from 0
            return
        if self.translator is None:  # traced once, reused every epoch
            self.translator = Translator(self.model, self.tokenizer, beam_size=1, batch_size=self.batch_size)
        start = time.perf_counter()
        hypotheses, _ = self.translator.translate(self.sources)
        logs["val_bleu"] = score_translations(hypotheses, self.references).bleu
        logs["val_bleu_seconds"] = time.perf_counter() - start


BEST_METRICS = {"val_bleu": "highest", "val_loss": "lowest"}


class BestModel(keras.callbacks.Callback):
    """Keeps `path` (`RUN/best.keras`) as the model of the epoch with the best `metric`
    (`val_bleu`: the highest, `val_loss`: the lowest) and, with `patience`, stops training once
    `patience` measurements of the metric in a row bring no gain (early stopping; with
    `--val-bleu-every K` the BLEU is measured every K epochs, and a measurement is what counts).

    Its state (the best value, its epoch and the measurements since) is a function of the epochs'
    metrics, so a resumed run rebuilds it from `metrics.json`'s finished epochs (`history`) and
    comes to the same decision as an uninterrupted one. `summary` (what `MetricsLog` writes)
    gets `best`: its epoch and value, and `early_stopped` when it stopped the run.
    """

    def __init__(self, path, metric, summary, patience=None, history=()):
        super().__init__()
        self.path, self.metric, self.summary, self.patience = path, metric, summary, patience
        self.best, self.best_epoch, self.since, self.stopped = None, None, 0, False
        for entry in history:
            self._measured(entry.get(metric), entry["epoch"])

    def _measured(self, value, epoch):
        """Counts a measurement; True when it is the best so far."""
        if value is None or not np.isfinite(value):
            return False
        better = self.best is None or (value > self.best if self.metric == "val_bleu" else value < self.best)
        if better:
            self.best, self.best_epoch, self.since = float(value), epoch, 0
            self.summary["best"] = {"epoch": epoch, self.metric: self.best, "model": "best.keras"}
        else:
            self.since += 1
        return better

    def on_epoch_end(self, epoch, logs=None):
        from keras_transformer.training.run_directory import save_model

        if logs is None or not logs_are_finite(logs):
            return
        if self._measured(logs.get(self.metric), epoch + 1):
            save_model(self.model, self.path)
        elif self.patience and self.since >= self.patience:
            self.stopped = self.model.stop_training = True
            self.summary["early_stopped"] = {
                "after_epoch": epoch + 1,
                "metric": self.metric,
                "patience": self.patience,
                "best_epoch": self.best_epoch,
            }


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
