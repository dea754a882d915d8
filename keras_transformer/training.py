"""Training set-up as in §5.3-5.4: Adam(0.9, 0.98, 1e-9) on the Noam schedule,
label-smoothed cross-entropy, padding-aware token accuracy; and the choice of
`tf.distribute` strategy.

Strategies (`select_strategy`):
    default       one device (TensorFlow's default strategy);
    mirrored      `MirroredStrategy` over every local GPU, or every logical
                  CPU device when there is no GPU;
    multi-worker  `MultiWorkerMirroredStrategy`, cluster from `TF_CONFIG`
                  (must be chosen before TensorFlow runs any op);
    auto          mirrored when there are several local GPUs, else default.
"""

import json
import os

import keras
import tensorflow as tf

from keras_transformer.losses import LabelSmoothedCrossEntropy, MaskedTokenAccuracy
from keras_transformer.schedules import NoamSchedule
from keras_transformer.validation import UserError


def make_optimizer(
    d_model,
    warmup_steps=4000,
    learning_rate_scale=1.0,
    grad_accum=1,
    peak_learning_rate=None,
    clip_norm=None,
    **adam_arguments,
):
    """Adam with β1 = 0.9, β2 = 0.98, ε = 1e-9 on `NoamSchedule(d_model, warmup_steps)`.

    `grad_accum` > 1 averages the gradients of that many batches into one
    update (a `grad_accum`-times larger batch); the schedule counts updates.
    `peak_learning_rate` sets the schedule's scale so that it peaks at that
    rate after `warmup_steps` (instead of `learning_rate_scale`; the same
    inverse-square-root shape). `clip_norm` rescales every update's gradients
    to a global norm of at most that (Keras' `global_clipnorm`).
    """
    arguments = dict(beta_1=0.9, beta_2=0.98, epsilon=1e-9)
    if grad_accum > 1:
        arguments["gradient_accumulation_steps"] = grad_accum
    if clip_norm is not None:
        arguments["global_clipnorm"] = clip_norm
    arguments.update(adam_arguments)
    if peak_learning_rate is not None:
        learning_rate_scale = NoamSchedule.scale_for_peak(peak_learning_rate, d_model, warmup_steps)
    schedule = NoamSchedule(
        d_model, warmup_steps=warmup_steps, scale=learning_rate_scale, steps_per_update=grad_accum
    )
    return keras.optimizers.Adam(learning_rate=schedule, **arguments)


STRATEGIES = ("auto", "default", "mirrored", "multi-worker")


def select_strategy(name):
    """The `tf.distribute.Strategy` called `name` (one of `STRATEGIES`)."""
    if name not in STRATEGIES:
        raise UserError(f"--strategy must be one of {list(STRATEGIES)}; got {name!r}.")
    if name == "multi-worker":
        cluster = _tf_config_cluster()
        if sum(len(tasks) for role, tasks in cluster.items() if role in ("chief", "worker")) < 1:
            raise UserError(
                "--strategy multi-worker needs TF_CONFIG with a cluster of workers, "
                'e.g. {"cluster": {"worker": ["host1:port", "host2:port"]}, '
                '"task": {"type": "worker", "index": 0}}.'
            )
        return tf.distribute.MultiWorkerMirroredStrategy()
    gpus = tf.config.list_logical_devices("GPU")
    if name == "mirrored":
        if gpus:
            return tf.distribute.MirroredStrategy([device.name for device in gpus])
        # CPU devices share memory: reduce on one of them. (TF's default
        # collective ops also key their state per process, so a second
        # MirroredStrategy in the same process could collide with the first.)
        return tf.distribute.MirroredStrategy(
            [device.name for device in tf.config.list_logical_devices("CPU")],
            cross_device_ops=tf.distribute.ReductionToOneDevice(),
        )
    if name == "auto" and len(gpus) > 1:
        return tf.distribute.MirroredStrategy([device.name for device in gpus])
    return tf.distribute.get_strategy()


def _tf_config_cluster():
    try:
        config = json.loads(os.environ.get("TF_CONFIG", "") or "{}")
    except json.JSONDecodeError as error:
        raise UserError(f"TF_CONFIG is not valid JSON ({error}).") from None
    cluster = config.get("cluster", {}) if isinstance(config, dict) else {}
    return cluster if isinstance(cluster, dict) else {}


def worker_index(strategy):
    """`(index, count)` of this worker in a multi-worker cluster; `(0, 1)` otherwise."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None:
        return 0, 1
    workers = resolver.cluster_spec().as_dict()
    count = sum(len(workers.get(role, [])) for role in ("chief", "worker"))
    index = resolver.task_id + (1 if resolver.task_type == "worker" and "chief" in workers else 0)
    return index, count


def compile_transformer(
    model,
    label_smoothing=0.1,
    warmup_steps=4000,
    learning_rate_scale=1.0,
    optimizer=None,
    grad_accum=1,
    peak_learning_rate=None,
    clip_norm=None,
    **compile_arguments,
):
    """Compiles `model` (a `Transformer`) with the paper's objective and optimizer.

    Args:
        model: a `Transformer`.
        label_smoothing: ε_ls (0.1).
        warmup_steps, learning_rate_scale: of the Noam schedule (ignored when
            `optimizer` is given).
        optimizer: overrides the paper's Adam.
        grad_accum: batches whose gradients make one update (see `make_optimizer`).
        peak_learning_rate, clip_norm: see `make_optimizer`.
        **compile_arguments: passed to `model.compile` (e.g. `jit_compile`,
            `steps_per_execution`).

    Returns:
        the model, compiled.
    """
    config = model.config
    model.compile(
        optimizer=optimizer
        or make_optimizer(
            config.d_model, warmup_steps, learning_rate_scale, grad_accum, peak_learning_rate, clip_norm
        ),
        loss=LabelSmoothedCrossEntropy(label_smoothing=label_smoothing, pad_id=config.pad_id),
        metrics=[MaskedTokenAccuracy(pad_id=config.pad_id)],
        **compile_arguments,
    )
    if model.built:
        # A built optimizer saves all its slots, so a model saved straight
        # after compiling reloads (Keras refuses an unbuilt saved optimizer).
        model.optimizer.build(model.trainable_variables)
    return model


def build_for_fit(model):
    """Builds a compiled `Transformer`'s loss, metrics and optimizer before `fit`.

    Call inside the strategy scope. `fit` then has nothing left to build from
    its first (distributed) batch, which Keras 3.15 cannot do under
    `MultiWorkerMirroredStrategy` (see `Transformer._maybe_symbolic_build`).
    """
    ids = keras.KerasTensor((None, None), "int32")
    model._symbolic_build(data_batch=({"source_ids": ids, "target_ids": ids}, ids))
    return model
