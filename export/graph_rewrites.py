"""Rewrites of the converted beam search that keep its arithmetic: fewer ONNX nodes per step.

tf2onnx converts `translate_ids`' `tf.while_loop` literally. Two patterns make
the `Loop` body much bigger than the model (per step, ONNX Runtime pays a
kernel launch per node, and at batch 1 that, not the arithmetic, is the cost):

1. **Loop-carried weights** (`hoist_loop_invariants`). The loop state carries
   every decoder weight (~95 values the body passes on unchanged), and the
   body re-shapes some of them at every step. A pass-through value is read
   from the enclosing graph instead (an ONNX body may use any outer value)
   and leaves the loop state; body nodes whose inputs are all constants
   (initializers, the body's own included) and whose op only rearranges or
   converts data (`Reshape`, `Transpose`, `Cast`, ...) are evaluated once with
   the ONNX reference evaluator into main-graph initializers. This also lets
   ONNX Runtime's quantizer see the decoder's weights (it only quantizes a
   `MatMul` whose weight is an initializer).
2. **`tensordot` chains** (`collapse_tensordots`). A Keras projection of a
   `(batch, len, d_model)` tensor is traced as `tensordot`, converted as
   Shape → Cast → Gather → Concat → Cast → Reshape → MatMul → Reshape: 8 nodes
   where one ONNX `MatMul` (which broadcasts over leading dimensions) does the
   same. A `Reshape -> MatMul(constant 2-D weight) -> Reshape` chain whose
   first reshape flattens to `(rows, weight height)` and whose second restores
   `Concat(Gather(Shape(x), [0..k-1]), [weight width])` of the same `x` becomes
   `MatMul(x, weight)`; the shape arithmetic left unused is dropped.

3. **LayerNorm as 13 nodes** (`fuse_layer_norms`). Keras' `LayerNormalization`
   is traced as `tf.nn.moments` plus an affine map, converted as
   GlobalAveragePool → Sub → Mul → GlobalAveragePool → Add(ε) → Sqrt →
   Reciprocal → Mul(γ) → Mul(x, ·) + (Neg(mean) · · + β): 13 kernels that ONNX
   Runtime's own LayerNorm fusion does not recognise (it looks for
   `ReduceMean`; inside a `Loop` nested in an `If` tf2onnx leaves
   `ReduceMean(axes=[-1])` itself, matched the same way). Each becomes one
   opset-17 `LayerNormalization(x, γ, β, axis=-1, epsilon=ε)`, ONNX Runtime's
   fused kernel. Matched only when γ and β
   are constants of shape `(1, 1, width)`: the input then has rank 3, where
   GlobalAveragePool averages over the last axis alone.

4. **`where` as a blend** (`select_with_where`). tf2onnx converts each
   `tf.where(c, p, q)` (SelectV2: the key/value cache writes, the attention
   and beam masks) as `p · Cast(c) + q · Cast(Not(c))`: six kernels, five of
   them full passes over the output, and NaN wherever `p` or `q` is infinite.
   Each becomes one ONNX `Where(c, p, q)`, TensorFlow's own semantics (also
   where tf2onnx computed `q · Cast(Not(c))` once for several blends, as for a
   constant fill and a mask every layer shares), except
   the writes into a `Loop`'s carried values (the key/value cache): ONNX
   Runtime's broadcasting `Where` is slower than its Mul/Add over a whole
   cache. Measured side by side on the `mini` model (256 val sentences): all
   blends as `Where` made batch 1 ~5-25% faster but batch 32 ~28% slower;
   sparing the cache writes keeps batch 32 level (22.6 s vs 22.0 s) and batch
   1 ~12% faster (79 vs 90 ms median).

5. **The tied embedding stored once** (`read_transposed_weights`). The
   output projection is `hidden @ Eᵀ` with E the embedding matrix that the
   `Gather`s read; hoisting (1) folds the body's `Transpose(E)` into a second
   initializer, so the file holds the largest weight twice (~4 MB of the
   `mini` model's 9.4). A `MatMul(x, T)` whose `x` is a matrix and whose `T`
   is a constant equal to the transpose of another constant `E` becomes
   `Gemm(x, E, transB=1)`, the same products (ONNX Runtime pre-packs either
   operand) from the one stored `E`. The decoding step projects the one new
   position as a `(rows, d_model)` matrix so that its `x` is one
   (`Transformer.decode_step`); `forward.onnx`'s `(batch, len, d_model)`
   projection keeps its `MatMul`.

6. **Reshape shapes computed through int32** (`read_shapes_in_int64`). TensorFlow computes a
   dynamic reshape's shape in int32 (`tf.shape(x)[:1]` joined with constants), which tf2onnx
   converts as Shape → Cast(int32) → Slice (→ Squeeze → Unsqueeze) → Concat → Cast(int64) →
   Reshape. Where every part of the shape is a constant or a slice of one tensor's shape, it
   becomes `Shape(x, start, end)` (opset 15) joined with int64 constants: the same values
   (dimensions below 2³¹), three to five kernels fewer per reshape. On the 3+3 `mini` model's
   beam search: `Loop` body 368 → 341 nodes (333 → 310 after ONNX Runtime's own optimizer,
   which folds neither); per-step time unchanged within this machine's noise (batch 1 56.4 vs
   55.7 ms, batch 32 690 vs 689 ms, random weights): these kernels are ~1 µs each.

7. **Integers compared as floats** (`compare_integers`). tf2onnx converts TensorFlow's
   `Greater` and `Less` of integers (int32 or int64) as `Cast(to float32)` of each operand, then
   the float comparison (its opset-7 handler, used at every opset): **wrong wherever the two
   integers differ by less than float32's spacing at their size** (above 2^24: 2^31 + 5 and
   2^31 compare equal) — the sampling seed's first test compared `seed > 2^31 - 1` and was
   false in `translate.onnx` for 2^31 + 5 (`keras_transformer.decoding.sampling.row_keys`).
   Each such comparison whose operands are all casts from one integer type, or such casts and
   float constants holding integers of that type (up to 2^24: tf2onnx folds a cast constant
   into float32, so a larger one has already lost its value, and such a comparison is left as
   converted), compares the integers themselves (ONNX `Greater`/`Less` take int32 and int64
   since opset 9): TensorFlow's semantics, and the casts left unused are dropped (up to two
   kernels fewer per comparison; the beam search's loop compares `step < limit` so). On the
   recipe's member 0 (fused export of stop 71, rewritten alone, `python
   scripts/count_loop_nodes.py --onnx DIR`): `translate.onnx`'s `Loop` body 316 -> 312 nodes
   (285 -> 282 after ONNX Runtime's optimizer); `translate_lean.onnx` has no such comparison.

`simplify(model)` applies all seven and drops initializers nothing reads. On
the `mini` recipe model: `Loop` body 1,555 → 1,258 nodes with rewrites 1 and
2, 1,114 with 3, 914 with 4; loop state 119 → 24 values. The same tokens
(scores within 2e-6: ONNX Runtime pre-packs constant matrix operands, sums in
another order and normalizes as (x - mean) · rstd).
Tested in `tests/test_onnx_int8.py` and by every ONNX parity test.
"""

