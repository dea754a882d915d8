"""Where the compiled beam search of `translate_xla` spends a step: XLA's own operations, timed
by the TensorFlow profiler.

    python scripts/profile_xla_search.py --model runs/multi30k-dropout0.2/averaged.keras \\
        --json results/profile_xla_search.json

Compiles `keras_transformer.decoding.request.decode(..., cache_policy="fixed")` under
`tf.function(jit_compile=True)` as `bench_xla_search.py` does (beam 4, test2016 in batches of
`--batch` sentences, file order, source bucket `--source-length`), runs `--batches` batches once
to compile, then once under `tf.profiler`, and sums the time of every XLA operation (a fused
loop, a `dot`, a `gather`, ...; the thunks of XLA's CPU runtime) over the traced run. Printed:
the operations that took most time, in ms per execution and in total, with how many times each
ran; the first-stage loop's operations run once per step at the full batch, so their
per-execution time is a batch-`--batch` step's. A loop's or a `cond`'s own time is that of the
operations inside it, so they are not listed; the others add up to about the wall time (XLA's
CPU runtime runs one operation at a time, each on one or both cores).
Operation names are those of the compiled program (`fusion.12`, `MatMul.3`): compare them
within one run only.
"""

import collections
import glob
import re
import tempfile
import time
from pathlib import Path

import harness
from bench_xla_search import batches, compiled_search

CONTAINER = re.compile(r"(while|cond|conditional)(\.\d+)?$")  # their time is their operations'


def profile(args):
    tf = harness.tensorflow()
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    from keras_transformer.data.tokenizer import Tokenizer
    from keras_transformer.training.run_directory import load_model, resolve_model

    run, model_path = resolve_model(args.model)
    model = load_model(model_path)
    tokenizer = Tokenizer.load(run.tokenizer_path)
    sentences = harness.read_multi30k(args.data_dir, "test2016")[0]
    arrays = batches(tokenizer, model.config, sentences, args.batch, False)
    arrays = [a for a in arrays if a.shape[1] == args.source_length][: args.batches]
    if not arrays:
        raise SystemExit(f"No test2016 batch of {args.batch} in source bucket {args.source_length}.")

    compiled = compiled_search(tf, model, args.beam_size)
    for array in arrays:
        compiled(array).numpy()
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        tick = time.perf_counter()
        for array in arrays:
            compiled(array).numpy()
        seconds = time.perf_counter() - tick
        tf.profiler.experimental.stop()
        (path,) = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
        space = xplane_pb2.XSpace()
        space.ParseFromString(Path(path).read_bytes())
    total_ms, calls = collections.Counter(), collections.Counter()
    for plane in space.planes:
        names = {key: value.name for key, value in plane.event_metadata.items()}
        for line in plane.lines:
            if not line.name.startswith("tf_numa"):  # XLA's CPU worker threads
                continue
            for event in line.events:
                name = names.get(event.metadata_id, "?")
                if name in ("ThunkExecutor::Execute", "SlinkyThreadPool::Await") or CONTAINER.match(name):
                    continue  # the runtime's containers (a loop, a cond: their operations count) and waits
                total_ms[name] += event.duration_ps / 1e9
                calls[name] += 1
    return seconds, len(arrays), total_ms, calls


def main():
    parser = harness.parser(__doc__, "profile_xla_search")
    parser.add_argument("--model", required=True, help="a trained run directory or .keras file")
    harness.add_data_dir(parser)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--source-length", type=int, default=32, help="the source bucket profiled")
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    seconds, count, total_ms, calls = profile(args)
    rows = [
        {"operation": name, "calls": calls[name], "ms_per_call": ms / calls[name], "ms_total": ms}
        for name, ms in total_ms.most_common(args.top)
    ]
    print(
        f"\n{args.model}: beam {args.beam_size}, {count} batches of {args.batch} test2016 sentences "
        f"(source bucket {args.source_length}) in {seconds:.2f} s; "
        f"operations {sum(total_ms.values()):.0f} ms in all."
    )
    harness.print_table(
        ["operation", "calls", "ms per call", "ms in all"],
        [[r["operation"], r["calls"], f"{r['ms_per_call']:.3f}", f"{r['ms_total']:.1f}"] for r in rows],
    )
    harness.write_report(
        args.json,
        settings=vars(args),
        seconds=seconds,
        batches=count,
        operations_ms=sum(total_ms.values()),
        top=rows,
    )


if __name__ == "__main__":
    main()
