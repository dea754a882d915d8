"""`translate_lean.onnx`: the beam search every request without controls runs, written as ONNX
nodes by hand around the exported `encoder.onnx` and `decoder_step.onnx`.

`translate.onnx` is `translate_ids_with_options` converted by tf2onnx: one `Loop` whose body
holds the decoder step and ~200 nodes of search bookkeeping (the controls' switches, sentences
leaving the batch at every step, shape arithmetic as TensorFlow traced it). At the `mini` width
that bookkeeping costs about as much as the decoder: on 40 val sentences at batch 1 (fused
kernels, AMD EPYC) `decoder_step.onnx` alone in a `Loop` with an `ArgMax` took 0.24 ms a step,
`translate.onnx` 0.55 ms a step. Here the same search has ~80 small nodes a step besides the
decoder's, and no pass over all `beam * vocab` candidates but one `ReduceMax`.

What it is (the search of `keras_transformer.decoding.search._BeamSearch`, the same tokens):
- the encoder's nodes once; then a `Loop` over stages, each a `Loop` over decoding steps whose
  body is `decoder_step.onnx`'s nodes (its weights as the body's own initializers: read from the
  main graph through the stages' `Loop` instead, batch 1 was ~20% slower on the `mini` model;
  its nodes that read only the stage's source mask and cross-attention keys/values run once per
  stage, before the steps' `Loop`: `_hoist_invariants`), the top `beam` of the `beam * vocab`
  candidates after `policy.constrain` (ONNX `TopK`'s order: ties go to the lower index, as
  `top_k`; ranked by chunks of the vocabulary first, and capped by chunk except where a
  special id is: `_top_candidates`; each sentence's caps a row of
  `policy.output_cap_rows`, which row at each step a table the stage computes once:
  `policy.output_cap_row`), the pool
  of finished hypotheses (the best `beam` by `log P / length_penalty`),
  `policy.search_is_final`, and one `Gather` per cache tensor to reorder the beams (the
  bodies' inputs and outputs declared with their ranks: ONNX Runtime's `MatMul` + `Add`
  fusion needs them);
- the policy's rules (`output_limits`, `constrain`, `length_penalty`, `search_is_final`,
  `empty_sources`) are the functions of `keras_transformer.decoding.policy` themselves, called
  with `OnnxOps` as their array namespace `xp`: each call emits the nodes, in the innermost
  graph that holds an operand (a rule of per-sentence constants is computed once per stage),
  and constant operands are folded with NumPy;
- a sentence whose search is final keeps its pool (its candidates are impossible, and `TopK`
  keeps the pool's own entries first among equals) until the stage ends: once at most
  `STAGE_FRACTION` of the stage's sentences are still searched, the finished ones write their
  pools into the results and leave, and the next stage runs on the others (`translate.onnx`
  drops them at every step: ~20 more nodes a step);
- an empty source (`policy.empty_sources`) is not searched: EOS alone, score 0.

Inputs: `source_ids` int32 `(batch, len_src)`; `length_penalty` float, `max_extra_length` and
`min_length` int32 and `early_stopping` bool scalars, with the export's options as defaults
(initializers). Outputs: the
whole pools, best first: `nbest_ids` int32 `(batch, beam, max_len)`, `nbest_scores` and
`nbest_log_probs` float `(batch, beam)` (a request's `num_return` is their first columns), and
`target_ids` `(batch, max_len)`, `scores` `(batch,)`, the best of each.

What it does not do: the controls (target prefix, banned words and sequences, n-gram and
repetition limits), sampling and alignments. `OnnxTranslator(mode="lean")` sends the requests
that ask for one of them to `translate.onnx`.
"""

import numpy as np
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from keras_transformer.decoding import policy
from keras_transformer_export.cache_names import cache_layers
from keras_transformer_export.graph_rewrites import prefixed_graph
from keras_transformer_export.onnx_runtime import CONTROLS_OFF, LEAN_GRAPH
from keras_transformer_export.onnx_runtime import LEAN_OPTIONS as OPTION_INPUTS

OUTPUT_SHAPES = {
    "target_ids": ["batch", "max_len"],
    "scores": ["batch"],
    "nbest_ids": ["batch", "beam", "max_len"],
    "nbest_scores": ["batch", "beam"],
    "nbest_log_probs": ["batch", "beam"],
}

_ONNX_TYPES = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.bool_): TensorProto.BOOL,
}


NUMPY_ARITHMETIC = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power}


def _arithmetic(op_type, reverse=False):
    """`Tensor`'s operator method for `op_type` (`reverse`: the tensor is the right operand)."""

    def method(self, other):
        a, b = (other, self) if reverse else (self, other)
        return _innermost(a, b)._arith(op_type, a, b)

    return method


