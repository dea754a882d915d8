"""The whole model against a NumPy forward pass written from the paper, not from our code.

The reference below reads the Keras model's weights by their paths and computes
§3 step by step in float64: token embeddings scaled by sqrt(d_model) (§3.4),
plus the sinusoids of §3.5 with sines at even and cosines at odd dimensions
(interleaved), N encoder and decoder layers of multi-head attention (Eq. 1, §3.2.2)
and the position-wise network (Eq. 2), each sublayer as LayerNorm(x +
Sublayer(x)) (post-LN, §3.1) or, for `norm_first`, x + Sublayer(LayerNorm(x))
with a final LayerNorm per stack; source padding masked, the decoder's
self-attention causal (§3.2.3); the pre-softmax projection tied to the
embedding (§3.4). The Keras logits must equal it to 1e-4 and its greedy output
must be the Keras search's, for post-LN and pre-LN models; and the reference with
a planted mistake (post-LN and pre-LN swapped, embeddings not scaled, sines and
cosines concatenated instead of interleaved, the causal mask off by one) must
differ from the model, so these tests would catch that mistake in the model.
"""

import numpy as np
import pytest

import keras_transformer as kt

PLANTED = ("norm_swapped", "embedding_unscaled", "sinusoids_concatenated", "mask_off_by_one")


