"""The model core on another Keras backend (issue 16): build, `fit` on NumPy arrays and
on a tf.data dataset, greedy and beam search, save and load `.keras`, with the
same numbers as TensorFlow (`reference.py`, run in a TensorFlow subprocess on
the same `.keras` file).

The backend is fixed when Keras is imported, so this module runs in a process of
its own: `tests/test_other_backend.py` runs it under `KERAS_BACKEND=jax`; `KERAS_BACKEND=torch
pytest -p no:xdist tests/backends` runs it on PyTorch where torch is installed.
Under TensorFlow it is skipped.
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

BACKEND = keras.backend.backend()
pytestmark = pytest.mark.skipif(
    BACKEND == "tensorflow", reason="runs under KERAS_BACKEND=jax (tests/test_other_backend.py) or torch"
)

import keras_transformer as kt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import reference  # noqa: E402


@pytest.fixture(scope="module")
def tensorflow_run(tmp_path_factory):
    """The `.keras` file TensorFlow wrote and what TensorFlow computed with it."""
    directory = tmp_path_factory.mktemp("tensorflow")
    environment = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, os.path.join(HERE, "reference.py"), str(directory)],
        env=environment,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return str(directory / "model.keras"), dict(np.load(directory / "reference.npz"))


def _load(path):
    return keras.saving.load_model(path)


def _numpy(tensor):
    return keras.ops.convert_to_numpy(tensor)


def test_the_tensorflow_model_loads_and_computes_the_same_logits(tensorflow_run):
    path, expected = tensorflow_run
    model = _load(path)
    x, _ = reference.inputs()
    np.testing.assert_allclose(_numpy(model(x)), expected["logits"], atol=2e-5)


def test_greedy_and_beam_search_find_the_same_translations(tensorflow_run):
    path, expected = tensorflow_run
    model = _load(path)
    x, _ = reference.inputs()
    found = reference.searches(model, x)
    for name in ("greedy_ids", "beam_ids"):
        np.testing.assert_array_equal(found[name], expected[name], err_msg=name)
    for name in ("greedy_scores", "beam_scores"):
        np.testing.assert_allclose(found[name], expected[name], atol=1e-4, err_msg=name)


def test_fit_on_numpy_arrays_trains_as_tensorflow_does(tensorflow_run, caplog):
    path, expected = tensorflow_run
    model = _load(path)
    x, y = reference.inputs()
    with caplog.at_level("WARNING", logger="keras_transformer"):
        logs = reference.fit_two_steps(model, x, y)  # TensorFlow fused its step; here: logits
    assert f"fused train step is TensorFlow-only; on {BACKEND}" in caplog.text
    assert model.fused_step is None
    np.testing.assert_allclose(logs, expected["fit_logs"], rtol=1e-4)
    for i, weight in enumerate(model.weights):
        np.testing.assert_allclose(_numpy(weight), expected[f"w{i}"], atol=5e-5, err_msg=weight.path)


def test_fit_on_a_tf_data_dataset_matches_numpy_arrays(tensorflow_run):
    tf = pytest.importorskip("tensorflow")

    path, _ = tensorflow_run
    x, y = reference.inputs()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    trained = {}
    for name, data in (("arrays", (x, y)), ("dataset", (dataset,))):
        model = _load(path)
        kt.compile_transformer(model, optimizer=keras.optimizers.SGD(0.5), fused_step=False)
        if name == "arrays":
            history = model.fit(*data, batch_size=8, epochs=2, shuffle=False, verbose=0)
        else:
            history = model.fit(*data, epochs=2, shuffle=False, verbose=0)
        trained[name] = (history.history["loss"], [_numpy(w) for w in model.weights])
    np.testing.assert_allclose(trained["dataset"][0], trained["arrays"][0], rtol=1e-6)
    for ours, theirs in zip(trained["dataset"][1], trained["arrays"][1]):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)


def test_save_and_load_keras_on_this_backend(tensorflow_run, tmp_path):
    path, _ = tensorflow_run
    model = _load(path)
    x, y = reference.inputs()
    kt.compile_transformer(model, optimizer=keras.optimizers.SGD(0.5))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.save(tmp_path / f"{BACKEND}.keras")
    loaded = keras.saving.load_model(tmp_path / f"{BACKEND}.keras")
    np.testing.assert_array_equal(_numpy(loaded(x)), _numpy(model(x)))
    assert loaded.optimizer.iterations.numpy() == model.optimizer.iterations.numpy() == 2
    np.testing.assert_array_equal(
        _numpy(kt.beam_search(loaded, x["source_ids"][:2]).ids),
        _numpy(kt.beam_search(model, x["source_ids"][:2]).ids),
    )


def test_attention_modes_agree_on_this_backend(tensorflow_run):
    path, _ = tensorflow_run
    model = _load(path)
    x, _ = reference.inputs()
    batched = _numpy(model(x))
    model.set_attention_mode("per_head")
    np.testing.assert_allclose(_numpy(model(x)), batched, atol=1e-5)


def test_search_results_are_plain_tensors(tensorflow_run):
    """Decoding is inference: on PyTorch its results carry no autograd graph."""
    model = _load(tensorflow_run[0])
    x, _ = reference.inputs()
    result = kt.beam_search(model, x["source_ids"][:2], beam_size=2, max_extra_length=3)
    for tensor in result:
        assert not getattr(tensor, "requires_grad", False)
        np.asarray(tensor)  # converts without a detach
