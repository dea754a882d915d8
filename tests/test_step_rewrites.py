"""`keras_transformer_export.step_rewrites`: `decoder_step.onnx` with fewer kernels per step and
bitwise the same outputs, on the tiny run's step as tf2onnx converts it (portable and fused)."""

import copy
import json

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from keras_transformer_export import step_rewrites
from keras_transformer_export.onnx_runtime import make_session
from keras_transformer_export.step_rewrites import leaner_step, positions_by_gather, verified


@pytest.fixture(scope="module")
def converted_steps(trained_run):
    """`{kernels: decoder_step model}` as the export has it before `leaner_step`."""
    from keras_transformer.training.run_directory import RunDirectory, load_run_model
    from keras_transformer_export.fused_kernels import fuse_for_onnx_runtime
    from keras_transformer_export.graph_rewrites import simplify
    from keras_transformer_export.graphs import TranslationGraphs
    from keras_transformer_export.onnx import convert

    model = load_run_model(str(trained_run))[1]
    graphs = TranslationGraphs(model, RunDirectory(str(trained_run)).tokenizer())
    portable = simplify(convert(graphs, "decoder_step"))
    return {"portable": portable, "fused": fuse_for_onnx_runtime(copy.deepcopy(portable))}


def _outputs(model, feeds):
    return make_session(model, 1).run(None, feeds)


@pytest.mark.parametrize("kernels", ["portable", "fused"])
def test_leaner_step_gives_bitwise_the_same_outputs_with_fewer_nodes(converted_steps, kernels):
    """The tiny preset (2 decoder layers, d_model 64, d_ff 256: every product's inner dimension
    within the 256 where ONNX Runtime's `Gemm` sums as `MatMul` + `Add`): all four rewrites
    are kept, and the step gives bitwise the outputs of the converted one on inputs other than
    `verified`'s own (another seed; 5 sentences of 1 beam, 1 of 4, 2 of 3; cache lengths 1 and 9)."""
    before = converted_steps[kernels]
    original = copy.deepcopy(before)
    after, applied = leaner_step(before)
    assert before == original  # not changed in place
    assert applied == {
        "positions_by_gather": 1,
        "collapse_scaled_reshapes": 2,
        "rows_as_matrices": 1,
        "split_heads_once": 2,
    }
    ops = [node.op_type for node in after.graph.node]
    assert len(ops) <= len(before.graph.node) - 16, (len(before.graph.node), len(ops))
    splits = [node for node in after.graph.node if node.op_type == "Split"]
    assert len(splits) == 2 and all(node.attribute[0].i == 1 for node in splits)  # on the heads' axis
    assert not any(node.op_type == "Unsqueeze" and node.input[0] == "token_ids" for node in after.graph.node)
    assert ops.count("Slice") == 0  # the position's slices and the last position's
    rng = np.random.default_rng(7)
    for sentences, beam, cache_length in ((5, 1, 1), (1, 4, 9), (2, 3, 9)):
        feeds = step_rewrites.random_feeds(before.graph, rng, sentences, beam, cache_length, source_length=4)
        for a, b in zip(_outputs(before, feeds), _outputs(after, feeds)):
            np.testing.assert_array_equal(a, b)
    # Applied again, nothing is left to do.
    assert leaner_step(after) == (after, {})


def test_a_deep_product_keeps_its_bias_apart_and_the_step_its_matrices(converted_steps, monkeypatch):
    """The tiny step widened to d_ff 512 (the recipe's): its feed-forward output sums 512 terms,
    where ONNX Runtime's `Gemm` would add the bias in other bits, so that bias `Add` becomes
    `Sum` (one per layer) and every rewrite is kept, `rows_as_matrices` included, with bitwise
    the outputs of the converted wide step."""
    wide = copy.deepcopy(converted_steps["portable"])
    rng = np.random.default_rng(5)
    for init in wide.graph.initializer:
        array = numpy_helper.to_array(init)
        more = (0.1 * rng.standard_normal(array.shape)).astype(array.dtype)
        if "inner_dense" in init.name:  # (d_model, 256) kernel and (256,) bias: twice the columns
            array = np.concatenate([array, more], axis=-1)
        elif "output_dense" in init.name and array.ndim == 2:  # (256, d_model): twice the rows
            array = np.concatenate([array, more])
        init.CopyFrom(numpy_helper.from_array(array, init.name))
    del wide.graph.value_info[:]
    after, applied = leaner_step(wide)
    assert applied["rows_as_matrices"] == 1, applied
    sums = [node for node in after.graph.node if node.op_type == "Sum"]
    assert len(sums) == 2 and all("output_dense" in node.name for node in sums), [n.name for n in sums]
    for sentences, beam, cache_length in ((1, 4, 3), (2, 3, 8)):
        feeds = step_rewrites.random_feeds(wide.graph, rng, sentences, beam, cache_length, source_length=4)
        for a, b in zip(_outputs(wide, feeds), _outputs(after, feeds)):
            np.testing.assert_array_equal(a, b)
    # With that bias fused into a `Gemm`, the step differs in bits and keeps its 3-D tensors.
    monkeypatch.setattr(step_rewrites, "GEMM_EXACT_DEPTH", 512)
    assert "rows_as_matrices" not in leaner_step(wide)[1]


