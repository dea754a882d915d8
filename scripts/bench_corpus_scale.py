"""Training on corpora past Multi30k: preparation time, peak anonymous memory and the training
step, from Multi30k's 29,000 pairs to 20 million, with the token cache (`data/token_store.py`).

The corpora are Multi30k's training set repeated to each size (written into `--work`, a
temporary directory by default, never into the project), validated on Multi30k's val. For each
size, a child process does what `keras-transformer train --data "files:train=...;val=..."
--preset tiny --vocab-size 8000 --batch-tokens 4096` does before and at its first steps:

  cold   a new run with an empty token cache: count the lines, sample the vocabulary,
         tokenize the corpus into the cache, build the model (`prepare_run`);
  warm   a second new run on the same files: the vocabulary sampled again, the cache reused;
  steps  in the warm process: `--steps` training steps of epoch 0 read from the cache
         ("streamed"), and the same batches held in memory (`Dataset.cache()`, filled first),
         timed in turns (median step, milliseconds).

Peak memory is `RssAnon` of `/proc/PID/status` (anonymous pages; the memory-mapped cache's
pages, which the kernel can drop, are not in it), polled by this process every 20 ms, the
maximum over each phase; `--baseline REF` also runs the given commit's pipeline (extracted with
`git archive`) at the sizes in `--baseline-sizes`, side by side.

    python scripts/bench_corpus_scale.py [--sizes 29000,290000,4500000,20000000]
        [--baseline REF --baseline-sizes 29000,290000] [--steps 40]
        [--json results/bench_corpus_scale.json] [--table-only]

It prints the table and writes it into docs/training.md (`--table-only`: from the JSON alone).
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness

CHILD = "--child"


def write_corpus(directory, data_dir, pairs):
    """Multi30k's training set repeated (and cut) to `pairs` lines per side; its val beside it."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, name, count in (("train", "train", pairs), ("val", "val", None)):
        for lang in ("en", "de"):
            lines = (Path(data_dir) / f"{name}.{lang}").read_text(encoding="utf-8").splitlines()
            path = paths[split, lang] = directory / f"{split}.{lang}"
            if count is None:
                path.write_text("\n".join(lines) + "\n", encoding="utf-8")
                continue
            block = ("\n".join(lines) + "\n").encode("utf-8")
            with open(path, "wb") as handle:
                for _ in range(count // len(lines)):
                    handle.write(block)
                handle.write(
                    ("\n".join(lines[: count % len(lines)]) + "\n").encode("utf-8")
                    if count % len(lines)
                    else b""
                )
    train, val = (f"{paths[split, 'en']},{paths[split, 'de']}" for split in ("train", "val"))
    return f"files:train={train};val={val}"


def rss_anon_kib(pid):
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def run_child(tree, data, work, steps, phases):
    """Runs the child in `tree` (a library checkout) and returns its reports, each with the peak
    RssAnon (MiB) of its phase."""
    environment = dict(os.environ, PYTHONPATH=str(tree), TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    command = [
        sys.executable,
        __file__,
        CHILD,
        json.dumps(dict(data=data, work=str(work), steps=steps, phases=phases)),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=environment, cwd=tree)
    peak, reports = [0], []

    def read():
        for line in process.stdout:
            if line.startswith("{"):
                report = json.loads(line)
                report["peak_rss_anon_mib"] = round(peak[0] / 1024)
                reports.append(report)
                peak[0] = 0
            else:
                print("   ", line.rstrip(), flush=True)

    reader = threading.Thread(target=read)
    reader.start()
    while process.poll() is None:
        peak[0] = max(peak[0], rss_anon_kib(process.pid) or 0)
        time.sleep(0.02)
    reader.join()
    if process.returncode:
        raise SystemExit(f"the child process failed (status {process.returncode})")
    return reports


def child(settings):
    """One process: a cold or warm preparation (or both, as `phases` says), then step timing."""
    started = time.perf_counter()
    tree = os.environ["PYTHONPATH"]  # the library under test, not the one beside this script
    sys.path[:] = [tree] + [path for path in sys.path if path != str(harness.ROOT)]
    tf = harness.tensorflow()
    import keras

    from keras_transformer.training.run_directory import RunDirectory
    from keras_transformer.training.setup import prepare_run
    from keras_transformer.training.trainer import TrainingOptions

    work = Path(settings["work"])
    print(json.dumps(dict(phase="imports", seconds=round(time.perf_counter() - started, 1))), flush=True)
    prepared = None
    for phase in settings["phases"]:
        fields = dict(
            data=settings["data"],
            out=str(work / f"run-{phase}"),
            preset="tiny",
            vocab_size=8000,
            batch_tokens=4096,
            strategy="default",
            epochs=1,
            overwrite=True,
        )
        if "token_cache" in TrainingOptions.__dataclass_fields__:  # the token cache's pipeline
            fields["token_cache"] = str(work / "token_cache")
        options, messages = TrainingOptions(**fields), []
        run = RunDirectory(options.out)
        tick = time.perf_counter()
        prepared = prepare_run(run, options, messages.append)
        seconds = time.perf_counter() - tick
        reused = any("reused" in message for message in messages)
        print(
            json.dumps(
                dict(
                    phase=phase,
                    seconds=round(seconds, 1),
                    cache_reused=reused,
                    examples=prepared.batches.info.examples,
                    messages=messages,
                )
            ),
            flush=True,
        )
    steps = settings["steps"]
    if not steps:
        return
    streamed = prepared.batches.epoch(0, seed=0).take(steps + 3)
    in_memory = streamed.cache()
    for _ in in_memory:  # fills the cache: the same batches, now held in memory
        pass
    model = prepared.model
    times = {"streamed": [], "in memory": []}

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.tick = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if batch >= 3:  # past tracing
                self.samples.append(time.perf_counter() - self.tick)

    for _ in range(2):  # in turns: a busy spell slows both
        for name, dataset in (("streamed", streamed), ("in memory", in_memory)):
            timer = StepTimer()
            timer.samples = times[name]
            model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=[timer])
    del tf
    print(
        json.dumps(
            dict(
                phase="steps",
                **{name: round(1000 * statistics.median(s), 1) for name, s in times.items()},
                steps=len(times["streamed"]),
            )
        ),
        flush=True,
    )


def main():
    parser = harness.parser(__doc__, "bench_corpus_scale")
    harness.add_data_dir(parser)
    parser.add_argument("--sizes", default="29000,290000,4500000,20000000")
    parser.add_argument("--baseline", help="a commit whose pipeline runs beside (e.g. 9ba06da)")
    parser.add_argument("--baseline-sizes", default="29000,290000")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--work", help="where the corpora and caches go (default: a temporary directory)")
    parser.add_argument(
        "--table-only", action="store_true", help="rewrite docs/training.md's table from --json"
    )
    args = parser.parse_args()
    if args.table_only:
        report = json.loads(Path(args.json).read_text(encoding="utf-8"))
        harness.replace_between(harness.ROOT / "docs" / "training.md", BEGIN, END, render(report))
        return
    if not args.data_dir:
        raise SystemExit("needs Multi30k: --data-dir DIR or $MULTI30K_DIR")
    work = Path(args.work or tempfile.mkdtemp(prefix="corpus-scale-"))
    trees = {"token cache": harness.ROOT}
    if args.baseline:
        trees[f"in memory @{args.baseline}"] = work / "baseline"
        trees[f"in memory @{args.baseline}"].mkdir(parents=True, exist_ok=True)
        harness.extract_tree(args.baseline, trees[f"in memory @{args.baseline}"])
    rows = []
    try:
        for size in (int(size) for size in args.sizes.split(",")):
            data = write_corpus(work / f"corpus-{size}", args.data_dir, size)
            for name, tree in trees.items():
                if tree != harness.ROOT and size not in {int(s) for s in args.baseline_sizes.split(",")}:
                    continue
                print(f"{size:,} pairs, {name} ...", flush=True)
                scratch = work / f"scratch-{size}-{len(rows)}"
                phases = ["cold", "warm"] if tree == harness.ROOT else ["cold"]
                reports = {
                    report["phase"]: report for report in run_child(tree, data, scratch, args.steps, phases)
                }
                phases = ("imports", "cold", "warm", "steps")
                rows.append(
                    dict(pairs=size, pipeline=name, **{phase: reports.get(phase) for phase in phases})
                )
                shutil.rmtree(scratch, ignore_errors=True)
            shutil.rmtree(work / f"corpus-{size}", ignore_errors=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    report = harness.write_report(args.json, settings=vars(args), results=rows)
    print()
    print(render(report))
    harness.replace_between(harness.ROOT / "docs" / "training.md", BEGIN, END, render(report))


BEGIN, END = "<!-- BEGIN corpus-scale -->", "<!-- END corpus-scale -->"


def render(report):
    """The Markdown table of a report (`--table-only` rewrites docs/training.md's from the JSON)."""
    headers = [
        "pairs",
        "pipeline",
        "prepare s (cold)",
        "prepare s (warm)",
        "peak RssAnon MiB (prepare)",
        "peak RssAnon MiB (all)",
        "step ms (as trained)",
        "step ms (same batches in memory)",
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in report["results"]:
        phases = [row[phase] for phase in ("imports", "cold", "warm", "steps") if row.get(phase)]
        cells = [
            f"{row['pairs']:,}",
            row["pipeline"],
            f"{row['cold']['seconds']:.0f}",
            f"{row['warm']['seconds']:.1f}" if row.get("warm") else "-",
            f"{row['cold']['peak_rss_anon_mib']:,}",
            f"{max(p['peak_rss_anon_mib'] for p in phases):,}",
            f"{row['steps']['streamed']:.0f}",
            f"{row['steps']['in memory']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    machine = report["machine"]
    simd = ", ".join(machine["simd"])
    lines.append(f"\n{machine['cpu']}, {machine['cores']} cores, {simd}; commit {machine['commit']}.")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == CHILD:
        child(json.loads(sys.argv[2]))
    else:
        main()
