"""Fixtures shared by the test modules."""

import time
import types

import keras
import pytest

import keras_transformer as kt

REVERSE_VOCAB = 20


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Downloads and token caches go to a temporary directory, not the user's ~/.cache (the CLI's
    subprocesses inherit it)."""
    import os

    os.environ["KERAS_TRANSFORMER_CACHE"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def import_script():
    """`import_script(name)`: the module of `scripts/<name>.py` (the folder is not a package; a
    script's own imports of its neighbours, such as `harness`, resolve while it is imported)."""
    import importlib
    import sys
    from pathlib import Path

    folder = str(Path(__file__).resolve().parents[1] / "scripts")

    def load(name):
        sys.path.insert(0, folder)
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(folder)

    return load


class _StopAtAccuracy(keras.callbacks.Callback):
    def __init__(self, target):
        super().__init__()
        self.target = target

    def on_epoch_end(self, epoch, logs=None):
        if logs["val_token_accuracy"] >= self.target:
            self.model.stop_training = True


@pytest.fixture(scope="session")
def reverse_model():
    """The tiny preset trained with `model.fit` to reverse sequences of 1-10 symbols.

    Phase 1 (timed) trains until held-out token accuracy reaches 0.985 and
    records the time and the re-evaluated accuracy; phase 2 trains a little
    longer so that the decoding tests get a model that decodes exactly.
    """
    keras.utils.set_random_seed(0)
    train_x, train_y = kt.sequence_task("reverse", 64 * 50 * 20, REVERSE_VOCAB, max_length=10, seed=1)
    val_x, val_y = kt.sequence_task("reverse", 500, REVERSE_VOCAB, max_length=10, seed=2)
    model = kt.Transformer.from_preset("tiny", vocab_size=REVERSE_VOCAB)
    # No XLA: on this 2-core CPU it compiles for ~20 s and then runs no faster.
    kt.compile_transformer(model, warmup_steps=200, learning_rate_scale=0.7)
    start = time.perf_counter()
    history = model.fit(
        train_x,
        train_y,
        batch_size=64,
        epochs=30,
        steps_per_epoch=50,
        validation_data=(val_x, val_y),
        callbacks=[_StopAtAccuracy(0.985)],
        verbose=0,
    )
    seconds = time.perf_counter() - start
    accuracy = model.evaluate(val_x, val_y, verbose=0, return_dict=True)["token_accuracy"]
    phase_1_epochs = len(history.history["loss"])
    model.fit(
        train_x,
        train_y,
        batch_size=64,
        epochs=phase_1_epochs + 25,
        steps_per_epoch=50,
        initial_epoch=phase_1_epochs,
        validation_data=(val_x, val_y),
        callbacks=[_StopAtAccuracy(0.999)],
        verbose=0,
    )
    return types.SimpleNamespace(
        model=model, seconds=seconds, epochs=phase_1_epochs, accuracy=accuracy, vocab=REVERSE_VOCAB
    )


@pytest.fixture(scope="session")
def multi30k_dir():
    """The shared Multi30k EN-DE copy beside the checkout (../shared/data/multi30k)."""
    import pathlib

    directory = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"
    if not (directory / "train.en").exists():
        pytest.skip(f"Multi30k not found at {directory}")
    return directory


@pytest.fixture(scope="session")
def synthetic_files(tmp_path_factory):
    """800 synthetic sentence pairs as two aligned UTF-8 files: `(source_path, target_path)`."""
    from keras_transformer.data.synthetic import SyntheticLanguagePair

    directory = tmp_path_factory.mktemp("corpus")
    sources, targets = SyntheticLanguagePair().corpus({"train": 800}, seed=5)["train"]
    (directory / "train.en").write_text("\n".join(sources) + "\n", encoding="utf-8")
    (directory / "train.de").write_text("\n".join(targets) + "\n", encoding="utf-8")
    return directory / "train.en", directory / "train.de"


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, synthetic_files):
    """A tiny model trained for 3 epochs through the CLI on the mirrored strategy (a run directory),
    with a peak learning rate, gradient clipping, validation BLEU and averaging at the end."""
    from keras_transformer import cli

    out = tmp_path_factory.mktemp("runs") / "tiny"
    status = cli.main(
        [
            "train",
            "--data",
            "files:{},{}".format(*synthetic_files),
            "--out",
            str(out),
            "--epochs",
            "3",
            "--strategy",
            "mirrored",
            "--preset",
            "tiny",
            "--vocab-size",
            "300",
            "--batch-tokens",
            "1024",
            "--warmup-steps",
            "50",
            "--learning-rate",
            "2e-3",
            "--clip-norm",
            "5",
            "--val-bleu",
            "8",
            "--average-last",
            "2",
        ]
    )
    assert status == 0
    return out


@pytest.fixture(scope="session")
def document_run(tmp_path_factory, synthetic_files):
    """A run directory as the documents assume `runs/demo` (a model, its tokenizer, its settings):
    the tiny preset trained for one epoch on one device, for the document tests that run on the
    worker without `trained_run` (conftest.py); it costs a fraction of `trained_run`."""
    from keras_transformer import cli

    out = tmp_path_factory.mktemp("runs") / "document"
    arguments = ["--preset", "tiny", "--vocab-size", "300", "--batch-tokens", "1024", "--warmup-steps", "50"]
    data = "files:{},{}".format(*synthetic_files)
    status = cli.main(
        ["train", "--data", data, "--out", str(out), "--epochs", "1", "--strategy", "default", *arguments]
    )
    assert status == 0
    return out


@pytest.fixture(scope="session")
def small_corpus(synthetic_files, tmp_path_factory):
    """`files:SRC,TGT` of the first 320 synthetic pairs (304 train, 16 held out): short epochs
    (about 25 batches of 1024 tokens) for the tests that train whole runs."""
    directory = tmp_path_factory.mktemp("small-corpus")
    for path in synthetic_files:
        lines = path.read_text(encoding="utf-8").splitlines()[:320]
        (directory / path.name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return "files:{},{}".format(*(directory / path.name for path in synthetic_files))


@pytest.fixture(scope="session")
def exported(trained_run, tmp_path_factory):
    """`keras-transformer export` of the tiny run, both formats: `(serving base dir, onnx dir)`;
    the SavedModel with the `translate_xla` signature."""
    from keras_transformer import cli

    directory = tmp_path_factory.mktemp("exports")
    serving, onnx_dir = directory / "serving", directory / "onnx"
    assert (
        cli.main(
            [
                "export",
                "--model",
                str(trained_run),
                "--format",
                "saved_model",
                "--out",
                str(serving),
                "--name",
                "tiny",
                # translate_xla too (tests/test_serving.py): 2 x 2 buckets, source lengths 16 and 128
                "--xla",
                "--xla-batch-sizes",
                "1,8",
                "--xla-source-lengths",
                "16",
            ]
        )
        == 0
    )
    assert cli.main(["export", "--model", str(trained_run), "--format", "onnx", "--out", str(onnx_dir)]) == 0
    return serving, onnx_dir
