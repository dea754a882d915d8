"""Checkpoints that survive a crash, and checkpoint averaging.

Every file is written atomically (`files.py`): a process restarted after
SIGKILL finds the old file or the new one, never half of one. Neither callback saves weights that are not finite, so a run that
diverges to NaN keeps its last good files.

- `EpochCheckpoints`: `checkpoints/epoch-0007.weights.h5` after every epoch,
  the last `keep` kept (the inputs of `average_checkpoints`).
- `TrainingState`: weights, optimizer slots, epoch and step, every
  `save_every` steps and after every epoch, for `--resume`.
"""

import glob
import json
import os
import re

import keras
import numpy as np

from keras_transformer.files import atomic_path, atomic_write

CHECKPOINT_PATTERN = re.compile(r"epoch-(\d+)\.weights\.h5$")


def atomic_save_weights(model, path):
    """`model.save_weights(path)`, atomically (see `files.py`)."""
    with atomic_path(path, suffix=".weights.h5") as temporary:
        model.save_weights(temporary, overwrite=True)


def weights_are_finite(model):
    return all(np.all(np.isfinite(keras.ops.convert_to_numpy(w))) for w in model.weights)


def _finite(logs):
    return logs is None or "loss" not in logs or bool(np.isfinite(logs["loss"]))


def epoch_checkpoints(directory):
    """The `epoch-N.weights.h5` files in `directory`, oldest epoch first."""
    found = []
    for path in glob.glob(os.path.join(directory, "epoch-*.weights.h5")):
        match = CHECKPOINT_PATTERN.search(os.path.basename(path))
        if match:
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


class EpochCheckpoints(keras.callbacks.Callback):
    """Saves `directory/epoch-NNNN.weights.h5` (1-based) after every epoch; keeps the last `keep`."""

    def __init__(self, directory, keep=5):
        super().__init__()
        self.directory, self.keep = directory, keep

    def on_epoch_end(self, epoch, logs=None):
        if not _finite(logs) or not weights_are_finite(self.model):
            return
        atomic_save_weights(self.model, os.path.join(self.directory, f"epoch-{epoch + 1:04d}.weights.h5"))
        for old in epoch_checkpoints(self.directory)[: -self.keep]:
            os.remove(old)


class TrainingState(keras.callbacks.Callback):
    """The state a restarted run resumes from: `state.json` naming a weights file.

    `state.json` holds `{"epoch": e, "step": s, "weights": FILE}`: `e` epochs
    are complete and `s` batches of epoch `e` (0-based) are done. The weights
    file (model and optimizer) is written first under a new name, then
    `state.json` is replaced, then older weights files are removed.

    Args:
        directory: where the state lives.
        save_every: also save every this many steps within an epoch (None: only
            at epoch ends).
        first_step: steps of the current epoch done before this `fit` (a
            resumed epoch starts part-way).
    """

    def __init__(self, directory, save_every=None, first_step=0):
        super().__init__()
        self.directory, self.save_every, self.first_step = directory, save_every, first_step
        self.epoch = 0

    @staticmethod
    def load(directory):
        """The saved state as a dict, or None when there is none."""
        path = os.path.join(directory, "state.json")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as file:
            state = json.load(file)
        state["weights"] = os.path.join(directory, state["weights"])
        return state

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        step = self.first_step + batch + 1
        if self.save_every and step % self.save_every == 0 and _finite(logs):
            self._save(self.epoch, step)

    def on_epoch_end(self, epoch, logs=None):
        self.first_step = 0
        if _finite(logs):
            self._save(epoch + 1, 0)

    def _save(self, epoch, step):
        if not weights_are_finite(self.model):
            return
        iterations = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        name = f"state-{iterations:09d}-{epoch:04d}-{step:06d}.weights.h5"
        atomic_save_weights(self.model, os.path.join(self.directory, name))
        atomic_write(os.path.join(self.directory, "state.json"),
                          json.dumps({"epoch": epoch, "step": step, "weights": name}))
        for old in glob.glob(os.path.join(self.directory, "state-*.weights.h5")):
            if os.path.basename(old) != name:
                os.remove(old)


def average_checkpoints(model, paths):
    """Sets `model`'s weights to the element-wise mean of the checkpoints at `paths`.

    `model` must be built and compiled like the trained one (the files hold the
    optimizer slots too); only the model weights are averaged.
    """
    if not paths:
        raise ValueError("No checkpoints to average.")
    total = None
    for path in paths:
        model.load_weights(path)
        values = [keras.ops.convert_to_numpy(w).astype(np.float64) for w in model.weights]
        total = values if total is None else [t + v for t, v in zip(total, values)]
    for weight, value in zip(model.weights, total):
        weight.assign((value / len(paths)).astype(weight.dtype))
    return model
