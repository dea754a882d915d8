"""ONNX graphs of a trained model, for ONNX Runtime.

`export_onnx` converts the functions of `keras_transformer_export.graphs.TranslationGraphs`
with `tf2onnx.convert.from_function` (not `from_keras`, which is broken on
Keras 3) and writes, atomically (`keras_transformer_export.layout.atomic_directory`):

| file                  | inputs                                   | outputs                         |
|-----------------------|------------------------------------------|---------------------------------|
| `forward.onnx`        | source_ids, target_ids int32 (batch, len) | logits float32 (batch, len_tgt, vocab) |
| `translate.onnx`      | source_ids int32 (batch, len_src)        | target_ids int32 (batch, max_len), scores float32 (batch,) |
| `encoder.onnx`        | source_ids                               | memory_mask bool (batch, 1, len_src), cross_key_i, cross_value_i |
| `decoder_step.onnx`   | token_ids (rows,), memory_mask, past_key_i, past_value_i (rows, heads, t, depth), cross_key_i, cross_value_i | logits, log_probs (rows, vocab), present_key_i, present_value_i (rows, heads, t + 1, depth) |
| `translate_text.onnx` | text string (batch,)                     | translation string (batch,), score float32 (batch,) |
| `translate_lean.onnx` | source_ids; length_penalty, max_extra_length, min_length (defaults: the export's) | target_ids, scores, nbest_ids (batch, beam, max_len), nbest_scores, nbest_log_probs (batch, beam) |
| `tokenizer.model`     | the SentencePiece model (for the ids graphs) |                             |
| `export.json`         | versions, model config, decoding settings, each graph's inputs/outputs |         |

Every graph has dynamic batch and length axes, opset 17, and passes
`onnx.checker.check_model(full_check=True)`. `translate.onnx` holds the
whole beam search as one ONNX `Loop`; `encoder.onnx` + `decoder_step.onnx`
are for runtimes that dislike `Loop`, driven by `export.onnx_beam_search`.
`translate_lean.onnx` is the beam search of requests without controls written as ONNX
nodes around `encoder.onnx` and `decoder_step.onnx` (`keras_transformer_export.lean_search`:
the same tokens, ~65 nodes of search per step instead of ~200, faster at batch 1).

Every converted graph is then rewritten by `keras_transformer_export.graph_rewrites.simplify`
(the same arithmetic, fewer nodes): the decoder weights that tf2onnx threads
through the `Loop` state are read from the enclosing graph with their
per-step reshapes done once, and each `tensordot` chain (8 nodes) becomes one
`MatMul` (the `mini` model's loop body: 1,555 → 1,258 nodes; ~25% faster at
batch 1). `decoder_step.onnx` (so `translate_lean.onnx`'s step too) is then rewritten by
`keras_transformer_export.step_rewrites.leaner_step` with what is known of one step (the
position is the cache length, the new positions a matrix), kept only where ONNX Runtime gives
bitwise the same outputs; `export.json`'s `step_rewrites` says which were kept.

`export_onnx(..., quantization="int8", gate=...)` writes the same files with
int8 matrix products (`keras_transformer_export.quantization`), refused if the gate measures a
larger validation BLEU drop than allowed.

`translate_text.onnx` needs onnxruntime-extensions (`ai.onnx.contrib`
domain): tf2onnx maps tf-text's SentencePiece tokenizer to its
`SentencepieceTokenizer` (the tokenizer graph is merged in front of
`translate.onnx` with `onnx.compose`); tf2onnx has no mapping for
detokenization, so the exporter appends a `Loop` over the batch of the
extensions' `SentencepieceDecoder` (which decodes one sentence per call). Unlike the
SavedModel it does not repair invalid UTF-8 (ONNX Runtime's string tensors
come from `str` in Python, which is always valid).
"""

import contextlib
import dataclasses
import logging
import os

import numpy as np
import onnx
from onnx import TensorProto, compose, helper, numpy_helper

