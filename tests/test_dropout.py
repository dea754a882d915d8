import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_transformer as kt
from keras_transformer.layers.dropout import in_xla_computation


@pytest.mark.parametrize("jit_compile", [False, True])
def test_dropout_drops_at_the_rate_and_rescales_the_rest(jit_compile):
    layer = kt.Dropout(0.1, seed=0)
    inputs = tf.random.stateless_normal((64, 16, 128), seed=(1, 2))
    apply = tf.function(lambda x: layer(x, training=True), jit_compile=jit_compile, autograph=False)
    first, second = apply(inputs).numpy(), apply(inputs).numpy()
    dropped = first == 0
    assert abs(dropped.mean() - 0.1) < 0.005  # 131,072 draws: ~0.0008 standard deviation
    np.testing.assert_allclose(first[~dropped], inputs.numpy()[~dropped] / 0.9, rtol=1e-6)
    assert 0.15 < (dropped != (second == 0)).mean() < 0.21  # a new mask per call (2 * 0.1 * 0.9)


def test_dropout_gradient_uses_the_same_mask():
    layer = kt.Dropout(0.5, seed=0)
    inputs = tf.ones((8, 32))
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        outputs = layer(inputs, training=True)
        total = tf.reduce_sum(outputs)
    gradient = tape.gradient(total, inputs).numpy()
    np.testing.assert_array_equal(gradient, outputs.numpy())  # 0 or 2 at the same places


def test_dropout_is_identity_when_not_training_or_rate_zero():
    inputs = np.arange(12, dtype="float32").reshape(3, 4)
    np.testing.assert_array_equal(kt.Dropout(0.3)(inputs, training=False), inputs)
    np.testing.assert_array_equal(kt.Dropout(0.0)(inputs, training=True), inputs)


def test_dropout_keeps_half_precision_dtype():
    layer = kt.Dropout(0.2, dtype="mixed_bfloat16")
    outputs = layer(np.ones((4, 8), "float32"), training=True)
    assert keras.backend.standardize_dtype(outputs.dtype) == "bfloat16"


def test_dropout_seed_reproduces_and_config_round_trips():
    inputs = np.ones((16, 16), "float32")
    first = kt.Dropout(0.4, seed=7)(inputs, training=True).numpy()
    np.testing.assert_array_equal(kt.Dropout(0.4, seed=7)(inputs, training=True).numpy(), first)
    clone = kt.Dropout.from_config(kt.Dropout(0.4, seed=7, name="d").get_config())
    assert (clone.rate, clone.seed, clone.name) == (0.4, 7, "d")
    with pytest.raises(ValueError, match="rate must be a number in"):
        kt.Dropout(1.0)


def test_xla_context_is_detected():
    seen = []
    tf.function(
        lambda: seen.append(in_xla_computation()) or tf.constant(0), jit_compile=True, autograph=False
    )()
    tf.function(lambda: seen.append(in_xla_computation()) or tf.constant(0), autograph=False)()
    assert seen == [True, False] and not in_xla_computation()


@pytest.mark.parametrize(
    "jit_compile, algorithm", [(True, tf.random.Algorithm.THREEFRY), (False, tf.random.Algorithm.PHILOX)]
)
def test_dropout_picks_the_generator_by_compilation(jit_compile, algorithm):
    layer = kt.Dropout(0.1, seed=0)
    function = tf.function(lambda x: layer(x, training=True), jit_compile=jit_compile, autograph=False)
    graph = function.get_concrete_function(tf.TensorSpec((2, 3))).graph
    generators = [op for op in graph.get_operations() if op.type == "StatelessRandomUniformV2"]
    assert len(generators) == 1
    assert tf.get_static_value(generators[0].inputs[3]) == algorithm.value
