"""Fault tolerance of `keras-transformer train`: SIGKILL and resume, NaN,
multi-worker training over two processes."""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import keras_transformer as kt
from keras_transformer.training.trainer import TrainingOptions, train

TINY = ["--preset", "tiny", "--vocab-size", "300", "--batch-tokens", "512", "--warmup-steps", "50"]


@pytest.fixture(scope="module")
def corpus_files(small_corpus):
    return small_corpus


def _command(data, out, *extra):
    return [
        sys.executable,
        "-m",
        "keras_transformer.cli",
        "train",
        "--data",
        data,
        "--out",
        str(out),
        *TINY,
        "--strategy",
        "default",
        *extra,
    ]


def _environment(**extra):
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", **extra)
    environment.pop("TF_CONFIG", None)
    environment.update(extra)
    return environment


def _wait_for(predicate, process, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        if process.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def test_sigkill_mid_epoch_then_same_command_resumes_and_finishes(corpus_files, tmp_path):
    out = tmp_path / "run"
    command = _command(corpus_files, out, "--epochs", "1", "--save-every-steps", "3", "--resume")
    state_path = out / "state" / "state.json"

    def mid_first_epoch():
        try:
            state = json.loads(state_path.read_text())
        except (OSError, ValueError):
            return False
        return state["epoch"] == 0 and state["step"] >= 6

    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_environment())
    try:
        assert _wait_for(mid_first_epoch, first, 600), first.communicate()[0].decode()[-3000:]
        os.kill(first.pid, signal.SIGKILL)
    finally:
        first.kill()
        first.communicate()  # reap it and close its pipe
    killed_at = json.loads(state_path.read_text())
    assert not (out / "model.keras").exists()

    second = subprocess.run(command, capture_output=True, text=True, env=_environment(), timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"epoch 1, step {killed_at['step']}" in second.stdout  # epoch and step restored

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "finished"
    assert [entry["epoch"] for entry in metrics["epochs"]] == [1]
    assert metrics["epochs"][0]["resumed_at_step"] == killed_at["step"]
    # No batch lost or repeated: the optimizer made exactly one update per batch.
    assert metrics["epochs"][-1]["optimizer_steps"] == metrics["batches_per_epoch"]
    assert not [name for name in os.listdir(out / "checkpoints") if name.startswith(".partial")]
    import keras_transformer as kt  # noqa: F401  (registers the layers)

    model = keras.saving.load_model(str(out / "model.keras"), compile=False)
    for path in (out / "checkpoints").glob("*.weights.h5"):
        model.load_weights(str(path))  # loads: not corrupt


class _PoisonWeights(keras.callbacks.Callback):
    """Turns one weight into NaN at a given epoch and batch (a divergence)."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            weight = self.model.weights[0]
            weight.assign(np.full(weight.shape, np.nan, "float32"))


def _tiny_options(out, data, **changes):
    """`TrainingOptions` of a quiet one-epoch tiny run on one device, with `changes`."""
    values = dict(preset="tiny", vocab_size=300, batch_tokens=1024, warmup_steps=50, epochs=1)
    values.update(strategy="default", verbose=0)
    return TrainingOptions(out=str(out), data=data, **{**values, **changes})


def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(corpus_files, tmp_path):
    out = tmp_path / "run"
    options = _tiny_options(out, corpus_files, epochs=4)
    result = train(options, callbacks=[_PoisonWeights(epoch=1, batch=3)], log=lambda *_: None)
    assert result.status == "stopped: non-finite loss at epoch 2, step 4"
    assert sorted(os.listdir(out / "checkpoints")) == ["epoch-0001.weights.h5", "manifest.json"]
    assert not (out / "model.keras").exists()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == result.status
    assert [entry["epoch"] for entry in metrics["epochs"]] == [1, 2]
    assert metrics["epochs"][0]["loss"] > 0 and metrics["epochs"][1]["loss"] is None
    model = result.model
    model.load_weights(str(out / "checkpoints" / "epoch-0001.weights.h5"))
    assert all(np.all(np.isfinite(np.asarray(w))) for w in model.weights)
    state = json.loads((out / "state" / "state.json").read_text())
    assert (state["epoch"], state["step"]) == (1, 0)  # the state after epoch 1, not the NaN one


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for handle in sockets:
        handle.bind(("127.0.0.1", 0))
    ports = [handle.getsockname()[1] for handle in sockets]
    for handle in sockets:
        handle.close()
    return ports


def test_two_workers_on_localhost_train_to_identical_weights(corpus_files, tmp_path):
    workers = [f"127.0.0.1:{port}" for port in _free_ports(2)]
    processes = []
    for index in range(2):
        tf_config = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})
        command = _command(corpus_files, tmp_path / f"worker{index}", "--steps", "6")
        command[command.index("default")] = "multi-worker"
        processes.append(
            subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=_environment(TF_CONFIG=tf_config),
            )
        )
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=600)[0].decode())
    finally:
        for process in processes:
            process.kill()
            process.communicate()
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
        assert "2 replica(s), --strategy multi-worker" in output
    import keras_transformer as kt  # noqa: F401

    models = [
        keras.saving.load_model(str(tmp_path / f"worker{i}" / "model.keras"), compile=False) for i in range(2)
    ]
    for first, second in zip(models[0].weights, models[1].weights):
        np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    metrics = [json.loads((tmp_path / f"worker{i}" / "metrics.json").read_text()) for i in range(2)]
    assert metrics[0]["epochs"][0]["loss"] == pytest.approx(metrics[1]["epochs"][0]["loss"])


@pytest.mark.parametrize(
    "extra, updates_per_batch",
    [
        (dict(grad_accum=2), 0.5),  # one update per two batches
        (dict(mixed_precision=True), 1.0),  # bfloat16 compute on CPU
    ],
)
def test_grad_accum_and_mixed_precision_train_through_the_trainer(
    corpus_files, tmp_path, extra, updates_per_batch
):
    options = _tiny_options(tmp_path / "run", corpus_files, **extra)
    policy = keras.config.dtype_policy().name
    result = train(options, log=lambda *_: None)
    assert result.status == "finished"
    assert keras.config.dtype_policy().name == policy  # the caller's global policy is restored
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    entry = metrics["epochs"][0]
    assert np.isfinite(entry["loss"]) and np.isfinite(entry["val_loss"])
    assert entry["optimizer_steps"] == int(metrics["batches_per_epoch"] * updates_per_batch)
    import keras_transformer as kt  # noqa: F401

    model = keras.saving.load_model(str(tmp_path / "run" / "model.keras"), compile=False)
    assert all(w.dtype == "float32" for w in model.weights)  # variables stay float32
    if extra.get("mixed_precision"):
        assert model.encoder.compute_dtype == "bfloat16"  # the mixed policy is the model's own


def test_resume_without_vocab_size_accepts_the_stored_vocabulary():
    from keras_transformer.training.setup import _check_same_run, _jsonable
    from keras_transformer.utils.checks import UserError

    stored = _jsonable(TrainingOptions(out="r", vocab_size=8000))
    _check_same_run(stored, TrainingOptions(out="r"))  # the default: whatever was stored
    with pytest.raises(UserError, match=r"vocab_size: 8000 -> 4000"):
        _check_same_run(stored, TrainingOptions(out="r", vocab_size=4000))


def test_time_budget_counts_the_time_a_resumed_run_already_spent():
    from keras_transformer.training.callbacks import TimeBudget

    class Model:
        stop_training = False

    fresh, resumed = TimeBudget(60.0), TimeBudget(60.0, spent=61.0)
    for budget in (fresh, resumed):
        budget.set_model(Model())
        budget.on_epoch_begin(0)
        budget.on_epoch_end(0)
    assert not fresh.exhausted and not fresh.model.stop_training
    assert resumed.exhausted and resumed.model.stop_training


def test_val_bleu_every_measures_every_kth_epoch_and_the_last():
    from keras_transformer.training.callbacks import ValidationBleu

    class EchoTranslator:  # translates each source into its reference
        def translate(self, sources):
            return [f"ref {source}" for source in sources], None

    callback = ValidationBleu(["a b c d", "e f g h"], ["ref a b c d", "ref e f g h"], None, every=3, last=7)
    callback.translator = EchoTranslator()
    measured = []
    for epoch in range(7):  # Keras counts epochs from 0
        logs = {"loss": 1.0}
        callback.on_epoch_end(epoch, logs)
        if "val_bleu" in logs:
            measured.append((epoch + 1, round(logs["val_bleu"])))
    assert measured == [(3, 100), (6, 100), (7, 100)]


def test_float16_with_loss_scaling_trains_and_resumes_on_mirrored_replicas(
    corpus_files, tmp_path, monkeypatch
):
    """What `--mixed-precision` takes on a GPU (`mixed_float16`: Keras wraps the optimizer in a
    `LossScaleOptimizer`, and the fused step scales the loss), here on two logical CPUs under
    `MirroredStrategy`: one epoch, then `--resume` for a second; finite falling losses, one update
    per global batch, float16 compute with float32 variables, the loss-scale optimizer both times."""
    from keras_transformer.training import setup

    monkeypatch.setattr(setup, "mixed_precision_policy", lambda: "mixed_float16")  # as with a GPU
    optimizers = []
    compile_transformer = setup.compile_transformer

    def compile_and_record(model, *args, **kwargs):
        compile_transformer(model, *args, **kwargs)
        optimizers.append(type(model.optimizer).__name__)

    monkeypatch.setattr(setup, "compile_transformer", compile_and_record)
    out = tmp_path / "run"
    for epochs, resume in ((1, False), (2, True)):
        changes = dict(batch_tokens=4096, warmup_steps=4, strategy="mirrored", mixed_precision=True)
        options = _tiny_options(out, corpus_files, epochs=epochs, resume=resume, **changes)
        assert train(options, log=lambda *_: None).status == "finished"
    assert optimizers == ["LossScaleOptimizer", "LossScaleOptimizer"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["replicas"] == 2 and [entry["epoch"] for entry in metrics["epochs"]] == [1, 2]
    losses = [entry["loss"] for entry in metrics["epochs"]]
    assert np.all(np.isfinite(losses)) and losses[1] < losses[0]
    assert np.isfinite(metrics["epochs"][1]["val_loss"])
    steps = [entry["optimizer_steps"] for entry in metrics["epochs"]]
    assert steps == [metrics["batches_per_epoch"], 2 * metrics["batches_per_epoch"]]  # no skipped update
    import keras_transformer as kt  # noqa: F401

    model = keras.saving.load_model(str(out / "model.keras"), compile=False)
    assert model.encoder.compute_dtype == "float16" and all(w.dtype == "float32" for w in model.weights)


class _ScriptedValidationLoss(keras.callbacks.Callback):
    """Validation that goes as scripted: epoch (interval) N's val_loss is `values[N - 1]`."""

    def __init__(self, values):
        super().__init__()
        self.values = values

    def on_epoch_end(self, epoch, logs=None):
        logs["val_loss"] = self.values[epoch]


def test_best_metric_val_bleu_needs_val_bleu():
    from keras_transformer.training.options import best_metric, check_options
    from keras_transformer.utils.checks import UserError

    with pytest.raises(UserError, match=r"--best-metric val_bleu needs --val-bleu N"):
        check_options(TrainingOptions(out="r", early_stopping=3, best_metric="val_bleu"))
    assert best_metric(TrainingOptions(out="r", val_bleu=50)) == "val_bleu"
    assert best_metric(TrainingOptions(out="r")) == "val_loss"


def test_training_intervals_count_updates_and_end_with_a_short_one():
    from keras_transformer.training.trainer import training_intervals

    assert training_intervals(TrainingOptions(out="r", epochs=3), 12) == (12, [12, 12, 12])
    assert training_intervals(TrainingOptions(out="r", steps=14, val_every_steps=5), 12) == (5, [5, 5, 4])
    accumulated = TrainingOptions(out="r", steps=4, val_every_steps=2, grad_accum=3)  # batches
    assert training_intervals(accumulated, 12) == (6, [6, 6])
    assert training_intervals(TrainingOptions(out="r", epochs=2, val_every_steps=5), 12) == (5, [5] * 4 + [4])


class _SignalAtBatch(keras.callbacks.Callback):
    """A SIGTERM after the run's `at`-th batch (counted over the whole run)."""

    def __init__(self, at):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            signal.raise_signal(signal.SIGTERM)


def test_steps_val_every_steps_and_early_stopping_resume_mid_interval_to_the_same_run(corpus_files, tmp_path):
    """--steps 20 --val-every-steps 5 on a corpus of 12-13 batches an epoch: intervals of 5 updates
    that cross the data's epoch boundary. Validation loss scripted 3.0, 2.0, 2.5, 1.0 with
    --early-stopping 1: the run stops after the third interval (no gain over the second) with the
    second's model as best.keras. Preempted at update 7 and resumed, the run ends with the same
    weights, the same best model and the same decision (rebuilt from metrics.json)."""
    from keras_transformer.training.checkpoints import average_checkpoints

    values = [3.0, 2.0, 2.5, 1.0]
    settings = dict(steps=20, val_every_steps=5, early_stopping=1, batch_tokens=1024)
    whole = train(
        _tiny_options(tmp_path / "whole", corpus_files, **settings),
        callbacks=[_ScriptedValidationLoss(values)],
        log=lambda line: None,
    )
    assert whole.status == "finished"
    assert [entry["optimizer_steps"] for entry in whole.epochs] == [5, 10, 15]
    metrics = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    assert metrics["best"] == {"epoch": 2, "val_loss": 2.0, "model": "best.keras"}
    assert metrics["early_stopped"] == {
        "after_epoch": 3,
        "metric": "val_loss",
        "patience": 1,
        "best_epoch": 2,
    }
    best = keras.saving.load_model(tmp_path / "whole" / "best.keras", compile=False)
    second = kt.Transformer.from_config(best.get_config())
    second.build()
    average_checkpoints(second, [str(tmp_path / "whole" / "checkpoints" / "epoch-0002.weights.h5")])
    for mine, expected in zip(best.get_weights(), second.get_weights()):
        np.testing.assert_array_equal(mine, expected)

    out, lines = tmp_path / "parts", []
    options = _tiny_options(out, corpus_files, **settings)
    preempted = train(
        options, callbacks=[_ScriptedValidationLoss(values), _SignalAtBatch(7)], log=lines.append
    )
    assert preempted.status == "preempted"
    resumed = train(
        dataclasses.replace(options, resume=True),
        callbacks=[_ScriptedValidationLoss(values)],
        log=lines.append,
    )
    assert [entry["optimizer_steps"] for entry in resumed.epochs] == [5, 10, 15]
    again = json.loads((out / "metrics.json").read_text())
    assert again["best"] == metrics["best"] and again["early_stopped"] == metrics["early_stopped"]
    assert "Early stopping: val_loss has not improved in 1 measurement(s); the best, epoch 2" in lines[-2]
    for mine, expected in zip(resumed.model.get_weights(), whole.model.get_weights()):
        np.testing.assert_allclose(mine, expected, atol=1e-6)
    resumed_best = keras.saving.load_model(out / "best.keras", compile=False)
    for mine, expected in zip(resumed_best.get_weights(), best.get_weights()):
        np.testing.assert_allclose(mine, expected, atol=1e-6)


@pytest.fixture(scope="module")
def source_run(corpus_files, tmp_path_factory):
    """A run directory as `train` leaves it (run.json, tokenizer.model, model.keras) holding an
    untrained tiny model: what `--init-from` starts from."""
    from keras_transformer.data.corpora import load_corpus
    from keras_transformer.training.run_directory import RunDirectory, save_model

    run = RunDirectory(tmp_path_factory.mktemp("source") / "run")
    run.path.mkdir()
    sources, targets = load_corpus(corpus_files)["train"]
    tokenizer = kt.Tokenizer.train(sources + targets, vocab_size=300)
    tokenizer.save(run.tokenizer_path)
    model = kt.Transformer.from_preset("tiny", vocab_size=tokenizer.vocab_size)
    run.write_json(run.settings_path, {"options": {}, "model": model.config.to_dict()})
    save_model(model, run.model_path)
    return run


def test_init_from_fine_tunes_a_trained_model_with_its_vocabulary_and_frozen_parts(
    source_run, corpus_files, tmp_path
):
    source = kt.load_model(source_run.path)
    options = _tiny_options(
        tmp_path / "tuned",
        corpus_files,
        init_from=str(source_run.path),
        freeze=["embeddings"],
        steps=3,
        vocab_size=None,
        preset="small",
        overrides={"dropout_rate": 0.3},
    )
    lines = []
    result = train(options, log=lines.append)
    assert result.status == "finished"
    assert any(line.startswith(f"Initialized from {source_run.model_path}") for line in lines)
    assert (tmp_path / "tuned" / "tokenizer.model").read_bytes() == source_run.tokenizer_path.read_bytes()
    tuned = result.model
    assert tuned.config.d_model == source.config.d_model and tuned.config.dropout_rate == 0.3  # not "small"
    np.testing.assert_array_equal(  # frozen: the source's weights, not a fresh initialization
        tuned.token_embedding.get_weights()[0], source.token_embedding.get_weights()[0]
    )
    moved = [
        not np.array_equal(mine, theirs)
        for mine, theirs in zip(tuned.encoder.get_weights(), source.encoder.get_weights())
    ]
    assert any(moved)  # trained from the source's weights


def test_init_from_and_tokenizer_mistakes_are_one_line_before_the_corpus_is_read(source_run, tmp_path):
    import sentencepiece

    from keras_transformer.utils.checks import UserError

    missing_corpus = "files:/nonexistent/a.src,/nonexistent/a.tgt"  # never reached
    other = tmp_path / "other.model"
    kt.Tokenizer.train(["a b c d e f g h"] * 50, vocab_size=270).save(other)
    sentencepiece.SentencePieceTrainer.train(  # SentencePiece's own default ids: <unk> 0, <s> 1, </s> 2
        sentence_iterator=iter(["x y z w"] * 50),
        model_prefix=str(tmp_path / "default_ids"),
        vocab_size=9,
        minloglevel=2,
    )
    cases = [
        (dict(init_from=str(source_run.path), tokenizer=str(other)), r"is not the vocabulary of --init-from"),
        (
            dict(init_from=str(source_run.path), vocab_size=500),
            r"--vocab-size 500, but --init-from .* 3\d\d pieces",
        ),
        (dict(init_from=str(tmp_path / "none")), r"is not a run directory"),
        (
            dict(tokenizer=str(tmp_path / "default_ids.model")),
            r"<pad> -1, <unk> 0, <s> 1, </s> 2; .* 0, 1, 2, 3",
        ),
        (
            dict(tokenizer=str(tmp_path / "absent.model")),
            r"--tokenizer .*absent.model: not a SentencePiece model",
        ),
        (dict(freeze=["decoder"]), r"--freeze must be some of embeddings, encoder"),
    ]
    for changes, message in cases:
        with pytest.raises(UserError, match=message):
            train(_tiny_options(tmp_path / "run", missing_corpus, **{"vocab_size": None, **changes}))
        assert not (tmp_path / "run").exists()


def test_back_translation_end_to_end_sampled_sources_tagged_and_mixed_by_weight(
    source_run, synthetic_files, tmp_path, monkeypatch, capsys
):
    """docs/training.md's back-translation recipe on the synthetic pair: target-side monolingual text
    -> sampled synthetic sources (`translate --sampling-topk 0 --seed S`) -> a corpus tagged <BT>,
    mixed by weight with the real pairs -> training. An untrained model stands in for the reverse
    model: the test pins the pipeline, not its quality."""
    import io

    from keras_transformer import cli

    sources, targets = (path.read_text(encoding="utf-8").splitlines() for path in synthetic_files)
    files = {}
    for name, lines in {
        "train.en": sources[:200],
        "train.de": targets[:200],
        "val.en": sources[200:216],
        "val.de": targets[200:216],
        "mono.de": targets[400:420],
    }.items():
        files[name] = tmp_path / name
        files[name].write_text("\n".join(lines) + "\n", encoding="utf-8")

    def sample(seed):
        stdin = io.TextIOWrapper(io.BytesIO(files["mono.de"].read_bytes()))
        monkeypatch.setattr(sys, "stdin", stdin)
        arguments = ["--sampling-topk", "0", "--seed", str(seed), "--max-extra-length", "8"]
        assert cli.main(["translate", "--model", str(source_run.path), *arguments]) == 0
        return capsys.readouterr().out

    synthetic = sample(1)
    # One line per input: sampled byte pieces that are line breaks (\r, \x1c, ...) are spaces.
    assert len(synthetic.splitlines()) == synthetic.count("\n") == 20
    files["synthetic.en"] = tmp_path / "synthetic.en"
    files["synthetic.en"].write_text(synthetic, encoding="utf-8")
    data = (
        "files:train={train_en},{train_de}@0.7;train={synthetic_en},{mono_de}@0.3#<BT>;val={val_en},{val_de}"
    )
    out = tmp_path / "run"
    arguments = [
        "--data",
        data.format(**{name.replace(".", "_"): path for name, path in files.items()}),
        "--out",
        str(out),
    ]
    status = cli.main(
        ["train", *arguments, *TINY, "--vocab-size", "600", "--strategy", "default", "--steps", "2"]
    )
    printed = capsys.readouterr()
    lines = printed.out
    assert status == 0, printed.err
    assert f"Training corpora mixed by weight: {files['train.en']} (200 pairs, 70% of each epoch), " in lines
    assert f"{files['synthetic.en']} (20 pairs, 30% of each epoch, tag <BT>)." in lines
    tokenizer = kt.Tokenizer.load(out / "tokenizer.model")
    assert tokenizer.ids_in_python(["<BT>"])[0][-1] == tokenizer.processor.piece_to_id("<BT>") > 3
