"""What every benchmark and profile script shares: where results go, where the data
is, the machine's description, timing, the table and the JSON report.

    import harness

    tf = harness.tensorflow()  # before Keras: TensorFlow without its C++ start-up lines
    parser = harness.parser(__doc__, "bench_attention")  # --json results/bench_attention.json
    harness.add_data_dir(parser)  # --data-dir: $MULTI30K_DIR, ../shared/data/multi30k, or the cache
    seconds = harness.interleaved({"a": run_a, "b": run_b}, rounds=7)
    harness.print_table(["variant", "ms"], [["a", "1.0"], ["b", "2.0"]])
    harness.write_report(args.json, settings=vars(args), results=rows)
    harness.replace_between(Path("README.md"), BEGIN, END, table)  # a generated block of a document

Measured figures belong in `results/` (tracked): every file a script writes
there carries the machine it was measured on (CPU model, SIMD flags, cores,
library versions, commit), so a figure in the README can be traced to its
command and its machine. Timings are only comparable within one run: time
variants side by side (`interleaved`), never against a file from another run.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
sys.path.insert(0, str(ROOT))  # the scripts run from a clone, installed or not


# Where the Multi30k files are when `--data-dir` is not given: this variable, else the
# shared copy beside the clone (this project's machines), else the project's download cache.
DATA_DIR_VARIABLE = "MULTI30K_DIR"
SHARED_DATA = ROOT.parent / "shared" / "data" / "multi30k"
PACKAGES = ("tensorflow", "keras", "onnxruntime", "ctranslate2", "keras-hub", "numpy")


def tensorflow():
    """`tensorflow`, imported without its C++ start-up lines (as the command line does)."""
    from keras_transformer.utils.tensorflow import import_tensorflow_quietly

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return import_tensorflow_quietly("the benchmarks")


def parser(doc, name):
    """An `ArgumentParser` described by the script's docstring, with `--json` defaulting to
    `results/NAME.json`."""
    result = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    result.add_argument(
        "--json", default=str(RESULTS / f"{name}.json"), help=f"report file (default results/{name}.json)"
    )
    return result


def default_data_dir():
    """`$MULTI30K_DIR`, else `../shared/data/multi30k` beside the clone if it exists, else None
    (`load_corpus("multi30k")` then downloads into its cache)."""
    if os.environ.get(DATA_DIR_VARIABLE):
        return os.environ[DATA_DIR_VARIABLE]
    return str(SHARED_DATA) if SHARED_DATA.is_dir() else None


def add_data_dir(parser):
    parser.add_argument(
        "--data-dir",
        default=default_data_dir(),
        help=f"a local Multi30k copy (default: ${DATA_DIR_VARIABLE}, {SHARED_DATA} if present, "
        "else downloaded into the cache)",
    )


def add_sentences(parser, split="test2016"):
    """`--data-dir`, `--split` and `--source-lang`: the Multi30k sentences a script translates
    (`sentences(args)`)."""
    add_data_dir(parser)
    parser.add_argument("--split", default=split)
    parser.add_argument("--source-lang", default="en")


def sentences(args):
    """The source sentences of `add_sentences`'s options."""
    return read_multi30k(args.data_dir, args.split, args.source_lang)[0]


def read_multi30k(data_dir, split, source_lang="en", target_lang="de"):
    """`(sources, targets)` of a Multi30k split: `train`, `val`, `test` or its file name
    (`test2016`), from `data_dir` or the project's download cache."""
    from keras_transformer.data.corpora import MULTI30K_SPLITS, load_corpus

    names = {file: name for name, file in MULTI30K_SPLITS.items()}
    corpus = load_corpus("multi30k", data_dir=data_dir, source_lang=source_lang, target_lang=target_lang)
    return corpus[names.get(split, split)]


def _cpu():
    """CPU model and the SIMD flags that decide speed here (AVX2, AVX-512, AMX)."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            text = handle.read()
        found = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        model = found.group(1).strip() if found else model
        line = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
        present = set(line.group(1).split()) if line else set()
        flags = sorted(f for f in present if f in ("avx2", "fma") or f.startswith(("avx512", "amx")))
    except OSError:  # not Linux
        pass
    return model, flags


def _commit():
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return commit + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def extract_tree(ref, into):
    """The library and scripts of commit `ref`, extracted into the directory `into`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "keras_transformer"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", ref],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def machine():
    """What a figure was measured on: CPU, SIMD flags, cores, Python and library versions, commit."""
    model, flags = _cpu()
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return dict(
        cpu=model,
        simd=flags,
        cores=os.cpu_count(),
        python=platform.python_version(),
        versions=versions,
        commit=_commit(),
    )


class LineWorker:
    """A benchmark variant in a process of its own (`script --worker SPEC`), driven one JSON line
    at a time: it answers one line when ready (`info`) and one per request (`ask`). The
    environment variable `tree_variable` names the library tree it imports (another commit's,
    from `extract_tree`), so its passes can interleave with this tree's."""

    def __init__(self, script, spec, tree_variable, tree, environment=None):
        self.process = subprocess.Popen(
            [sys.executable, str(script), "--worker", json.dumps(spec)],
            env={**os.environ, tree_variable: str(tree), **(environment or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self._answer()

    def _answer(self):
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"a worker stopped (exit code {self.process.wait()}); see its stderr above")
        return json.loads(line)

    def ask(self, request):
        """Sends `request` (one line) and returns the worker's answer (a dict)."""
        self.process.stdin.write(request + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def median_seconds(function, min_runs=3, min_seconds=1.0):
    """Median wall time of `function()` over at least `min_runs` calls and `min_seconds`
    (call it once before, to trace or compile)."""
    samples, start = [], time.perf_counter()
    while len(samples) < min_runs or time.perf_counter() - start < min_seconds:
        tick = time.perf_counter()
        function()
        samples.append(time.perf_counter() - tick)
    return statistics.median(samples)


def interleaved(functions, rounds, iterations=1):
    """Seconds per call of each of `functions` (name -> callable), `rounds` samples each, timed in
    turns (a, b, c, a, b, c, ...) so that a busy spell slows all of them, not one."""
    samples = {name: [] for name in functions}
    for _ in range(rounds):
        for name, function in functions.items():
            tick = time.perf_counter()
            for _ in range(iterations):
                function()
            samples[name].append((time.perf_counter() - tick) / iterations)
    return samples


def print_table(headers, rows):
    """A Markdown table of `rows` (lists of already formatted cells)."""
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |", flush=True)


def write_report(path, **report):
    """Writes `report` as JSON to `path` with the machine it was measured on; says where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), **report}
    path.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    print(f"\nWrote {path}")
    return report


def replace_between(path, begin, end, text):
    """Rewrites the block between the lines `begin` and `end` of `path` (which must have them) with `text`.

    The README's and docs' generated tables live between such markers, so that a script rewrites
    them from its results and nobody types a measured figure.
    """
    path = Path(path)
    content = path.read_text(encoding="utf-8")
    if begin not in content or end not in content:
        raise SystemExit(
            f"{path}: the markers {begin!r} ... {end!r} are missing; put them where the table goes."
        )
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}", encoding="utf-8")
