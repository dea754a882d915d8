"""Where `translate.onnx`'s (or `translate_lean.onnx`'s) time goes in ONNX Runtime: its
profiler, summed by op type.

Translates `--sentences` sentences of a split at batch 1 (one at a time) and
in one batch of 32 with ONNX Runtime's profiling on (`--threads` intra-op
threads), then sums the kernel times of the profile by op type and prints
each type's share, calls per decoding step, the nodes of the `Loop` body and
the `--top-nodes` slowest nodes; and by part of the step (`part_of`: the
decoder layers, the embedding, the output projection with log-softmax, the
search's bookkeeping, and what runs once per batch outside the decoding `Loop`:
the encoder and the search's set-up).

    python scripts/profile_onnx.py EXPORT_DIR [--data-dir DIR] [--split test2016]
        [--graph translate|translate_lean] [--sentences 32] [--threads 2] [--top-nodes 25]
        [--json results/profile_onnx.json]

With `--graph translate_lean` the decoding step is the lean graph's step `Loop` body (its
`decoder_step.onnx` nodes named `dec/...`, the search's `lean/step/...`); its nodes that run
once per stage count as "once per batch".
"""

import collections
import json
import os

import harness
import onnx  # noqa: E402
import onnxruntime  # noqa: E402
from count_loop_nodes import main_body  # noqa: E402

from keras_transformer_export.graph_rewrites import all_graphs, count_nodes  # noqa: E402
from keras_transformer_export.lean_search import step_body  # noqa: E402
from keras_transformer_export.onnx_runtime import OnnxTranslator, read_metadata  # noqa: E402


def profile(path, batches, threads, step_node):
    """`({(node name, op type): microseconds}, kernel calls, decoding steps)` over `batches` of
    source ids (`by_op_type` and `by_part` sum them).

    Kernel times of the `Loop` body's nodes are recorded on their own, so the
    `Loop` node's own time (which contains them) is left out; the number of
    decoding steps is the number of times `step_node` (a body node) ran.
    """
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.enable_profiling = True
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    for source_ids in batches:
        session.run(None, {"source_ids": source_ids})
    trace = session.end_profiling()
    with open(trace, encoding="utf-8") as handle:
        events = json.load(handle)
    os.remove(trace)
    nodes, calls, steps = collections.defaultdict(float), 0, 0
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            steps += event["name"] == f"{step_node}_kernel_time"
            if event["args"]["op_name"] != "Loop":
                nodes[(event["name"][: -len("_kernel_time")], event["args"]["op_name"])] += event["dur"]
                calls += 1
    return nodes, calls, max(1, steps)


def by_op_type(nodes):
    """`{op type: microseconds}` of `profile`'s nodes."""
    totals = collections.defaultdict(float)
    for (_, op), micros in nodes.items():
        totals[op] += micros
    return totals


def by_part(nodes, part):
    """`{part: microseconds}` of `profile`'s nodes, `part` giving each node's (`part_of`)."""
    parts = collections.defaultdict(float)
    for key, micros in nodes.items():
        parts[part[key]] += micros
    return parts


ONCE = "once per batch: encoder, search set-up"
PARTS = ("decoder layers", "embedding", "output projection + log-softmax", "search", ONCE)


def part_of(name, op_type, in_step=True):
    """Which part of a decoding step a node of `translate.onnx` belongs to, from its name (the
    TensorFlow scope tf2onnx keeps) and type: the decoder stack's layers, the target embedding
    and positional encoding, the tied output projection and log-softmax, or the search's own
    bookkeeping (top-k, the beams' gathers, finished hypotheses, the loop's condition); a node
    outside the decoding `Loop` (`in_step` false: the encoder, the search's set-up and results)
    runs once per batch, not per step (its time is still shown per step, as a share)."""
    if not in_step:
        return ONCE
    if "token_embedding" in name or "positional_encoding" in name:
        return "embedding"
    if "decoder" in name:
        return "decoder layers"
    if op_type in (
        "Gemm",
        "LogSoftmax",
        "MatMulInteger",
        "DynamicQuantizeLinear",
        # ONNX Runtime's fusions of the int8 projection (DynamicQuantizeLinear + MatMulInteger + scale)
        "DynamicQuantizeMatMul",
        "MatMulIntegerToFloat",
    ):
        return "output projection + log-softmax"
    return "search"


