"""Is ONNX Runtime's fused attention faster than our unfused nodes at the recipe's width? Measured
before writing a graph rewrite that adopts it (issue: serving at small widths).

Builds two ONNX graphs of a decoding step's attention through `--layers` decoder layers (the
same weights), each run `--steps` times in an ONNX `Loop` as in `translate.onnx` (the output
and the growing self-attention caches carried, the cross-attention keys/values and the source
mask read from the enclosing graph), and times them side by side in ONNX Runtime (CPU,
`--threads`):

- **unfused**: the nodes `translate.onnx`'s `Loop` body runs per layer today (after its
  rewrites): self-attention = fused Q/K/V `MatMul` + bias, `Split`, heads `Reshape`s, the
  growing cache `Concat`s, scaled `MatMul(q, kᵀ)`, `Softmax`, `MatMul(·, v)`, `Reshape`,
  output `MatMul` + bias; cross-attention = query `MatMul` + bias, beams folded into the
  query length, `MatMul` with the cross keys, the source mask as `Where` before and after
  `Softmax`, `MatMul` with the cross values, output `MatMul` + bias.
- **fused**: the same arithmetic with `com.microsoft.MultiHeadAttention` (self-attention with
  `past_key`/`past_value` -> `present_key`/`present_value` in the heads-first layout our cache
  uses, the bias fused; cross-attention with the cached keys/values as 4-D inputs and a
  `key_padding_mask`).

Both graphs' outputs (the last step's output and the caches) are compared (max |difference|),
then each is run `--repeat` times in turn, interleaved (a pause before each run); the table
gives the median microseconds per decoding step and the ratio. Sizes: `mini` (d_model 128, 4
heads) by default; batch 1 is 1 sentence × `--beam` beams, batch 32 is 32 sentences × beams;
random inputs (the source lengths differ, so the mask matters). Attention only: the step's
feed-forward sublayers, norms, output projection and search are not in these graphs.

    python scripts/bench_fused_attention.py [--d-model 128 --heads 4 --layers 3 --beam 4]
        [--steps 40 --source 20 --threads 2 --repeat 40] [--json results/bench_fused_attention.json]
"""

import os
import shutil
import statistics
import tempfile
import time

import harness
import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

from keras_transformer_export.onnx_runtime import make_session

FLOAT = TensorProto.FLOAT
SETTLE_SECONDS = 0.05  # a pause before each timed run: the other session's threads stop spinning


