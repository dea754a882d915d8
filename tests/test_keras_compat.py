"""The private Keras names of `keras_compat.py` still do what we use them for."""

import keras
import numpy as np

import keras_transformer as kt
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
