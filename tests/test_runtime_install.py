"""The runtime install of docs/deployment.md ("A runtime without TensorFlow"): its `pip install`
lines, run into a new virtual environment with this checkout as the package, give a Python that
cannot import TensorFlow or Keras and translates an ONNX export (every mode) and a CTranslate2
export exactly as the full install does.

The packages come from the package index (or pip's cache), as `make install`'s do.
"""

import os
import shlex
import subprocess
import sys
import venv

import pytest
from test_docs import code_blocks

pytest.importorskip("ctranslate2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENT = "docs/deployment.md"
PACKAGE = "path/to/keras-transformer"  # the documented line's stand-in for the checkout
HEAVY = ("tensorflow", "tensorflow_text", "keras", "tf2onnx", "jax")


def documented_block():
    """The bash block of docs/deployment.md that this test runs (its `not run` reason names it)."""
    [block] = [code for _, _, code, reason in code_blocks(DOCUMENT) if reason and __name__ in reason]
    return block


def pip_lines():
    """The block's `pip install` lines as argument lists (comments dropped, the checkout's path in)."""
    lines = []
    for line in documented_block().splitlines():
        words = shlex.split(line, comments=True)
        if words[:2] == ["pip", "install"]:
            lines.append([ROOT if word == PACKAGE else word for word in words[2:]])
    return lines


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
    """The Python of a new virtual environment holding only the documented runtime install."""
    directory = tmp_path_factory.mktemp("runtime-env") / "env"
    venv.EnvBuilder(with_pip=True).create(directory)
    python = str(directory / "bin" / "python")
    for arguments in pip_lines():
        completed = subprocess.run(
            [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *arguments],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )
        assert completed.returncode == 0, f"pip install {' '.join(arguments)}:\n{completed.stderr[-3000:]}"
    return python


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
        for mode in ("full", "split", "text")
    ]
    commands.append(["keras_transformer_export.ctranslate2", str(ctranslate2_export)])
    for command in commands:
        expected = _translate(sys.executable, command, text)
        assert len(expected.splitlines()) == 12
        assert _translate(runtime_python, command, text) == expected, command
