"""`make demo` end to end: the README's quick start, run exactly on the synthetic pair written as
text files, learns it to BLEU >= 90, and the exported SavedModel and ONNX graphs translate exactly
like Keras.

CI runs `make demo` after `make test` (`.ci/run`), and `make demo` fails below BLEU 90 or on any
export that differs. The demo trains for minutes, so in the suite it runs only when asked
(`KERAS_TRANSFORMER_DEMO_TEST=1`); what the suite always checks is that the README's quick start
is the demo's commands, so CI's demo run is a run of the quick start.
"""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _demo_module():
    spec = importlib.util.spec_from_file_location("demo", ROOT / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_quick_start():
    """The `keras-transformer` commands of the README's quick start block (the bash block that
    trains on `files:`), as argument lists, an `echo ... |` before one dropped."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    block = next(b for b in blocks if 'keras-transformer train --data "files:' in b)
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split("#")[0].strip()
        if line:
            words = shlex.split(line.split("|")[-1])
            assert words[0] == "keras-transformer", line
            commands.append(words[1:])
    return commands


def test_the_readmes_quick_start_is_what_the_demo_runs():
    assert sorted(readme_quick_start()) == sorted(_demo_module().quick_start())


@pytest.mark.skipif(
    os.environ.get("KERAS_TRANSFORMER_DEMO_TEST") != "1",
    reason="minutes of training (CI runs `make demo` itself); set KERAS_TRANSFORMER_DEMO_TEST=1",
)
def test_demo_reaches_bleu_90_and_the_exports_agree(tmp_path):
    out, data = tmp_path / "demo", tmp_path / "data"
    completed = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--out", str(out), "--data", str(data)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((out / "eval-files-test.json").read_text())
    assert report["sentences"] == 500 and report["bleu"] >= 90
    parity = json.loads((out / "parity.json").read_text())
    assert all(r["identical"] == parity["sentences"] for r in parity["runtimes"].values()), parity
    assert parity["max_logit_difference"] < 1e-4
