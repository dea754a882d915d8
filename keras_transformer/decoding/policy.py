"""The decoding policy, written once: §6.1's defaults, the length penalty, the output-length rule,
which ids may be output, and when a beam search is final.

"We used beam search with a beam size of 4 and length penalty α = 0.6 [...]
We set the maximum output length during inference to input length + 50, but
terminate early when possible." (§6.1; the penalty is GNMT's, Wu et al. 2016.)

Every search that claims to give the model's translation uses these
definitions: the Keras search (`keras_transformer.decoding.search`, on any
backend and inside exported graphs), the NumPy driver of the ONNX step graphs
(`keras_transformer_export.onnx_runtime.SplitBeamSearch`) and the CTranslate2
translator, which re-ranks CTranslate2's hypotheses with `length_penalty`
(`keras_transformer_export.ctranslate2`). The rules that touch arrays take the
array namespace `xp` (`numpy` or `keras.ops`; the functions they call have
the same names and meaning in both).

The rules here are those every request obeys; the optional controls a request
can switch on (target prefix, banned sequences, n-gram and repetition limits)
are in `keras_transformer.decoding.controls`, random sampling in
`keras_transformer.decoding.sampling`, the same way.

Shape legend: sentences = sentences still searched, beam = beam_size.
"""

import unicodedata

import numpy as np

BEAM_SIZE = 4  # §6.1
LENGTH_PENALTY = 0.6  # α of `length_penalty`, §6.1
MAX_EXTRA_LENGTH = 50  # output tokens beyond the source length, §6.1

# "Impossible" log-probability; finite, so that 0 * NEG_INF stays 0.
NEG_INF = -1.0e9

# Self-attention cache of the incremental decoder (keras_transformer.layers.decoding_cache):
# "growing" (one position appended per step; finished sentences leave the batch), "fixed"
# (preallocated, static shapes: XLA and JAX) or "auto" (the backend's best).
CACHE_POLICIES = ("auto", "growing", "fixed")


def length_penalty(length, alpha):
    """GNMT's `((5 + length) / 6) ** alpha`: a hypothesis scores `log P / length_penalty(length)`.

    `length` counts output tokens, EOS included; a Python number, or a float
    array or tensor (its dtype is kept: float32 in every search). `alpha = 0`
    ranks by log-probability alone.
    """
    return ((5.0 + length) / 6.0) ** alpha


def output_limits(source_lengths, max_length, xp, max_extra_length=MAX_EXTRA_LENGTH):
    """Output tokens allowed per sentence, EOS included: `source length + max_extra_length`,
    within `[1, max_length]` (the model's positions). `source_lengths` counts non-pad ids."""
    return xp.clip(source_lengths + max_extra_length, 1, max_length)  # (sentences,)


# `<unk>`: the id of the characters a vocabulary lacks (the tokenizer's; the model's config
# names the other special ids). `disable_unk` bans it; an empty source may not hold it.
UNK_ID = 1

# The special ids no search outputs (names of `TransformerConfig` fields): padding, and BOS (a
# generated pad would also make cached decoding, which has no target padding mask, differ from a
# full forward pass). EOS is forced at a sentence's last allowed position (`output_limits`).
NEVER_OUTPUT = ("pad_id", "bos_id")