import numpy as np
import onnx
from onnx import helper, numpy_helper

# Ops that rearrange, select or convert their input: evaluating them once on
# constants changes no arithmetic and never makes a tensor bigger than the
# inputs it reads (no Tile/Expand/ConstantOfShape).
FOLDABLE = frozenset(
    {
        "Reshape",
        "Transpose",
        "Cast",
        "Squeeze",
        "Unsqueeze",
        "Identity",
        "Flatten",
        "Shape",
        "Slice",
        "Gather",
        "Concat",
        "Constant",
    }
)


def hoist_loop_invariants(model):
    """`model` (an `onnx.ModelProto`, changed in place and returned) with its `Loop`s' invariants hoisted
    (module docstring, 1), wherever the `Loop`s are (an `If` branch too)."""
    constants = {init.name for init in model.graph.initializer}
    for graph in list(all_graphs(model.graph)):
        for node in graph.node:
            if node.op_type == "Loop":
                _drop_pass_through_state(graph, node)
                body = next(a.g for a in node.attribute if a.name == "body")
                _fold_constants(model, body, constants)
    _drop_unused_initializers(model.graph)
    return model


def reshape_zeros_as_tensorflow(model):
    """`model` (changed in place and returned) with every `Reshape` to a shape computed at run time
    reading a 0 in it as TensorFlow does, as the size 0 (`allowzero=1`), not as ONNX's default
    "keep this input dimension": a batch of no sentences, or a request with no banned
    sequences, has such sizes. Reshapes to constant shapes are left alone (tf2onnx writes
    0 meaning "keep" in some of those)."""
    for graph in all_graphs(model.graph):
        constants = {init.name for init in graph.initializer} | {
            init.name for init in model.graph.initializer
        }
        constants |= {output for node in graph.node if node.op_type == "Constant" for output in node.output}
        for node in graph.node:
            if node.op_type == "Reshape" and node.input[1] not in constants:
                if not any(attribute.name == "allowzero" for attribute in node.attribute):
                    node.attribute.append(helper.make_attribute("allowzero", 1))
    return model


def sort_nodes(model):
    """`model` (changed in place and returned) with each graph's nodes in an order ONNX accepts,
    counting as a node's inputs the outer values its subgraphs read: a tool that sorts by
    explicit inputs only (ONNX Runtime's quantizer) can put an `If` before the node that
    makes a value its branch reads. Kahn's algorithm, the current order breaking ties.

    A graph is sorted before its subgraphs are visited: sorting replaces its nodes by copies,
    so subgraphs listed beforehand would be the replaced nodes' (and their sorting lost)."""
    pending = [model.graph]
    while pending:
        graph = pending.pop()
        produced = {name: index for index, node in enumerate(graph.node) for name in node.output}
        reads = []
        for node in graph.node:
            names = set(node.input)
            for subgraph in _subgraphs(node):
                names |= {name for g in all_graphs(subgraph) for n in g.node for name in n.input}
            reads.append({produced[name] for name in names if name in produced})
        done, order = set(), []
        while len(order) < len(graph.node):
            ready = next(i for i in range(len(graph.node)) if i not in done and reads[i] <= done)
            done.add(ready)
            order.append(graph.node[ready])
        nodes = [onnx.NodeProto() for _ in order]
        for copy, node in zip(nodes, order):
            copy.CopyFrom(node)
        del graph.node[:]
        graph.node.extend(nodes)
        pending.extend(subgraph for node in graph.node for subgraph in _subgraphs(node))
    return model


