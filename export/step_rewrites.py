"""Rewrites of `decoder_step.onnx` that use what is known about one decoding step: fewer kernels
per step, the same bits.

The step is converted by tf2onnx from `Transformer.decode_step`, which Keras writes for any
number of new positions: `(rows, 1, d_model)` tensors, and the positional encoding as a slice
`table[t : t + 1]` whose bounds are computed from the cache's shape. In a step that decodes one
position per row, four things are known that the converted graph does not use:

1. **The position is the cache length** (`positions_by_gather`): the slice's ~8 kernels
   (Shape -> Cast -> Slice -> Concat -> Add -> Slice -> Unsqueeze -> Slice, what ONNX Runtime
   leaves after folding its constants) become `Gather(table, Shape(past_key_0)[2:3])`, a
   `(1, d_model)` row of the same table.
2. **The new positions are a matrix** (`rows_as_matrices`): the `(rows, 1, width)` tensors
   become `(rows, width)` (the token ids are gathered without their `Unsqueeze`, a reshape to
   `(-1, 1, width)` reshapes to `(-1, width)`, the last position's `Slice` + `Squeeze` before
   the output projection go). ONNX Runtime then fuses each projection's `MatMul` + bias `Add`
   (+ `Relu`) into one `Gemm` / `FusedGemm`, which it only does for matrices: the same sums
   (ONNX Runtime's SGEMM adds the bias to a finished dot product as long as the inner dimension
   is at most 256, measured: from 512 on, a `Gemm` sums in two blocks and differs in the last
   bit). So a product over more than `GEMM_EXACT_DEPTH` terms keeps its bias apart: its `Add`
   is written as `Sum` of the same two operands (the same addition; ONNX Runtime fuses only
   `Add`), and the step still gets its matrices (the recipe's d_ff 512 model: its feed-forward
   output).
3. **A scaled query reshaped twice** (`collapse_scaled_reshapes`): `Reshape(Mul(Reshape(x, a),
   c), b)` with a scalar `c` becomes `Reshape(Mul(x, c), b)`.
4. **The new position's heads are one reshape away** (`split_heads_once`): a self-attention's
   Q/K/V projection split in three, each part reshaped to `(rows, heads, 1, depth)`, becomes
   one reshape to `(rows, 3 x heads, 1, depth)` split on the heads' axis.

`leaner_step(model)` applies the four and keeps the result only if `verified`: ONNX Runtime
runs the step before and after on random inputs (several sentences of several beams, two cache
lengths) and every output is bitwise the same; otherwise (a graph the rewrites do not know, or
a kernel that sums in another order) it tries them without `rows_as_matrices`, then keeps the
step as converted. On the 3+3 `mini` model (fused kernels) the step runs 108 kernels before and
74 after (`scripts/count_loop_nodes.py`, after ONNX Runtime's optimizer).
"""

import copy

import numpy as np
import onnx
from onnx import helper, numpy_helper

from keras_transformer.layers.positional_encoding import sinusoidal_table
from keras_transformer_export.graph_rewrites import (
    _attribute,
    _consumers,
    _drop_dead_nodes,
    _drop_unused_initializers,
    _rename_uses,
    _unique,
    _uses,
)

