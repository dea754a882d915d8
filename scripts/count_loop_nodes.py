"""Nodes per decoding step: the beam search's loop body in an ONNX export and in a SavedModel.

For each `translate.onnx` given (an `export --format onnx` directory), the nodes of the main
graph's `Loop` body (the default request's beam search; the searches with per-request options
are `Loop`s inside `If` branches, listed in the JSON) as stored and after ONNX Runtime's own
optimizer (`ORT_ENABLE_ALL`, the session default), with the body's most frequent node
types, and the step `Loop` body of `translate_lean.onnx` (with how many of its nodes are the
search's, not `decoder_step.onnx`'s) and `decoder_step.onnx` itself, both also after the
optimizer (which fuses what `keras_transformer_export.step_rewrites` prepared: a projection's
`MatMul` + bias `Add` into a `Gemm`); for each SavedModel version directory given, the nodes of
the `while` body of its `translate_ids` function (all, and without `Const`). Every graph runs
these nodes once per decoding step.

    python scripts/count_loop_nodes.py [--onnx EXPORT_DIR ...] [--saved-model VERSION_DIR ...]
        [--json results/loop_nodes.json]
"""

import collections
import json
import os
import tempfile

import harness
import onnx
import onnxruntime

from keras_transformer_export.graph_rewrites import all_graphs


def _loop_bodies(graph):
    """The `Loop` bodies in `graph` and its subgraphs (an `If` branch holds a search with options)."""
    return [
        attribute.g
        for g in all_graphs(graph)
        for node in g.node
        if node.op_type == "Loop"
        for attribute in node.attribute
        if attribute.name == "body"
    ]


def main_body(model):
    """The body of the main graph's `Loop`: the default request's beam search."""
    loop = next(node for node in model.graph.node if node.op_type == "Loop")
    return next(attribute.g for attribute in loop.attribute if attribute.name == "body")


def optimized(path):
    """The model at `path` as ONNX Runtime runs it: after its own optimizer (`ORT_ENABLE_ALL`)."""
    with tempfile.TemporaryDirectory() as directory:
        optimized_path = os.path.join(directory, "optimized.onnx")
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = optimized_path
        options.log_severity_level = 3
        onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        return onnx.load(optimized_path)


def _metadata(export_dir):
    with open(os.path.join(export_dir, "export.json"), encoding="utf-8") as handle:
        return json.load(handle)


def onnx_counts(export_dir):
    path = os.path.join(export_dir, "translate.onnx")
    model = onnx.load(path)
    stored = main_body(model)
    optimized_model = optimized(path)
    optimized_body = main_body(optimized_model)
    return dict(
        path=path,
        loop_body_nodes=len(stored.node),
        after_onnx_runtime_optimizer=len(optimized_body.node),
        every_loop_body=[len(body.node) for body in _loop_bodies(model.graph)],
        every_loop_body_after_optimizer=[len(body.node) for body in _loop_bodies(optimized_model.graph)],
        node_types=dict(collections.Counter(node.op_type for node in stored.node).most_common(12)),
        node_types_after_optimizer=dict(
            collections.Counter(node.op_type for node in optimized_body.node).most_common(12)
        ),
    )


def saved_model_counts(version_dir):
    from tensorflow.core.protobuf import saved_model_pb2

    saved = saved_model_pb2.SavedModel()
    with open(os.path.join(version_dir, "saved_model.pb"), "rb") as handle:
        saved.ParseFromString(handle.read())
    library = saved.meta_graphs[0].graph_def.library
    functions = {function.signature.name: function for function in library.function}
    bodies = [
        functions[node.attr["body"].func.name]
        for name, function in functions.items()
        if name.startswith("__inference_translate_ids")
        for node in function.node_def
        if node.op in ("While", "StatelessWhile")
    ]
    body = max(bodies, key=lambda function: len(function.node_def))
    types = collections.Counter(node.op for node in body.node_def)
    return dict(
        path=version_dir,
        while_body_nodes=len(body.node_def),
        without_const=len(body.node_def) - types["Const"],
        node_types=dict(types.most_common(12)),
    )


def main():
    parser = harness.parser(__doc__, "loop_nodes")
    parser.add_argument("--onnx", nargs="*", default=[], metavar="EXPORT_DIR")
    parser.add_argument("--saved-model", nargs="*", default=[], metavar="VERSION_DIR")
    args = parser.parse_args()
    rows, report = [], dict(onnx=[], saved_model=[])
    for export_dir in args.onnx:
        found = onnx_counts(export_dir)
        report["onnx"].append(found)
        rows.append([export_dir, "translate.onnx beam search Loop body", found["loop_body_nodes"]])
        rows.append([export_dir, "  after ONNX Runtime's optimizer", found["after_onnx_runtime_optimizer"]])
        lean_path = os.path.join(export_dir, "translate_lean.onnx")
        if os.path.exists(lean_path):
            from keras_transformer_export.lean_search import step_body

            body = step_body(onnx.load(lean_path))
            step = len(body.node)
            search = sum(node.name.startswith("lean/step/") for node in body.node)
            step_optimized = len(step_body(optimized(lean_path)).node)
            decoder_path = os.path.join(export_dir, "decoder_step.onnx")
            decoder = len(onnx.load(decoder_path).graph.node)
            decoder_optimized = len(optimized(decoder_path).graph.node)
            found.update(
                lean_step_body_nodes=step,
                lean_search_nodes=search,
                lean_step_body_after_optimizer=step_optimized,
                decoder_step_nodes=decoder,
                decoder_step_after_optimizer=decoder_optimized,
                step_rewrites=_metadata(export_dir).get("step_rewrites"),
            )
            rows.append([export_dir, "translate_lean.onnx step Loop body", step])
            rows.append([export_dir, "  after ONNX Runtime's optimizer", step_optimized])
            rows.append([export_dir, "  of which the search's (the others decoder_step.onnx's)", search])
            rows.append([export_dir, "decoder_step.onnx", decoder])
            rows.append([export_dir, "  after ONNX Runtime's optimizer", decoder_optimized])
    if args.saved_model:
        harness.tensorflow()
    for version_dir in args.saved_model:
        found = saved_model_counts(version_dir)
        report["saved_model"].append(found)
        rows.append([version_dir, "translate_ids while body", found["while_body_nodes"]])
        rows.append([version_dir, "  without Const", found["without_const"]])
    harness.print_table(["export", "graph", "nodes per step"], rows)
    harness.write_report(args.json, **report)


if __name__ == "__main__":
    main()