def store_constants_once(model):
    """`model` (changed in place and returned) with every subgraph's initializers moved into the
    main graph, each distinct tensor stored once (subgraphs read outer values by name).

    tf2onnx gives each `If` branch and `Loop` body its own copy of the weights it reads,
    and the ONNX export assembles one branch per search (`keras_transformer_export.onnx`):
    without this, the file would hold every weight once per search.
    """
    main = model.graph
    stored = {}  # (type, dims, bytes) -> name in the main graph
    taken = {init.name for init in main.initializer}
    renames = {}
    for init in list(main.initializer):
        key = _tensor_key(init)
        if key in stored:
            renames[init.name] = stored[key]
            main.initializer.remove(init)
        else:
            stored[key] = init.name
    if renames:
        _rename_uses(main, renames, outputs=True)
    for graph in list(all_graphs(main))[1:]:
        renames = {}
        for init in list(graph.initializer):
            key = _tensor_key(init)
            if key not in stored:
                name = _unique(init.name, taken)
                moved = onnx.TensorProto()
                moved.CopyFrom(init)
                moved.name = name
                main.initializer.append(moved)
                stored[key], taken = name, taken | {name}
            renames[init.name] = stored[key]
            graph.initializer.remove(init)
        if renames:
            _rename_uses(graph, renames, outputs=True)
    return model


def _tensor_key(init):
    array = numpy_helper.to_array(init)
    return init.data_type, tuple(init.dims), array.tobytes()


def _drop_pass_through_state(graph, loop):
    """Replaces the loop-carried values that the body passes through unchanged by outer-scope reads."""
    body = next(a.g for a in loop.attribute if a.name == "body")
    carried = len(body.input) - 2  # body inputs: iteration number, condition, carried values
    keep = []
    renames = {}  # body name -> outer name; outer uses of the loop's final value -> initial value
    final_values = {}
    for index in range(carried):
        body_input = body.input[2 + index]
        body_output = body.output[1 + index]
        initial = loop.input[2 + index]
        if body_output.name == body_input.name and initial:
            renames[body_input.name] = initial
            final_values[loop.output[index]] = initial
        else:
            keep.append(index)
    if not renames:
        return
    _rename_uses(body, renames)
    new_inputs = list(body.input[:2]) + [body.input[2 + i] for i in keep]
    new_outputs = [body.output[0]] + [body.output[1 + i] for i in keep] + list(body.output[1 + carried :])
    del body.input[:]
    body.input.extend(new_inputs)
    del body.output[:]
    body.output.extend(new_outputs)
    loop_inputs = list(loop.input[:2]) + [loop.input[2 + i] for i in keep]
    loop_outputs = [loop.output[i] for i in keep] + list(loop.output[carried:])
    del loop.input[:]
    loop.input.extend(loop_inputs)
    del loop.output[:]
    loop.output.extend(loop_outputs)
    # Whoever read a dropped state's final value reads its (unchanged) initial value.
    for output in graph.output:
        if output.name in final_values:  # pragma: no cover - our graphs never output weights
            raise ValueError(f"graph output {output.name} is a loop-invariant state; cannot hoist it.")
    _rename_uses(graph, final_values)


def _rename_uses(graph, renames, outputs=False):
    """Renames the inputs of `graph`'s nodes (and of their subgraphs, unless they shadow the name).

    With `outputs`, a graph output that is renamed keeps its name through an
    `Identity` of the outer value (the loop body's own pass-through outputs
    are dropped instead).
    """
    for node in graph.node:
        node.input[:] = [renames.get(name, name) for name in node.input]
        for attribute in node.attribute:
            subgraphs = (
                [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
            )
            for subgraph in subgraphs:
                shadowed = {value.name for value in subgraph.input}
                _rename_uses(subgraph, {k: v for k, v in renames.items() if k not in shadowed}, outputs=True)
    for output in graph.output if outputs else []:
        if output.name in renames:
            # A body output that is an outer value needs a node that produces it.
            graph.node.append(helper.make_node("Identity", [renames[output.name]], [output.name]))


def _fold_constants(model, body, constants):
    """Evaluates the body's constant-only `FOLDABLE` nodes into main-graph initializers."""
    from onnx.reference import ReferenceEvaluator

    values = {init.name: init for init in model.graph.initializer}
    values.update((init.name, init) for init in body.initializer)
    constants = constants | {init.name for init in body.initializer}
    folded_nodes = []
    for node in body.node:  # topologically sorted, as ONNX requires
        inputs = [name for name in node.input if name]
        if node.op_type not in FOLDABLE or not all(name in constants for name in inputs):
            continue
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            continue  # pragma: no cover - none of FOLDABLE has subgraphs
        feeds = {name: numpy_helper.to_array(values[name]) for name in inputs}
        single = helper.make_model(
            helper.make_graph(
                [node],
                "fold",
                [_value_info(name, array) for name, array in feeds.items()],
                [helper.make_value_info(name, onnx.TypeProto()) for name in node.output],
            ),
            opset_imports=model.opset_import,
        )
        results = ReferenceEvaluator(single).run(None, feeds)
        for name, array in zip(node.output, results):
            tensor = numpy_helper.from_array(np.asarray(array), name)
            model.graph.initializer.append(tensor)
            values[name] = tensor
            constants.add(name)
        folded_nodes.append(node)
    for node in folded_nodes:
        body.node.remove(node)


def _value_info(name, array):
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), array.shape)


