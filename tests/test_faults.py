"""What clusters do to a run: a second writer, a full disk, preemption (SIGTERM,
SIGINT), truncated or emptied files. Each test fails without its fix."""

import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

from keras_transformer import cli
from keras_transformer.training.checkpoints import CorruptCheckpoint, Snapshot, state_snapshots
from keras_transformer.training.locking import DirectoryBusy, WriterLock
from keras_transformer.training.preemption import EXIT_PREEMPTED, StopSignals
from keras_transformer.training.trainer import TrainingOptions, train
from keras_transformer.utils.files import StorageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--preset",
    "tiny",
    "--vocab-size",
    "300",
    "--batch-tokens",
    "1024",
    "--warmup-steps",
    "50",
    "--strategy",
    "default",
]


@pytest.fixture(scope="module")
def data(small_corpus):
    return small_corpus


def _options(data, out, **extra):
    values = dict(
        out=str(out),
        data=data,
        preset="tiny",
        vocab_size=300,
        batch_tokens=1024,
        warmup_steps=50,
        epochs=1,
        strategy="default",
        verbose=0,
    )
    values.update(extra)
    return TrainingOptions(**values)


def _quiet(*_):
    pass


def _env():
    return {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}


def _our_lines(text):
    return [line for line in text.splitlines() if line.startswith("keras-transformer:")]


def _partial_files(directory):
    return [str(p) for p in directory.rglob(".partial-*")]


def _weights(path):
    import keras_transformer  # noqa: F401  (registers the layers)

    model = keras.saving.load_model(str(path), compile=False)
    return [np.asarray(w) for w in model.weights]


# ------------------------------------------------------------------ one writer per directory
def test_second_writer_is_refused_with_the_holders_pid(trained_run, data, tmp_path, capsys, monkeypatch):
    exports = tmp_path / "exports"
    with WriterLock(trained_run):  # this process's pid is the holder's
        for command in (
            ["train", "--data", data, "--out", str(trained_run), "--resume", *TINY],
            ["average", "--model", str(trained_run), "--last", "2"],
        ):
            assert cli.main(command) == 2
            lines = _our_lines(capsys.readouterr().err)
            assert lines == [
                f"keras-transformer: error: {trained_run} is being written by another "
                f"process (pid {os.getpid()}); wait for it to finish or stop it, or "
                f"choose another directory."
            ], command
        # Readers keep working on the last complete files.
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"a b c\n"), encoding="utf-8"))
        assert cli.main(["translate", "--model", str(trained_run)]) == 0
        assert len(capsys.readouterr().out.splitlines()) == 1
    from keras_transformer_export.layout import export_lock

    for export_format, out in (("saved_model", exports), ("onnx", exports / "onnx")):
        with export_lock(export_format, out):
            assert (
                cli.main(
                    ["export", "--model", str(trained_run), "--format", export_format, "--out", str(out)]
                )
                == 2
            )
            assert f"(pid {os.getpid()})" in _our_lines(capsys.readouterr().err)[0]
    assert not (exports / "onnx").exists() and not list(exports.glob("*/1"))


