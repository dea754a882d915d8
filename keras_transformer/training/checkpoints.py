"""Checkpoints that survive a crash, a full disk and a storage fault; checkpoint averaging.

Every file is serialized in memory and written atomically (`files.py`,
`keras_compat.py`): a process restarted after SIGKILL finds the old file or the
new one, never half of one, and a full disk is a `StorageError`, not a crash.
Neither callback saves weights that are not finite, so a run that diverges to
NaN keeps its last good files.

- `EpochCheckpoints`: `checkpoints/epoch-0007.weights.h5` after every epoch,
  the last `keep` kept (the inputs of `average_checkpoints`), and
  `checkpoints/manifest.json` with each file's SHA-256 and dropout RNG state.
- `TrainingState`: weights, optimizer slots, dropout RNG state, epoch and step,
  every `save_every` steps and after every epoch, for `--resume`. The newest
  and the previous state are kept.

Both kinds of file are *snapshots* a run can resume from (an epoch checkpoint
holds the optimizer too). `restore_latest` loads the newest one that is
intact: a file that is missing, empty, fails its checksum or does not load is
reported in one line and the next older snapshot is tried.
"""

import dataclasses
import glob
import json
import os
import re

import keras
import numpy as np

from keras_transformer.utils.checks import UserError
from keras_transformer.utils.files import atomic_write, sha256_of
from keras_transformer.utils.keras_compat import weights_bytes

CHECKPOINT_PATTERN = re.compile(r"epoch-(\d+)\.weights\.h5$")
STATE_PATTERN = re.compile(r"state-(\d+)-(\d+)-(\d+)\.weights\.h5$")
MANIFEST = "manifest.json"


class CorruptCheckpoint(UserError):
    """A checkpoint file that is missing, empty, fails its checksum or does not load."""


def atomic_save_weights(model, path):
    """`model.save_weights(path)`, atomically and without HDF5 touching the disk; returns the SHA-256."""
    data = weights_bytes(model)
    atomic_write(path, data)
    return sha256_of(data)


def _generator_states(model):
    """The state variables of `model`'s random generators: `model.variables` that are not weights."""
    weights = {id(w) for w in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def random_state(model):
    """The states of `model`'s random generators (dropout), as lists of ints.

    They are not weights (Keras does not save them), but a resumed run needs
    them to draw the dropout masks an uninterrupted run would have drawn.
    """
    return [keras.ops.convert_to_numpy(v).tolist() for v in _generator_states(model)]


def set_random_state(model, values):
    generators = _generator_states(model)
    if values is None or len(values) != len(generators):
        return  # an older file without RNG state: resume with fresh generators
    for variable, value in zip(generators, values):
        variable.assign(np.asarray(value, dtype=variable.dtype))


def weights_are_finite(model):
    return all(np.all(np.isfinite(keras.ops.convert_to_numpy(w))) for w in model.weights)


def logs_are_finite(logs):
    return logs is None or "loss" not in logs or bool(np.isfinite(logs["loss"]))


def epoch_checkpoints(directory):
    """The `epoch-N.weights.h5` files in `directory`, oldest epoch first."""
    found = []
    for path in glob.glob(os.path.join(directory, "epoch-*.weights.h5")):
        match = CHECKPOINT_PATTERN.search(os.path.basename(path))
        if match:
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def _read_json(path):
    """The JSON in `path`, or None when it is missing or unreadable (a storage fault)."""
    try:
        with open(path, encoding="utf-8") as file:
            value = json.load(file)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


@dataclasses.dataclass
class Snapshot:
    """A weights file a run can resume from: `epoch` epochs and `step` batches done."""

    path: str
    epoch: int
    step: int
    sha256: str = None
    random_state: list = None

    def problem(self):
        """Why the file is unusable ("empty", "checksum mismatch", ...), or None if it looks intact."""
        if not os.path.exists(self.path):
            return "missing"
        if os.path.getsize(self.path) == 0:
            return "empty (0 bytes)"
        if self.sha256 and sha256_of(self.path) != self.sha256:
            return "checksum mismatch: changed or truncated since it was written"
        return None

    def load_into(self, model):
        """Loads weights, optimizer slots and RNG state; `CorruptCheckpoint` if the file is bad."""
        problem = self.problem()
        if problem is None:
            try:
                model.load_weights(self.path)
            except Exception as error:  # noqa: BLE001 - h5py/Keras raise many kinds on bad files
                problem = f"does not load: {_first_line(error)}"
        if problem:
            raise CorruptCheckpoint(f"{self.path} is corrupt ({problem}).")
        set_random_state(model, self.random_state)


def _first_line(error):
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:200]


