"""The default request's speed before and after the per-request decoding options, side by side,
and what each option costs when it is on.

Issue 40 made every decoding option an input of the exported graphs
(`translate.onnx`'s inputs backed by initializers, the SavedModel's second
signature) and put the searches behind conditionals decided once per request.
A request with the default options must run as fast as before. This script
exports one model twice, with the code of `--baseline REF` (in a worker process
that imports that commit's library and exporters) and with this tree, and times
the two exports side by side in one process, on the same sentences:

| row | what runs |
|---|---|
| `saved_model @REF` / `saved_model` | `serving_default` (text in, text out; what TF Serving runs) |
| `onnx @REF` / `onnx` | `translate.onnx` fed `source_ids` only (the options' defaults) |
| `onnx: <option>` | `translate.onnx` with that option on (this tree only) |

Batch 32: Multi30k test2016 sorted by length and cut into batches of 32, every
batch translated by every row in turn (`--limit` sentences); sentences/s.
Batch 1: `--single` sentences translated alone by every row in turn, with a
50 ms pause before each timed call (as `bench_serving.py`); median latency.
Before any timing, the default rows of both exports must give the same
translations (the same ids from `translate.onnx`).

    python scripts/bench_request_options.py [--model runs/multi30k | --random-weights mini]
        [--baseline bce7862] [--limit 256] [--single 30] [--json results/bench_request_options.json]

`--random-weights PRESET` (the default, `mini`): a model of that preset with
random weights and a SentencePiece vocabulary of 8000 trained on Multi30k's
training text, its EOS never chosen (`bench_serving.random_weights_without_eos`):
every sentence decodes to its length limit, so both exports do the same work.
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import numpy as np

BATCH = 32
SETTLE_SECONDS = 0.05  # bench_serving.SETTLE_SECONDS: idle threads of the previous row stop spinning

# The baseline worker: export the model with the library and exporters of the baseline tree.
EXPORT_WORKER = """
import sys
import keras
from keras_transformer.data.tokenizer import Tokenizer
from keras_transformer_export.graphs import TranslationGraphs
from keras_transformer_export.onnx import export_onnx
from keras_transformer_export.saved_model import export_saved_model
model_path, tokenizer_path, out = sys.argv[1:]
graphs = TranslationGraphs(keras.saving.load_model(model_path), Tokenizer.load(tokenizer_path))
export_saved_model(graphs, out + "/serving", "bench")
export_onnx(graphs, out + "/onnx")
"""

# Each option on its own (translate.onnx inputs), timed beside the default request.
OPTIONS = {
    "n-best 4": dict(num_return=np.array(4, np.int32)),
    "min_length 5, alpha 1.0": dict(
        min_length=np.array(5, np.int32), length_penalty=np.array(1.0, np.float32)
    ),
    "prefix (2 tokens)": "target_prefix",
    "no-repeat 3-grams": dict(no_repeat_ngram_size=np.array(3, np.int32)),
    "repetition penalty 1.2": dict(repetition_penalty=np.array(1.2, np.float32)),
    "sampling (top-k 0)": dict(sampling_topk=np.array(0, np.int32)),
    "sampling (top-k 10, top-p 0.9)": dict(
        sampling_topk=np.array(10, np.int32), sampling_topp=np.array(0.9, np.float32)
    ),
    "alignments": dict(return_alignments=np.array(True)),
}


def baseline_exports(ref, model_path, tokenizer_path, directory):
    """The SavedModel version and ONNX directory the code of commit `ref` exports."""
    tree = directory / "baseline"
    tree.mkdir()
    for folder, name in (("keras_transformer", "keras_transformer"), ("export", "keras_transformer_export")):
        archive = subprocess.run(
            ["git", "-C", str(harness.ROOT), "archive", ref, folder], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        if folder != name:
            (tree / folder).rename(tree / name)
    out = directory / "baseline-exports"
    environment = {**os.environ, "PYTHONPATH": str(tree), "TF_CPP_MIN_LOG_LEVEL": "2"}
    subprocess.run(
        [sys.executable, "-c", EXPORT_WORKER, str(model_path), str(tokenizer_path), str(out)],
        check=True,
        env=environment,
        cwd=str(directory),
    )
    commit = subprocess.run(
        ["git", "-C", str(harness.ROOT), "rev-parse", "--short", ref],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return out / "serving" / "bench" / "1", out / "onnx", commit


def current_exports(model, tokenizer, directory):
    from keras_transformer_export.graphs import TranslationGraphs
    from keras_transformer_export.onnx import export_onnx
    from keras_transformer_export.saved_model import export_saved_model

    graphs = TranslationGraphs(model, tokenizer)
    saved = export_saved_model(graphs, str(directory / "now" / "serving"), "bench")
    onnx_dir = export_onnx(graphs, str(directory / "now" / "onnx"))
    return Path(saved), Path(onnx_dir)


def model_and_tokenizer(args):
    from keras_transformer.data.tokenizer import Tokenizer

    if args.model:
        from keras_transformer.training.run_directory import load_model, resolve_model

        run, path = resolve_model(args.model)
        return load_model(path), run.tokenizer(), f"{args.model} ({os.path.basename(path)})"
    import bench_serving

    sources, targets = harness.read_multi30k(args.data_dir, "train")
    tokenizer = Tokenizer.train(sources + targets, vocab_size=8000)
    model = bench_serving.random_weights_without_eos(args.random_weights, tokenizer.vocab_size)
    return model, tokenizer, f"{args.random_weights} preset, random weights, EOS suppressed, BPE 8000"


def rows(saved, onnx_dir, label, threads):
    """`{name: function(batch of sentences) -> outputs}` of one export's default rows."""
    import tensorflow as tf

    from keras_transformer_export.onnx_runtime import make_session

    signature = tf.saved_model.load(str(saved)).signatures["serving_default"]
    session = make_session(str(onnx_dir / "translate.onnx"), threads)
    suffix = f" @{label}" if label else ""
    return {
        f"saved_model{suffix}": lambda batch: [
            t.decode() for t in signature(text=tf.constant(batch["text"]))["translation"].numpy()
        ],
        f"onnx{suffix}": lambda batch: session.run(["target_ids"], {"source_ids": batch["ids"]})[0],
    }, session


