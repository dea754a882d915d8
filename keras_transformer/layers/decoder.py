"""The decoder, §3.1: N layers of masked self-attention, encoder-decoder attention
and feed-forward, each residual.

Shape legend: batch, len_tgt (target positions), len_src (source positions), d_model.
The decoder always applies the causal mask (§3.2.3): position i never sees
positions > i, whatever mask the caller passes.
"""

import keras

from keras_transformer.layers.feed_forward import PositionwiseFeedForward
from keras_transformer.layers.masks import causal_mask, combine_masks
from keras_transformer.layers.multi_head_attention import MultiHeadAttention
from keras_transformer.layers.residual import make_norm_and_dropout, residual_block
from keras_transformer.layers.stack import LayerArguments, TransformerStack
from keras_transformer.utils.checks import register


@register
class DecoderLayer(LayerArguments, keras.layers.Layer):
    """One decoder layer (§3.1): masked self-attention, cross-attention over the
    encoder output (memory), feed-forward; residual blocks as `EncoderLayer`.

    Args: as `EncoderLayer`.

    Call arguments:
        inputs: `(batch, len_tgt, d_model)`.
        memory: encoder output `(batch, len_src, d_model)`.
        self_attention_mask: bool `(batch|1, len_tgt, len_tgt)`, already causal.
        memory_mask: bool `(batch, 1, len_src)`, True = real source token.
        training: enables dropout.

    Returns:
        `(batch, len_tgt, d_model)`; `call_with_weights` also returns the
        self- and cross-attention weights `(batch, num_heads, len_tgt, len_tgt|len_src)`.
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
        for name in ("self_attention", "cross_attention"):
            setattr(
                self,
                name,
                MultiHeadAttention(
                    num_heads,
                    d_model,
                    attention_dropout_rate,
                    mode=attention_mode,
                    dtype=self.dtype_policy,
                    name=name,
                ),
            )
        self.feed_forward = PositionwiseFeedForward(
            d_model,
            d_ff,
            dropout_rate=activation_dropout_rate,
            dtype=self.dtype_policy,
            name="feed_forward",
        )
        for prefix in ("self_attention", "cross_attention", "feed_forward"):
            make_norm_and_dropout(self, prefix, dropout_rate, layer_norm_epsilon)

    def build(self, inputs_shape, memory_shape=None):
        memory_shape = inputs_shape if memory_shape is None else memory_shape
        self.self_attention.build(inputs_shape, inputs_shape)
        self.cross_attention.build(inputs_shape, memory_shape)
        self.feed_forward.build(inputs_shape)
        for norm in (self.self_attention_norm, self.cross_attention_norm, self.feed_forward_norm):
            norm.build(inputs_shape)

    def call(self, inputs, memory, self_attention_mask=None, memory_mask=None, training=None):
        return self.call_with_weights(inputs, memory, self_attention_mask, memory_mask, training)[0]

    def call_with_weights(self, inputs, memory, self_attention_mask=None, memory_mask=None, training=None):
        """Returns `(outputs, self_attention_weights, cross_attention_weights)`."""
        if not self.built:
            self.build(inputs.shape, memory.shape)
        weights = {}

        def self_attend(x):
            outputs, weights["self"] = self.self_attention.call_with_weights(
                x, x, attention_mask=self_attention_mask, training=training
            )
            return outputs

        def cross_attend(x):
            outputs, weights["cross"] = self.cross_attention.call_with_weights(
                x, memory, attention_mask=memory_mask, training=training
            )
            return outputs

        x = self._sublayers(inputs, self_attend, cross_attend, training)
        return x, weights["self"], weights["cross"]

    def call_with_cache(self, inputs, cache, step, self_attention_mask, memory_mask=None):
        """Incremental decoding of the positions `step, step + 1, ...` (inference only).

        Args:
            inputs: `(batch, len_new, d_model)`.
            cache: this layer's `LayerCache`: `self_key`, `self_value`
                `(batch, max_len, num_heads, depth)` (past keys/values) and
                `cross_key`, `cross_value` `(batch, len_src, num_heads,
                depth)` (the memory projected once).
            step: scalar int position of `inputs[:, 0]`.
            self_attention_mask: bool `(1, len_new, max_len)`, causal from `step`.
            memory_mask: bool `(batch, 1, len_src)`.

        Returns:
            `(outputs (batch, len_new, d_model), self_key, self_value)`.
        """
        updated = {}

        def self_attend(x):
            outputs, updated["key"], updated["value"] = self.self_attention.call_with_cache(
                x, cache.self_key, cache.self_value, step, self_attention_mask
            )
            return outputs

        def cross_attend(x):
            query = self.cross_attention.project_heads(x, "query")
            return self.cross_attention.attend_heads(query, cache.cross_key, cache.cross_value, memory_mask)[
                0
            ]

        x = self._sublayers(inputs, self_attend, cross_attend, training=False)
        return x, updated["key"], updated["value"]

    def _sublayers(self, inputs, self_attend, cross_attend, training):
        x = residual_block(
            inputs,
            self_attend,
            self.self_attention_norm,
            self.self_attention_dropout,
            self.norm_first,
            training,
        )
        x = residual_block(
            x,
            cross_attend,
            self.cross_attention_norm,
            self.cross_attention_dropout,
            self.norm_first,
            training,
        )
        return residual_block(
            x,
            lambda h: self.feed_forward(h, training=training),
            self.feed_forward_norm,
            self.feed_forward_dropout,
            self.norm_first,
            training,
        )

    def compute_output_shape(self, inputs_shape, memory_shape=None):
        return tuple(inputs_shape)


@register
class Decoder(TransformerStack):
    """The decoder stack (§3.1) over already embedded, right-shifted target tokens.

    Adds the positional encoding, applies embedding dropout (§5.4), then
    `num_layers` `DecoderLayer`s; with `norm_first` a final layer norm. The
    causal mask is always applied.

    Args: as `Encoder`.

    Call arguments:
        inputs: scaled target embeddings `(batch, len_tgt, d_model)`.
        memory: encoder output `(batch, len_src, d_model)`.
        target_mask: optional bool `(batch, 1, len_tgt)`, True = real target
            token; combined with the causal mask.
        memory_mask: bool `(batch, 1, len_src)`, True = real source token.
        training: enables dropout.

    Returns:
        `(batch, len_tgt, d_model)` hidden states (logits come from the tied
        projection of `Transformer`).
    """

    layer_class = DecoderLayer

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

    def build(self, inputs_shape, memory_shape=None):
        super().build(inputs_shape, inputs_shape if memory_shape is None else memory_shape)

    def call(self, inputs, memory, target_mask=None, memory_mask=None, training=None):
        return self.call_with_weights(inputs, memory, target_mask, memory_mask, training)[0]

    def call_with_weights(self, inputs, memory, target_mask=None, memory_mask=None, training=None):
        """Returns `(outputs, [self-attention weights], [cross-attention weights])`, one per layer."""
        if not self.built:
            self.build(inputs.shape, memory.shape)
        length = keras.ops.shape(inputs)[1]
        self_attention_mask = combine_masks(causal_mask(length), target_mask)
        x = self.embed_positions(inputs, training)
        self_weights, cross_weights = [], []
        for layer in self.stack_layers:
            x, self_w, cross_w = layer.call_with_weights(
                x, memory, self_attention_mask, memory_mask, training=training
            )
            self_weights.append(self_w)
            cross_weights.append(cross_w)
        return self.normalize_output(x), self_weights, cross_weights

    def call_with_cache(self, inputs, cache, step, memory_mask=None):
        """Incremental decoding: embedded target positions `step, ...` -> hidden states.

        Args:
            inputs: scaled target embeddings `(batch, len_new, d_model)` of the
                positions `step, step + 1, ...` (usually `len_new == 1`).
            cache: a `DecodingCache` (`Transformer.init_cache`).
            step: scalar int.
            memory_mask: bool `(batch, 1, len_src)`.

        Returns:
            `(hidden (batch, len_new, d_model), cache)` with this step's keys
            and values written into the self-attention caches.
        """
        max_len = keras.ops.shape(cache.self_key[0])[1]
        self_attention_mask = causal_mask(keras.ops.shape(inputs)[1], max_len, offset=step)
        x = self.embed_positions(inputs, training=False, offset=step)
        keys, values = [], []
        for i, layer in enumerate(self.stack_layers):
            x, key, value = layer.call_with_cache(x, cache.layer(i), step, self_attention_mask, memory_mask)
            keys.append(key)
            values.append(value)
        return self.normalize_output(x), cache.with_self_attention(keys, values)
