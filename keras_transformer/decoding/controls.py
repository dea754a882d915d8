"""The decoding controls a request can switch on, written once for every runtime.

Each control is defined as CTranslate2 defines it (`src/decoding_utils.cc`,
`src/decoding.cc`), so the CTranslate2 export maps it one to one:

- `target_prefix`: while a sentence's output is shorter than its prefix, the
  prefix's next token is the only possibility (it wins over every ban); the
  search then goes on freely. Its log-probabilities count in the score.
- `suppress_sequences`: a one-token sequence is never output; a longer one's
  last token is impossible where the output ends with the sequence's other tokens.
- `disable_unk`: `<unk>` is never output.
- `no_repeat_ngram_size` n: the tokens that would repeat an n-gram of the output
  are impossible.
- `repetition_penalty` p: before the softmax, the logit `s` of every token
  already in the output becomes `s * p` if `s < 0`, else `s / p`.

As in CTranslate2 (`DisableTokens`), a control's banned token gets
`policy.NEG_INF` on the logits, before the softmax: the tokens left share the
whole probability, and a search's choices and scores are CTranslate2's. The
rules of `policy.constrain` (padding and BOS never, EOS before `min_length`,
EOS at the length limit) apply after it, as without controls, so a request
without controls gets the scores it always got. Like `policy`, this module imports nothing: its functions take
the array namespace `xp` (`numpy` or `keras.ops`), and `DecodingOptions` is
plain Python, so the Keras search, the exported graphs and the NumPy driver of
the ONNX step graphs (`keras_transformer_export.onnx_runtime`) share it.

Shape legend: sentences, beam (1 for greedy search and sampling), length =
output positions, vocab; `history` `(sentences, beam, length)` holds the
tokens output so far (positions >= `step` are padding).
"""

import dataclasses
import numbers
import operator
from typing import NamedTuple

from keras_transformer.decoding.policy import BEAM_SIZE, LENGTH_PENALTY, MAX_EXTRA_LENGTH, NEG_INF

# Ids a prefix or a banned sequence may not hold (names of `TransformerConfig` fields): padding
# pads them; BOS is never output; EOS ends every output (a prefix is continued, and EOS is forced
# at the length limit whatever is banned).
RESERVED_IDS = ("pad_id", "bos_id", "eos_id")


