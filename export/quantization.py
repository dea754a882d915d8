"""Int8 ONNX graphs (ONNX Runtime dynamic quantization), gated on validation BLEU.

`quantize_int8` applies `onnxruntime.quantization.quantize_dynamic` to the
matrix products with a constant weight: every `MatMul` of the encoder, of the
decoder (inside the beam search's `Loop` too: `keras_transformer_export.graph_rewrites` first
makes its weights visible as initializers) and the output projection. Weights
become per-tensor symmetric int8; activations are quantized to uint8 on the fly
(`DynamicQuantizeLinear` + `MatMulInteger`). The attention products
(scores, weighted values) have no constant operand and stay float32, as do
LayerNorm and softmax.

`quantize_dynamic` leaves the embedding matrix E in float32 (a `Gather`
reads it) and does not quantize `Gemm`; E is the model's largest weight (4 MB
of the `mini` model's 9.4 MB) and the tied output projection reads it as
`Gemm(x, E, transB=1)` (`keras_transformer_export.graph_rewrites`, 5).
`quantize_embeddings` stores E once as int8 `Qᵀ (d_model, vocab)` with one
scale per vocabulary entry (`E[v] ≈ s[v] · Q[v]`, symmetric, as CTranslate2
quantizes embeddings): the lookups read rows of `Transpose(Qᵀ)` (folded into a
constant by ONNX Runtime when it loads the graph) times the entries' scales,
the projection is `MatMulInteger` of the dynamically quantized `x` with `Qᵀ`,
scaled per column (the pattern `quantize_dynamic` writes, which ONNX Runtime
fuses into one kernel).

Measured on the Multi30k recipe model (`mini`, val, beam 5, α 1.0): float32
35.29 sacreBLEU, int8 35.15 (−0.14), int8 with the output projection left in
float32 35.03 (−0.26): the projection is quantized too.

Int8 can hurt a model more than that (CTranslate2's int8 kept 70/100 identical
translations on a weakly trained model), so `export_onnx(...,
quantization="int8", gate=BleuGate(...))` translates the validation sentences
with the float32 and the int8 `translate.onnx` in ONNX Runtime and refuses to
write the int8 graphs when BLEU falls by more than `max_drop`
(`DEFAULT_MAX_BLEU_DROP`, 1.0) unless forced; the measurement goes into
`export.json` either way.
"""

import logging
import os
import tempfile
import time

from keras_transformer.utils.checks import UserError
from keras_transformer_export.graph_rewrites import sort_nodes

DEFAULT_MAX_BLEU_DROP = 1.0


def quantize_int8(model):
    """An int8 copy of the ONNX `model` (a `ModelProto`): `MatMul`s with a constant weight, dynamic
    activations."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # quantize_dynamic logs advice about static quantization's pre-processing on the root
    # logger; it does not apply to dynamic quantization of a converted graph.
    advice = logging.Filter()
    advice.filter = lambda record: "pre-processing before quantization" not in record.getMessage()
    root = logging.getLogger()
    root.addFilter(advice)
    try:
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "int8.onnx")
            # The embedding first: quantize_dynamic would rewrite its Gemm as a MatMul over a second,
            # transposed copy of E, quantized per tensor.
            quantize_dynamic(
                quantize_embeddings(onnx.ModelProto.FromString(model.SerializeToString())),
                path,
                weight_type=QuantType.QInt8,
                op_types_to_quantize=["MatMul"],
                extra_options={"EnableSubgraph": True},
            )
            quantized = sort_nodes(onnx.load(path))
    finally:
        root.removeFilter(advice)
    quantized.doc_string = model.doc_string + " (int8)"
    return quantized


def quantize_embeddings(model):
    """`model` (changed in place and returned) with each constant that only `Gather(axis 0)` and
    `Gemm(transB=1)` read stored as int8 with per-row scales (module docstring)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from keras_transformer_export.graph_rewrites import all_graphs, tensor_ranks

    main = model.graph
    readers = {}  # value name -> [(graph, node, input position)] over all graphs
    outputs = set()  # values that are some graph's output: kept as they are
    for graph in all_graphs(main):
        outputs.update(output.name for output in graph.output)
        for node in graph.node:
            for position, name in enumerate(node.input):
                readers.setdefault(name, []).append((graph, node, position))
    ranks = None
    for init in list(main.initializer):
        uses = readers.get(init.name, [])
        if (
            init.data_type != onnx.TensorProto.FLOAT
            or len(init.dims) != 2
            or not uses
            or init.name in outputs
        ):
            continue
        if not all(
            _reads_rows(node, position) or _reads_transposed(node, position) for _, node, position in uses
        ):
            continue
        ranks = ranks if ranks is not None else tensor_ranks(model)
        table = numpy_helper.to_array(init)
        scales = np.abs(table).max(axis=1) / 127.0
        scales[scales == 0] = 1.0
        quantized = np.clip(np.rint(table / scales[:, None]), -127, 127).astype(np.int8)
        name = init.name
        main.initializer.remove(init)
        main.initializer.extend(
            [
                numpy_helper.from_array(np.ascontiguousarray(quantized.T), f"{name}/int8_transposed"),
                numpy_helper.from_array(scales.astype(np.float32), f"{name}/row_scales"),
            ]
        )
        for graph, node, _ in uses:
            nodes = (_lookup if node.op_type == "Gather" else _projection)(
                node, name, ranks.get(node.input[1])
            )
            position = list(graph.node).index(node)
            graph.node.remove(node)
            for offset, new in enumerate(nodes):
                new.name = new.output[0]  # named after the value it makes: a profile tells them apart
                graph.node.insert(position + offset, new)
    return model