class Tensor:
    """A value of the graph being built: its name, NumPy dtype and rank (what the policy's
    rules read of an array: `shape`'s length, `dtype`, arithmetic, `[:, i]`)."""

    def __init__(self, ops, name, dtype, rank):
        self.ops, self.name, self.dtype, self.rank = ops, name, np.dtype(dtype), rank

    @property
    def shape(self):
        return (None,) * self.rank

    # Arithmetic with tensors and numbers (the ONNX node of NUMPY_ARITHMETIC's key), the node in the
    # innermost graph among the operands.
    __add__, __radd__ = _arithmetic("Add"), _arithmetic("Add", reverse=True)
    __sub__, __rsub__ = _arithmetic("Sub"), _arithmetic("Sub", reverse=True)
    __mul__, __rmul__ = _arithmetic("Mul"), _arithmetic("Mul", reverse=True)
    __truediv__, __rtruediv__ = _arithmetic("Div"), _arithmetic("Div", reverse=True)
    __pow__ = _arithmetic("Pow")

    def __getitem__(self, index):
        """`x[:, i]` (full slices, then one integer): a `Gather` on that axis."""
        index = index if isinstance(index, tuple) else (index,)
        *full, last = index
        if not all(s == slice(None) for s in full) or not isinstance(last, int):
            raise NotImplementedError(f"OnnxOps supports x[:, ..., i] only; got {index!r}.")
        return self.ops.take(self, np.array(last, np.int64), axis=len(full))


def _is_constant(value):
    return not isinstance(value, Tensor)


def _innermost(*values):
    """The builder of the most deeply nested graph among the tensors in `values` (a node reading
    a value of an enclosing graph belongs to the inner one)."""
    return max((v.ops for v in values if isinstance(v, Tensor)), key=lambda ops: ops.depth)


class OnnxOps:
    """The array namespace `xp` of `keras_transformer.decoding.policy` that writes ONNX nodes:
    each function called on a `Tensor` appends the node(s) computing it; called on NumPy values
    or Python numbers alone it computes them with NumPy (constant folding)."""

    def __init__(self, prefix, depth=0):
        self.prefix, self.depth, self.nodes, self.initializers, self._count = prefix, depth, [], [], 0

    # -- building blocks ---------------------------------------------------------------------
    def fresh(self, hint):
        self._count += 1
        return f"{self.prefix}{hint}_{self._count}"

    def const(self, value, dtype=None):
        array = np.asarray(value, dtype)
        name = self.fresh("const")
        self.initializers.append(numpy_helper.from_array(array, name))
        return Tensor(self, name, array.dtype, array.ndim)

    def tensor(self, value, like=None):
        """`value` as a `Tensor`: constants take `like`'s dtype when they are Python numbers."""
        if isinstance(value, Tensor):
            return value
        if like is not None and isinstance(value, (int, float, bool)):
            return self.const(value, like.dtype)
        return self.const(value)

    def node(self, op_type, inputs, dtype, rank, outputs=1, **attributes):
        names = [self.fresh(op_type.lower()) for _ in range(outputs)]
        inputs = [x.name if isinstance(x, Tensor) else x for x in inputs]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=names[0], **attributes))
        if outputs == 1:
            return Tensor(self, names[0], dtype, rank)
        return [Tensor(self, name, d, r) for name, (d, r) in zip(names, zip(dtype, rank))]

    def unsqueeze(self, x, axes):
        return self.node("Unsqueeze", [x, self.const(axes, np.int64)], x.dtype, x.rank + len(axes))

    def squeeze(self, x, axes):
        return self.node("Squeeze", [x, self.const(axes, np.int64)], x.dtype, x.rank - len(axes))

    def concat(self, values, axis):
        values = [self.tensor(v) for v in values]
        return self.node("Concat", values, values[0].dtype, values[0].rank, axis=axis)

    def arange(self, end, dtype):
        """`Range(0, end, 1)` of a scalar or `(1,)` tensor `end`."""
        end = self.squeeze(end, [0]) if end.rank == 1 else end
        return self.node(
            "Range", [self.const(0, dtype), self.cast(end, dtype), self.const(1, dtype)], dtype, 1
        )

    def reduce(self, op_type, x, axes=None):
        """`op_type` (`ReduceSum`, `ReduceMin`, ...) over `axes` (default: all), axes dropped."""
        inputs = [x] if axes is None else [x, self.const(axes, np.int64)]
        return self.node(op_type, inputs, x.dtype, 0 if axes is None else x.rank - len(axes), keepdims=0)

    def rows(self, x, indices):
        """`x[indices]` along the first axis."""
        return self.node("Gather", [x, indices], x.dtype, x.rank - 1 + indices.rank, axis=0)

    def cast(self, x, dtype):
        dtype = np.dtype(dtype)
        if _is_constant(x):
            return np.asarray(x, dtype)
        if x.dtype == dtype:
            return x
        return self.node("Cast", [x], dtype, x.rank, to=_ONNX_TYPES[dtype])

    def _pair(self, a, b):
        """Two operands as tensors of one dtype (NumPy's promotion of int and float: float)."""
        like = a if isinstance(a, Tensor) else b
        a, b = self.tensor(a, like), self.tensor(b, like)
        if a.dtype != b.dtype:
            dtype = np.result_type(a.dtype, b.dtype)
            a, b = self.cast(a, dtype), self.cast(b, dtype)
        return a, b

    def _arith(self, op_type, a, b):
        if _is_constant(a) and _is_constant(b):
            return NUMPY_ARITHMETIC[op_type](a, b)
        a, b = self._pair(a, b)
        return self.node(op_type, [a, b], a.dtype, max(a.rank, b.rank))

    def _compare(self, op_type, numpy_function, a, b):
        if _is_constant(a) and _is_constant(b):
            return numpy_function(a, b)
        a, b = self._pair(a, b)
        return self.node(op_type, [a, b], np.bool_, max(a.rank, b.rank))

    def _logical(self, op_type, numpy_function, a, b):
        if _is_constant(a) and _is_constant(b):
            return numpy_function(a, b)
        a, b = self.tensor(a), self.tensor(b)
        return self.node(op_type, [a, b], np.bool_, max(a.rank, b.rank))

    # -- the functions the policy calls --------------------------------------------------------
    def greater_equal(self, a, b):
        return self._compare("GreaterOrEqual", np.greater_equal, a, b)

    def less(self, a, b):
        return self._compare("Less", np.less, a, b)

    def equal(self, a, b):
        return self._compare("Equal", np.equal, a, b)

    def logical_and(self, a, b):
        return self._logical("And", np.logical_and, a, b)

    def logical_or(self, a, b):
        return self._logical("Or", np.logical_or, a, b)

    def logical_not(self, x):
        return np.logical_not(x) if _is_constant(x) else self.node("Not", [x], np.bool_, x.rank)

    def full(self, shape, value, dtype):
        return np.full(shape, value, dtype)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def minimum(self, a, b):
        if _is_constant(a) and _is_constant(b):
            return np.minimum(a, b)
        owner = _innermost(a, b)
        if owner is not self:  # operands of enclosing graphs only: computed there
            return owner.minimum(a, b)
        a, b = self._pair(a, b)
        return self.node("Min", [a, b], a.dtype, max(a.rank, b.rank))

    def where(self, condition, a, b):
        if all(_is_constant(x) for x in (condition, a, b)):
            return np.where(condition, a, b)
        owner = _innermost(condition, a, b)
        if owner is not self:  # as `minimum`
            return owner.where(condition, a, b)
        if _is_constant(a) and _is_constant(b):  # their common dtype
            dtype = np.result_type(np.asarray(a), np.asarray(b))
            a, b = self.const(a, dtype), self.const(b, dtype)
        else:
            a, b = self._pair(a, b)
        condition = self.tensor(condition)
        return self.node("Where", [condition, a, b], a.dtype, max(condition.rank, a.rank, b.rank))

    def reshape(self, x, shape):
        if _is_constant(x):
            return np.reshape(x, shape)
        return self.node("Reshape", [x, self.const(shape, np.int64)], x.dtype, len(shape))

    def max(self, x, axis):
        return self.node("ReduceMax", [x], x.dtype, x.rank - 1, axes=[axis], keepdims=0)

    def all(self, x, axis):
        as_int = self.cast(x, np.int32)
        smallest = self.node("ReduceMin", [as_int], np.int32, x.rank - 1, axes=[axis], keepdims=0)
        return self.cast(smallest, np.bool_)

    def take(self, x, indices, axis=0):
        x, indices = self.tensor(x), self.tensor(indices)
        return self.node("Gather", [x, indices], x.dtype, x.rank - 1 + indices.rank, axis=axis)

    def clip(self, x, low, high):
        if _is_constant(x):
            return np.clip(x, low, high)
        low, high = self.const(low, x.dtype), self.const(high, x.dtype)
        return self.node("Clip", [x, low, high], x.dtype, x.rank)


