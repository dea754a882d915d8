"""Boolean attention masks built from token ids (True = may attend).

Shape legend: batch = sentences, len_q = query positions, len_k = key positions.

Every mask here is broadcastable to the attention mask shape
`(batch, len_q, len_k)` that `scaled_dot_product_attention` and
`MultiHeadAttention` take, and several masks combine with `combine_masks`
(logical AND). Masks are explicit tensors rather than Keras "implicit" masks so
that they survive `tf.function`, SavedModel and ONNX export unchanged.
"""

from keras import ops


def padding_mask(ids, pad_id=0):
    """Marks the real (non-padding) tokens of `ids` as keys that may be attended.

    Args:
        ids: int tensor `(batch, len_k)` of token ids.
        pad_id: the padding id.

    Returns:
        bool tensor `(batch, 1, len_k)`: True where `ids != pad_id`.

    Example:
    >>> padding_mask([[5, 6, 0]]).numpy().tolist()
    [[[True, True, False]]]
    """
    ids = ops.convert_to_tensor(ids)
    return ops.expand_dims(ops.not_equal(ids, pad_id), axis=1)


def causal_mask(len_q, len_k=None, offset=0):
    """Lets query position i attend to key positions j <= i + offset (§3.2.3).

    Args:
        len_q: number of query positions.
        len_k: number of key positions (defaults to `len_q`).
        offset: absolute position of the first query; used by incremental
            decoding, where the query is one new token at step `offset`.

    Returns:
        bool tensor `(1, len_q, len_k)`.

    Example:
    >>> causal_mask(3).numpy().astype(int).tolist()
    [[[1, 0, 0], [1, 1, 0], [1, 1, 1]]]
    """
    len_k = len_q if len_k is None else len_k
    query_positions = ops.arange(len_q)[:, None] + offset  # (len_q, 1)
    key_positions = ops.arange(len_k)[None, :]  # (1, len_k)
    return ops.expand_dims(key_positions <= query_positions, axis=0)


def combine_masks(*masks):
    """Logical AND of the given masks, skipping `None`; `None` if all are.

    Masks broadcast against each other, so `(batch, 1, len_k)` padding masks
    combine with `(1, len_q, len_k)` causal masks into `(batch, len_q, len_k)`.
    """
    present = [ops.convert_to_tensor(m) for m in masks if m is not None]
    if not present:
        return None
    combined = present[0]
    for mask in present[1:]:
        combined = ops.logical_and(combined, mask)
    return combined
