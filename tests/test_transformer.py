import json

import keras
import numpy as np
import pytest

import keras_transformer as kt

VOCAB = 40


def _model(**overrides):
    return kt.Transformer.from_preset("tiny", vocab_size=VOCAB, **overrides)


def _batch(seed=0, batch=3, len_src=7, len_tgt=6):
    rng = np.random.default_rng(seed)
    source = rng.integers(4, VOCAB, size=(batch, len_src))
    target = rng.integers(4, VOCAB, size=(batch, len_tgt))
    source[1, 4:] = 0  # padding
    target[2, 3:] = 0
    return {"source_ids": source, "target_ids": target}


def _seed_states(model):
    return [v for v in model.variables if "seed_generator_state" in v.path]


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("mode", kt.ATTENTION_MODES)
def test_no_future_leakage(training, mode):
    model = _model(
        attention_mode=mode, dropout_rate=0.3, attention_dropout_rate=0.3, activation_dropout_rate=0.3
    )
    inputs = _batch()
    seed_states = [np.asarray(v) for v in _seed_states(model)]
    logits = np.asarray(model(inputs, training=training))
    for t in range(inputs["target_ids"].shape[1] - 1):
        changed = {**inputs, "target_ids": inputs["target_ids"].copy()}
        changed["target_ids"][:, t + 1 :] = (changed["target_ids"][:, t + 1 :] + 7) % (VOCAB - 4) + 4
        for variable, state in zip(_seed_states(model), seed_states):
            variable.assign(state)  # the same dropout masks as the first call
        changed_logits = np.asarray(model(changed, training=training))
        np.testing.assert_allclose(changed_logits[:, : t + 1], logits[:, : t + 1], atol=1e-5)
        assert not np.allclose(changed_logits[:, t + 1 :], logits[:, t + 1 :])  # the test can fail


def test_dropout_is_really_active_in_training():
    model = _model(dropout_rate=0.3)
    inputs = _batch()
    assert not np.allclose(model(inputs, training=True), model(inputs, training=True))
    np.testing.assert_allclose(model(inputs), model(inputs), atol=0)


def test_attention_weights_on_future_and_padded_positions_are_exactly_zero():
    model = _model()
    inputs = _batch()
    weights = model.attention_weights(inputs)
    source_real = inputs["source_ids"] != 0
    target_real = inputs["target_ids"] != 0
    future = np.triu(np.ones((6, 6), bool), k=1)
    for layer_weights in weights["encoder_self"] + weights["decoder_cross"]:
        layer_weights = np.asarray(layer_weights)  # (batch, heads, len_q, len_src)
        assert np.all(
            layer_weights[~np.broadcast_to(source_real[:, None, None, :], layer_weights.shape)] == 0
        )
    for layer_weights in weights["decoder_self"]:
        layer_weights = np.asarray(layer_weights)  # (batch, heads, len_tgt, len_tgt)
        assert np.all(layer_weights[..., future] == 0)
        assert np.all(
            layer_weights[~np.broadcast_to(target_real[:, None, None, :], layer_weights.shape)] == 0
        )
        rows = layer_weights.sum(-1)[:, :, 0]  # the first position always sees itself
        np.testing.assert_allclose(rows, 1.0, atol=1e-5)


@pytest.mark.parametrize("mode", kt.ATTENTION_MODES)
def test_extra_source_padding_changes_no_logit(mode):
    model = _model(attention_mode=mode)
    inputs = _batch()
    padded = {**inputs, "source_ids": np.pad(inputs["source_ids"], ((0, 0), (0, 9)))}
    np.testing.assert_allclose(model(padded), model(inputs), atol=1e-5)


def test_extra_target_padding_changes_no_earlier_logit():
    model = _model()
    inputs = _batch()
    padded = {**inputs, "target_ids": np.pad(inputs["target_ids"], ((0, 0), (0, 4)))}
    np.testing.assert_allclose(np.asarray(model(padded))[:, :6], model(inputs), atol=1e-5)


