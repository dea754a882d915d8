"""Multi-head attention, §3.2.2, with a batched and a per-head compute mode.

    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)

Shape legend: batch, len_q / len_k (query / key positions), d_model,
num_heads, depth = d_model // num_heads (the paper's d_k = d_v).

Weights (the checkpoint format; same order and shapes as
`keras.layers.MultiHeadAttention(num_heads, key_dim=depth)`):
    query_kernel (d_model, num_heads, depth)   query_bias (num_heads, depth)
    key_kernel   (d_model, num_heads, depth)   key_bias   (num_heads, depth)
    value_kernel (d_model, num_heads, depth)   value_bias (num_heads, depth)
    output_kernel (num_heads, depth, d_model)  output_bias (d_model,)

`W_i^Q` of the paper is `query_kernel[:, i, :]`.
"""

import keras
from keras import ops

from keras_transformer.layers.attention import scaled_dot_product_attention
from keras_transformer.layers.decoding_cache import CacheHistory
from keras_transformer.layers.dropout import Dropout
from keras_transformer.layers.portable_ops import rows_by_position, write_at, write_in_place
from keras_transformer.layers.results import with_optional
from keras_transformer.utils.checks import check_choice, check_positive_int, check_rate
from keras_transformer.utils.registration import register

ATTENTION_MODES = ("batched", "per_head")


