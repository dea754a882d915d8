"""The residual connection around every sublayer, §3.1 and §5.4.

Post-norm (the paper):  LayerNorm(x + Dropout(Sublayer(x)))
Pre-norm (option):      x + Dropout(Sublayer(LayerNorm(x)))
"""

import keras

from keras_transformer.layers.dropout import Dropout
from keras_transformer.utils.checks import check_rate


def residual_block(inputs, sublayer, norm, dropout, norm_first, training=None):
    """Applies `sublayer` with its residual connection, dropout and layer norm.

    Args:
        inputs: `(batch, length, d_model)`.
        sublayer: callable `(batch, length, d_model) -> (batch, length, d_model)`.
        norm: the `LayerNormalization` of this sublayer.
        dropout: the `Dropout` on the sublayer output (P_drop of §5.4).
        norm_first: pre-norm instead of the paper's post-norm.
        training: enables dropout.
    """
    if norm_first:
        return inputs + dropout(sublayer(norm(inputs)), training=training)
    return norm(inputs + dropout(sublayer(inputs), training=training))


def make_norm_and_dropout(layer, prefix, dropout_rate, epsilon):
    """Creates `<prefix>_norm` and `<prefix>_dropout` on `layer` (stable checkpoint paths)."""
    check_rate("dropout_rate", dropout_rate)
    norm = keras.layers.LayerNormalization(epsilon=epsilon, dtype=layer.dtype_policy, name=f"{prefix}_norm")
    dropout = Dropout(dropout_rate, dtype=layer.dtype_policy, name=f"{prefix}_dropout")
    setattr(layer, f"{prefix}_norm", norm)
    setattr(layer, f"{prefix}_dropout", dropout)