def control_piece(piece):
    """Whether a SentencePiece piece writes a control character: a byte-fallback piece `<0x..>`
    of an ASCII control byte (0x00-0x1F, 0x7F), or a piece holding a control character or a
    line or paragraph separator (Unicode categories Cc, Zl, Zp: a vocabulary trained without
    normalization may keep tabs, newlines or U+2028).

    No translation outputs one (`never_output_ids`): a NUL ended a translation early where the
    text passes through a C string (onnxruntime-extensions' detokenizer in `translate_text.onnx`)
    and nowhere else; a newline, carriage return or tab in a text the library or a server returns
    splits the line or the TSV column its user writes it to (`translate` itself writes
    line-breaking characters as spaces: `cli.one_line`). A C1 control or a line separator that
    several byte pieces spell together (`<0xC2><0x85>` is U+0085) is not prevented: that is a
    sequence, not a piece."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        byte = int(piece[3:5], 16)
        return byte < 0x20 or byte == 0x7F
    return any(unicodedata.category(character) in ("Cc", "Zl", "Zp") for character in piece)


def never_output_ids(id_to_piece, piece_count, special_ids, vocab_size=None):
    """`(vocab_size,)` list of bools: the ids no search outputs, in every runtime: `special_ids`
    (the model's ids of `NEVER_OUTPUT`) and the pieces of control characters (`control_piece`),
    given a SentencePiece model's `id_to_piece` and size `piece_count` (any runtime's;
    `vocab_size`, the model's output vocabulary, defaults to it: ids past the pieces are not
    control pieces). The special pieces of the vocabulary (`<pad>`, `<unk>`, `<s>`, `</s>`) are
    not control pieces: `<unk>` and EOS stay allowed."""
    specials = set(special_ids)
    vocab_size = piece_count if vocab_size is None else vocab_size
    return [i in specials or (i < piece_count and control_piece(id_to_piece(i))) for i in range(vocab_size)]


def constrain(log_probs, step, limits, never, is_eos, min_length, xp):
    """One step's log-probabilities with the output rules applied: impossible ids get `NEG_INF`.

    - the ids in `never` (`never_output_ids`: `NEVER_OUTPUT` and the pieces of control
      characters, or `NEVER_OUTPUT` alone where no tokenizer is known; plus a request's
      banned single tokens) are impossible;
    - EOS is impossible before `min_length` output tokens (EOS included), and
    - at a sentence's last allowed step EOS is the only possibility (this wins over `min_length`).

    The other log-probabilities are kept as they are (not renormalized, as fairseq does), so a
    hypothesis's score stays the model's log-probability of it.

    Written as `minimum(log_probs, cap)` with a cap of 0 (allowed) or `NEG_INF` (impossible)
    per sentence and id: the same values as `where(banned, NEG_INF, log_probs)` (a
    log-probability is at most 0 and, from finite logits, above `NEG_INF`), and in ONNX
    Runtime one broadcast `Min` instead of a broadcast `Where`, 3x faster on the
    `(sentences, beam, vocab)` tensor at batch 32 (the largest node of the search's step).
    The cap itself is built from float caps, the one per id (`never`) a constant of the
    graph and those per sentence `(sentences, 1[, 1])`: two passes over `(sentences, 1,
    vocab)` (a `Min` and the EOS column's `Where`), where the same rule on booleans
    (`where(is_eos, early, last or never)`) was converted by tf2onnx as eight (an `Or`, and a
    `where` of booleans as a float blend with four casts).

    Args:
        log_probs: float32 `(sentences, vocab)` or `(sentences, beam, vocab)`.
        step: output tokens decoded so far (scalar).
        limits: int `(sentences,)`, `output_limits`.
        never: bool `(vocab,)`; is_eos: bool `(vocab,)`.
        min_length: int scalar (0 or 1: no minimum).
        xp: `numpy` or `keras.ops`.
    """
    cap = output_caps(step, limits, never, is_eos, min_length, len(log_probs.shape), log_probs.dtype, xp)
    return xp.minimum(log_probs, cap)


def output_caps(step, limits, never, is_eos, min_length, rank, dtype, xp):
    """`constrain`'s caps: 0 where an id is allowed, `NEG_INF` where it is impossible, float
    `(sentences, vocab)` for `rank` 2 and `(sentences, 1, vocab)` for `rank` 3 (the arguments
    as `constrain`'s; `dtype` the log-probabilities')."""
    last, early = _sentence_states(step, limits, min_length, rank, xp)
    return _caps_of(last, early, never, is_eos, dtype, xp)


def _sentence_states(step, limits, min_length, rank, xp):
    """Which sentences are at their last allowed step, and which are before `min_length` (and
    not at their last step): bool `(sentences, 1[, 1])` each, `rank` dimensions (`None`: as
    `step` and `limits` broadcast)."""
    last = xp.greater_equal(step, limits - 1)
    if rank is not None:
        last = xp.reshape(last, (-1,) + (1,) * (rank - 1))
    early = xp.logical_and(xp.less(step, min_length - 1), xp.logical_not(last))
    return last, early


def _caps_of(last, early, never, is_eos, dtype, xp):
    """The caps of sentences in the states `last`, `early` (`_sentence_states`)."""
    impossible, allowed = xp.full((), NEG_INF, dtype), xp.zeros((), dtype)
    id_cap = xp.where(never, impossible, allowed)  # (vocab,)
    others = xp.minimum(id_cap, xp.where(last, impossible, allowed))  # (sentences, 1[, 1], vocab)
    return xp.where(is_eos, xp.where(early, impossible, allowed), others)


def output_cap_rows(never, is_eos, rank, dtype):
    """`output_caps` of the three states a sentence can be in, as a NumPy table to index with
    `output_cap_row`: float `(3, vocab)` for `rank` 2, `(3, 1, vocab)` for `rank` 3: a sentence
    neither early nor last, one before `min_length`, one at its last step. `never`, `is_eos`:
    NumPy bool `(vocab,)`.

    For a graph whose `never` and `is_eos` are constants: `take(rows, output_cap_row(...),
    axis=0)` has `output_caps`' values, one row `Gather` per step instead of two broadcast
    passes over `(sentences, 1, vocab)` (`export/lean_search.py`)."""
    states = ((False, False), (False, True), (True, False))  # (last, early) of rows 0, 1, 2
    rows = [_caps_of(last, early, never, is_eos, dtype, np) for last, early in states]
    return np.stack(rows).reshape((3,) + (1,) * (rank - 2) + (-1,))


def output_cap_row(step, limits, min_length, xp):
    """Each sentence's row of `output_cap_rows` `(sentences,)`: 0 (neither), 1 (before
    `min_length`), 2 (at its last step); arguments as `constrain`'s. With `step` a column of
    steps `(steps, 1)`: the rows at each of them `(steps, sentences)` (a table a graph can
    compute once and index by step)."""
    last, early = _sentence_states(step, limits, min_length, None, xp)
    return xp.where(last, 2, xp.where(early, 1, 0))


def blank_piece(piece):
    """Whether a SentencePiece piece carries no content: only the word boundary `▁`, whitespace,
    or control and format characters (a byte-fallback piece `<0x..>` of an ASCII control byte or
    space too). The special pieces are judged by `blank_ids`."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        byte = int(piece[3:5], 16)
        return byte <= 0x20 or byte == 0x7F
    return all(
        character.isspace() or unicodedata.category(character) in ("Cc", "Cf", "Zs", "Zl", "Zp")
        for character in piece.replace("\u2581", " ")
    )


def blank_ids(id_to_piece, vocab_size, unk_id=UNK_ID):
    """`(vocab,)` list of bools: the ids an empty source may consist of (`blank_piece`, and
    every special id but `<unk>`, which stands for a character the vocabulary lacks), given a
    SentencePiece model's `id_to_piece` (any runtime's: tf-text, `sentencepiece`)."""
    specials = ("<pad>", "<s>", "</s>")
    pieces = [id_to_piece(i) for i in range(vocab_size)]
    return [i != unk_id and (piece in specials or blank_piece(piece)) for i, piece in enumerate(pieces)]


def empty_sources(source_ids, blank, xp):
    """Which sources have no content `(batch,)` bool: every id is blank (`blank_ids`, as an
    array `(vocab,)`; padding and EOS are). Such a source is not searched: its translation is
    empty (EOS alone) with score 0, in every runtime. `source_ids` must be in the vocabulary."""
    return xp.all(xp.take(blank, source_ids, axis=0), axis=1)


# Above the score of every empty slot of a pool (`NEG_INF` divided by a length penalty no larger
# than the sentence's limit's) and below every hypothesis's: `search_is_final`'s early stopping.
FULL_POOL = 0.5 * NEG_INF
FLOAT32_MAX = 3.4028235e38


def search_is_final(step, limits, alive_log_probs, finished_scores, alpha, xp, early_stopping=False):
    """Whether each sentence's beam search is final before decoding position `step`: `(sentences,)` bool.

    A live hypothesis can at best keep its log-probability and get the
    largest length penalty its sentence allows, so once the worst of the
    `beam` finished hypotheses scores at least the best live one divided by
    that penalty, none can enter the pool. The best live one is the maximum
    over the beam, not slot 0: a slot whose candidate ended in EOS is dead
    (`NEG_INF`) for a step. A sentence that reached its limit is final too.

    With `early_stopping` a sentence is also final as soon as its pool holds
    `beam` finished hypotheses, whether or not a live one could still beat
    them: CTranslate2's rule (`src/decoding.cc`: a batch is finished once
    `beam_size` hypotheses are) and Hugging Face's `early_stopping=True`.
    Fewer steps; the result can differ where a longer hypothesis would have
    won. Off (a Python `False`), the rule adds nothing to a graph.

    Args:
        step: tokens decoded so far (an int or a scalar tensor).
        limits: float32 `(sentences,)`, `output_limits` as floats.
        alive_log_probs: float32 `(sentences, beam)`.
        finished_scores: float32 `(sentences, beam)`, best first (`NEG_INF`: empty slot).
        alpha: `length_penalty`'s α.
        xp: `numpy` or `keras.ops`.
        early_stopping: a bool, or a scalar bool tensor (a request's option).
    """
    penalty = length_penalty(limits, alpha)
    best_alive = xp.max(alive_log_probs, axis=1) / penalty
    if early_stopping is True:
        best_alive = xp.minimum(best_alive, FULL_POOL / penalty)
    elif early_stopping is not False:
        best_alive = xp.minimum(best_alive, xp.where(early_stopping, FULL_POOL / penalty, FLOAT32_MAX))
    return xp.logical_or(xp.greater_equal(finished_scores[:, -1], best_alive), xp.greater_equal(step, limits))
