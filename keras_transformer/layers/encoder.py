"""The encoder, §3.1: a stack of N identical layers of self-attention + feed-forward.

Shape legend: batch, len_src (source positions), d_model.
"""

import keras

from keras_transformer.layers.feed_forward import PositionwiseFeedForward
from keras_transformer.layers.multi_head_attention import MultiHeadAttention
from keras_transformer.layers.residual import make_norm_and_dropout, residual_block
from keras_transformer.layers.results import split_optional, with_optional
from keras_transformer.layers.stack import LayerArguments, TransformerStack
from keras_transformer.utils.registration import register


@register
class EncoderLayer(LayerArguments, keras.layers.Layer):
    """One encoder layer: self-attention and feed-forward sublayers, each residual (§3.1).

    Args:
        d_model, num_heads, d_ff: sizes (512, 8, 2048 in the base model).
        dropout_rate: P_drop on each sublayer output before the residual sum (§5.4).
        attention_dropout_rate: dropout on attention weights (0 in the paper).
        activation_dropout_rate: dropout inside the feed-forward (0 in the paper).
        layer_norm_epsilon: 1e-6 as in the paper's code (Keras defaults to 1e-3).
        norm_first: pre-norm residual blocks instead of the paper's post-norm.
        attention_mode: `"batched"` or `"per_head"` (see `MultiHeadAttention`).

    Call arguments:
        inputs: `(batch, len_src, d_model)`.
        attention_mask: bool `(batch, 1, len_src)` (a `padding_mask`) or
            `(batch, len_src, len_src)`, True = may attend.
        return_weights: also return the self-attention weights.
        training: enables dropout.

    Returns:
        `(batch, len_src, d_model)`; with `return_weights`, `(outputs,
        weights)`, weights `(batch, num_heads, len_src, len_src)` float32.
    """

    def __init__(
        self,
        d_model,
        num_heads,
        d_ff,
        dropout_rate=0.1,
        attention_dropout_rate=0.0,
        activation_dropout_rate=0.0,
        layer_norm_epsilon=1e-6,
        norm_first=False,
        attention_mode="batched",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.store_layer_arguments(locals())
        self.self_attention = MultiHeadAttention(
            num_heads,
            d_model,
            attention_dropout_rate,
            mode=attention_mode,
            dtype=self.dtype_policy,
            name="self_attention",
        )
        self.feed_forward = PositionwiseFeedForward(
            d_model,
            d_ff,
            dropout_rate=activation_dropout_rate,
            dtype=self.dtype_policy,
            name="feed_forward",
        )
        make_norm_and_dropout(self, "self_attention", dropout_rate, layer_norm_epsilon)
        make_norm_and_dropout(self, "feed_forward", dropout_rate, layer_norm_epsilon)

    def build(self, inputs_shape):
        self.self_attention.build(inputs_shape, inputs_shape)
        self.feed_forward.build(inputs_shape)
        self.self_attention_norm.build(inputs_shape)
        self.feed_forward_norm.build(inputs_shape)

    def call(self, inputs, attention_mask=None, return_weights=False, training=None):
        weights = []

        def attend(x):
            outputs, weights_or_none = split_optional(
                self.self_attention(
                    x, attention_mask=attention_mask, return_weights=return_weights, training=training
                ),
                return_weights,
            )
            weights.append(weights_or_none)
            return outputs

        x = residual_block(
            inputs, attend, self.self_attention_norm, self.self_attention_dropout, self.norm_first, training
        )
        x = residual_block(
            x,
            lambda h: self.feed_forward(h, training=training),
            self.feed_forward_norm,
            self.feed_forward_dropout,
            self.norm_first,
            training,
        )
        return with_optional(x, weights[0])


@register
class Encoder(TransformerStack):
    """The encoder stack (§3.1) over already embedded source tokens.

    Adds the positional encoding, applies embedding dropout (§5.4), then
    `num_layers` `EncoderLayer`s; with `norm_first` a final layer norm.

    Args:
        num_layers: N (6 in the paper).
        max_length: positions covered by the positional encoding.
        other arguments: as `EncoderLayer`.

    Call arguments:
        inputs: scaled token embeddings `(batch, len_src, d_model)`.
        attention_mask: bool `(batch, 1, len_src)`, True = real token.
        return_weights: also return each layer's self-attention weights.
        training: enables dropout.

    Returns:
        memory `(batch, len_src, d_model)`; with `return_weights`, `(memory,
        [weights (batch, num_heads, len_src, len_src) of each layer])`.
    """

    layer_class = EncoderLayer

    def __init__(
        self,
        num_layers,
        d_model,
        num_heads,
        d_ff,
        max_length,
        dropout_rate=0.1,
        attention_dropout_rate=0.0,
        activation_dropout_rate=0.0,
        layer_norm_epsilon=1e-6,
        norm_first=False,
        attention_mode="batched",
        **kwargs,
    ):
        arguments = dict(locals())
        super().__init__(num_layers, max_length, arguments, **kwargs)

    def build(self, inputs_shape):
        super().build(inputs_shape)

    def call(self, inputs, attention_mask=None, return_weights=False, training=None):
        x = self.embed_positions(inputs, training)
        all_weights = []
        for layer in self.stack_layers:
            x, weights = split_optional(
                layer(x, attention_mask, return_weights=return_weights, training=training), return_weights
            )
            all_weights.append(weights)
        return with_optional(self.normalize_output(x), all_weights if return_weights else None)