# Ops that read a `(rows, ..., width)` tensor element by element (or, `DynamicQuantizeLinear`,
# its range as a whole): they take a `(rows, width)` matrix as well and give one.
ROW_WISE = frozenset({"Relu", "Cast", "Identity", "DynamicQuantizeLinear"})
ELEMENTWISE = frozenset({"Add", "Mul", "Sub", "Div"})
LAST_AXIS = frozenset({"Softmax", "LogSoftmax", "LayerNormalization", "Split"})
# Ops whose first input is the rows and whose other inputs are constants (weights, biases, scales).
PROJECTIONS = frozenset({"MatMul", "MatMulInteger", "SkipLayerNormalization"})
# What tf2onnx computes a slice's bounds with (`_positional_table`).
SHAPE_ARITHMETIC = frozenset(
    {"Cast", "Slice", "Concat", "Add", "Sub", "Mul", "Equal", "Unsqueeze", "Squeeze", "Gather", "Reshape"}
    | {"Constant"}
)
# The name suffix of the position's `Gather` (`positions_by_gather`), which `rows_as_matrices`
# lets a matrix be added to: a `(1, d_model)` row.
POSITION = "/by_gather"
# `Shape(past_key_0)`'s axis that holds the number of positions decoded so far.
CACHE_LENGTH_AXIS = 2
# The most terms a product may sum for ONNX Runtime's `Gemm` to add its bias after them, in the
# bits of `MatMul` + `Add` (module docstring, 2); a deeper product's bias stays apart.
GEMM_EXACT_DEPTH = 256
# ONNX Runtime's optimizers that `verified` leaves out (its docstring).
UNSEEN_FUSIONS = ("SkipLayerNormFusion",)


def leaner_step(model):
    """`(model, report)`: `decoder_step.onnx`'s `model` with the module docstring's rewrites (a
    new model; `model` is not changed). All four if the result is `verified`, else all but
    `rows_as_matrices` (the one whose `Gemm`s may sum in another order) if that is, else
    `model` itself; `report` is `{rewrite: applied}`, empty if none was kept."""
    for rewrites in (REWRITES, tuple(r for r in REWRITES if r is not rows_as_matrices)):
        rewritten = copy.deepcopy(model)
        applied = {}
        for rewrite in rewrites:
            if rewrite is rows_as_matrices and not applied.get("positions_by_gather"):
                continue  # a (1, 1, d_model) position would broadcast matrices back to rank 3
            applied[rewrite.__name__] = int(rewrite(rewritten))
            _drop_dead_nodes(rewritten.graph)  # a value the rewrite left unread has no reader
        if not any(applied.values()):
            return model, {}
        _drop_unused_initializers(rewritten.graph)
        del rewritten.graph.value_info[:]  # ranks changed
        # With the shapes inferred anew, else none (ONNX Runtime infers them): which of the two
        # gives the converted step's bits depends on which fusions ONNX Runtime then finds.
        for candidate in (_shapes_inferred(rewritten), rewritten):
            if verified(model, candidate):
                return candidate, {name: count for name, count in applied.items() if count}
    return model, {}


def _shapes_inferred(model):
    """A copy of `model` with its values' shapes inferred by ONNX (`model` if that fails).
    ONNX Runtime's fusions read them: an `Add` + `LayerNormalization` becomes one
    `SkipLayerNormalization` (other bits) only where the shapes are known."""
    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - ONNX Runtime infers what it can
        return model


# -- 1. the position ------------------------------------------------------------------------------


def positions_by_gather(model):
    """Replaces the positional table's slice by a `Gather` of its row at the cache length (module
    docstring, 1); returns how many were replaced (0 or 1)."""
    graph = model.graph
    constants = {init.name: init for init in graph.initializer}
    producers = {name: node for node in graph.node for name in node.output}
    inputs = {value.name for value in graph.input}
    if "past_key_0" not in inputs:
        return 0
    for add in graph.node:
        if add.op_type != "Add":
            continue
        for side, name in enumerate(add.input):
            made = producers.get(name)
            if made is not None and made.op_type == "Gather" and made.name.endswith(POSITION):
                return 0  # rewritten already
            table = _positional_table(name, producers, constants, inputs)
            if table is None:
                continue
            length = f"{name}/cache_length"
            row = f"{name}{POSITION}"
            index = list(graph.node).index(add)
            graph.node.insert(
                index,
                helper.make_node(
                    "Shape", ["past_key_0"], [length], name=length,
                    start=CACHE_LENGTH_AXIS, end=CACHE_LENGTH_AXIS + 1,
                ),
            )  # fmt: skip
            graph.node.insert(index + 1, helper.make_node("Gather", [table, length], [row], name=row, axis=0))
            add.input[side] = row
            return 1
    return 0


