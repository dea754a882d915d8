"""Scaled dot-product attention, Eq. (1) of Vaswani et al. (2017), §3.2.1.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

Shape legend (any leading axes `...` are carried through, e.g. `(batch,)` for
one head or `(batch, num_heads)` for all heads at once):
    query (..., len_q, depth)   key (..., len_k, depth)   value (..., len_k, depth_v)
    mask  broadcastable to (..., len_q, len_k), bool, True = may attend
"""

import math

import keras
from keras import ops


def scaled_dot_product_attention(
    query,
    key,
    value,
    mask=None,
    dropout=None,
    training=None,
    return_attention_weights=False,
):
    """Computes Eq. (1) with a boolean mask, in a numerically safe way.

    The masking and the softmax run in float32 (the fill value is always
    representable and exp cannot overflow); for float16 inputs the logits
    product `Q K^T` is also taken in float32, since it overflows float16's
    range (65504) long before the softmax (bfloat16 has float32's range and
    keeps its own dtype). The weights go back to the input dtype for the
    product with `value`. Masked positions get exactly zero weight, and a query
    row with no position to attend to (a fully padded row) gets all-zero weights
    and a zero output instead of NaN.

    Args:
        query: `(..., len_q, depth)`.
        key: `(..., len_k, depth)`.
        value: `(..., len_k, depth_v)`.
        mask: optional bool tensor broadcastable to `(..., len_q, len_k)`.
        dropout: optional callable `dropout(weights, training=...)` applied to
            the attention weights (e.g. a `keras.layers.Dropout`).
        training: passed to `dropout`.
        return_attention_weights: also return the (pre-dropout) weights.

    Returns:
        `(..., len_q, depth_v)` outputs, and with `return_attention_weights`
        a tuple `(outputs, weights)` with weights `(..., len_q, len_k)` float32.

    Example:
    >>> import numpy as np
    >>> q = k = v = np.eye(2, dtype="float32")[None]  # (1, 2, 2)
    >>> out = scaled_dot_product_attention(q, k, v, mask=np.array([[[True, False]]]))
    >>> out.numpy().round(3).tolist()
    [[[1.0, 0.0], [1.0, 0.0]]]
    """
    depth = query.shape[-1]
    if keras.backend.standardize_dtype(query.dtype) == "float16":
        query, key = ops.cast(query, "float32"), ops.cast(key, "float32")
    query = ops.multiply(query, ops.cast(1.0 / math.sqrt(depth), query.dtype))
    logits = ops.matmul(query, ops.swapaxes(key, -1, -2))  # (..., len_q, len_k)
    weights = masked_softmax(logits, mask)  # float32
    outputs_weights = ops.cast(weights, value.dtype)
    if dropout is not None:
        outputs_weights = dropout(outputs_weights, training=training)
    outputs = ops.matmul(outputs_weights, value)  # (..., len_q, depth_v)
    if return_attention_weights:
        return outputs, weights
    return outputs


def masked_softmax(logits, mask=None):
    """Softmax over the last axis in float32, with exact zeros where `mask` is False.

    Args:
        logits: `(..., len_q, len_k)` in any float dtype.
        mask: optional bool, broadcastable to `logits`.

    Returns:
        float32 `(..., len_q, len_k)`; rows where the mask is all False are zero.
    """
    logits = ops.cast(logits, "float32")
    if mask is not None:
        # where() rather than adding a large negative number: no overflow in
        # any dtype, and the fill is far below any real logit.
        logits = ops.where(mask, logits, ops.cast(-3.0e38, "float32"))
    if logits.shape[-1] == 1:  # one key: the softmax is 1 (and Keras warns about it)
        weights = ops.ones_like(logits)
    else:
        weights = ops.softmax(logits, axis=-1)
    if mask is None:
        return weights
    # Only changes fully masked rows (whose softmax is uniform over nothing).
    return ops.where(mask, weights, ops.cast(0.0, "float32"))  # a scalar: no zeros tensor to build
