"""The TensorFlow side of tests/backends/test_backend.py: `python reference.py DIR` (TensorFlow backend).

Builds the tiny model (dropout off), saves it as DIR/model.keras, and writes
DIR/reference.npz with what the same model computes on TensorFlow: logits,
greedy and beam-search ids and scores, the logs of two SGD steps of `fit` on
NumPy arrays, and the weights after them. The test on another backend loads
the same `.keras` file and must compute the same numbers.
"""

import os
import sys

import keras
import numpy as np

import keras_transformer as kt

VOCAB = 30


def inputs():
    x, y = kt.sequence_task("reverse", 16, VOCAB, max_length=8, seed=4)
    return x, y


def fit_two_steps(model, x, y, fused_step=True):
    kt.compile_transformer(model, optimizer=keras.optimizers.SGD(0.5), fused_step=fused_step)
    logs = [model.train_on_batch(x, y, return_dict=True) for _ in range(2)]
    return [logs[i][name] for i in range(2) for name in ("loss", "token_accuracy")]


def searches(model, x):
    greedy = kt.greedy_search(model, x["source_ids"][:4], max_extra_length=5)
    beam = kt.beam_search(model, x["source_ids"][:4], beam_size=3, max_extra_length=5, num_return=2)
    return dict(
        greedy_ids=keras.ops.convert_to_numpy(greedy.ids),
        greedy_scores=keras.ops.convert_to_numpy(greedy.scores),
        beam_ids=keras.ops.convert_to_numpy(beam.ids),
        beam_scores=keras.ops.convert_to_numpy(beam.scores),
    )


def main(directory):
    keras.utils.set_random_seed(3)
    model = kt.Transformer.from_preset("tiny", vocab_size=VOCAB, dropout_rate=0.0)
    model.save(os.path.join(directory, "model.keras"))
    x, y = inputs()
    logits = np.asarray(model(x))
    found = searches(model, x)
    fit_logs = fit_two_steps(model, x, y)
    weights = {f"w{i}": np.asarray(w) for i, w in enumerate(model.weights)}
    np.savez(os.path.join(directory, "reference.npz"), logits=logits, fit_logs=fit_logs, **found, **weights)


if __name__ == "__main__":
    assert keras.backend.backend() == "tensorflow", "run with KERAS_BACKEND=tensorflow"
    main(sys.argv[1])