@dataclasses.dataclass(frozen=True)
class DecodingOptions:
    """What one request may choose, with the defaults that give §6.1's beam search.

    Attributes:
        length_penalty: α of GNMT's penalty `((5 + length) / 6) ** α` (0: none).
        max_extra_length: output tokens beyond the source length (EOS included).
        min_length: EOS is impossible before this many output tokens (EOS included).
        num_return: hypotheses per sentence: the n best of the beam (at most `beam_size`),
            or `num_return` independent samples.
        disable_unk, no_repeat_ngram_size, repetition_penalty: the module docstring's
            controls (0 and 1.0: off); the per-sentence `target_prefix` and the
            `suppress_sequences` are token lists given beside the options.
        sampling_topk: 1 searches (beam search, greedy with a beam of 1); K > 1 samples
            from the K likeliest tokens, 0 from the whole vocabulary.
        sampling_topp: samples from the smallest set of those whose probability reaches p.
        sampling_temperature: divides the log-probabilities before sampling.
        seed: the samples are a function of (seed, sentence index, sample index, step).
        return_alignments: also return each output token's most attended source position.
        early_stopping: a sentence's beam search ends as soon as its pool holds `beam_size`
            finished hypotheses (CTranslate2's rule, Hugging Face's `early_stopping=True`),
            not when no live hypothesis can still beat them (`policy.search_is_final`).
    """

    length_penalty: float = LENGTH_PENALTY
    max_extra_length: int = MAX_EXTRA_LENGTH
    min_length: int = 0
    num_return: int = 1
    disable_unk: bool = False
    no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0
    sampling_topk: int = 1
    sampling_topp: float = 1.0
    sampling_temperature: float = 1.0
    seed: int = 0
    return_alignments: bool = False
    early_stopping: bool = False

    @property
    def sampling(self):
        """Whether tokens are sampled (`sampling_topk != 1`) rather than searched."""
        return self.sampling_topk != 1

    def check(self, beam_size=BEAM_SIZE):
        """Raises `ValueError` naming the first bad option (what was wrong, what is allowed)."""
        for name, kind in OPTION_TYPES.items():
            value = getattr(self, name)
            if isinstance(value, bool) != (kind is bool) or not isinstance(value, _KINDS[kind]):
                raise ValueError(f"{name} must be {_KIND_NAMES[kind]}; got {value!r}.")
            largest = _LARGEST.get(OPTION_DTYPES[name])
            if largest is not None and value > largest:  # beyond its graph dtype: one line, not an overflow
                raise ValueError(f"{name} must be at most {largest}; got {value!r}.")
        for name, allowed in option_rules(beam_size):
            if not option_holds(self, name, beam_size, PYTHON_COMPARISONS):
                raise ValueError(f"{name} must be {allowed}; got {getattr(self, name)!r}.")
        return self

    def replace(self, **changes):
        """These options with `changes` (unknown names are refused with the valid ones listed)."""
        names = [field.name for field in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise ValueError(f"unknown decoding option(s) {unknown}; the options are {names}.")
        return dataclasses.replace(self, **changes)


class Hypotheses(NamedTuple):
    """A request's results in every runtime, best first (samples: in sample order).

    ids: int32 `(batch, num_return, max_len)`, EOS-terminated, padded after EOS.
    scores: float32 `(batch, num_return)`: log-probability / GNMT length penalty.
    log_probs: float32 `(batch, num_return)`; at `policy.NEG_INF` or below for a
        hypothesis that does not exist (fewer than `num_return` do: a prefix up to the
        length limit leaves few continuations).
    alignments: int32 `(batch, num_return, max_len)`: for each output token before EOS,
        the source position it attends to most; -1 elsewhere. None when not asked for.
    """

    ids: object
    scores: object
    log_probs: object
    alignments: object = None


class Hypothesis(NamedTuple):
    """One translation of a sentence, as the text interfaces return it (`Translator`,
    `OnnxTranslator`, `CTranslate2Translator`'s `translate_hypotheses`).

    text: the translation. score: log-probability / GNMT length penalty.
    log_prob: the log-probability of the output (EOS included).
    alignment: with `return_alignments`, sorted `(source word, target word)` index pairs
        (`keras_transformer.decoding.alignments.word_alignment`), else None.
    """

    text: str
    score: float
    log_prob: float
    alignment: list = None


def sentence_hypotheses(texts, scores, log_probs, alignments=None):
    """The `Hypothesis` list of one sentence from its `num_return` results, best first: a result
    at `NEG_INF` is none (fewer exist), except the first (there is always one)."""
    alignments = alignments if alignments is not None else [None] * len(texts)
    fields = zip(texts, map(float, scores), map(float, log_probs), alignments)
    return [Hypothesis(*values) for i, values in enumerate(fields) if i == 0 or values[2] > NEG_INF / 2]


def check_prefix_lengths(prefix_lengths, source_lengths, max_length, max_extra_length, indices=None):
    """Raises `ValueError` for the first prefix that leaves no room for EOS in its sentence's
    output limit (`policy.output_limits`): lengths are Python ints per sentence, `indices` the
    sentences' indices in the request (default their order)."""
    indices = range(len(prefix_lengths)) if indices is None else indices
    for index, length, source in zip(indices, prefix_lengths, source_lengths):
        limit = min(max(source + max_extra_length, 1), max_length)
        if length > limit - 1:
            raise ValueError(
                f"target_prefix of sentence {index} has {length} pieces, more than its output limit "
                f"allows ({limit} tokens with EOS: source length + max_extra_length, at most the "
                f"model's max_length); raise max_extra_length or shorten the prefix."
            )


OPTION_TYPES = {field.name: field.type for field in dataclasses.fields(DecodingOptions)}
# The graph dtype of each option, in every runtime (the seed is int64: any 63-bit seed); a
# request's value is converted to it, whatever Python type it came as (`1` for a float option).
OPTION_DTYPES = {
    name: "int64" if name == "seed" else {int: "int32", float: "float32", bool: "bool"}[kind]
    for name, kind in OPTION_TYPES.items()
}
_LARGEST = {"int32": 2**31 - 1, "int64": 2**63 - 1}


_KINDS = {int: numbers.Integral, float: numbers.Real, bool: bool}
_KIND_NAMES = {int: "an integer", float: "a number", bool: "True or False"}


# The range of every option: `(name, comparison, bound)`, written once for `DecodingOptions.check`
# (Python values) and the exported graphs' checks (tensors): `option_holds`.
OPTION_RULES = (
    ("max_extra_length", ">=", 0),
    ("min_length", ">=", 0),
    ("no_repeat_ngram_size", ">=", 0),
    ("seed", ">=", 0),
    ("sampling_topk", ">=", 0),
    ("num_return", "num_return", 1),
    ("length_penalty", ">=", 0.0),
    ("repetition_penalty", ">", 0.0),
    ("sampling_topp", "in (0, 1]", None),
    ("sampling_temperature", ">", 0.0),
)


def option_rules(beam_size):
    """`(name, allowed)` of each rule in `OPTION_RULES`, `allowed` in words."""
    words = {
        ">=": "{kind} >= {bound}",
        ">": "a number > {bound}",
        "in (0, 1]": "a number in (0, 1]",
        "num_return": f"in [1, beam size {beam_size}] (sampling, with sampling_topk != 1, may return more)",
    }
    return [
        (
            name,
            words[comparison].format(
                kind="an integer" if isinstance(bound, int) else "a number", bound=bound
            ),
        )
        for name, comparison, bound in OPTION_RULES
    ]


def option_holds(options, name, beam_size, xp):
    """Whether the rule of option `name` holds: a Python bool, or a bool tensor for tensor
    options (`xp` `keras.ops`, `tf.math`, or `operator`-like `PYTHON_COMPARISONS`)."""
    _, comparison, bound = next(rule for rule in OPTION_RULES if rule[0] == name)
    value = getattr(options, name)
    if comparison == ">=":
        return xp.greater_equal(value, bound)
    if comparison == ">":
        return xp.greater(value, bound)
    if comparison == "in (0, 1]":
        return xp.logical_and(xp.greater(value, 0.0), xp.less_equal(value, 1.0))
    sampling = xp.not_equal(options.sampling_topk, 1)
    return xp.logical_and(
        xp.greater_equal(value, 1), xp.logical_or(sampling, xp.less_equal(value, beam_size))
    )


def _both(a, b):
    return a and b


def _either(a, b):
    return a or b


class PYTHON_COMPARISONS:  # noqa: N801 (a namespace, used like a module)
    """The comparisons of `option_holds` on Python numbers."""

    greater_equal = staticmethod(operator.ge)
    greater = staticmethod(operator.gt)
    less_equal = staticmethod(operator.le)
    not_equal = staticmethod(operator.ne)
    logical_and = staticmethod(_both)
    logical_or = staticmethod(_either)


def padded_token_lists(lists, pad_id):
    """Token lists as equal-length rows (lists) padded with `pad_id`, at least one column wide
    (so that column 0 exists for an empty list)."""
    width = max([len(ids) for ids in lists] + [1])
    return [list(ids) + [pad_id] * (width - len(ids)) for ids in lists]


def check_token_lists(name, lists, vocab_size, reserved):
    """Raises `ValueError` unless every id of `lists` (lists of ints) is in the vocabulary and
    not `reserved` (`RESERVED_IDS`' values)."""
    for number, ids in enumerate(lists):
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, numbers.Integral):
                raise ValueError(f"{name}[{number}] must hold integer ids; got {token!r}.")
            if not 0 <= token < vocab_size or token in reserved:
                raise ValueError(
                    f"{name}[{number}] holds id {token}: ids must be in [0, {vocab_size}) and not "
                    f"padding, BOS or EOS ({sorted(reserved)})."
                )


