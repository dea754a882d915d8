"""One translation request's decoding: what the `Translator` and every exported graph run.

`decode(model, source_ids, options, ...)` applies a request's
`DecodingOptions` (`keras_transformer.decoding.controls`) to a batch of source
ids and always returns `Hypotheses` of shape `(batch, num_return, ...)`:

- a source with no content (`policy.empty_sources`) is not searched: its
  hypotheses are empty (EOS alone) with score 0; a batch of 0 gives 0 rows
  (the search runs on the others, which may be none);
- sampling (`sampling_topk != 1`) runs `search.sample`, else `search.beam_search`
  (beam 1: greedy search's tokens);
- the per-step controls (prefix, sequences of 2+ tokens, n-gram and repetition
  limits) are in the search only when some is on, so a request without them
  runs the plain search;
- alignments are computed when asked for (`align`).

The options may be Python values (each choice is then made here, in Python:
what XLA and JAX need) or tensors (an exported graph's inputs: each choice is a
graph conditional, `keras.ops.cond`, made once per request, never per step).
"""

import functools

import numpy as np
from keras import ops

from keras_transformer.decoding import policy
from keras_transformer.decoding.controls import DecodingOptions, Hypotheses
from keras_transformer.decoding.search import (
    Controls,
    beam_pools,
    inference,
    sample_rows,
    split_controls,
    when,
)
from keras_transformer.layers.masks import padding_mask
from keras_transformer.layers.portable_ops import argmax, gather_rows
from keras_transformer.model.ensemble import Ensemble
from keras_transformer.utils.checks import check_choice

# The searches `decode` chooses between (module docstring).
SEARCHES = ("beam", "beam_with_controls", "sample")


def _static(value):
    return value is None or isinstance(value, (bool, int, float, np.ndarray, list, tuple))


@inference
def decode(
    model,
    source_ids,
    options=None,
    beam_size=policy.BEAM_SIZE,
    target_prefix=None,
    suppress_sequences=None,
    sentence_ids=None,
    blank=None,
    cache_policy="auto",
    search=None,
    never=None,
):
    """Decodes `source_ids` int `(batch, len_src)` under `options` (module docstring).

    Args:
        model: a `Transformer`.
        options: a `DecodingOptions` (default: §6.1's), or any object with its attributes as tensors.
        beam_size: of the beam search (fixed per compiled function).
        target_prefix: one token list per sentence, or int `(batch, width)` padded with
            `pad_id`; suppress_sequences: token lists, or int `(count, width)` padded.
        sentence_ids: int `(batch,)`, each row's index in the request (sampling's key;
            default the row).
        blank: bool `(vocab,)`, `policy.blank_ids` of the tokenizer: sources made of these
            only are empty. None: every source is searched.
        cache_policy: of the searches.
        search: None (chosen per request), or one of `SEARCHES` whatever the options say
            (`"beam"`: the plain beam search, `"beam_with_controls"`, `"sample"`) and
            without alignments: the ONNX export converts each alone and chooses between
            them itself (`keras_transformer_export.onnx`).
        never: bool `(vocab,)`, `policy.never_output_ids` of the tokenizer: the ids no
            hypothesis holds (the special ids and the pieces of control characters). None:
            the model's `NEVER_OUTPUT` ids alone.

    Returns:
        `Hypotheses`.
    """
    config = model.config
    options = DecodingOptions() if options is None else options
    source_ids = ops.cast(ops.convert_to_tensor(source_ids), "int32")
    batch = ops.shape(source_ids)[0]
    sentence_ids = ops.arange(batch, dtype="int32") if sentence_ids is None else sentence_ids
    prefix = _padded(target_prefix, config.pad_id)
    if blank is None:
        return _decode(
            model,
            source_ids,
            options,
            beam_size,
            prefix,
            suppress_sequences,
            sentence_ids,
            cache_policy,
            search,
            never,
        )

    # Empty sources are not searched: the others are, and their results are written back.
    empty = policy.empty_sources(source_ids, ops.convert_to_tensor(blank), ops)
    keep = ops.cast(ops.where(ops.logical_not(empty))[0], "int32")
    length, extra = ops.shape(source_ids)[1], options.max_extra_length
    static = isinstance(length, int) and isinstance(extra, int)
    max_len = policy.output_limits(length, config.max_length, np if static else ops, extra)
    max_len = int(max_len) if static else max_len
    template = _empty_hypotheses(config, batch, options, max_len)

    # The search runs on the kept rows even when there are none (a graph conditional around
    # it would be cheaper then, but tf2onnx cannot convert that one: the search handles 0 rows).
    found = _decode(
        model,
        gather_rows(source_ids, keep),
        options,
        beam_size,
        None if prefix is None else gather_rows(prefix, keep),
        suppress_sequences,
        gather_rows(sentence_ids, keep),
        cache_policy,
        search,
        never,
    )
    return Hypotheses(
        *(
            None if full is None or part is None else ops.scatter_update(full, keep[:, None], part)
            for full, part in zip(template, found)
        )
    )


