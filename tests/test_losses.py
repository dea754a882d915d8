import keras
import numpy as np
import pytest

import keras_transformer as kt
from keras_transformer.training import losses as loss_functions


def _reference_loss(labels, logits, epsilon, pad_id=0):
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    vocab = logits.shape[-1]
    target = np.full(logits.shape, epsilon / vocab)
    np.put_along_axis(target, labels[..., None], 1 - epsilon + epsilon / vocab, axis=-1)
    per_token = -(target * log_probs).sum(-1)
    real = labels != pad_id
    return per_token[real].sum() / real.sum()


def _labels_and_logits(seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(1, 11, size=(4, 6))
    labels[0, 3:] = 0
    labels[2, 1:] = 0
    return labels, rng.normal(size=(4, 6, 11)).astype("float32") * 3


@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.3])
def test_loss_is_cross_entropy_against_smoothed_targets_over_real_tokens(epsilon):
    labels, logits = _labels_and_logits()
    loss = kt.LabelSmoothedCrossEntropy(label_smoothing=epsilon)(labels, logits)
    np.testing.assert_allclose(float(loss), _reference_loss(labels, logits, epsilon), rtol=1e-5)


def _reference_gradient(labels, logits, epsilon, pad_id=0):
    """d mean-loss / d logits = (softmax - smoothed target) / real tokens, zero at padding."""
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    vocab = logits.shape[-1]
    target = np.full(logits.shape, epsilon / vocab)
    np.put_along_axis(target, labels[..., None], 1 - epsilon + epsilon / vocab, axis=-1)
    real = (labels != pad_id)[..., None]
    return (probs - target) * real / real.sum()


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_loss_gradient_is_softmax_minus_smoothed_target(epsilon, jit_compile):
    import tensorflow as tf

    labels, logits = _labels_and_logits()
    loss = kt.LabelSmoothedCrossEntropy(label_smoothing=epsilon)

    @tf.function(jit_compile=jit_compile)
    def value_and_gradient(logits):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            value = loss(labels, logits)
        return value, tape.gradient(value, logits)

    value, gradient = value_and_gradient(tf.constant(logits))
    np.testing.assert_allclose(float(value), _reference_loss(labels, logits, epsilon), rtol=1e-5)
    np.testing.assert_allclose(gradient.numpy(), _reference_gradient(labels, logits, epsilon), atol=1e-7)


def test_padding_logits_do_not_matter():
    labels, logits = _labels_and_logits()
    changed = logits.copy()
    changed[labels == 0] += 100.0
    loss = kt.LabelSmoothedCrossEntropy()
    assert float(loss(labels, changed)) == pytest.approx(float(loss(labels, logits)), rel=1e-6)


def test_reductions_and_sample_weight():
    labels, logits = _labels_and_logits()
    per_token = np.asarray(kt.LabelSmoothedCrossEntropy(reduction="none")(labels, logits))
    assert per_token.shape == labels.shape and np.all(per_token[labels == 0] == 0)
    total = float(kt.LabelSmoothedCrossEntropy(reduction="sum")(labels, logits))
    assert total == pytest.approx(per_token.sum(), rel=1e-5)
    weights = np.array([1.0, 0.0, 2.0, 1.0])
    weighted = float(kt.LabelSmoothedCrossEntropy()(labels, logits, sample_weight=weights))
    real = (labels != 0) * weights[:, None]
    assert weighted == pytest.approx((per_token * weights[:, None]).sum() / real.sum(), rel=1e-5)


def test_bad_loss_arguments():
    with pytest.raises(ValueError, match="label_smoothing must be a number in"):
        kt.LabelSmoothedCrossEntropy(label_smoothing=1.0)
    with pytest.raises(ValueError, match="reduction must be one of"):
        kt.LabelSmoothedCrossEntropy(reduction="sum_over_batch_size")


def test_token_accuracy_ignores_padding_and_accumulates():
    metric = kt.MaskedTokenAccuracy()
    labels = np.array([[5, 6, 0, 0]])
    logits = np.zeros((1, 4, 8), "float32")
    logits[0, 0, 5] = logits[0, 1, 2] = 1.0  # right, wrong, then padding predicted "wrong"
    metric.update_state(labels, logits)
    assert float(metric.result()) == pytest.approx(0.5)
    metric.update_state(np.array([[7, 0, 0, 0]]), np.eye(8, dtype="float32")[[7, 1, 1, 1]][None])
    assert float(metric.result()) == pytest.approx(2 / 3)