def option_rows(session):
    def run(extra):
        def translate(batch):
            feed = {
                "source_ids": batch["ids"],
                **(extra if isinstance(extra, dict) else {"target_prefix": batch["prefix"]}),
            }
            return session.run(["nbest_ids"], feed)[0]

        return translate

    return {f"onnx: {name}": run(extra) for name, extra in OPTIONS.items()}


def main():
    parser = harness.parser(__doc__, "bench_request_options")
    parser.add_argument("--model", help="a trained run directory or .keras file (default: --random-weights)")
    parser.add_argument(
        "--random-weights", default="mini", help="the preset of the random-weights model (default mini)"
    )
    parser.add_argument(
        "--baseline", default="bce7862", help="the commit before the options (default bce7862)"
    )
    parser.add_argument("--limit", type=int, default=256, help="sentences of the batch-32 rows (default 256)")
    parser.add_argument("--single", type=int, default=30, help="sentences of the batch-1 rows (default 30)")
    parser.add_argument("--threads", type=int, default=2)
    harness.add_data_dir(parser)
    args = parser.parse_args()
    tf = harness.tensorflow()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    model, tokenizer, described = model_and_tokenizer(args)
    sentences, _ = harness.read_multi30k(args.data_dir, "test2016")
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        model_path, tokenizer_path = directory / "model.keras", directory / "tokenizer.model"
        model.save(model_path)
        tokenizer.save(str(tokenizer_path))
        print("Exporting with this tree and with the baseline (a few minutes)...", flush=True)
        now_saved, now_onnx = current_exports(model, tokenizer, directory)
        old_saved, old_onnx, commit = baseline_exports(args.baseline, model_path, tokenizer_path, directory)
        loops = {
            commit: loop_sizes(old_onnx / "translate.onnx"),
            "now": loop_sizes(now_onnx / "translate.onnx"),
        }
        print(f"translate.onnx Loop bodies (nodes per step): {loops}", flush=True)
        old_rows, _ = rows(old_saved, old_onnx, commit, args.threads)
        new_rows, session = rows(now_saved, now_onnx, "", args.threads)
        functions = {**old_rows, **new_rows}
        batches = make_batches(sentences[: args.limit], tokenizer, model.config.max_length, session)
        check_identical(functions, batches, commit)
        functions.update(option_rows(session))
        print(f"Timing {len(functions)} rows, batch 32 over {args.limit} sentences...", flush=True)
        batch_seconds = time_batches(functions, batches)
        singles = make_batches(
            sentences[args.limit : args.limit + args.single], tokenizer, model.config.max_length, session, 1
        )
        print(f"Timing batch 1 over {args.single} sentences...", flush=True)
        single_seconds = time_singles(functions, singles)
    report(functions, batch_seconds, single_seconds, args, described, commit, loops)


