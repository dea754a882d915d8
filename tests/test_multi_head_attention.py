import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_transformer as kt


def _inputs(batch=2, len_q=5, len_k=7, d_model=16, seed=0):
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(batch, len_q, d_model)).astype("float32")
    value = rng.normal(size=(batch, len_k, d_model)).astype("float32")
    mask = np.ones((batch, len_q, len_k), bool)
    mask[1, :, 4:] = False  # padded keys in the second sentence
    return query, value, mask


def _outputs_and_gradients(layer, query, value, mask):
    query, value = tf.constant(query), tf.constant(value)
    with tf.GradientTape() as tape:
        tape.watch([query, value])
        outputs = layer(query, value, attention_mask=mask)
        loss = tf.reduce_sum(outputs * tf.sin(outputs))
    variables = layer.trainable_variables
    gradients = tape.gradient(loss, variables + [query, value])
    return outputs.numpy(), [g.numpy() for g in gradients]


def test_per_head_and_batched_give_same_outputs_and_gradients():
    query, value, mask = _inputs()
    layer = kt.MultiHeadAttention(num_heads=4, d_model=16, mode="batched")
    batched = _outputs_and_gradients(layer, query, value, mask)
    layer.mode = "per_head"
    per_head = _outputs_and_gradients(layer, query, value, mask)
    np.testing.assert_allclose(per_head[0], batched[0], atol=1e-5)
    assert len(per_head[1]) == 8 + 2
    for g_per_head, g_batched in zip(per_head[1], batched[1]):
        np.testing.assert_allclose(g_per_head, g_batched, atol=1e-5)


def test_per_head_attention_weights_match_batched():
    query, value, mask = _inputs()
    layer = kt.MultiHeadAttention(num_heads=4, d_model=16)
    _, batched = layer(query, value, attention_mask=mask, return_weights=True)
    layer.mode = "per_head"
    _, per_head = layer(query, value, attention_mask=mask, return_weights=True)
    assert batched.shape == (2, 4, 5, 7)
    np.testing.assert_allclose(per_head, batched, atol=1e-6)
    assert np.all(np.asarray(batched)[1, :, :, 4:] == 0.0)


def test_weights_have_keras_multi_head_attention_order_and_shapes():
    query, value, _ = _inputs()
    ours = kt.MultiHeadAttention(num_heads=4, d_model=16)
    theirs = keras.layers.MultiHeadAttention(num_heads=4, key_dim=4)
    ours(query, value), theirs(query, value)
    assert [w.shape for w in ours.get_weights()] == [w.shape for w in theirs.get_weights()]


@pytest.mark.parametrize("mode", kt.ATTENTION_MODES)
@pytest.mark.parametrize("direction", ["keras_to_ours", "ours_to_keras"])
def test_weights_copied_to_and_from_keras_give_same_outputs(mode, direction):
    query, value, mask = _inputs()
    ours = kt.MultiHeadAttention(num_heads=4, d_model=16, mode=mode)
    theirs = keras.layers.MultiHeadAttention(num_heads=4, key_dim=4)
    ours(query, value), theirs(query, value)
    source, target = (theirs, ours) if direction == "keras_to_ours" else (ours, theirs)
    target.set_weights(source.get_weights())
    np.testing.assert_allclose(
        ours(query, value, attention_mask=mask),
        theirs(query, value, attention_mask=mask),
        atol=1e-5,
    )


def test_self_attention_defaults_key_to_value():
    query, value, _ = _inputs()
    layer = kt.MultiHeadAttention(num_heads=2, d_model=16)
    np.testing.assert_allclose(layer(query, value), layer(query, value, key=value), atol=0)