def test_token_accuracy_equals_argmax_accuracy():
    labels, logits = _labels_and_logits(seed=3)
    logits[labels == 3, 3] += 10.0  # some right, most wrong
    metric = kt.MaskedTokenAccuracy()
    metric.update_state(labels, logits)
    real = labels != 0
    expected = (logits.argmax(-1) == labels)[real].mean()
    assert 0 < expected < 1
    assert float(metric.result()) == pytest.approx(expected)


def _projected_case(seed=0, tokens=23, width=5, vocab=11):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(tokens, width)).astype("float32")
    kernel = rng.normal(size=(vocab, width)).astype("float32")
    bias = 0.01 * rng.normal(size=(vocab,)).astype("float32")
    labels = rng.integers(0, vocab, size=tokens)
    labels[::3] = (hidden @ kernel.T).argmax(-1)[::3]  # some predictions right
    weights = (rng.random(tokens) < 0.6) * rng.choice([0.5, 1.0, 2.0], size=tokens)
    return hidden, kernel, bias, labels, weights.astype("float32")


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_projected_loss_equals_projecting_then_the_loss(with_bias, jit_compile):
    """Sums, counts and all three gradients match logits -> `smoothed_cross_entropy`,
    with chunks of 4 positions (several, the last one partly used) and zero
    weights scattered among the positions; unknown lengths without XLA."""
    import tensorflow as tf

    hidden, kernel, bias, labels, weights = _projected_case()
    bias = bias if with_bias else None

    def reference(hidden, kernel, bias):
        logits = tf.matmul(hidden, kernel, transpose_b=True) + (0.0 if bias is None else bias)
        losses = loss_functions.smoothed_cross_entropy(labels, logits, 0.1)
        hits = tf.cast(tf.gather(logits, labels, batch_dims=1) >= tf.reduce_max(logits, -1), "float32")
        return tf.reduce_sum(losses * weights), tf.reduce_sum(hits * weights)

    def projected(hidden, kernel, bias):
        return loss_functions.projected_smoothed_cross_entropy(
            hidden, kernel, labels, weights, 0.1, bias=bias, chunk_size=4
        )

    results = []
    for function in (reference, projected):
        signature = None if jit_compile else [tf.TensorSpec((None, 5)), tf.TensorSpec((11, 5))]

        @tf.function(jit_compile=jit_compile, input_signature=signature)
        def value_and_gradients(hidden, kernel, function=function):
            variables = [hidden, kernel] + ([] if bias is None else [tf.constant(bias)])
            with tf.GradientTape() as tape:
                tape.watch(variables)
                total, correct = function(*variables[:2], variables[2] if bias is not None else None)
                scaled = 3.0 * total  # an upstream gradient other than 1
            return total, correct, tape.gradient(scaled, variables)

        results.append(value_and_gradients(tf.constant(hidden), tf.constant(kernel)))
    (total, correct, gradients), (fused_total, fused_correct, fused_gradients) = results
    assert 0 < float(correct) < float(tf.reduce_sum(weights))
    np.testing.assert_allclose(float(fused_total), float(total), rtol=1e-5)
    assert float(fused_correct) == float(correct)
    for expected, actual in zip(gradients, fused_gradients):
        np.testing.assert_allclose(actual.numpy(), expected.numpy(), atol=1e-5)


def test_projected_loss_of_only_padding_is_zero_with_zero_gradients():
    import tensorflow as tf

    hidden, kernel, _, labels, _ = _projected_case()
    hidden, kernel = tf.constant(hidden), tf.constant(kernel)
    with tf.GradientTape() as tape:
        tape.watch([hidden, kernel])
        total, correct = loss_functions.projected_smoothed_cross_entropy(
            hidden, kernel, labels, np.zeros(len(labels), "float32"), 0.1, chunk_size=4
        )
    gradients = tape.gradient(total, [hidden, kernel])
    assert float(total) == 0.0 and float(correct) == 0.0
    assert all(float(tf.reduce_max(tf.abs(gradient))) == 0.0 for gradient in gradients)