def _drop_unused_initializers(graph):
    """Removes the initializers (of any graph) that no node or graph output reads."""
    uses = _uses(graph)
    for g in all_graphs(graph):
        for init in [init for init in g.initializer if not uses.get(init.name)]:
            g.initializer.remove(init)


def count_nodes(model):
    """`(main graph nodes, nodes in Loop bodies)` of an ONNX model."""
    main, loop = len(model.graph.node), 0
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                loop += len(attribute.g.node)
    return main, loop


def _subgraphs(node):
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            yield attribute.g
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            yield from attribute.graphs


def all_graphs(graph):
    """`graph` and every subgraph inside it (`Loop` bodies, `If` branches), depth first."""
    yield graph
    for node in graph.node:
        for subgraph in _subgraphs(node):
            yield from all_graphs(subgraph)


def prefixed_graph(graph, prefix, outer):
    """A copy of `graph` with every name it defines, in it and in its subgraphs (node outputs,
    initializers, inputs, outputs), prefixed, and its inputs renamed as `outer` maps them
    (`onnx.compose.add_prefix` leaves a subgraph's reads of outer initializers unprefixed). Every
    node gets a name of its own: tf2onnx leaves some unnamed, and ONNX Runtime refuses a graph
    with two nodes of one name (`prefix` alone would be one)."""
    copy = onnx.GraphProto()
    copy.CopyFrom(graph)
    graphs = list(all_graphs(copy))
    defined = {name for g in graphs for node in g.node for name in node.output if name}
    defined |= {init.name for g in graphs for init in g.initializer}
    defined |= {value.name for g in graphs for value in [*g.input, *g.output]}
    names = {name: prefix + name for name in defined}
    names.update(outer)
    taken = {node.name for g in graphs for node in g.node if node.name}
    for g in graphs:
        for index, node in enumerate(g.node):
            node.input[:] = [names.get(n, n) for n in node.input]
            node.output[:] = [names.get(n, n) for n in node.output]
            if not node.name:  # one not taken by a named node (tf2onnx's names look the same)
                node.name = _unique(f"{node.op_type}_{index}", taken)
                taken.add(node.name)
            node.name = prefix + node.name
        for value in [*g.input, *g.output, *g.value_info]:
            value.name = names.get(value.name, value.name)
        for init in g.initializer:
            init.name = names.get(init.name, init.name)
    return copy


def collapse_tensordots(model):
    """`model` (changed in place and returned) with its tensordot chains collapsed (module docstring, 2)."""
    constants = _initializers(model)
    for graph in all_graphs(model.graph):
        _collapse(graph, constants, _uses(model.graph))
    _drop_dead_nodes(model.graph)
    return model


def _uses(graph):
    """`{value name: number of node inputs and graph outputs that read it}` over all graphs."""
    counts = {}
    for g in all_graphs(graph):
        for node in g.node:
            for name in node.input:
                counts[name] = counts.get(name, 0) + 1
        for output in g.output:
            counts[output.name] = counts.get(output.name, 0) + 1
    return counts


def _collapse(graph, constants, uses):
    producers = {name: node for node in graph.node for name in node.output}
    consumers = _consumers(graph)
    removed, collapsed = [], 0
    for matmul in list(graph.node):
        if matmul.op_type != "MatMul" or matmul.input[1] not in constants:
            continue
        weight = constants[matmul.input[1]]
        flatten = producers.get(matmul.input[0])
        users = consumers.get(matmul.output[0], [])
        if (
            len(weight.dims) != 2
            or flatten is None
            or flatten.op_type != "Reshape"
            or uses.get(flatten.output[0]) != 1
            or len(users) != 1
            or uses.get(matmul.output[0]) != 1
            or users[0].op_type != "Reshape"
        ):
            continue
        restore, source = users[0], flatten.input[0]
        flat_shape = _skip_casts(flatten.input[1], producers)[0]
        if flat_shape not in constants or numpy_helper.to_array(constants[flat_shape]).tolist()[-1:] != [
            weight.dims[0]
        ]:
            continue  # not a flattening to (rows, weight's height)
        if not _keeps_leading_dimensions(restore.input[1], source, weight.dims[1], producers, constants):
            continue
        matmul.input[0] = source
        matmul.output[0] = restore.output[0]
        removed += [flatten, restore]
        collapsed += 1
    for node in removed:
        graph.node.remove(node)
    return collapsed


