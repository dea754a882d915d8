import time

import keras
import numpy as np
import tensorflow as tf

import keras_transformer as kt


class _StopAtAccuracy(keras.callbacks.Callback):
    def __init__(self, target):
        super().__init__()
        self.target = target

    def on_epoch_end(self, epoch, logs=None):
        if logs["val_token_accuracy"] >= self.target:
            self.model.stop_training = True


def test_tiny_preset_learns_to_reverse_sequences_with_fit():
    vocab = 20
    train_inputs, train_labels = kt.sequence_task("reverse", 64 * 50 * 30, vocab, max_length=10, seed=1)
    val_inputs, val_labels = kt.sequence_task("reverse", 500, vocab, max_length=10, seed=2)
    model = kt.Transformer.from_preset("tiny", vocab_size=vocab)
    kt.compile_transformer(model, warmup_steps=200, learning_rate_scale=0.7, jit_compile=True)
    start = time.perf_counter()
    model.fit(train_inputs, train_labels, batch_size=64, epochs=30, steps_per_epoch=50,
              validation_data=(val_inputs, val_labels), callbacks=[_StopAtAccuracy(0.985)],
              verbose=0)
    elapsed = time.perf_counter() - start
    # Held-out sequences, teacher forcing, padding excluded.
    accuracy = model.evaluate(val_inputs, val_labels, verbose=0, return_dict=True)["token_accuracy"]
    assert accuracy >= 0.98, accuracy
    print(f"reverse task: {elapsed:.1f}s to token accuracy {accuracy:.4f}")
    assert elapsed < 90, f"took {elapsed:.0f}s"


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
