"""Training set-up as in §5.3-5.4: Adam(0.9, 0.98, 1e-9) on the Noam schedule,
label-smoothed cross-entropy and padding-aware token accuracy. Backend-neutral;
the `tf.distribute` strategies are in `distribution`.
"""

import keras

from keras_transformer.training.fused_step import LOG, FusedOutputLossStep
from keras_transformer.training.losses import LabelSmoothedCrossEntropy, MaskedTokenAccuracy
from keras_transformer.training.schedules import NoamSchedule
from keras_transformer.utils import keras_compat


def make_optimizer(
    d_model,
    warmup_steps=4000,
    learning_rate_scale=1.0,
    grad_accum=1,
    peak_learning_rate=None,
    clip_norm=None,
    total_steps=None,
    cooldown_steps=0,
    **adam_arguments,
):
    """Adam with β1 = 0.9, β2 = 0.98, ε = 1e-9 on `NoamSchedule(d_model, warmup_steps)`.

    `grad_accum` > 1 averages the gradients of that many batches into one
    update (a `grad_accum`-times larger batch); the schedule counts updates.
    `peak_learning_rate` sets the schedule's scale so that it peaks at that
    rate after `warmup_steps` (instead of `learning_rate_scale`; the same
    inverse-square-root shape). `clip_norm` rescales every update's gradients
    to a global norm of at most that (Keras' `global_clipnorm`).
    `cooldown_steps` of `total_steps` updates: the rate falls linearly towards
    zero over the run's last updates (`NoamSchedule`; 0: the paper's schedule).
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
        d_model,
        warmup_steps=warmup_steps,
        scale=learning_rate_scale,
        steps_per_update=grad_accum,
        total_steps=total_steps,
        cooldown_steps=cooldown_steps,
    )
    return keras.optimizers.Adam(learning_rate=schedule, **arguments)


def compile_transformer(
    model,
    label_smoothing=0.1,
    warmup_steps=4000,
    learning_rate_scale=1.0,
    optimizer=None,
    grad_accum=1,
    peak_learning_rate=None,
    clip_norm=None,
    total_steps=None,
    cooldown_steps=0,
    fused_step=True,
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
        peak_learning_rate, clip_norm, total_steps, cooldown_steps: see
            `make_optimizer`.
        fused_step: train with `FusedOutputLossStep` (the pre-softmax projection
            inside the loss: no logits, no projected padding; TensorFlow
            backend). On another backend it is not installed and the log says
            so; `False` trains on logits with Keras' own step everywhere.
        **compile_arguments: passed to `model.compile` (e.g. `jit_compile`,
            `steps_per_execution`).

    Returns:
        the model, compiled.
    """
    config = model.config
    model.compile(
        optimizer=optimizer
        or make_optimizer(
            config.d_model,
            warmup_steps,
            learning_rate_scale,
            grad_accum,
            peak_learning_rate,
            clip_norm,
            total_steps,
            cooldown_steps,
        ),
        loss=LabelSmoothedCrossEntropy(label_smoothing=label_smoothing, pad_id=config.pad_id),
        metrics=[MaskedTokenAccuracy(pad_id=config.pad_id)],
        **compile_arguments,
    )
    model.fused_step = None
    if fused_step and keras.backend.backend() == "tensorflow":
        model.fused_step = FusedOutputLossStep()
    elif fused_step:
        LOG.warning(
            "keras_transformer: the fused train step is TensorFlow-only; on %s, fit trains on logits.",
            keras.backend.backend(),
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
    `MultiWorkerMirroredStrategy` (see `keras_compat.DistributedFitFixes`).
    """
    ids = keras.KerasTensor((None, None), "int32")
    keras_compat.symbolic_build(model, ({"source_ids": ids, "target_ids": ids}, ids))
    return model