def _padded(prefix, pad_id):
    from keras_transformer.decoding.search import token_array

    return token_array(prefix, pad_id)


def _empty_hypotheses(config, batch, options, max_len):
    """`Hypotheses` of `batch` empty outputs (EOS alone, score 0)."""
    n = options.num_return
    ids = ops.concatenate(
        [
            ops.full((batch, n, 1), config.eos_id, "int32"),
            ops.full((batch, n, max_len - 1), config.pad_id, "int32"),
        ],
        axis=2,
    )
    zeros = ops.zeros((batch, n), "float32")
    alignments = None
    if not _static(options.return_alignments) or options.return_alignments:
        alignments = ops.full((batch, n, max_len), -1, "int32")
    return Hypotheses(ids, zeros, zeros, alignments)


def _decode(
    model, source_ids, options, beam_size, prefix, suppress_sequences, sentence_ids, cache_policy, search,
    never,
):  # fmt: skip
    """`decode` of sources that all have content."""
    o = options
    banned, controls = split_controls(
        model.config,
        disable_unk=o.disable_unk,
        suppress_sequences=suppress_sequences,
        target_prefix=prefix,
        no_repeat_ngram_size=o.no_repeat_ngram_size,
        repetition_penalty=o.repetition_penalty,
    )

    def sampled(controls):
        return Hypotheses(
            *sample_rows(
                model,
                source_ids,
                o.num_return,
                o.sampling_topk,
                o.sampling_topp,
                o.sampling_temperature,
                o.seed,
                sentence_ids,
                o.length_penalty,
                o.max_extra_length,
                o.min_length,
                None,
                True,
                cache_policy,
                banned,
                controls,
                never,
            )  # fmt: skip
        )

    def searched(controls, banned=banned):
        ids, scores, log_probs = beam_pools(
            model, source_ids, beam_size, o.length_penalty, o.max_extra_length, None, o.min_length, True,
            cache_policy, banned, controls, never, o.early_stopping,
        )  # fmt: skip
        n = o.num_return
        return Hypotheses(ids[:, :n], scores[:, :n], log_probs[:, :n])

    if search is not None:  # one search, as asked
        check_choice("search", search, SEARCHES)
        if search == "beam":  # no control at all: the search of a request with the defaults
            return searched(Controls(), banned=(False, None))
        return {"beam_with_controls": searched, "sample": sampled}[search](controls)

    def controlled():
        return searched(controls)

    def plain():
        return searched(Controls(), banned=(False, None))

    def sampling():  # with its controls (no-ops where off): a second sampling loop is not worth it
        return sampled(controls if not all(_static(v) for v in controls) or controls.any_on() else Controls())

    def searching():
        return when(_controls_on(model.config, controls, banned), controlled, plain)

    topk = o.sampling_topk
    result = when(topk != 1 if _static(topk) else ops.not_equal(topk, 1), sampling, searching)
    if _static(o.return_alignments):
        if not o.return_alignments:
            return result
        return result._replace(alignments=align(model, source_ids, result.ids))

    def aligned():
        return align(model, source_ids, result.ids)

    def unaligned():
        return ops.full(ops.shape(result.ids), -1, "int32")

    return result._replace(alignments=when(o.return_alignments, aligned, unaligned))