def test_loss_from_decoder_output_matches_the_loss_on_logits():
    labels, _ = _labels_and_logits()
    rng = np.random.default_rng(1)
    hidden = rng.normal(size=labels.shape + (5,)).astype("float32")
    kernel = rng.normal(size=(11, 5)).astype("float32")
    logits = hidden @ kernel.T
    for reduction in ("mean", "sum"):
        loss = kt.LabelSmoothedCrossEntropy(reduction=reduction)
        value, correct, count = loss.from_decoder_output(labels, hidden, kernel)
        assert float(value) == pytest.approx(float(loss(labels, logits)), rel=1e-5)
        metric = kt.MaskedTokenAccuracy()
        metric.update_state(labels, logits)
        assert (float(correct), float(count)) == (float(metric.correct), float(metric.count))
    with pytest.raises(ValueError, match='reduction="none" is not supported'):
        kt.LabelSmoothedCrossEntropy(reduction="none").from_decoder_output(labels, hidden, kernel)


def test_noam_schedule_follows_section_5_3():
    schedule = kt.NoamSchedule(d_model=512, warmup_steps=4000)

    def paper(step):
        return 512**-0.5 * min(step**-0.5, step * 4000**-1.5)

    for iterations in (0, 1, 99, 3999, 4000, 15999, 99999):
        assert float(schedule(iterations)) == pytest.approx(paper(iterations + 1), rel=1e-5)
    assert float(schedule(15999)) == pytest.approx(float(schedule(3999)) / 2, rel=1e-4)


def test_compile_helper_uses_the_papers_adam():
    model = kt.Transformer.from_preset("tiny", vocab_size=20)
    kt.compile_transformer(model, warmup_steps=100)
    config = model.optimizer.get_config()
    assert (config["beta_1"], config["beta_2"], config["epsilon"]) == (0.9, 0.98, 1e-9)
    assert keras.saving.deserialize_keras_object(config["learning_rate"]).warmup_steps == 100
    assert model.loss.label_smoothing == 0.1


def test_noam_schedule_counts_updates_under_gradient_accumulation():
    plain = kt.NoamSchedule(d_model=64, warmup_steps=10)
    accumulated = kt.NoamSchedule(d_model=64, warmup_steps=10, steps_per_update=4)
    for update in range(6):
        for call in range(4):  # Keras evaluates the schedule at every optimizer call
            assert float(accumulated(4 * update + call)) == pytest.approx(float(plain(update)))


def test_noam_schedule_cooldown_falls_linearly_to_zero_over_the_last_updates():
    plain = kt.NoamSchedule(d_model=64, warmup_steps=10)
    cooled = kt.NoamSchedule(d_model=64, warmup_steps=10, total_steps=100, cooldown_steps=20)
    for iterations in range(120):  # update iterations + 1
        remaining = 100 - iterations  # this update and those after it
        factor = min(1.0, max(0.0, remaining / 20))
        assert float(cooled(iterations)) == pytest.approx(float(plain(iterations)) * factor, rel=1e-6)
    assert float(cooled(99)) > 0 and float(cooled(100)) == 0  # the last update moves; none after it
    # Serialized with the model's optimizer, so a resumed run keeps its cooldown.
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(cooled))
    assert (again.total_steps, again.cooldown_steps) == (100, 20)
    accumulated = kt.NoamSchedule(64, 10, steps_per_update=4, total_steps=100, cooldown_steps=20)
    assert float(accumulated(4 * 90 + 3)) == pytest.approx(float(cooled(90)))  # counts updates
    with pytest.raises(ValueError, match="total_steps"):
        kt.NoamSchedule(64, 10, cooldown_steps=20)
    with pytest.raises(ValueError, match="at most total_steps"):
        kt.NoamSchedule(64, 10, total_steps=10, cooldown_steps=20)


def test_cooldown_option_counts_the_runs_updates():
    from keras_transformer.training.options import TrainingOptions
    from keras_transformer.training.setup import cooldown_updates

    assert cooldown_updates(TrainingOptions(out="r", epochs=50), 145) == (None, 0)
    assert cooldown_updates(TrainingOptions(out="r", epochs=50, cooldown=0.2), 145) == (7250, 1450)
    assert cooldown_updates(TrainingOptions(out="r", steps=1000, cooldown=0.1), 145) == (1000, 100)
    options = TrainingOptions(out="r", epochs=10, grad_accum=4, cooldown=0.5)
    assert cooldown_updates(options, 145) == (362, 181)  # 1,450 batches: updates span epochs
    assert cooldown_updates(TrainingOptions(out="r", steps=3, cooldown=0.01), 145) == (3, 1)