def main():
    parser = harness.parser(__doc__, "profile_onnx")
    parser.add_argument("export_dir")
    harness.add_sentences(parser)
    parser.add_argument("--sentences", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top-nodes", type=int, default=25, help="the slowest nodes to list")
    parser.add_argument("--graph", choices=("translate", "translate_lean"), default="translate")
    args = parser.parse_args()
    path = os.path.join(args.export_dir, f"{args.graph}.onnx")
    model = onnx.load(path)
    main_nodes, loop_nodes = count_nodes(model)
    body = main_body(model) if args.graph == "translate" else step_body(model)
    if args.graph == "translate_lean":
        loop_nodes = len(body.node)
    step_nodes = {node.name for node in body.node}
    if args.graph == "translate":
        step_node = next(node.name for node in body.node if node.op_type in ("MatMul", "MatMulInteger"))

        def in_step(name):
            return name in step_nodes

    else:  # ONNX Runtime renames the decoder's nodes it fuses ("fused dec/...", ".../MatMulAddFusion")
        step_node = next(node.name for node in body.node if node.op_type == "TopK")
        outside = {node.name for graph in all_graphs(model.graph) for node in graph.node} - step_nodes

        def in_step(name):  # a decoder node hoisted out of the step keeps its name: outside
            return name in step_nodes or ("dec/" in name and name not in outside)

    sentences = harness.sentences(args)[: args.sentences]
    translator = OnnxTranslator(args.export_dir, "full")
    report = {
        "export": args.export_dir,
        "main_nodes": main_nodes,
        "loop_body_nodes": loop_nodes,
        "quantization": read_metadata(args.export_dir).get("quantization"),
        "threads": args.threads,
    }
    print(f"{path}: {main_nodes} nodes outside the Loop, {loop_nodes} in its body")
    for label, batches in (
        ("batch 1", [translator.encode([s]) for s in sentences]),
        ("batch 32", [translator.encode(sentences)]),
    ):
        nodes, calls, steps = profile(path, batches, args.threads, step_node)
        part = {(name, op): part_of(name, op, in_step(name)) for name, op in nodes}
        totals, parts = by_op_type(nodes), by_part(nodes, part)
        busy = sum(totals.values())
        print(
            f"\n{label}: {steps} decoding steps, {calls / steps:.0f} kernel calls and "
            f"{busy / steps / 1000:.2f} ms of kernel time per step\n"
        )
        top = sorted(totals.items(), key=lambda item: -item[1])[:15]
        harness.print_table(
            ["op type", "share", "ms per step"],
            [[op, f"{100 * micros / busy:.1f}%", f"{micros / steps / 1000:.3f}"] for op, micros in top],
        )
        print()
        harness.print_table(
            ["part of the step", "share", "ms per step"],
            [
                [part, f"{100 * parts[part] / busy:.1f}%", f"{parts[part] / steps / 1000:.3f}"]
                for part in PARTS
            ],
        )
        print()
        slowest = sorted(nodes.items(), key=lambda item: -item[1])[: args.top_nodes]
        harness.print_table(
            ["node", "op type", "part", "share", "ms per step"],
            [
                [
                    name[-60:],
                    op,
                    part[name, op],
                    f"{100 * us / busy:.1f}%",
                    f"{us / steps / 1000:.3f}",
                ]
                for (name, op), us in slowest
            ],
        )
        report[label] = {
            "part_share_percent": {part: 100 * parts[part] / busy for part in PARTS},
            "steps": steps,
            "kernel_calls_per_step": calls / steps,
            "kernel_ms_per_step": busy / steps / 1000,
            "op_share_percent": {k: 100 * v / busy for k, v in totals.items()},
            "slowest_nodes": [
                {
                    "node": name,
                    "op_type": op,
                    "part": part[name, op],
                    "share_percent": 100 * us / busy,
                }
                for (name, op), us in slowest
            ],
        }
    harness.write_report(args.json, settings=vars(args), **report)


if __name__ == "__main__":
    main()
