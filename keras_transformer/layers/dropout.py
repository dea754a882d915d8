"""Dropout (§5.4, "Residual Dropout") with a random number generator that XLA compiles well.

The paper drops units of every sublayer output and of the embedding sums with
probability P_drop; the kept units are scaled by 1 / (1 - P_drop) ("inverted"
dropout, so inference needs no rescaling). That is `keras.layers.Dropout`; this
layer differs only in where its random bits come from.

Why not `keras.layers.Dropout`: on TensorFlow it calls
`tf.nn.experimental.stateless_dropout`, whose `"auto_select"` algorithm XLA on
CPU lowers to a slow generic expansion. Measured on this project's 2-core CPU
(TF 2.21, one `(256, 16, 512)` float32 tensor, `jit_compile=True`):
`auto_select` 82-850 ms, `"philox"` 26 ms, `"threefry"` 5.4 ms (JAX's default
generator, which XLA compiles natively); without XLA TensorFlow's CPU kernel has
Philox only (11 ms). In a `base`-width training step with XLA, the twelve
dropouts took ~14% of the step before this layer. So: Threefry inside an XLA
computation, Philox outside it.

Shape legend: any `(...)`; the output has the input's shape and dtype.
"""

import keras
from keras import ops

from keras_transformer.utils.checks import check_rate
from keras_transformer.utils.registration import register

_INT32_MAX = 2**31 - 1


def in_xla_computation():
    """True while TensorFlow traces a `jit_compile=True` function (XLA)."""
    try:
        import tensorflow as tf
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - TensorFlow-less installs use Keras's dropout
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def dropout(inputs, rate, seed_generator):
    """Inverted dropout: zeros with probability `rate`, kept units scaled by `1 / (1 - rate)`.

    Args:
        inputs: float tensor `(...)`.
        rate: drop probability in [0, 1).
        seed_generator: a `keras.random.SeedGenerator`; each call draws a new seed.

    Returns:
        a tensor like `inputs`. The keep decisions come from float32 uniforms
        (also for half-precision inputs, whose own uniforms would round `rate`).
    """
    if not rate:
        return inputs
    if keras.backend.backend() != "tensorflow":
        return keras.random.dropout(inputs, rate, seed=seed_generator)
    import tensorflow as tf

    seed = ops.cast(ops.mod(seed_generator.next(), _INT32_MAX - 1), "int32")  # stateless ops want int32
    algorithm = "threefry" if in_xla_computation() else "philox"
    uniform = tf.random.stateless_uniform(ops.shape(inputs), seed=seed, alg=algorithm)
    scaled = inputs * ops.cast(1.0 / (1.0 - rate), inputs.dtype)
    return ops.where(uniform >= rate, scaled, ops.zeros_like(scaled))


@register
class Dropout(keras.layers.Layer):
    """`keras.layers.Dropout` (inverted dropout) with an XLA-friendly generator.

    Same arguments, behaviour and checkpoint layout as `keras.layers.Dropout`
    (its only state, the seed generator, is not saved); see the module
    docstring for the generator.

    Args:
        rate: drop probability in [0, 1).
        seed: optional int seed of this layer's `keras.random.SeedGenerator`.

    Call arguments:
        inputs: float tensor `(...)`.
        training: drop only when True.

    Returns:
        a tensor like `inputs`.

    Example:
    >>> import numpy as np
    >>> layer = Dropout(0.5, seed=0)
    >>> out = layer(np.ones((1, 1000), "float32"), training=True).numpy()
    >>> sorted(set(out.ravel().tolist())), bool(0.4 < (out == 0).mean() < 0.6)
    ([0.0, 2.0], True)
    """

    def __init__(self, rate, seed=None, **kwargs):
        super().__init__(**kwargs)
        check_rate("rate", rate)
        self.rate = rate
        self.seed = seed
        if rate > 0:
            self.seed_generator = keras.random.SeedGenerator(seed)
        self.supports_masking = True
        self.built = True

    def call(self, inputs, training=False):
        if not training or not self.rate:
            return inputs
        return dropout(inputs, self.rate, self.seed_generator)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(rate=self.rate, seed=self.seed)
        return config
