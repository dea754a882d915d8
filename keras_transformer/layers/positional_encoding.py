"""Sinusoidal positional encoding, §3.5.

    PE(pos, 2i)   = sin(pos / 10000^(2i / d_model))
    PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model))

Sines on even and cosines on odd dimensions, interleaved exactly as written
(the TensorFlow tutorial concatenates them instead, a different table).
"""

import keras
import numpy as np
from keras import ops

from keras_transformer.utils.checks import check_positive_int
from keras_transformer.utils.registration import register


def sinusoidal_table(length, d_model, base=10000.0):
    """The §3.5 table as a float32 NumPy array `(length, d_model)`, computed in float64."""
    check_positive_int("length", length)
    check_positive_int("d_model", d_model)
    positions = np.arange(length, dtype=np.float64)[:, None]  # (length, 1)
    pair_index = np.arange(d_model, dtype=np.float64)[None, :] // 2  # i of 2i and 2i+1
    angles = positions / np.power(base, 2.0 * pair_index / d_model)  # (length, d_model)
    table = np.where(np.arange(d_model) % 2 == 0, np.sin(angles), np.cos(angles))
    return table.astype(np.float32)


@register
class SinusoidalPositionalEncoding(keras.layers.Layer):
    """Adds the §3.5 sinusoidal table to a sequence of embeddings.

    The table is a constant (not a weight), computed once at build time for
    `max_length` positions.

    Args:
        max_length: number of positions the table covers.
        base: the wavelength base (10000 in the paper).

    Call arguments:
        inputs: `(batch, length, d_model)`, length <= max_length - offset.
        offset: scalar int, absolute position of `inputs[:, 0]` (incremental
            decoding feeds one position at a time).

    Returns:
        `(batch, length, d_model)`: `inputs + table[offset : offset + length]`.

    Example:
    >>> import numpy as np
    >>> out = SinusoidalPositionalEncoding(max_length=4)(np.zeros((1, 2, 4), "float32"))
    >>> [round(float(v), 3) for v in out[0, 1]]  # position 1: sin(1), cos(1), sin(.01), cos(.01)
    [0.841, 0.54, 0.01, 1.0]
    """

    def __init__(self, max_length, base=10000.0, **kwargs):
        super().__init__(**kwargs)
        check_positive_int("max_length", max_length)
        self.max_length = max_length
        self.base = base

    def build(self, input_shape):
        # A NumPy array, made a constant of whichever graph calls the layer: a
        # tensor made here would belong to the graph that happened to build
        # the layer (e.g. the first traced train step) and be out of scope in
        # every other.
        self.table = sinusoidal_table(self.max_length, input_shape[-1], self.base)  # (max_length, d_model)

    def call(self, inputs, offset=0):
        length = ops.shape(inputs)[1]
        table = ops.convert_to_tensor(self.table)
        positions = ops.slice(table, (offset, 0), (length, self.table.shape[1]))
        return inputs + ops.cast(positions, inputs.dtype)[None]

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(max_length=self.max_length, base=self.base)
        return config