def test_encode_then_decode_equals_call():
    model = _model()
    inputs = _batch()
    memory = model.encode(inputs["source_ids"])
    assert memory.shape == (3, 7, 64)
    np.testing.assert_allclose(
        model.decode(inputs["target_ids"], memory, inputs["source_ids"]), model(inputs), atol=1e-6
    )


def test_per_head_and_batched_models_agree_on_logits():
    model = _model()
    inputs = _batch()
    batched = np.asarray(model(inputs))
    model.set_attention_mode("per_head")
    assert all(
        layer.mode == "per_head"
        for layer in model._flatten_layers()
        if isinstance(layer, kt.MultiHeadAttention)
    )
    np.testing.assert_allclose(model(inputs), batched, atol=1e-5)


@pytest.mark.parametrize("saved_mode, loaded_mode", [("batched", "per_head"), ("per_head", "batched")])
def test_saved_model_reloads_safely_and_runs_in_the_other_mode(tmp_path, saved_mode, loaded_mode):
    model = _model(attention_mode=saved_mode, share_embeddings=False, tie_output=False)
    kt.compile_transformer(model)
    inputs = _batch()
    expected = np.asarray(model(inputs))
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert isinstance(loaded, kt.Transformer) and loaded.config == model.config
    np.testing.assert_allclose(loaded(inputs), expected, atol=1e-6)
    assert isinstance(loaded.loss, kt.LabelSmoothedCrossEntropy)
    schedule = loaded.optimizer.get_config()["learning_rate"]
    assert schedule["class_name"] == "NoamSchedule" and schedule["config"]["d_model"] == 64
    loaded.set_attention_mode(loaded_mode)
    np.testing.assert_allclose(loaded(inputs), expected, atol=1e-5)
    # and weights saved in one mode load into a model built in the other
    weights_path = tmp_path / "model.weights.h5"
    model.save_weights(weights_path)
    other = _model(attention_mode=loaded_mode, share_embeddings=False, tie_output=False)
    other.load_weights(weights_path)
    np.testing.assert_allclose(other(inputs), expected, atol=1e-5)


def _every_layer_instance():
    model = _model(norm_first=True, share_embeddings=False, tie_output=False)
    layers = [
        layer
        for layer in model._flatten_layers(include_self=True)
        if type(layer).__module__.startswith("keras_transformer")
    ]
    return layers + [
        kt.LabelSmoothedCrossEntropy(0.2, pad_id=1),
        kt.MaskedTokenAccuracy(pad_id=1),
        kt.NoamSchedule(256, warmup_steps=100, scale=2.0),
    ]


def test_every_layer_config_round_trips_through_json():
    instances = _every_layer_instance()
    classes = {type(instance) for instance in instances}
    assert {
        kt.MultiHeadAttention,
        kt.PositionwiseFeedForward,
        kt.SinusoidalPositionalEncoding,
        kt.TokenEmbedding,
        kt.EncoderLayer,
        kt.DecoderLayer,
        kt.Encoder,
        kt.Decoder,
        kt.Transformer,
    } <= classes
    for instance in instances:
        serialized = json.loads(json.dumps(keras.saving.serialize_keras_object(instance)))
        restored = keras.saving.deserialize_keras_object(serialized, safe_mode=True)
        assert type(restored) is type(instance)
        assert restored.get_config() == instance.get_config(), type(instance).__name__


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_gives_finite_float32_logits(policy):
    keras.config.set_dtype_policy(policy)
    model = _model()
    inputs = _batch()
    inputs["source_ids"][0] = 0  # a fully padded source row
    inputs["target_ids"][1] = 0  # a fully padded target row
    logits = model(inputs)
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    assert model.encoder.stack_layers[0].self_attention.compute_dtype == policy.split("_")[1]
    assert np.all(np.isfinite(logits))
    loss = kt.LabelSmoothedCrossEntropy()(inputs["target_ids"], logits)
    assert np.isfinite(float(loss))


