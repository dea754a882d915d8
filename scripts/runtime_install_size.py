"""The runtime install of docs/deployment.md ("A runtime without TensorFlow"), and its size
beside the full install's.

`documented_pip_lines` reads the `pip install` lines of that document's block (the block
`tests/test_runtime_install.py` runs, which says so in its `not run` reason) and
`install` runs them into a virtual environment, so the script and the test install exactly
what the document says. The script creates, each in a new virtual environment, the runtime
install without and with CTranslate2 and the full install (`pip install` of this checkout with
its dependencies) without and with CTranslate2, and reports the size of each environment's
`site-packages` (pip and setuptools included in all).

    python scripts/runtime_install_size.py [--json results/runtime_install_size.json]
"""

import os
import shlex
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import harness

DOCUMENT = harness.ROOT / "docs" / "deployment.md"
PACKAGE = "path/to/keras-transformer"  # the documented lines' stand-in for the checkout
MARKER = "tests/test_runtime_install.py"


def documented_block():
    """The bash block of docs/deployment.md whose `not run` reason names the runtime install test."""
    lines = DOCUMENT.read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        if line.startswith("<!-- not run:") and MARKER in line and lines[index + 1].startswith("```bash"):
            end = next(i for i in range(index + 2, len(lines)) if lines[i].startswith("```"))
            return "\n".join(lines[index + 2 : end])
    raise SystemExit(f"{DOCUMENT}: no bash block marked as run by {MARKER}")


def documented_pip_lines(package=harness.ROOT):
    """The block's `pip install` lines as argument lists (comments dropped, `package` for the
    checkout's stand-in)."""
    found = []
    for line in documented_block().splitlines():
        words = shlex.split(line, comments=True)
        if words[:2] == ["pip", "install"]:
            found.append([str(package) if word == PACKAGE else word for word in words[2:]])
    return found


def install(directory, pip_lines):
    """A new virtual environment in `directory` with `pip_lines` installed in order; its Python."""
    venv.EnvBuilder(with_pip=True).create(directory)
    python = str(Path(directory) / "bin" / "python")
    for arguments in pip_lines:
        completed = subprocess.run(
            [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *arguments],
            capture_output=True,
            text=True,
            timeout=1200,
            cwd=harness.ROOT,
        )
        if completed.returncode:
            raise RuntimeError(f"pip install {' '.join(arguments)}:\n{completed.stderr[-3000:]}")
    return python


def site_packages_mb(python):
    path = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    total = sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
        if not os.path.islink(os.path.join(root, name))
    )
    return round(total / 2**20)


def packages(python):
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return sorted(listed)


def main():
    parser = harness.parser(__doc__, "runtime_install_size")
    args = parser.parse_args()
    lines = documented_pip_lines()
    ctranslate2 = [line for line in lines if any(word.startswith("ctranslate2") for word in line)]
    without = [line for line in lines if line not in ctranslate2]
    full = [[str(harness.ROOT)]]
    rows, report = [], {}
    with tempfile.TemporaryDirectory() as directory:
        for name, pip_lines in (
            ("runtime (ONNX Runtime)", without),
            ("runtime + CTranslate2", lines),
            ("full install", full),
            ("full install + CTranslate2", full + ctranslate2),
        ):
            python = install(os.path.join(directory, str(len(report))), pip_lines)
            size = site_packages_mb(python)
            report[name] = dict(pip_lines=pip_lines, site_packages_mb=size, packages=packages(python))
            rows.append([name, f"{size:,}", len(report[name]["packages"])])
            print(f"{name}: {size:,} MB", flush=True)
    harness.print_table(["environment", "site-packages MB", "packages"], rows)
    harness.write_report(args.json, python=sys.version.split()[0], environments=report)


if __name__ == "__main__":
    main()