from keras_transformer.utils import keras_compat
from keras_transformer_export.fused_kernels import KERNELS, count_fused, fuse_for_onnx_runtime
from keras_transformer_export.graph_rewrites import (
    all_graphs,
    prefixed_graph,
    reshape_zeros_as_tensorflow,
    simplify,
)
from keras_transformer_export.graphs import TranslationGraphs
from keras_transformer_export.layout import atomic_directory
from keras_transformer_export.lean_search import lean_translate_graph
from keras_transformer_export.onnx_runtime import LEAN_GRAPH
from keras_transformer_export.step_rewrites import leaner_step

OPSET = 17
CONTRIB_DOMAIN = "ai.onnx.contrib"

# file stem -> TranslationGraphs function converted by tf2onnx
GRAPHS = {
    "forward": "forward",
    "translate": "translate_ids_with_options",
    "encoder": "encode",
    "decoder_step": "decoder_step",
    "align": "align",
}
TEXT_GRAPH = "translate_text"


QUANTIZATIONS = ("float32", "int8")


def export_onnx(
    graphs, out_dir, overwrite=False, log=None, quantization="float32", gate=None, kernels="portable"
):
    """Writes the ONNX graphs of `graphs` (a `TranslationGraphs`) into `out_dir`; returns its path.

    `quantization="int8"` writes int8 graphs (`keras_transformer_export.quantization.quantize_int8`);
    `gate`, if given, is called as `gate(float32_dir, int8_dir)` before the
    directory appears (e.g. `keras_transformer_export.quantization.BleuGate`): it returns a report
    stored in `export.json` or raises to write nothing (it checks the portable graphs).
    `kernels="fused"` then rewrites every graph with ONNX Runtime's fused CPU kernels
    (`keras_transformer_export.fused_kernels`: ONNX Runtime only). `log`, if given, is
    called with a line per graph written.
    """
    if not isinstance(graphs, TranslationGraphs):
        raise TypeError(f"graphs must be a TranslationGraphs; got {graphs!r}.")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}; got {quantization!r}.")
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}; got {kernels!r}.")
    described = {}
    with atomic_directory(out_dir, overwrite=overwrite) as temporary:
        models = {
            stem: simplify(translate_graph(graphs) if stem == "translate" else convert(graphs, function))
            for stem, function in GRAPHS.items()
        }
        with_defaults(models["translate"], request_defaults(graphs))
        extra = {"quantization": {"type": "float32"}}
        if quantization == "int8":
            models, extra = _int8(graphs, models, temporary, gate)
        extra["kernels"] = kernels
        if kernels == "fused":
            for model in models.values():
                fuse_for_onnx_runtime(model)
            extra["fused_kernels"] = count_fused(models["translate"])
        models["decoder_step"], extra["step_rewrites"] = leaner_step(models["decoder_step"])
        models[TEXT_GRAPH] = text_graph(graphs, models["translate"])
        models[LEAN_GRAPH] = lean_translate_graph(
            models["encoder"], models["decoder_step"], graphs.model_metadata(),
            {"beam_size": graphs.beam_size, **dataclasses.asdict(graphs.options)}, graphs.blank, graphs.never,
        )  # fmt: skip
        for stem, model in models.items():
            onnx.checker.check_model(model, full_check=True)
            path = os.path.join(temporary, f"{stem}.onnx")
            onnx.save(model, path)
            described[stem] = describe(model)
            if log is not None:
                log(f"wrote {stem}.onnx ({os.path.getsize(path) / 1e6:.1f} MB)")
        graphs.write_assets(temporary, opset=OPSET, graphs=described, **extra)
    return os.path.abspath(out_dir)