def _value(name, dtype, shape=None):
    return helper.make_tensor_value_info(name, _ONNX_TYPES[np.dtype(dtype)], shape)


def _loop(ops, name, trips, condition, carried, body, outputs_hint):
    """A `Loop` node in `ops`' graph over `body` (an `OnnxOps`, its inputs the iteration, the
    condition and `carried`'s `{name: Tensor}`, its outputs `outputs_hint`: the condition, then
    one `Tensor` per carried name); the loop's final carried values `{name: Tensor}`."""
    names = list(carried)
    inputs = [body.iteration, body.condition] + [body.carried[n] for n in names]
    graph = helper.make_graph(
        body.nodes,
        name.replace("/", "_"),
        # Each value's rank (its sizes unknown): ONNX Runtime's fusions (MatMul + Add into Gemm)
        # need to know the ranks of a body's values.
        [_value(v.name, v.dtype, [None] * v.rank) for v in inputs],
        [_value(v.name, v.dtype, [None] * v.rank) for v in outputs_hint],
        body.initializers,
    )
    results = [ops.fresh(f"{name}_{n}") for n in names]
    inputs = [trips.name, condition.name] + [carried[n].name for n in names]
    ops.nodes.append(helper.make_node("Loop", inputs, results, name=ops.fresh(name), body=graph))
    return {n: Tensor(ops, r, carried[n].dtype, carried[n].rank) for n, r in zip(names, results)}


