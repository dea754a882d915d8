"""Greedy and beam search (§6.1) over a `Transformer`, as graph loops.

Shape legend: batch = sentences, beam = beam_size, len_src = source positions,
max_len = decoding steps (= output tokens, EOS included), vocab.

Both searches are one loop (`keras.ops.while_loop`, or `tf.while_loop` with
relaxed shape invariants where shapes change), so they run eagerly, inside
`tf.function` (also `jit_compile=True`) and in exported graphs. With
`use_cache=True` (the default) the decoder runs one position per step
against a key/value cache (`Transformer.init_cache` / `decode_step`), under
one of two policies (`cache_policy`, see `keras_transformer.layers.
decoding_cache`):
- `"growing"`: the self-attention cache grows by one position per step, and
  a sentence whose beam search is final leaves the batch (its rows are
  dropped from every loop tensor; its result is kept in input order). The
  default on TensorFlow (without XLA) and PyTorch.
- `"fixed"`: preallocated `max_len` positions, every sentence stays until
  the last one is done: static shapes, for XLA (`jit_compile=True`) and JAX,
  where it is the default.
Both give the same tokens. With `use_cache=False` the decoder re-runs over
the whole prefix every step (as the TensorFlow tutorial does; for
benchmarks, not XLA).

Output length: each sentence may produce `min(source_length + max_extra_length,
model max_length)` tokens, EOS included (§6.1: "input length + 50"); at the
last allowed step EOS is forced, so every output ends with EOS. Tokens after
EOS are `pad_id`.

On PyTorch the searches run under `torch.no_grad()`: decoding is inference,
so no autograd graph is kept per step and the results are plain tensors.
"""

import contextlib
import functools
from typing import NamedTuple

import keras
import numpy as np
from keras import ops

from keras_transformer.decoding.policy import (
    BEAM_SIZE,
    CACHE_POLICIES,
    LENGTH_PENALTY,
    MAX_EXTRA_LENGTH,
    NEG_INF,
    NEVER_OUTPUT,
    length_penalty,
    output_limits,
    search_is_final,
)
from keras_transformer.layers.dropout import in_xla_computation
from keras_transformer.layers.masks import padding_mask
from keras_transformer.layers.portable_ops import gather_rows, write_at
from keras_transformer.utils.checks import check_positive_int


def _inference(search):
    """Runs `search` without recording gradients where the backend records them eagerly (PyTorch)."""

    @functools.wraps(search)
    def run(*args, **kwargs):
        with _no_gradients():
            return search(*args, **kwargs)

    return run


def resolve_cache_policy(cache_policy):
    """`"growing"` or `"fixed"` for `cache_policy` (`"auto"`: fixed on JAX and under XLA)."""
    if cache_policy not in CACHE_POLICIES:
        raise ValueError(f"cache_policy must be one of {CACHE_POLICIES}; got {cache_policy!r}.")
    static_shapes = keras.backend.backend() == "jax" or (
        keras.backend.backend() == "tensorflow" and in_xla_computation()
    )
    if cache_policy == "growing" and static_shapes:
        raise ValueError(
            'cache_policy="growing" changes tensor shapes every step, which XLA and JAX cannot '
            'compile; use cache_policy="fixed" (or "auto").'
        )
    if cache_policy == "auto":
        return "fixed" if static_shapes else "growing"
    return cache_policy


def _while_loop(cond, body, loop_vars, shapes_change):
    """`keras.ops.while_loop(cond, body, loop_vars)` (a tuple), also where the loop tensors'
    shapes change from one iteration to the next (`shapes_change`: a growing cache, a
    shrinking batch): then `tf.while_loop` with every dimension relaxed on TensorFlow, a
    Python loop on PyTorch."""
    if not shapes_change:
        return ops.while_loop(cond, body, loop_vars)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        loop_vars = tf.nest.map_structure(tf.convert_to_tensor, tuple(loop_vars))
        invariants = tf.nest.map_structure(_changing_shape, loop_vars)
        return tf.while_loop(cond, lambda *v: tuple(body(*v)), loop_vars, shape_invariants=invariants)
    loop_vars = tuple(loop_vars)
    while bool(ops.convert_to_numpy(cond(*loop_vars))):
        loop_vars = tuple(body(*loop_vars))
    return loop_vars


