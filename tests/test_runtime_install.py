"""The runtime install of docs/deployment.md ("A runtime without TensorFlow"): its `pip install`
lines, run into a new virtual environment with this checkout as the package, give a Python that
cannot import TensorFlow or Keras and translates an ONNX export (every mode) and a CTranslate2
export exactly as the full install does.

The packages come from the package index (or pip's cache), as `make install`'s do; the lines
are read and run by `scripts/runtime_install_size.py`'s functions, which also measure the
install's size.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("ctranslate2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from runtime_install_size import documented_pip_lines, install  # noqa: E402

HEAVY = ("tensorflow", "tensorflow_text", "keras", "tf2onnx", "jax")


def pip_lines():
    return documented_pip_lines(ROOT)


def test_the_documented_install_names_the_package_last_without_its_dependencies():
    lines = pip_lines()
    assert len(lines) == 3, lines
    assert lines[-1] == ["--no-deps", ROOT], "the package goes last, with --no-deps"
    packages = " ".join(" ".join(line) for line in lines[:-1])
    for needed in ("numpy", "onnxruntime", "onnxruntime-extensions", "sentencepiece", "ctranslate2"):
        assert needed in packages, needed
    for heavy in ("tensorflow", "keras"):
        assert heavy not in packages, heavy


@pytest.fixture(scope="module")
def runtime_python(tmp_path_factory):
    """The Python of a new virtual environment holding only the documented runtime install
    (`scripts/runtime_install_size.py` installs the same lines to measure its size)."""
    return install(tmp_path_factory.mktemp("runtime-env") / "env", pip_lines())


@pytest.fixture(scope="module")
def ctranslate2_export(trained_run, tmp_path_factory):
    from keras_transformer.training.run_directory import RunDirectory, load_model
    from keras_transformer_export.ctranslate2 import export_ctranslate2

    model = load_model(trained_run / "model.keras")
    return export_ctranslate2(
        model, RunDirectory(trained_run).tokenizer(), tmp_path_factory.mktemp("ct2") / "m"
    )


def _translate(python, arguments, text):
    completed = subprocess.run(
        [python, "-m", *arguments, "--scores"],
        input=text,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert completed.returncode == 0, f"{' '.join(arguments)}:\n{completed.stderr[-3000:]}"
    return completed.stdout


def test_runtime_env_has_no_tensorflow_and_translates_as_the_full_install(
    runtime_python, exported, ctranslate2_export, synthetic_files
):
    found = subprocess.run(
        [
            runtime_python,
            "-c",
            "import importlib.util, sys; "
            f"print(' '.join(m for m in {HEAVY!r} if importlib.util.find_spec(m)))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == "", f"the runtime environment can import {found.stdout.strip()}"

    text = "\n".join(synthetic_files[0].read_text(encoding="utf-8").splitlines()[-12:]) + "\n"
    onnx_dir = str(exported[1])
    commands = [
        ["keras_transformer_export.onnx_runtime", onnx_dir, "--mode", mode]
        for mode in ("full", "split", "text", "lean")
    ]
    commands.append(["keras_transformer_export.ctranslate2", str(ctranslate2_export)])
    for command in commands:
        expected = _translate(sys.executable, command, text)
        assert len(expected.splitlines()) == 12
        assert _translate(runtime_python, command, text) == expected, command