def _initializers(model):
    """`{name: TensorProto}` of the initializers of every graph of `model`."""
    return {init.name: init for graph in all_graphs(model.graph) for init in graph.initializer}


def _consumers(graph):
    """`{value name: [nodes of graph that read it, once per input]}`."""
    consumers = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return consumers


def _skip_casts(name, producers):
    node = producers.get(name)
    while node is not None and node.op_type == "Cast":
        name = node.input[0]
        node = producers.get(name)
    return name, node


def _keeps_leading_dimensions(shape_name, source, width, producers, constants):
    """Whether `shape_name` is `Concat(Gather(Shape(source), [0..k-1]), [width])` (casts allowed)."""
    _, concat = _skip_casts(shape_name, producers)
    if concat is None or concat.op_type != "Concat" or len(concat.input) != 2:
        return False
    last = _skip_casts(concat.input[1], producers)[0]
    if last not in constants or numpy_helper.to_array(constants[last]).tolist() != [width]:
        return False
    _, gather = _skip_casts(concat.input[0], producers)
    if gather is None or gather.op_type != "Gather" or gather.input[1] not in constants:
        return False
    free = numpy_helper.to_array(constants[gather.input[1]]).tolist()
    _, shape = _skip_casts(gather.input[0], producers)
    return (
        shape is not None
        and shape.op_type == "Shape"
        and shape.input[0] == source
        and free == list(range(len(free)))
        and not shape.attribute
    )


def _drop_dead_nodes(graph):
    """Removes nodes (in any graph) none of whose outputs is read, until none is left."""
    while True:
        uses = _uses(graph)
        dead = [
            (g, node)
            for g in all_graphs(graph)
            for node in g.node
            if not any(uses.get(name) for name in node.output if name)
        ]
        if not dead:
            return
        for g, node in dead:
            g.node.remove(node)


def fuse_layer_norms(model):
    """`model` (changed in place and returned) with each traced LayerNorm replaced by one
    `LayerNormalization` node (module docstring, 3). Returns the model; `count_nodes` tells the change."""
    constants = _initializers(model)
    uses = _uses(model.graph)
    for graph in all_graphs(model.graph):
        consumers = _consumers(graph)
        matches = [_layer_norm_at(node, consumers, constants, uses) for node in graph.node]
        for match in [m for m in matches if m is not None]:
            source, gamma, beta, epsilon, last, first = match
            scale = _flat_initializer(model.graph, constants, gamma)
            shift = _flat_initializer(model.graph, constants, beta)
            output = last.output[0]
            # The chain's last node gives up its output (so _drop_dead_nodes removes the chain) to the
            # fused node, placed where the chain starts (its inputs are ready there).
            last.output[0] = output + "/unfused"
            graph.node.insert(
                list(graph.node).index(first),
                helper.make_node(
                    "LayerNormalization",
                    [source, scale, shift],
                    [output],
                    name=f"{first.name}/fused_layer_norm",
                    axis=-1,
                    epsilon=epsilon,
                ),
            )
    _drop_dead_nodes(model.graph)
    return model


def _layer_norm_at(mean, consumers, constants, uses):
    """`(x, gamma, beta, epsilon, last node, first node)` if `mean` starts the traced LayerNorm, else None."""
    if not _mean_over_last_axis(mean):
        return None

    def only(name, op_type):  # the single reader of `name` (in one or more inputs), if an `op_type` node
        readers = consumers.get(name, [])
        if (
            not readers
            or any(r is not readers[0] for r in readers)
            or uses.get(name) != len(readers)
            or readers[0].op_type != op_type
        ):
            return None
        return readers[0]

    def other(node, name):
        inputs = list(node.input)
        return inputs[1] if inputs[0] == name else inputs[0] if inputs[1] == name else None

    x = mean.input[0]
    readers = consumers.get(mean.output[0], [])
    subs = [n for n in readers if n.op_type == "Sub" and list(n.input) == [x, mean.output[0]]]
    negs = [n for n in readers if n.op_type == "Neg"]
    if len(readers) != 2 or len(subs) != 1 or len(negs) != 1:
        return None
    square = only(subs[0].output[0], "Mul")
    if square is None or list(square.input) != [subs[0].output[0]] * 2:
        return None
    variance = only(square.output[0], mean.op_type)
    variance = variance if variance is not None and _mean_over_last_axis(variance) else None
    add_epsilon = variance and only(variance.output[0], "Add")
    epsilon = add_epsilon and other(add_epsilon, variance.output[0])
    root = epsilon in constants and only(add_epsilon.output[0], "Sqrt")
    reciprocal = root and only(root.output[0], "Reciprocal")
    scaled = reciprocal and only(reciprocal.output[0], "Mul")
    gamma = scaled and other(scaled, reciprocal.output[0])
    if not gamma or gamma not in constants or constants[epsilon].dims:
        return None
    readers = consumers.get(scaled.output[0], [])
    if len(readers) != 2 or uses.get(scaled.output[0]) != 2 or any(n.op_type != "Mul" for n in readers):
        return None
    by_other = {other(n, scaled.output[0]): n for n in readers}
    if set(by_other) != {x, negs[0].output[0]}:
        return None
    times_x, times_neg_mean = by_other[x], by_other[negs[0].output[0]]
    add_beta = only(times_neg_mean.output[0], "Add")
    beta = add_beta and other(add_beta, times_neg_mean.output[0])
    final = beta in constants and only(add_beta.output[0], "Add")
    if (
        not final
        or uses.get(times_x.output[0]) != 1
        or sorted(final.input) != sorted([times_x.output[0], add_beta.output[0]])
    ):
        return None
    width = list(constants[gamma].dims)
    if len(width) != 3 or width[:2] != [1, 1] or list(constants[beta].dims) != width:
        return None
    value = float(numpy_helper.to_array(constants[epsilon]))
    return x, gamma, beta, value, final, mean