class EpochCheckpoints(keras.callbacks.Callback):
    """Saves `directory/epoch-NNNN.weights.h5` (1-based) after every epoch; keeps the last `keep`."""

    def __init__(self, directory, keep=5):
        super().__init__()
        self.directory, self.keep = directory, keep

    def on_epoch_end(self, epoch, logs=None):
        if not logs_are_finite(logs) or not weights_are_finite(self.model):
            return
        name = f"epoch-{epoch + 1:04d}.weights.h5"
        sha = atomic_save_weights(self.model, os.path.join(self.directory, name))
        manifest = _read_json(os.path.join(self.directory, MANIFEST)) or {}
        manifest[name] = {"sha256": sha, "random_state": random_state(self.model)}
        paths = epoch_checkpoints(self.directory)
        kept = {os.path.basename(path) for path in paths[-self.keep :]}
        atomic_write(
            os.path.join(self.directory, MANIFEST),
            json.dumps({k: v for k, v in manifest.items() if k in kept}, sort_keys=True),
        )
        for path in paths[: -self.keep]:
            os.remove(path)


def checkpoint_snapshots(directory):
    """`Snapshot`s of the epoch checkpoints in `directory`, oldest first (with manifest checksums)."""
    manifest = _read_json(os.path.join(directory, MANIFEST)) or {}
    snapshots = []
    for path in epoch_checkpoints(directory):
        name = os.path.basename(path)
        entry = manifest.get(name) if isinstance(manifest.get(name), dict) else {}
        snapshots.append(
            Snapshot(
                path,
                int(CHECKPOINT_PATTERN.search(name).group(1)),
                0,
                entry.get("sha256"),
                entry.get("random_state"),
            )
        )
    return snapshots


