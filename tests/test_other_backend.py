"""`tests/backends/` (the model core on JAX) in a process of its own, run from the main suite.

Keras fixes its backend when it is imported, so the JAX module cannot run in
this (TensorFlow) process. Launched from here, it runs on one pytest-xdist
worker while the other worker goes on with the rest of the suite, instead of
after it.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _environment(backend):
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST_", "KERAS_BACKEND"))  # the xdist worker's own settings
    }
    environment.update(KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    return environment


def test_the_backend_module_passes_on_jax():
    pytest.importorskip("jax")
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "tests/backends"],
        cwd=ROOT,
        env=_environment("jax"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stdout[-6000:] + completed.stderr[-3000:]
    summary = completed.stdout.strip().splitlines()[-1]
    with open(os.path.join(ROOT, "tests", "backends", "test_backend.py"), encoding="utf-8") as module:
        tests = len(re.findall(r"^def test_", module.read(), re.MULTILINE))
    # Every test ran on JAX: none skipped (a skip would mean the backend did not take).
    assert re.fullmatch(rf"{tests} passed in .*", summary), summary
    print(summary)
