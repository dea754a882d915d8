import keras
import numpy as np
import pytest

import keras_transformer as kt


def _reference_attention(q, k, v, mask):
    logits = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    logits = np.where(mask, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return weights @ v, weights


def test_matches_equation_1():
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 3, 5, 4)).astype("float32") for _ in range(3))
    mask = rng.random((2, 1, 5, 5)) > 0.3
    mask[..., 0] = True  # at least one key per row
    outputs, weights = kt.scaled_dot_product_attention(q, k, v, mask=mask, return_attention_weights=True)
    expected_outputs, expected_weights = _reference_attention(q, k, v, mask)
    np.testing.assert_allclose(outputs, expected_outputs, atol=1e-5)
    np.testing.assert_allclose(weights, expected_weights, atol=1e-6)


def test_masked_positions_get_exactly_zero_weight():
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(1, 4, 8)).astype("float32") * 100 for _ in range(3))
    mask = np.array(kt.causal_mask(4))
    _, weights = kt.scaled_dot_product_attention(q, k, v, mask=mask, return_attention_weights=True)
    assert np.all(np.asarray(weights)[~np.broadcast_to(mask, weights.shape)] == 0.0)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_fully_masked_row_is_zero_not_nan(dtype):
    q = k = v = np.ones((1, 2, 4), dtype)
    mask = np.array([[[True, True], [False, False]]])
    outputs, weights = kt.scaled_dot_product_attention(q, k, v, mask=mask, return_attention_weights=True)
    assert keras.backend.standardize_dtype(weights.dtype) == "float32"
    assert np.all(np.isfinite(np.asarray(outputs, "float32")))
    np.testing.assert_array_equal(np.asarray(weights)[0, 1], [0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(outputs, "float32")[0, 1], np.zeros(4))


def test_float16_with_huge_logits_stays_finite():
    q = np.full((1, 3, 4), 200.0, "float16")  # q.k = 160000 > float16 max before scaling
    _, weights = kt.scaled_dot_product_attention(
        q, q, q, mask=np.array(kt.causal_mask(3)), return_attention_weights=True
    )
    assert np.all(np.isfinite(weights))
