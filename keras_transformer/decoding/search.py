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
- `"fixed"`: preallocated `max_len` positions and static shapes, for XLA
  (`jit_compile=True`) and JAX, where it is the default. A finished sentence
  stays in the batch, but the beam search halves its batch once at most half
  of it is live (a loop per batch size: `batch`, `batch / 2`, ..., 1, each
  compiled; the live sentences move to the front, finished ones fill the
  rest), so the tail of a batch costs the rows it needs, within 2x. The
  steps before position `FIXED_CACHE_BLOCK` (32) read only the cache's
  first 32 positions (greedy search also writes only those), and a beam
  search never reorders the cache: each row writes its own row in place and
  reads its hypothesis's positions from the rows that wrote them
  (`_CachedDecoder`). Under XLA, a
  beam search without controls finds each step's best candidates from the
  logits block by block, never writing the `(batch, beam, vocab)` scores
  (`_top_candidates_of_logits`).
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

from keras_transformer.decoding import controls as rules
from keras_transformer.decoding import sampling
from keras_transformer.decoding.policy import (
    BEAM_SIZE,
    CACHE_POLICIES,
    LENGTH_PENALTY,
    MAX_EXTRA_LENGTH,
    NEG_INF,
    NEVER_OUTPUT,
    UNK_ID,
    constrain,
    length_penalty,
    output_caps,
    output_limits,
    search_is_final,
)
from keras_transformer.layers.decoding_cache import CacheHistory
from keras_transformer.layers.dropout import in_xla_computation
from keras_transformer.layers.masks import padding_mask
from keras_transformer.layers.portable_ops import argmax, gather_rows, write_at
from keras_transformer.utils.checks import check_positive_int

TOP_K_BLOCK = 128  # columns per block of `_top_candidates`
FIXED_CACHE_BLOCK = 32  # positions of a fixed cache that the steps before the 32nd read alone
STAGED_HALVINGS = 5  # a fixed-cache search of a batch unknown when traced: down to 1/32 of it


def inference(search):
    """`search`, run without recording gradients where the backend records them eagerly (PyTorch):
    a decorator of every decoding function."""

    @functools.wraps(search)
    def run(*args, **kwargs):
        with _no_gradients():
            return search(*args, **kwargs)

    return run


def resolve_cache_policy(cache_policy):
    """`"growing"` or `"fixed"` for `cache_policy` (`"auto"`: fixed on JAX and under XLA)."""
    if cache_policy not in CACHE_POLICIES:
        raise ValueError(f"cache_policy must be one of {CACHE_POLICIES}; got {cache_policy!r}.")
    static_shapes = _compiled_by_xla()
    if cache_policy == "growing" and static_shapes:
        raise ValueError(
            'cache_policy="growing" changes tensor shapes every step, which XLA and JAX cannot '
            'compile; use cache_policy="fixed" (or "auto").'
        )
    if cache_policy == "auto":
        return "fixed" if static_shapes else "growing"
    return cache_policy


def _compiled_by_xla():
    """Whether the search is being compiled by XLA, which needs static shapes: on JAX, or while
    TensorFlow traces a `jit_compile=True` function."""
    return keras.backend.backend() == "jax" or (
        keras.backend.backend() == "tensorflow" and in_xla_computation()
    )


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

        def as_tuple(*values):
            return tuple(body(*values))

        return tf.while_loop(cond, as_tuple, loop_vars, shape_invariants=invariants)
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


class Controls(NamedTuple):
    """The per-step controls of one request (`keras_transformer.decoding.controls`), as arrays.

    target_prefix: int32 `(batch, width)` padded with `pad_id` (width >= 1), or None.
    suppress_sequences: int32 `(count, width)` padded with `pad_id`, or None (their one-token
        sequences are banned through `_Setup`'s `never`; the longer ones here).
    no_repeat_ngram_size: int (0: off); repetition_penalty: float (1.0: off).

    Python numbers for the off values let the search leave a control out of the
    graph; tensors (an exported graph's inputs) are applied whatever their value,
    where a value that is off changes nothing.
    """

    target_prefix: object = None
    suppress_sequences: object = None
    no_repeat_ngram_size: object = 0
    repetition_penalty: object = 1.0

    @staticmethod
    def lengths(padded, pad_id):
        """Tokens per row of a padded `(rows, width)` array: `(rows,)` int32."""
        return ops.sum(ops.cast(ops.not_equal(padded, pad_id), "int32"), axis=1)

    def any_on(self):
        """Whether some control acts (a Python bool: the options must be Python values)."""
        return (
            self.target_prefix is not None
            or self.suppress_sequences is not None
            or self.no_repeat_ngram_size != 0
            or self.repetition_penalty != 1.0
        )


def when(pred, function, otherwise):
    """`function()` where `pred` holds, else `otherwise` (a value, or a function of none): decided
    in Python for a Python or eager predicate, else by a graph conditional (`keras.ops.cond`)."""
    other = otherwise if callable(otherwise) else (lambda: otherwise)  # noqa: E731
    if isinstance(pred, (bool, np.bool_)):
        return function() if pred else other()
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if not tf.executing_eagerly():
            return ops.cond(pred, function, other)
    try:
        concrete = bool(ops.convert_to_numpy(pred))
    except Exception:  # a traced value (JAX): the backend's conditional
        return ops.cond(pred, function, other)
    return function() if concrete else other()


def _static(value):
    """Whether a control's value is a Python number (then it is on: `_on` said so)."""
    return isinstance(value, (bool, int, float))


def _on(value, off):
    """Whether a control with `value` may act: False only for a Python `off` value."""
    return not (isinstance(value, (bool, int, float)) and value == off)