def _positional_table(name, producers, constants, inputs):
    """The name of the §3.5 table if `name` is computed from that table (a constant equal to
    `sinusoidal_table`), other constants and the shapes of the graph's inputs alone; else None."""
    tables, seen, stack = set(), set(), [name]
    while stack:
        value = stack.pop()
        if value in seen or value == "":
            continue
        seen.add(value)
        if value in constants:
            array = numpy_helper.to_array(constants[value])
            if array.ndim == 2 and array.shape[0] > 1 and array.dtype == np.float32:
                if np.array_equal(array, sinusoidal_table(*array.shape)):
                    tables.add(value)
                else:
                    return None  # a weight: not the position alone
            continue
        node = producers.get(value)
        if node is None:
            return None  # an input read other than through its shape
        if node.op_type == "Shape":
            if node.input[0] not in inputs:
                return None
            continue
        if node.op_type not in SHAPE_ARITHMETIC:
            return None
        stack.extend(node.input)
    return next(iter(tables)) if len(tables) == 1 else None


# -- 2. rows as matrices --------------------------------------------------------------------------


def rows_as_matrices(model):
    """Makes the step's `(rows, 1, width)` tensors `(rows, width)` (module docstring, 2); returns
    whether it did. All or nothing: a reader it does not know leaves the graph unchanged."""
    graph = model.graph
    work = copy.deepcopy(graph)
    if not _rows_as_matrices(work):
        return False
    graph.CopyFrom(work)
    return True


def _rows_as_matrices(graph):
    """`rows_as_matrices` on `graph` (changed in place; when it returns False `graph` may be
    half-changed, and the caller throws it away)."""
    constants = {init.name: init for init in graph.initializer}
    consumers = _consumers(graph)
    producers = {name: node for node in graph.node for name in node.output}
    outputs = {value.name for value in graph.output}

    def constant(name):
        return numpy_helper.to_array(constants[name]) if name in constants else None

    # Sources: the token ids gathered without their `Unsqueeze`; reshapes to (-1, 1, width).
    unsqueeze = next((n for n in graph.node if n.op_type == "Unsqueeze" and n.input[0] == "token_ids"), None)
    if unsqueeze is None or _axes(unsqueeze, constant) != [1]:
        return False
    sources = []
    for reader in consumers.get(unsqueeze.output[0], []):
        ids = reader.input[1] if len(reader.input) > 1 else None
        if reader.op_type == "Gather" and ids == unsqueeze.output[0] and not _attribute(reader, "axis"):
            reader.input[1] = "token_ids"
            sources.append(reader.output[0])
        elif not _int8_lookup_reader(reader, graph, consumers, producers, constant, sources):
            return False
    graph.node.remove(unsqueeze)
    _drop_dead_nodes(graph)  # what the int8 lookup no longer reads
    consumers = _consumers(graph)
    producers = {name: node for node in graph.node for name in node.output}
    for node in graph.node:
        if node.op_type == "Reshape" and _row_shape(constant(node.input[1])):
            node.input[1] = _new_constant(graph, constants, constant(node.input[1])[[0, 2]])
            sources.append(node.output[0])

    # Phase 1: every tensor computed row by row from the sources.
    rows, pending = set(sources), list(sources)
    while pending:
        for node in consumers.get(pending.pop(), []):
            if node.op_type in ROW_WISE | ELEMENTWISE | LAST_AXIS | PROJECTIONS:
                first_only = node.op_type in ("DynamicQuantizeLinear", "SkipLayerNormalization")
                for name in node.output[:1] if first_only else node.output:
                    if name not in rows:
                        rows.add(name)
                        pending.append(name)
            elif node.op_type not in ("Reshape", "Slice", "Gemm"):
                return False  # a reader this rewrite does not know
    if rows & outputs:
        return False

    # Phase 2: each reader of rows checked (and its constants reshaped) with all rows known.
    readers = [node for node in graph.node if any(name in rows for name in node.input)]
    if not all(
        _reads_rows(node, rows, constant, graph, constants, consumers, producers, outputs) for node in readers
    ):
        return False
    _deep_biases_apart(graph, rows, constant, consumers, outputs)
    return True