def _reads_rows(node, position):
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    return node.op_type == "Gather" and position == 0 and axis == 0


def _reads_transposed(node, position):
    attributes = {a.name: (a.i if a.type == a.INT else a.f) for a in node.attribute}
    return (
        node.op_type == "Gemm"
        and position == 1
        and len(node.input) == 2
        and attributes.get("transB") == 1
        and not attributes.get("transA")
        and attributes.get("alpha", 1.0) == 1.0
    )


def _lookup(gather, table, ids_rank):
    """Nodes for `Gather(E, ids)` from the int8 `Qᵀ` and the row scales: `(ids..., d_model)` float32."""
    from onnx import TensorProto, helper

    prefix, ids, output = gather.name or gather.output[0], gather.input[1], gather.output[0]
    nodes = []
    flat = ids
    if ids_rank != 1:  # Gather along axis 1 puts the ids' axes last; look up a flat list, reshape back
        flat = f"{prefix}/flat_ids"
        nodes += [
            helper.make_node("Constant", [], [f"{prefix}/minus_one"], value_ints=[-1]),
            helper.make_node("Reshape", [ids, f"{prefix}/minus_one"], [flat]),
        ]
    rows = output if ids_rank == 1 else f"{prefix}/rows"
    # Rows of `Transpose(Qᵀ)`: a constant that ONNX Runtime folds once when it loads the graph, so
    # the file holds E once. `Gather(Qᵀ, ids, axis=1)` instead copied one byte at a time: 0.26 ms
    # a step at batch 32 on the `mini` model (ad hoc profile, AMD EPYC), 7% of the int8 step.
    nodes += [
        helper.make_node("Transpose", [f"{table}/int8_transposed"], [f"{prefix}/int8_table"], perm=[1, 0]),
        helper.make_node("Gather", [f"{prefix}/int8_table", flat], [f"{prefix}/int8_rows"], axis=0),
        helper.make_node("Cast", [f"{prefix}/int8_rows"], [f"{prefix}/float_rows"], to=TensorProto.FLOAT),
        helper.make_node("Gather", [f"{table}/row_scales", flat], [f"{prefix}/scales"], axis=0),
        helper.make_node("Constant", [], [f"{prefix}/last_axis"], value_ints=[1]),
        helper.make_node(
            "Unsqueeze", [f"{prefix}/scales", f"{prefix}/last_axis"], [f"{prefix}/scale_column"]
        ),
        helper.make_node("Mul", [f"{prefix}/float_rows", f"{prefix}/scale_column"], [rows]),
    ]
    if ids_rank != 1:
        nodes += [
            helper.make_node("Shape", [ids], [f"{prefix}/ids_shape"]),
            helper.make_node("Shape", [rows], [f"{prefix}/width"], start=1),
            helper.make_node(
                "Concat", [f"{prefix}/ids_shape", f"{prefix}/width"], [f"{prefix}/shape"], axis=0
            ),
            helper.make_node("Reshape", [rows, f"{prefix}/shape"], [output]),
        ]
    return nodes


