"""Training: the objective (label-smoothed loss, token accuracy), the Noam
schedule and the paper's Adam (backend-neutral); the fused train step; and the
training run of `keras-transformer train` (TensorFlow: tf.data, tf.distribute):
`trainer`, `distribution`, `checkpoints`, `run_directory`, `preemption`, `locking`."""

from keras_transformer.training.losses import LabelSmoothedCrossEntropy, MaskedTokenAccuracy
from keras_transformer.training.optimizer import compile_transformer, make_optimizer
from keras_transformer.training.schedules import NoamSchedule

__all__ = [
    "LabelSmoothedCrossEntropy",
    "MaskedTokenAccuracy",
    "NoamSchedule",
    "compile_transformer",
    "make_optimizer",
]
