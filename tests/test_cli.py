"""The command line: bad input gives one line, exit status 2 and no run
directory; a tiny run trains, translates, evaluates, averages and draws."""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from keras_transformer import cli
from keras_transformer.decoding import policy

TINY = ["--preset", "tiny", "--vocab-size", "300", "--batch-tokens", "1024", "--warmup-steps", "50"]


@pytest.fixture(scope="module")
def parallel_files(synthetic_files):
    return synthetic_files


def _fails_cleanly(capsys, out, *arguments):
    status = cli.main(["train", "--out", str(out), *TINY, *arguments])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(error) == 1 and error[0].startswith("keras-transformer: error: "), error
    return error[0]


def _write(path, content):
    path.write_bytes(content)
    return path


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "no such file"),
        ("not_utf8", "line 3: not valid UTF-8"),
        ("counts", "has 3 lines but"),
        ("empty", "the corpus is empty"),
        ("unknown", "Unknown dataset 'wmt99'"),
        ("vocab", "vocab_size=300 is too large"),
    ],
)
def test_bad_input_gives_one_line_exit_2_and_no_run_directory(case, expected, tmp_path, capsys):
    good = _write(tmp_path / "good.txt", b"a b\nc d\ne f\n")
    latin1 = _write(tmp_path / "latin1.en", b"ok\nfine\ncaf\xe9\n")
    two_lines = _write(tmp_path / "two.de", b"x\ny\n")
    blank = _write(tmp_path / "blank.txt", b"\n\n")
    data = {
        "missing": f"files:{tmp_path / 'nope.en'},{good}",
        "not_utf8": f"files:{latin1},{good}",
        "counts": f"files:{good},{two_lines}",
        "empty": f"files:{blank},{blank}",
        "unknown": "wmt99",
        "vocab": f"files:{good},{good}",
    }[case]
    out = tmp_path / "run"
    message = _fails_cleanly(capsys, out, "--data", data)
    assert expected in message
    assert not out.exists()


@pytest.mark.parametrize(
    "arguments, expected",
    [
        (["--learning-rate", "0"], "argument --learning-rate: expected a number > 0, got '0'"),
        (["--learning-rate", "fast"], "argument --learning-rate: expected a number > 0"),
        (["--clip-norm", "-1"], "argument --clip-norm: expected a number > 0, got '-1'"),
        (["--clip-norm", "inf"], "argument --clip-norm: expected a number > 0"),
        (["--learning-rate-scale", "-2"], "argument --learning-rate-scale: expected a number > 0"),
        (["--max-minutes", "0"], "argument --max-minutes: expected a number > 0"),
        (["--val-bleu", "-5"], "argument --val-bleu: expected an integer >= 0, got '-5'"),
        (["--average-last", "0"], "argument --average-last: expected a positive integer, got '0'"),
        (
            ["--average-last", "6"],
            "--average-last 6 needs at least that many epoch checkpoints; raise --keep-checkpoints (now 5).",
        ),
        (
            ["--learning-rate", "1e-3", "--learning-rate-scale", "2"],
            "--learning-rate (the peak) and --learning-rate-scale both set the learning rate",
        ),
        (["--label-smoothing", "1"], "--label-smoothing must be in [0, 1); got 1.0."),
        (["--label-smoothing", "-0.1"], "--label-smoothing must be in [0, 1)"),
        (["--cooldown", "0"], "argument --cooldown: expected a number > 0, got '0'"),
        (["--cooldown", "1"], "--cooldown is a fraction of the run's updates, in (0, 1); got 1.0."),
    ],
)
def test_bad_training_option_gives_one_line_exit_2(arguments, expected, tmp_path, capsys):
    out = tmp_path / "run"
    try:
        status = cli.main(["train", "--out", str(out), *TINY, *arguments])
    except SystemExit as exit:  # argparse's own checks
        status = exit.code
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(error) == 1 and error[0].startswith("keras-transformer"), error
    assert expected in error[0]
    assert not out.exists()