def _changing_shape(tensor):
    """The shape invariant of a loop tensor whose shape changes: its first axis (the batch,
    which shrinks) and, for rank 4, its third (the position axis of a heads-first cache, which
    grows) are relaxed; the other dimensions stay known, so the step's shape arithmetic folds."""
    import tensorflow as tf

    dims = tensor.shape.as_list()
    return tf.TensorShape(
        [None if axis == 0 or (len(dims) == 4 and axis == 2) else d for axis, d in enumerate(dims)]
    )


def _no_gradients():
    if keras.backend.backend() == "torch":
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


class Translations(NamedTuple):
    """Decoded hypotheses.

    ids: int32 `(batch, max_len)`, or `(batch, num_return, max_len)` when
        `num_return > 1`; EOS-terminated, padded after EOS.
    scores: float32 `(batch,)` / `(batch, num_return)`: log-probability divided
        by the GNMT length penalty ((5 + length) / 6) ** alpha (greedy: alpha 0).
    log_probs: float32, same shape: the raw log-probability of each output.
    """

    ids: object
    scores: object
    log_probs: object


@_inference
def greedy_search(
    model,
    source_ids,
    max_length=None,
    max_extra_length=MAX_EXTRA_LENGTH,
    min_length=0,
    use_cache=True,
    cache_policy="auto",
):
    """Picks the most probable token at every step.

    Args:
        model: a `Transformer`.
        source_ids: int `(batch, len_src)`, padded with `pad_id`.
        max_length: if given, every sentence may produce up to this many tokens
            (capped by the model's `max_length`) instead of
            `source_length + max_extra_length`.
        max_extra_length: see the module docstring.
        min_length: EOS is not allowed before this many tokens (EOS
            included), unless the length limit forces it.
        use_cache: incremental decoding with the key/value cache.
        cache_policy: `"auto"`, `"growing"` or `"fixed"` (module docstring).

    Returns:
        `Translations` with ids `(batch, max_len)` and scores `(batch,)`.
    """
    setup = _Setup(model, source_ids, max_length, max_extra_length, min_length)
    decoder = _make_decoder(model, setup, 1, use_cache, cache_policy)
    batch, config = setup.batch, model.config
    tokens = ops.full((batch, setup.max_len), config.pad_id, "int32")
    state = (
        ops.zeros((), "int32"),
        tokens,
        ops.full((batch,), config.bos_id, "int32"),
        ops.zeros((batch,), "float32"),
        ops.zeros((batch,), "bool"),
        decoder.initial_state(),
    )

    def cond(step, tokens, last, log_probs, finished, decoder_state):
        return ops.logical_and(step < setup.max_len, ops.logical_not(ops.all(finished)))

    def body(step, tokens, last, log_probs, finished, decoder_state):
        logits, decoder_state = decoder.step(last, tokens, step, decoder_state)
        step_log_probs = setup.constrain(ops.log_softmax(logits, axis=-1), step)  # (batch, vocab)
        next_tokens = ops.cast(ops.argmax(step_log_probs, axis=-1), "int32")
        next_log_probs = ops.take_along_axis(step_log_probs, next_tokens[:, None], axis=-1)[:, 0]
        next_tokens = ops.where(finished, config.pad_id, next_tokens)
        log_probs = log_probs + ops.where(finished, 0.0, next_log_probs)
        tokens = write_at(tokens, next_tokens[:, None], step)
        finished = ops.logical_or(finished, ops.equal(next_tokens, config.eos_id))
        return step + 1, tokens, next_tokens, log_probs, finished, decoder_state

    _, tokens, _, log_probs, _, _ = _while_loop(cond, body, state, decoder.grows)
    return Translations(tokens, log_probs, log_probs)