def search_choice(config, options, target_prefix, suppress_sequences):
    """`(sampling, with_controls)`: whether `decode` samples, and whether its beam search has the
    per-step controls, for a request (bools, or bool tensors for tensor options)."""
    banned, controls = split_controls(
        config,
        disable_unk=options.disable_unk,
        target_prefix=_padded(target_prefix, config.pad_id),
        suppress_sequences=suppress_sequences,
        no_repeat_ngram_size=options.no_repeat_ngram_size,
        repetition_penalty=options.repetition_penalty,
    )
    topk = options.sampling_topk
    return (topk != 1 if _static(topk) else ops.not_equal(topk, 1)), _controls_on(config, controls, banned)


def _controls_on(config, controls, banned):
    """Whether some control acts: a per-step one, `disable_unk` or a banned sequence (the plain
    search has none, so a request with the defaults pays for none); a Python bool where the
    controls are Python values."""
    disable_unk, sequences = banned
    prefix = controls.target_prefix
    if all(_static(v) for v in (*controls, disable_unk)) and (
        sequences is None or isinstance(sequences, np.ndarray)
    ):
        has_sequences = sequences is not None and bool(np.any(sequences != config.pad_id))
        return controls.any_on() or bool(disable_unk) or has_sequences
    lengths = None if sequences is None else Controls.lengths(sequences, config.pad_id)
    on = ops.logical_or(
        ops.not_equal(controls.no_repeat_ngram_size, 0), ops.not_equal(controls.repetition_penalty, 1.0)
    )
    on = ops.logical_or(on, ops.cast(disable_unk, "bool"))
    if prefix is not None:
        on = ops.logical_or(on, ops.any(ops.not_equal(prefix, config.pad_id)))
    if lengths is not None:
        on = ops.logical_or(on, ops.any(ops.greater(lengths, 0)))
    return on


@inference
def align(model, source_ids, target_ids):
    """For each token of each hypothesis, the source position its decoder attends to most:
    int32 `(batch, n, max_len)` (-1 at EOS and after).

    The cross-attention of the last decoder layer (fairseq's default alignment layer),
    its heads averaged, in one teacher-forced pass over the hypotheses: the weights the
    search computed for each token (a cached step equals the full pass), without
    keeping them during the search. For an `Ensemble`, the mean of its members' weights.

    Args:
        source_ids: int `(batch, len_src)`; target_ids: int `(batch, n, max_len)`,
            EOS-terminated and padded.
    """
    config = model.config
    shape = ops.shape(target_ids)
    n, length = shape[1], shape[2]
    targets = ops.reshape(target_ids, (-1, length))  # (rows, max_len)
    bos = ops.full((ops.shape(targets)[0], 1), config.bos_id, "int32")
    inputs = ops.concatenate([bos, targets[:, :-1]], axis=1)
    memory_mask = ops.repeat(padding_mask(source_ids, config.pad_id), n, axis=0)
    weights = []  # each model's last cross-attention, heads averaged (rows, max_len, len_src)
    for member in model.members if isinstance(model, Ensemble) else [model]:  # an ensemble's: their mean
        memory = ops.repeat(member.encode(source_ids, training=False), n, axis=0)
        _, _, cross = member.decoder(
            member.target_embedding(inputs),
            memory,
            padding_mask(inputs, config.pad_id),
            memory_mask,
            return_weights=True,
            training=False,
        )
        weights.append(ops.mean(cross[-1], axis=1))
    attended = argmax(functools.reduce(ops.add, weights))  # (rows, max_len)
    before_eos = ops.equal(ops.cumsum(ops.cast(ops.equal(targets, config.eos_id), "int32"), axis=1), 0)
    return ops.reshape(ops.where(before_eos, attended, -1), shape)