class TrainingState(keras.callbacks.Callback):
    """The state a restarted run resumes from: `state.json` naming a weights file.

    `state.json` holds `{"epoch": e, "step": s, "weights": FILE, "sha256": ...,
    "random_state": ..., "previous": {...}}`: `e` epochs are complete and `s`
    batches of epoch `e` (0-based) are done; `previous` describes the state
    before it, kept as a fallback. The weights file (model and optimizer) is
    written first under a new name, then `state.json` is replaced, then weights
    files older than the previous one are removed.

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

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        step = self.first_step + batch + 1
        if self.save_every and step % self.save_every == 0 and logs_are_finite(logs):
            self.save(self.epoch, step)

    def on_epoch_end(self, epoch, logs=None):
        self.first_step = 0
        if logs_are_finite(logs):
            self.save(epoch + 1, 0)

    def save(self, epoch, step):
        """Saves the state after `step` batches of epoch `epoch` (0-based); skips non-finite weights."""
        if not weights_are_finite(self.model):
            return
        iterations = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        name = f"state-{iterations:09d}-{epoch:04d}-{step:06d}.weights.h5"
        sha = atomic_save_weights(self.model, os.path.join(self.directory, name))
        current = _read_json(os.path.join(self.directory, "state.json")) or {}
        if current.get("weights") == name:  # saved again at the same point (a preemption)
            previous = current.get("previous")
        else:
            previous = {k: v for k, v in current.items() if k != "previous"} or None
        state = {
            "epoch": epoch,
            "step": step,
            "weights": name,
            "sha256": sha,
            "random_state": random_state(self.model),
            "previous": previous,
        }
        atomic_write(os.path.join(self.directory, "state.json"), json.dumps(state))
        keep = {name, previous.get("weights") if isinstance(previous, dict) else None}
        for old in glob.glob(os.path.join(self.directory, "state-*.weights.h5")):
            if os.path.basename(old) not in keep:
                os.remove(old)


def state_snapshots(directory):
    """`Snapshot`s of the resume states in `directory` (from `state.json`, else from the file names)."""
    state = _read_json(os.path.join(directory, "state.json"))
    entries = []
    if state is not None:
        entries = [state] + ([state["previous"]] if isinstance(state.get("previous"), dict) else [])
    snapshots = []
    for entry in entries:
        try:
            snapshots.append(
                Snapshot(
                    os.path.join(directory, entry["weights"]),
                    int(entry["epoch"]),
                    int(entry["step"]),
                    entry.get("sha256"),
                    entry.get("random_state"),
                )
            )
        except (KeyError, TypeError, ValueError):
            continue
    listed = {s.path for s in snapshots}
    for path in glob.glob(os.path.join(directory, "state-*.weights.h5")):
        match = STATE_PATTERN.search(os.path.basename(path))
        if match and path not in listed:  # state.json lost or damaged: the name says where it was
            snapshots.append(Snapshot(path, int(match.group(2)), int(match.group(3))))
    return snapshots


def restore_latest(model, state_dir, checkpoints_dir, log=print):
    """Loads the newest intact snapshot (state or epoch checkpoint) into `model`.

    Returns `(epoch, step)` to resume at, or `(0, 0)` when there is nothing to
    resume from. Each damaged file is reported in one line and the next older
    snapshot is tried; when every one is damaged, `CorruptCheckpoint`.
    """
    candidates = state_snapshots(state_dir) + checkpoint_snapshots(checkpoints_dir)
    # Newest first; at the same point a state (it was written last) before an epoch checkpoint.
    candidates.sort(
        key=lambda s: (s.epoch, s.step, os.path.dirname(s.path) == os.fspath(state_dir)), reverse=True
    )
    for snapshot in candidates:
        try:
            snapshot.load_into(model)
        except CorruptCheckpoint as error:
            log(f"keras-transformer: warning: {error} Trying the previous state or checkpoint.")
            continue
        log(f"Resuming from {snapshot.path}: epoch {snapshot.epoch + 1}, step {snapshot.step}.")
        return snapshot.epoch, snapshot.step
    if candidates:
        raise CorruptCheckpoint(
            f"No intact state or epoch checkpoint is left in {state_dir} or "
            f"{checkpoints_dir}; start the run again with --overwrite."
        )
    return 0, 0


def average_checkpoints(model, paths):
    """Sets `model`'s weights to the element-wise mean of the checkpoints at `paths`.

    `model` must be built and compiled like the trained one (the files hold the
    optimizer slots too); only the model weights are averaged. A checkpoint
    that is damaged (see `Snapshot.problem`; checksums from the directory's
    manifest) raises `CorruptCheckpoint`, and `model` is then left unaveraged.
    """
    if not paths:
        raise ValueError("No checkpoints to average.")
    known = {s.path: s for d in {os.path.dirname(p) for p in paths} for s in checkpoint_snapshots(d)}
    total = None
    for path in paths:
        known.get(path, Snapshot(path, 0, 0)).load_into(model)
        values = [keras.ops.convert_to_numpy(w).astype(np.float64) for w in model.weights]
        total = values if total is None else [t + v for t, v in zip(total, values)]
    for weight, value in zip(model.weights, total):
        weight.assign((value / len(paths)).astype(weight.dtype))
    return model