def _sinusoids(length, d_model, interleaved=True):
    angles = np.arange(length)[:, None] / 10000.0 ** (2 * np.arange(d_model // 2)[None, :] / d_model)
    if not interleaved:
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
    table = np.zeros((length, d_model))
    table[:, 0::2], table[:, 1::2] = np.sin(angles), np.cos(angles)
    return table


def _layer_norm(x, gamma, beta, epsilon):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + epsilon) * gamma + beta


def _attention(w, prefix, queries, keys_values, mask):
    """Multi-head attention (§3.2.2): heads of Eq. 1, concatenated and projected."""
    q = np.einsum("bld,dhk->bhlk", queries, w[f"{prefix}/query_kernel"]) + w[f"{prefix}/query_bias"][:, None]
    k = np.einsum("bld,dhk->bhlk", keys_values, w[f"{prefix}/key_kernel"]) + w[f"{prefix}/key_bias"][:, None]
    v = (
        np.einsum("bld,dhk->bhlk", keys_values, w[f"{prefix}/value_kernel"])
        + w[f"{prefix}/value_bias"][:, None]
    )
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])  # (batch, heads, len_q, len_k)
    scores = np.where(mask[:, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    heads = weights @ v  # (batch, heads, len_q, depth)
    return np.einsum("bhlk,hkd->bld", heads, w[f"{prefix}/output_kernel"]) + w[f"{prefix}/output_bias"]


def _feed_forward(w, prefix, x):
    """Eq. 2: max(0, x W1 + b1) W2 + b2."""
    inner = np.maximum(0, x @ w[f"{prefix}/inner_dense/kernel"] + w[f"{prefix}/inner_dense/bias"])
    return inner @ w[f"{prefix}/output_dense/kernel"] + w[f"{prefix}/output_dense/bias"]


def reference_logits(model, source_ids, target_ids, planted=None):
    """The paper's forward pass (module docstring), optionally with one `PLANTED` mistake."""
    config = model.config
    w = {v.path.removeprefix(model.name + "/"): np.asarray(v.numpy(), np.float64) for v in model.weights}
    embedding = w["token_embedding/embeddings"]
    scale = 1.0 if planted == "embedding_unscaled" else np.sqrt(config.d_model)
    table = _sinusoids(config.max_length, config.d_model, interleaved=planted != "sinusoids_concatenated")
    norm_first = config.norm_first != (planted == "norm_swapped")
    epsilon = config.layer_norm_epsilon

    def sublayer(x, prefix, name, function):
        norm = (w[f"{prefix}/{name}_norm/gamma"], w[f"{prefix}/{name}_norm/beta"], epsilon)
        if norm_first:
            return x + function(_layer_norm(x, *norm))
        return _layer_norm(x + function(x), *norm)

    def stack(side, x, layers, *sublayers):
        x = embedding[x] * scale + table[: x.shape[1]]
        for i in range(layers):
            for name, function in sublayers:
                x = sublayer(
                    x, f"{side}/layer_{i}", name, lambda h, f=function, i=i: f(h, f"{side}/layer_{i}")
                )
        if norm_first:
            if f"{side}/output_norm/gamma" in w:
                x = _layer_norm(x, w[f"{side}/output_norm/gamma"], w[f"{side}/output_norm/beta"], epsilon)
        return x

    source_mask = np.broadcast_to(
        (source_ids != config.pad_id)[:, None, :], (len(source_ids), 1, source_ids.shape[1])
    )
    length = target_ids.shape[1]
    allowed = np.arange(length)[None, :] <= np.arange(length)[:, None] + (
        1 if planted == "mask_off_by_one" else 0
    )
    target_mask = allowed[None] & (target_ids != config.pad_id)[:, None, :]
    memory = stack(
        "encoder",
        source_ids,
        config.num_layers,
        ("self_attention", lambda h, p: _attention(w, f"{p}/self_attention", h, h, source_mask)),
        ("feed_forward", lambda h, p: _feed_forward(w, f"{p}/feed_forward", h)),
    )
    hidden = stack(
        "decoder",
        target_ids,
        config.num_decoder_layers,
        ("self_attention", lambda h, p: _attention(w, f"{p}/self_attention", h, h, target_mask)),
        ("cross_attention", lambda h, p: _attention(w, f"{p}/cross_attention", h, memory, source_mask)),
        ("feed_forward", lambda h, p: _feed_forward(w, f"{p}/feed_forward", h)),
    )
    return hidden @ embedding.T  # the tied pre-softmax projection


def reference_greedy(model, source_ids, steps, logits_of=reference_logits):
    """Greedy decoding with a reference (`logits_of(model, source_ids, target_ids)`): the argmax
    of the last position, `steps` times, EOS at the last (the output length limit, §6.1)."""
    config = model.config
    tokens = np.full((len(source_ids), 1), config.bos_id)
    for step in range(steps):
        logits = np.array(logits_of(model, source_ids, tokens)[:, -1], np.float64)
        logits[:, [config.pad_id, config.bos_id]] = -np.inf  # the search never outputs them
        if step == steps - 1:
            logits[:, np.arange(logits.shape[1]) != config.eos_id] = -np.inf
        tokens = np.concatenate([tokens, logits.argmax(-1)[:, None]], axis=1)
    return tokens[:, 1:]


def _model_and_batch(norm_first, seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    model = kt.Transformer.from_preset("tiny", vocab_size=40, norm_first=norm_first)
    model.build()
    rng = np.random.default_rng(seed)
    source_ids = rng.integers(4, 40, size=(3, 9)).astype(np.int32)
    source_ids[1, 6:], source_ids[2, 4:] = 0, 0  # padding
    source_ids[np.arange(3), [8, 5, 3]] = 3  # EOS
    target_ids = rng.integers(4, 40, size=(3, 7)).astype(np.int32)
    target_ids[:, 0] = 2  # BOS
    target_ids[2, 5:] = 0
    return model, source_ids, target_ids


def _assert_same_logits_and_greedy_tokens(model, source_ids, target_ids, logits_of, tolerance):
    keras_logits = np.asarray(model({"source_ids": source_ids, "target_ids": target_ids}, training=False))
    theirs = np.asarray(logits_of(model, source_ids, target_ids))
    real = target_ids != 0  # positions after the target's padding are not compared
    np.testing.assert_allclose(keras_logits[real], theirs[real], atol=tolerance, rtol=tolerance)
    greedy = np.asarray(kt.greedy_search(model, source_ids, max_length=6).ids)
    expected = reference_greedy(model, source_ids, 6, logits_of)
    for row, reference in zip(greedy, expected):  # the search stops a sentence at its EOS
        length = next((i + 1 for i, t in enumerate(row) if t == model.config.eos_id), len(row))
        assert row[:length].tolist() == reference[:length].tolist()


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_logits_and_greedy_tokens_equal_the_papers_forward_pass(norm_first):
    model, source_ids, target_ids = _model_and_batch(norm_first)
    _assert_same_logits_and_greedy_tokens(model, source_ids, target_ids, reference_logits, 1e-4)


@pytest.mark.parametrize("planted", PLANTED)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_a_planted_mistake_is_caught(planted, norm_first):
    model, source_ids, target_ids = _model_and_batch(norm_first)
    keras_logits = np.asarray(model({"source_ids": source_ids, "target_ids": target_ids}, training=False))
    wrong = reference_logits(model, source_ids, target_ids, planted=planted)
    real = target_ids != 0
    assert np.max(np.abs(keras_logits[real] - wrong[real])) > 1e-2


def keras_hub_logits(model, source_ids, target_ids):
    """The model's weights moved into keras-hub's layers: `TransformerEncoder`/`TransformerDecoder`
    (their `normalize_first` is our `norm_first`), `SinePositionEncoding` (interleaved, §3.5), a
    `LayerNormalization` per stack for pre-LN, and the tied projection (§3.4)."""
    import keras
    import keras_hub

    config = model.config
    w = {v.path.removeprefix(model.name + "/"): v.numpy() for v in model.weights}

    def copy_layer(layer, prefix):
        """Our layer `prefix`'s weights into keras-hub's `layer` (built), sublayer by sublayer."""
        attention = ("query_kernel", "query_bias", "key_kernel", "key_bias", "value_kernel", "value_bias")
        attention += ("output_kernel", "output_bias")
        pairs = [("self_attention", layer._self_attention_layer, attention)]
        pairs += [("self_attention_norm", layer._self_attention_layer_norm, ("gamma", "beta"))]
        if prefix.startswith("decoder"):
            pairs += [("cross_attention", layer._cross_attention_layer, attention)]
            pairs += [("cross_attention_norm", layer._cross_attention_layer_norm, ("gamma", "beta"))]
        pairs += [("feed_forward/inner_dense", layer._feedforward_intermediate_dense, ("kernel", "bias"))]
        pairs += [("feed_forward/output_dense", layer._feedforward_output_dense, ("kernel", "bias"))]
        pairs += [("feed_forward_norm", layer._feedforward_layer_norm, ("gamma", "beta"))]
        for ours, theirs, names in pairs:
            theirs.set_weights([w[f"{prefix}/{ours}/{name}"] for name in names])

    def output_norm(side, x):
        if not config.norm_first:
            return x
        layer = keras.layers.LayerNormalization(epsilon=config.layer_norm_epsilon)
        layer.build((None, None, config.d_model))
        layer.set_weights([w[f"{side}/output_norm/gamma"], w[f"{side}/output_norm/beta"]])
        return layer(x)

    def embed(ids):
        x = w["token_embedding/embeddings"][ids] * np.sqrt(config.d_model)
        return x + np.asarray(keras_hub.layers.SinePositionEncoding()(x))

    options = dict(
        intermediate_dim=config.d_ff,
        num_heads=config.num_heads,
        layer_norm_epsilon=config.layer_norm_epsilon,
        normalize_first=config.norm_first,
    )
    source_padding, target_padding = source_ids != config.pad_id, target_ids != config.pad_id
    memory = embed(source_ids)
    for i in range(config.num_layers):
        layer = keras_hub.layers.TransformerEncoder(**options)
        layer(memory, padding_mask=source_padding)  # builds it
        copy_layer(layer, f"encoder/layer_{i}")
        memory = layer(memory, padding_mask=source_padding)
    memory = output_norm("encoder", memory)
    hidden = embed(target_ids)
    masks = dict(decoder_padding_mask=target_padding, encoder_padding_mask=source_padding)
    for i in range(config.num_decoder_layers):
        layer = keras_hub.layers.TransformerDecoder(**options)
        layer(hidden, memory, **masks)  # builds it
        copy_layer(layer, f"decoder/layer_{i}")
        hidden = layer(hidden, memory, **masks)  # causal self-attention by default
    hidden = output_norm("decoder", hidden)
    return np.asarray(hidden) @ w["token_embedding/embeddings"].T


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_logits_and_greedy_tokens_equal_keras_hubs_layers(norm_first):
    pytest.importorskip("keras_hub", reason="keras-hub is in the test extra: pip install -e '.[test]'")
    model, source_ids, target_ids = _model_and_batch(norm_first)
    _assert_same_logits_and_greedy_tokens(model, source_ids, target_ids, keras_hub_logits, 1e-5)
