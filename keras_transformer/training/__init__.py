"""Training: the objective (label-smoothed loss, token accuracy), the Noam
schedule and the paper's Adam (backend-neutral); the fused train step; and the
training run of `keras-transformer train` (TensorFlow: tf.data, tf.distribute):
`trainer`, `distribution`, `checkpoints`, `run_directory`, `preemption`, `locking`."""

from keras_transformer.utils.lazy import lazy_exports

# Imported on first use: `training.options` (the command line's parser) needs no Keras.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(
            ["LabelSmoothedCrossEntropy", "MaskedTokenAccuracy"], "keras_transformer.training.losses"
        ),
        **dict.fromkeys(["compile_transformer", "make_optimizer"], "keras_transformer.training.optimizer"),
        "NoamSchedule": "keras_transformer.training.schedules",
    },
)

__all__ = [
    "LabelSmoothedCrossEntropy",
    "MaskedTokenAccuracy",
    "NoamSchedule",
    "compile_transformer",
    "make_optimizer",
]