def _hoist_invariants(graph, outer, ops):
    """`graph`'s nodes less those that read only `outer` values (the stage's, the same at every
    step), constants and each other, and depend on an `outer` value (or feed one that does):
    those are appended to `ops` (the enclosing graph, before its `Loop`) with the constants they
    read (moved, or copied under another name where a node left in `graph` reads them too). In
    the fused step: the source mask's int32 form and the
    cross-attentions' query shape, computed once per stage instead of once per step."""
    constants = {init.name: init for init in graph.initializer}
    invariant, staged, hoisted = set(outer), set(outer), []
    for node in graph.node:
        reads = [name for name in node.input if name]
        subgraphs = any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in node.attribute)
        if reads and not subgraphs and all(name in invariant or name in constants for name in reads):
            hoisted.append(node)
            invariant.update(node.output)
            if any(name in staged for name in reads):
                staged.update(node.output)  # computed from the stage's values
    # A node of constants alone stays in the step unless a hoisted node of the stage's values
    # reads it: ONNX Runtime folds it into a constant when it loads the graph, where hoisted its
    # constants would be copied into the stage (the int8 embedding's `Transpose(Qᵀ)`: 1 MB).
    needed = set()
    for node in reversed(hoisted):
        if any(name in staged for name in node.output) or any(name in needed for name in node.output):
            needed.update(node.input)
    hoisted = [node for node in hoisted if any(name in staged or name in needed for name in node.output)]
    kept = [node for node in graph.node if node not in hoisted]
    still_read = {name for node in kept for name in node.input}
    moved = {}
    for name in dict.fromkeys(name for node in hoisted for name in node.input if name in constants):
        moved[name] = f"{name}/stage" if name in still_read else name
        ops.initializers.append(numpy_helper.from_array(numpy_helper.to_array(constants[name]), moved[name]))
    for node in hoisted:
        node.input[:] = [moved.get(name, name) for name in node.input]
        ops.nodes.append(node)
    left = [init for init in graph.initializer if init.name in still_read]
    del graph.initializer[:]
    graph.initializer.extend(left)
    return kept


def _body(prefix, depth, carried):
    """An `OnnxOps` for a `Loop` body with inputs for the iteration, the condition and one per
    value of `carried` `{name: Tensor}` (`body.carried`)."""
    body = OnnxOps(prefix, depth)
    body.iteration = Tensor(body, f"{prefix}iteration", np.int64, 0)
    body.condition = Tensor(body, f"{prefix}condition", np.bool_, 0)
    body.carried = {n: Tensor(body, f"{prefix}in/{n}", v.dtype, v.rank) for n, v in carried.items()}
    return body


# A search stage ends (the finished sentences leave the batch) once at most STAGE_FRACTION of
# the sentences it started with are still searched. 3/4 rather than 1/2: at batch 32 (fused
# kernels, 192 val sentences, AMD EPYC) faster in 9 of 10 interleaved passes (~3%).
STAGE_FRACTION = (3, 4)

# The per-sentence state of the search that a step updates (besides `step`, `last` and the caches).
STEP_STATE = ("alive", "alive_log_probs", "finished", "finished_scores", "finished_log_probs", "done")


def chunk_size(vocab):
    """The vocabulary's chunk for `_top_candidates`: the divisor of `vocab` nearest its square
    root, within a factor 2 of it; None where there is none (one `TopK` over all candidates)."""
    root = np.sqrt(vocab)
    divisors = [c for c in range(2, vocab) if vocab % c == 0 and root / 2 <= c <= 2 * root]
    return min(divisors, key=lambda c: abs(c - root)) if divisors else None


class _ChunkCaps:
    """`policy.constrain`'s caps (`policy.output_cap_rows`: a row per sentence state) laid out
    for `_top_candidates`: one cap per chunk of `chunk` ids (`by_chunk`), and id by id (`by_id`;
    `special_ids` for the chunks of `special`: the range from the first to the last chunk whose
    ids do not all have the same cap in every state, i.e. that hold a special id). A step reads
    them with `index` `(sentences, 1)` int64: `state * chunks` (`chunks = vocab / chunk`; 1, and
    chunks of the whole vocabulary, when `chunk` is None)."""

    def __init__(self, cap_rows, chunk):
        states, vocab = cap_rows.shape
        self.chunk = chunk or vocab
        self.chunks = vocab // self.chunk
        per_chunk = cap_rows.reshape(states, self.chunks, self.chunk)
        uneven = np.flatnonzero(np.any(per_chunk != per_chunk[:, :, :1], axis=(0, 2)))
        first, last = (uneven.min(), uneven.max() + 1) if uneven.size else (0, 0)
        self.special = slice(int(first), int(last))  # the chunks whose ids differ
        # Tables indexed by `state * chunks` (the rows between are not read).
        self.by_id = per_chunk.reshape(states * self.chunks, self.chunk)  # a state's chunk's ids
        self.by_chunk = np.zeros((states * self.chunks, self.chunks), cap_rows.dtype)
        self.by_chunk[:: self.chunks] = per_chunk[:, :, 0]
        self.by_chunk[:: self.chunks, self.special] = 0  # the special chunks: exact from their ids
        self.special_ids = np.zeros(
            (states * self.chunks,) + per_chunk[:, self.special].shape[1:], cap_rows.dtype
        )
        self.special_ids[:: self.chunks] = per_chunk[:, self.special]