def build(fused, d_model, heads, layers, seed=0):
    """The ONNX model of one step's attention through `layers` layers (module docstring)."""
    depth = d_model // heads
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def const(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(name, shape):
        return const(name, (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32))

    inputs = [
        helper.make_tensor_value_info("x", FLOAT, ["rows", 1, d_model]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, ["sentences", 1, 1, "source"]),
        helper.make_tensor_value_info("mask_index", TensorProto.INT32, ["sentences", "source"]),
    ]
    outputs = []
    const("scale", np.float32(1 / np.sqrt(depth)))
    const("zero", np.float32(0))
    const("neg", np.float32(-1e9))
    const("heads_shape", np.array([0, heads, 1, depth], np.int64))  # (rows, heads, 1, depth)
    const("rows_shape", np.array([0, 1, d_model], np.int64))
    x = "x"
    for layer in range(layers):
        past_k, past_v = f"past_key_{layer}", f"past_value_{layer}"
        cross_k, cross_v = f"cross_key_{layer}", f"cross_value_{layer}"
        for name, dims in ((past_k, "past"), (past_v, "past"), (cross_k, "source"), (cross_v, "source")):
            rows = "rows" if name.startswith("past") else "sentences"
            inputs.append(helper.make_tensor_value_info(name, FLOAT, [rows, heads, dims, depth]))
        w_qkv, b_qkv = (
            weight(f"w_qkv{layer}", (d_model, 3 * d_model)),
            weight(f"b_qkv{layer}", (3 * d_model,)),
        )
        w_o, b_o = weight(f"w_o{layer}", (d_model, d_model)), weight(f"b_o{layer}", (d_model,))
        w_q, b_q = weight(f"w_q{layer}", (d_model, d_model)), weight(f"b_q{layer}", (d_model,))
        w_co, b_co = weight(f"w_co{layer}", (d_model, d_model)), weight(f"b_co{layer}", (d_model,))
        p = f"l{layer}_"
        present_k, present_v = f"present_key_{layer}", f"present_value_{layer}"
        if fused:
            nodes += [
                helper.make_node("MatMul", [x, w_qkv], [p + "qkv"]),
                helper.make_node("Split", [p + "qkv"], [p + "q", p + "k", p + "v"], axis=-1, num_outputs=3),
                helper.make_node(
                    "MultiHeadAttention",
                    [p + "q", p + "k", p + "v", b_qkv, "", "", past_k, past_v],
                    [p + "ctx", present_k, present_v],
                    domain="com.microsoft",
                    num_heads=heads,
                ),
            ]
        else:
            nodes += [
                helper.make_node("MatMul", [x, w_qkv], [p + "qkv0"]),
                helper.make_node("Add", [p + "qkv0", b_qkv], [p + "qkv"]),
                helper.make_node("Split", [p + "qkv"], [p + "q", p + "k", p + "v"], axis=-1, num_outputs=3),
                helper.make_node("Reshape", [p + "k", "heads_shape"], [p + "kh"]),
                helper.make_node("Reshape", [p + "v", "heads_shape"], [p + "vh"]),
                helper.make_node("Concat", [past_k, p + "kh"], [present_k], axis=2),
                helper.make_node("Concat", [past_v, p + "vh"], [present_v], axis=2),
                helper.make_node("Reshape", [p + "q", "heads_shape"], [p + "qh0"]),
                helper.make_node("Mul", [p + "qh0", "scale"], [p + "qh"]),
                helper.make_node("Transpose", [present_k], [p + "kt"], perm=[0, 1, 3, 2]),
                helper.make_node("MatMul", [p + "qh", p + "kt"], [p + "logits"]),
                helper.make_node("Softmax", [p + "logits"], [p + "probs"], axis=-1),
                helper.make_node("MatMul", [p + "probs", present_v], [p + "ctx4"]),
                helper.make_node("Reshape", [p + "ctx4", "rows_shape"], [p + "ctx"]),
            ]
        nodes += [
            helper.make_node("MatMul", [p + "ctx", w_o], [p + "o0"]),
            helper.make_node("Add", [p + "o0", b_o], [p + "self"]),
            helper.make_node("MatMul", [p + "self", w_q], [p + "cq0"]),
        ]
        # Cross-attention: beams folded into the query length, (sentences, beams, ...).
        nodes.append(helper.make_node("Shape", [cross_k], [p + "sent"], start=0, end=1))
        nodes.append(helper.make_node("Concat", [p + "sent", "minus_one", "width"], [p + "fold3"], axis=0))
        if fused:
            nodes += [
                helper.make_node("Add", [p + "cq0", b_q], [p + "cq"]),
                helper.make_node("Reshape", [p + "cq", p + "fold3"], [p + "cqf"]),
                helper.make_node(
                    "MultiHeadAttention",
                    [p + "cqf", cross_k, cross_v, "", "mask_index"],
                    [p + "cctx3"],
                    domain="com.microsoft",
                    num_heads=heads,
                ),
                helper.make_node("Reshape", [p + "cctx3", "rows_shape_neg"], [p + "cctx"]),
            ]
        else:
            nodes += [
                helper.make_node("Add", [p + "cq0", b_q], [p + "cq"]),
                helper.make_node("Concat", [p + "sent", "minus_one", "heads_depth"], [p + "fold4"], axis=0),
                helper.make_node("Reshape", [p + "cq", p + "fold4"], [p + "cqh0"]),
                helper.make_node("Mul", [p + "cqh0", "scale"], [p + "cqh1"]),
                helper.make_node("Transpose", [p + "cqh1"], [p + "cqh"], perm=[0, 2, 1, 3]),
                helper.make_node("Transpose", [cross_k], [p + "ckt"], perm=[0, 1, 3, 2]),
                helper.make_node("MatMul", [p + "cqh", p + "ckt"], [p + "clog"]),
                helper.make_node("Where", ["mask", p + "clog", "neg"], [p + "clogm"]),
                helper.make_node("Softmax", [p + "clogm"], [p + "cprob0"], axis=-1),
                helper.make_node("Where", ["mask", p + "cprob0", "zero"], [p + "cprob"]),
                helper.make_node("MatMul", [p + "cprob", cross_v], [p + "cctx4"]),
                helper.make_node("Transpose", [p + "cctx4"], [p + "cctxt"], perm=[0, 2, 1, 3]),
                helper.make_node("Reshape", [p + "cctxt", "rows_shape_neg"], [p + "cctx"]),
            ]
        nodes += [
            helper.make_node("MatMul", [p + "cctx", w_co], [p + "co0"]),
            helper.make_node("Add", [p + "co0", b_co], [p + "out"]),
        ]
        x = p + "out"
        outputs += [
            helper.make_tensor_value_info(present_k, FLOAT, None),
            helper.make_tensor_value_info(present_v, FLOAT, None),
        ]
    const("minus_one", np.array([-1], np.int64))
    const("width", np.array([d_model], np.int64))
    const("heads_depth", np.array([heads, depth], np.int64))
    const("rows_shape_neg", np.array([-1, 1, d_model], np.int64))
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    outputs.insert(0, helper.make_tensor_value_info("y", FLOAT, None))
    graph = helper.make_graph(nodes, "attention_step", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def loop_model(step, layers, steps):
    """`step` (the model `build` returns) run `steps` times in an ONNX `Loop`, as in
    `translate.onnx`: the output and the caches carried from one step to the next (the cache
    grows by a position per step), the cross-attention inputs read from the enclosing graph."""
    carried = ["x"] + [f"{kind}_{layer}" for layer in range(layers) for kind in ("past_key", "past_value")]
    presents = ["y"] + [
        f"{kind}_{layer}" for layer in range(layers) for kind in ("present_key", "present_value")
    ]
    by_name = {value.name: value for value in step.graph.input}
    body_inputs = [
        helper.make_tensor_value_info("step", TensorProto.INT64, []),
        helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
        *[by_name[name] for name in carried],
    ]
    body_outputs = [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, [])]
    body_outputs += [helper.make_tensor_value_info(name, FLOAT, None) for name in presents]
    body = helper.make_graph(
        [*step.graph.node, helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "step",
        body_inputs,
        body_outputs,
    )
    outer = [helper.make_tensor_value_info(f"final_{name}", FLOAT, None) for name in carried]
    initializers = [
        *step.graph.initializer,
        numpy_helper.from_array(np.array(steps, np.int64), "trip_count"),
        numpy_helper.from_array(np.array(True), "keep_going"),
    ]
    loop = helper.make_node(
        "Loop", ["trip_count", "keep_going", *carried], [value.name for value in outer], body=body
    )
    graph = helper.make_graph([loop], "decoding", list(step.graph.input), outer, initializers)
    return helper.make_model(graph, opset_imports=list(step.opset_import))


def feeds(d_model, heads, layers, sentences, beam, past, source, seed=1):
    rng = np.random.default_rng(seed)
    depth, rows = d_model // heads, sentences * beam
    lengths = rng.integers(max(1, source // 2), source + 1, size=sentences)
    lengths[0] = source
    valid = np.arange(source)[None, :] < lengths[:, None]
    out = {
        "x": rng.standard_normal((rows, 1, d_model)).astype(np.float32),
        "mask": valid[:, None, None, :],
        "mask_index": valid.astype(np.int32),
    }
    for layer in range(layers):
        out[f"past_key_{layer}"] = rng.standard_normal((rows, heads, past, depth)).astype(np.float32)
        out[f"past_value_{layer}"] = rng.standard_normal((rows, heads, past, depth)).astype(np.float32)
        out[f"cross_key_{layer}"] = rng.standard_normal((sentences, heads, source, depth)).astype(np.float32)
        out[f"cross_value_{layer}"] = rng.standard_normal((sentences, heads, source, depth)).astype(
            np.float32
        )
    return out


def session(model, threads, directory):
    """An ONNX Runtime session of `model` (saved into `directory`) with `threads` intra-op threads."""
    path = os.path.join(directory, f"{model.graph.name}-{id(model)}.onnx")
    onnx.save(model, path)
    return make_session(path, threads)


def main():
    parser = harness.parser(__doc__, "bench_fused_attention")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument(
        "--steps", type=int, default=40, help="decoding steps per run (the cache grows to this)"
    )
    parser.add_argument("--source", type=int, default=20, help="source length (the longest sentence's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=40, help="timed runs per graph and batch")
    args = parser.parse_args()
    shape = (args.d_model, args.heads, args.layers)
    steps = {name: build(name == "fused", *shape) for name in ("unfused", "fused")}
    models = {name: loop_model(step, args.layers, args.steps) for name, step in steps.items()}
    directory = tempfile.mkdtemp()
    sessions = {name: session(model, args.threads, directory) for name, model in models.items()}
    shutil.rmtree(directory)
    rows = []
    for sentences in (1, 32):
        inputs = feeds(*shape, sentences, args.beam, 1, args.source)
        results = {name: s.run(None, inputs) for name, s in sessions.items()}
        difference = max(float(np.abs(a - b).max()) for a, b in zip(results["unfused"], results["fused"]))
        times = {name: [] for name in sessions}
        for repeat in range(args.repeat):
            for name in list(sessions) if repeat % 2 == 0 else list(sessions)[::-1]:
                time.sleep(SETTLE_SECONDS)
                start = time.perf_counter()
                sessions[name].run(None, inputs)
                times[name].append(time.perf_counter() - start)
        per_step = {name: statistics.median(t) * 1e6 / args.steps for name, t in times.items()}
        rows.append(
            dict(
                sentences=sentences,
                rows=sentences * args.beam,
                unfused_us_per_step=round(per_step["unfused"], 1),
                fused_us_per_step=round(per_step["fused"], 1),
                fused_speedup=round(per_step["unfused"] / per_step["fused"], 3),
                max_abs_difference=difference,
            )
        )
    nodes = {name: len(step.graph.node) for name, step in steps.items()}
    print(
        f"{args.steps} decoding steps' attention in a Loop, {args.layers} layers (self + cross), "
        f"d_model {args.d_model}, {args.heads} heads, beam {args.beam}, source {args.source}, "
        f"{args.threads} threads; nodes per step: unfused {nodes['unfused']}, fused {nodes['fused']}"
    )
    harness.print_table(
        ["sentences", "rows", "unfused µs/step", "fused µs/step", "fused speed-up", "max abs difference"],
        [
            [
                r["sentences"],
                r["rows"],
                r["unfused_us_per_step"],
                r["fused_us_per_step"],
                f"{r['fused_speedup']}×",
                f"{r['max_abs_difference']:.1e}",
            ]
            for r in rows
        ],
    )
    harness.write_report(
        args.json,
        settings=vars(args),
        onnxruntime=onnxruntime.__version__,
        nodes_per_step=nodes,
        results=rows,
    )


if __name__ == "__main__":
    main()
