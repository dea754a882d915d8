"""Loop-invariant weights out of the beam search's ONNX `Loop`.

tf2onnx converts the `tf.while_loop` of `translate_ids` into an ONNX `Loop`
whose state carries every weight of the decoder: ~100 loop-carried values
that the body passes through unchanged, and whose kernels the body then
reshapes, transposes or casts again at every decoding step. That costs per-step
work, and it hides the weights from tools that look for constant matrix
operands (ONNX Runtime's quantizer only quantizes a `MatMul` whose weight is
an initializer it can see).

`hoist_loop_invariants` rewrites the graph, exactly (no arithmetic changes):

1. A loop-carried value that the body passes through unchanged is read from
   the enclosing scope instead (an ONNX body may use any outer value), and
   leaves the loop state.
2. Body nodes whose inputs are all constants (initializers, `Constant` nodes
   or results of such nodes) and whose op only rearranges or converts data
   (`Reshape`, `Transpose`, `Cast`, ...; constants include the body's own
   initializers) are evaluated once, with the ONNX
   reference evaluator, into initializers of the main graph.
3. Initializers that nothing uses any more (in any graph) are dropped.

    model = hoist_loop_invariants(onnx.load("translate.onnx"))

Tested in `tests/test_onnx_int8.py`: the rewritten graph gives bit-identical
outputs and has fewer nodes per step.
"""

import numpy as np
import onnx
from onnx import helper, numpy_helper

# Ops that rearrange, select or convert their input: evaluating them once on
# constants changes no arithmetic and never makes a tensor bigger than the
# inputs it reads (no Tile/Expand/ConstantOfShape).
FOLDABLE = frozenset({"Reshape", "Transpose", "Cast", "Squeeze", "Unsqueeze", "Identity", "Flatten",
                      "Shape", "Slice", "Gather", "Concat", "Constant"})


def hoist_loop_invariants(model):
    """`model` (an `onnx.ModelProto`, changed in place and returned) with its `Loop`s' invariants hoisted."""
    graph = model.graph
    constants = {init.name for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Loop":
            _drop_pass_through_state(graph, node)
            body = next(a.g for a in node.attribute if a.name == "body")
            _fold_constants(model, body, constants)
    _drop_unused_initializers(graph)
    return model


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
    new_outputs = [body.output[0]] + [body.output[1 + i] for i in keep] + list(body.output[1 + carried:])
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
    for node in graph.node:
        node.input[:] = [final_values.get(name, name) for name in node.input]
    for output in graph.output:
        if output.name in final_values:  # pragma: no cover - our graphs never output weights
            raise ValueError(f"graph output {output.name} is a loop-invariant state; cannot hoist it.")


def _rename_uses(graph, renames, outputs=False):
    """Renames the inputs of `graph`'s nodes (and of their subgraphs, unless they shadow the name).

    With `outputs`, a graph output that is renamed keeps its name through an
    `Identity` of the outer value (the loop body's own pass-through outputs
    are dropped instead).
    """
    for node in graph.node:
        node.input[:] = [renames.get(name, name) for name in node.input]
        for attribute in node.attribute:
            subgraphs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
            for subgraph in subgraphs:
                shadowed = {value.name for value in subgraph.input}
                _rename_uses(subgraph, {k: v for k, v in renames.items() if k not in shadowed},
                             outputs=True)
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
            helper.make_graph([node], "fold", [_value_info(name, array) for name, array in feeds.items()],
                              [helper.make_value_info(name, onnx.TypeProto()) for name in node.output]),
            opset_imports=model.opset_import)
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
    used = set()

    def collect(g):
        for node in g.node:
            used.update(node.input)
            for attribute in node.attribute:
                for subgraph in ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH
                                 else attribute.graphs):
                    collect(subgraph)
        used.update(output.name for output in g.output)

    def drop(g):
        for init in [init for init in g.initializer if init.name not in used]:
            g.initializer.remove(init)
        for node in g.node:
            for attribute in node.attribute:
                for subgraph in ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH
                                 else attribute.graphs):
                    drop(subgraph)

    collect(graph)
    drop(graph)


def count_nodes(model):
    """`(main graph nodes, nodes in Loop bodies)` of an ONNX model."""
    main, loop = len(model.graph.node), 0
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                loop += len(attribute.g.node)
    return main, loop