def _int8(graphs, models, temporary, gate):
    """The int8 graphs and their `export.json` entry; runs `gate` on float32 and int8 `translate.onnx`."""
    import shutil

    from keras_transformer_export.quantization import count_quantized, quantize_int8

    quantized = {stem: quantize_int8(model) for stem, model in models.items()}
    integer, floating = count_quantized(quantized["translate"])
    entry = {
        "type": "int8",
        "method": "onnxruntime.quantization.quantize_dynamic: MatMul weights "
        "int8 per tensor, activations uint8 per call; the tied embedding int8 "
        "with a scale per vocabulary entry (lookups and output projection)",
        "translate_matmuls": {"int8": integer, "float32": floating},
    }
    if gate is not None:
        # Both translate.onnx side by side in hidden scratch directories inside the partial export.
        directories = {name: os.path.join(temporary, f".gate-{name}") for name in QUANTIZATIONS}
        for name, directory in directories.items():
            graphs.write_assets(directory)
            onnx.save(
                (models if name == "float32" else quantized)["translate"],
                os.path.join(directory, "translate.onnx"),
            )
        try:
            entry["gate"] = gate(directories["float32"], directories["int8"])
        finally:
            for directory in directories.values():
                shutil.rmtree(directory, ignore_errors=True)
    return quantized, {"quantization": entry}


def convert(graphs, name, extra_opset=None, function=None):
    """The ONNX `ModelProto` of the `TranslationGraphs` function `name` (or of `function`, a
    `tf.function` with the input signature of `name`)."""
    import tensorflow as tf
    import tf2onnx

    keras_compat.patch_tf2onnx_for_numpy2()
    # tf2onnx deep-copies the whole graph before each of its optimizers, to roll one back that
    # fails ("catch errors"); none fails on these graphs, and without the copies the three
    # searches convert in ~45 s instead of ~60 s. (tf2onnx reads any value of this variable
    # as "false".)
    previous = os.environ.get("TF2ONNX_CATCH_ERRORS")
    os.environ["TF2ONNX_CATCH_ERRORS"] = "false"
    try:
        with _cleanups_only_after_changes(), _tf2onnx_quiet():
            model, _ = tf2onnx.convert.from_function(
                function or tf.function(getattr(graphs, name), autograph=False),
                input_signature=graphs.specs(name),
                opset=OPSET,
                extra_opset=extra_opset,
            )
    finally:
        if previous is None:
            del os.environ["TF2ONNX_CATCH_ERRORS"]
        else:
            os.environ["TF2ONNX_CATCH_ERRORS"] = previous
    _name_dynamic_axes(model)
    _scalar_loop_counters(model)
    reshape_zeros_as_tensorflow(model)
    model.doc_string = f"keras-transformer {name}"
    return model