@inference
def greedy_search(
    model,
    source_ids,
    max_length=None,
    max_extra_length=MAX_EXTRA_LENGTH,
    min_length=0,
    use_cache=True,
    cache_policy="auto",
    never=None,
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
        never: bool `(vocab,)`, the ids never output (`policy.never_output_ids` of the
            tokenizer: also the pieces of control characters); None: the model's
            `NEVER_OUTPUT` ids alone.

    Returns:
        `Translations` with ids `(batch, max_len)` and scores `(batch,)`.
    """
    setup = _Setup(model, source_ids, max_length, max_extra_length, min_length, never=never)
    decoder = _make_decoder(model, setup, 1, use_cache, cache_policy)
    tokens, log_probs = _token_by_token(setup, decoder, _most_probable, Controls())
    return Translations(tokens, log_probs, log_probs)


def _most_probable(step_log_probs, step):
    return argmax(step_log_probs)


def _token_by_token(setup, decoder, choose, controls):
    """The greedy loop: one token per sentence and step, chosen by `choose(log_probs (batch,
    vocab), step) -> (batch,)` among what the rules and `controls` allow. Returns the tokens
    `(batch, max_len)` and their summed log-probabilities `(batch,)`."""
    batch, config = setup.batch, setup.config
    tokens = ops.full((batch, setup.max_len), config.pad_id, "int32")
    state = (
        ops.zeros((), "int32"),
        tokens,
        ops.full((batch,), config.bos_id, "int32"),
        ops.zeros((batch,), "float32"),
        ops.zeros((batch,), "bool"),
        decoder.initial_state(),
    )
    prefix = setup.prefix_state(controls)

    def cond(step, tokens, last, log_probs, finished, decoder_state):
        return ops.logical_and(step < setup.max_len, ops.logical_not(ops.all(finished)))

    def body(step, tokens, last, log_probs, finished, decoder_state):
        logits, decoder_state = decoder.step(last, tokens, step, decoder_state)
        step_log_probs = setup.step_log_probs(
            logits[:, None], tokens[:, None], step, setup.limits, controls, *prefix
        )
        step_log_probs = step_log_probs[:, 0]  # (batch, vocab)
        next_tokens = choose(step_log_probs, step)
        next_log_probs = ops.take_along_axis(step_log_probs, next_tokens[:, None], axis=-1)[:, 0]
        next_tokens = ops.where(finished, config.pad_id, next_tokens)
        log_probs = log_probs + ops.where(finished, 0.0, next_log_probs)
        tokens = write_at(tokens, next_tokens[:, None], step)
        finished = ops.logical_or(finished, ops.equal(next_tokens, config.eos_id))
        return step + 1, tokens, next_tokens, log_probs, finished, decoder_state

    _, tokens, _, log_probs, _, _ = _while_loop(cond, body, state, decoder.grows)
    return tokens, log_probs


@inference
def sample(
    model,
    source_ids,
    num_return=1,
    sampling_topk=0,
    sampling_topp=1.0,
    sampling_temperature=1.0,
    seed=0,
    sentence_ids=None,
    length_penalty=LENGTH_PENALTY,
    max_extra_length=MAX_EXTRA_LENGTH,
    min_length=0,
    max_length=None,
    use_cache=True,
    cache_policy="auto",
    never=None,
    **controls,
):
    """`num_return` random samples per sentence (`keras_transformer.decoding.sampling`), one
    token at a time like greedy search, under the same rules and controls as `beam_search`
    (`controls`: its `disable_unk`, `suppress_sequences`, `target_prefix`,
    `no_repeat_ngram_size`, `repetition_penalty`).

    Sample k of the sentence with request index i is a function of `(seed, i, k)`:
    `sentence_ids` `(batch,)` gives each row's index in the request (default its row),
    so a sentence gets the same samples in any batch. `sampling_topk` 0 samples
    from the whole vocabulary, K from the K likeliest tokens (1 is greedy search).
    `never`: as `greedy_search`'s.

    Returns:
        `Translations` with ids `(batch, num_return, max_len)`, scores `(batch,
        num_return)` (log-probability / GNMT penalty with `length_penalty`, as beam
        search's) and log_probs, in sample order.
    """
    if isinstance(num_return, int):
        check_positive_int("num_return", num_return)
    banned, controls = split_controls(model.config, **controls)
    return sample_rows(
        model, source_ids, num_return, sampling_topk, sampling_topp, sampling_temperature, seed,
        sentence_ids, length_penalty, max_extra_length, min_length, max_length, use_cache, cache_policy,
        banned, controls, never,
    )  # fmt: skip


def sample_rows(
    model, source_ids, num_return, topk, topp, temperature, seed, sentence_ids, alpha, max_extra_length,
    min_length, max_length, use_cache, cache_policy, banned, controls, never=None,
):  # fmt: skip
    """`sample` with its controls split (`split_controls`): `Translations` `(batch, num_return, ...)`."""
    disable_unk, banned = banned
    setup = _Setup(
        model, source_ids, max_length, max_extra_length, min_length, disable_unk, banned, num_return, never
    )
    decoder = _make_decoder(model, setup, 1, use_cache, cache_policy)
    batch = ops.shape(setup.source_ids)[0]
    if sentence_ids is None:
        sentence_ids = ops.arange(batch, dtype="int32")
    sentence_keys = ops.repeat(ops.cast(sentence_ids, "int32"), num_return, axis=0)  # (rows,)
    sample_keys = ops.tile(ops.arange(num_return, dtype="int32"), [batch])

    def choose(step_log_probs, step):
        keys = sampling.row_keys(seed, sentence_keys, sample_keys, step, ops)
        return sampling.sample(step_log_probs, keys, topk, topp, temperature, ops)

    tokens, log_probs = _token_by_token(setup, decoder, choose, controls)
    lengths = ops.sum(ops.cast(ops.not_equal(tokens, model.config.pad_id), "float32"), axis=1)
    scores = log_probs / length_penalty_of(lengths, alpha)
    shape = (batch, num_return)
    return Translations(
        ops.reshape(tokens, (*shape, ops.shape(tokens)[1])),
        ops.reshape(scores, shape),
        ops.reshape(log_probs, shape),
    )


def length_penalty_of(lengths, alpha):
    """`policy.length_penalty` of float32 lengths with α a Python number or a tensor."""
    return length_penalty(lengths, alpha if isinstance(alpha, (int, float)) else ops.cast(alpha, "float32"))


def token_array(lists, pad_id):
    """Token lists (a list of lists of ids, or an int array `(rows, width)` padded with `pad_id`)
    as an int32 array `(rows, width >= 1)`; None stays None."""
    if lists is None:
        return None
    if isinstance(lists, (list, tuple)):
        rows = rules.padded_token_lists(lists, pad_id)
        return np.array(rows, np.int32).reshape(len(rows), len(rows[0]) if rows else 1)
    array = ops.cast(ops.convert_to_tensor(lists), "int32")
    if array.shape[1] is None or array.shape[1] == 0:  # a padding column, so that column 0 exists
        array = ops.pad(array, [[0, 0], [0, 1]], constant_values=pad_id)
    return array


def split_controls(config, disable_unk=False, suppress_sequences=None, target_prefix=None, **per_step):
    """`((disable_unk, banned sequences), Controls)` of `beam_search`'s control arguments: the
    banned sequences (all of them: their one-token ones go into the never mask) and the
    `Controls` acting at every step (the sequences only where some has 2 or more tokens)."""
    unknown = sorted(set(per_step) - {"no_repeat_ngram_size", "repetition_penalty"})
    if unknown:
        raise TypeError(f"unexpected decoding control(s) {unknown}.")
    banned = token_array(suppress_sequences, config.pad_id)
    per_token = banned
    if isinstance(banned, np.ndarray) and not np.any(np.sum(banned != config.pad_id, axis=1) > 1):
        per_token = None  # only one-token sequences: the never mask has them all
    controls = Controls(token_array(target_prefix, config.pad_id), per_token, **per_step)
    return (disable_unk, banned), controls


@inference
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
    never=None,
    early_stopping=False,
    **controls,
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
        never: bool `(vocab,)`, the ids never output (`policy.never_output_ids` of the
            tokenizer: also the pieces of control characters); None: the model's
            `NEVER_OUTPUT` ids alone.
        early_stopping: a sentence is done as soon as its pool is full (CTranslate2's rule:
            fewer steps, `policy.search_is_final`).
        **controls: `disable_unk` (bool), `suppress_sequences` (token lists, or an
            int array `(count, width)` padded with `pad_id`), `target_prefix` (one token
            list per sentence, or `(batch, width)` padded), `no_repeat_ngram_size` (int),
            `repetition_penalty` (float), as `keras_transformer.decoding.controls` defines
            them. Python values that are off leave the control out of the graph.

    Returns:
        `Translations`, best first; ids `(batch, max_len)` for `num_return=1`,
        else `(batch, num_return, max_len)` (also for a tensor `num_return`).
    """
    check_positive_int("beam_size", beam_size)
    if isinstance(num_return, int):
        check_positive_int("num_return", num_return)
        if num_return > beam_size:
            raise ValueError(f"num_return={num_return} must be <= beam_size={beam_size}.")
    if isinstance(length_penalty, (int, float)) and not length_penalty >= 0:
        raise ValueError(f"length_penalty must be a number >= 0; got {length_penalty!r}.")
    banned, controls = split_controls(model.config, **controls)
    ids, scores, log_probs = beam_pools(
        model, source_ids, beam_size, length_penalty, max_extra_length, max_length, min_length,
        use_cache, cache_policy, banned, controls, never, early_stopping,
    )  # fmt: skip
    if isinstance(num_return, int) and num_return == 1:
        return Translations(ids[:, 0], scores[:, 0], log_probs[:, 0])
    return Translations(ids[:, :num_return], scores[:, :num_return], log_probs[:, :num_return])


def beam_pools(
    model, source_ids, beam_size, alpha, max_extra_length, max_length, min_length, use_cache, cache_policy,
    banned, controls, never=None, early_stopping=False,
):  # fmt: skip
    """`beam_search` with its controls split (`split_controls`): the whole pools, `(batch, beam,
    max_len)` ids and `(batch, beam)` scores and log-probabilities, best first."""
    disable_unk, banned = banned
    setup = _Setup(
        model, source_ids, max_length, max_extra_length, min_length, disable_unk, banned, never=never
    )
    decoder = _make_decoder(model, setup, beam_size, use_cache, cache_policy)
    return _BeamSearch(model, setup, decoder, beam_size, alpha, controls, early_stopping).run()


class _Setup:
    """Encodes the source once, works out the output length limits, and applies the rules of
    `policy.constrain` and the `Controls` to each step's logits."""

    def __init__(
        self,
        model,
        source_ids,
        max_length,
        max_extra_length,
        min_length,
        disable_unk=False,
        banned_sequences=None,
        repeat=1,
        never=None,
    ):
        for name, value in (("max_extra_length", max_extra_length), ("min_length", min_length)):
            if isinstance(value, (bool, float)) or (isinstance(value, int) and value < 0):
                raise ValueError(f"{name} must be an integer >= 0; got {value!r}.")
        self.min_length = min_length
        if max_length is not None:
            check_positive_int("max_length", max_length)
        config = model.config
        self.config = config
        self.source_ids = ops.cast(ops.convert_to_tensor(source_ids), "int32")
        if len(self.source_ids.shape) != 2:
            raise ValueError(f"source_ids must have shape (batch, length); got {self.source_ids.shape}.")
        self.memory_mask = padding_mask(self.source_ids, config.pad_id)  # (batch, 1, len_src)
        self.memory = model.encode(self.source_ids, training=False)  # (batch, len_src, d_model)
        lengths = ops.sum(ops.cast(ops.not_equal(self.source_ids, config.pad_id), "int32"), axis=1)
        if not (isinstance(repeat, int) and repeat == 1):  # rows = sentences x repeat
            self.memory_mask, self.memory, lengths = (
                ops.repeat(t, repeat, axis=0) for t in (self.memory_mask, self.memory, lengths)
            )
        self.batch = ops.shape(self.memory)[0]
        if max_length is None:  # (batch,) tokens incl. EOS
            self.limits = output_limits(lengths, config.max_length, ops, max_extra_length)
            source_length = self.source_ids.shape[1]
            if source_length is None or not isinstance(max_extra_length, int):  # known at run time
                source_length = ops.shape(self.source_ids)[1]
                self.max_len = output_limits(source_length, config.max_length, ops, max_extra_length)
            else:  # a Python int: static shapes for XLA
                self.max_len = int(output_limits(source_length, config.max_length, np, max_extra_length))
        else:
            self.limits = ops.full((self.batch,), min(max_length, config.max_length), "int32")
            self.max_len = min(max_length, config.max_length)
        ids = ops.arange(config.target_vocab)
        self.is_eos = ops.equal(ids, config.eos_id)  # (vocab,)
        # The ids never output (policy.never_output_ids, or NEVER_OUTPUT alone without a
        # tokenizer), as a constant: `never_ids` the ids themselves, for the blocks of
        # `_top_candidates_of_logits`.
        if never is None:
            self.never_ids = sorted({getattr(config, name) for name in NEVER_OUTPUT})
        else:
            never = np.asarray(never, bool)
            if never.shape != (config.target_vocab,):
                raise ValueError(f"never must have shape ({config.target_vocab},); got {never.shape}.")
            self.never_ids = np.flatnonzero(never).tolist()
        self.never = ops.convert_to_tensor(np.isin(np.arange(config.target_vocab), self.never_ids))
        # The controls' bans at every step (CTranslate2's: before the softmax): <unk> and the
        # one-token banned sequences; None when the request has neither.
        suppressed = []
        if _on(disable_unk, False):
            suppressed.append(ops.logical_and(disable_unk, ops.equal(ids, UNK_ID)))
        if banned_sequences is not None:
            lengths = Controls.lengths(banned_sequences, config.pad_id)
            suppressed.append(rules.single_token_bans(banned_sequences, lengths, config.target_vocab, ops))
        self.suppressed = functools.reduce(ops.logical_or, suppressed) if suppressed else None
        self.repeat = repeat

    def prefix_state(self, controls):
        """`(prefix, prefix_lengths)` per row of the loop, or `()` without a prefix."""
        prefix = controls.target_prefix
        if prefix is None:
            return ()
        prefix = ops.cast(ops.convert_to_tensor(prefix), "int32")
        if not (isinstance(self.repeat, int) and self.repeat == 1):
            prefix = ops.repeat(prefix, self.repeat, axis=0)
        return prefix, Controls.lengths(prefix, self.config.pad_id)

    def step_log_probs(self, logits, history, step, limits, controls, prefix=None, prefix_lengths=None):
        """One step's log-probabilities `(sentences, beam, vocab)` from the decoder's logits
        `(sentences * beam, vocab)` or `(sentences, beam, vocab)`, with every rule applied.

        Without controls, exactly the rules of `policy.constrain`. With them, as
        CTranslate2 orders them: the repetition penalty on the logits, then the
        controls' bans (`<unk>`, banned sequences, repeated n-grams) on the logits, the
        softmax over what is left, then the rules and the prefix
        (`keras_transformer.decoding.controls`). `history` `(sentences, beam,
        max_len)`: the tokens so far.
        """
        sentences, beam = ops.shape(limits)[0], ops.shape(history)[1]
        vocab, pad = self.config.target_vocab, self.config.pad_id
        penalty, size = controls.repetition_penalty, controls.no_repeat_ngram_size
        controlled = (
            _on(penalty, 1.0) or self.suppressed is not None or _on(size, 0)
            or controls.suppress_sequences is not None
        )  # fmt: skip
        if controlled:
            logits = ops.reshape(logits, (sentences, beam, vocab))
        # Each control is computed only where it acts: a tensor's value is checked once per
        # step (a graph conditional), so a request pays for the controls it turns on.
        if _on(penalty, 1.0):
            penalty = penalty if _static(penalty) else ops.cast(penalty, logits.dtype)

            def penalized(logits=logits):
                return rules.repetition_penalized(logits, history, step, penalty, pad, ops)

            logits = when(_static(penalty) or ops.not_equal(penalty, 1.0), penalized, logits)
        free = logits  # what a prefix token's log-probability is taken from (no ban applies to it)
        if self.suppressed is not None:
            logits = ops.where(self.suppressed, ops.cast(NEG_INF, logits.dtype), logits)
        if _on(size, 0):

            def without_repeats(logits=logits):
                tokens, banned = rules.repeated_ngram_ends(history, step, size, ops)
                return rules.ban(logits, tokens, banned, pad, ops)

            logits = when(_static(size) or ops.greater(size, 0), without_repeats, logits)
        sequences = controls.suppress_sequences
        if sequences is not None:
            lengths = Controls.lengths(sequences, pad)

            def without_sequences(logits=logits):
                tokens, banned = rules.sequence_ends(history, step, sequences, lengths, ops)
                return rules.ban(logits, tokens, banned, pad, ops)

            multi = isinstance(sequences, np.ndarray) or ops.any(ops.greater(lengths, 1))
            logits = when(multi, without_sequences, logits)
        raw = ops.reshape(ops.log_softmax(logits, axis=-1), (sentences, beam, vocab))
        log_probs = constrain(raw, step, limits, self.never, self.is_eos, self.min_length, ops)
        if prefix is not None:

            def forced(log_probs=log_probs):
                free_log_probs = raw if free is logits else ops.log_softmax(free, axis=-1)
                free_log_probs = ops.reshape(free_log_probs, (sentences, beam, vocab))
                return rules.forced_prefix(log_probs, free_log_probs, step, prefix, prefix_lengths, ops)

            log_probs = when(ops.any(ops.less(step, prefix_lengths)), forced, log_probs)
        return log_probs


def _top_candidates(candidates, k, block=None):
    """`keras.ops.top_k(candidates, k)` of float `(sentences, n)`: the same values and indices
    (ties: the lower index first), where XLA compiles the search (TensorFlow's `jit_compile`,
    JAX) found through blocks of `block` columns.

    XLA's CPU `TopK` is a partial sort per row: ~1.5 ms per step at batch 32 (`(32, 4 x 8000)`)
    against ~0.16 ms for ONNX Runtime's. The `k` best lie in the `k` blocks with the best
    maxima (each block ranked before an element's own holds an element ranked before it; blocks
    of equal maxima rank by index), so: one vectorized max per block, `TopK` over the block
    maxima, the `k` blocks gathered in index order (so equal values keep index order), `TopK`
    over their `k x block` columns (`TOP_K_BLOCK` by default). Elsewhere (eager, exported
    graphs: ONNX Runtime's `TopK` is fast) the plain `top_k`.
    """
    n, block = candidates.shape[-1], block or TOP_K_BLOCK
    if not _compiled_by_xla() or not isinstance(n, int) or n <= 4 * k * block:
        return ops.top_k(candidates, k=k)
    blocks = -(-n // block)
    padded = ops.pad(candidates, ((0, 0), (0, blocks * block - n)), constant_values=float("-inf"))
    padded = ops.reshape(padded, (-1, blocks, block))
    return _top_of_best_blocks(
        ops.max(padded, axis=2), lambda best: ops.take_along_axis(padded, best[:, :, None], axis=1), k
    )


def _top_of_best_blocks(block_maxima, columns_of, k):
    """`top_k` of candidates in blocks of equal size, from each block's maximum `(sentences,
    blocks)` and `columns_of(best)`, the candidates `(sentences, k, block)` of the blocks `best`
    `(sentences, k)` (in index order): values and indices `(sentences, k)` (block index x block
    + column). The `k` best lie in the `k` blocks with the best maxima (`_top_candidates`)."""
    _, best = ops.top_k(block_maxima, k=k)
    best = ops.sort(best, axis=1)  # index order: equal values keep it
    columns = columns_of(best)
    block = columns.shape[-1]
    values, index = ops.top_k(ops.reshape(columns, (-1, k * block)), k=k)
    return values, ops.take_along_axis(best, index // block, axis=1) * block + index % block


def _top_candidates_of_logits(setup, logits, alive_log_probs, step, limits, k, block=None):
    """The `k` best candidates of a beam-search step straight from the decoder's logits, where
    XLA compiles a search without controls: `_top_candidates(alive_log_probs[:, :, None] +
    constrain(log_softmax(logits)), k)`'s values and flat indices `(sentences, k)` (into
    `beam * vocab`), without the `(sentences, beam, vocab)` candidates ever written.

    XLA's CPU backend spends ~1 ns per element on that tensor (its log-softmax, rules, sum
    and block maxima: ~1.6 ms per batch-32 step before, `docs/benchmarks.md`).
    Here the only passes over the logits are the log-softmax's own (its maximum, its sum of
    exponentials) and one maximum per block of `block` ids. Every operation from a logit to
    its candidate's score is monotone (rounding included), so a block's best candidate is
    `alive + ((allowed maximum - row maximum) - log-sum)`, or `alive + NEG_INF` where the rules
    allow none of its ids; the blocks of plain ids (neither never output nor EOS) share one
    cap per sentence (`policy.output_caps` of a plain id), so their allowed maximum is the
    block's maximum or none; the few blocks holding special ids are capped id by id. The `k`
    blocks with the best (ties: the lower index first) hold the `k` best candidates
    (`_top_candidates`); their candidates are computed as the search computes them, from
    their logits and their ids' caps, and ranked.

    Args:
        setup: the search's `_Setup`; logits: float `(sentences * beam, vocab)`.
        alive_log_probs: float32 `(sentences, beam)`; step: scalar; limits: int `(sentences,)`.
        block: ids per block (default: the divisor of the vocabulary nearest `TOP_K_BLOCK`
            between half and twice it, else `TOP_K_BLOCK` with the last block padded).
    """
    sentences, beam = alive_log_probs.shape
    vocab, dtype = setup.config.target_vocab, logits.dtype
    block = block or _vocabulary_block(vocab)
    per_row = -(-vocab // block)
    neg_inf = float("-inf")

    def caps(ids):  # the rules' caps of int `ids` `(1 or sentences, n, block)`, per sentence
        never, is_eos = (ops.take(mask, ids, axis=0) for mask in (setup.never, setup.is_eos))
        return output_caps(step, limits, never, is_eos, setup.min_length, 3, dtype, ops)

    logits = ops.reshape(logits, (sentences, beam, vocab))
    padded = ops.pad(logits, ((0, 0), (0, 0), (0, per_row * block - vocab)), constant_values=neg_inf)
    blocks = ops.reshape(padded, (sentences, beam, per_row, block))
    block_max = ops.max(blocks, axis=-1)  # (sentences, beam, per_row)
    row_max = ops.max(logits, axis=-1)  # (sentences, beam): log_softmax's, as XLA lowers it
    log_sum = ops.log(ops.sum(ops.exp(logits - row_max[:, :, None]), axis=-1))
    plain_cap = output_caps(step, limits, False, False, setup.min_length, 3, dtype, ops)  # (sentences, 1, 1)
    allowed_max = ops.where(ops.equal(plain_cap, 0.0), block_max, neg_inf)
    # The blocks holding the ids `setup.never` and `setup.is_eos` mark (`_Setup`: never_ids, EOS).
    special = sorted({i // block for i in setup.never_ids + [setup.config.eos_id]})
    for part in special:  # (sentences, beam) each: the allowed maximum of a block of special ids
        first, end = part * block, min((part + 1) * block, vocab)
        allowed = ops.equal(caps(ops.arange(first, end, dtype="int32")[None, None]), 0.0)
        exact = ops.max(ops.where(allowed, logits[:, :, first:end], neg_inf), axis=-1)
        allowed_max = ops.where(ops.equal(ops.arange(per_row), part), exact[:, :, None], allowed_max)
    best_log_prob = ops.where(
        allowed_max > neg_inf,
        (allowed_max - row_max[:, :, None]) - log_sum[:, :, None],
        ops.cast(NEG_INF, dtype),
    )
    block_maxima = ops.reshape(alive_log_probs[:, :, None] + best_log_prob, (sentences, beam * per_row))

    def candidates_of(best):  # (sentences, k) blocks -> their candidates (sentences, k, block)
        origins, parts = best // per_row, best % per_row  # the beam and the block within its row
        columns = _take_per_sentence(ops.reshape(blocks, (sentences, beam * per_row, block)), best)
        shift, norm, alive = (
            _take_per_sentence(t, origins)[:, :, None] for t in (row_max, log_sum, alive_log_probs)
        )
        ids = ops.minimum(parts[:, :, None] * block + ops.arange(block, dtype="int32"), vocab - 1)
        return alive + ops.minimum((columns - shift) - norm, caps(ids))  # policy.constrain's minimum

    values, index = _top_of_best_blocks(block_maxima, candidates_of, k)  # index into (beam, per_row * block)
    return values, index // (per_row * block) * vocab + index % (per_row * block)


def _vocabulary_block(vocab):
    """`_top_candidates_of_logits`' ids per block: the divisor of `vocab` nearest `TOP_K_BLOCK`
    within half and twice it (no padding), else `TOP_K_BLOCK`."""
    block = TOP_K_BLOCK
    divisors = [d for d in range(block // 2, 2 * block + 1) if vocab % d == 0]
    return min(divisors, key=lambda d: (abs(d - block), d)) if divisors else block


def _take_per_sentence(tensor, index):
    """`out[s, j] = tensor[s, index[s, j]]`: `(sentences, k, ...)` from `tensor` `(sentences, n, ...)`
    and int `index` `(sentences, k)`.

    `take_along_axis` with the same result, but as one row gather over the
    flattened `(sentences * n, ...)`: `take_along_axis` broadcasts its index
    and exports as ~25 ONNX nodes (shape arithmetic, `Expand`, `GatherND`)
    per call, three calls per beam-search step.
    """
    sentences, n, k = ops.shape(index)[0], ops.shape(tensor)[1], ops.shape(index)[1]
    trailing = tuple(ops.shape(tensor)[2:])
    rows = ops.arange(sentences, dtype="int32")[:, None] * n + ops.cast(index, "int32")
    taken = gather_rows(ops.reshape(tensor, (-1, *trailing)), ops.reshape(rows, (-1,)))
    # A batch known when traced stays known (a loop's shapes must not loosen); else -1, which
    # exports as no node.
    return ops.reshape(taken, (sentences if isinstance(sentences, int) else -1, k, *trailing))


def _repeat(tensor, times):
    """`(batch, ...)` -> `(batch * times, ...)`, each row repeated `times` times in a row."""
    return tensor if times == 1 else ops.repeat(tensor, times, axis=0)


def _make_decoder(model, setup, beam_size, use_cache, cache_policy):
    if not use_cache:
        resolve_cache_policy(cache_policy)  # checks the argument
        return _PrefixDecoder(model, setup, beam_size)
    return _CachedDecoder(model, setup, beam_size, resolve_cache_policy(cache_policy))


class _DecoderState(NamedTuple):
    """`_CachedDecoder`'s loop state. A fixed cache of more than `FIXED_CACHE_BLOCK` positions
    is split: `cache` holds its first `FIXED_CACHE_BLOCK` positions and `tail` the others (the
    self-attention keys, then values, of each layer `(rows, num_heads, max_len - block,
    depth)`; else `()`). `history` int32 `(rows, max_len)`: for each row, the beam of its
    sentence whose cache row holds each position of its hypothesis (a fixed cache in a beam
    search, never reordered; else `()`)."""

    cache: object  # DecodingCache
    memory_mask: object  # (sentences, 1, len_src)
    tail: tuple = ()
    history: object = ()


class _CachedDecoder:
    """One position per step; the self-attention cache has a row per beam, the cross-attention
    one a row per sentence (`_DecoderState`).

    A fixed cache costs per step what the step needs, not what its size allows: it is sized
    for the longest output allowed (source length + 50), most outputs are shorter than
    `FIXED_CACHE_BLOCK` positions, and a step before that position reads the first block only.
    - A beam search never reorders it: each row writes its step's keys and values into its
      own cache row, in place, and reads each earlier position from the row that wrote it, by
      its `history` (the beams it extends; `CacheHistory`), the first block alone before its
      last step (a `cond` in the attention that only reads). Reordered by beam origin, the
      cache was gathered every step, and under XLA the gathered cache was copied into the
      loop's state again (a gather cannot write in place): two passes over it a step.
    - Greedy search (nothing to reorder) splits a cache longer than the block: a step before
      position `FIXED_CACHE_BLOCK` reads and writes the first block only (a `cond`; the tail,
      never written until then, passes through); a later step joins the two parts (a copy)
      and splits them again.
    Both give the same tokens."""

    def __init__(self, model, setup, beam_size, policy):
        self.model, self.setup, self.beam_size = model, setup, beam_size
        self.grows = policy == "growing"  # shapes change; finished sentences leave the batch
        self.tracks_history = not self.grows and beam_size > 1
        max_len = setup.max_len  # a Python int where shapes are static (XLA)
        long = not self.grows and isinstance(max_len, int) and max_len > FIXED_CACHE_BLOCK
        self.block = FIXED_CACHE_BLOCK if long else None  # the history reads it; greedy splits at it
        # A fixed cache (XLA, JAX) projects with the tied embeddings transposed once, here, outside
        # the loop: transposed inside it, XLA's CPU product reads them transposed (NT), 1.6x slower
        # at 4 rows (batch 1, beam 4).
        kernel = None if self.grows else model.step_projection_kernel()
        self.projection = {} if kernel is None else {"projection_kernel": kernel}

    def initial_state(self):
        split = self.block and not self.tracks_history
        max_length = None if self.grows else (self.block if split else self.setup.max_len)
        cache = self.model.init_cache(self.setup.memory, max_length, self.beam_size)
        rows, heads, _, depth = ops.shape(cache.self_key[0])
        tail = ()
        if split:
            shape = (rows, heads, self.setup.max_len - self.block, depth)
            tail = tuple(ops.zeros(shape, t.dtype) for t in _self_attention(cache))
        history = ops.zeros((rows, self.setup.max_len), "int32") if self.tracks_history else ()
        return _DecoderState(cache, self.setup.memory_mask, tail, history)

    def step(self, last_tokens, prefix, step, state):
        cache, memory_mask = state.cache, state.memory_mask
        if self.grows:
            logits, cache = self.model.decode_step(last_tokens, None, cache, memory_mask)
            return logits, state._replace(cache=cache)
        if self.tracks_history:  # this step's position is the row's own
            rows = ops.shape(last_tokens)[0]
            beams = ops.arange(rows, dtype="int32") % self.beam_size
            history = write_at(state.history, beams[:, None], step, axis=1)
            read = CacheHistory((ops.arange(rows, dtype="int32") - beams)[:, None] + history, self.block)
            logits, cache = self.model.decode_step(
                last_tokens, step, cache, memory_mask, cache_history=read, **self.projection
            )
            return logits, state._replace(cache=cache, history=history)
        if not self.block:
            logits, cache = self.model.decode_step(last_tokens, step, cache, memory_mask, **self.projection)
            return logits, state._replace(cache=cache)

        def within_block():
            logits, written = self.model.decode_step(last_tokens, step, cache, memory_mask, **self.projection)
            return logits, _self_attention(written), state.tail

        def beyond_block():
            joined = _joined(cache, state.tail)
            logits, written = self.model.decode_step(
                last_tokens, step, joined, memory_mask, **self.projection
            )
            tensors = _self_attention(written)
            head = tuple(t[:, :, : self.block] for t in tensors)
            return logits, head, tuple(t[:, :, self.block :] for t in tensors)

        logits, head, tail = ops.cond(step < self.block, within_block, beyond_block)
        layers = cache.num_layers
        cache = cache.with_self_attention(head[:layers], head[layers:])
        return logits, state._replace(cache=cache, tail=tail)

    def reorder(self, state, flat_beam_index):
        """The beams' state gathered by beam origin `flat_beam_index` `(rows,)`: their
        histories (a fixed cache, not reordered), else the self-attention caches (one gather
        per tensor)."""
        if self.tracks_history:
            return state._replace(history=gather_rows(state.history, flat_beam_index))
        return _rows_of(state, flat_beam_index)

    def select_rows(self, state, rows):
        """The self-attention caches (and histories) of the rows `rows` `(new_rows,)`, whole
        sentences with their beams in order (the batch shrinks)."""
        return _rows_of(state, rows)

    @staticmethod
    def select_sentences(state, indices):
        """Keeps the sentences `indices` of the per-sentence tensors."""
        return state._replace(
            cache=state.cache.select_sentences(indices), memory_mask=gather_rows(state.memory_mask, indices)
        )


def _self_attention(cache):
    """A `DecodingCache`'s self-attention keys, then values (a tuple of `2 * num_layers`)."""
    return cache.self_key + cache.self_value


def _joined(cache, tail):
    """`cache` with the split-off positions `tail` (`_DecoderState.tail`) after its own."""
    tensors = [ops.concatenate([t, rest], axis=2) for t, rest in zip(_self_attention(cache), tail)]
    return cache.with_self_attention(tensors[: cache.num_layers], tensors[cache.num_layers :])


def _rows_of(state, rows):
    """`state` with the self-attention cache rows `rows` (its tail and histories too)."""
    tail = tuple(gather_rows(t, rows) for t in state.tail)
    history = state.history if isinstance(state.history, tuple) else gather_rows(state.history, rows)
    return state._replace(cache=state.cache.reorder(rows), tail=tail, history=history)


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

    def __init__(self, model, setup, decoder, beam_size, alpha, controls, early_stopping=False):
        self.config, self.setup, self.decoder = model.config, setup, decoder
        self.beam_size, self.controls, self.early_stopping = beam_size, controls, early_stopping
        self.alpha = float(alpha) if isinstance(alpha, (int, float)) else ops.cast(alpha, "float32")
        self.prefix_keys = () if controls.target_prefix is None else ("prefix", "prefix_lengths")

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
            **dict(zip(self.prefix_keys, self.setup.prefix_state(self.controls))),
        )
        stages = self._stage_sizes(batch)
        if self.decoder.grows or stages:  # the finished pools of the sentences that left, in input order
            state["results"] = (sequences, no_scores, no_scores)
        for size in stages:  # the fixed cache: a smaller batch once at most `size` sentences are live
            state = ops.while_loop(functools.partial(self._more_live_than, size), self._body, (state,))[0]
            state = self._compact(state, size)
        final = _while_loop(self._not_done, self._body, (state,), self.decoder.grows)[0]
        if not (self.decoder.grows or stages):
            return final["finished"], final["finished_scores"], final["finished_log_probs"]
        # The sentences still in the loop (stopped by max_len) join the results.
        return self._write_results(final, ops.arange(ops.shape(final["sentences"])[0], dtype="int32"))

    def _body(self, state):
        return (self._step(state),)

    def _stage_sizes(self, batch):
        """The batch sizes a fixed-cache search shrinks to as its sentences finish: halvings of
        `batch` down to 1 (none with a growing cache, whose finished sentences leave every step)."""
        if self.decoder.grows or not isinstance(self.decoder, _CachedDecoder):
            return []
        if isinstance(batch, int):
            halvings = max(batch - 1, 0).bit_length()
        else:
            halvings = STAGED_HALVINGS
        return [(batch + 2**k - 1) // 2**k for k in range(1, halvings + 1)]

    def _more_live_than(self, size, state):
        live = ops.sum(ops.cast(ops.logical_not(state["done"]), "int32"))
        return ops.logical_and(self._not_done(state), live > size)

    def _compact(self, state, size):
        """`state` with its first `size` sentences the live ones (then finished ones, to fill):
        static shapes. The pools of all go into the results first (a live sentence's is written
        again when it finishes)."""
        rows = ops.shape(state["done"])[0]
        state = dict(state, results=self._write_results(state, ops.arange(rows, dtype="int32")))
        order = ops.where(state["done"], rows, 0) + ops.arange(rows, dtype="int32")
        staying = ops.cast(ops.top_k(-order, k=size)[1], "int32")  # (size,) live first, in order
        beams = staying[:, None] * self.beam_size + ops.arange(self.beam_size, dtype="int32")
        state["decoder_state"] = self.decoder.select_rows(state["decoder_state"], ops.reshape(beams, (-1,)))
        state["last"] = ops.reshape(state["last"], (rows, self.beam_size))
        state = self._keep(state, staying)
        state["last"] = ops.reshape(state["last"], (-1,))
        return state

    def _not_done(self, state):
        return ops.logical_and(state["step"] < self.setup.max_len, ops.logical_not(ops.all(state["done"])))

    def _sentence_done(self, step, limits, alive_log_probs, finished_scores):
        """`policy.search_is_final` before decoding position `step` `(sentences,)`."""
        limits = ops.cast(limits, "float32")
        return search_is_final(
            step, limits, alive_log_probs, finished_scores, self.alpha, ops, self.early_stopping
        )

    def _step(self, state):
        beam, step, limits = self.beam_size, state["step"], state["limits"]
        sentences = ops.shape(limits)[0]
        logits, decoder_state = self.decoder.step(state["last"], state["alive"], step, state["decoder_state"])
        vocab = self.config.target_vocab
        if self._from_logits():
            top_log_probs, top_index = _top_candidates_of_logits(
                self.setup, logits, state["alive_log_probs"], step, limits, beam
            )
        else:
            prefix = [state[key] for key in self.prefix_keys]
            log_probs = self.setup.step_log_probs(
                logits, state["alive"], step, limits, self.controls, *prefix
            )
            candidates = ops.reshape(
                state["alive_log_probs"][:, :, None] + log_probs, (sentences, beam * vocab)
            )
            top_log_probs, top_index = _top_candidates(candidates, beam)  # (sentences, beam)
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

    def _from_logits(self):
        """Whether a step's best candidates come from `_top_candidates_of_logits`: under XLA, with
        static shapes and no control acting on the logits (the rules alone)."""
        controls = self.controls
        return (
            _compiled_by_xla()
            and isinstance(self.setup.batch, int)
            and self.setup.suppressed is None
            and controls.target_prefix is None
            and controls.suppress_sequences is None
            and not _on(controls.no_repeat_ngram_size, 0)
            and not _on(controls.repetition_penalty, 1.0)
            and self.config.target_vocab > 4 * TOP_K_BLOCK
        )

    def _leave(self, state, staying):
        """`state` without the sentences not in `staying`, whose pools go into the results."""
        state = dict(
            state, results=self._write_results(state, ops.cast(ops.where(state["done"])[0], "int32"))
        )
        return self._keep(state, staying)

    def _keep(self, state, staying):
        """`state` (a new dict) of the sentences `staying` `(kept,)` only: the per-sentence tensors,
        `last` `(sentences, beam)` and the decoder's per-sentence state (its per-beam rows are
        the caller's: `reorder`, or `select_rows` when the fixed cache's batch shrinks)."""
        state = dict(state)
        for key in self.SENTENCE_KEYS + self.prefix_keys + ("last",):
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