def _deep_biases_apart(graph, rows, constant, consumers, outputs):
    """The bias `Add` after a product of rows that sums more than `GEMM_EXACT_DEPTH` terms becomes
    `Sum` (module docstring, 2), so that ONNX Runtime does not fuse the two into a `Gemm`."""
    for node in graph.node:
        weight = constant(node.input[1]) if node.op_type == "MatMul" and node.input[0] in rows else None
        if weight is None or weight.shape[0] <= GEMM_EXACT_DEPTH or node.output[0] in outputs:
            continue
        readers = consumers.get(node.output[0], [])
        if len(readers) == 1 and readers[0].op_type == "Add":
            readers[0].op_type = "Sum"


def _int8_lookup_reader(reader, graph, consumers, producers, constant, sources):
    """Whether `reader` of the token ids' `Unsqueeze` belongs to `quantization._lookup`'s int8
    embedding lookup of ids `(rows, 1)`, made to read the ids `(rows,)`: its `Reshape` to `(-1,)`
    (the ids themselves: its readers read `token_ids`), or the `Shape` of the ids that reshapes
    the looked-up `(rows, width)` rows to `(rows, 1, width)` (that `Reshape`'s readers read the
    rows, a source). Adds the sources to `sources`; the nodes left unread are dropped later."""

    def values(name):  # a constant's values, from an initializer or a `Constant` node
        made = producers.get(name)
        if made is not None and made.op_type == "Constant":
            return _attribute(made, "value_ints")
        value = constant(name)
        return None if value is None else value.tolist()

    if reader.op_type == "Reshape" and values(reader.input[1]) == [-1]:
        _rename_uses(graph, {reader.output[0]: "token_ids"})
        return True
    if reader.op_type != "Shape" or reader.attribute:
        return False
    concats = consumers.get(reader.output[0], [])
    if len(concats) != 1 or concats[0].op_type != "Concat" or concats[0].input[0] != reader.output[0]:
        return False
    width = producers.get(concats[0].input[1]) if len(concats[0].input) == 2 else None
    reshapes = consumers.get(concats[0].output[0], [])
    if (  # the target (ids..., width), width = Shape(rows, start=1), the rows matrices
        width is None
        or width.op_type != "Shape"
        or _attribute(width, "start") != 1
        or _attribute(width, "end") is not None
        or not reshapes
        or any(r.op_type != "Reshape" or r.input[1] != concats[0].output[0] for r in reshapes)
        or any(r.input[0] != width.input[0] for r in reshapes)
    ):
        return False
    _rename_uses(graph, {reshape.output[0]: reshape.input[0] for reshape in reshapes})
    sources.extend(reshape.input[0] for reshape in reshapes)
    return True