# ----------------------------------------------------------------------------- the rules


def forced_prefix(log_probs, raw_log_probs, step, prefix, prefix_lengths, xp):
    """The prefix rule: where `step < prefix_lengths`, the prefix token is the only possibility
    and keeps its log-probability before any ban (`raw_log_probs`).

    log_probs, raw_log_probs: `(sentences, beam, vocab)`; prefix: int `(sentences, width)`
    (padded; width >= 1); prefix_lengths: int `(sentences,)`.
    """
    column = xp.minimum(step, xp.shape(prefix)[1] - 1)
    forced = xp.expand_dims(xp.take(prefix, xp.reshape(column, (1,)), axis=1), -1)  # (sentences, 1, 1)
    active = xp.reshape(xp.less(step, prefix_lengths), (-1, 1, 1))
    ids = xp.arange(log_probs.shape[-1])  # vocab: static
    only_forced = xp.where(xp.equal(ids, forced), raw_log_probs, NEG_INF)
    return xp.where(active, only_forced, log_probs)


def repetition_penalized(logits, history, step, penalty, pad_id, xp):
    """CTranslate2's repetition penalty on `logits` `(sentences, beam, vocab)`: each token of
    `history[..., :step]` has its logit `s` made `s * penalty` if `s < 0`, else `s / penalty`
    (once, however often it occurs).

    Only the history's entries are touched: their logits gathered, penalized and written back
    (a token written twice gets the same value twice); the positions from `step` on write
    padding's logit back unchanged (padding is never output)."""
    valid = xp.less(xp.arange(xp.shape(history)[-1]), step)
    columns = xp.where(valid, history, pad_id)  # (sentences, beam, length)
    seen = xp.take_along_axis(logits, columns, axis=-1)
    penalized = xp.where(xp.less(seen, 0.0), seen * penalty, seen / penalty)
    return set_columns(logits, columns, xp.where(valid, penalized, seen), xp)