def test_mixed_precision_logits_close_to_float32():
    inputs = _batch()
    reference = _model()
    expected = np.asarray(reference(inputs))
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = _model()
    model.set_weights(reference.get_weights())
    np.testing.assert_allclose(model(inputs), expected, atol=0.25)


def test_wrong_inputs_name_the_expected_keys():
    with pytest.raises(ValueError, match=r"expects a dict with keys \['source_ids', 'target_ids'\]"):
        _model()(np.ones((2, 3), "int32"))


def test_a_model_left_unbuilt_builds_inside_fit():
    # Built lazily in the first traced train step; nothing built may belong to that graph only.
    model = kt.Transformer(kt.TransformerConfig.from_preset("tiny", vocab_size=20))
    assert not model.built
    kt.compile_transformer(model, warmup_steps=10)
    inputs, labels = kt.sequence_task("copy", 64, vocab_size=20, max_length=6, seed=0)
    history = model.fit(inputs, labels, batch_size=16, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert model.built and model.count_params() > 0  # the fused train step never calls the model
    assert model(inputs).shape == (64, labels.shape[1], 20)


def test_decoder_stack_with_a_cache_returns_weights_of_the_cached_positions():
    """`return_weights=` and `cache=` together: the weights of a decoding step are the
    corresponding row of the full pass's (zero beyond the step), and the cache comes back."""
    model = _model()
    inputs = _batch()
    source, target = inputs["source_ids"], inputs["target_ids"]
    full = model.attention_weights(inputs)
    memory = model.encode(source)
    cache = model.init_cache(memory, max_length=6)
    source_mask = kt.padding_mask(source)
    for step in range(3):  # rows of real target tokens only (row 2 is padded from position 3)
        embedded = model.target_embedding(target[:, step : step + 1])
        _, self_weights, cross_weights, cache = model.decoder(
            embedded, memory_mask=source_mask, cache=cache, cache_step=step, return_weights=True
        )
        assert isinstance(cache, kt.DecodingCache)
        for layer in range(len(self_weights)):
            np.testing.assert_allclose(
                np.asarray(self_weights[layer])[:, :, 0, : step + 1],
                np.asarray(full["decoder_self"][layer])[:, :, step, : step + 1],
                atol=1e-5,
            )
            assert np.all(np.asarray(self_weights[layer])[:, :, 0, step + 1 :] == 0)
            np.testing.assert_allclose(
                np.asarray(cross_weights[layer])[:, :, 0],
                np.asarray(full["decoder_cross"][layer])[:, :, step],
                atol=1e-5,
            )


def test_decoder_memory_and_cache_mistakes_are_reported():
    model = _model()
    source = _batch()["source_ids"]
    memory = model.encode(source)
    cache = model.init_cache(memory, max_length=4)
    embedded = model.target_embedding(np.full((3, 1), 2))
    with pytest.raises(ValueError, match="pass the encoder output"):
        model.decoder(embedded)
    with pytest.raises(ValueError, match="do not also pass memory"):
        model.decoder(embedded, memory, cache=cache, cache_step=0)


def test_a_decoding_step_projects_with_a_given_transposed_embedding_matrix():
    """`decode_step(..., projection_kernel=)` (the tied embeddings transposed once, by a search
    under static shapes) gives `project`'s logits; a model with its own projection refuses it."""
    model = _model()
    source = _batch()["source_ids"]
    cache = model.init_cache(model.encode(source), max_length=4)
    mask = kt.padding_mask(source)
    tokens = np.full((3,), 2, "int32")
    logits, _ = model.decode_step(tokens, 0, cache, mask)
    kernel = np.transpose(np.asarray(model.target_embedding.embeddings))
    given, _ = model.decode_step(tokens, 0, cache, mask, projection_kernel=kernel)
    np.testing.assert_allclose(given, logits, atol=1e-5)
    untied = _model(tie_output=False)
    untied_cache = untied.init_cache(untied.encode(source), max_length=4)
    with pytest.raises(ValueError, match="has its own projection"):
        untied.decode_step(tokens, 0, untied_cache, mask, projection_kernel=kernel)