def _mean_over_last_axis(node):
    """Whether `node` is a LayerNorm's mean as tf2onnx converts it: `GlobalAveragePool` where it
    knows the rank, else `ReduceMean(axes=[-1], keepdims=1)` (inside a `Loop` nested in an `If`)."""
    if node.op_type == "GlobalAveragePool":
        return True
    if node.op_type != "ReduceMean" or len(node.input) != 1:
        return False
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return list(attributes.get("axes", [])) == [-1] and attributes.get("keepdims", 1) == 1


def _flat_initializer(main, constants, name):
    """The main-graph initializer `name + "/flat"`: the `(1, 1, width)` constant `name` as `(width,)`."""
    flat = name + "/flat"
    if flat not in constants:
        array = numpy_helper.to_array(constants[name]).reshape(-1)
        constants[flat] = numpy_helper.from_array(array, flat)
        main.initializer.append(constants[flat])
    return flat


def select_with_where(model):
    """`model` (changed in place and returned) with each `where` blend replaced by one `Where` node
    (module docstring, 4)."""
    producers = {
        name: node for graph in all_graphs(model.graph) for node in graph.node for name in node.output
    }
    uses = _uses(model.graph)
    for graph in all_graphs(model.graph):
        carried = set() if graph is model.graph else {value.name for value in graph.input}
        for add in [node for node in graph.node if node.op_type == "Add"]:
            select = _blend_at(add, producers, uses)
            # A write into a loop-carried tensor (the key/value cache) stays a blend: ONNX Runtime's
            # broadcasting Where is slower than Mul/Add over a whole cache (module docstring, 4).
            if select is not None and not carried.intersection(select[1:]):
                condition, when_true, when_false = select
                output = add.output[0]
                add.output[0] = output + "/blend"
                graph.node.insert(
                    list(graph.node).index(add),
                    helper.make_node(
                        "Where", [condition, when_true, when_false], [output], name=add.name + "/where"
                    ),
                )
    _drop_dead_nodes(model.graph)
    return model


def _blend_at(add, producers, uses):
    """`(c, p, q)` if `add` is `p * Cast(c) + q * Cast(Not(c))` (factors in either order), else None."""
    terms = [producers.get(name) for name in add.input]
    if len(terms) != 2 or any(t is None or t.op_type != "Mul" for t in terms):
        return None

    def split(mul):  # (the factor that is a Cast of a bool, the other factor), or None
        for mask, value in ((mul.input[1], mul.input[0]), (mul.input[0], mul.input[1])):
            cast = producers.get(mask)
            if cast is not None and cast.op_type == "Cast":
                return cast.input[0], value
        return None

    for first, second in (terms, terms[::-1]):
        # The kept side's product feeds this blend only; the other may be shared (a constant fill
        # times the negated mask, computed once for every layer): it goes once nothing reads it.
        if uses.get(first.output[0]) != 1:
            continue
        kept, dropped = split(first), split(second)
        if kept is None or dropped is None:
            continue
        negation = producers.get(dropped[0])
        if negation is not None and negation.op_type == "Not" and negation.input[0] == kept[0]:
            return kept[0], kept[1], dropped[1]
    return None


