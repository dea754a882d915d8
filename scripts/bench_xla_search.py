"""The beam search as `translate_xla` compiles it (XLA, fixed-size cache), alone: this tree against
another commit's library, side by side.

    python scripts/bench_xla_search.py --model runs/multi30k-dropout0.2/averaged.keras \\
        --baseline fcdf9e4 --json results/bench_xla_search.json

Each variant runs in a process of its own (the baseline's library extracted from git by
`harness.extract_tree`), loads the model, cuts test2016 into batches of `--batch` sentences
padded to `translate_xla`'s source-length buckets (16, 32, 64, ...) and compiles
`keras_transformer.decoding.request.decode(..., cache_policy="fixed")` under
`tf.function(jit_compile=True)` per shape, as the signature does; then the variants time one
pass over all batches in turns (`--rounds`), so that a busy spell slows both. Two orders: the
file's (a server's requests: each batch mixes short and long sentences) and sorted by source
length (as `bench_serving.py` feeds every runtime). Printed: sentences/s (median pass) per
variant and order, the ratio to the baseline, and how many translations equal this tree's.
"""

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

TREE = "BENCH_XLA_SEARCH_TREE"  # the library a worker imports (default: this tree)
ORDERS = ("file order", "sorted by length")


def batches(tokenizer, config, sentences, batch, sort):
    """`sentences` as int32 `(batch, L)` arrays, L the smallest `translate_xla` bucket that holds
    the longest source (ids with EOS); a last short batch is dropped (one shape per bucket)."""
    import numpy as np

    from keras_transformer_export.xla_serving import XlaBuckets

    lengths = XlaBuckets().for_model(config.max_length).source_lengths
    ids = [tokenizer.processor.encode(s)[: config.max_length - 1] + [config.eos_id] for s in sentences]
    if sort:
        ids.sort(key=len)
    out = []
    for start in range(0, len(ids) - batch + 1, batch):
        rows = ids[start : start + batch]
        width = next(n for n in lengths if n >= max(map(len, rows)))
        array = np.full((batch, width), config.pad_id, np.int32)
        for row, sentence in enumerate(rows):
            array[row, : len(sentence)] = sentence
        out.append(array)
    return out


def compiled_search(tf, model, beam_size):
    """The search `translate_xla` compiles: `source_ids (batch, L)` -> the best ids, under
    `tf.function(jit_compile=True)` with the fixed-size cache (one program per shape)."""
    from keras_transformer.decoding.request import decode

    def search(source_ids):
        return decode(model, source_ids, None, beam_size, cache_policy="fixed").ids[:, 0]

    return tf.function(search, jit_compile=True, autograph=False)


def worker(spec):
    """The `--worker` side: compiles, then one JSON line per pass asked for on stdin."""
    spec = json.loads(spec)
    tf = harness.tensorflow()
    import numpy as np

    import keras_transformer
    from keras_transformer.data.tokenizer import Tokenizer
    from keras_transformer.training.run_directory import load_model

    model = load_model(spec["model"])
    tokenizer = Tokenizer.load(spec["tokenizer"])
    sentences = harness.read_multi30k(spec["data_dir"], "test2016")[0]
    compiled = compiled_search(tf, model, spec["beam_size"])
    orders = {order: batches(tokenizer, model.config, sentences, spec["batch"], sort) for order, sort in
              zip(ORDERS, (False, True))}  # fmt: skip
    tick = time.perf_counter()
    found = {}
    for order, arrays in orders.items():
        found[order] = [compiled(a).numpy() for a in arrays]
    compile_seconds = time.perf_counter() - tick
    for order, arrays in found.items():  # the tokens, for the comparison
        width = max(a.shape[1] for a in arrays)
        padded = [np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in arrays]
        np.save(Path(spec["out"]) / f"{ORDERS.index(order)}.npy", np.concatenate(padded))
    info = dict(
        library=keras_transformer.__file__,
        compile_and_first_pass_seconds=compile_seconds,
        sentences=sum(len(array) for array in orders[ORDERS[0]]),
    )
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        order = line.strip()
        tick = time.perf_counter()
        for array in orders[order]:
            compiled(array).numpy()
        print(json.dumps(dict(seconds=time.perf_counter() - tick)), flush=True)


def main():
    parser = harness.parser(__doc__, "bench_xla_search")
    parser.add_argument("--model", required=True, help="a trained run directory or .keras file")
    parser.add_argument("--baseline", required=True, help="the git commit to compare with")
    harness.add_data_dir(parser)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from keras_transformer.training.run_directory import resolve_model

    run, model_path = resolve_model(args.model)
    scratch = tempfile.TemporaryDirectory(prefix="bench_xla_search_")
    trees = {"this tree": harness.ROOT}
    baseline_tree = Path(scratch.name) / "baseline"
    baseline_tree.mkdir()
    baseline = f"@{harness.extract_tree(args.baseline, baseline_tree)}"
    trees[baseline] = baseline_tree
    workers, outs = {}, {}
    for name, tree in trees.items():
        outs[name] = Path(scratch.name) / f"out-{len(outs)}"
        outs[name].mkdir()
        spec = dict(
            model=str(model_path), tokenizer=str(run.tokenizer_path), data_dir=str(args.data_dir),
            batch=args.batch, beam_size=args.beam_size, out=str(outs[name]),
        )  # fmt: skip
        print(f"compiling {name} ...", flush=True)
        workers[name] = harness.LineWorker(__file__, spec, TREE, tree)
    seconds = {(name, order): [] for name in workers for order in ORDERS}
    for _ in range(args.rounds):
        for order in ORDERS:
            for name, worker_ in workers.items():
                seconds[name, order].append(worker_.ask(order)["seconds"])
    for worker_ in workers.values():
        worker_.close()

    import numpy as np

    sentences = workers["this tree"].info["sentences"]  # per pass (a last short batch is left out)
    rows, table = [], []
    for order_index, order in enumerate(ORDERS):
        ours = np.load(outs["this tree"] / f"{order_index}.npy")
        base_rate = sentences / statistics.median(seconds[baseline, order])
        for name in workers:
            found = np.load(outs[name] / f"{order_index}.npy")
            width = min(found.shape[1], ours.shape[1])
            same = int(np.all(found[:, :width] == ours[:, :width], axis=1).sum())
            rate = sentences / statistics.median(seconds[name, order])
            info = workers[name].info
            rows.append(
                dict(
                    variant=name,
                    order=order,
                    sentences_per_second=rate,
                    seconds=seconds[name, order],
                    identical_to_this_tree=same,
                    compile_and_first_pass_seconds=info["compile_and_first_pass_seconds"],
                )
            )
            table.append([name, order, f"{rate:.1f}", f"{rate / base_rate:.2f}x", f"{same}/{sentences}"])
    print(
        f"\n{model_path}: beam {args.beam_size}, batches of {args.batch} test2016 sentences, median of "
        f"{args.rounds} passes; {harness.machine()['cpu']}, {os.cpu_count()} cores.\n"
    )
    harness.print_table(["variant", "order", "sentences/s", "vs baseline", "identical to this tree"], table)
    harness.write_report(args.json, settings=vars(args), results=rows)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.path.insert(0, os.environ.get(TREE, str(harness.ROOT)))
        worker(sys.argv[2])
    else:
        main()