def loop_sizes(path):
    """`{Loop node name: nodes in its body}` of an ONNX file, wherever the Loops are."""
    import onnx

    from keras_transformer_export.graph_rewrites import all_graphs

    return {
        node.name: len(next(a.g for a in node.attribute if a.name == "body").node)
        for graph in all_graphs(onnx.load(str(path)).graph)
        for node in graph.node
        if node.op_type == "Loop"
    }


def make_batches(sentences, tokenizer, max_length, session, size=BATCH):
    """Batches of `size` sentences sorted by length: text, padded ids, and a 2-token prefix (the
    default output's first two tokens)."""
    import tensorflow as tf

    order = sorted(sentences, key=lambda s: len(s.split()))
    batches = []
    for start in range(0, len(order), size):
        text = order[start : start + size]
        ids = tokenizer.encode(tf.constant(text), max_length=max_length, pad_to_max_length=False).numpy()
        best = session.run(["target_ids"], {"source_ids": ids})[0]
        prefix = np.where(np.isin(best[:, :2], [0, 3]), 0, best[:, :2]).astype(np.int32)
        batches.append({"text": text, "ids": ids, "prefix": prefix})
    return batches


def check_identical(functions, batches, commit):
    """The default rows of both exports give the same outputs (texts, ids) on every batch."""
    for batch in batches:
        outputs = {name: function(batch) for name, function in functions.items()}
        for kind in ("saved_model", "onnx"):
            before, after = outputs[f"{kind} @{commit}"], outputs[kind]
            width = min(np.shape(before)[-1], np.shape(after)[-1]) if kind == "onnx" else None
            same = (
                np.array_equal(np.asarray(before)[:, :width], np.asarray(after)[:, :width])
                if kind == "onnx"
                else before == after
            )
            if not same:
                raise SystemExit(f"{kind}: the default request's output differs from @{commit}'s")
    print("The default request gives the baseline's outputs in both runtimes.", flush=True)


def time_batches(functions, batches):
    """Seconds of each row over all the batches, the rows in turn on each batch."""
    for function in functions.values():  # warm up: first runs allocate
        function(batches[0])
    seconds = dict.fromkeys(functions, 0.0)
    for batch in batches:
        for name, function in functions.items():
            time.sleep(SETTLE_SECONDS)
            tick = time.perf_counter()
            function(batch)
            seconds[name] += time.perf_counter() - tick
    return seconds


def time_singles(functions, singles):
    """Each row's latencies, one sentence at a time, the rows in turn on each sentence."""
    latencies = {name: [] for name in functions}
    for batch in singles:
        for name, function in functions.items():
            time.sleep(SETTLE_SECONDS)
            tick = time.perf_counter()
            function(batch)
            latencies[name].append(time.perf_counter() - tick)
    return latencies


def report(functions, batch_seconds, single_seconds, args, described, commit, loops):
    table, results = [], {}
    for name in functions:
        kind = name.split(" @")[0].split(":")[0]
        baseline = f"{kind} @{commit}"
        speed = args.limit / batch_seconds[name]
        median = statistics.median(single_seconds[name]) * 1000
        row = {"sentences_per_s_batch32": speed, "median_ms_batch1": median}
        if baseline in batch_seconds and name != baseline:
            row["vs_baseline_batch32"] = batch_seconds[baseline] / batch_seconds[name]
            row["vs_baseline_batch1"] = statistics.median(single_seconds[baseline]) * 1000 / median
        results[name] = row
        table.append(
            [
                name,
                f"{speed:.1f}",
                f"{median:.1f}",
                f"{row['vs_baseline_batch32']:.3f}x" if "vs_baseline_batch32" in row else "",
                f"{row['vs_baseline_batch1']:.3f}x" if "vs_baseline_batch1" in row else "",
            ]
        )
    print(f"\nModel: {described}; beam 4, alpha 0.6; baseline @{commit}")
    harness.print_table(
        [
            "row",
            "sentences/s (batch 32)",
            "median ms (batch 1)",
            "vs @baseline (batch 32)",
            "vs @baseline (batch 1)",
        ],
        table,
    )
    harness.write_report(
        args.json,
        settings=vars(args),
        model=described,
        baseline=commit,
        loop_body_nodes=loops,
        results=results,
    )


if __name__ == "__main__":
    main()
