"""The decoder, §3.1: N layers of masked self-attention, encoder-decoder attention
and feed-forward, each residual.

Shape legend: batch, len_tgt (target positions), len_src (source positions), d_model.
The decoder always applies the causal mask (§3.2.3): position i never sees
positions > i, whatever mask the caller passes.
"""

import keras

from keras_transformer.layers.decoding_cache import DecodingCache
from keras_transformer.layers.feed_forward import PositionwiseFeedForward
from keras_transformer.layers.masks import causal_mask, combine_masks
from keras_transformer.layers.multi_head_attention import MultiHeadAttention
from keras_transformer.layers.residual import make_norm_and_dropout, residual_block
from keras_transformer.layers.results import split_optional, with_optional
from keras_transformer.layers.stack import LayerArguments, TransformerStack
from keras_transformer.utils.registration import register


@register
class DecoderLayer(LayerArguments, keras.layers.Layer):
    """One decoder layer (§3.1): masked self-attention, cross-attention over the
    encoder output (memory), feed-forward; residual blocks as `EncoderLayer`.

    Args: as `EncoderLayer`.

    Call arguments:
        inputs: `(batch, len_tgt, d_model)`.
        memory: encoder output `(batch, len_src, d_model)`.
        self_attention_mask: bool `(batch|1, len_tgt, len_tgt)`, already causal
            (with a cache `(1, len_new, max_len)`, causal from `cache_step`).
        memory_mask: bool `(batch, 1, len_src)`, True = real source token.
        cache: for incremental decoding (inference), this layer's
            `LayerCache` instead of `memory`: `self_key`, `self_value`
            heads-first `(batch, num_heads, len_cache, depth)` (past
            keys/values) and `cross_key`, `cross_value` `(batch_src,
            num_heads, len_src, depth)` (the memory projected once per
            sentence, `Transformer.init_cache`; `batch_src` divides
            `batch`, whose consecutive rows are a sentence's beams).
        cache_step: with `cache`, the scalar int position of `inputs[:, 0]`
            in a fixed-size cache (`len_cache` = the maximum length); without
            it the cache grows (this call's positions are appended).
        cache_rows, cache_block: with `cache_step`, optional: the fields of a
            `CacheHistory`, the self-attention cache row each row reads at each
            position and the first positions read alone before that step
            (`MultiHeadAttention`); the cache is then written in place.
        return_weights: also return the attention weights.
        training: enables dropout.

    Returns:
        `(batch, len_tgt, d_model)`; then, if asked, in this order: the
        self- and cross-attention weights `(batch, num_heads, len_tgt,
        len_tgt|len_src)` (`return_weights`) and the `LayerCache` with this
        call's keys and values written (`cache`).
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

    def call(
        self,
        inputs,
        memory=None,
        self_attention_mask=None,
        memory_mask=None,
        cache=None,
        cache_step=None,
        return_weights=False,
        training=None,
        cache_rows=None,
        cache_block=None,
    ):
        _check_memory_or_cache(self.name, memory, cache)
        optional = {}  # what the attention sublayers return besides their outputs

        def self_attend(x):
            cached = {}
            if cache is not None:
                cached = {"cache": (cache.self_key, cache.self_value)}
                cached.update({"append_to_cache": True} if cache_step is None else {"cache_step": cache_step})
                if cache_rows is not None:
                    cached.update(cache_rows=cache_rows, cache_block=cache_block)
            outputs, optional["self_weights"], optional["self_cache"] = split_optional(
                self.self_attention(
                    x,
                    attention_mask=self_attention_mask,
                    return_weights=return_weights,
                    training=training,
                    **cached,
                ),
                return_weights,
                cache is not None,
            )
            return outputs

        def cross_attend(x):
            # Without a cache the memory is projected here; with one, it was projected once (init_cache).
            source = {"value": memory} if cache is None else {"cache": (cache.cross_key, cache.cross_value)}
            outputs, optional["cross_weights"], _ = split_optional(
                self.cross_attention(
                    x, attention_mask=memory_mask, return_weights=return_weights, training=training, **source
                ),
                return_weights,
                cache is not None,
            )
            return outputs

        x = self._sublayers(inputs, self_attend, cross_attend, training)
        if cache is not None:
            cache = cache._replace(self_key=optional["self_cache"][0], self_value=optional["self_cache"][1])
        return with_optional(x, optional["self_weights"], optional["cross_weights"], cache)

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
        cache: for incremental decoding (inference), a `DecodingCache`
            (`Transformer.init_cache`) instead of `memory`; `inputs` are then
            the next positions (usually one).
        cache_step: with a fixed-size cache, the scalar int position of
            `inputs[:, 0]`; without it the cache grows: `inputs` follow the
            cached positions and are appended to them.
        cache_rows, cache_block: with `cache_step`, optional: the fields of a
            `CacheHistory` (a beam's history; `DecoderLayer`).
        return_weights: also return each layer's attention weights.
        training: enables dropout.

    Returns:
        `(batch, len_tgt, d_model)` hidden states (logits come from the tied
        projection of `Transformer`); then, if asked, in this order: the lists
        of self- and cross-attention weights, one per layer
        (`return_weights`), and the `DecodingCache` with this call's keys and
        values written (`cache`).
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

    def call(
        self,
        inputs,
        memory=None,
        target_mask=None,
        memory_mask=None,
        cache=None,
        cache_step=None,
        return_weights=False,
        training=None,
        cache_rows=None,
        cache_block=None,
    ):
        _check_memory_or_cache(self.name, memory, cache)
        length = keras.ops.shape(inputs)[1]
        if cache is None:
            self_attention_mask = combine_masks(causal_mask(length), target_mask)
            x = self.embed_positions(inputs, training)
        elif cache_step is None:  # growing cache: the new positions follow the cached ones
            cache_step = keras.ops.shape(cache.self_key[0])[2]
            # One new position sees every cached one: no mask to build or apply.
            self_attention_mask = (
                None if inputs.shape[1] == 1 else causal_mask(length, cache_step + length, offset=cache_step)
            )
            x = self.embed_positions(inputs, training, offset=cache_step)
            cache_step = None
        else:  # fixed-size cache: the new positions see the written ones and themselves, causally
            max_len = keras.ops.shape(cache.self_key[0])[2]
            self_attention_mask = causal_mask(length, max_len, offset=cache_step)
            x = self.embed_positions(inputs, training, offset=cache_step)
        self_weights, cross_weights, layer_caches = [], [], []
        for i, layer in enumerate(self.stack_layers):
            x, self_w, cross_w, layer_cache = split_optional(
                layer(
                    x,
                    memory,
                    self_attention_mask,
                    memory_mask,
                    cache=None if cache is None else cache.layer(i),
                    cache_step=cache_step,
                    return_weights=return_weights,
                    training=training,
                    **({} if cache_rows is None else {"cache_rows": cache_rows, "cache_block": cache_block}),
                ),
                return_weights,
                return_weights,
                cache is not None,
            )
            self_weights.append(self_w)
            cross_weights.append(cross_w)
            layer_caches.append(layer_cache)
        return with_optional(
            self.normalize_output(x),
            self_weights if return_weights else None,
            cross_weights if return_weights else None,
            None if cache is None else DecodingCache.from_layers(layer_caches),
        )


def _check_memory_or_cache(name, memory, cache):
    if cache is None and memory is None:
        raise ValueError(f"{name}: pass the encoder output (memory), or a cache for incremental decoding.")
    if cache is not None and memory is not None:
        raise ValueError(
            f"{name}: with a cache, cross-attention reads the memory projected in the cache; do not "
            "also pass memory."
        )