def _top_candidates(ops, log_probs, alive_log_probs, beam, caps, index, sentence_chunks):
    """The best `beam` of each sentence's `beam * vocab` candidates `alive_log_probs +
    constrain(log_probs)`, in ONNX `TopK`'s order (value descending, ties to the lower index):
    their values `(sentences, beam)` float and flat indices `b * vocab + token` `(sentences,
    beam)` int64.

    `log_probs` `(sentences * beam, vocab)` before the output rules, `alive_log_probs`
    `(sentences, beam)`; `caps` a `_ChunkCaps` and `index` `(sentences, 1)` each sentence's
    row of its tables; `sentence_chunks` `(sentences, 1)`: each sentence's first chunk (`beam
    * chunks` per sentence).

    One `TopK` over `beam * vocab` candidates is a scalar pass (ONNX Runtime's heap, one thread
    per row: ~0.45 ms at 32 sentences of beam 4 over 8,000 ids, timed ad hoc on the 2-core AMD
    EPYC), and the caps' `Min` over them another (one thread, ~0.2 ms). Instead, by chunks of
    `c` consecutive ids: each chunk's best candidate is `alive + max(capped log_probs of the
    chunk)` exactly (adding a float is monotone, so it commutes with the max); a chunk without a
    special id has one cap for all its ids (0 or `NEG_INF`, and a log-probability is at most 0),
    so its capped max is `min(max, cap)`, and only the special chunks are capped id by id. The
    `beam` best chunks (ties to the lower chunk) hold the `beam` best candidates (each chunk
    ranked above a candidate's chunk holds a candidate ranked above it); taken in index order
    and capped id by id, their `beam * c` candidates give `TopK` the same values and the same
    order among ties as the whole row."""
    expanded = ops.unsqueeze(alive_log_probs, [2])
    top = ops.const([beam], np.int64)
    chunk, chunks = caps.chunk, caps.chunks
    if chunks == 1:  # no chunks: the whole row capped, one `TopK`
        capped = ops.minimum(
            ops.reshape(log_probs, (-1, beam, chunk)), ops.take(ops.const(caps.by_id), index)
        )
        candidates = ops.reshape(ops._arith("Add", expanded, capped), (-1, beam * chunk))
        return ops.node("TopK", [candidates, top], (np.float32, np.int64), (2, 2), outputs=2, axis=-1)
    by_chunk = ops.reshape(log_probs, (-1, beam, chunks, chunk))
    maxima = ops.max(by_chunk, axis=3)  # (sentences, beam, chunks), before the caps
    special = caps.special
    first, last = special.start, special.stop
    bounds = [ops.const([first], np.int64), ops.const([last], np.int64), ops.const([2], np.int64)]
    special_ids = ops.node("Slice", [by_chunk, *bounds], np.float32, 4)
    special_ids = ops.minimum(special_ids, ops.take(ops.const(caps.special_ids), index))
    special_maxima = ops.node("ReduceMax", [special_ids], np.float32, 3, axes=[3], keepdims=0)
    pads = ops.const([0, 0, first, 0, 0, chunks - last], np.int64)
    special_maxima = ops.node("Pad", [special_maxima, pads, ops.const(np.float32(np.inf))], np.float32, 3)
    maxima = ops.node(
        "Min", [maxima, ops.take(ops.const(caps.by_chunk), index), special_maxima], np.float32, 3
    )
    chunk_scores = ops.reshape(ops._arith("Add", expanded, maxima), (-1, beam * chunks))
    _, best = ops.node("TopK", [chunk_scores, top], (np.float32, np.int64), (2, 2), outputs=2, axis=-1)
    best, _ = ops.node(
        "TopK", [best, top], (np.int64, np.int64), (2, 2), outputs=2, axis=-1, largest=0
    )  # in index order
    rows = ops._arith("Add", best, sentence_chunks)
    values = ops.rows(ops.reshape(log_probs, (-1, chunk)), rows)  # (sentences, beam, chunk)
    id_caps = ops.take(
        ops.const(caps.by_id), ops._arith("Add", index, ops._arith("Mod", best, np.int64(chunks)))
    )
    values = ops.minimum(values, id_caps)
    origin = ops._arith("Div", best, np.int64(chunks))  # each chunk's beam
    alive = ops.node("GatherElements", [alive_log_probs, origin], np.float32, 2, axis=1)
    alive = ops.unsqueeze(alive, [2])
    candidates = ops.reshape(ops._arith("Add", alive, values), (-1, beam * chunk))
    top_values, position = ops.node(
        "TopK", [candidates, top], (np.float32, np.int64), (2, 2), outputs=2, axis=-1
    )
    which = ops.node(
        "GatherElements", [best, ops._arith("Div", position, np.int64(chunk))], np.int64, 2, axis=1
    )
    offset = ops.node("Mod", [position, ops.const(chunk, np.int64)], np.int64, 2)
    return top_values, ops._arith("Add", ops._arith("Mul", which, np.int64(chunk)), offset)


