"""Token embeddings scaled by sqrt(d_model) and the tied pre-softmax projection, §3.4.

"We share the same weight matrix between the two embedding layers and the
pre-softmax linear transformation [...] In the embedding layers, we multiply
those weights by sqrt(d_model)."

Shape legend: ids (batch, length) int; embeddings (batch, length, d_model);
logits (batch, length, vocab_size) float32.
"""

import math

import keras
from keras import ops

from keras_transformer.layers.portable_ops import gather_rows
from keras_transformer.utils.checks import check_positive_int
from keras_transformer.utils.registration import register


@register
class TokenEmbedding(keras.layers.Layer):
    """A `(vocab_size, d_model)` matrix used to embed ids and, tied, to project to logits.

    Args:
        vocab_size: number of token ids.
        d_model: embedding width.
        scale: multiply embeddings by sqrt(d_model) (§3.4).
        embeddings_initializer: defaults to N(0, d_model^-0.5), so that scaled
            embeddings have unit variance, the usual choice for tied weights.

    Call arguments:
        ids: int `(batch, length)`.

    Returns:
        `(batch, length, d_model)`. `project(hidden)` returns float32 logits
        `(batch, length, vocab_size)` computed as `hidden @ embeddings^T` in
        float32 (no bias: the paper shares the matrix, nothing else).

    Example:
    >>> import numpy as np
    >>> emb = TokenEmbedding(vocab_size=10, d_model=4)
    >>> emb(np.array([[1, 2]])).shape, emb.project(np.ones((1, 2, 4), "float32")).shape
    (TensorShape([1, 2, 4]), TensorShape([1, 2, 10]))
    """

    def __init__(self, vocab_size, d_model, scale=True, embeddings_initializer=None, **kwargs):
        super().__init__(**kwargs)
        check_positive_int("vocab_size", vocab_size)
        check_positive_int("d_model", d_model)
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.scale = scale
        self.embeddings_initializer = keras.initializers.get(
            embeddings_initializer or keras.initializers.RandomNormal(mean=0.0, stddev=d_model**-0.5)
        )

    def build(self, input_shape=None):
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.vocab_size, self.d_model),
            initializer=self.embeddings_initializer,
            autocast=False,  # stays float32 for the float32 logits of `project`
        )

    def call(self, ids):
        outputs = gather_rows(self.embeddings, ops.cast(ids, "int32"))
        outputs = ops.cast(outputs, self.compute_dtype)
        if self.scale:
            outputs = outputs * ops.cast(math.sqrt(self.d_model), outputs.dtype)
        return outputs

    def project(self, hidden):
        """Pre-softmax linear map with the shared matrix: `(..., d_model)` -> float32 `(..., vocab_size)`."""
        if not self.built:
            self.build()
        return ops.matmul(ops.cast(hidden, "float32"), ops.transpose(self.embeddings))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.d_model,)

    def get_config(self):
        config = super().get_config()
        config.update(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            scale=self.scale,
            embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer),
        )
        return config
