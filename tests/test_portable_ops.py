import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.layers.portable_ops import write_at


@pytest.mark.parametrize("length_new,start", [(1, 0), (1, 5), (3, 0), (3, 2), (6, 0)])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_write_at_equals_slice_assignment(length_new, start, jit_compile):
    rng = np.random.default_rng(0)
    tensor = rng.normal(size=(2, 6, 3, 4)).astype(np.float32)
    updates = rng.normal(size=(2, length_new, 3, 4)).astype(np.float32)
    expected = tensor.copy()
    expected[:, start : start + length_new] = updates
    function = tf.function(write_at, jit_compile=jit_compile)
    np.testing.assert_array_equal(function(tensor, updates, tf.constant(start)), expected)


def test_write_at_graph_has_no_xla_only_ops():
    """The reason it exists: tf2onnx cannot convert XlaDynamicUpdateSlice (keras.ops.slice_update)."""
    function = tf.function(write_at).get_concrete_function(
        tf.TensorSpec([None, 8, 2, 4]), tf.TensorSpec([None, 1, 2, 4]), tf.TensorSpec([], tf.int32)
    )
    ops = {op.type for op in function.graph.get_operations()}
    assert not {op for op in ops if op.startswith("Xla")}, ops