def lean_translate_graph(encoder, decoder_step, config, decoding, blank, never):
    """`translate_lean.onnx` (module docstring) from the exported `encoder` and `decoder_step`
    ONNX models, the model's `config` and the export's `decoding` options (`export.json`'s), and
    `blank` `(vocab,)` bool (`policy.blank_ids`); `never` `(vocab,)` bool, the ids never output
    (`policy.never_output_ids`)."""
    beam, vocab = decoding["beam_size"], config["target_vocab_size"] or config["vocab_size"]
    pad, bos, eos = config["pad_id"], config["bos_id"], config["eos_id"]
    layers = cache_layers(config)
    heads, depth = config["num_heads"], config["d_model"] // config["num_heads"]
    caches = [f"past_{kind}_{i}" for kind in ("key", "value") for i in range(layers)]
    crosses = [f"cross_{kind}_{i}" for kind in ("key", "value") for i in range(layers)]
    neg_inf = np.float32(policy.NEG_INF)

    main = OnnxOps("lean/")
    source = Tensor(main, "source_ids", np.int32, 2)
    options = {name: Tensor(main, name, dtype, 0) for name, dtype in OPTION_INPUTS.items()}
    alpha, min_length = options["length_penalty"], options["min_length"]

    # The encoder, once.
    encoder_graph = prefixed_graph(encoder.graph, "enc/", {"source_ids": "source_ids"})
    main.nodes.extend(encoder_graph.node)
    main.initializers.extend(encoder_graph.initializer)
    encoded = {v.name: Tensor(main, f"enc/{v.name}", np.float32, 4) for v in encoder.graph.output}
    encoded["memory_mask"] = Tensor(main, "enc/memory_mask", np.bool_, 3)

    # Set-up: the output limits (policy.output_limits), the empty sources, the initial state.
    batch = main.node("Shape", [source], np.int64, 1, start=0, end=1)
    width = main.node("Shape", [source], np.int64, 1, start=1, end=2)
    not_pad = main.logical_not(main.equal(source, np.int32(pad)))
    lengths = main.reduce("ReduceSum", main.cast(not_pad, np.int32), [1])
    extra = options["max_extra_length"]
    limits = policy.output_limits(lengths, config["max_length"], main, extra)  # (batch,) int32
    max_len = policy.output_limits(main.cast(width, np.int32), config["max_length"], main, extra)  # (1,)
    max_len64 = main.cast(max_len, np.int64)
    trips = main.squeeze(max_len64, [0])
    empty = policy.empty_sources(source, np.asarray(blank, bool), main)  # (batch,)
    positions = main.arange(max_len, np.int64)  # int64, as the step it is compared with
    # Per step (tokens decoded before it): the tokens after it, and their length penalty.
    steps_after = main.cast(positions + np.int64(1), np.float32)  # (max_len,)
    step_penalties = policy.length_penalty(steps_after, alpha)
    row_shape = main.concat([main.const([-1], np.int64), max_len64], axis=0)  # (-1, max_len)

    def filled(ops, shape, value, dtype, rank):
        tensor = numpy_helper.from_array(np.array([value], dtype))
        return ops.node("ConstantOfShape", [shape], dtype, rank, value=tensor)

    rows = batch * np.int64(beam)
    pool_shape = main.concat([batch, main.const([beam], np.int64), max_len64], axis=0)
    beam_shape = main.concat([batch, main.const([beam], np.int64)], axis=0)
    first_only = main.const([[0.0] + [neg_inf] * (beam - 1)], np.float32)
    ones = main.const([1], np.int64)
    state = {
        "step": main.const(0, np.int64),
        "sentences": main.arange(batch, np.int64),
        "limits": limits,
        **{name: encoded[name] for name in ["memory_mask", *crosses]},
        "last": filled(main, rows, bos, np.int32, 1),
        "alive": filled(main, pool_shape, pad, np.int32, 3),
        "alive_log_probs": main.node("Tile", [first_only, main.concat([batch, ones], 0)], np.float32, 2),
        "finished": filled(main, pool_shape, pad, np.int32, 3),
        "finished_scores": filled(main, beam_shape, neg_inf, np.float32, 2),
        "finished_log_probs": filled(main, beam_shape, neg_inf, np.float32, 2),
        "done": empty,
    }
    cache_shape = main.concat([rows, main.const([heads, 0, depth], np.int64)], axis=0)
    for name in caches:
        state[name] = filled(main, cache_shape, 0.0, np.float32, 4)
    state["results"] = state["finished"]
    state["result_scores"] = state["finished_scores"]
    state["result_log_probs"] = state["finished_log_probs"]
    searching = main.less(main.reduce("ReduceMin", main.cast(empty, np.int32)), np.int32(1))

    # The stages: the sentences still searched form the batch; their steps run until at most
    # STAGE_FRACTION of them are left.
    stage = _body("lean/stage/", 1, state)
    now = dict(stage.carried)
    sentence_keys = ["sentences", "limits", "memory_mask", *crosses, *STEP_STATE]
    results = ("results", "result_scores", "result_log_probs")
    where = stage.unsqueeze(now["sentences"], [1])  # every sentence's pool into the results
    for result, key in zip(results, ("finished", "finished_scores", "finished_log_probs")):
        now[result] = stage.node("ScatterND", [now[result], where, now[key]], now[key].dtype, now[key].rank)
    live = stage.node("NonZero", [stage.logical_not(now["done"])], np.int64, 2)
    live = stage.reshape(live, (-1,))  # (live,) the sentences still searched
    for key in sentence_keys:
        now[key] = stage.rows(now[key], live)
    size = stage.node("Shape", [live], np.int64, 1)
    beams = stage.const(np.arange(beam), np.int64)
    live_rows = stage.reshape(stage.unsqueeze(live, [1]) * np.int64(beam) + beams, (-1,))
    for key in ["last", *caches]:
        now[key] = stage.rows(now[key], live_rows)
    numerator, denominator = STAGE_FRACTION
    enough = stage.squeeze(stage._arith("Div", size * np.int64(numerator), np.int64(denominator)), [0])
    most_final = stage.squeeze(size, [0]) - enough
    beam_rows = stage.unsqueeze(stage.arange(size, np.int64), [1])
    pool_rows = beam_rows * np.int64(2 * beam)
    ids = np.arange(vocab)
    never = np.asarray(never, bool)
    chunk_caps = _ChunkCaps(policy.output_cap_rows(never, ids == eos, 2, np.float32), chunk_size(vocab))
    sentence_chunks = beam_rows * np.int64(beam * chunk_caps.chunks)
    beam_rows = beam_rows * np.int64(beam)
    stage_pool_shape = stage.concat([size, stage.const([beam], np.int64), max_len64], axis=0)
    stage_limits = now["limits"]
    stage_limits_float = stage.cast(stage_limits, np.float32)
    # Each sentence's row of the output caps at each step (max_len, sentences), once a stage.
    steps_column = stage.unsqueeze(positions, [1])
    states_by_step = policy.output_cap_row(steps_column, stage_limits, min_length, stage)
    # ... as the row index of `chunk_caps`' tables, `state * chunks` (max_len, sentences, 1).
    cap_index_by_step = stage.unsqueeze(
        stage.cast(states_by_step, np.int64) * np.int64(chunk_caps.chunks), [2]
    )

    # One step of every searched sentence's beam.
    step_state = {key: now[key] for key in ["step", "last", *STEP_STATE, *caches]}
    body = _body("lean/step/", 2, step_state)
    carried = body.carried
    step64 = carried["step"]
    next_step = body.take(steps_after, step64)  # float: tokens after this step
    decoder_inputs = {"token_ids": carried["last"].name, "memory_mask": now["memory_mask"].name}
    decoder_inputs.update({name: carried[name].name for name in caches})
    decoder_inputs.update({name: now[name].name for name in crosses})
    decoder_graph = prefixed_graph(decoder_step.graph, "dec/", decoder_inputs)
    stage_values = {now["memory_mask"].name, *(now[name].name for name in crosses)}
    body.nodes.extend(_hoist_invariants(decoder_graph, stage_values, stage))
    body.initializers.extend(decoder_graph.initializer)
    # policy.constrain: each sentence's row of the caps' tables (`_ChunkCaps`), from the stage's
    # table of rows per step.
    top_log_probs, top_index = _top_candidates(
        body,
        Tensor(body, "dec/log_probs", np.float32, 2),
        carried["alive_log_probs"],
        beam,
        chunk_caps,
        body.take(cap_index_by_step, step64, axis=0),
        sentence_chunks,
    )
    origin = body._arith("Div", top_index, np.int64(vocab))  # which live hypothesis each extends
    tokens = body.cast(body.node("Mod", [top_index, body.const(vocab, np.int64)], np.int64, 2), np.int32)
    origin_rows = body.reshape(body._arith("Add", beam_rows, origin), (-1,))  # (sentences * beam,)
    alive = body.rows(body.node("Reshape", [carried["alive"], row_shape], np.int32, 2), origin_rows)
    alive = body.node("Reshape", [alive, stage_pool_shape], np.int32, 3)
    alive = body.where(body.equal(positions, step64), body.unsqueeze(tokens, [2]), alive)
    is_eos = body.equal(tokens, np.int32(eos))
    # Candidates ending in EOS join the pool of finished hypotheses. A sentence already final
    # keeps its pool (in the Keras search it has left the batch): its candidates are impossible,
    # and `TopK` ranks the pool's own entries first among equals.
    was_done = carried["done"]
    searched = body.unsqueeze(body.logical_not(was_done), [1])
    eos_log_probs = body.where(body.logical_and(is_eos, searched), top_log_probs, neg_inf)
    penalized = eos_log_probs / body.take(step_penalties, step64)
    pool_scores = body.concat([carried["finished_scores"], penalized], axis=1)
    pool_log_probs = body.concat([carried["finished_log_probs"], eos_log_probs], axis=1)
    pool = body.concat([carried["finished"], alive], axis=1)
    finished_scores, keep = body.node(
        "TopK",
        [pool_scores, body.const([beam], np.int64)],
        (np.float32, np.int64),
        (2, 2),
        outputs=2,
        axis=-1,
    )
    keep_rows = body.reshape(body._arith("Add", pool_rows, keep), (-1,))
    finished = body.rows(body.node("Reshape", [pool, row_shape], np.int32, 2), keep_rows)
    # The others stay live; a slot whose candidate finished is dead this step.
    alive_log_probs = body.where(is_eos, neg_inf, top_log_probs)
    final = policy.search_is_final(
        next_step, stage_limits_float, alive_log_probs, finished_scores, alpha, body,
        options["early_stopping"],
    )  # fmt: skip
    new = {
        "step": step64 + np.int64(1),
        "last": body.reshape(tokens, (-1,)),
        "alive": alive,
        "alive_log_probs": alive_log_probs,
        "finished": body.node("Reshape", [finished, stage_pool_shape], np.int32, 3),
        "finished_scores": finished_scores,
        "finished_log_probs": body.node("GatherElements", [pool_log_probs, keep], np.float32, 2, axis=1),
        "done": body.logical_or(was_done, final),
    }
    for past in caches:  # the beams reordered: one gather per cache tensor
        new[past] = body.rows(
            Tensor(body, f"dec/{past.replace('past_', 'present_')}", np.float32, 4), origin_rows
        )
    # More than `enough` still searched: fewer than `size - enough` final.
    final_now = body.reduce("ReduceSum", body.cast(new["done"], np.int64))
    more = body.less(final_now, most_final)
    steps_left = stage.squeeze(max_len64, [0]) - now["step"]
    outputs = [more] + [new[k] for k in step_state]
    stepped = _loop(stage, "lean/steps", steps_left, stage.const(True, np.bool_), step_state, body, outputs)
    now.update(stepped)
    left = stage.reduce("ReduceMin", stage.cast(now["done"], np.int32))
    again = stage.logical_and(
        stage.less(left, np.int32(1)), stage.less(now["step"], stage.squeeze(max_len64, [0]))
    )
    staged = _loop(main, "lean/stages", trips, searching, state, stage, [again] + [now[k] for k in state])

    # The sentences still searched when the loop ended (at max_len) write their pools too.
    where = main.unsqueeze(staged["sentences"], [1])
    pools = [
        main.node("ScatterND", [staged[result], where, staged[key]], staged[key].dtype, staged[key].rank)
        for result, key in zip(results, ("finished", "finished_scores", "finished_log_probs"))
    ]
    # An empty source: EOS alone, score 0 (policy.empty_sources).
    eos_alone = main.where(main.equal(positions, np.int64(0)), np.int32(eos), np.int32(pad))  # (max_len,)
    nbest_ids = main.where(main.unsqueeze(empty, [1, 2]), eos_alone, pools[0])
    nbest_scores = main.where(main.unsqueeze(empty, [1]), np.float32(0), pools[1])
    nbest_log_probs = main.where(main.unsqueeze(empty, [1]), np.float32(0), pools[2])
    first = main.const(0, np.int64)
    graph_outputs = {
        "target_ids": main.take(nbest_ids, first, axis=1),
        "scores": main.take(nbest_scores, first, axis=1),
        "nbest_ids": nbest_ids,
        "nbest_scores": nbest_scores,
        "nbest_log_probs": nbest_log_probs,
    }
    for name, value in graph_outputs.items():
        main.nodes.append(helper.make_node("Identity", [value.name], [name], name=f"lean/{name}"))
    defaults = [  # an option newer than the export: its default
        numpy_helper.from_array(np.array(decoding.get(n, getattr(CONTROLS_OFF, n)), dtype), n)
        for n, dtype in OPTION_INPUTS.items()
    ]
    graph = helper.make_graph(
        main.nodes,
        "translate_lean",
        [_value("source_ids", np.int32, ["batch", "source_length"])]
        + [_value(name, dtype, []) for name, dtype in OPTION_INPUTS.items()],
        [_value(name, value.dtype, OUTPUT_SHAPES[name]) for name, value in graph_outputs.items()],
        main.initializers + defaults,
    )
    model = helper.make_model(graph, opset_imports=list(decoder_step.opset_import))
    model.ir_version = decoder_step.ir_version
    model.doc_string = "keras-transformer translate_lean: the plain beam search, hand-built (lean_search.py)"
    return model