def _reads_rows(node, rows, constant, graph, constants, consumers, producers, outputs):
    """Whether `node`, a reader of rows, computes the same from `(rows, width)` matrices; adjusts
    a `(1, 1, width)` constant operand to `(1, width)` and removes a last position's
    `Slice` + `Squeeze` (their readers read the rows themselves)."""
    op, inputs = node.op_type, list(node.input)

    def constants_only(names):
        return all(name in constants for name in names if name)

    if op in ROW_WISE:
        return True
    if op in LAST_AXIS:
        axis = _attribute(node, "axis", 0 if op == "Split" else -1)
        return axis == -1 and constants_only(inputs[1:])
    if op == "MatMul":
        return inputs[0] in rows and inputs[1] in constants and constant(inputs[1]).ndim == 2
    if op == "MatMulInteger":  # (rows, weight, the rows' zero point, the weight's)
        weights = inputs[1:2] + inputs[3:]
        return inputs[0] in rows and constants_only(weights) and _is_scalar(inputs[2], producers, constant)
    if op == "SkipLayerNormalization":
        return (
            inputs[0] in rows
            and inputs[1] in rows
            and constants_only(inputs[2:])
            and not any(node.output[1:])
        )
    if op in ELEMENTWISE:
        for index, other in enumerate(inputs):
            value = constant(other)
            if (
                other in rows
                or (value is not None and value.ndim <= 1)
                or _is_scalar(other, producers, constant)
            ):
                continue
            if value is not None and value.ndim == 3 and value.shape[:2] == (1, 1):
                node.input[index] = _new_constant(graph, constants, value[0])
                continue
            made = producers.get(other)
            if made is None or not made.name.endswith(POSITION):  # the (1, d_model) position
                return False
        return True
    if op == "Reshape":  # its target alone sets the output's shape, unless it copies a dimension
        return _sets_shape(inputs[1], producers, constant)
    if op == "Slice":
        return _drop_last_position(node, constant, graph, consumers, outputs)
    return op == "Gemm" and inputs[0] in rows


def _sets_shape(target, producers, constant):
    """Whether the reshape target `target` has no 0 (a dimension copied from the input) that
    could mean another thing for a matrix: a constant without zeros, or a `Concat` of such
    constants and dimensions of other tensors (`Shape`: a 0 there is an empty batch, the same
    either way)."""
    value = constant(target)
    if value is not None:
        return not (value == 0).any()
    node = producers.get(target)
    if node is None or node.op_type != "Concat":
        return False
    return all(
        (constant(part) is not None and not (constant(part) == 0).any())
        or (producers.get(part) is not None and producers[part].op_type == "Shape")
        for part in node.input
    )


def _drop_last_position(node, constant, graph, consumers, outputs):
    """`x[:, -1:]` or `x[:, 0:1]` of rows `(rows, 1, width)` followed by `Squeeze(axis 1)`: the
    rows themselves."""
    readers = consumers.get(node.output[0], [])
    if len(node.input) != 4 or len(readers) != 1 or readers[0].op_type != "Squeeze":
        return False
    squeeze = readers[0]
    starts, ends, axes = (constant(name) for name in node.input[1:4])
    if starts is None or ends is None or axes is None or _axes(squeeze, constant) != [1]:
        return False
    bounds = dict(zip(axes.tolist(), zip(starts.tolist(), ends.tolist())))
    if set(bounds) != {0, 1} or bounds[0][0] != 0 or bounds[0][1] < 2**31 - 1:
        return False
    if bounds[1] != (0, 1) and not (bounds[1][0] == -1 and bounds[1][1] >= 2**31 - 1):
        return False
    if squeeze.output[0] in outputs:
        return False
    _rename_uses(graph, {squeeze.output[0]: node.input[0]})
    graph.node.remove(node)
    graph.node.remove(squeeze)
    return True


def _is_scalar(name, producers, constant):
    """Whether `name` is a scalar computed at run time: `DynamicQuantizeLinear`'s scale or zero
    point, or a product of such scalars and scalar constants (an int8 product's scale)."""
    node = producers.get(name)
    if node is None:
        return False
    if node.op_type == "DynamicQuantizeLinear":
        return name in node.output[1:]
    if node.op_type in ("Mul", "Cast"):
        return all(
            _is_scalar(value, producers, constant)
            or (constant(value) is not None and constant(value).ndim == 0)
            for value in node.input
        )
    return False


def _axes(node, constant):
    if len(node.input) > 1:
        axes = constant(node.input[1])
        return None if axes is None else axes.tolist()
    return _attribute(node, "axes")