def read_shapes_in_int64(model):
    """`model` (changed in place and returned) with each computed `Reshape` shape read from `Shape`
    directly, in int64 (module docstring, 6)."""
    constants = _initializers(model)
    for graph in all_graphs(model.graph):
        in_int64 = _ShapesInInt64(graph, constants, model.graph)
        for reshape in [node for node in graph.node if node.op_type == "Reshape"]:
            cast = in_int64.producers.get(reshape.input[1])
            if cast is None or cast.op_type != "Cast" or _attribute(cast, "to") != onnx.TensorProto.INT64:
                continue
            found = in_int64.value(cast.input[0])
            index = list(graph.node).index(reshape)  # the nodes of a failed match too: they are kept
            for offset, node in enumerate(in_int64.new_nodes):
                graph.node.insert(index + offset, node)
            in_int64.new_nodes = []
            if found is not None:
                reshape.input[1] = found[0]
    _drop_dead_nodes(model.graph)
    _drop_unused_initializers(model.graph)  # the int64 copies made for a chain left alone
    return model


def _attribute(node, name, default=None):
    found = next((a for a in node.attribute if a.name == name), None)
    return default if found is None else helper.get_attribute_value(found)


class _ShapesInInt64:
    """The int64 values equal to a graph's int32 shape vectors computed from constants and `Shape`
    slices (`read_shapes_in_int64`); each built once, its nodes collected in `new_nodes` for the
    caller to insert, its int64 constants added to `main`'s initializers."""

    def __init__(self, graph, constants, main):
        self.producers = {name: node for node in graph.node for name in node.output}
        self.constants, self.main = constants, main
        self.built = {}  # value name -> (int64 value name, length or None), or None
        self.new_nodes = []

    def value(self, name):
        """`(int64 value name, its length or None)` equal to the int32 vector `name`, or None."""
        if name not in self.built:
            self.built[name] = self._build(name)
        return self.built[name]

    def _new(self, op_type, inputs, name, **attributes):
        output = _unique(name + "/int64", self.producers)
        self.new_nodes.append(helper.make_node(op_type, inputs, [output], name=output, **attributes))
        return output

    def _build(self, name):
        constants = self.constants
        if name in constants:  # an int32 constant: its int64 copy, in the main graph
            array = numpy_helper.to_array(constants[name])
            if array.dtype != np.int32 or array.ndim != 1:
                return None
            copy = _unique(name + "/int64", constants)
            constants[copy] = numpy_helper.from_array(array.astype(np.int64), copy)
            self.main.initializer.append(constants[copy])
            return copy, len(array)
        node = self.producers.get(name)
        if node is None:
            return None
        if node.op_type == "Concat" and _attribute(node, "axis") == 0:
            parts = [self.value(part) for part in node.input]
            if any(part is None for part in parts):
                return None
            lengths = [part[1] for part in parts]
            output = self._new("Concat", [part[0] for part in parts], name, axis=0)
            return output, None if None in lengths else sum(lengths)
        if node.op_type == "Unsqueeze":  # of a Squeeze of a one-element vector: that vector
            squeeze = self.producers.get(node.input[0])
            if (
                squeeze is not None
                and squeeze.op_type == "Squeeze"
                and _constant_list(node.input[1:], constants) == [0]
                and _constant_list(squeeze.input[1:], constants) == [0]
            ):
                found = self.value(squeeze.input[0])
                return found if found is not None and found[1] == 1 else None
            return None
        if node.op_type == "Slice":  # of Cast(Shape(x)) to int32, along axis 0 with step 1
            inputs = [node.input[i : i + 1] for i in range(1, 5)]
            starts, ends, axes, steps = (_constant_list(names, constants) for names in inputs)
            cast = self.producers.get(node.input[0])
            shape = self.producers.get(cast.input[0]) if cast is not None and cast.op_type == "Cast" else None
            if (
                shape is None
                or shape.op_type != "Shape"
                or shape.attribute
                or _attribute(cast, "to") != onnx.TensorProto.INT32
                or not (isinstance(starts, list) and len(starts) == 1)
                or not (isinstance(ends, list) and len(ends) == 1)
                or axes not in ((), [0])
                or steps not in ((), [1])
            ):
                return None
            start, end = starts[0], min(ends[0], 2**62)
            output = self._new("Shape", [shape.input[0]], name, start=start, end=end)
            return output, end - start if 0 <= start <= end < 2**31 else None
        return None


def _constant_list(names, constants):
    """The values of the constant input `names[0]` as a flat list, `()` if the input is omitted
    (`names` empty or `[""]`), None if it is not a constant."""
    if not names or not names[0]:
        return ()
    if names[0] not in constants:
        return None
    return numpy_helper.to_array(constants[names[0]]).reshape(-1).tolist()


def _unique(name, taken):
    while name in taken:
        name += "_"
    return name


def tensor_ranks(model):
    """`{value name: rank}` over the model and its subgraphs, where ONNX shape inference knows it."""
    ranks = {}
    for graph, values in _inferred_values(model):
        ranks.update(
            (value.name, len(value.type.tensor_type.shape.dim))
            for value in values
            if value.type.tensor_type.HasField("shape")
        )
        ranks.update((init.name, len(init.dims)) for init in graph.initializer)
    return ranks


def tensor_types(model):
    """`{value name: ONNX element type}` over the model and its subgraphs, where ONNX shape
    inference knows it."""
    types = {}
    for graph, values in _inferred_values(model):
        types.update(
            (value.name, value.type.tensor_type.elem_type)
            for value in values
            if value.type.tensor_type.elem_type
        )
        types.update((init.name, init.data_type) for init in graph.initializer)
    return types


