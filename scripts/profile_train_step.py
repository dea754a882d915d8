"""Where a training step's time goes: TensorFlow's profiler over a few steps of
a preset on Multi30k batches, summed by op type.

Trains `--steps` untimed steps (tracing), then profiles `--steps` more with
`tf.profiler.experimental` and reads the trace (`xplane.pb`) directly: every
TensorFlow op executed on the CPU is one event named `name:Type`; their
durations are summed per type (ops run on two threads at once, so the
column sums to more than the wall time). Also prints the step's wall time, its
kernel count, and how much of the kernel time the matrix products, the
elementwise ops and the dropout draws take.

    python scripts/profile_train_step.py [--preset mini] [--batch-tokens 4096] [--steps 10]
        [--json results/profile_train_step.json]
"""

import collections
import glob
import os
import sys
import tempfile
import time
from pathlib import Path

import harness

tf = harness.tensorflow()

import numpy as np  # noqa: E402
from bench_train import load_batches  # noqa: E402

import keras_transformer as kt  # noqa: E402

GROUPS = {
    "matrix products": (
        "MatMul",
        "BatchMatMulV2",
        "BatchMatMulV3",
        "_MklMatMul",
        "_FusedMatMul",
        "_MklBatchMatMulV2",
        "_MklFusedMatMul",
        "Einsum",
    ),
    "dropout (random draws, masks)": (
        "StatelessRandomUniformV2",
        "StatelessRandomGetKeyCounter",
        "RandomUniform",
        "StatelessRandomUniformFullIntV2",
        "GreaterEqual",
        "SelectV2",
    ),
    "softmax / log-softmax": ("Softmax", "LogSoftmax", "SoftmaxCrossEntropyWithLogits"),
    "layer norm and elementwise": (
        "Mean",
        "SquaredDifference",
        "Rsqrt",
        "AddV2",
        "Mul",
        "Sub",
        "RealDiv",
        "Relu",
        "ReluGrad",
        "Sum",
        "Neg",
        "Square",
        "Sqrt",
    ),
    "shape and data movement": (
        "Reshape",
        "Transpose",
        "ConcatV2",
        "StridedSlice",
        "Slice",
        "Pack",
        "GatherV2",
        "Shape",
        "Cast",
        "Fill",
        "BroadcastTo",
        "Tile",
        "ExpandDims",
        "Squeeze",
        "Identity",
        "UnsortedSegmentSum",
        "StridedSliceGrad",
    ),
    "optimizer (Adam)": (
        "ResourceApplyAdam",
        "AssignVariableOp",
        "AssignAddVariableOp",
        "ReadVariableOp",
        "AssignSubVariableOp",
    ),
}


# Events named like ops that are not TensorFlow kernels (Eigen's thread-pool work items,
# XLA's launches of compiled clusters, the profiler's and tf.data's own regions).
NOT_OPS = frozenset({"Process", "ExecuteAsyncOnStream", "StartRegion", "StopRegion", "Record"})


def op_times(logdir):
    """`{op type: (total microseconds, count)}` from the profile's xplane.pb files."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    totals = collections.defaultdict(lambda: [0.0, 0])
    for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
        space = xplane_pb2.XSpace()
        space.ParseFromString(Path(path).read_bytes())
        for plane in space.planes:
            if not plane.name.startswith("/host:CPU"):
                continue
            names = {key: metadata.name for key, metadata in plane.event_metadata.items()}
            for line in plane.lines:
                if (
                    line.name not in ("", "tf_Compute")
                    and "Executor" not in line.name
                    and not line.name.startswith("tf_")
                ):
                    continue
                for event in line.events:
                    name = names.get(event.metadata_id, "")
                    if ":" not in name or name.startswith(("Iterator", "Eager")):
                        continue
                    op_type = name.rsplit(":", 1)[1]
                    if not op_type or " " in op_type or op_type[0].islower() or op_type in NOT_OPS:
                        continue
                    totals[op_type][0] += event.duration_ps / 1e6
                    totals[op_type][1] += 1
    return totals


def main():
    parser = harness.parser(__doc__, "profile_train_step")
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    harness.add_data_dir(parser)
    args = parser.parse_args()

    vocab_size, batches = load_batches(args.steps, args.batch_tokens, args.data_dir)
    model = kt.Transformer.from_preset(args.preset, vocab_size=vocab_size)
    kt.compile_transformer(model, warmup_steps=1000)
    stacked = (
        {key: np.stack([inputs[key] for inputs, _ in batches]) for key in ("source_ids", "target_ids")},
        np.stack([labels for _, labels in batches]),
    )
    dataset = tf.data.Dataset.from_tensor_slices(stacked).cache()
    args.steps = len(batches)  # the batches of the most frequent shape (one trace)
    model.fit(dataset, epochs=1, verbose=0)  # tracing
    start = time.perf_counter()
    model.fit(dataset, epochs=1, verbose=0)
    step_seconds = (time.perf_counter() - start) / args.steps
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        model.fit(dataset, epochs=1, verbose=0)
        tf.profiler.experimental.stop()
        totals = op_times(logdir)
    busy = sum(t for t, _ in totals.values())
    ops_per_step = sum(c for _, c in totals.values()) / args.steps
    grouped = collections.defaultdict(float)
    for op_type, (micros, _) in totals.items():
        group = next((g for g, types in GROUPS.items() if op_type in types), "other")
        grouped[group] += micros
    print(
        f"{args.preset}, {args.batch_tokens}-token batches: {step_seconds * 1000:.0f} ms per step "
        f"(unprofiled), {ops_per_step:.0f} TensorFlow kernels per step, "
        f"{busy / args.steps / 1000:.0f} ms of op time per step (two threads)\n"
    )
    groups = sorted(grouped.items(), key=lambda item: -item[1])
    harness.print_table(
        ["op group", "share of op time"], [[group, f"{100 * micros / busy:.1f}%"] for group, micros in groups]
    )
    print()
    top = sorted(totals.items(), key=lambda item: -item[1][0])[:20]
    harness.print_table(
        ["op type", "ms per step", "calls per step", "share"],
        [
            [
                op_type,
                f"{micros / args.steps / 1000:.1f}",
                f"{count / args.steps:.0f}",
                f"{100 * micros / busy:.1f}%",
            ]
            for op_type, (micros, count) in top
        ],
    )
    harness.write_report(
        args.json,
        settings=vars(args),
        step_ms=step_seconds * 1000,
        ops_per_step=ops_per_step,
        groups_percent={g: 100 * m / busy for g, m in grouped.items()},
        op_types={
            k: {"ms_per_step": v[0] / args.steps / 1000, "calls_per_step": v[1] / args.steps}
            for k, v in totals.items()
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