def test_a_rewrite_that_changes_a_bit_is_not_kept(converted_steps, monkeypatch):
    """`verified` compares bit for bit; `leaner_step` falls back to the rewrites without
    `rows_as_matrices`, then to the step as converted."""
    step = converted_steps["fused"]
    changed = copy.deepcopy(step)
    weight = next(init for init in changed.graph.initializer if numpy_helper.to_array(init).ndim == 2)
    array = numpy_helper.to_array(weight).copy()
    array.flat[0] = np.nextafter(array.flat[0], np.float32(np.inf))  # one bit of one weight
    weight.CopyFrom(numpy_helper.from_array(array, weight.name))
    assert verified(step, copy.deepcopy(step)) and not verified(step, changed)

    calls = []

    def refuse_rows(before, after):  # as if `Gemm` summed in another order
        calls.append(after)
        return any(node.op_type == "Unsqueeze" and node.input[0] == "token_ids" for node in after.graph.node)

    monkeypatch.setattr(step_rewrites, "verified", refuse_rows)
    after, applied = leaner_step(step)
    assert len(calls) == 3  # all four: with inferred shapes, then without; then the others
    assert applied == {"positions_by_gather": 1, "collapse_scaled_reshapes": 2, "split_heads_once": 2}
    monkeypatch.setattr(step_rewrites, "verified", lambda before, after: False)
    assert leaner_step(step) == (step, {})


def test_a_graph_without_the_positional_table_is_left_alone():
    """An `Add` of an input and a constant slice of a table that is not the §3.5 table (a weight):
    no position rewrite, and so no matrices either."""
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    graph = helper.make_graph(
        [
            helper.make_node("Shape", ["past_key_0"], ["length"], start=2, end=3),
            helper.make_node("Slice", ["table", "length", "end"], ["rows"]),
            helper.make_node("Add", ["x", "rows"], ["y"]),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3]),
            helper.make_tensor_value_info("past_key_0", onnx.TensorProto.FLOAT, [1, 1, None, 1]),
        ],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(np.array([4], np.int64), "end")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert positions_by_gather(copy.deepcopy(model)) == 0
    assert leaner_step(model) == (model, {})


def test_exports_record_the_rewrites_and_fusing_their_step_shares_one_query_shape(exported):
    """`export.json` says which rewrites the written `decoder_step.onnx` has. Fusing that step
    again (as `scripts/bench_serving.py`'s fused copy of a portable export does) still finds
    both cross-attentions in its `(rows, width)` form, and they read one `(sentences, -1,
    width)` shape; rewritten once more, the fused step keeps every output bitwise."""
    from keras_transformer_export.fused_kernels import fuse_for_onnx_runtime

    metadata = json.loads((exported[1] / "export.json").read_text())
    assert metadata["step_rewrites"] == {
        "positions_by_gather": 1,
        "collapse_scaled_reshapes": 2,
        "rows_as_matrices": 1,
        "split_heads_once": 2,
    }
    fused = fuse_for_onnx_runtime(onnx.load(str(exported[1] / "decoder_step.onnx")))
    shapes = [node for node in fused.graph.node if "fused_query_shape" in node.name]
    assert len(shapes) == 1 and [node.op_type for node in fused.graph.node].count("MultiHeadAttention") == 2
    folds = [node for node in fused.graph.node if node.name.endswith("fused_fold_beams")]
    assert len(folds) == 2 and all(node.input[1] == shapes[0].output[0] for node in folds)
    assert leaner_step(fused) == (fused, {})


def test_heads_split_once_only_where_every_part_is_one_heads_reshape():
    """`split_heads_once` rewrites a Q/K/V `Split` whose parts are each read once by a reshape to
    `(rows, heads, 1, depth)` (the query through its scalar `Mul`), and leaves one alone whose
    key part has a second reader; the rewritten graph gives bitwise the same outputs."""
    heads, depth = 2, 3
    width = heads * depth

    def model(key_read_twice):
        shape = numpy_helper.from_array(np.array([-1, heads, 1, depth], np.int64), "shape")
        nodes = [
            helper.make_node("Split", ["qkv"], ["q", "k", "v"], axis=-1),
            helper.make_node("Mul", ["q", "scale"], ["q_scaled"]),
            helper.make_node("Reshape", ["q_scaled", "shape"], ["q_heads"]),
            helper.make_node("Reshape", ["k", "shape"], ["k_heads"]),
            helper.make_node("Reshape", ["v", "shape"], ["v_heads"]),
        ]
        outputs = ["q_heads", "k_heads", "v_heads"]
        if key_read_twice:
            nodes.append(helper.make_node("Relu", ["k"], ["k_relu"]))
            outputs.append("k_relu")
        graph = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("qkv", onnx.TensorProto.FLOAT, [None, 3 * width])],
            [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in outputs],
            [shape, numpy_helper.from_array(np.array(depth**-0.5, np.float32), "scale")],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    untouched = model(key_read_twice=True)
    assert step_rewrites.split_heads_once(untouched) == 0
    before, after = model(key_read_twice=False), model(key_read_twice=False)
    assert step_rewrites.split_heads_once(after) == 1
    assert [node.op_type for node in after.graph.node] == ["Mul", "Reshape", "Split"]
    feeds = {"qkv": np.random.default_rng(3).standard_normal((5, 3 * width)).astype(np.float32)}
    for a, b in zip(_outputs(before, feeds), _outputs(after, feeds)):
        np.testing.assert_array_equal(a, b)
