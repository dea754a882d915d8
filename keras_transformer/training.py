"""Training set-up as in §5.3-5.4: Adam(0.9, 0.98, 1e-9) on the Noam schedule,
label-smoothed cross-entropy, padding-aware token accuracy."""

import keras

from keras_transformer.losses import LabelSmoothedCrossEntropy, MaskedTokenAccuracy
from keras_transformer.schedules import NoamSchedule


def make_optimizer(d_model, warmup_steps=4000, learning_rate_scale=1.0, **adam_arguments):
    """Adam with β1 = 0.9, β2 = 0.98, ε = 1e-9 on `NoamSchedule(d_model, warmup_steps)`."""
    arguments = dict(beta_1=0.9, beta_2=0.98, epsilon=1e-9)
    arguments.update(adam_arguments)
    schedule = NoamSchedule(d_model, warmup_steps=warmup_steps, scale=learning_rate_scale)
    return keras.optimizers.Adam(learning_rate=schedule, **arguments)


def compile_transformer(model, label_smoothing=0.1, warmup_steps=4000, learning_rate_scale=1.0,
                        optimizer=None, **compile_arguments):
    """Compiles `model` (a `Transformer`) with the paper's objective and optimizer.

    Args:
        model: a `Transformer`.
        label_smoothing: ε_ls (0.1).
        warmup_steps, learning_rate_scale: of the Noam schedule (ignored when
            `optimizer` is given).
        optimizer: overrides the paper's Adam.
        **compile_arguments: passed to `model.compile` (e.g. `jit_compile`,
            `steps_per_execution`).

    Returns:
        the model, compiled.
    """
    config = model.config
    model.compile(
        optimizer=optimizer or make_optimizer(config.d_model, warmup_steps, learning_rate_scale),
        loss=LabelSmoothedCrossEntropy(label_smoothing=label_smoothing, pad_id=config.pad_id),
        metrics=[MaskedTokenAccuracy(pad_id=config.pad_id)],
        **compile_arguments,
    )
    if model.built:
        # A built optimizer saves all its slots, so a model saved straight
        # after compiling reloads (Keras refuses an unbuilt saved optimizer).
        model.optimizer.build(model.trainable_variables)
    return model
