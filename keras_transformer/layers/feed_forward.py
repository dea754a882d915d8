"""Position-wise feed-forward network, Eq. (2), §3.3.

    FFN(x) = max(0, x W_1 + b_1) W_2 + b_2

Shape legend: (batch, length, d_model) -> (batch, length, d_ff) -> (batch, length, d_model).
"""

import keras

from keras_transformer.layers.dropout import Dropout
from keras_transformer.utils.checks import check_positive_int, check_rate
from keras_transformer.utils.registration import register


@register
class PositionwiseFeedForward(keras.layers.Layer):
    """Two linear maps with a ReLU between them, applied to every position alike.

    Args:
        d_model: input and output width (512 in the base model).
        d_ff: inner width (2048 in the base model).
        activation: the inner non-linearity; `"relu"` as in the paper.
        dropout_rate: dropout on the inner activations. 0 in the paper (later
            tensor2tensor versions use 0.1 "relu dropout").

    Call arguments:
        inputs: `(batch, length, d_model)`.
        training: enables dropout.

    Returns:
        `(batch, length, d_model)`.

    Example:
    >>> import numpy as np
    >>> PositionwiseFeedForward(d_model=8, d_ff=32)(np.ones((2, 3, 8), "float32")).shape
    TensorShape([2, 3, 8])
    """

    def __init__(self, d_model, d_ff, activation="relu", dropout_rate=0.0, **kwargs):
        super().__init__(**kwargs)
        check_positive_int("d_model", d_model)
        check_positive_int("d_ff", d_ff)
        check_rate("dropout_rate", dropout_rate)
        self.d_model = d_model
        self.d_ff = d_ff
        self.activation = activation
        self.dropout_rate = dropout_rate
        self.inner_dense = keras.layers.Dense(
            d_ff, activation=activation, dtype=self.dtype_policy, name="inner_dense"
        )
        self.inner_dropout = Dropout(dropout_rate, dtype=self.dtype_policy, name="inner_dropout")
        self.output_dense = keras.layers.Dense(d_model, dtype=self.dtype_policy, name="output_dense")

    def build(self, input_shape):
        if input_shape[-1] != self.d_model:
            raise ValueError(
                f"PositionwiseFeedForward expects inputs with last dimension "
                f"d_model={self.d_model}, got shape {tuple(input_shape)}."
            )
        self.inner_dense.build(input_shape)
        self.output_dense.build(tuple(input_shape[:-1]) + (self.d_ff,))

    def call(self, inputs, training=None):
        hidden = self.inner_dense(inputs)  # (batch, length, d_ff)
        hidden = self.inner_dropout(hidden, training=training)
        return self.output_dense(hidden)  # (batch, length, d_model)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            d_model=self.d_model,
            d_ff=self.d_ff,
            activation=self.activation,
            dropout_rate=self.dropout_rate,
        )
        return config
