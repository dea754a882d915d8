"""The private Keras names this package relies on, in one place, each with a test
(`tests/test_keras_compat.py`) so that a Keras upgrade that moves them fails
there and not in a user's run.

In-memory serialization: `model.save_weights` and `model.save` only take
paths, and HDF5 can crash the process (SIGSEGV) after a write to a full disk
fails. Serializing into memory keeps HDF5 away from the disk; the bytes are
then written by `files.atomic_write`, whose failures are ordinary `OSError`s.
The files are byte-for-byte what Keras writes (`model.load_weights` and
`keras.saving.load_model` read them).
"""

import io


def weights_bytes(model):
    """The `.weights.h5` file `model.save_weights` would write (model and optimizer), as bytes."""
    from keras.src.saving import saving_lib

    if not model.built:
        raise ValueError("Build the model before saving its weights.")
    buffer = io.BytesIO()
    store = saving_lib.H5IOStore(buffer, mode="w")
    try:
        saving_lib._save_state(
            model, weights_store=store, assets_store=None, inner_path="", visited_saveables=set()
        )
    finally:
        store.close()
    return buffer.getvalue()


def model_bytes(model):
    """The `.keras` file `model.save` would write, as bytes."""
    from keras.src.saving import saving_lib

    buffer = io.BytesIO()
    saving_lib.save_model(model, buffer)  # takes a file object; `keras.saving.save_model` does not
    return buffer.getvalue()


# The compiled state the fused train step reads (`training/fused_step.py`).


def compiled_loss(model):
    """The `CompileLoss` container `model.compile` made, or None."""
    return getattr(model, "_compile_loss", None)


def compiled_metrics(model):
    """The `CompileMetrics` container `model.compile` made, or None."""
    return getattr(model, "_compile_metrics", None)


def loss_tracker(model):
    """The `Mean` metric behind the `loss` that `fit` logs."""
    return model._loss_tracker


def has_loss_weights(compile_loss):
    """Whether `compile(loss_weights=...)` was given."""
    return compile_loss._user_loss_weights is not None


def has_weighted_metrics(compile_metrics):
    """Whether `compile(weighted_metrics=...)` was given."""
    return compile_metrics._flat_weighted_metrics != [None]


def symbolic_build(model, data_batch):
    """Builds a compiled model's loss, metrics and optimizer from a symbolic batch, as `fit` does."""
    model._symbolic_build(data_batch=data_batch)


def sublayers(model):
    """Every layer inside `model` (not itself), depth first."""
    return model._flatten_layers(include_self=False, recursive=True)


class DistributedFitFixes:
    """Mixin for a `keras.Model` that `fit`s under `MultiWorkerMirroredStrategy` (Keras 3.15).

    - `fit` first reduces a distributed batch with `strategy.reduce` to build
      the model symbolically; MultiWorkerMirroredStrategy cannot reduce dict
      inputs. When the model, loss, metrics and optimizer are all built
      (`training.optimizer.build_for_fit`), there is nothing to build.
    - Keras averages each replica's logs across workers with
      `strategy.reduce("MEAN", value, axis=0)`, which fails on scalars
      (tensorflow/tensorflow#72388): they travel as shape (1,).
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        compiled = (compiled_loss(self), compiled_metrics(self), getattr(self, "optimizer", None))
        if self.built and all(part is not None and part.built for part in compiled):
            return
        super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def logs_for_workers(self, logs):
        """`logs` as the multi-worker reduction needs them (unchanged elsewhere)."""
        import keras

        if keras.backend.backend() != "tensorflow":
            return logs
        import tensorflow as tf

        if not isinstance(self.distribute_strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return logs
        return {
            name: keras.ops.reshape(value, (1,)) if len(value.shape) == 0 else value
            for name, value in logs.items()
        }


def patch_tf2onnx_for_numpy2():
    """tf2onnx 1.17 still uses `np.object` etc. (removed in NumPy 2); Keras ships the fix.

    `keras.src.export.tf2onnx_lib.patch_tf2onnx` is what `model.export(format="onnx")`
    calls; a missing one is tolerated on NumPy < 2 (nothing to patch there).
    """
    import warnings

    import numpy as np

    try:
        from keras.src.export.tf2onnx_lib import patch_tf2onnx
    except ImportError:  # pragma: no cover - a future Keras may move it
        if int(np.__version__.split(".")[0]) >= 2:
            raise
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # its own `hasattr(np, "object")` probe
        patch_tf2onnx()
