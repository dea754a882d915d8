"""`translate.onnx` with ONNX Runtime's fused CPU kernels: `export --onnx-kernels fused`
(fusion 2 below; 1 and 3 are measured slower at the recipe's width and left to `fusions=`).

The portable graph (`keras_transformer_export.graph_rewrites.simplify`) uses standard ONNX ops
only, so any ONNX runtime runs it; per decoding step each decoder layer is ~40 kernels, and
at the recipe's width (d_model 128) the step is a few hundred tiny kernels whose launch, not
their arithmetic, is much of the time. ONNX Runtime's own transformer fusions do not look
inside a `Loop`, so this module writes its `com.microsoft` nodes itself, in every graph of
the model (the plain beam search's `Loop` body, and those of the searches with controls and
of sampling):

1. **Self-attention with the growing cache** -> one `MultiHeadAttention`: the heads'
   `Reshape`s, the cache `Concat`s (axis 2 of the `(rows, heads, t, depth)` cache), the query
   scaling, `MatMul(q, kᵀ)`, `Softmax`, `MatMul(·, v)` and the merge of the heads, with the
   Q/K/V bias fused in (`past_key`/`past_value` in, `present_key`/`present_value` out: the
   layout our cache already has, so the loop state and the per-step reorder are unchanged).
   Matched only with the scale `1/sqrt(depth)` (the op's default).
2. **Cross-attention over the encoder's keys/values** -> one `MultiHeadAttention` with the
   cached `(sentences, heads, source, depth)` keys and values as 4-D inputs, the beams of a
   sentence as its query length (the `(sentences, -1, width)` shape read from the source mask)
   and the source mask as `key_padding_mask` (int32; both computed once per step and shared
   by the layers): replaces the scaling, transposes, `MatMul`s, the
   two mask `Where`s and `Softmax`. A masked position gets the op's additive -10000 instead
   of the portable graph's fill of -3e38: both are exactly 0 after the softmax for logits
   below ~9,900 in size.
3. **Residual + bias + LayerNorm** -> one `SkipLayerNormalization`: a post-norm sublayer's
   `LayerNormalization(x + (MatMul(h, W) + b))` becomes `SkipLayerNormalization(MatMul(h, W),
   x, γ, β, b)`; in an int8 graph the product is `MatMulInteger`'s output scaled back to float
   (a `Mul`, `keras_transformer_export.quantization`), the same pattern otherwise.

The arithmetic is the same up to the order of float operations (fused kernels sum and
normalize in their own order), so a hypothesis whose score ties another's within ~1e-6 can
flip; `scripts/compare_onnx_exports.py` counts the sentences that differ. ONNX Runtime only:
the `com.microsoft` domain is not standard ONNX.
"""

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from keras_transformer_export.graph_rewrites import (
    _attribute,
    _consumers,
    _drop_dead_nodes,
    _initializers,
    _uses,
    all_graphs,
)

DOMAIN = "com.microsoft"
KERNELS = ("portable", "fused")
FUSIONS = ("self_attention", "cross_attention", "skip_layer_norm")  # 1, 2, 3 above
# What `export --onnx-kernels fused` writes: 2. On the 3+3 `mini` model (AMD EPYC, 2 threads,
# test2016) the self-attention kernel made the step slower than our nodes: batch 1 1.05x and
# batch 32 0.98x of the portable graph with all three, 1.16x and 0.99x without it. And ONNX
# Runtime 1.32's `SkipLayerNormalization` is a scalar loop with a division per element: on the
# same model's lean graph (2-core Intel Xeon, ad hoc, interleaved, 5 passes) the step with `Add` +
# `LayerNormalization` instead ran batch 32 at 1.07x (float32) and 1.11x (int8), batch 1 level.
DEFAULT_FUSIONS = ("cross_attention",)
# What makes a sublayer's output before its bias (fusion 3): a float product, or an int8 one
# scaled back to float (`MatMulInteger` -> `Cast` -> `Mul` by the two scales).
PRODUCTS = ("MatMul", "Mul")


