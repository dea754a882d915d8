"""The learning-rate schedule of §5.3 ("Noam").

    lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)

It rises linearly for `warmup_steps` steps, then decays with the inverse
square root of the step number.
"""

import keras
from keras import ops

from keras_transformer.utils.checks import check_positive_int
from keras_transformer.utils.registration import register


@register
class NoamSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """§5.3 learning rate; serializable, so it survives `model.save`.

    Keras counts optimizer iterations from 0; the paper's step_num counts from
    1, so the schedule evaluates the formula at `iterations + 1` (the first
    update gets a non-zero rate).

    Args:
        d_model: model width (512 for base).
        warmup_steps: 4000 in the paper.
        scale: a constant factor on the whole schedule (1.0 in the paper).
        steps_per_update: optimizer calls per weight update under gradient
            accumulation (Keras evaluates the schedule at every call; the
            paper's step_num counts updates).

    Example:
    >>> schedule = NoamSchedule(d_model=512, warmup_steps=4000)
    >>> round(float(schedule(3999)), 7)  # the peak, at step 4000
    0.0006988
    """

    def __init__(self, d_model, warmup_steps=4000, scale=1.0, steps_per_update=1):
        check_positive_int("d_model", d_model)
        check_positive_int("warmup_steps", warmup_steps)
        check_positive_int("steps_per_update", steps_per_update)
        if not scale > 0:
            raise ValueError(f"scale must be a number > 0; got {scale!r}.")
        self.d_model = d_model
        self.warmup_steps = warmup_steps
        self.scale = scale
        self.steps_per_update = steps_per_update

    @staticmethod
    def scale_for_peak(peak_learning_rate, d_model, warmup_steps):
        """The `scale` whose schedule peaks at `peak_learning_rate` (at step `warmup_steps`).

        >>> schedule = NoamSchedule(128, 1000, NoamSchedule.scale_for_peak(5e-3, 128, 1000))
        >>> round(float(schedule(999)), 6)
        0.005
        """
        if not peak_learning_rate > 0:
            raise ValueError(f"the peak learning rate must be a number > 0; got {peak_learning_rate!r}.")
        return peak_learning_rate * (d_model * warmup_steps) ** 0.5

    def __call__(self, step):
        step_num = ops.floor(ops.cast(step, "float32") / self.steps_per_update) + 1.0
        return (self.scale * self.d_model**-0.5) * ops.minimum(
            ops.rsqrt(step_num), step_num * self.warmup_steps**-1.5
        )

    def get_config(self):
        return {
            "d_model": self.d_model,
            "warmup_steps": self.warmup_steps,
            "scale": self.scale,
            "steps_per_update": self.steps_per_update,
        }
