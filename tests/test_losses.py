import keras
import numpy as np
import pytest

import keras_transformer as kt


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
    np.testing.assert_allclose(gradient.numpy(), _reference_gradient(labels, logits, epsilon),
                               atol=1e-7)


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
