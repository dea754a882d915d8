"""The private Keras names of `keras_compat.py` still do what we use them for."""

import keras
import numpy as np
import pytest

import keras_transformer as kt
from keras_transformer.utils import keras_compat
from keras_transformer.utils.keras_compat import model_bytes, weights_bytes


def _compiled_tiny():
    model = kt.Transformer.from_preset("tiny", vocab_size=40)
    model.build()
    kt.compile_transformer(model)
    return model


def test_weights_bytes_is_a_weights_file_keras_loads_with_the_optimizer(tmp_path):
    model = _compiled_tiny()
    model.optimizer.iterations.assign(7)
    path = tmp_path / "in-memory.weights.h5"
    path.write_bytes(weights_bytes(model))
    other = _compiled_tiny()
    other.load_weights(str(path))
    for ours, theirs in zip(model.weights, other.weights):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert int(other.optimizer.iterations.numpy()) == 7  # the optimizer is in the file too
    model.save_weights(str(tmp_path / "keras.weights.h5"))
    assert abs(path.stat().st_size - (tmp_path / "keras.weights.h5").stat().st_size) < 4096


def test_model_bytes_is_a_keras_file_that_loads_in_safe_mode(tmp_path):
    model = _compiled_tiny()
    path = tmp_path / "model.keras"
    path.write_bytes(model_bytes(model))
    loaded = keras.saving.load_model(str(path), compile=False, safe_mode=True)
    ids = np.array([[5, 6, 3]], "int32")
    inputs = {"source_ids": ids, "target_ids": ids}
    np.testing.assert_allclose(np.asarray(loaded(inputs)), np.asarray(model(inputs)), atol=1e-6)


def test_compiled_state_accessors_read_what_compile_made():
    model = _compiled_tiny()
    assert keras_compat.compiled_loss(model) is not None
    assert keras_compat.compiled_metrics(model) is not None
    assert not keras_compat.has_loss_weights(keras_compat.compiled_loss(model))
    ids = keras.KerasTensor((None, None), "int32")
    keras_compat.symbolic_build(model, ({"source_ids": ids, "target_ids": ids}, ids))
    assert model.optimizer.built and keras_compat.compiled_metrics(model).built
    assert not keras_compat.has_weighted_metrics(keras_compat.compiled_metrics(model))
    weighted = kt.Transformer.from_preset("tiny", vocab_size=40)
    weighted.compile(
        optimizer="sgd",
        loss=kt.LabelSmoothedCrossEntropy(),
        loss_weights=1.0,
        weighted_metrics=[kt.MaskedTokenAccuracy()],
    )
    keras_compat.symbolic_build(weighted, ({"source_ids": ids, "target_ids": ids}, ids))
    assert keras_compat.has_loss_weights(keras_compat.compiled_loss(weighted))
    assert keras_compat.has_weighted_metrics(keras_compat.compiled_metrics(weighted))


def test_loss_tracker_is_the_logged_loss():
    model = _compiled_tiny()
    inputs, labels = kt.sequence_task("reverse", 8, 40, max_length=6, seed=1)
    logs = model.train_on_batch(inputs, labels, return_dict=True)
    assert float(keras_compat.loss_tracker(model).result()) == pytest.approx(logs["loss"])


def test_sublayers_reaches_every_attention_layer():
    model = _compiled_tiny()
    attention = [layer for layer in keras_compat.sublayers(model) if isinstance(layer, kt.MultiHeadAttention)]
    assert len(attention) == 3 * model.config.num_layers  # encoder self, decoder self and cross
    assert model not in keras_compat.sublayers(model)


def test_distributed_fit_fixes_skip_the_symbolic_build_of_a_built_model():
    model = _compiled_tiny()
    from keras_transformer.training.optimizer import build_for_fit

    build_for_fit(model)
    model._maybe_symbolic_build(data_batch=object())  # nothing to build: the batch is not read
    assert model.logs_for_workers({"loss": 1.0}) == {"loss": 1.0}  # no multi-worker strategy


def test_tf2onnx_patch_lets_tf2onnx_convert_on_this_numpy():
    import tensorflow as tf
    import tf2onnx

    keras_compat.patch_tf2onnx_for_numpy2()
    double = tf.function(lambda x: 2.0 * x)
    model, _ = tf2onnx.convert.from_function(
        double, input_signature=[tf.TensorSpec([None], tf.float32)], opset=17
    )
    assert [node.op_type for node in model.graph.node] == ["Mul"]
