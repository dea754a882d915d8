import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_transformer as kt
from keras_transformer.training.fused_step import FusedOutputLossStep


def test_tiny_preset_learns_to_reverse_sequences_with_fit(reverse_model):
    # Trained in the `reverse_model` fixture: model.fit until the held-out
    # token accuracy (teacher forcing, padding excluded) reaches 0.985.
    print(
        f"reverse task: {reverse_model.epochs} x 50 steps ({reverse_model.seconds:.1f}s) to token "
        f"accuracy {reverse_model.accuracy:.4f}"
    )
    assert reverse_model.accuracy >= 0.98
    # Learning speed in updates, not seconds (the machine decides those): the fixture stops at
    # 0.985 within at most 30 epochs of 50 steps; reaching it before the cap is the criterion.
    assert reverse_model.epochs < 30


def _fit(model, optimizer, inputs, labels, steps):
    kt.compile_transformer(model, optimizer=optimizer)
    model.fit(inputs, labels, batch_size=len(labels) // steps, epochs=1, shuffle=False, verbose=0)
    return {weight.path: np.asarray(weight) for weight in model.weights}


def test_mirrored_strategy_step_equals_single_device_step():
    """Two fit steps on 2 replicas == on 1 device, every weight within 1e-5.

    SGD with a large learning rate turns any error in the gradient (its scale,
    or how replicas' tokens are weighted) straight into the weights. Adam is
    not used here: its first steps are lr * g / |g|, so weights whose gradient
    is at rounding-noise level (the key-projection bias, whose gradient is
    zero in theory since the softmax cancels it) move by +-lr depending on
    the summation order, on one device as much as on two.
    """
    config = kt.TransformerConfig.from_preset("tiny", vocab_size=30, dropout_rate=0.0)
    inputs, labels = kt.sequence_task("reverse", 32, 30, max_length=8, seed=3)
    # Uneven padding between the two replicas' halves of each global batch:
    # only a loss normalized by the *global* token count gives equal steps.
    order = np.argsort((labels != 0).sum(1))
    inputs = {key: value[order] for key, value in inputs.items()}
    labels = labels[order]

    single = kt.Transformer(config, name="transformer")
    single.build()
    initial = single.get_weights()
    expected = _fit(single, keras.optimizers.SGD(0.5), inputs, labels, steps=2)

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        mirrored = kt.Transformer(config, name="transformer")
        mirrored.build()
        mirrored.set_weights(initial)
        actual = _fit(mirrored, keras.optimizers.SGD(0.5), inputs, labels, steps=2)
    moved = max(np.abs(a - b).max() for a, b in zip(expected.values(), initial))
    assert moved > 1e-3  # the steps did change the weights
    assert actual.keys() == expected.keys()
    for path, expected_weight in expected.items():
        np.testing.assert_allclose(actual[path], expected_weight, atol=1e-5, err_msg=path)


def _train_steps(fused, jit_compile=False, tie_output=True, metrics=None, sample_weight=None):
    config = kt.TransformerConfig.from_preset("tiny", vocab_size=30, dropout_rate=0.0, tie_output=tie_output)
    inputs, labels = kt.sequence_task("reverse", 16, 30, max_length=8, seed=4)
    keras.utils.set_random_seed(5)
    model = kt.Transformer(config, name="transformer")
    model.build()
    kt.compile_transformer(model, optimizer=keras.optimizers.SGD(0.5), jit_compile=jit_compile)
    if metrics is not None:
        model.compile(
            optimizer=keras.optimizers.SGD(0.5), loss=model.loss, metrics=metrics, jit_compile=jit_compile
        )
    model.fused_step = FusedOutputLossStep() if fused else None
    steps = [
        model.train_on_batch(inputs, labels, sample_weight=sample_weight, return_dict=True) for _ in range(2)
    ]
    weights = {weight.path: np.asarray(weight) for weight in model.weights}
    return model, steps, weights


@pytest.mark.parametrize("jit_compile,tie_output", [(False, True), (True, True), (False, False)])
def test_fused_projection_and_loss_train_like_the_logits_path(jit_compile, tie_output):
    """`train_step`'s fused path (no logits, padding skipped) == Keras' step on logits:
    the logged loss and accuracy, and every weight after two SGD steps."""
    model, fused_steps, fused = _train_steps(True, jit_compile, tie_output)
    assert model.fused_step.fusable_loss(model, None) == (model.loss, None)  # the fused path ran
    assert model.fused_step.fallback_reason is None
    _, logit_steps, expected = _train_steps(False, jit_compile, tie_output)
    for fused_logs, logs in zip(fused_steps, logit_steps):
        assert fused_logs.keys() == logs.keys() == {"loss", "token_accuracy"}
        for name in logs:
            assert fused_logs[name] == pytest.approx(logs[name], rel=1e-5), name
    for path, weight in expected.items():
        np.testing.assert_allclose(fused[path], weight, atol=2e-5, err_msg=path)


def test_train_step_falls_back_to_logits_for_what_it_cannot_fuse(caplog):
    """Where the fused step cannot compute what was compiled, Keras' step runs, and the log says why."""
    metrics = [kt.MaskedTokenAccuracy(), "sparse_categorical_accuracy"]
    with caplog.at_level("WARNING", logger="keras_transformer"):
        model, steps, _ = _train_steps(True, metrics=metrics)
    assert model.fused_step.fallback_reason == "a compiled metric is not MaskedTokenAccuracy(pad_id)"
    assert "not fused: a compiled metric is not MaskedTokenAccuracy" in caplog.text
    assert {"token_accuracy", "sparse_categorical_accuracy"} <= set(steps[-1])
    model, steps, _ = _train_steps(True, sample_weight=np.linspace(0.5, 1.5, 16))
    assert model.fused_step.fusable_loss(model, np.ones(16)) == (None, "sample weights are given")
    assert np.isfinite(steps[-1]["loss"])


def test_compile_transformer_chooses_the_step_explicitly():
    model = kt.Transformer.from_preset("tiny", vocab_size=30)
    kt.compile_transformer(model)
    assert isinstance(model.fused_step, FusedOutputLossStep)  # TensorFlow backend
    kt.compile_transformer(model, fused_step=False)
    assert model.fused_step is None
    model.compile(optimizer="sgd", loss=kt.LabelSmoothedCrossEntropy())
    assert model.fused_step is None  # plain `compile`: Keras' own step


def test_peak_learning_rate_and_gradient_clipping_reach_the_optimizer():
    model = kt.Transformer.from_preset("tiny", vocab_size=50)
    model.build()
    kt.compile_transformer(model, warmup_steps=100, peak_learning_rate=5e-3, clip_norm=1.0)
    optimizer = model.optimizer
    assert optimizer.global_clipnorm == 1.0
    schedule = keras.saving.deserialize_keras_object(optimizer.get_config()["learning_rate"])
    rates = [float(schedule(step)) for step in (0, 49, 99, 399)]
    assert rates[2] == pytest.approx(5e-3, rel=1e-6)  # the peak, at step 100
    assert rates[1] == pytest.approx(2.5e-3, rel=1e-6)  # linear warmup
    assert rates[3] == pytest.approx(2.5e-3, rel=1e-6)  # 1/sqrt(step) after it
    assert rates[0] < rates[1] < rates[2]