def fuse_for_onnx_runtime(model, fusions=DEFAULT_FUSIONS):
    """`model` (changed in place and returned) with the `fusions` of the module docstring, in
    every graph; `count_fused(model)` tells how many of each were written."""
    unknown = set(fusions) - set(FUSIONS)
    if unknown:
        raise ValueError(f"unknown fusions {sorted(unknown)}; choose from {FUSIONS}.")
    constants = {name: numpy_helper.to_array(tensor) for name, tensor in _initializers(model).items()}
    fuser = _Fuser(model, constants, fusions)
    for graph in list(all_graphs(model.graph)):
        fuser.graph(graph)
    if fuser.written:
        _drop_dead_nodes(model.graph)
        if not any(opset.domain == DOMAIN for opset in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


def count_fused(model):
    """`{op type: count}` of the `com.microsoft` nodes in every graph of `model`."""
    counts = {}
    for graph in all_graphs(model.graph):
        for node in graph.node:
            if node.domain == DOMAIN:
                counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


class _Fuser:
    def __init__(self, model, constants, fusions):
        self.main, self.constants, self.written = model.graph, constants, 0
        self.fusions = fusions
        self.uses = _uses(model.graph)

    def constant(self, name):
        return self.constants.get(name)

    def new_constant(self, name, array):
        if name not in self.constants:
            self.main.initializer.append(numpy_helper.from_array(array, name))
            self.constants[name] = array
        return name

    def graph(self, graph):
        self.producers = {name: node for node in graph.node for name in node.output}
        self.consumers = _consumers(graph)
        self.masks = {}  # bool source mask -> its int32 key_padding_mask, per graph
        self.query_shapes = {}  # (bool source mask, width) -> `query_shape`, per graph
        attentions = [getattr(self, name) for name in FUSIONS[:2] if name in self.fusions]
        for node in list(graph.node):
            if node.op_type == "Softmax":
                self.insert(graph, node, next((f for f in (fuse(node) for fuse in attentions) if f), None))
        for node in list(graph.node):
            if node.op_type == "LayerNormalization" and "skip_layer_norm" in self.fusions:
                self.insert(graph, node, self.skip_layer_norm(node))

    def insert(self, graph, anchor, fused):
        """`fused` placed where `anchor` (the `Softmax` or `LayerNormalization` they replace) is:
        every input they read is ready there, and every reader of their outputs comes later (the
        nodes they replace gave up those outputs), so the graph stays sorted."""
        if fused:
            index = list(graph.node).index(anchor)
            for offset, node in enumerate(fused):
                graph.node.insert(index + offset, node)
            self.written += 1

    # -- matching helpers -------------------------------------------------------------------
    def made_by(self, name, op_type):
        node = self.producers.get(name)
        return node if node is not None and node.op_type == op_type else None

    def only_reader(self, name, op_type):
        """The one node that reads `name` (nothing else does, in any graph), if an `op_type`."""
        readers = self.consumers.get(name, [])
        if len(readers) != 1 or self.uses.get(name) != 1 or readers[0].op_type != op_type:
            return None
        return readers[0]

    def read_once(self, *nodes):
        return all(self.uses.get(node.output[0]) == 1 for node in nodes)

    def shape_constant(self, node):
        value = self.constant(node.input[1]) if node is not None and len(node.input) > 1 else None
        return None if value is None else value.tolist()

    def scaled_by(self, mul, depth):
        """The input of `mul` that is scaled by `1/sqrt(depth)` (the other input), or None."""
        if mul is None:
            return None
        for index in (0, 1):
            scale = self.constant(mul.input[index])
            if scale is not None and scale.size == 1 and np.isclose(float(scale), depth**-0.5, rtol=1e-6):
                return mul.input[1 - index]
        return None

    # -- 1. self-attention with the growing cache --------------------------------------------
    def self_attention(self, softmax):
        logits = self.made_by(softmax.input[0], "MatMul")
        context = self.only_reader(softmax.output[0], "MatMul")
        if logits is None or context is None or context.input[0] != softmax.output[0]:
            return None
        keys_t = self.made_by(logits.input[1], "Transpose")
        query = self.made_by(logits.input[0], "Reshape")
        if keys_t is None or _attribute(keys_t, "perm") != [0, 1, 3, 2] or query is None:
            return None
        keys = self.made_by(keys_t.input[0], "Concat")
        values = self.made_by(context.input[1], "Concat")
        merged = self.only_reader(context.output[0], "Reshape")
        if keys is None or values is None or merged is None:
            return None
        if _attribute(keys, "axis") != 2 or _attribute(values, "axis") != 2:
            return None
        heads_shape = self.shape_constant(query)
        if heads_shape is None or len(heads_shape) != 4 or heads_shape[2] != 1:
            return None  # the query as (rows, heads, 1, depth)
        heads, depth = heads_shape[1], heads_shape[3]
        if self.shape_constant(merged) != [-1, 1, heads * depth]:
            return None
        scaled = self.made_by(query.input[0], "Mul")
        split_query = self.made_by(self.scaled_by(scaled, depth), "Reshape")
        if split_query is None or self.shape_constant(split_query) != [-1, 1, heads, depth]:
            return None
        new_key = self.made_by(keys.input[1], "Reshape")
        new_value = self.made_by(values.input[1], "Reshape")
        if any(n is None or self.shape_constant(n) != heads_shape for n in (new_key, new_value)):
            return None
        split = self.made_by(split_query.input[0], "Split")
        if (
            split is None
            or len(split.output) != 3
            or [split_query.input[0], new_key.input[0], new_value.input[0]] != list(split.output)
            or _attribute(split, "axis") not in (-1, 2)
            or (len(split.input) > 1 and split.input[1])
            or not self.read_once(split_query, scaled, query, new_key, new_value, logits, softmax, context)
            or self.uses.get(keys_t.output[0]) != 1
        ):
            return None
        # The Q/K/V bias: fused into the attention when nothing else reads the biased projection.
        bias, add = "", self.made_by(split.input[0], "Add")
        if add is not None and self.uses.get(add.output[0]) == 1:
            for index in (0, 1):
                value = self.constant(add.input[index])
                if value is not None and value.shape == (3 * heads * depth,):
                    bias = add.input[index]
                    split.input[0] = add.input[1 - index]
                    break
        attention = helper.make_node(
            "MultiHeadAttention",
            [*split.output, bias, "", "", keys.input[0], values.input[0]],
            [merged.output[0], keys.output[0], values.output[0]],
            name=f"{softmax.name}/fused_self_attention",
            domain=DOMAIN,
            num_heads=heads,
        )
        # The replaced nodes give up their outputs (they are dropped as dead).
        for node in (merged, keys, values):
            node.output[0] += "/unfused"
        return [attention]

    # -- 2. cross-attention over the encoder's keys and values -------------------------------
    def cross_attention(self, softmax):
        masked = self.made_by(softmax.input[0], "Where")
        zeroed = self.only_reader(softmax.output[0], "Where")
        if masked is None or zeroed is None or zeroed.input[1] != softmax.output[0]:
            return None
        mask = masked.input[0]
        if zeroed.input[0] != mask or not self.filled_with(masked, lambda v: v <= -1e9):
            return None
        if not self.filled_with(zeroed, lambda v: v == 0):
            return None
        logits = self.made_by(masked.input[1], "MatMul")
        context = self.only_reader(zeroed.output[0], "MatMul")
        if logits is None or context is None or context.input[0] != zeroed.output[0]:
            return None
        query_t = self.made_by(logits.input[0], "Transpose")
        keys_t = self.made_by(logits.input[1], "Transpose")
        merged_t = self.only_reader(context.output[0], "Transpose")
        merged = merged_t and self.only_reader(merged_t.output[0], "Reshape")
        if (
            query_t is None
            or keys_t is None
            or merged is None
            or _attribute(query_t, "perm") != [0, 2, 1, 3]
            or _attribute(keys_t, "perm") != [0, 1, 3, 2]
            or _attribute(merged_t, "perm") != [0, 2, 1, 3]
        ):
            return None
        merged_shape = self.shape_constant(merged)  # (rows, 1, width), or (rows, width) in a step
        if merged_shape is None or merged_shape[:-1] not in ([-1, 1], [-1]):  # `step_rewrites` wrote
            return None
        width = merged_shape[-1]
        keys, values = keys_t.input[0], context.input[1]
        scaled = self.made_by(query_t.input[0], "Mul")
        folded = self.made_by(scaled and scaled.input[0], "Reshape")
        heads_depth = folded and self.folded_heads(folded, keys)
        if heads_depth is None or heads_depth[0] * heads_depth[1] != width:
            return None
        heads, depth = heads_depth
        unsqueeze = self.made_by(mask, "Unsqueeze")
        if (
            self.scaled_by(scaled, depth) != folded.output[0]
            or unsqueeze is None
            or not self.read_once(folded, scaled, query_t, logits, masked, softmax, zeroed, context, merged_t)
        ):
            return None
        axes = self.constant(unsqueeze.input[1]) if len(unsqueeze.input) > 1 else None
        if axes is None or axes.tolist() != [1]:
            return None  # the mask (sentences, 1, 1, source) from (sentences, 1, source)
        name, project = softmax.name, folded.input[0]
        rows1, fused_context = f"{name}/query", f"{name}/context"
        rows_shape = self.new_constant(
            f"fused/rows_shape_{'_'.join(map(str, merged_shape[1:]))}", np.array(merged_shape, np.int64)
        )
        nodes = []
        padding = self.key_padding_mask(unsqueeze.input[0], nodes)
        rows3 = self.query_shape(unsqueeze.input[0], width, nodes)
        nodes += [
            helper.make_node("Reshape", [project, rows3], [rows1], name=f"{name}/fused_fold_beams"),
            helper.make_node(
                "MultiHeadAttention",
                [rows1, keys, values, "", padding],
                [fused_context],
                name=f"{name}/fused_cross_attention",
                domain=DOMAIN,
                num_heads=heads,
            ),
            helper.make_node(
                "Reshape", [fused_context, rows_shape], [merged.output[0]], name=f"{name}/fused_rows"
            ),
        ]
        merged.output[0] += "/unfused"
        return nodes

    def folded_heads(self, reshape, keys):
        """`(heads, depth)` if `reshape` folds the beams into the query length, to the shape
        `Concat(Shape(keys)[0:1], [-1], [heads], [depth])` (sentences, beams, heads, depth)."""
        concat = self.made_by(reshape.input[1], "Concat")
        if concat is None or len(concat.input) != 4 or _attribute(concat, "axis") != 0:
            return None
        sentences = self.made_by(concat.input[0], "Shape")
        parts = [self.constant(name) for name in concat.input[1:]]
        if (
            sentences is None
            or sentences.input[0] != keys
            or (_attribute(sentences, "start", 0), _attribute(sentences, "end")) != (0, 1)
            or any(part is None or part.shape != (1,) for part in parts)
            or int(parts[0][0]) != -1
        ):
            return None
        return int(parts[1][0]), int(parts[2][0])

    def filled_with(self, where, test):
        value = self.constant(where.input[2])
        return value is not None and value.size == 1 and test(float(value))

    def key_padding_mask(self, mask, nodes):
        """The int32 `(sentences, source)` mask of the bool `(sentences, 1, source)` `mask`
        (appended to `nodes` the first time a graph needs it)."""
        if mask not in self.masks:
            flat, cast = f"{mask}/fused_flat", f"{mask}/fused_int32"
            axis = self.new_constant("fused/axis_1", np.array([1], np.int64))
            nodes += [
                helper.make_node("Squeeze", [mask, axis], [flat], name=f"{mask}/fused_squeeze"),
                helper.make_node("Cast", [flat], [cast], name=f"{mask}/fused_cast", to=TensorProto.INT32),
            ]
            self.masks[mask] = cast
        return self.masks[mask]

    def query_shape(self, mask, width, nodes):
        """`(sentences, -1, width)`: the shape that folds the beams of each sentence into the
        query length, `sentences` read from the `(sentences, 1, source)` `mask` (appended to
        `nodes` the first time a graph needs it: the layers share it, as they share the mask)."""
        if (mask, width) not in self.query_shapes:
            sentences, shape = f"{mask}/fused_sentences", f"{mask}/fused_query_shape_{width}"
            minus_one = self.new_constant("fused/minus_one", np.array([-1], np.int64))
            width_constant = self.new_constant(f"fused/width_{width}", np.array([width], np.int64))
            nodes += [
                helper.make_node("Shape", [mask], [sentences], name=sentences, start=0, end=1),
                helper.make_node(
                    "Concat", [sentences, minus_one, width_constant], [shape], name=shape, axis=0
                ),
            ]
            self.query_shapes[mask, width] = shape
        return self.query_shapes[mask, width]

    # -- 3. residual + bias + LayerNorm ------------------------------------------------------
    def skip_layer_norm(self, norm):
        if _attribute(norm, "axis", -1) != -1 or len(norm.input) != 3:
            return None
        residual = self.made_by(norm.input[0], "Add")
        if residual is None or self.uses.get(residual.output[0]) != 1:
            return None
        for index in (0, 1):
            biased = self.made_by(residual.input[index], "Add")
            if biased is None or self.uses.get(biased.output[0]) != 1:
                continue
            for side in (0, 1):
                bias = self.constant(biased.input[side])
                product = self.producers.get(biased.input[1 - side])
                if (
                    bias is not None
                    and bias.ndim == 1
                    and product is not None
                    and product.op_type in PRODUCTS
                ):
                    skip = residual.input[1 - index]
                    node = helper.make_node(
                        "SkipLayerNormalization",
                        [biased.input[1 - side], skip, norm.input[1], norm.input[2], biased.input[side]],
                        [norm.output[0]],
                        name=f"{norm.name}/fused_skip",
                        domain=DOMAIN,
                        epsilon=_attribute(norm, "epsilon", 1e-5),
                    )
                    norm.output[0] += "/unfused"
                    return [node]
        return None