def repeated_ngram_ends(history, step, size, xp):
    """`(tokens, banned)` `(sentences, beam, length)`: the tokens that would end an n-gram (n =
    `size`) already in `history[..., :step]` are those where `banned` (CTranslate2's
    `NoRepeatNgram`; n = 1 bans every token output so far; 0 bans nothing). `ban` applies them.

    Position p of the output ends a repeat when its `size - 1` predecessors equal the output's
    last `size - 1` tokens: `history[p - i] == history[step - i]` for i = 1 .. size - 1.
    """
    length = xp.shape(history)[-1]
    positions = xp.arange(length)
    lags = xp.arange(1, length + 1)  # i
    earlier = xp.take(history, xp.clip(positions[:, None] - lags[None, :], 0, length - 1), axis=-1)
    last = xp.take(history, xp.clip(step - lags, 0, length - 1), axis=-1)  # (sentences, beam, length)
    equal = xp.logical_or(xp.equal(earlier, xp.expand_dims(last, -2)), xp.greater_equal(lags, size))
    ends = xp.logical_and(
        xp.all(equal, axis=-1),  # (sentences, beam, length): predecessors match
        xp.logical_and(xp.greater_equal(positions, size - 1), xp.less(positions, step)),
    )
    ends = xp.logical_and(ends, xp.logical_and(xp.greater(size, 0), xp.greater_equal(step, size - 1)))
    return history, ends


def sequence_ends(history, step, sequences, sequence_lengths, xp):
    """`(tokens, banned)` `(sentences, beam, count)`: the last tokens of the banned `sequences`
    `(count, width)` of 2 or more tokens (`sequence_lengths` `(count,)`; one-token sequences
    are in the `never` mask of `policy.constrain`), banned where their other tokens end
    `history[..., :step]`. `ban` applies them."""
    width = xp.shape(sequences)[-1]
    heads = sequence_lengths - 1  # tokens before the banned one
    offsets = xp.arange(width)
    places = step - heads[:, None] + offsets[None, :]  # (count, width): output position of token j
    length = xp.shape(history)[-1]
    taken = xp.take(history, xp.reshape(xp.clip(places, 0, length - 1), (-1,)), axis=-1)
    taken = xp.reshape(taken, tuple(xp.shape(history)[:-1]) + tuple(xp.shape(sequences)))  # (s, b, n, w)
    equal = xp.logical_or(xp.equal(taken, sequences), xp.greater_equal(offsets, heads[:, None]))
    matched = xp.logical_and(
        xp.all(equal, axis=-1), xp.logical_and(xp.greater_equal(heads, 1), xp.greater_equal(step, heads))
    )  # (sentences, beam, count)
    last = xp.take_along_axis(sequences, xp.reshape(xp.maximum(heads, 0), (-1, 1)), axis=1)[:, 0]
    return xp.broadcast_to(last, xp.shape(matched)), matched