def test_kernel_initializer_sees_the_square_matrix_fans():
    layer = kt.MultiHeadAttention(num_heads=8, d_model=512)
    layer.build((None, None, 512), (None, None, 512))
    limit = np.sqrt(6.0 / (512 + 512))  # Glorot uniform on (d_model, d_model)
    kernel = np.asarray(layer.query_kernel)
    assert kernel.max() <= limit and kernel.max() > 0.9 * limit


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(num_heads=3, d_model=16), "d_model=16 must be divisible by num_heads=3"),
        (dict(num_heads=0, d_model=16), "num_heads must be a positive integer"),
        (dict(num_heads=2, d_model=-4), "d_model must be a positive integer"),
        (dict(num_heads=2, d_model=16, mode="flash"), "mode must be one of ['batched', 'per_head']"),
        (dict(num_heads=2, d_model=16, dropout_rate=1.5), "dropout_rate must be a number in [0, 1)"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(arguments, message):
    with pytest.raises(ValueError) as error:
        kt.MultiHeadAttention(**arguments)
    assert message in str(error.value)


def test_wrong_input_width_is_reported():
    layer = kt.MultiHeadAttention(num_heads=2, d_model=16)
    with pytest.raises(ValueError, match="d_model=16"):
        layer(np.ones((1, 2, 8), "float32"), np.ones((1, 2, 8), "float32"))


# --- Options through `__call__`: `return_weights=`, `cache=`, `cache_step=` --------------------------


@pytest.mark.parametrize("mode", kt.ATTENTION_MODES)
@pytest.mark.parametrize("policy", ["fixed", "growing"])
def test_self_attention_through_a_cache_filled_step_by_step_equals_causal_attention(mode, policy):
    """A heads-first cache filled one position per call gives causal self-attention (§3.2.3),
    written into preallocated positions (fixed) or appended (growing)."""
    x, _, _ = _inputs(len_q=6)
    layer = kt.MultiHeadAttention(num_heads=4, d_model=16, mode=mode)
    full, full_weights = layer(x, attention_mask=kt.causal_mask(6), return_weights=True)
    cache = (np.zeros((2, 4, 6 if policy == "fixed" else 0, 4), "float32"),) * 2
    for step in range(6):
        if policy == "fixed":
            options = dict(attention_mask=kt.causal_mask(1, 6, offset=step), cache_step=step)
        else:
            options = dict(append_to_cache=True)
        outputs, weights, cache = layer(x[:, step : step + 1], cache=cache, return_weights=True, **options)
        assert cache[0].shape == (2, 4, 6 if policy == "fixed" else step + 1, 4)
        np.testing.assert_allclose(outputs[:, 0], full[:, step], atol=1e-5, err_msg=f"step {step}")
        np.testing.assert_allclose(weights[:, :, 0], full_weights[:, :, step, : weights.shape[-1]], atol=1e-6)
    heads_first = np.transpose(layer.project_heads(x, "key"), (0, 2, 1, 3))
    np.testing.assert_allclose(cache[0], heads_first, atol=1e-6)


@pytest.mark.parametrize("mode", kt.ATTENTION_MODES)
def test_the_fused_projections_equal_the_separate_ones(mode):
    x, _, _ = _inputs()
    layer = kt.MultiHeadAttention(num_heads=4, d_model=16, mode=mode)
    query, keys, values = layer.project_self_attention(x)
    np.testing.assert_allclose(query, layer.project_heads(x, "query"), atol=1e-6)
    for fused, name in ((keys, "key"), (values, "value")):
        np.testing.assert_allclose(fused, np.transpose(layer.project_heads(x, name), (0, 2, 1, 3)), atol=1e-6)
    np.testing.assert_allclose(layer.project_key_value(x)[1], values, atol=1e-6)


def test_a_read_only_cache_holds_the_projected_keys_and_values():
    """Cross-attention over a memory projected once equals projecting it at every call."""
    query, value, mask = _inputs()
    layer = kt.MultiHeadAttention(num_heads=4, d_model=16)
    projected = layer.project_key_value(value)
    outputs, cache = layer(query, attention_mask=mask, cache=projected)
    np.testing.assert_allclose(outputs, layer(query, value, attention_mask=mask), atol=1e-6)
    assert cache[0] is projected[0] and cache[1] is projected[1]


@pytest.mark.parametrize("mode", kt.ATTENTION_MODES)
def test_queries_of_several_rows_per_cache_row_are_folded(mode):
    """Beams of a sentence share its cross-attention cache: 3 query rows per cache row give
    what the cache repeated 3 times gives, weights included."""
    query, value, mask = _inputs(len_q=1)
    layer = kt.MultiHeadAttention(num_heads=4, d_model=16, mode=mode)
    beams = np.concatenate([query, query[:, :, ::-1], 2 * query], axis=1).reshape(6, 1, 16)  # 3 per sentence
    outputs, weights, _ = layer(
        beams, attention_mask=mask, cache=layer.project_key_value(value), return_weights=True
    )
    repeated = layer.project_key_value(np.repeat(value, 3, axis=0))
    expected, expected_weights, _ = layer(
        beams, attention_mask=np.repeat(mask, 3, axis=0), cache=repeated, return_weights=True
    )
    np.testing.assert_allclose(outputs, expected, atol=1e-6)
    np.testing.assert_allclose(weights, expected_weights, atol=1e-6)


@pytest.mark.parametrize("mode", kt.ATTENTION_MODES)
@pytest.mark.parametrize("block", [None, 2, 3])
def test_a_cache_read_through_row_histories_equals_the_reordered_cache(mode, block):
    """`cache_rows`: each row reads each position from the cache row its history names, and the
    cache is written in place, row by row; the same outputs as the cache gathered into that
    order first (as a reordering beam search keeps it). Before position `cache_block` only the
    first `cache_block` positions are read; the mask hides the rest either way."""
    rng = np.random.default_rng(5)
    rows, length, step = 6, 5, 2
    layer = kt.MultiHeadAttention(num_heads=4, d_model=16, mode=mode)
    x = rng.normal(size=(rows, 1, 16)).astype("float32")
    cache = tuple(rng.normal(size=(rows, 4, length, 4)).astype("float32") for _ in range(2))
    history = rng.integers(0, rows, size=(rows, length)).astype("int32")
    history[:, step] = np.arange(rows)  # the step's own position is its own row
    mask = kt.causal_mask(1, length, offset=step)
    outputs, written = layer(
        x, attention_mask=mask, cache=cache, cache_step=step, cache_rows=history, cache_block=block
    )
    expected_cache = tuple(np.array(t) for t in cache)
    positions = np.arange(length)
    reordered = tuple(t[history, :, positions].transpose(0, 2, 1, 3) for t in expected_cache)
    expected, reordered_written = layer(x, attention_mask=mask, cache=reordered, cache_step=step)
    np.testing.assert_allclose(outputs, expected, atol=1e-6)
    for got, before, ordered in zip(written, cache, reordered_written):
        got = np.asarray(got)
        np.testing.assert_array_equal(np.delete(got, step, axis=2), np.delete(before, step, axis=2))
        np.testing.assert_array_equal(got[:, :, step], np.asarray(ordered)[:, :, step])  # its own row
    with pytest.raises(ValueError, match="cache_rows is for decoding"):
        layer(x, attention_mask=mask, cache=cache, cache_step=step, cache_rows=history, return_weights=True)


def test_cache_mistakes_are_reported():
    query, value, _ = _inputs()
    layer = kt.MultiHeadAttention(num_heads=4, d_model=16)
    projected = layer.project_key_value(value)
    with pytest.raises(ValueError, match="do not pass value or key"):
        layer(query, value, cache=projected)
    with pytest.raises(ValueError, match=r"expects cache=\(keys, values\)"):
        layer(query, cache=projected[0])
    with pytest.raises(ValueError, match="not both"):
        layer(query, cache=projected, cache_step=0, append_to_cache=True)
    with pytest.raises(ValueError, match="need a cache"):
        layer(query, append_to_cache=True)


def test_return_weights_works_in_a_functional_model():
    """The options go through `Layer.__call__`, so the layer also traces symbolically."""
    query = keras.Input((5, 16))
    value = keras.Input((7, 16))
    outputs, weights = kt.MultiHeadAttention(num_heads=4, d_model=16)(query, value, return_weights=True)
    assert tuple(outputs.shape) == (None, 5, 16) and tuple(weights.shape) == (None, 4, 5, 7)
    model = keras.Model([query, value], [outputs, weights])
    q, v, _ = _inputs()
    eager_outputs, eager_weights = model([q, v])
    np.testing.assert_allclose(np.asarray(eager_weights).sum(-1), 1.0, atol=1e-5)
    assert eager_outputs.shape == (2, 5, 16)
    layer_outputs, layer_weights = kt.EncoderLayer(16, 4, 32)(query, return_weights=True)
    assert tuple(layer_outputs.shape) == (None, 5, 16) and tuple(layer_weights.shape) == (None, 4, 5, 5)


def test_mixed_precision_autocasts_a_cached_call():
    """Through `__call__`, a bfloat16 layer computes in bfloat16 from float32 inputs."""
    x, _, _ = _inputs(len_q=1)
    layer = kt.MultiHeadAttention(num_heads=4, d_model=16, dtype="mixed_bfloat16")
    cache = (np.zeros((2, 4, 3, 4), "float32"),) * 2
    outputs, (keys, values) = layer(x, attention_mask=kt.causal_mask(1, 3), cache=cache, cache_step=0)
    assert keras.backend.standardize_dtype(outputs.dtype) == "bfloat16"
    assert keras.backend.standardize_dtype(keys.dtype) == "bfloat16"
    assert layer.query_kernel.dtype == "float32"