def _projection(gemm, table, _):
    """Nodes for `Gemm(x, E, transB=1)`: uint8 `x` (per call) times the int8 `Qᵀ`, scaled per column."""
    from onnx import TensorProto, helper

    prefix, x, output = gemm.name or gemm.output[0], gemm.input[0], gemm.output[0]
    return [
        helper.make_node(
            "DynamicQuantizeLinear",
            [x],
            [f"{prefix}/x_uint8", f"{prefix}/x_scale", f"{prefix}/x_zero_point"],
        ),
        helper.make_node(
            "MatMulInteger",
            [f"{prefix}/x_uint8", f"{table}/int8_transposed", f"{prefix}/x_zero_point"],
            [f"{prefix}/int32"],
        ),
        helper.make_node("Cast", [f"{prefix}/int32"], [f"{prefix}/float"], to=TensorProto.FLOAT),
        helper.make_node("Mul", [f"{prefix}/x_scale", f"{table}/row_scales"], [f"{prefix}/scale"]),
        helper.make_node("Mul", [f"{prefix}/float", f"{prefix}/scale"], [output]),
    ]


def count_quantized(model):
    """`(MatMulInteger, float MatMul)` node counts over the model and its `Loop` bodies."""
    from keras_transformer_export.graph_rewrites import all_graphs

    types = [node.op_type for graph in all_graphs(model.graph) for node in graph.node]
    return types.count("MatMulInteger"), types.count("MatMul")


class QuantizationRefused(UserError):
    """Int8 lost more BLEU than allowed (one line for the CLI, exit 2)."""


class BleuGate:
    """Compares the float32 and int8 `translate.onnx` on validation pairs; refuses a large BLEU drop.

    Args:
        sources, references: the validation pairs (lists of str).
        target_lang: for sacreBLEU's tokenizer choice (`score_translations`).
        max_drop: the largest allowed fall in sacreBLEU, in BLEU points.
        force: write int8 even when the drop is larger (the report says so).
        threads: ONNX Runtime intra-op threads.

    Called as `gate(float_dir, int8_dir)` by `export_onnx`; returns the
    report for `export.json` or raises `QuantizationRefused`.
    """

    def __init__(
        self,
        sources,
        references,
        target_lang=None,
        max_drop=DEFAULT_MAX_BLEU_DROP,
        force=False,
        threads=None,
        log=None,
    ):
        if not sources or len(sources) != len(references):
            raise ValueError("BleuGate needs aligned, non-empty validation pairs.")
        if max_drop < 0:
            raise ValueError(f"max_drop must be >= 0; got {max_drop}.")
        self.sources, self.references = list(sources), list(references)
        self.target_lang, self.max_drop, self.force = target_lang, max_drop, force
        self.threads, self.log = threads, log

    def __call__(self, float_dir, int8_dir):
        from keras_transformer.evaluation import score_translations
        from keras_transformer_export.onnx_runtime import OnnxTranslator

        scores, texts, seconds = {}, {}, {}
        for name, directory in (("float32", float_dir), ("int8", int8_dir)):
            start = time.perf_counter()
            texts[name] = OnnxTranslator(directory, "full", batch_size=32, threads=self.threads).translate(
                self.sources
            )[0]
            seconds[name] = round(time.perf_counter() - start, 1)
            scores[name] = score_translations(texts[name], self.references, self.target_lang)
        drop = scores["float32"].bleu - scores["int8"].bleu
        report = {
            "sentences": len(self.sources),
            "bleu_float32": round(scores["float32"].bleu, 2),
            "bleu_int8": round(scores["int8"].bleu, 2),
            "bleu_drop": round(drop, 2),
            "max_bleu_drop": self.max_drop,
            "chrf_float32": round(scores["float32"].chrf, 2),
            "chrf_int8": round(scores["int8"].chrf, 2),
            "identical_translations": sum(a == b for a, b in zip(texts["float32"], texts["int8"])),
            "bleu_signature": scores["int8"].bleu_signature,
            "seconds": seconds,
            "passed": drop <= self.max_drop,
            "forced": bool(self.force and drop > self.max_drop),
        }
        if self.log is not None:
            self.log(
                f"int8 check on {len(self.sources)} validation pairs: BLEU {report['bleu_float32']} "
                f"(float32) -> {report['bleu_int8']} (int8), {report['identical_translations']} "
                f"identical translations"
            )
        if drop > self.max_drop and not self.force:
            raise QuantizationRefused(
                f"int8 loses {drop:.2f} BLEU on {len(self.sources)} validation pairs (float32 "
                f"{scores['float32'].bleu:.2f}, int8 {scores['int8'].bleu:.2f}), more than the allowed "
                f"{self.max_drop:g}; nothing written. Export float32, or pass --max-bleu-drop or --force."
            )
        return report