@_inference
def beam_search(
    model,
    source_ids,
    beam_size=BEAM_SIZE,
    length_penalty=LENGTH_PENALTY,
    max_extra_length=MAX_EXTRA_LENGTH,
    num_return=1,
    max_length=None,
    min_length=0,
    use_cache=True,
    cache_policy="auto",
):
    """Beam search with the GNMT length penalty and a pool of finished hypotheses (§6.1).

    Every step expands the live hypotheses of each sentence and keeps the
    `beam_size` best of the `beam_size * vocab` candidates; those ending in
    EOS move to the sentence's pool of finished hypotheses (the best
    `beam_size` by penalized score), the others stay live. A sentence is done
    when no live hypothesis can still beat the worst one in a full pool (or
    at its maximum length); the loop stops when all are. `beam_size=1` with
    `length_penalty=0` gives exactly `greedy_search`'s tokens.

    Args:
        model: a `Transformer`.
        source_ids: int `(batch, len_src)`, padded with `pad_id`.
        beam_size: hypotheses kept per sentence (4 in the paper).
        length_penalty: alpha of ((5 + |Y|) / 6) ** alpha (0.6 in the paper).
        max_extra_length: output length limit = source length + this (50).
        num_return: how many hypotheses per sentence to return (n-best).
        max_length: optional fixed output length limit instead.
        min_length: EOS is not allowed before this many tokens (EOS
            included), unless the length limit forces it.
        use_cache: incremental decoding with the key/value cache.
        cache_policy: `"auto"`, `"growing"` (finished sentences also leave
            the batch) or `"fixed"` (module docstring).

    Returns:
        `Translations`, best first; ids `(batch, max_len)` for `num_return=1`,
        else `(batch, num_return, max_len)`.
    """
    check_positive_int("beam_size", beam_size)
    check_positive_int("num_return", num_return)
    if num_return > beam_size:
        raise ValueError(f"num_return={num_return} must be <= beam_size={beam_size}.")
    if not length_penalty >= 0:
        raise ValueError(f"length_penalty must be a number >= 0; got {length_penalty!r}.")
    setup = _Setup(model, source_ids, max_length, max_extra_length, min_length)
    decoder = _make_decoder(model, setup, beam_size, use_cache, cache_policy)
    search = _BeamSearch(model, setup, decoder, beam_size, length_penalty)
    ids, scores, log_probs = search.run()
    if num_return == 1:
        return Translations(ids[:, 0], scores[:, 0], log_probs[:, 0])
    return Translations(ids[:, :num_return], scores[:, :num_return], log_probs[:, :num_return])