def test_train_arguments_are_the_training_options_fields():
    """One place for defaults, help and limits: `train`'s parser is built from
    `TrainingOptions`, so parsing no option gives the dataclass' own defaults."""
    from keras_transformer.training.options import FIELDS, RUN_DEFINING, TrainingOptions

    parsed = cli.build_parser().parse_args(["train", "--out", "runs/x"])
    assert cli.training_options(parsed) == TrainingOptions(out="runs/x")
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for name, field in FIELDS.items():
        shown = field.metadata["command_line"]
        assert (f"--{name.replace('_', '-')} " in help_text or name == "overrides") == shown, name
        assert not shown or field.metadata["help"].split("(")[0].strip()[:20] in " ".join(help_text.split())
    assert "--set KEY=VALUE" in help_text and "(default: 4096)" in help_text
    overrides = ["--set", "dropout_rate=0.3", "--set", "num_layers=3"]
    parsed = cli.build_parser().parse_args(["train", "--out", "r", *overrides, "--xla", "--epochs", "2"])
    options = cli.training_options(parsed)
    assert options.overrides == {"dropout_rate": 0.3, "num_layers": 3} and options.xla and options.epochs == 2
    assert set(RUN_DEFINING) >= {"data", "preset", "overrides", "batch_tokens", "seed"}
    assert not {"epochs", "out", "resume", "overwrite", "strategy", "verbose"} & set(RUN_DEFINING)
    # A field reused with another default: the help shows the default that parser has.
    evaluate_help = cli.build_parser()._subparsers._group_actions[0].choices["evaluate"].format_help()
    data_help = " ".join(evaluate_help.split()).split("--data DATASET ")[-1].split(" --data-dir")[0]
    assert data_help == (
        "synthetic | multi30k | files:SRC,TGT | files:train=SRC,TGT;val=SRC,TGT;test=SRC,TGT"
    ), data_help  # required: no default


@pytest.mark.parametrize(
    "values, expected",
    [
        (dict(epochs=0), "--epochs must be a positive integer; got 0."),
        (dict(batch_tokens=2.5), "--batch-tokens must be a positive integer; got 2.5."),
        (dict(epochs=None), "--epochs must be a positive integer; got None."),
        (dict(val_bleu=True), "--val-bleu must be an integer >= 0; got True."),
        (dict(clip_norm=float("nan")), "--clip-norm must be a number > 0; got nan."),
        (dict(strategy="tpu"), "--strategy must be one of ['auto', 'default', 'mirrored', 'multi-worker']"),
    ],
)
def test_training_options_built_in_python_are_checked_by_the_command_line_parsers(values, expected):
    from keras_transformer.training.options import TrainingOptions, check_options
    from keras_transformer.utils.checks import UserError

    check_options(TrainingOptions(out="r", learning_rate=1e-3, clip_norm=1))  # valid: no error
    with pytest.raises(UserError) as error:
        check_options(TrainingOptions(out="r", **values))
    assert str(error.value).startswith(expected)


def test_bad_decoding_option_gives_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["evaluate", "--model", "x", "--data", "synthetic", "--length-penalty", "-0.5"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "keras-transformer: error: argument --length-penalty: expected a number >= 0, "
        "got '-0.5' (see keras-transformer evaluate --help)"
    ]


@pytest.mark.parametrize(
    "arguments, expected",
    [
        (
            ["--preset", "tinny"],
            "preset must be one of ['base', 'big', 'small', 'mini', 'tiny']; got 'tinny' "
            "(did you mean 'tiny'?)",
        ),
        (
            ["--set", "dropout=0.2"],
            "unknown TransformerConfig field 'dropout' (did you mean 'dropout_rate'?); "
            "the fields are: vocab_size, num_layers,",
        ),
        (["--set", "num_layers=three"], "num_layers must be a positive integer"),
        (["--set", "d_model=65"], "d_model=65 must be divisible by num_heads=4"),
    ],
)
def test_model_settings_are_checked_before_any_corpus_is_read(
    arguments, expected, tmp_path, capsys, monkeypatch
):
    from keras_transformer.training import setup

    def never(*args, **kwargs):
        raise AssertionError("the corpus was read before the settings were checked")

    monkeypatch.setattr(setup, "load_corpus", never)
    message = _fails_cleanly(capsys, tmp_path / "run", "--data", "synthetic", *arguments)
    assert expected in message, message
    assert not (tmp_path / "run").exists()