def write_lean_graph(export_dir):
    """Writes `translate_lean.onnx` into an ONNX export directory from its `encoder.onnx`,
    `decoder_step.onnx`, `export.json` and `tokenizer.model` (for a directory whose step
    graphs were rewritten after the export, e.g. with fused kernels); returns its path."""
    import json
    import os

    import onnx
    import sentencepiece

    with open(os.path.join(export_dir, "export.json"), encoding="utf-8") as handle:
        metadata = json.load(handle)
    processor = sentencepiece.SentencePieceProcessor(model_file=os.path.join(export_dir, "tokenizer.model"))
    config = metadata["model"]
    pieces, count = processor.id_to_piece, processor.get_piece_size()
    specials = [config[name] for name in policy.NEVER_OUTPUT]
    model = lean_translate_graph(
        *(onnx.load(os.path.join(export_dir, f"{stem}.onnx")) for stem in ("encoder", "decoder_step")),
        config, metadata["decoding"], policy.blank_ids(pieces, count),
        policy.never_output_ids(pieces, count, specials, config["target_vocab_size"] or config["vocab_size"]),
    )  # fmt: skip
    path = os.path.join(export_dir, f"{LEAN_GRAPH}.onnx")
    onnx.save(model, path)
    return path


def step_body(model):
    """The `Loop` body of one search step in a `translate_lean.onnx` model (inside the stages'
    `Loop`): its node count is the graph's nodes per step."""
    stages = next(node for node in model.graph.node if node.op_type == "Loop")
    stage = next(a.g for a in stages.attribute if a.name == "body")
    steps = next(node for node in stage.node if node.op_type == "Loop")
    return next(a.g for a in steps.attribute if a.name == "body")
