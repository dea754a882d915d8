"""Tensor updates that export everywhere.

`keras.ops.slice_update` lowers to TensorFlow's `XlaDynamicUpdateSlice`,
which neither tf2onnx nor ONNX Runtime knows, so a decoder that writes its
key/value cache with it cannot be exported as an ONNX graph. `write_at` does
the same update with `where` (and a gather when several positions are
written), which every exporter maps and XLA still compiles to an in-place
update: side by side in one `tf.while_loop` of 100 writes into a
`(128, 100, 8, 64)` cache, both took ~6 ms/step without XLA and ~0.15 ms/step
with it on the 2-core CPU we develop on.
"""

import keras
from keras import ops


def write_at(tensor, updates, start, axis=1):
    """`tensor` with `updates` written along `axis` at positions `start, start + 1, ...`.

    Args:
        tensor: `(batch, length, ...)` (with `axis=1`; any axis >= 1).
        updates: `(batch, len_new, ...)`, the same other dimensions, same dtype.
        start: scalar int; `start + len_new <= length`.
        axis: the position axis (2 for a heads-first cache).

    Returns:
        `(batch, length, ...)`: `tensor[:, start + i] = updates[:, i]`.

    Example:
    >>> import numpy as np
    >>> ops.convert_to_numpy(write_at(np.zeros((1, 4)), np.array([[7.0, 8.0]]), 1))
    array([[0., 7., 8., 0.]])
    """
    offset = ops.arange(ops.shape(tensor)[axis]) - start  # (length,): index into updates
    len_new = updates.shape[axis]
    if len_new == 1:  # one position (every decoding step): a broadcasting `where`
        inside = ops.equal(offset, 0)
    else:
        len_new = ops.shape(updates)[axis]
        inside = ops.logical_and(ops.greater_equal(offset, 0), ops.less(offset, len_new))
        updates = ops.take(updates, ops.clip(offset, 0, len_new - 1), axis=axis)  # (batch, ..., length, ...)
    inside = ops.reshape(inside, (1,) * axis + (-1,) + (1,) * (len(tensor.shape) - axis - 1))
    return ops.where(inside, updates, tensor)


def write_in_place(tensor, updates, start):
    """`tensor` `(rows, heads, length, depth)` with `updates` `(rows, heads, len_new, depth)`
    written at positions `start, start + 1, ...` of axis 2, as one scatter of `depth`-long rows:
    XLA writes it into `tensor`'s buffer when nothing else reads `tensor` afterwards (`write_at`'s
    `where` reads and writes every position). A scatter, not a dynamic-update-slice: TensorFlow
    has no standard op for the latter (Keras' `slice_update` is `XlaDynamicUpdateSlice`, which a
    SavedModel for TF Serving should not hold).

    Example:
    >>> import numpy as np
    >>> ops.convert_to_numpy(write_in_place(np.zeros((1, 1, 3, 1), "float32"),
    ...                                     np.ones((1, 1, 1, 1), "float32"), 1))[0, 0, :, 0]
    array([0., 1., 0.], dtype=float32)
    """
    shape = ops.shape(tensor)
    length, depth = shape[2], shape[3]
    len_new = ops.shape(updates)[2]
    flat = ops.reshape(tensor, (-1, length, depth))  # (rows * heads, length, depth)
    count = ops.shape(flat)[0]
    row = ops.repeat(ops.arange(count, dtype="int32"), len_new)  # each written (row, position)
    position = ops.tile(ops.arange(len_new, dtype="int32") + ops.cast(start, "int32"), [count])
    indices = ops.stack([row, position], axis=1)
    values = ops.reshape(ops.cast(updates, tensor.dtype), (-1, depth))
    return ops.reshape(ops.scatter_update(flat, indices, values), shape)


def rows_by_position(tensor, rows):
    """`tensor` `(rows, heads, length, depth)` read as `out[r, :, p] = tensor[rows[r, p], :, p]`
    for int `rows` `(rows_out, n)` in range, `n <= length` (the first `n` positions): each
    row's keys or values at each position taken from the row that wrote them (a beam's
    history in a cache that is never reordered). One gather of `depth`-long slices.

    Example:
    >>> import numpy as np
    >>> t = np.arange(6, dtype="float32").reshape(2, 1, 3, 1)  # row 0: 0, 1, 2; row 1: 3, 4, 5
    >>> ops.convert_to_numpy(rows_by_position(t, np.array([[1, 0]])))[0, 0, :, 0]
    array([3., 1.], dtype=float32)
    """
    _, heads, length, depth = ops.shape(tensor)
    rows = ops.cast(rows, "int32")
    flat = (
        rows[:, None, :] * (heads * length)
        + ops.arange(heads, dtype="int32")[None, :, None] * length
        + ops.arange(ops.shape(rows)[1], dtype="int32")[None, None, :]
    )  # (rows_out, heads, n): indices into the (rows * heads * length, depth) matrix
    return gather_rows(ops.reshape(tensor, (-1, depth)), flat)


def gather_rows(tensor, indices):
    """`tensor[indices]` along axis 0, for `indices` known to be in range (no negative ones).

    `keras.ops.take` also maps negative indices (`where(i < 0, i + n, i)`), which
    an exported graph pays for with six extra nodes per call; a decoding step
    gathers every cache tensor, so on TensorFlow this is one `GatherV2`.

    Example:
    >>> import numpy as np
    >>> ops.convert_to_numpy(gather_rows(np.array([[1, 2], [3, 4]]), np.array([1, 1, 0])))
    array([[3, 4],
           [3, 4],
           [1, 2]])
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.gather(tensor, indices, axis=0)
    return ops.take(tensor, indices, axis=0)


def argmax(tensor):
    """int32 index of the largest value along the last axis, the first one on ties.

    `keras.ops.argmax` on TensorFlow first maps -0.0 to the smallest negative float (a
    flush-to-zero fix for another backend) with a `Bitcast`, which tf2onnx cannot convert
    and which costs three more kernels per call; on TensorFlow this is one `ArgMax`.

    Example:
    >>> import numpy as np
    >>> ops.convert_to_numpy(argmax(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]])))
    array([1, 0], dtype=int32)
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.math.argmax(tensor, axis=-1, output_type=tf.int32)
    return ops.cast(ops.argmax(tensor, axis=-1), "int32")