def test_a_malformed_data_argument_is_refused_whole(tmp_path, capsys, parallel_files):
    """A stray ';' is refused before any file is read (the paths here do not exist)."""
    for data in ("files:a.en,a.de;;val=b.en,b.de", "files:train=a.en,a.de;;", "files:;train=a.en,a.de"):
        message = _fails_cleanly(capsys, tmp_path / "run", "--data", data)
        assert "has an empty entry between ';' (a stray ';'?)" in message, message


def test_flags_are_never_abbreviated_and_errors_have_one_prefix(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["train", "--out", "r", "--epoch", "1"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "keras-transformer: error: unrecognized arguments: --epoch 1 (see keras-transformer train --help)"
    ]


def test_every_option_of_every_command_has_help_and_shows_its_default():
    parser = cli.build_parser()
    for name, command in parser._subparsers._group_actions[0].choices.items():
        for action in command._actions:
            if action.dest in ("help",) or not action.option_strings:
                continue
            assert action.help, f"{name} {action.option_strings[0]} has no help"
            shown = action.default not in (None, False, [], argparse.SUPPRESS)
            assert not shown or str(action.default) in action.help, f"{name} {action.option_strings[0]}"


def test_a_missing_model_file_is_named_as_missing(tmp_path, capsys):
    message = _translate_fails(capsys, "--model", str(tmp_path / "runs" / "mine" / "averagd.keras"))
    assert message == (
        f"keras-transformer: error: {tmp_path / 'runs' / 'mine' / 'averagd.keras'} does not exist "
        "(--model takes a run directory or a .keras file)."
    )


def _translate_fails(capsys, *arguments):
    status = cli.main(["translate", *arguments])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(error) == 1, error
    return error[0]


def test_translate_from_an_epoch_checkpoint(trained_run, monkeypatch, capsys):
    """`--checkpoint N` translates with the run's epoch-N checkpoint (the last one holds the final
    model's weights), and a missing epoch is named with the epochs there are."""
    import io

    from keras_transformer.training.run_directory import load_run_model

    final = load_run_model(trained_run)[1].get_weights()
    last = load_run_model(trained_run, checkpoint=3)[1].get_weights()
    second = load_run_model(trained_run, checkpoint=2)[1].get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(last, final))
    assert not all(np.array_equal(a, b) for a, b in zip(second, final))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the dog sees the cat\n")))
    assert cli.main(["translate", "--model", str(trained_run), "--checkpoint", "2", "--beam-size", "1"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    message = _translate_fails(capsys, "--model", str(trained_run), "--checkpoint", "9")
    assert "holds no checkpoint of epoch 9; it holds epochs [1, 2, 3]" in message, message


def test_train_warns_when_the_warmup_outlasts_the_run():
    from keras_transformer.training.options import TrainingOptions
    from keras_transformer.training.setup import _warn_if_warmup_outlasts_the_run

    said = []
    _warn_if_warmup_outlasts_the_run(TrainingOptions(out="r", epochs=1), 73, said.append)
    assert said and said[0].startswith(
        "Warning: --warmup-steps 4000 is longer than the whole run (73 updates"
    )
    said.clear()
    _warn_if_warmup_outlasts_the_run(TrainingOptions(out="r", epochs=10, warmup_steps=400), 113, said.append)
    assert said == []


def test_existing_run_directory_needs_resume_or_overwrite(tmp_path, capsys, parallel_files):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    message = _fails_cleanly(capsys, out, "--data", "files:{},{}".format(*parallel_files))
    assert "--resume" in message and "--overwrite" in message
    assert sorted(os.listdir(out)) == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    # --resume on a directory that holds no run.json is refused as well.
    message = _fails_cleanly(capsys, out, "--data", "files:{},{}".format(*parallel_files), "--resume")
    assert "not a run to resume" in message


def test_console_script_prints_one_error_line_and_exits_2(tmp_path):
    out = tmp_path / "run"
    completed = subprocess.run(
        [sys.executable, "-m", "keras_transformer.cli", "train", "--data", "nope", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 2
    # Nothing else: TensorFlow's C++ start-up lines are hidden (KERAS_TRANSFORMER_TF_LOGS=1 shows them).
    assert completed.stderr.splitlines() == [
        "keras-transformer: error: Unknown dataset 'nope'; use one of "
        "['synthetic', 'multi30k', 'files:SRC,TGT', 'files:train=SRC,TGT;val=SRC,TGT;test=SRC,TGT']."
    ]
    assert "Traceback" not in completed.stderr and not out.exists()


@pytest.mark.parametrize(
    "arguments", [["--help"], ["export", "--help"], ["translate"], ["train", "--epochs", "0"]]
)
def test_help_and_usage_errors_import_neither_keras_nor_tensorflow(arguments):
    """`--help` and a usage error answer at once (TensorFlow alone takes seconds to import)."""
    code = (
        "import sys\n"
        "from keras_transformer import cli\n"
        "try:\n"
        f"    cli.main({arguments!r})\n"
        "except SystemExit as stop:\n"
        "    status = stop.code\n"
        "heavy = sorted({'keras', 'tensorflow', 'jax', 'torch'} & set(sys.modules))\n"
        "print(status, heavy)\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    status, heavy = completed.stdout.strip().splitlines()[-1].split(" ", 1)
    assert heavy == "[]", f"{arguments} imported {heavy}"
    assert status == ("0" if "--help" in arguments else "2"), completed.stderr


def test_tensorflow_start_up_lines_are_recognized_and_nothing_else():
    from keras_transformer.utils import tensorflow

    hidden = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
        "I0000 00:00:1795619388.934317    4917 port.cc:153] oneDNN custom operations are on.\n",
        "To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow\n",
    ]
    kept = [
        "W0000 00:00:1795619388.93 4917 op_kernel.cc:1] a real warning\n",
        "E0000 00:00:1795619388.93 4917 something.cc:1] a real error\n",
        "UserWarning: a Python warning\n",
    ]
    assert all(tensorflow._is_start_up_line(line) for line in hidden)
    assert not any(tensorflow._is_start_up_line(line) for line in kept)


def test_mirrored_strategy_trains_through_the_cli(trained_run):
    metrics = json.loads((trained_run / "metrics.json").read_text())
    assert metrics["status"] == "finished" and metrics["replicas"] == 2
    assert [entry["epoch"] for entry in metrics["epochs"]] == [1, 2, 3]
    # --val-bleu 8: a greedy BLEU on 8 validation pairs after every epoch.
    assert all(0 <= entry["val_bleu"] <= 100 for entry in metrics["epochs"])
    assert all(entry["val_bleu_seconds"] > 0 for entry in metrics["epochs"])
    # --average-last 2 wrote averaged.keras from epochs 2 and 3 (checked in
    # test_average_is_the_mean_of_the_checkpoints).
    assert metrics["averaged"] == [2, 3]
    losses = [entry["loss"] for entry in metrics["epochs"]]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    for name in ("run.json", "tokenizer.model", "model.keras", "learning_curve.png"):
        assert (trained_run / name).is_file(), name
    assert sorted(os.listdir(trained_run / "checkpoints")) == [
        *(f"epoch-{n:04d}.weights.h5" for n in (1, 2, 3)),
        "manifest.json",
    ]
    assert any((trained_run / "logs").rglob("events.out.tfevents.*"))


def test_translate_reads_stdin_and_writes_one_line_per_input(trained_run, monkeypatch, capsys):
    import io

    lines = ["the dog sees the cat", "", "caf\u00e9 \U0001f600", "x " * 400]
    stdin = io.TextIOWrapper(io.BytesIO(("\n".join(lines) + "\n").encode("utf-8")))
    monkeypatch.setattr(sys, "stdin", stdin)
    assert cli.main(["translate", "--model", str(trained_run), "--beam-size", "2", "--scores"]) == 0
    output = capsys.readouterr().out.splitlines()
    assert len(output) == len(lines)
    assert all(np.isfinite(float(line.rsplit("\t", 1)[1])) for line in output)


def test_python_api_translates_and_scores_like_the_cli(trained_run, monkeypatch, capsys):
    import io

    import keras_transformer as kt

    sentences = ["the dog sees the cat", "a bird eats", ""]
    translator = kt.load_translator(trained_run, beam_size=2)
    texts, scores = translator.translate(sentences)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(sentences).encode() + b"\n")))
    assert cli.main(["translate", "--model", str(trained_run), "--beam-size", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == texts
    # The search's score is the log-likelihood of its translation over the length penalty, where
    # the text tokenizes back to the ids the search produced (text is what `score` takes; this
    # 3-epoch model's output need not round-trip, e.g. for the empty source).
    likelihoods = translator.score(sentences, texts)
    retokenized = translator.tokenizer.processor.encode(texts)
    lengths = np.array([len(ids) + 1 for ids in retokenized], np.float32)
    penalized = likelihoods / policy.length_penalty(lengths, 0.6)
    searched = kt.beam_search(translator.model, translator.encode(sentences), beam_size=2).ids.numpy()
    config = translator.model.config
    round_trip = [
        list(row[(row != config.pad_id) & (row != config.eos_id) & (row != config.bos_id)]) == pieces
        for row, pieces in zip(searched, retokenized)
    ]
    assert round_trip[0], "the first sentence's translation should round-trip"
    np.testing.assert_allclose(penalized[round_trip], scores[round_trip], rtol=1e-4)
    with pytest.raises(ValueError, match="one target per source"):
        translator.score(sentences, texts[:1])
    averaged = kt.load_translator(trained_run / "averaged.keras", beam_size=2)
    assert averaged.model is not translator.model and len(averaged.translate(sentences[:1])[0]) == 1


def test_evaluate_average_and_attention(trained_run, parallel_files, capsys, tmp_path):
    assert (trained_run / "averaged.keras").is_file()  # train --average-last 2
    assert (
        cli.main(
            ["average", "--model", str(trained_run), "--last", "2", "--output", str(tmp_path / "again.keras")]
        )
        == 0
    )
    assert (tmp_path / "again.keras").is_file()
    data = "files:{},{}".format(*parallel_files)
    assert (
        cli.main(
            [
                "evaluate",
                "--model",
                str(trained_run / "averaged.keras"),
                "--data",
                data,
                "--split",
                "train",
                "--limit",
                "20",
                "--beam-size",
                "2",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "BLEU" in printed and "nrefs:1|case:mixed|eff:no|tok:13a" in printed
    report = json.loads((trained_run / "eval-files-train.json").read_text())
    assert report["sentences"] == 20 and 0 <= report["bleu"] <= 100
    assert 0 <= report["paper_bleu"] <= 100 and "tok:none" in report["paper_signature"]
    assert len((trained_run / "translations-files-train.txt").read_text().splitlines()) == 20
    picture = tmp_path / "attention.png"
    assert (
        cli.main(
            [
                "attention",
                "--model",
                str(trained_run),
                "--text",
                "the dog sees the cat",
                "--out",
                str(picture),
            ]
        )
        == 0
    )
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["average", "--model", str(trained_run), "--last", "9"]) == 2
    assert "holds 3 epoch checkpoint(s)" in capsys.readouterr().err


def test_average_is_the_mean_of_the_checkpoints(trained_run):
    import keras

    import keras_transformer as kt

    settings = json.loads((trained_run / "run.json").read_text())
    model = kt.Transformer(kt.TransformerConfig.from_dict(settings["model"]))
    model.build()
    kt.compile_transformer(model)
    values = []
    for epoch in (2, 3):
        model.load_weights(str(trained_run / "checkpoints" / f"epoch-{epoch:04d}.weights.h5"))
        values.append([np.asarray(w) for w in model.weights])
    averaged = keras.saving.load_model(str(trained_run / "averaged.keras"), compile=False)
    for weight, first, second in zip(averaged.weights, *values):
        np.testing.assert_allclose(np.asarray(weight), (first + second) / 2, rtol=1e-6, atol=1e-7)