HOLDER = """
import sys, time
from keras_transformer.training.locking import WriterLock
WriterLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def test_a_killed_writer_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DirectoryBusy, match=f"pid {holder.pid}\\)"):
            WriterLock(tmp_path).acquire()
        holder.kill()  # SIGKILL: no chance to clean up
        holder.wait(timeout=30)
    finally:
        holder.kill()
        holder.communicate()
    with WriterLock(tmp_path) as lock:
        assert lock.held


# ------------------------------------------------------------------ a full disk
def test_a_full_disk_stops_the_run_with_one_line_and_the_state_intact(data, tmp_path, monkeypatch, capsys):
    """ENOSPC injected into the second state save (the write path under HDF5's, see files.py)."""
    out = tmp_path / "run"
    real_fsync, saves = os.fsync, []

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if f"{os.sep}state{os.sep}.partial-" in target and target.endswith(".weights.h5"):
            saves.append(target)
            if len(saves) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    status = cli.main(
        ["train", "--data", data, "--out", str(out), *TINY, "--epochs", "1", "--save-every-steps", "5"]
    )
    monkeypatch.undo()
    assert status == 1
    lines = _our_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(
        f"keras-transformer: error: no space left on device while saving {out / 'state'}/state-"
    )
    assert lines[0].endswith("; free space and run the same command with --resume.")
    assert _partial_files(out) == []
    (newest,) = state_snapshots(out / "state")  # the step-5 state, complete and loadable
    assert (newest.epoch, newest.step) == (0, 5)
    newest.load_into(_tiny_model(out))  # (resuming from a state: the tests below)


FULL_DISK = """
set -u
mount -t tmpfs -o size=8m tmpfs "$1" || exit 97
cd "$1"
"$2" -m keras_transformer.cli train --data "$3" --out "$1/run" {tiny} --epochs 3 \
    > "$4/stdout" 2> "$4/stderr"
echo $? > "$4/status"
cp -a "$1/run" "$4/run"
"""


def test_a_real_full_disk_exits_1_without_a_crash(data, tmp_path):
    """`train` into an 8 MB tmpfs (mounted in a private mount namespace; skipped where none can be)."""
    mount_point, results = tmp_path / "small-disk", tmp_path / "results"
    mount_point.mkdir()
    results.mkdir()
    prefix = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    script = FULL_DISK.format(tiny=" ".join(TINY))
    try:
        completed = subprocess.run(
            [*prefix, "sh", "-c", script, "sh", str(mount_point), sys.executable, data, str(results)],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=600,
        )
    except FileNotFoundError:
        pytest.skip("no unshare(1) here")
    if completed.returncode == 97 or not (results / "status").exists():
        pytest.skip(f"cannot mount a tmpfs here: {completed.stderr.strip()[-300:]}")
    status = int((results / "status").read_text())
    stderr = (results / "stderr").read_text()
    assert status == 1, stderr[-3000:]  # not -11 (SIGSEGV inside HDF5)
    assert "Traceback" not in stderr and "Segmentation" not in stderr
    (line,) = _our_lines(stderr)
    assert "no space left on device while saving" in line and "--resume" in line
    assert _partial_files(results / "run") == []
    snapshots = state_snapshots(results / "run" / "state")
    assert snapshots, "no complete state survived"
    model = _tiny_model(results / "run")
    snapshots[0].load_into(model)  # the last complete state loads


def _tiny_model_of_size(vocab_size=40):
    import keras_transformer as kt

    model = kt.Transformer.from_preset("tiny", vocab_size=vocab_size)
    model.build()
    return model


def _tiny_model(run):
    """A compiled model of the run's config, as `train` builds it (for loading states into)."""
    import keras_transformer as kt

    settings = json.loads((run / "run.json").read_text())
    model = kt.Transformer(kt.TransformerConfig.from_dict(settings["model"]))
    model.build()
    kt.compile_transformer(model)
    return model


# ------------------------------------------------------------------ preemption
@pytest.fixture(scope="module")
def finished_run(data, tmp_path_factory):
    """One uninterrupted epoch, state saved every 4 steps: the end-of-epoch state (1, 0), the one
    before it (0, 4k) and checkpoint epoch-0001. The reference of the preemption test and the base of
    the corrupt-file tests (which damage copies)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train(_options(data, out, save_every_steps=4), log=_quiet).status == "finished"
    return out


def _signal_when(predicate, number, seconds=300):
    """Sends `number` to this process (from another thread, as a scheduler would) once `predicate()`."""

    def watch():
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if predicate():
                os.kill(os.getpid(), number)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_sigterm_mid_epoch_then_resume_equals_an_uninterrupted_run(data, finished_run, tmp_path, capsys):
    """SIGTERM while `keras-transformer train` runs: exit 75 with the state saved at a step
    boundary; the same command with --resume ends with the uninterrupted run's weights (to 1e-6;
    dropout is on, its RNG state is resumed too), optimizer step count and validation metrics."""
    out = tmp_path / "run"
    command = [
        "train",
        "--data",
        data,
        "--out",
        str(out),
        *TINY,
        "--epochs",
        "1",
        "--save-every-steps",
        "4",
        "--resume",
    ]

    def mid_epoch():
        try:
            return json.loads((out / "state" / "state.json").read_text())["step"] >= 4
        except (OSError, ValueError, KeyError):
            return False

    watcher = _signal_when(mid_epoch, signal.SIGTERM)
    assert cli.main(command) == EXIT_PREEMPTED
    watcher.join()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is removed again
    printed = capsys.readouterr()
    metrics = json.loads((out / "metrics.json").read_text())
    state = json.loads((out / "state" / "state.json").read_text())
    step = state["step"]
    assert metrics["status"] == "preempted" and metrics["epochs"] == []
    assert metrics["preempted_at"] == {"epoch": 1, "step": step, "signal": "SIGTERM"}
    # A step boundary, mid-epoch: the signal is sent once the save at step 4 is on disk, and it can
    # reach the trainer while step 4's callbacks still run (then it stops at 4, not later).
    assert state["epoch"] == 0 and 4 <= step < metrics["batches_per_epoch"]
    lines = printed.out.splitlines()
    assert "Received SIGTERM: stopping after the current step and saving the state" in lines[-2]
    assert lines[-1].startswith(f"Training stopped by SIGTERM at epoch 1, step {step};")
    assert lines[-1].endswith("Run the same command with --resume to continue.")
    assert "Traceback" not in printed.err and not (out / "model.keras").exists()
    assert _partial_files(out) == []

    assert cli.main(command) == 0
    assert f"epoch 1, step {step}." in capsys.readouterr().out
    for ours, theirs in zip(_weights(out / "model.keras"), _weights(finished_run / "model.keras")):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)
    ours, theirs = (json.loads((d / "metrics.json").read_text())["epochs"][-1] for d in (out, finished_run))
    assert ours["resumed_at_step"] == step and ours["optimizer_steps"] == theirs["optimizer_steps"]
    for key in ("val_loss", "val_token_accuracy"):  # the training loss covers the resumed part only
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key


def test_sigint_is_a_stop_request_and_a_second_one_interrupts():
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        lines = []
        with StopSignals(lines.append) as signals:
            signal.raise_signal(signal.SIGINT)
            assert signals.requested == "SIGINT" and lines == [
                "Received SIGINT: stopping after the current step and saving the state (send it "
                "again to stop at once)."
            ]
            with pytest.raises(KeyboardInterrupt):  # Python's own SIGINT handler again
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        # An ignored SIGINT (a background job, nohup) stays ignored.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with StopSignals(lines.append) as signals:
            signal.raise_signal(signal.SIGINT)
            assert signals.requested is None
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_a_second_sigterm_stops_the_process_at_once():
    """The first SIGTERM is a request; the second is delivered to the default handler, which ends
    the process with SIGTERM (exit status -15 as Python's subprocess reports it)."""
    code = (
        "import signal\n"
        "from keras_transformer.training.preemption import StopSignals\n"
        "with StopSignals(print) as signals:\n"
        "    signal.raise_signal(signal.SIGTERM)\n"
        "    print('requested', signals.requested, flush=True)\n"
        "    signal.raise_signal(signal.SIGTERM)\n"
        "    print('still running')\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == -signal.SIGTERM, completed.stderr
    assert completed.stdout.splitlines()[-1] == "requested SIGTERM"
    assert "still running" not in completed.stdout


def test_the_command_line_exits_130_on_an_interrupt_outside_the_stop_request(monkeypatch, capsys):
    """A second Ctrl-C while `train` stops (Python's KeyboardInterrupt, as above), or one in any
    other command: exit status 130 and one line, no traceback."""

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_presets", interrupted)
    assert cli.main(["presets"]) == 130
    assert capsys.readouterr().err.splitlines() == [
        "keras-transformer: interrupted; the last saved state is intact."
    ]


# ------------------------------------------------------------------ corrupt files
def _damage(path, how):
    if how == "truncate":
        size = path.stat().st_size
        with open(path, "r+b") as file:
            file.truncate(size // 2)
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "flip":  # same size, one byte changed in the middle
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, expected_warnings, resumed_at",
    [
        # The epoch-1 checkpoint is as new as the end-of-epoch state.
        ({"newest": "truncate"}, ["checksum mismatch"], "epoch 2, step 0."),
        # state.json lost: the states are found by their names (no checksum, so the load tells).
        (
            {"state.json": "empty", "newest": "truncate", "checkpoint": "empty"},
            ["does not load", "empty (0 bytes)"],
            "the previous state",
        ),
    ],
)
def test_resume_skips_a_corrupt_state_with_one_line(
    finished_run, data, tmp_path, damage, expected_warnings, resumed_at
):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    state = json.loads((out / "state" / "state.json").read_text())
    files = {
        "newest": out / "state" / state["weights"],
        "previous": out / "state" / state["previous"]["weights"],
        "state.json": out / "state" / "state.json",
        "checkpoint": out / "checkpoints" / "epoch-0001.weights.h5",
    }
    for name, how in damage.items():
        _damage(files[name], how)
    lines = []
    result = train(_options(data, out, save_every_steps=4, resume=True), log=lines.append)
    assert result.status == "finished"
    warnings = [line for line in lines if line.startswith("keras-transformer: warning:")]
    assert len(warnings) == len(expected_warnings)
    for line, reason in zip(warnings, expected_warnings):
        assert reason in line and "is corrupt" in line and "\n" not in line
    if resumed_at == "the previous state":
        resumed_at = f"epoch 1, step {state['previous']['step']}."
    assert [line for line in lines if line.startswith("Resuming from")][0].endswith(resumed_at)


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_average_refuses_a_corrupt_checkpoint(trained_run, tmp_path, capsys, how):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    (run / "averaged.keras").unlink(missing_ok=True)  # another test may have averaged the run
    _damage(run / "checkpoints" / "epoch-0002.weights.h5", how)
    assert cli.main(["average", "--model", str(run), "--last", "3"]) == 2
    (line,) = _our_lines(capsys.readouterr().err)
    assert line.startswith(
        f"keras-transformer: error: {run / 'checkpoints' / 'epoch-0002.weights.h5'} is corrupt ("
    )
    assert not (run / "averaged.keras").exists()


def test_export_refuses_a_corrupt_model(trained_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    _damage(run / "model.keras", "truncate")
    assert cli.main(["export", "--model", str(run), "--format", "onnx", "--out", str(tmp_path / "onnx")]) == 2
    (line,) = _our_lines(capsys.readouterr().err)
    assert line.startswith(f"keras-transformer: error: {run / 'model.keras'} cannot be loaded (")
    assert not (tmp_path / "onnx").exists()


def test_snapshot_problems_are_named(tmp_path):
    path = tmp_path / "x.weights.h5"
    assert Snapshot(str(path), 0, 0).problem() == "missing"
    path.write_bytes(b"")
    assert Snapshot(str(path), 0, 0).problem() == "empty (0 bytes)"
    path.write_bytes(b"abc")
    assert Snapshot(str(path), 0, 0, sha256="0" * 64).problem().startswith("checksum mismatch")
    with pytest.raises(CorruptCheckpoint, match=r"x\.weights\.h5 is corrupt \(does not load: "):
        Snapshot(str(path), 0, 0).load_into(_tiny_model_of_size())
    with pytest.raises(StorageError, match="^no space left on device while saving /x$"):
        raise StorageError("/x", OSError(errno.ENOSPC, "No space left on device"))