def _row_shape(shape):
    """Whether a reshape target is `(-1, 1, width)`."""
    return shape is not None and shape.ndim == 1 and len(shape) == 3 and shape[0] == -1 and shape[1] == 1


def _new_constant(graph, constants, array):
    name = _unique(f"step_rewrites/constant_{len(constants)}", constants)
    graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
    constants[name] = graph.initializer[-1]
    return name


# -- 3. a scaled query reshaped twice --------------------------------------------------------------


def collapse_scaled_reshapes(model):
    """`Reshape(Mul(Reshape(x, a), c), b)` -> `Reshape(Mul(x, c), b)` for a scalar constant `c`
    and a target `b` without zeros (module docstring, 3); returns how many."""
    graph = model.graph
    constants = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    producers = {name: node for node in graph.node for name in node.output}
    uses = _uses(graph)
    collapsed = 0
    for outer in graph.node:
        if (
            outer.op_type != "Reshape"
            or outer.input[1] not in constants
            or (constants[outer.input[1]] == 0).any()
        ):
            continue
        mul = producers.get(outer.input[0])
        if mul is None or mul.op_type != "Mul" or uses.get(mul.output[0]) != 1:
            continue
        # A scalar factor only: a (1,)-shaped one would broadcast to a rank of its own.
        sides = [i for i, value in enumerate(mul.input) if value in constants and constants[value].ndim == 0]
        if len(sides) != 1:
            continue
        inner = producers.get(mul.input[1 - sides[0]])
        if inner is None or inner.op_type != "Reshape" or uses.get(inner.output[0]) != 1:
            continue
        mul.input[1 - sides[0]] = inner.input[0]
        collapsed += 1
    return collapsed


# -- 4. the heads split once ----------------------------------------------------------------------


def split_heads_once(model):
    """Each self-attention's `Split` of the Q/K/V projection into three `(rows, width)` parts,
    each reshaped to `(rows, heads, 1, depth)` and the query scaled by a scalar `c` first,
    becomes `Mul` by `(c, ..., c, 1, ..., 1)` (the query's `width` columns by `c`, the keys'
    and values' by 1: the same products), one `Reshape` to `(rows, 3 x heads, 1, depth)` and
    a `Split` on the heads' axis (module docstring, 4): the same elements in the same places,
    two kernels fewer per layer. (The scale stays before the split: a scalar `Mul` straight
    before the query's `MatMul` is what ONNX Runtime folds into the product's `alpha`, which
    rounds differently.) Returns how many."""
    graph = model.graph
    constants = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    consumers = _consumers(graph)
    outputs = {value.name for value in graph.output}

    def only_reader(name, op_type):
        readers = consumers.get(name, [])
        if len(readers) != 1 or readers[0].op_type != op_type or name in outputs:
            return None
        return readers[0]

    def heads_shape(reshape):
        target = constants.get(reshape.input[1]) if reshape is not None else None
        if target is None or target.shape != (4,) or target[0] != -1 or target[2] != 1 or (target == 0).any():
            return None
        return target.tolist()

    count = 0
    for split in list(graph.node):
        if (
            split.op_type != "Split"
            or len(split.output) != 3
            or _attribute(split, "axis", 0) != -1
            or (len(split.input) > 1 and split.input[1])
            or _attribute(split, "split") is not None
        ):
            continue
        mul = only_reader(split.output[0], "Mul")
        scale = [constants.get(name) for name in mul.input] if mul is not None else []
        scale = [value for value in scale if value is not None and value.ndim == 0]
        if len(scale) != 1:
            continue
        reshapes = [only_reader(mul.output[0], "Reshape")]
        reshapes += [only_reader(name, "Reshape") for name in split.output[1:]]
        shapes = [heads_shape(reshape) for reshape in reshapes]
        if shapes[0] is None or any(shape != shapes[0] for shape in shapes):
            continue
        _, heads, _, depth = shapes[0]
        width = heads * depth
        factors = np.concatenate([np.full(width, scale[0]), np.ones(2 * width, scale[0].dtype)])
        prefix = split.name or split.output[0]
        scaled, joined = f"{prefix}/scaled", f"{prefix}/heads"
        factors = _new_constant(graph, constants, factors.astype(scale[0].dtype))
        target = _new_constant(graph, constants, np.array([-1, 3 * heads, 1, depth], np.int64))
        sizes = _new_constant(graph, constants, np.array([heads] * 3, np.int64))
        index = list(graph.node).index(split)
        new_nodes = [
            helper.make_node("Mul", [split.input[0], factors], [scaled], name=scaled),
            helper.make_node("Reshape", [scaled, target], [joined], name=joined),
            helper.make_node(
                "Split", [joined, sizes], [reshape.output[0] for reshape in reshapes],
                name=f"{prefix}/by_heads", axis=1,
            ),
        ]  # fmt: skip
        for node in (split, mul, *reshapes):
            graph.node.remove(node)
        for offset, node in enumerate(new_nodes):
            graph.node.insert(index + offset, node)
        count += 1
    return count