def ban(logits, tokens, banned, pad_id, xp):
    """`logits` `(sentences, beam, vocab)` with `NEG_INF` at the `tokens` `(sentences, beam, k)`
    where `banned`: one scatter, not a vocabulary-wide mask (the entries not banned write
    padding's own logit back to it: padding is never a banned token)."""
    columns = xp.where(banned, tokens, pad_id)
    kept = xp.take_along_axis(logits, columns, axis=-1)
    return set_columns(logits, columns, xp.where(banned, NEG_INF, kept), xp)


def banned_tokens(tokens, banned, vocab, xp):
    """bool `(sentences, beam, vocab)`: the mask of `ban` (for inspection and tests)."""
    return _hit_columns(tokens, banned, vocab, xp)


def set_columns(tensor, columns, updates, xp):
    """`tensor` `(..., vocab)` with `tensor[..., columns[..., k]] = updates[..., k]`: one scatter
    (`numpy.put_along_axis`, ONNX `ScatterND`); entries that write the same column twice
    must carry the same value (every runtime then agrees)."""
    if xp.__name__ == "numpy":
        result = tensor.copy()
        xp.put_along_axis(result, columns.astype("int64"), updates, axis=-1)
        return result
    shape = xp.shape(tensor)
    rows = 1
    for size in shape[:-1]:  # not -1: a reshape cannot infer it when the other size is 0
        rows = rows * size
    flat_columns = xp.reshape(columns, (rows, xp.shape(columns)[-1]))
    row_ids = xp.broadcast_to(xp.arange(rows)[:, None], xp.shape(flat_columns))
    indices = xp.reshape(xp.stack([row_ids, xp.cast(flat_columns, row_ids.dtype)], axis=-1), (-1, 2))
    flat = xp.scatter_update(xp.reshape(tensor, (rows, shape[-1])), indices, xp.reshape(updates, (-1,)))
    return xp.reshape(flat, shape)


def single_token_bans(sequences, sequence_lengths, vocab, xp):
    """bool `(vocab,)`: the tokens of the one-token `sequences` (always banned)."""
    one = xp.equal(sequence_lengths, 1)
    return _hit_columns(sequences[None, :, 0], one[None], vocab, xp)[0]


def _hit_columns(columns, valid, vocab, xp):
    """bool `(..., vocab)`: True at `columns[..., k]` (ids) where `valid[..., k]`.

    One scatter of ones into a `(rows, vocab + 1)` table (the invalid entries go to the extra
    column, which is dropped): duplicate ids write the same value, so every runtime agrees.
    """
    leading = tuple(xp.shape(columns)[:-1])
    rows = 1
    for size in leading:  # not -1: a reshape cannot infer it when the other size is 0
        rows = rows * size
    columns = xp.reshape(xp.where(valid, columns, vocab), (rows, xp.shape(columns)[-1]))
    if xp.__name__ == "numpy":
        table = xp.zeros((rows, vocab + 1), bool)
        xp.put_along_axis(table, columns.astype("int64"), True, axis=1)
    else:
        row_ids = xp.broadcast_to(xp.arange(rows)[:, None], xp.shape(columns))
        indices = xp.reshape(xp.stack([row_ids, xp.cast(columns, row_ids.dtype)], axis=-1), (-1, 2))
        table = xp.scatter_update(
            xp.zeros((rows, vocab + 1), "float32"), indices, xp.ones((xp.shape(indices)[0],), "float32")
        )
        table = xp.greater(table, 0.0)
    return xp.reshape(table[:, :vocab], leading + (vocab,))