class _Setup:
    """Encodes the source once and works out the output length limits."""

    def __init__(self, model, source_ids, max_length, max_extra_length, min_length):
        for name, value in (("max_extra_length", max_extra_length), ("min_length", min_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0; got {value!r}.")
        self.min_length = min_length
        if max_length is not None:
            check_positive_int("max_length", max_length)
        config = model.config
        self.config = config
        self.source_ids = ops.cast(ops.convert_to_tensor(source_ids), "int32")
        if len(self.source_ids.shape) != 2:
            raise ValueError(f"source_ids must have shape (batch, length); got {self.source_ids.shape}.")
        self.batch = ops.shape(self.source_ids)[0]
        self.memory_mask = padding_mask(self.source_ids, config.pad_id)  # (batch, 1, len_src)
        self.memory = model.encode(self.source_ids, training=False)  # (batch, len_src, d_model)
        if max_length is None:  # (batch,) tokens incl. EOS
            lengths = ops.sum(ops.cast(ops.not_equal(self.source_ids, config.pad_id), "int32"), axis=1)
            self.limits = output_limits(lengths, config.max_length, ops, max_extra_length)
            source_length = self.source_ids.shape[1]
            if source_length is None:  # unknown until run time (exported graphs)
                source_length = ops.shape(self.source_ids)[1]
                self.max_len = output_limits(source_length, config.max_length, ops, max_extra_length)
            else:  # a Python int: static shapes for XLA
                self.max_len = int(output_limits(source_length, config.max_length, np, max_extra_length))
        else:
            self.limits = ops.full((self.batch,), min(max_length, config.max_length), "int32")
            self.max_len = min(max_length, config.max_length)
        ids = ops.arange(config.target_vocab)
        self.is_eos = ops.equal(ids, config.eos_id)  # (vocab,)
        self.not_eos = ops.logical_not(self.is_eos)
        never = [ops.equal(ids, getattr(config, name)) for name in NEVER_OUTPUT]  # policy.NEVER_OUTPUT
        self.never = functools.reduce(ops.logical_or, never)

    def constrain(self, log_probs, step, limits=None):
        """Applies the output rules to one step's log-probabilities.

        Pad and BOS are impossible; EOS is impossible before `min_length`
        tokens, and the only possibility at a sentence's last allowed step.
        The other log-probabilities are not renormalized (as fairseq does).
        log_probs: `(batch, vocab)` or `(batch, beam, vocab)`; `limits`
        `(batch,)`, default every sentence's (`self.limits`).
        """
        limits = self.limits if limits is None else limits
        last = ops.greater_equal(step, limits - 1)  # (batch,)
        last = ops.reshape(last, (-1,) + (1,) * (len(log_probs.shape) - 1))
        log_probs = ops.where(self.never, NEG_INF, log_probs)
        if self.min_length > 1:
            too_early = ops.logical_and(self.is_eos, step < self.min_length - 1)
            log_probs = ops.where(too_early, NEG_INF, log_probs)
        return ops.where(ops.logical_and(last, self.not_eos), NEG_INF, log_probs)


def _take_per_sentence(tensor, index):
    """`out[s, j] = tensor[s, index[s, j]]`: `(sentences, k, ...)` from `tensor` `(sentences, n, ...)`
    and int `index` `(sentences, k)`.

    `take_along_axis` with the same result, but as one row gather over the
    flattened `(sentences * n, ...)`: `take_along_axis` broadcasts its index
    and exports as ~25 ONNX nodes (shape arithmetic, `Expand`, `GatherND`)
    per call, three calls per beam-search step.
    """
    n, k = ops.shape(tensor)[1], ops.shape(index)[1]
    trailing = tuple(ops.shape(tensor)[2:])
    rows = ops.arange(ops.shape(index)[0], dtype="int32")[:, None] * n + ops.cast(index, "int32")
    taken = gather_rows(ops.reshape(tensor, (-1, *trailing)), ops.reshape(rows, (-1,)))
    return ops.reshape(taken, (-1, k, *trailing))


def _repeat(tensor, times):
    """`(batch, ...)` -> `(batch * times, ...)`, each row repeated `times` times in a row."""
    return tensor if times == 1 else ops.repeat(tensor, times, axis=0)


def _make_decoder(model, setup, beam_size, use_cache, cache_policy):
    if not use_cache:
        resolve_cache_policy(cache_policy)  # checks the argument
        return _PrefixDecoder(model, setup, beam_size)
    return _CachedDecoder(model, setup, beam_size, resolve_cache_policy(cache_policy))


class _CachedDecoder:
    """One position per step. State: `(DecodingCache, memory_mask (sentences, 1, len_src))`;
    the self-attention cache has a row per beam, the cross-attention one a row per sentence."""

    def __init__(self, model, setup, beam_size, policy):
        self.model, self.setup, self.beam_size, self.policy = model, setup, beam_size, policy
        self.grows = policy == "growing"  # shapes change; finished sentences leave the batch

    def initial_state(self):
        max_length = None if self.grows else self.setup.max_len
        return self.model.init_cache(self.setup.memory, max_length, self.beam_size), self.setup.memory_mask

    def step(self, last_tokens, prefix, step, state):
        cache, memory_mask = state
        logits, cache = self.model.decode_step(
            last_tokens, None if self.policy == "growing" else step, cache, memory_mask
        )
        return logits, (cache, memory_mask)

    @staticmethod
    def reorder(state, flat_beam_index):
        """Gathers the self-attention caches by beam origin `(rows,)` (one gather per tensor)."""
        cache, memory_mask = state
        return cache.reorder(flat_beam_index), memory_mask

    @staticmethod
    def select_sentences(state, indices):
        """Keeps the sentences `indices` of the per-sentence tensors."""
        cache, memory_mask = state
        return cache.select_sentences(indices), gather_rows(memory_mask, indices)


class _PrefixDecoder:
    """No cache: re-runs the decoder over BOS + the whole prefix every step."""

    grows = False

    def __init__(self, model, setup, beam_size):
        self.model, self.setup, self.beam_size = model, setup, beam_size
        self.memory = _repeat(setup.memory, beam_size)
        self.memory_mask = _repeat(setup.memory_mask, beam_size)

    def initial_state(self):
        return ops.zeros((), "int32")  # nothing to carry

    def step(self, last_tokens, prefix, step, state):
        prefix = ops.reshape(prefix, (-1, ops.shape(prefix)[-1]))  # (batch * beam, max_len)
        bos = ops.full((ops.shape(prefix)[0], 1), self.model.config.bos_id, "int32")
        inputs = ops.concatenate([bos, prefix[:, :step]], axis=1)  # (batch * beam, step + 1)
        hidden = self.model.decoder_output(inputs, self.memory, self.memory_mask, training=False)
        logits = self.model.project(hidden)
        return logits[:, -1], state

    @staticmethod
    def reorder(state, flat_beam_index):
        return state


class _BeamSearch:
    """The beam-search loop; state tensors are `(sentences, beam, ...)` for the sentences still
    in the loop (all of them unless the decoder `grows`)."""

    # Per-sentence state, dropped together when sentences leave the batch.
    SENTENCE_KEYS = (
        "sentences", "limits", "alive", "alive_log_probs", "finished", "finished_scores",
        "finished_log_probs", "done",
    )  # fmt: skip

    def __init__(self, model, setup, decoder, beam_size, length_penalty):
        self.config, self.setup, self.decoder = model.config, setup, decoder
        self.beam_size, self.alpha = beam_size, float(length_penalty)

    def penalty(self, length):
        """`policy.length_penalty` of an int length."""
        return length_penalty(ops.cast(length, "float32"), self.alpha)

    def run(self):
        batch, beam, config = self.setup.batch, self.beam_size, self.config
        sequences = ops.full((batch, beam, self.setup.max_len), config.pad_id, "int32")
        only_first = ops.concatenate([ops.zeros((1,)), ops.full((beam - 1,), NEG_INF)], axis=0)
        no_scores = ops.full((batch, beam), NEG_INF)
        state = dict(
            step=ops.zeros((), "int32"),
            sentences=ops.arange(batch, dtype="int32"),  # input index of each sentence in the loop
            limits=self.setup.limits,
            alive=sequences,
            alive_log_probs=ops.tile(only_first[None], (batch, 1)),  # (batch, beam)
            last=ops.full((batch * beam,), config.bos_id, "int32"),
            finished=sequences,
            finished_scores=no_scores,
            finished_log_probs=no_scores,
            done=ops.zeros((batch,), "bool"),
            decoder_state=self.decoder.initial_state(),
        )
        if self.decoder.grows:  # the finished pools of the sentences that left, in input order
            state["results"] = (sequences, no_scores, no_scores)
        final = _while_loop(
            lambda s: self._not_done(s), lambda s: (self._step(s),), (state,), self.decoder.grows
        )[0]
        if not self.decoder.grows:
            return final["finished"], final["finished_scores"], final["finished_log_probs"]
        # The sentences still in the loop (stopped by max_len) join the results.
        return self._write_results(final, ops.arange(ops.shape(final["sentences"])[0], dtype="int32"))

    def _not_done(self, state):
        return ops.logical_and(state["step"] < self.setup.max_len, ops.logical_not(ops.all(state["done"])))

    def _sentence_done(self, step, limits, alive_log_probs, finished_scores):
        """`policy.search_is_final` before decoding position `step` `(sentences,)`."""
        limits = ops.cast(limits, "float32")
        return search_is_final(step, limits, alive_log_probs, finished_scores, self.alpha, ops)

    def _step(self, state):
        beam, step, limits = self.beam_size, state["step"], state["limits"]
        sentences = ops.shape(limits)[0]
        logits, decoder_state = self.decoder.step(state["last"], state["alive"], step, state["decoder_state"])
        log_probs = ops.reshape(ops.log_softmax(logits, axis=-1), (sentences, beam, -1))
        log_probs = self.setup.constrain(log_probs, step, limits)
        vocab = ops.shape(log_probs)[-1]
        candidates = ops.reshape(state["alive_log_probs"][:, :, None] + log_probs, (sentences, -1))
        top_log_probs, top_index = ops.top_k(candidates, k=beam)  # (sentences, beam)
        origin = top_index // vocab  # which live hypothesis each candidate extends
        tokens = ops.cast(top_index % vocab, "int32")
        alive = _take_per_sentence(state["alive"], origin)
        at_step = ops.equal(ops.arange(ops.shape(alive)[-1]), step)  # (max_len,)
        alive = ops.where(at_step, tokens[:, :, None], alive)
        is_eos = ops.equal(tokens, self.config.eos_id)

        # Candidates ending in EOS join the pool of finished hypotheses.
        eos_log_probs = ops.where(is_eos, top_log_probs, NEG_INF)
        pool_scores = ops.concatenate(
            [state["finished_scores"], eos_log_probs / self.penalty(step + 1)], axis=1
        )
        pool_log_probs = ops.concatenate([state["finished_log_probs"], eos_log_probs], axis=1)
        pool = ops.concatenate([state["finished"], alive], axis=1)
        finished_scores, keep = ops.top_k(pool_scores, k=beam)
        # The others stay live; a slot whose candidate finished is dead this step.
        alive_log_probs = ops.where(is_eos, NEG_INF, top_log_probs)
        new = dict(
            state,
            step=step + 1,
            alive=alive,
            alive_log_probs=alive_log_probs,
            last=tokens,
            finished=_take_per_sentence(pool, keep),
            finished_scores=finished_scores,
            finished_log_probs=_take_per_sentence(pool_log_probs, keep),
            done=self._sentence_done(step + 1, limits, alive_log_probs, finished_scores),
        )
        origin_rows = ops.arange(sentences)[:, None] * beam + origin  # (sentences, beam)
        if not self.decoder.grows:
            new["last"] = ops.reshape(tokens, (-1,))
            new["decoder_state"] = self.decoder.reorder(decoder_state, ops.reshape(origin_rows, (-1,)))
            return new
        # Finished sentences leave: one gather per cache tensor reorders the beams of the others.
        staying = ops.cast(ops.where(ops.logical_not(new["done"]))[0], "int32")  # (kept,)
        new["decoder_state"] = self.decoder.reorder(
            decoder_state, ops.reshape(gather_rows(origin_rows, staying), (-1,))
        )
        # Unconditionally (a gather by all rows when none leaves): a `cond` here would make
        # tf2onnx inline the loop body without its static shapes, and its rewrites then miss.
        new = self._leave(new, staying)
        new["last"] = ops.reshape(new["last"], (-1,))
        return new

    def _leave(self, state, staying):
        """`state` without the sentences not in `staying`, whose pools go into the results."""
        state = dict(
            state, results=self._write_results(state, ops.cast(ops.where(state["done"])[0], "int32"))
        )
        for key in self.SENTENCE_KEYS + ("last",):
            state[key] = gather_rows(state[key], staying)
        state["decoder_state"] = self.decoder.select_sentences(state["decoder_state"], staying)
        return state

    @staticmethod
    def _write_results(state, rows):
        """The results with the finished pools of the loop's sentences `rows` written in."""
        where = gather_rows(state["sentences"], rows)[:, None]  # (rows, 1) input indices
        return tuple(
            ops.scatter_update(result, where, gather_rows(state[key], rows))
            for result, key in zip(state["results"], ("finished", "finished_scores", "finished_log_probs"))
        )