def _inferred_values(model):
    """`(graph, its value infos, inputs and outputs)` for each graph of `model` after ONNX shape inference."""
    inferred = onnx.shape_inference.infer_shapes(model)
    return [(graph, [*graph.value_info, *graph.input, *graph.output]) for graph in all_graphs(inferred.graph)]


def read_transposed_weights(model):
    """`model` (changed in place and returned) with each `MatMul(x, Eᵀ)` of a stored `E` read as
    `Gemm(x, E, transB=1)` (module docstring, 5)."""
    main = model.graph
    constants = {init.name: init for init in main.initializer}
    by_shape = {}  # (rows, columns) -> names of the 2-D constants of that shape
    for name, init in constants.items():
        if len(init.dims) == 2:
            by_shape.setdefault(tuple(init.dims), []).append(name)
    arrays = {}  # name -> array, converted once (square weights are each other's candidates)

    def array(name):
        if name not in arrays:
            arrays[name] = numpy_helper.to_array(constants[name])
        return arrays[name]

    ranks = None
    for graph in all_graphs(main):
        for index, node in enumerate(graph.node):
            if node.op_type != "MatMul" or node.input[1] not in constants:
                continue
            weight = node.input[1]
            candidates = [c for c in by_shape.get(tuple(constants[weight].dims)[::-1], []) if c != weight]
            if not candidates:
                continue
            ranks = ranks if ranks is not None else tensor_ranks(model)
            if ranks.get(node.input[0]) != 2:
                continue  # Gemm multiplies matrices only
            stored = next((c for c in candidates if np.array_equal(array(c), array(weight).T)), None)
            if stored is not None:
                graph.node[index].CopyFrom(
                    helper.make_node(
                        "Gemm", [node.input[0], stored], list(node.output), name=node.name, transB=1
                    )
                )
    _drop_unused_initializers(main)
    return model


def compare_integers(model):
    """`model` (changed in place and returned) with each `Greater`/`Less` of integers cast to float
    comparing the integers (module docstring, 7)."""
    integer_types = {onnx.TensorProto.INT32: np.int32, onnx.TensorProto.INT64: np.int64}
    types = tensor_types(model)
    constants = _initializers(model)
    producers = {
        name: node for graph in all_graphs(model.graph) for node in graph.node for name in node.output
    }
    taken = set(constants) | set(producers)
    for graph in all_graphs(model.graph):
        for node in [n for n in graph.node if n.op_type in ("Greater", "Less")]:
            casts = [producers.get(name) for name in node.input]
            sources = {
                types.get(cast.input[0])
                for cast in casts
                if cast is not None
                and cast.op_type == "Cast"
                and _attribute(cast, "to") == onnx.TensorProto.FLOAT
            }
            if len(sources) != 1 or next(iter(sources)) not in integer_types:
                continue
            dtype = integer_types[sources.pop()]
            operands = [
                _integer_operand(name, cast, constants, dtype) for name, cast in zip(node.input, casts)
            ]
            if any(operand is None for operand in operands):
                continue
            for index, operand in enumerate(operands):
                if isinstance(operand, np.ndarray):  # a float constant holding integers: in `dtype`
                    name = _unique(node.input[index] + "/integer", taken)
                    taken.add(name)
                    model.graph.initializer.append(numpy_helper.from_array(operand, name))
                    operand = name
                node.input[index] = operand
    _drop_dead_nodes(model.graph)
    _drop_unused_initializers(model.graph)
    return model


def _integer_operand(name, producer, constants, dtype):
    """What a comparison in `dtype` reads instead of `name`: the integer a `Cast(to float)` of
    `dtype` converted, or a float constant's values as a `dtype` array where all are integers
    that float32 holds exactly; else None."""
    if producer is not None and producer.op_type == "Cast":
        return producer.input[0]  # of `dtype` (the caller checked every cast's source type)
    if name in constants and producer is None:
        values = numpy_helper.to_array(constants[name])
        if (
            values.dtype == np.float32
            and np.all(np.abs(values) <= 2.0**24)
            and np.all(values == np.round(values))
        ):
            return values.astype(dtype)
    return None


def simplify(model, layer_norms=True, wheres=True):
    """`model` (changed in place and returned) with the rewrites applied (the LayerNorm fusion and the
    `Where`s only if `layer_norms` / `wheres`: benchmarks compare without them) and unused
    initializers dropped."""
    hoist_loop_invariants(model)
    collapse_tensordots(model)
    read_shapes_in_int64(model)
    if layer_norms:
        fuse_layer_norms(model)
    if wheres:
        select_with_where(model)
    read_transposed_weights(model)
    compare_integers(model)
    # Last: ONNX shape inference, which the rewrites above need, does not see the types of a
    # subgraph's outer initializers, and this moves every subgraph's into the main graph.
    store_constants_once(model)
    _drop_unused_initializers(model.graph)
    return model