@contextlib.contextmanager
def _tf2onnx_quiet():
    """tf2onnx's loggers at ERROR while it converts: its warnings here are hundreds of "missing
    output shape" lines for the values inside the searches' loops (shapes it cannot infer and
    does not need), which buried the export's own one-line report."""
    loggers = [logging.getLogger("tf2onnx")]
    loggers += [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith("tf2onnx.")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def _cleanups_only_after_changes():
    """tf2onnx with its dead-node sweep only where it can find something.

    After each of its optimizers (a dozen, applied until none changes the graph),
    tf2onnx syncs the graph's protos and sweeps the nodes no output needs, over every
    subgraph: about half of a search's conversion time. A sweep after an optimizer
    that changed nothing finds nothing the previous sweep left, so here the sync and
    the sweep run once before the optimizers and then after each change only (the
    same graph; the three searches convert ~40 s faster)."""
    from tf2onnx import optimizer
    from tf2onnx.optimizer.optimizer_base import GraphOptimizerBase

    original_optimize, original_graph = GraphOptimizerBase.optimize, optimizer.optimize_graph

    def optimize(self, graph, iteration):
        self.opt_iteration = iteration
        graph = self._optimize(graph)
        if self.graph_been_opt:
            graph.update_proto()
            graph.delete_unused_nodes(graph.outputs)
        return graph

    def optimize_graph(graph, catch_errors=True, optimizers=None):
        graph.update_proto()
        graph.delete_unused_nodes(graph.outputs)
        return original_graph(graph, catch_errors, optimizers=optimizers)

    GraphOptimizerBase.optimize, optimizer.optimize_graph = optimize, optimize_graph
    try:
        yield
    finally:
        GraphOptimizerBase.optimize, optimizer.optimize_graph = original_optimize, original_graph


# translate.onnx's outputs: those of each search, then the alignments.
SEARCH_OUTPUTS = ("target_ids", "scores", "nbest_ids", "nbest_scores", "nbest_log_probs")
# The prepared values `request_plan` gives the searches in place of the request's own.
PLANNED = ("source_ids", "target_prefix", "sentence_ids")


def translate_graph(graphs):
    """`translate.onnx`: the request's checks and preparation (`request_plan`), then

        the plain beam search, in the main graph (its Loop runs 0 steps unless it is chosen)
        If(plain, the plain search's outputs, If(sampling, sample, beam_with_controls))
        If(return_alignments, align, -1)

    each search converted alone (tf2onnx takes ~4x as long for the same searches inside
    `tf.cond`s and stores the weights once per branch) and stored once
    (`graph_rewrites.store_constants_once`, in `simplify`). The choice is made once per
    request, not per step. The default request's search is in the main graph, as before
    the options: a Loop inside an If reads the weights two scopes up, where ONNX Runtime
    does not pre-pack them (its matrix products were ~10% slower at batch 1, `mini`)."""
    from keras_transformer.decoding.request import SEARCHES

    plan = convert(graphs, "request_plan")
    plan.graph.CopyFrom(prefixed_graph(plan.graph, "plan/", {name: name for name in _input_names(plan)}))
    planned = {name: f"plan/planned_{name}" if name in PLANNED else name for name in _input_names(plan)}
    searches = {  # each simplified alone, its Loop at the top of its graph (as the rewrites expect)
        search: _branch(
            simplify(convert(graphs, "translate_ids_with_options", function=graphs.search_function(search))),
            f"{search}/",
            planned,
            SEARCH_OUTPUTS,
        )
        for search in SEARCHES
    }
    plain = searches.pop("beam")  # its nodes go into the main graph, its Loop gated by `plain`
    loops = [node for node in plain.node if node.op_type == "Loop"]
    if len(loops) != 1:  # pragma: no cover - the beam search is one loop
        raise ValueError(f"the plain beam search has {len(loops)} top-level Loops, expected 1")
    gate = [
        helper.make_node("Or", ["plan/sampling", "plan/with_controls"], ["plan/other_search"]),
        helper.make_node("Not", ["plan/other_search"], ["plan/plain"]),
    ]
    plain_nodes = list(plain.node)
    plain_nodes.insert(
        plain_nodes.index(loops[0]),
        helper.make_node("And", [loops[0].input[1], "plan/plain"], ["beam/gated_condition"]),
    )
    loops[0].input[1] = "beam/gated_condition"
    outputs = [_output_like(plain, name) for name in SEARCH_OUTPUTS]
    found = [f"found/{name}" for name in SEARCH_OUTPUTS]
    other = helper.make_node(
        "If", ["plan/sampling"], [f"other/{n}" for n in SEARCH_OUTPUTS], name="sample_or_search",
        then_branch=searches["sample"], else_branch=searches["beam_with_controls"],
    )  # fmt: skip
    chosen = helper.make_node(
        "If", ["plan/plain"], found, name="plain_or_other",
        then_branch=helper.make_graph(
            [helper.make_node("Identity", [v.name], [f"plain/{n}"]) for v, n in zip(plain.output, SEARCH_OUTPUTS)],
            "plain", [], _renamed(outputs, "plain/"),
        ),
        else_branch=helper.make_graph([other], "other_searches", [], _renamed(outputs, "other/")),
    )  # fmt: skip
    aligner = _branch(
        simplify(convert(graphs, "align")),
        "align/",
        {"source_ids": "plan/planned_source_ids", "target_ids": found[2]},
    )
    unaligned = helper.make_graph(
        [
            helper.make_node("Shape", [found[2]], ["unaligned/shape"]),
            helper.make_node(
                "ConstantOfShape",
                ["unaligned/shape"],
                ["unaligned/alignments"],
                value=helper.make_tensor("minus_one", TensorProto.INT32, [1], [-1]),
            ),  # fmt: skip
        ],
        "unaligned",
        [],
        [_output_like(aligner, aligner.output[0].name, "unaligned/alignments")],
    )
    aligned = helper.make_node(
        "If", ["return_alignments"], ["alignments"], then_branch=aligner, else_branch=unaligned, name="align"
    )
    copies = [helper.make_node("Identity", [f], [name]) for f, name in zip(found, SEARCH_OUTPUTS)]
    graph = helper.make_graph(
        [*plan.graph.node, *gate, *plain_nodes, chosen, aligned, *copies],
        "translate",
        list(plan.graph.input),
        [*_renamed(outputs, ""), _output_like(aligner, aligner.output[0].name, "alignments")],
        initializer=[*plan.graph.initializer, *plain.initializer],
    )
    opsets = {o.domain: o.version for o in plan.opset_import}
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    model.ir_version = plan.ir_version
    model.doc_string = "keras-transformer translate_ids_with_options"
    return model


def _input_names(model):
    return [value.name for value in model.graph.input]


def _branch(model, prefix, inputs, outputs=None):
    """`model`'s graph as an `If` branch: its names prefixed, its inputs read from the
    enclosing graph as `inputs` maps them (`{input name: outer name}`), no inputs of its own,
    its outputs in the order of `outputs` (names before the prefix; an `If` pairs them by
    position, and tf2onnx sorts a function's outputs by name)."""
    graph = prefixed_graph(model.graph, prefix, inputs)
    del graph.input[:]
    if outputs is not None:
        by_name = {value.name: value for value in graph.output}
        ordered = [by_name[prefix + name] for name in outputs]
        del graph.output[:]
        graph.output.extend(ordered)
    return graph


def _output_like(graph, name, new_name=None):
    """A copy of `graph`'s output `name` (its type and shape), named `new_name`."""
    for value in list(graph.output):
        if value.name == name or value.name.endswith("/" + name):
            copy = onnx.ValueInfoProto()
            copy.CopyFrom(value)
            copy.name = new_name or name
            return copy
    raise KeyError(name)


def _renamed(values, prefix):
    copies = []
    for value in values:
        copy = onnx.ValueInfoProto()
        copy.CopyFrom(value)
        copy.name = prefix + value.name
        copies.append(copy)
    return copies


def request_defaults(graphs):
    """`{input name: default}` of `translate.onnx`'s request inputs: the export's options, no
    prefix, no banned sequences, the rows' own indices."""
    from keras_transformer.decoding.translator import option_tensors

    empty = {"target_prefix": np.zeros((0, 0), np.int32), "suppress_sequences": np.zeros((0, 0), np.int32)}
    return {
        **empty,
        "sentence_ids": np.zeros((0,), np.int32),
        **{name: value.numpy() for name, value in option_tensors(graphs.options).items()},
    }


def with_defaults(model, defaults):
    """Gives the graph inputs named in `defaults` an initializer of the same name: a client
    that leaves them out gets the default (ONNX Runtime reads an input's initializer then)."""
    inputs = {value.name for value in model.graph.input}
    missing = sorted(set(defaults) - inputs)
    if missing:
        raise ValueError(f"the graph has no inputs {missing}")
    given = {init.name for init in model.graph.initializer}
    model.graph.initializer.extend(
        numpy_helper.from_array(np.asarray(value), name)
        for name, value in defaults.items()
        if name not in given
    )
    return model


def text_graph(graphs, translate):
    """`translate_text.onnx`: tokenizer graph -> `translate` (the converted beam search) -> detokenizer.

    The tokenizer part (tf-text SentencePiece, truncation, EOS, padding) is
    converted by tf2onnx; the beam search is the `translate` model itself,
    merged in with `onnx.compose` (not converted a second time).
    """
    tokenize = convert(graphs, "source_ids", extra_opset=[helper.make_opsetid(CONTRIB_DOMAIN, 1)])
    tokenize = compose.add_prefix(tokenize, "tokenize/")
    translate = onnx.ModelProto.FromString(translate.SerializeToString())  # a copy
    translate.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    model = compose.merge_models(tokenize, translate, io_map=[(tokenize.graph.output[0].name, "source_ids")])
    _rename(model.graph, "tokenize/text", "text")
    _rename(model.graph, "scores", "score")
    model = _append_detokenizer(model, graphs.tokenizer.model_proto)
    model.doc_string = "keras-transformer translate_text"
    return model


def _name_dynamic_axes(model):
    """Gives tf2onnx's `unk__N` dynamic axes readable names: `batch`, then `<tensor>_<axis>`."""
    for value in list(model.graph.input) + list(model.graph.output):
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.dim_param.startswith("unk__") or (not dim.dim_param and not dim.HasField("dim_value")):
                dim.dim_param = "batch" if axis == 0 else f"{value.name}_{axis}"


def _scalar_loop_counters(model):
    """Declares each `Loop` body's iteration number and condition scalar where tf2onnx left no shape.

    A `tf.while_loop` with shape invariants (the growing decoding cache) is
    converted with an unshaped loop counter, which ONNX Runtime refuses ("Loop
    subgraph input 0 has unknown shape"); ONNX defines both as scalars.
    """
    for graph in all_graphs(model.graph):
        for node in graph.node:
            if node.op_type != "Loop":
                continue
            body = next(a.g for a in node.attribute if a.name == "body")
            for value in body.input[:2]:
                if not value.type.tensor_type.HasField("shape"):
                    value.type.tensor_type.shape.SetInParent()  # rank 0


def _rename(graph, old, new):
    """Renames the graph input/output `old` (and its uses by top-level nodes) to `new`."""
    for value in list(graph.input) + list(graph.output):
        if value.name == old:
            value.name = new
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        node.output[:] = [new if name == old else name for name in node.output]


def describe(model):
    """`{"inputs": {name: [dtype, shape]}, "outputs": ...}` of an ONNX model."""

    def entries(values):
        result = {}
        for value in values:
            tensor = value.type.tensor_type
            shape = [
                d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in tensor.shape.dim
            ]
            result[value.name] = [TensorProto.DataType.Name(tensor.elem_type).lower(), shape]
        return result

    return {"inputs": entries(model.graph.input), "outputs": entries(model.graph.output)}


def _append_detokenizer(model, sentencepiece_model):
    """Replaces the graph output `target_ids` by `translation` strings (one `SentencepieceDecoder` per row).

    The decoder drops the control pieces (pad, BOS, EOS), as `Tokenizer.decode`
    does; rows are EOS-terminated and padded after EOS.
    """
    graph = model.graph
    ids_output = next(o for o in graph.output if o.name == "target_ids")
    graph.output.remove(ids_output)
    nodes = [
        helper.make_node("Cast", ["target_ids"], ["detok_ids64"], to=TensorProto.INT64),
        helper.make_node("Shape", ["detok_ids64"], ["detok_shape"]),
        helper.make_node("Gather", ["detok_shape", "detok_zero"], ["detok_rows"], axis=0),
    ]
    body = helper.make_graph(
        [
            helper.make_node("Gather", ["detok_ids64", "row"], ["row_ids"], axis=0),
            helper.make_node(
                "SentencepieceDecoder",
                ["row_ids", "detok_fairseq"],
                ["row_text"],
                domain=CONTRIB_DOMAIN,
                model=sentencepiece_model,
            ),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "detokenize_row",
        [
            helper.make_tensor_value_info("row", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("row_text", TensorProto.STRING, [1]),
        ],
    )
    nodes += [
        helper.make_node(
            "Loop",
            [
                "detok_rows",
                "",
            ],
            ["detok_texts"],
            body=body,
        ),
        helper.make_node("Reshape", ["detok_texts", "detok_flat"], ["translation"]),
    ]
    graph.initializer.extend(
        [
            helper.make_tensor("detok_zero", TensorProto.INT64, [], [0]),
            helper.make_tensor("detok_flat", TensorProto.INT64, [1], [-1]),
            helper.make_tensor("detok_fairseq", TensorProto.BOOL, [1], [False]),
        ]
    )
    graph.node.extend(nodes)
    graph.output.insert(0, helper.make_tensor_value_info("translation", TensorProto.STRING, ["batch"]))
    return model
