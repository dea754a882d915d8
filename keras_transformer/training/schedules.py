"""The learning-rate schedule of §5.3 ("Noam").

    lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)

It rises linearly for `warmup_steps` steps, then decays with the inverse
square root of the step number. Optionally (not in the paper) a cooldown: over
the run's last `cooldown_steps` of `total_steps` updates the rate is also
multiplied by a factor falling linearly from 1 to 1/cooldown_steps at the last
update (the "warmup-stable-decay" shape's decay, here on top of §5.3's curve).
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
        total_steps: the run's updates; needed with `cooldown_steps`.
        cooldown_steps: the last updates over which the rate falls linearly
            towards zero (0: none, the paper's schedule). Update
            `total_steps - k` (k = 0 .. cooldown_steps - 1) gets the factor
            `(k + 1) / cooldown_steps`; updates past `total_steps` get 0.

    Example:
    >>> schedule = NoamSchedule(d_model=512, warmup_steps=4000)
    >>> round(float(schedule(3999)), 7)  # the peak, at step 4000
    0.0006988
    >>> cooled = NoamSchedule(512, 4000, total_steps=10000, cooldown_steps=2000)
    >>> round(float(cooled(7999)) / float(schedule(7999)), 4)  # update 8000: before the cooldown
    1.0
    >>> round(float(cooled(8999)) / float(schedule(8999)), 4)  # update 9000: half way down
    0.5005
    >>> round(float(cooled(9999)) / float(schedule(9999)), 4)  # the last update: 1 / 2000
    0.0005
    """

    def __init__(
        self, d_model, warmup_steps=4000, scale=1.0, steps_per_update=1, total_steps=None, cooldown_steps=0
    ):
        check_positive_int("d_model", d_model)
        check_positive_int("warmup_steps", warmup_steps)
        check_positive_int("steps_per_update", steps_per_update)
        if not scale > 0:
            raise ValueError(f"scale must be a number > 0; got {scale!r}.")
        if cooldown_steps:
            check_positive_int("cooldown_steps", cooldown_steps)
            check_positive_int("total_steps", total_steps)
            if cooldown_steps > total_steps:
                raise ValueError(
                    f"cooldown_steps ({cooldown_steps}) must be at most total_steps ({total_steps})."
                )
        self.d_model = d_model
        self.warmup_steps = warmup_steps
        self.scale = scale
        self.steps_per_update = steps_per_update
        self.total_steps = total_steps
        self.cooldown_steps = cooldown_steps

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
        rate = (self.scale * self.d_model**-0.5) * ops.minimum(
            ops.rsqrt(step_num), step_num * self.warmup_steps**-1.5
        )
        if not self.cooldown_steps:
            return rate
        remaining = float(self.total_steps) + 1.0 - step_num  # this update and the ones after it
        return rate * ops.clip(remaining / float(self.cooldown_steps), 0.0, 1.0)

    def get_config(self):
        return {
            "d_model": self.d_model,
            "warmup_steps": self.warmup_steps,
            "scale": self.scale,
            "steps_per_update": self.steps_per_update,
            "total_steps": self.total_steps,
            "cooldown_steps": self.cooldown_steps,
        }
