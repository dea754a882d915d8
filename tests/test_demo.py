"""`make demo` end to end: the synthetic pair is learnable to BLEU >= 90, and
the exported SavedModel and ONNX graphs translate exactly like Keras.

It trains for ~8 minutes on 2 cores, so it runs only when asked
(`KERAS_TRANSFORMER_DEMO_TEST=1 make test`); `make demo` itself fails below
BLEU 90, which is the same check.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
    os.environ.get("KERAS_TRANSFORMER_DEMO_TEST") != "1",
    reason="~8 min of training; set KERAS_TRANSFORMER_DEMO_TEST=1",
)
def test_demo_reaches_bleu_90_on_the_synthetic_test_split(tmp_path):
    out = tmp_path / "demo"
    completed = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((out / "eval-synthetic-test.json").read_text())
    assert report["sentences"] == 500 and report["bleu"] >= 90
    parity = json.loads((out / "parity.json").read_text())
    assert all(r["identical"] == parity["sentences"] for r in parity["runtimes"].values()), parity
    assert parity["max_logit_difference"] < 1e-4