@register
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention (§3.2.2) over one set of weights, in two modes.

    `mode="batched"` projects all heads with one matrix product per projection
    and attends with one batched product; `mode="per_head"` loops over the heads
    and computes each `head_i` from kernel slices, literally as the paper writes
    it. The modes share the variables, so a model trained in one runs in the
    other; `mode` can be changed on a built layer.

    Args:
        num_heads: number of heads h.
        d_model: model width; must be divisible by `num_heads`.
        dropout_rate: dropout on the attention weights (0 in the paper, which
            only drops sublayer outputs; see `EncoderLayer`).
        mode: `"batched"` or `"per_head"`.
        use_bias: add biases to the four projections (as Keras does).
        kernel_initializer: initializer of the projection matrices, applied as
            to a `(d_model, d_model)` matrix (so Glorot sees the true fans).
        bias_initializer: initializer of the biases.

    Call arguments:
        query: `(batch, len_q, d_model)`.
        value: `(batch, len_k, d_model)`; defaults to `query` (self-attention).
        key: `(batch, len_k, d_model)`; defaults to `value`.
        attention_mask: bool `(batch, len_q, len_k)` or broadcastable,
            True = may attend (see `keras_transformer.layers.masks`).
        cache: projected `(keys, values)`, each heads-first `(batch_k,
            num_heads, len_k, depth)`, for incremental decoding (§3.2.3 at
            inference). Three uses:
            - read-only (neither `cache_step` nor `append_to_cache`): the
              heads attend over it as it is (cross-attention over the memory
              projected once; `value` and `key` are not passed). `batch_k`
              may divide `batch`: the `batch // batch_k` consecutive query
              rows of each cache row (the beams of a sentence) are folded
              into its query axis, so the memory is read once per sentence;
              the mask is then `(batch_k, 1, len_k)`.
            - `cache_step` (fixed-size cache): this call's keys and values
              (`len_new` positions) are written into it from that position,
              then the heads attend over the whole cache; the mask must hide
              the positions not written yet. Static shapes: XLA, JAX.
            - `append_to_cache=True` (growing cache): they are appended on
              the position axis, and the heads attend over the `len_k +
              len_new` positions. Each step touches the filled positions only.
        cache_step: scalar int, where this call's keys and values go.
        cache_rows: with `cache_step`, int `(batch, len_k)`: the cache row
            each query row reads at each position (a beam's history: the
            cache is then written in place and never reordered; the fields of
            a `CacheHistory`); None: row r reads row r.
        cache_block: with `cache_rows`, None or a Python int: a step before
            that position reads the first `cache_block` positions alone.
        append_to_cache: append this call's keys and values to `cache`.
        return_weights: also return the attention weights.
        training: enables attention dropout.

    Returns:
        `outputs (batch, len_q, d_model)`; then, in this order, the
        attention weights `(batch, num_heads, len_q, len_k)` in float32 if
        `return_weights`, and the `(keys, values)` cache if `cache` is given.

    Example:
    >>> import numpy as np
    >>> mha = MultiHeadAttention(num_heads=2, d_model=8)
    >>> mha(np.ones((1, 3, 8), "float32"), np.ones((1, 5, 8), "float32")).shape
    TensorShape([1, 3, 8])
    """

    def __init__(
        self,
        num_heads,
        d_model,
        dropout_rate=0.0,
        mode="batched",
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_positive_int("num_heads", num_heads)
        check_positive_int("d_model", d_model)
        if d_model % num_heads:
            raise ValueError(
                f"d_model={d_model} must be divisible by num_heads={num_heads} "
                f"(each head gets d_model // num_heads dimensions); allowed "
                f"num_heads for d_model={d_model}: "
                f"{[h for h in range(1, min(d_model, 64) + 1) if d_model % h == 0]}."
            )
        check_rate("dropout_rate", dropout_rate)
        self.num_heads = num_heads
        self.d_model = d_model
        self.depth = d_model // num_heads
        self.dropout_rate = dropout_rate
        self.mode = mode
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.attention_dropout = Dropout(dropout_rate, dtype=self.dtype_policy, name="attention_dropout")

    @property
    def mode(self):
        return self._mode

    @mode.setter
    def mode(self, value):
        check_choice("mode", value, ATTENTION_MODES)
        self._mode = value

    def build(self, query_shape, value_shape=None, key_shape=None):
        for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            if shape is not None and shape[-1] is not None and shape[-1] != self.d_model:
                raise ValueError(
                    f"MultiHeadAttention({self.name}) expects {name} with last "
                    f"dimension d_model={self.d_model}, got shape {tuple(shape)}."
                )
        heads_shape = (self.d_model, self.num_heads, self.depth)
        for projection in ("query", "key", "value"):
            setattr(self, f"{projection}_kernel", self._add_kernel(f"{projection}_kernel", heads_shape))
            setattr(self, f"{projection}_bias", self._add_bias(f"{projection}_bias", heads_shape[1:]))
        self.output_kernel = self._add_kernel("output_kernel", (self.num_heads, self.depth, self.d_model))
        self.output_bias = self._add_bias("output_bias", (self.d_model,))

    def _add_kernel(self, name, shape):
        def initializer(shape, dtype=None):
            matrix = self.kernel_initializer((self.d_model, self.d_model), dtype=dtype)
            return ops.reshape(matrix, shape)

        return self.add_weight(name=name, shape=shape, initializer=initializer)

    def _add_bias(self, name, shape):
        if not self.use_bias:
            return None
        return self.add_weight(name=name, shape=shape, initializer=self.bias_initializer)

    def call(
        self,
        query,
        value=None,
        key=None,
        attention_mask=None,
        cache=None,
        cache_step=None,
        append_to_cache=False,
        return_weights=False,
        training=None,
        cache_rows=None,
        cache_block=None,
    ):
        updates_cache = cache_step is not None or append_to_cache
        if cache_rows is not None and (cache_step is None or return_weights):
            raise ValueError(
                f"MultiHeadAttention({self.name}): cache_rows is for decoding with a fixed-size "
                "cache (cache_step), without return_weights."
            )
        if cache_step is not None and append_to_cache:
            raise ValueError(
                f"MultiHeadAttention({self.name}): pass cache_step (write into a fixed-size cache) "
                "or append_to_cache=True (grow the cache), not both."
            )
        if updates_cache and cache is None:
            raise ValueError(f"MultiHeadAttention({self.name}): cache_step/append_to_cache need a cache.")
        fold = False
        if cache is not None and not updates_cache:  # keys and values projected once (cross-attention)
            if value is not None or key is not None:
                raise ValueError(
                    f"MultiHeadAttention({self.name}): with a cache and no cache_step the keys and "
                    "values come from the cache; do not pass value or key (pass cache_step to write "
                    "the projections of value into the cache instead)."
                )
            keys, values = self._check_cache(cache)
            query, fold = self.project_heads(query, "query"), True
        elif value is None and key is None:  # self-attention: one fused Q/K/V product
            query, keys, values = self.project_self_attention(query)
        else:
            value = query if value is None else value
            query = self.project_heads(query, "query")
            keys, values = self.project_key_value(value, key)
        if updates_cache:
            key_cache, value_cache = self._check_cache(cache)
            keys, values = (ops.cast(t, key_cache.dtype) for t in (keys, values))
            if append_to_cache:  # growing cache: one more position per step
                keys = ops.concatenate([key_cache, keys], axis=2)
                values = ops.concatenate([value_cache, values], axis=2)
            elif cache_rows is None:  # fixed-size cache
                keys = write_at(key_cache, keys, cache_step, axis=2)
                values = write_at(value_cache, values, cache_step, axis=2)
            else:  # fixed-size cache, never reordered: each row reads its history's rows
                keys = write_in_place(key_cache, keys, cache_step)
                values = write_in_place(value_cache, values, cache_step)
                history = CacheHistory(cache_rows, cache_block)
                outputs = self._attend_history(query, keys, values, attention_mask, cache_step, history)
                return with_optional(outputs, None, (keys, values))
        outputs, weights = self.attend_heads(
            query, keys, values, attention_mask, training, return_weights, fold_queries=fold
        )
        return with_optional(
            outputs, weights if return_weights else None, None if cache is None else (keys, values)
        )

    def _attend_history(self, query, keys, values, attention_mask, step, history):
        """`attend_heads` over the written cache `keys`, `values` `(rows, num_heads, len_cache,
        depth)` as each row's `history` (a `CacheHistory`) reads it: the first `history.block`
        positions alone before that step (a `cond` that only reads the cache: it is written,
        in place, before it), else all."""

        def attend(length):
            rows = history.rows[:, :length]
            mask = None if attention_mask is None else attention_mask[..., :length]
            read = (rows_by_position(t, rows) for t in (keys, values))
            return self.attend_heads(query, *read, mask)[0]

        length = keys.shape[2]
        if history.block is None or (length is not None and history.block >= length):
            return attend(ops.shape(keys)[2])
        return ops.cond(step < history.block, lambda: attend(history.block), lambda: attend(length))

    def _check_cache(self, cache):
        if not isinstance(cache, (tuple, list)) or len(cache) != 2:
            raise ValueError(
                f"MultiHeadAttention({self.name}) expects cache=(keys, values), each "
                f"(batch, num_heads={self.num_heads}, len_k, depth={self.depth}); got {type(cache).__name__}."
            )
        return cache

    def project_heads(self, inputs, projection):
        """`(batch, len, d_model)` -> `(batch, len, num_heads, depth)`, for "query"|"key"|"value".

        Batched: one `(d_model, num_heads * depth)` matrix product (on
        TensorFlow ~2x faster than the equivalent einsum without XLA). Per
        head: `inputs @ W_i` for each head i, stacked.
        """
        return self._project(inputs, (projection,))[0]

    def project_key_value(self, value, key=None):
        """Keys and values heads-first `(batch, num_heads, len_k, depth)` from `value` (and `key`,
        default `value`) `(batch, len_k, d_model)`; one fused K/V product when `key` is `value`."""
        if key is None or key is value:
            keys, values = self._project(value, ("key", "value"))
        else:
            keys, values = self.project_heads(key, "key"), self.project_heads(value, "value")
        return _heads_first(keys), _heads_first(values)

    def project_self_attention(self, inputs):
        """Queries `(batch, len, num_heads, depth)` and heads-first keys and values `(batch,
        num_heads, len, depth)` of `inputs`, with one fused Q/K/V matrix product (batched mode)."""
        query, keys, values = self._project(inputs, ("query", "key", "value"))
        return query, _heads_first(keys), _heads_first(values)

    def _project(self, inputs, projections):
        """`inputs` `(batch, len, d_model)` through each of `projections`, each `(batch, len,
        num_heads, depth)`; batched mode computes them with one matrix product of the kernels
        side by side (the same sums per output column)."""
        if not self.built:  # called before the layer (e.g. to fill a cache)
            self.build(inputs.shape)
        kernels = [self._weight(f"{name}_kernel") for name in projections]
        biases = [self._weight(f"{name}_bias") for name in projections]
        if self.mode == "per_head":
            return [
                ops.stack(
                    [
                        ops.matmul(inputs, kernel[:, i, :]) + (0 if bias is None else bias[i])
                        for i in range(self.num_heads)
                    ],
                    axis=2,
                )  # each head (batch, len, depth)
                for kernel, bias in zip(kernels, biases)
            ]
        outputs = ops.matmul(inputs, _side_by_side([ops.reshape(k, (self.d_model, -1)) for k in kernels]))
        if self.use_bias:  # (batch, len, len(projections) * d_model)
            outputs = outputs + _side_by_side([ops.reshape(b, (-1,)) for b in biases])
        parts = ops.split(outputs, len(projections), axis=-1) if len(projections) > 1 else [outputs]
        shape = _batch_and_length_shape(inputs, (self.num_heads, self.depth))
        return [ops.reshape(part, shape) for part in parts]

    def attend_heads(
        self, query, key, value, attention_mask=None, training=None, return_weights=False, fold_queries=False
    ):
        """Eq. (1) per head, then W^O.

        Args:
            query: projected `(batch, len_q, num_heads, depth)`.
            key, value: projected, heads-first `(batch_k, num_heads, len_k,
                depth)` (from `project_key_value` or a cache).
            attention_mask: bool, broadcastable to `(batch, len_q, len_k)`.
            fold_queries: `batch_k` divides `batch`; the `batch // batch_k`
                consecutive query rows of each key row are attended as one
                longer query (the mask is then `(batch_k, 1, len_k)`).

        Returns `((batch, len_q, d_model), weights or None)`; weights
        `(batch, num_heads, len_q, len_k)` float32.
        """
        batch, len_q = ops.shape(query)[0], _length(query, 1)
        output_shape = _batch_and_length_shape(query, (self.d_model,))
        if fold_queries:  # (batch, len_q, ...) -> (batch_k, fold * len_q, ...)
            query = ops.reshape(query, (ops.shape(key)[0], -1, self.num_heads, self.depth))
        if self.mode == "per_head":
            heads, head_weights = [], []
            for i in range(self.num_heads):
                head_i, weights_i = scaled_dot_product_attention(
                    query[:, :, i],
                    key[:, i],
                    value[:, i],
                    mask=attention_mask,
                    dropout=self.attention_dropout,
                    training=training,
                    return_attention_weights=True,
                )  # (batch, len_q, depth), (batch, len_q, len_k)
                heads.append(head_i)
                head_weights.append(weights_i)
            context = ops.concatenate(heads, axis=-1)  # Concat(head_1, ..., head_h)
            weights = ops.stack(head_weights, axis=1) if return_weights else None
        else:
            mask = None if attention_mask is None else ops.expand_dims(attention_mask, axis=1)
            context, weights = scaled_dot_product_attention(
                _heads_first(query),
                key,
                value,
                mask=mask,
                dropout=self.attention_dropout,
                training=training,
                return_attention_weights=True,
            )  # (batch, num_heads, len_q, depth)
            context = ops.transpose(context, (0, 2, 1, 3))
        context = ops.reshape(context, output_shape)
        outputs = ops.matmul(context, ops.reshape(self._weight("output_kernel"), (-1, self.d_model)))
        if self.output_bias is not None:
            outputs = outputs + self._weight("output_bias")
        if (
            return_weights and fold_queries
        ):  # (batch_k, heads, fold * len_q, len_k) -> (batch, heads, len_q, len_k)
            weights = ops.reshape(
                weights, (ops.shape(weights)[0], self.num_heads, -1, len_q, ops.shape(key)[2])
            )
            weights = ops.reshape(ops.transpose(weights, (0, 2, 1, 3, 4)), (batch, self.num_heads, len_q, -1))
        return outputs, (weights if return_weights else None)

    def _weight(self, name):
        """A weight in the compute dtype, also outside `__call__`'s autocast
        (`Transformer.init_cache` calls `project_heads` directly)."""
        weight = getattr(self, name)
        return None if weight is None else ops.cast(weight, self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update(
            num_heads=self.num_heads,
            d_model=self.d_model,
            dropout_rate=self.dropout_rate,
            mode=self.mode,
            use_bias=self.use_bias,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=keras.initializers.serialize(self.bias_initializer),
        )
        return config


def _side_by_side(tensors):
    """Concatenated on the last axis (one tensor as it is)."""
    return tensors[0] if len(tensors) == 1 else ops.concatenate(tensors, axis=-1)


def _heads_first(tensor):
    """`(batch, len, num_heads, depth)` -> `(batch, num_heads, len, depth)`."""
    return ops.transpose(tensor, (0, 2, 1, 3))


def _batch_and_length_shape(tensor, trailing):
    """The shape `(batch, len) + trailing` for a reshape of `tensor` `(batch, len, ...)`, with one
    axis left to infer (-1): the batch where the length is static (the decoding step's length 1),
    so that the exported step reshapes to a constant shape instead of computing it from `Shape`
    at every step (5 ONNX nodes per reshape)."""
    length = _length(tensor, 1)
    return ((-1, length) if length != -1 else (ops.shape(tensor)[0], -1)) + tuple(trailing)


def _length(tensor, axis):
    """The static size of `axis` where known (it keeps symbolic shapes exact), else -1 (inferred)."""
    size = tensor.shape[axis]
    return -1 if size is None else size
