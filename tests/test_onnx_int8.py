"""ONNX graph rewriting and int8: loop invariants hoisted out of the beam
search's `Loop` without changing its results; `export --format onnx
--quantization int8` writes int8 matrix products only after a validation-BLEU
check against float32, and refuses (writing nothing) when int8 loses too much."""

import json
import shutil

import numpy as np
import onnx
import onnxruntime
import pytest
import sacrebleu
from onnx import TensorProto, helper, numpy_helper

from keras_transformer import cli
from keras_transformer_export.fused_kernels import FUSIONS, count_fused, fuse_for_onnx_runtime
from keras_transformer_export.graph_rewrites import (
    all_graphs,
    collapse_tensordots,
    compare_integers,
    count_nodes,
    fuse_layer_norms,
    hoist_loop_invariants,
    read_shapes_in_int64,
    read_transposed_weights,
    select_with_where,
)
from keras_transformer_export.lean_search import step_body
from keras_transformer_export.onnx_runtime import OnnxTranslator
from keras_transformer_export.quantization import (
    BleuGate,
    QuantizationRefused,
    count_quantized,
    quantize_embeddings,
)


def _loop_model():
    """y = x @ reshape(w) applied `n` times in a `Loop` that carries `w` unchanged (as tf2onnx does)."""
    weight = np.arange(16, dtype=np.float32).reshape(2, 8) / 16.0
    body = helper.make_graph(
        [
            helper.make_node("Reshape", ["w_in", "shape"], ["w_square"]),
            helper.make_node("MatMul", ["x_in", "w_square"], ["x_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [1, 4]),
            helper.make_tensor_value_info("w_in", TensorProto.FLOAT, [2, 8]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [1, 4]),
            helper.make_tensor_value_info("w_in", TensorProto.FLOAT, [2, 8]),
        ],
        initializer=[numpy_helper.from_array(np.array([4, 4], np.int64), "shape")],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Loop", ["n", "", "x", "w"], ["x_final", "w_final"], body=body),
            helper.make_node("Identity", ["x_final"], ["y"]),
        ],
        "loop",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
            helper.make_tensor_value_info("n", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        initializer=[numpy_helper.from_array(weight, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model, **feeds):
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def test_hoisting_reads_weights_from_outside_the_loop_and_keeps_the_results():
    model = _loop_model()
    x, n = np.array([[1.0, -2.0, 0.5, 3.0]], np.float32), np.array(3, np.int64)
    before = _run(model, x=x, n=n)
    hoisted = hoist_loop_invariants(_loop_model())
    onnx.checker.check_model(hoisted, full_check=True)
    loop = next(node for node in hoisted.graph.node if node.op_type == "Loop")
    body = loop.attribute[0].g
    assert list(loop.input) == ["n", "", "x"] and list(loop.output) == ["x_final"]
    assert [node.op_type for node in body.node] == ["MatMul", "Identity"]  # the Reshape runs once
    assert count_nodes(hoisted) == (2, 2)
    matmul = body.node[0]
    assert matmul.input[1] in {init.name for init in hoisted.graph.initializer}
    np.testing.assert_array_equal(_run(hoisted, x=x, n=n), before)


def _tied_embedding_model(hidden_rank=2):
    """Embeddings `Gather(E, ids)` and logits `hidden @ Eᵀ`, Eᵀ a second constant (as hoisting leaves it)."""
    table = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    hidden_shape = ["rows", 4] if hidden_rank == 2 else ["batch", "length", 4]
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["E", "ids"], ["embedded"]),
            helper.make_node("MatMul", ["hidden", "E_transposed"], ["logits"], name="projection"),
        ],
        "tied",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "length"]),
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, hidden_shape),
        ],
        [
            helper.make_tensor_value_info("embedded", TensorProto.FLOAT, ["batch", "length", 4]),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, [*hidden_shape[:-1], 6]),
        ],
        initializer=[
            numpy_helper.from_array(table, "E"),
            numpy_helper.from_array(table.T.copy(), "E_transposed"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), table


def _run_all(model, **feeds):
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_tied_projection_reads_the_one_stored_embedding():
    model, table = _tied_embedding_model()
    ids = np.array([[0, 5, 2], [3, 3, 1]], np.int64)
    hidden = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    before = _run_all(model, ids=ids, hidden=hidden)
    read_transposed_weights(model)
    onnx.checker.check_model(model, full_check=True)
    assert [init.name for init in model.graph.initializer] == ["E"]
    projection = model.graph.node[1]
    assert projection.op_type == "Gemm" and list(projection.input) == ["hidden", "E"]
    assert helper.get_attribute_value(projection.attribute[0]) == 1  # transB
    after = _run_all(model, ids=ids, hidden=hidden)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_allclose(after[1], before[1], rtol=1e-6, atol=1e-6)


def test_tied_projection_of_a_batch_of_sequences_keeps_its_matmul():
    model, _ = _tied_embedding_model(hidden_rank=3)  # Gemm multiplies matrices only
    read_transposed_weights(model)
    assert [node.op_type for node in model.graph.node] == ["Gather", "MatMul"]
    assert len(model.graph.initializer) == 2


def test_int8_embedding_is_stored_once_with_a_scale_per_row():
    model, table = _tied_embedding_model()
    read_transposed_weights(model)
    ids = np.array([[0, 5, 2], [3, 3, 1]], np.int64)
    hidden = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    quantize_embeddings(model)
    onnx.checker.check_model(model, full_check=True)
    stored = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    assert set(stored) == {"E/int8_transposed", "E/row_scales"}
    assert stored["E/int8_transposed"].dtype == np.int8 and stored["E/int8_transposed"].shape == (4, 6)
    scales = np.abs(table).max(axis=1) / 127
    np.testing.assert_allclose(stored["E/row_scales"], scales, rtol=1e-6)
    embedded, logits = _run_all(model, ids=ids, hidden=hidden)
    # Each looked-up entry is its row to within half that row's quantization step.
    assert embedded.shape == (2, 3, 4)
    assert np.all(np.abs(embedded - table[ids]) <= scales[ids][..., None] / 2 + 1e-6)
    # The projection multiplies uint8-quantized activations by the int8 rows: close to float32.
    assert logits.shape == (3, 6)
    np.testing.assert_allclose(logits, hidden @ table.T, atol=0.05 * np.abs(hidden @ table.T).max())


# `keras_transformer_export.onnx.convert` (tf2onnx) is tested by tests/test_export.py; here it returns
# the graphs that test's float32 export wrote, so that these tests pay for quantization and the gate only.
# Not `decoder_step`: the export writes it after `step_rewrites.leaner_step`, which the exports
# here apply themselves after quantizing and fusing (a step quantized after its rewrite is not what
# any export writes), so it is converted again.
CONVERTED = {
    "forward": "forward",
    "encode": "encoder",
    "align": "align",
}


@pytest.fixture(scope="module")
def converted(exported):
    import keras_transformer_export.onnx

    real = keras_transformer_export.onnx.convert

    def convert(graphs, name, extra_opset=None, function=None):
        if name in CONVERTED:
            return onnx.load(str(exported[1] / f"{CONVERTED[name]}.onnx"))
        return real(graphs, name, extra_opset, function)  # the text graph's tokenizer part

    def translate_graph(graphs):  # the assembled translate.onnx, as the float32 export wrote it
        return onnx.load(str(exported[1] / "translate.onnx"))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(keras_transformer_export.onnx, "convert", convert)
        patch.setattr(keras_transformer_export.onnx, "translate_graph", translate_graph)
        yield exported[1]


@pytest.fixture(scope="module")
def int8_export(trained_run, converted, tmp_path_factory):
    """`export --format onnx --quantization int8` of the tiny run (the gate on its 40 held-out pairs)."""
    out = tmp_path_factory.mktemp("int8") / "onnx-int8"
    assert (
        cli.main(
            [
                "export",
                "--model",
                str(trained_run),
                "--format",
                "onnx",
                "--quantize",
                "int8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    return out


def test_int8_export_quantizes_the_loop_and_records_the_bleu_check(int8_export, converted):
    translate = onnx.load(str(int8_export / "translate.onnx"))
    integer, floating = count_quantized(translate)
    # tiny: 2+2 layers -> in each search's Loop 2x(fused Q/K/V + output + cross Q + cross output
    # + 2 feed-forward) + the output projection in int8; the float MatMuls are the attention
    # products (2 per attention, 2 attentions per layer).
    loops = [n for g in all_graphs(translate.graph) for n in g.node if n.op_type == "Loop"]
    assert len(loops) == 3  # the plain beam search, with controls, sampling
    for loop in loops:
        body = [
            n.op_type
            for g in all_graphs(next(a.g for a in loop.attribute if a.name == "body"))
            for n in g.node
        ]
        assert (body.count("MatMulInteger"), body.count("MatMul")) == (2 * 6 + 1, 2 * 2 * 2), loop.name
    # No weight is left in float32 anywhere (the encoders, the aligner): every product with a
    # stored matrix is a MatMulInteger.
    weights = {i.name for g in all_graphs(translate.graph) for i in g.initializer if len(i.dims) == 2}
    float_products = [
        n for g in all_graphs(translate.graph) for n in g.node if n.op_type in ("MatMul", "Gemm")
    ]
    assert floating == len(float_products) and not [n.name for n in float_products if set(n.input) & weights]
    metadata = json.loads((int8_export / "export.json").read_text())
    entry = metadata["quantization"]
    assert entry["type"] == "int8" and entry["translate_matmuls"] == {"int8": integer, "float32": floating}
    gate = entry["gate"]
    assert gate["sentences"] == 40 and gate["passed"] and not gate["forced"]
    assert gate["bleu_drop"] == pytest.approx(gate["bleu_float32"] - gate["bleu_int8"], abs=0.02)
    assert gate["bleu_drop"] <= gate["max_bleu_drop"] == 1.0
    assert 0 <= gate["identical_translations"] <= 40
    assert json.loads((converted / "export.json").read_text())["quantization"] == {"type": "float32"}
    # The int8 step rewritten too, as matrices: ONNX Runtime makes each Add + LayerNormalization
    # of the converted (rows, 1, width) step alone one SkipLayerNormalization (other bits), but
    # never inside a Loop, and `step_rewrites.verified` compares without that fusion.
    assert metadata["step_rewrites"] == {
        "positions_by_gather": 1,
        "rows_as_matrices": 1,
        "collapse_scaled_reshapes": 2,
        "split_heads_once": 2,
    }


def _vocabulary_matrices(model, vocab):
    """`(shape, dtype)` of each stored matrix of `model` with a vocabulary-sized axis (not the
    int64 index rows of the sampler)."""
    return sorted(
        (tuple(init.dims), numpy_helper.to_array(init).dtype.name)
        for graph in all_graphs(model.graph)
        for init in graph.initializer
        if len(init.dims) == 2 and vocab in init.dims and init.data_type != TensorProto.INT64
    )


def test_tied_embedding_is_stored_once_in_float32_and_in_int8(int8_export, converted):
    config = json.loads((converted / "export.json").read_text())["model"]
    vocab, width = config["vocab_size"], config["d_model"]
    # float32: the one matrix E that the lookups and the output projection's Gemm read.
    assert _vocabulary_matrices(onnx.load(str(converted / "translate.onnx")), vocab) == [
        ((vocab, width), "float32")
    ]
    # int8: Qᵀ (with a scale per vocabulary entry); no float32 copy of the embedding is left.
    int8 = onnx.load(str(int8_export / "translate.onnx"))
    assert _vocabulary_matrices(int8, vocab) == [((width, vocab), "int8")]
    scales = [init for init in int8.graph.initializer if init.name.endswith("/row_scales")]
    assert [(tuple(s.dims), s.data_type) for s in scales] == [((vocab,), TensorProto.FLOAT)]


def test_int8_lookup_reads_rows_of_a_table_onnx_runtime_folds_and_the_stage_copies_none(
    int8_export, converted
):
    """The int8 lookups gather rows (axis 0) of `Transpose(Qᵀ)`, a constant ONNX Runtime folds
    when it loads the graph (no `Transpose` is left to run in the step), and `translate_lean.onnx`
    keeps that node in its step rather than copy `Qᵀ` into the stage (`_hoist_invariants`: 1 MB
    more on the `mini` model)."""
    config = json.loads((converted / "export.json").read_text())["model"]
    vocab, width = config["vocab_size"], config["d_model"]
    # The lean graph holds the encoder's and the step's (the two graphs it is built from), no more.
    for stem, copies in (("decoder_step", 1), ("translate_lean", 2)):
        model = onnx.load(str(int8_export / f"{stem}.onnx"))
        assert _vocabulary_matrices(model, vocab) == [((width, vocab), "int8")] * copies, stem
        graphs = list(all_graphs(model.graph))
        made_by = {name: node for graph in graphs for node in graph.node for name in node.output}
        lookups = [
            node
            for graph in graphs
            for node in graph.node
            if node.op_type == "Gather" and made_by.get(node.input[0], node).op_type == "Transpose"
        ]
        axes = [
            {a.name: helper.get_attribute_value(a) for a in node.attribute}.get("axis", 0) for node in lookups
        ]
        assert axes and set(axes) == {0}, stem
    options = onnxruntime.SessionOptions()
    options.optimized_model_filepath = str(int8_export.parent / "lean_optimized.onnx")
    onnxruntime.InferenceSession(
        str(int8_export / "translate_lean.onnx"), options, providers=["CPUExecutionProvider"]
    )
    optimized = step_body(onnx.load(options.optimized_model_filepath))
    assert not [node for node in optimized.node if node.op_type == "Transpose" and "int8" in node.input[0]]
    assert [node for node in optimized.node if node.op_type == "Gather" and "int8" in node.input[0]]


def test_int8_graphs_translate_in_every_mode(int8_export, synthetic_files):
    sentences = synthetic_files[0].read_text(encoding="utf-8").splitlines()[-20:]
    translators = {mode: OnnxTranslator(str(int8_export), mode) for mode in ("full", "split")}
    # Sentence by sentence: int8 activations are quantized per tensor, so a sentence's output
    # depends on the other rows of its batch. translate.onnx and the split driver's graphs
    # are quantized apart. ONNX Runtime's int8 kernels round differently on another CPU, and
    # the tiny run's outputs are long repetitions full of near-ties: on an Intel Xeon with AMX
    # (and in CI) all 20 were the same with scores within 2e-4 (the closing note of issue 40);
    # on an AMD EPYC (AVX-512, no AMX) one of the 20 took another path (scores -24.67 /
    # -24.82) and the others' scores differ by up to 5.7e-4 of their value, at 915a706 too.
    # So: at least 18 of 20 the same, their scores within 1e-3.
    full, split = ([translator.translate([s]) for s in sentences] for translator in translators.values())
    assert all(f[0][0] for f in full)
    same = [i for i, (f, s) in enumerate(zip(full, split)) if f[0] == s[0]]
    assert len(same) >= 18, [(f[0], s[0]) for f, s in zip(full, split)]
    np.testing.assert_allclose([full[i][1][0] for i in same], [split[i][1][0] for i in same], rtol=1e-3)
    batch = translators["full"].translate(sentences)
    assert all(batch[0]) and len(batch[0]) == len(sentences)


def _break_projection(directory):
    """Negates the int8 output projection (the weights shaped (d_model, vocab)) of translate.onnx."""
    path = directory / "translate.onnx"
    model = onnx.load(str(path))
    vocab = json.loads((directory / "export.json").read_text())["model"]["vocab_size"]
    broken = 0
    for init in model.graph.initializer:
        if init.dims and init.dims[-1] == vocab and init.data_type == TensorProto.INT8:
            init.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(init), init.name))
            broken += 1
    assert broken == 1
    onnx.save(model, str(path))


def test_gate_refuses_a_large_drop_unless_forced(int8_export, converted, tmp_path, synthetic_files):
    broken = tmp_path / "broken"
    shutil.copytree(int8_export, broken)
    _break_projection(broken)
    sources = synthetic_files[0].read_text(encoding="utf-8").splitlines()[-20:]
    # References: the float32 graphs' own translations, so float32 scores 100 and a broken
    # int8 model falls far below it (the 3-epoch tiny model is too weak for real references).
    references = OnnxTranslator(str(converted), "full").translate(sources)[0]
    gate = BleuGate(sources, references, max_drop=1.0)
    with pytest.raises(
        QuantizationRefused,
        match=r"int8 loses .* BLEU on 20 validation pairs "
        r"\(float32 100.00, .*nothing written",
    ):
        gate(str(converted), str(broken))
    report = BleuGate(sources, references, max_drop=1.0, force=True)(str(converted), str(broken))
    assert report["forced"] and not report["passed"] and report["bleu_drop"] > 1.0
    assert report["bleu_float32"] == 100.0


def test_refused_int8_export_writes_nothing(trained_run, converted, tmp_path, monkeypatch, capsys):
    def refuse(self, float_dir, int8_dir):
        raise QuantizationRefused("int8 loses 9.99 BLEU on 40 validation pairs; nothing written.")

    monkeypatch.setattr(BleuGate, "__call__", refuse)
    out = tmp_path / "int8"
    assert (
        cli.main(
            [
                "export",
                "--model",
                str(trained_run),
                "--format",
                "onnx",
                "--quantization",
                "int8",
                "--max-bleu-drop",
                "0.5",
                "--out",
                str(out),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "int8 loses 9.99 BLEU" in err and "Traceback" not in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")]


def _tensordot_model():
    """y = tensordot(x, w, 1) as tf2onnx converts it: Shape/Gather/Concat/Reshape/MatMul/Reshape."""
    weight = np.linspace(-1, 1, 4 * 3, dtype=np.float32).reshape(4, 3)
    constant = lambda name, values: numpy_helper.from_array(np.array(values, np.int64), name)  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Gather", ["x_shape", "free"], ["free_dims"], axis=0),
        helper.make_node("Concat", ["free_dims", "width"], ["out_shape"], axis=0),
        helper.make_node("Reshape", ["x", "flat"], ["x_flat"]),
        helper.make_node("MatMul", ["x_flat", "w"], ["y_flat"]),
        helper.make_node("Reshape", ["y_flat", "out_shape"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tensordot",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "t", 3])],
        initializer=[
            numpy_helper.from_array(weight, "w"),
            constant("free", [0, 1]),
            constant("width", [3]),
            constant("flat", [-1, 4]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_tensordot_chain_becomes_one_matmul_with_the_same_result():
    x = np.random.default_rng(0).normal(size=(2, 5, 4)).astype(np.float32)
    before = _run(_tensordot_model(), x=x)
    collapsed = collapse_tensordots(_tensordot_model())
    onnx.checker.check_model(collapsed, full_check=True)
    assert [(node.op_type, list(node.input)) for node in collapsed.graph.node] == [("MatMul", ["x", "w"])]
    np.testing.assert_array_equal(_run(collapsed, x=x), before)
    # A chain that flattens to something else than (rows, weight height) is left alone.
    other = _tensordot_model()
    other.graph.initializer[3].CopyFrom(numpy_helper.from_array(np.array([-1, 2], np.int64), "flat"))
    assert len(collapse_tensordots(other).graph.node) == 6


def _traced_layer_norm_model(width=6, epsilon=1e-6):
    """Keras' LayerNormalization as tf2onnx converts it (13 nodes), on `x` of shape (batch, len, width)."""
    rng = np.random.default_rng(1)
    gamma = rng.normal(size=(1, 1, width)).astype(np.float32)
    beta = rng.normal(size=(1, 1, width)).astype(np.float32)
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["mean"]),
        helper.make_node("Neg", ["mean"], ["neg_mean"]),
        helper.make_node("Sub", ["x", "mean"], ["diff"]),
        helper.make_node("Mul", ["diff", "diff"], ["square"]),
        helper.make_node("GlobalAveragePool", ["square"], ["variance"]),
        helper.make_node("Add", ["variance", "epsilon"], ["variance_eps"]),
        helper.make_node("Sqrt", ["variance_eps"], ["std"]),
        helper.make_node("Reciprocal", ["std"], ["rstd"]),
        helper.make_node("Mul", ["rstd", "gamma"], ["scale"]),
        helper.make_node("Mul", ["x", "scale"], ["x_scaled"]),
        helper.make_node("Mul", ["neg_mean", "scale"], ["mean_scaled"]),
        helper.make_node("Add", ["mean_scaled", "beta"], ["shift"]),
        helper.make_node("Add", ["x_scaled", "shift"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "layer_norm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None, width])],
        initializer=[
            numpy_helper.from_array(np.array(epsilon, np.float32), "epsilon"),
            numpy_helper.from_array(gamma, "gamma"),
            numpy_helper.from_array(beta, "beta"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_traced_layer_norm_becomes_one_node_with_the_same_result():
    x = np.random.default_rng(0).normal(size=(2, 3, 6)).astype(np.float32) * 4 + 1
    before = _run(_traced_layer_norm_model(), x=x)
    fused = fuse_layer_norms(_traced_layer_norm_model())
    onnx.checker.check_model(fused, full_check=True)
    assert [node.op_type for node in fused.graph.node] == ["LayerNormalization"]
    node = fused.graph.node[0]
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute} == pytest.approx(
        {"axis": -1, "epsilon": 1e-6}
    )
    np.testing.assert_allclose(_run(fused, x=x), before, rtol=1e-5, atol=1e-5)
    # A chain with a value read elsewhere (here the variance is also a graph output) is left alone.
    shared = _traced_layer_norm_model()
    shared.graph.output.append(helper.make_tensor_value_info("variance", TensorProto.FLOAT, None))
    assert len(fuse_layer_norms(shared).graph.node) == 13


def test_exported_graphs_have_every_layer_norm_fused(exported):
    """The tiny preset (2 + 2 layers): 2 norms per encoder layer, 3 per decoder layer, none left
    traced; translate.onnx has them in each search's loop (and its encoder) and in the aligner."""
    # align.onnx: the last decoder layer's cross-attention weights need only its first norm.
    expected = {"encoder": 4, "decoder_step": 6, "forward": 10, "align": 8}
    for name, count in expected.items():
        model = onnx.load(str(exported[1] / f"{name}.onnx"))
        ops = [node.op_type for graph in all_graphs(model.graph) for node in graph.node]
        assert ops.count("LayerNormalization") == count, name
        assert "GlobalAveragePool" not in ops, name
    translate = onnx.load(str(exported[1] / "translate.onnx"))
    loops = [n for g in all_graphs(translate.graph) for n in g.node if n.op_type == "Loop"]
    assert len(loops) == 3  # the plain beam search, with controls, sampling
    for loop in loops:
        body = next(a.g for a in loop.attribute if a.name == "body")
        assert [n.op_type for g in all_graphs(body) for n in g.node].count("LayerNormalization") == 6
    assert "GlobalAveragePool" not in [n.op_type for g in all_graphs(translate.graph) for n in g.node]


def _blend_model(swap=False):
    """`tf.where(c, p, q)` as tf2onnx converts it: `p * Cast(c) + q * Cast(Not(c))`."""
    nodes = [
        helper.make_node("Cast", ["c"], ["c_float"], to=TensorProto.FLOAT),
        helper.make_node("Not", ["c"], ["not_c"]),
        helper.make_node("Cast", ["not_c"], ["not_c_float"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["p", "c_float"] if not swap else ["c_float", "p"], ["kept"]),
        helper.make_node("Mul", ["q", "not_c_float"], ["dropped"]),
        helper.make_node("Add", ["kept", "dropped"] if not swap else ["dropped", "kept"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "blend",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, [1, 3]),
            helper.make_tensor_value_info("p", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("q", TensorProto.FLOAT, [2, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("swap", [False, True])
def test_a_where_blend_becomes_one_where_with_tensorflows_semantics(swap):
    c = np.array([[True, False, True]])
    # Infinite values where the condition does not pick them (as masked attention scores are).
    p = np.array([[1.0, np.inf, 3.0], [4.0, 5.0, 6.0]], np.float32)
    q = np.array([[-1.0, -2.0, -np.inf], [-4.0, -5.0, -6.0]], np.float32)
    blended = _run(_blend_model(swap), c=c, p=p, q=q)
    assert np.isnan(blended[0, 1]) and np.isnan(blended[0, 2])  # 0 * inf: the blend's flaw
    rewritten = select_with_where(_blend_model(swap))
    onnx.checker.check_model(rewritten, full_check=True)
    assert [(node.op_type, list(node.input)) for node in rewritten.graph.node] == [("Where", ["c", "p", "q"])]
    np.testing.assert_array_equal(_run(rewritten, c=c, p=p, q=q), np.where(c, p, q))  # tf.where's values
    # A product that is read twice is not a blend's private term: left alone.
    shared = _blend_model(swap)
    shared.graph.output.append(helper.make_tensor_value_info("kept", TensorProto.FLOAT, None))
    assert len(select_with_where(shared).graph.node) == 6


def test_exported_graphs_have_no_where_blend_left(exported):
    for name in ("encoder", "decoder_step", "forward", "translate"):
        model = onnx.load(str(exported[1] / f"{name}.onnx"))
        ops = [node.op_type for graph in all_graphs(model.graph) for node in graph.node]
        assert "Where" in ops, name
        before = count_nodes(model)
        assert count_nodes(select_with_where(model)) == before, name


def _int32_reshape_model(step=1, squeeze=False):
    """`x` (batch, 8) reshaped to `Concat(tf.shape(x)[:1], [2, 4])` as tf2onnx converts TensorFlow's
    int32 shape arithmetic (module docstring 6 of graph_rewrites), optionally through a
    Squeeze/Unsqueeze pair or with a Slice step of `step`."""

    def constant(name, values, dtype=np.int64):
        return numpy_helper.from_array(np.array(values, dtype), name)

    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Cast", ["shape"], ["shape32"], to=TensorProto.INT32),
        helper.make_node("Slice", ["shape32", "zero", "one", "zero", "step"], ["batch"]),
    ]
    if squeeze:
        nodes += [
            helper.make_node("Squeeze", ["batch", "zero"], ["batch_scalar"]),
            helper.make_node("Unsqueeze", ["batch_scalar", "zero"], ["batch_vector"]),
        ]
    nodes += [
        helper.make_node("Concat", ["batch_vector" if squeeze else "batch", "rest"], ["target32"], axis=0),
        helper.make_node("Cast", ["target32"], ["target"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["x", "target"], ["y"], allowzero=1),
    ]
    graph = helper.make_graph(
        nodes,
        "int32_reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 2, 4])],
        initializer=[
            constant("zero", [0]),
            constant("one", [1]),
            constant("step", [step]),
            constant("rest", [2, 4], np.int32),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("squeeze", [False, True])
def test_an_int32_reshape_shape_is_read_from_shape_in_int64_with_the_same_result(squeeze):
    rewritten = read_shapes_in_int64(_int32_reshape_model(squeeze=squeeze))
    onnx.checker.check_model(rewritten, full_check=True)
    ops = [node.op_type for node in rewritten.graph.node]
    assert ops == ["Shape", "Concat", "Reshape"], ops
    shape = rewritten.graph.node[0]
    assert {a.name: helper.get_attribute_value(a) for a in shape.attribute} == {"start": 0, "end": 1}
    for batch in (3, 1, 0):  # an empty batch too: the reshape keeps allowzero
        x = np.arange(batch * 8, dtype=np.float32).reshape(batch, 8)
        np.testing.assert_array_equal(_run(rewritten, x=x), x.reshape(batch, 2, 4))
    # A slice with another step is not a slice of the shape that `Shape(start, end)` reads: left alone.
    left = read_shapes_in_int64(_int32_reshape_model(step=2))
    assert len(left.graph.node) == 6 and len(left.graph.initializer) == 4


def test_exported_graphs_have_no_int32_reshape_shape_left(exported):
    for name in ("encoder", "decoder_step", "forward", "translate"):
        model = onnx.load(str(exported[1] / f"{name}.onnx"))
        before = count_nodes(model)
        assert count_nodes(read_shapes_in_int64(model)) == before, name


@pytest.fixture(scope="module")
def fused_export(trained_run, converted, tmp_path_factory):
    """`export --format onnx --onnx-kernels fused` of the tiny run (from the converted graphs)."""
    out = tmp_path_factory.mktemp("fused") / "onnx-fused"
    arguments = ["export", "--model", str(trained_run), "--format", "onnx", "--onnx-kernels", "fused"]
    assert cli.main([*arguments, "--out", str(out)]) == 0
    return out


def _ops(graph):
    return [node.op_type for g in all_graphs(graph) for node in g.node]


def test_fused_export_has_onnx_runtime_kernels_in_every_decoding_step(fused_export, converted):
    """The tiny preset (2 + 2 layers): in each search's Loop (plain, with controls, sampling) every
    cross-attention is one MultiHeadAttention; the self-attentions keep their nodes (one Softmax
    each) and the residuals + LayerNorms theirs (3 per layer): the fused kernels were slower
    there (`fused_kernels.DEFAULT_FUSIONS`)."""
    metadata = json.loads((fused_export / "export.json").read_text())
    assert metadata["kernels"] == "fused" and json.loads((converted / "export.json").read_text())[
        "kernels"
    ] in ("portable", None)
    translate = onnx.load(str(fused_export / "translate.onnx"))
    onnx.checker.check_model(translate, full_check=True)
    loops = [n for g in all_graphs(translate.graph) for n in g.node if n.op_type == "Loop"]
    assert len(loops) == 3
    for loop in loops:
        ops = _ops(next(a.g for a in loop.attribute if a.name == "body"))
        assert (ops.count("MultiHeadAttention"), ops.count("LayerNormalization")) == (2, 6), loop.name
        assert ops.count("Softmax") == 2 and "SkipLayerNormalization" not in ops, loop.name
    assert metadata["fused_kernels"] == count_fused(translate)
    portable = onnx.load(str(converted / "translate.onnx"))
    assert count_nodes(translate)[1] < count_nodes(portable)[1]
    step = _ops(onnx.load(str(fused_export / "decoder_step.onnx")).graph)
    assert (step.count("MultiHeadAttention"), step.count("LayerNormalization")) == (2, 6)


def test_fused_graphs_translate_as_the_portable_ones(fused_export, converted, synthetic_files):
    from keras_transformer_export.parity import translate_in_subprocess

    sentences = synthetic_files[0].read_text(encoding="utf-8").splitlines()[-24:]
    for mode in ("full", "split", "lean"):
        fused = OnnxTranslator(str(fused_export), mode).translate(sentences)
        portable = OnnxTranslator(str(converted), mode).translate(sentences)
        assert fused[0] == portable[0], mode
        np.testing.assert_allclose(fused[1], portable[1], rtol=1e-4, atol=1e-4)
    assert translate_in_subprocess(str(fused_export), sentences, "text") == portable[0]


def test_fused_int8_export_is_gated_fused_and_translates_as_the_portable_int8(
    int8_export, trained_run, converted, synthetic_files, tmp_path
):
    """`--quantization int8 --onnx-kernels fused`: the gate checks the portable int8 graphs, then
    every decoding step gets the fused kernels around its int8 products, and the graphs translate
    as the portable int8 export does (to int8's own tolerance: `test_int8_graphs_translate_in_every_mode`)."""
    out = tmp_path / "onnx-int8-fused"
    arguments = ["export", "--model", str(trained_run), "--format", "onnx", "--quantization", "int8"]
    assert cli.main([*arguments, "--onnx-kernels", "fused", "--out", str(out)]) == 0
    metadata = json.loads((out / "export.json").read_text())
    assert metadata["kernels"] == "fused" and metadata["quantization"]["type"] == "int8"
    assert metadata["quantization"]["gate"]["passed"]
    # Its step as matrices (verified without ONNX Runtime's SkipLayerNormFusion, which fuses the
    # converted (rows, 1, width) step alone, never inside a Loop): the int8 embedding lookup
    # reads the ids (rows,), not (rows, 1).
    assert metadata["step_rewrites"]["rows_as_matrices"] == 1
    step = onnx.load(str(out / "decoder_step.onnx"))
    readers = [node.op_type for node in step.graph.node if "token_ids" in node.input]
    assert readers and set(readers) == {"Gather"}, readers
    translate = onnx.load(str(out / "translate.onnx"))
    assert metadata["fused_kernels"] == count_fused(translate)
    for loop in [n for g in all_graphs(translate.graph) for n in g.node if n.op_type == "Loop"]:
        ops = _ops(next(a.g for a in loop.attribute if a.name == "body"))
        assert (ops.count("MultiHeadAttention"), ops.count("LayerNormalization")) == (2, 6), loop.name
        assert ops.count("MatMulInteger") == 2 * 6 + 1, loop.name
    # int8 activations are quantized per tensor, so the fused kernels' float rounding (1e-7)
    # moves an activation across a quantization step now and then, and the tiny run's outputs
    # are long repetitions full of near-ties: on the AMD EPYC 17 of 20 were the same (scores
    # within 5e-4, as the portable int8 graphs' full and split modes differ), sacreBLEU 0.27
    # against 0.27. So: most the same, their scores within 1e-3, and BLEU within the gate's drop.
    sentences = synthetic_files[0].read_text(encoding="utf-8").splitlines()[-20:]
    references = synthetic_files[1].read_text(encoding="utf-8").splitlines()[-20:]
    for mode in ("full", "split", "lean"):
        fused, portable = (
            [translator.translate([s]) for s in sentences]
            for translator in (OnnxTranslator(str(directory), mode) for directory in (out, int8_export))
        )
        same = [i for i, (f, p) in enumerate(zip(fused, portable)) if f[0] == p[0]]
        assert len(same) >= 15, (mode, [(f[0], p[0]) for f, p in zip(fused, portable)])
        hypotheses = [[found[0][0] for found in translations] for translations in (fused, portable)]
        bleu = [sacrebleu.corpus_bleu(texts, [references]).score for texts in hypotheses]
        assert abs(bleu[0] - bleu[1]) <= 1.0, bleu  # the gate's default --max-bleu-drop
        np.testing.assert_allclose(
            [fused[i][1][0] for i in same], [portable[i][1][0] for i in same], rtol=1e-3
        )


def test_fusion_keeps_a_step_of_attention_and_layer_norm_to_float_rounding():
    """A self-attention with a growing cache, a cross-attention with a padded source and a
    post-norm residual, written as the portable graph writes them, fused: the same values
    (to 1e-5), the same cache outputs, and a graph that reads nothing it did not read before."""
    model = _attention_step_model()
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((6, 1, 8)).astype(np.float32),
        "past_key": rng.standard_normal((6, 2, 3, 4)).astype(np.float32),
        "past_value": rng.standard_normal((6, 2, 3, 4)).astype(np.float32),
        "cross_key": rng.standard_normal((2, 2, 5, 4)).astype(np.float32),
        "cross_value": rng.standard_normal((2, 2, 5, 4)).astype(np.float32),
        "mask": np.array([[[True] * 5], [[True] * 3 + [False] * 2]]),
    }
    before = _outputs_by_name(model, feeds)
    fused = fuse_for_onnx_runtime(_attention_step_model(), fusions=FUSIONS)
    onnx.checker.check_model(fused, full_check=True)
    assert sorted(_ops(fused.graph)) == sorted(
        ["MatMul", "Split", "MultiHeadAttention", "MatMul", "SkipLayerNormalization", "MatMul", "Add"]
        + ["Shape", "Concat", "Reshape", "Squeeze", "Cast", "MultiHeadAttention", "Reshape"]
    )
    for name, value in _outputs_by_name(fused, feeds).items():
        np.testing.assert_allclose(value, before[name], rtol=1e-5, atol=1e-5, err_msg=name)
    # A scale other than 1/sqrt(depth) is not the op's: both attentions are left alone.
    odd = _ops(fuse_for_onnx_runtime(_attention_step_model(scale=0.3), fusions=FUSIONS).graph)
    counts = [odd.count(op) for op in ("MultiHeadAttention", "Softmax", "SkipLayerNormalization")]
    assert counts == [0, 2, 1]


def _outputs_by_name(model, feeds):
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in model.graph.output], session.run(None, feeds)))


def _attention_step_model(scale=None, heads=2, depth=4):
    """One decoder step's self-attention (growing cache), residual + LayerNorm and
    cross-attention (beams folded into the query length), as the portable graph has them."""
    width = heads * depth
    scale = depth**-0.5 if scale is None else scale
    rng = np.random.default_rng(1)

    def weight(*shape):
        return rng.standard_normal(shape).astype(np.float32) / 3

    constants = {
        "w_qkv": weight(width, 3 * width), "b_qkv": weight(3 * width), "w_o": weight(width, width),
        "b_o": weight(width), "gamma": 1 + weight(width), "beta": weight(width),
        "w_q": weight(width, width), "b_q": weight(width), "scale": np.float32(scale),
        "heads": np.array([-1, heads, 1, depth], np.int64),
        "split": np.array([-1, 1, heads, depth], np.int64),
        "rows": np.array([-1, 1, width], np.int64), "minus_one": np.array([-1], np.int64),
        "heads_part": np.array([heads], np.int64), "depth_part": np.array([depth], np.int64),
        "axis": np.array([1], np.int64), "fill": np.float32(-3e38), "zero": np.float32(0),
    }  # fmt: skip
    node = helper.make_node
    nodes = [
        node("MatMul", ["x", "w_qkv"], ["qkv0"]),
        node("Add", ["qkv0", "b_qkv"], ["qkv"]),
        node("Split", ["qkv"], ["q", "k", "v"], axis=-1),
        node("Reshape", ["k", "heads"], ["kh"]),
        node("Concat", ["past_key", "kh"], ["present_key"], axis=2),
        node("Reshape", ["v", "heads"], ["vh"]),
        node("Concat", ["past_value", "vh"], ["present_value"], axis=2),
        node("Transpose", ["present_key"], ["kt"], perm=[0, 1, 3, 2]),
        node("Reshape", ["q", "split"], ["q4"]),
        node("Mul", ["q4", "scale"], ["qs"]),
        node("Reshape", ["qs", "heads"], ["qh"]),
        node("MatMul", ["qh", "kt"], ["logits"]),
        node("Softmax", ["logits"], ["probs"]),
        node("MatMul", ["probs", "present_value"], ["context"]),
        node("Reshape", ["context", "rows"], ["merged"]),
        node("MatMul", ["merged", "w_o"], ["out0"]),
        node("Add", ["out0", "b_o"], ["out"]),
        node("Add", ["x", "out"], ["residual"]),
        node("LayerNormalization", ["residual", "gamma", "beta"], ["normed"], axis=-1, epsilon=1e-6),
        # Cross-attention: (rows, 1, width) -> (sentences, beams, heads, depth) -> heads first.
        node("MatMul", ["normed", "w_q"], ["cq0"]),
        node("Add", ["cq0", "b_q"], ["cq"]),
        node("Shape", ["cross_key"], ["sentences"], start=0, end=1),
        node("Concat", ["sentences", "minus_one", "heads_part", "depth_part"], ["fold4"], axis=0),
        node("Reshape", ["cq", "fold4"], ["cq4"]),
        node("Mul", ["cq4", "scale"], ["cqs"]),
        node("Transpose", ["cqs"], ["cqt"], perm=[0, 2, 1, 3]),
        node("Transpose", ["cross_key"], ["ckt"], perm=[0, 1, 3, 2]),
        node("MatMul", ["cqt", "ckt"], ["clogits"]),
        node("Unsqueeze", ["mask", "axis"], ["mask4"]),
        node("Where", ["mask4", "clogits", "fill"], ["cmasked"]),
        node("Softmax", ["cmasked"], ["cprobs"]),
        node("Where", ["mask4", "cprobs", "zero"], ["cprobs0"]),
        node("MatMul", ["cprobs0", "cross_value"], ["ccontext"]),
        node("Transpose", ["ccontext"], ["cct"], perm=[0, 2, 1, 3]),
        node("Reshape", ["cct", "rows"], ["y"]),
    ]
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "step",
        [
            value("x", TensorProto.FLOAT, ["rows", 1, width]),
            value("past_key", TensorProto.FLOAT, ["rows", heads, "t", depth]),
            value("past_value", TensorProto.FLOAT, ["rows", heads, "t", depth]),
            value("cross_key", TensorProto.FLOAT, ["sentences", heads, "source", depth]),
            value("cross_value", TensorProto.FLOAT, ["sentences", heads, "source", depth]),
            value("mask", TensorProto.BOOL, ["sentences", 1, "source"]),
        ],
        [
            value("y", TensorProto.FLOAT, ["rows", 1, width]),
            value("present_key", TensorProto.FLOAT, ["rows", heads, "t_next", depth]),
            value("present_value", TensorProto.FLOAT, ["rows", heads, "t_next", depth]),
            value("normed", TensorProto.FLOAT, ["rows", 1, width]),
        ],
        [numpy_helper.from_array(np.asarray(array), name) for name, array in constants.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_onnx_kernels_is_refused_outside_onnx(trained_run, tmp_path, capsys):
    arguments = ["export", "--model", str(trained_run), "--format", "saved_model", "--onnx-kernels", "fused"]
    assert cli.main([*arguments, "--out", str(tmp_path / "serving")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error == ["keras-transformer: error: --onnx-kernels fused is for --format onnx only; "
                     "drop it or use --format onnx."]  # fmt: skip
    assert not (tmp_path / "serving").exists()


def test_integers_tf2onnx_compares_as_floats_are_compared_as_integers():
    """tf2onnx converts an integer `Greater`/`Less` as a comparison of float32 casts: 2^31 + 5 and
    2^31 compare equal. `compare_integers` compares the integers (TensorFlow's results), with
    integral float constants read in the integer type (up to 2^24: a larger one was rounded by the
    conversion itself); a float comparison stays as it was."""
    import tensorflow as tf
    import tf2onnx

    def compare(x, y, small):
        return (
            tf.greater(x, y),
            tf.less(x, tf.constant(4, tf.int64)),
            tf.less(small, 7),
            tf.greater(tf.cast(small, tf.float32), 2.5),  # floats by choice: kept
        )

    spec = [tf.TensorSpec([None], tf.int64, name=n) for n in ("x", "y")] + [
        tf.TensorSpec([None], tf.int32, name="small")
    ]
    converted, _ = tf2onnx.convert.from_function(tf.function(compare), input_signature=spec, opset=17)
    feeds = dict(
        x=np.array([2**31 + 5, 2**31 + 7, 3], np.int64),
        y=np.array([2**31, 2**31 + 7, 2], np.int64),
        small=np.array([6, 7, 8], np.int32),
    )
    expected = [np.asarray(t) for t in compare(*(tf.constant(feeds[n]) for n in ("x", "y", "small")))]

    def run(model):
        session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, feeds)

    assert not np.array_equal(run(converted)[0], expected[0])  # the converted graph's error
    casts = sum(node.op_type == "Cast" for node in converted.graph.node)
    rewritten = compare_integers(converted)
    onnx.checker.check_model(rewritten, full_check=True)
    for found, wanted in zip(run(rewritten), expected):
        np.testing.assert_array_equal(found, wanted)
    assert sum(node.op_type == "Cast" for node in rewritten.graph.node) == 1  # the float comparison's
    assert casts > 1

    # A constant above 2^24 was rounded to float32 by the conversion itself (its value is lost):
    # such a comparison is left as converted.
    def large(x):
        return tf.less(x, tf.constant(2**31 + 6, tf.int64))

    converted, _ = tf2onnx.convert.from_function(tf.function(large), input_signature=spec[:1], opset=17)
    assert [n.op_type for n in compare_integers(converted).graph.node] == ["Cast", "Less"]