# -- checks ---------------------------------------------------------------------------------------


def verified(before, after, seed=0):
    """Whether ONNX Runtime gives bitwise the same outputs for the steps `before` and `after` on
    random inputs: 3 sentences of 2 beams (6 rows), cache lengths 0 and 5, 7 source positions.

    Without ONNX Runtime's `SkipLayerNormFusion`: it makes an `Add` + `LayerNormalization` one
    `SkipLayerNormalization` (other bits) only in a graph's main body and only for `(rows, 1,
    width)` tensors with known shapes, so the converted step alone would be compared in bits that
    no search runs: inside the searches' `Loop` bodies, where the step runs, ONNX Runtime leaves
    the two nodes as they are, and the rewritten step has matrices."""
    from keras_transformer_export.onnx_runtime import make_session

    rng = np.random.default_rng(seed)
    try:
        onnx.checker.check_model(after)
        sessions = [make_session(model, 1, UNSEEN_FUSIONS) for model in (before, after)]
        for cache_length in (0, 5):
            feeds = random_feeds(before.graph, rng, 3, 2, cache_length, source_length=7)
            results = [session.run(None, feeds) for session in sessions]
            if any(not np.array_equal(a, b) for a, b in zip(*results)):
                return False
    except Exception:  # noqa: BLE001 - a graph ONNX Runtime refuses or cannot run is not kept
        return False
    return True


def random_feeds(graph, rng, sentences, beam, cache_length, source_length):
    """Inputs for the step `graph`: `sentences * beam` rows of token ids and self-attention cache
    `(rows, heads, cache_length, depth)`; per sentence, a source mask (its first position kept)
    and cross-attention keys and values `(sentences, heads, source_length, depth)`."""
    vocab = next(
        (
            d.dim_value
            for value in graph.output
            if value.name == "log_probs"
            for d in value.type.tensor_type.shape.dim[1:]
        ),
        100,
    )
    rows, feeds = sentences * beam, {}
    for value in graph.input:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        if value.name == "token_ids":
            feeds[value.name] = rng.integers(4, vocab, rows).astype(dtype)
        elif value.name == "memory_mask":
            mask = rng.random((sentences, 1, source_length)) < 0.8
            mask[:, :, 0] = True
            feeds[value.name] = mask.astype(dtype)
        elif value.name.startswith("past_"):
            feeds[value.name] = rng.standard_normal((rows, dims[1], cache_length, dims[3])).astype(dtype)
        else:  # cross_key_i, cross_value_i
            feeds[value.name] = rng.standard_normal((sentences, dims[1], source_length, dims[3])).astype(
                dtype
            )
    return feeds


REWRITES = (positions_by_gather, collapse_scaled_reshapes, rows_as_matrices, split_heads_once)
