"""Text in, text out: tokenize, beam search (§6.1) in a compiled graph,
detokenize; what `keras-transformer translate` and `evaluate` run.

Sentences are sorted by length and translated in batches (less padding),
then put back in input order. A source longer than the model's `max_length`
ids is truncated to it (EOS kept last): the model has no positions beyond.
"""

import dataclasses
import re
import types
from typing import NamedTuple

import numpy as np
from keras import ops

from keras_transformer.decoding import controls, policy
from keras_transformer.decoding.alignments import word_alignment
from keras_transformer.decoding.controls import (
    OPTION_TYPES,
    RESERVED_IDS,
    DecodingOptions,
    check_prefix_lengths,
    check_token_lists,
    option_holds,
    option_rules,
    sentence_hypotheses,
)
from keras_transformer.decoding.request import decode
from keras_transformer.decoding.search import token_array
from keras_transformer.utils.tensorflow import import_tensorflow

tf = import_tensorflow("Translator (the tf-text tokenizer in a tf.function)")


def log_likelihood(model, source_ids, target_pieces):
    """log p(target | source) of each pair `(batch,)` float32: the sum of the log-probabilities of
    the target's tokens and its EOS under teacher forcing (the quantity beam search maximizes
    before the length penalty).

    Args:
        model: a `Transformer`.
        source_ids: int32 `(batch, len_src)`, EOS-terminated and padded (`Tokenizer.encode`).
        target_pieces: int32 `tf.RaggedTensor` `(batch, None)`, the target's ids without BOS or
            EOS (`Tokenizer.tokenize`), at most `max_length - 1` of them.
    """
    config = model.config
    rows = target_pieces.nrows()
    labels = tf.concat([target_pieces, tf.fill([rows, 1], config.eos_id)], axis=1).to_tensor(config.pad_id)
    inputs = tf.concat([tf.fill([rows, 1], config.bos_id), target_pieces], axis=1).to_tensor(config.pad_id)
    logits = tf.cast(model({"source_ids": source_ids, "target_ids": inputs}, training=False), tf.float32)
    picked = tf.gather(tf.nn.log_softmax(logits, axis=-1), labels, batch_dims=2)  # (batch, len_tgt)
    return tf.reduce_sum(picked * tf.cast(tf.not_equal(labels, config.pad_id), tf.float32), axis=1)


class SentenceAttention(NamedTuple):
    """`Translator.attention`'s result.

    weights: dict of per-layer lists of `(1, num_heads, len_q, len_k)` arrays:
        `encoder_self`, `decoder_self`, `decoder_cross` (`Transformer.attention_weights`).
    source_pieces, target_pieces: the SentencePiece pieces along the axes
        (the target starts with BOS).
    target: the target sentence (the model's translation unless one was given).
    """

    weights: dict
    source_pieces: list
    target_pieces: list
    target: str


# The graph dtype of each `DecodingOptions` field (`controls.OPTION_DTYPES`).
OPTION_DTYPES = {name: tf.as_dtype(dtype) for name, dtype in controls.OPTION_DTYPES.items()}


def option_specs():
    """The `tf.TensorSpec` of every `DecodingOptions` field (a scalar named after it), in order."""
    return [tf.TensorSpec([], OPTION_DTYPES[name], name=name) for name in OPTION_TYPES]


def option_tensors(options):
    """`{name: scalar tensor}` of a `DecodingOptions`, in the dtypes of `option_specs`."""
    return {name: tf.constant(getattr(options, name), OPTION_DTYPES[name]) for name in OPTION_TYPES}


def checked_request(config, beam_size, source_ids, options, target_prefix, suppress_sequences):
    """`source_ids` once the request is checked in the graph (`InvalidArgument` otherwise).

    Every `controls.option_rules` rule, the ids of the prefix and the banned sequences
    (in the vocabulary, not padding/BOS/EOS inside them) and each prefix's length (at most
    its sentence's output limit - 1, leaving room for EOS). Each check is a
    `tf.debugging.Assert` with the message (TensorFlow, TF Serving) and a gather named
    after it that reads out of range when the check fails: ONNX has no assertion op
    (tf2onnx drops `Assert`), and ONNX Runtime's error then names the failed check.
    """
    checks = [
        (option_holds(options, name, beam_size, tf.math), f"{name} must be {allowed}")
        for name, allowed in option_rules(beam_size)
    ]
    for name, ids in (("target_prefix", target_prefix), ("suppress_sequences", suppress_sequences)):
        reserved = [getattr(config, key) for key in RESERVED_IDS if key != "pad_id"]
        inside = tf.logical_and(ids >= 0, ids < config.target_vocab)
        ok = tf.reduce_all(tf.logical_and(inside, tf.reduce_all(tf.not_equal(ids[..., None], reserved), -1)))
        checks.append((ok, f"{name} ids must be in [0, {config.target_vocab}) and not BOS or EOS"))
    lengths = tf.reduce_sum(tf.cast(tf.not_equal(source_ids, config.pad_id), tf.int32), axis=1)
    limits = policy.output_limits(lengths, config.max_length, ops, options.max_extra_length)
    prefix_lengths = tf.reduce_sum(tf.cast(tf.not_equal(target_prefix, config.pad_id), tf.int32), axis=1)
    checks.append(
        (
            tf.logical_or(
                tf.equal(tf.shape(target_prefix)[1], 0), tf.reduce_all(prefix_lengths <= limits - 1)
            ),
            "a target_prefix must be shorter than its sentence's output limit (source length + "
            "max_extra_length, at most the model's max_length)",
        )
    )
    total = tf.zeros([], source_ids.dtype)
    for ok, message in checks:
        with tf.control_dependencies([tf.debugging.Assert(ok, [message])]):
            index = tf.cast(tf.logical_not(ok), tf.int32)
        name = re.sub(r"[^A-Za-z0-9]+", "_", message)[:60].strip("_")
        total += tf.gather(tf.zeros([1], source_ids.dtype), tf.reshape(index, [1]), name=name)[0]
    return source_ids + total


class Translator:
    """Translates lists of strings with a trained `Transformer` and its `Tokenizer`.

    Args:
        model: a `Transformer`.
        tokenizer: the run's `Tokenizer`.
        beam_size: of the beam search, fixed per translator (4).
        batch_size: sentences per search call.
        jit_compile: compile the search with XLA (one program per set of options and
            input shape: sources are not padded to buckets here, unlike `translate_xla`).
        cache_policy: of the searches; `"auto"` grows the cache (finished
            sentences leave the batch) unless `jit_compile`.
        **options: `DecodingOptions` fields, this translator's defaults (§6.1's
            otherwise: `length_penalty` 0.6, `max_extra_length` 50); each call may
            change them.

    Without XLA, two search graphs, each traced when first asked for: one for the
    requests with these options and no prefix or banned sequence (the options Python
    values, so the controls they leave off are not in it: with the defaults, the
    plain beam search alone), one for every other request (every option an input: a
    new seed or length penalty is a new value, not a new graph). A new process's
    first batch with the defaults is ~3x faster than with one graph of every control
    (docs/decoding.md).
    """

    def __init__(
        self,
        model,
        tokenizer,
        beam_size=policy.BEAM_SIZE,
        batch_size=64,
        jit_compile=False,
        cache_policy="auto",
        **options,
    ):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.beam_size = beam_size
        self.options = DecodingOptions().replace(**options).check(beam_size)
        self.max_source_length = model.config.max_length
        pieces = tokenizer.processor.id_to_piece
        blank = np.array(policy.blank_ids(pieces, tokenizer.vocab_size), bool)
        specials = [getattr(model.config, name) for name in policy.NEVER_OUTPUT]
        never = policy.never_output_ids(pieces, tokenizer.vocab_size, specials, model.config.target_vocab)
        never = np.array(never, bool)

        def search(source_ids, target_prefix, suppress_sequences, sentence_ids, options):
            """(batch, len_src) -> Hypotheses (batch, num_return, max_len)."""
            return decode(
                model, source_ids, options, beam_size, target_prefix, suppress_sequences, sentence_ids,
                blank, cache_policy, never=never,
            )  # fmt: skip

        def with_literal_options(source_ids, target_prefix, suppress_sequences, sentence_ids, *values):
            options = DecodingOptions(*values)
            return search(source_ids, target_prefix, suppress_sequences, sentence_ids, options)

        def with_tensor_options(source_ids, target_prefix, suppress_sequences, sentence_ids, *options):
            options = types.SimpleNamespace(**dict(zip(OPTION_TYPES, options)))
            source_ids = checked_request(
                model.config, beam_size, source_ids, options, target_prefix, suppress_sequences
            )
            return search(source_ids, target_prefix, suppress_sequences, sentence_ids, options)

        ids, rows = tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None], tf.int32)
        if jit_compile:  # XLA needs static shapes: the options are Python values, one trace each
            # given field by field: tf.function keys ints, floats and bools by value (an object by
            # its identity: every call's new DecodingOptions would retrace and recompile)
            self._search = tf.function(with_literal_options, jit_compile=True, autograph=False)
        else:  # two graphs, each traced when first asked for (`_run`); the search's control flow
            # is explicit (keras.ops.cond, while_loop), hence no autograph
            own = self._own_options = self.options  # Python values, checked
            self._own_search = tf.function(
                lambda source_ids, sentence_ids: search(source_ids, None, None, sentence_ids, own),
                input_signature=[ids, rows],
                autograph=False,
            )
            self._search = tf.function(  # any other request: every option is an input
                with_tensor_options, input_signature=[ids, ids, ids, rows, *option_specs()], autograph=False
            )
        self._jit_compile = jit_compile

        def score(source_ids, pieces):
            return log_likelihood(model, source_ids, pieces)

        self._score = tf.function(
            score,
            input_signature=[
                tf.TensorSpec([None, None], tf.int32),
                tf.RaggedTensorSpec([None, None], tf.int32, ragged_rank=1),
            ],
        )

    def encode(self, sentences):
        """Strings -> padded source ids `(batch, len_src)`, EOS-terminated, truncated to max_length."""
        return self.tokenizer.encode(
            tf.constant(list(sentences), tf.string),
            max_length=self.max_source_length,
            pad_to_max_length=False,
        )

    def token_lists(self, texts):
        """Each string's SentencePiece ids (no BOS/EOS), as lists of ints."""
        if not texts:
            return []
        return [list(map(int, ids)) for ids in self.tokenizer.tokenize(tf.constant(list(texts))).to_list()]

    def translate(self, sentences, progress=None, **options):
        """Translations of `sentences` (a list of str) as `(texts, scores)`, in input order: the
        best hypothesis of each (`translate_hypotheses` for n-best lists, prefixes, alignments).

        `progress`, if given, is called with the number of sentences done after
        every batch; `options` change this translator's `DecodingOptions` for the call.
        """
        hypotheses = self.translate_hypotheses(sentences, progress, **options)
        return [h[0].text for h in hypotheses], np.array([h[0].score for h in hypotheses], np.float32)

    def translate_hypotheses(
        self, sentences, progress=None, target_prefix=None, suppress_sequences=None, **options
    ):
        """The hypotheses of each sentence: a list (one per sentence) of `num_return` `Hypothesis`.

        Args:
            sentences: a list of str.
            progress: called with the number of sentences done after every batch.
            target_prefix: one string (or None) per sentence: its translation starts with it
                (`keras_transformer.decoding.controls`).
            suppress_sequences: strings the translations may not contain (each tokenized
                as a sequence of pieces).
            **options: `DecodingOptions` fields for this call.

        A sentence with no content (empty, spaces, tabs or control characters) gets empty
        hypotheses with score 0, without a search.
        """
        options = self.options.replace(**options).check(self.beam_size)
        sentences = list(sentences)
        prefixes = self._prefixes(sentences, target_prefix)
        pad = self.model.config.pad_id
        sequences = token_array(self.token_lists(suppress_sequences or []), pad)
        check_token_lists("suppress_sequences", self.token_lists(suppress_sequences or []), *self._id_range())
        results = [None] * len(sentences)
        if not sentences:
            return results
        lengths = self.tokenizer.tokenize(tf.constant(sentences, tf.string)).row_lengths().numpy()
        order = np.argsort(lengths, kind="stable")
        for start in range(0, len(order), self.batch_size):
            indices = order[start : start + self.batch_size]
            source_ids = self.encode([sentences[i] for i in indices])
            prefix = token_array([prefixes[i] for i in indices], pad)
            self._check_prefix_lengths(source_ids.numpy(), prefix, options, indices)
            found = self._run(source_ids, prefix, sequences, indices.astype(np.int32), options)
            for row, index in enumerate(indices):
                results[index] = self._hypotheses(sentences[index], found, row, options.return_alignments)
            if progress is not None:
                progress(min(start + self.batch_size, len(order)))
        return results

    def _prefixes(self, sentences, target_prefix):
        if target_prefix is None:
            return [[] for _ in sentences]
        if isinstance(target_prefix, str) or len(target_prefix) != len(sentences):
            raise ValueError(
                f"target_prefix must be a list with one string (or None) per sentence: {len(sentences)}."
            )
        prefixes = self.token_lists(["" if p is None else p for p in target_prefix])
        check_token_lists("target_prefix", prefixes, *self._id_range())
        return prefixes

    def _id_range(self):
        """`(vocab size, reserved ids)` for `check_token_lists`."""
        config = self.model.config
        return config.target_vocab, [getattr(config, name) for name in RESERVED_IDS]

    def _check_prefix_lengths(self, source_ids, prefix, options, indices):
        pad = self.model.config.pad_id
        check_prefix_lengths(
            np.sum(prefix != pad, axis=1).tolist(),
            np.sum(source_ids != pad, axis=1).tolist(),
            self.model.config.max_length,
            options.max_extra_length,
            indices.tolist(),
        )

    def search_ids(
        self, source_ids, target_prefix=None, suppress_sequences=None, sentence_ids=None, **options
    ):
        """The compiled search on source ids int32 `(batch, len_src)` (`encode`): `Hypotheses`
        `(batch, num_return, max_len)` (`keras_transformer.decoding.request.decode`).

        `target_prefix` int `(batch, width)` and `suppress_sequences` int `(count, width)`,
        padded with `pad_id`, or token lists; `sentence_ids` `(batch,)`: each row's index
        in the request (sampling's key; default the row)."""
        options = self.options.replace(**options).check(self.beam_size)
        source_ids = np.asarray(source_ids, np.int32)
        batch = len(source_ids)
        pad = self.model.config.pad_id
        prefix = token_array([[]] * batch if target_prefix is None else target_prefix, pad)
        sequences = token_array([] if suppress_sequences is None else suppress_sequences, pad)
        sentence_ids = np.arange(batch, dtype=np.int32) if sentence_ids is None else sentence_ids
        return self._run(source_ids, prefix, sequences, np.asarray(sentence_ids, np.int32), options)

    def _run(self, source_ids, prefix, sequences, sentence_ids, options):
        if self._jit_compile:
            return self._search(source_ids, prefix, sequences, sentence_ids, *dataclasses.astuple(options))
        pad = self.model.config.pad_id
        plain = not np.any(np.asarray(prefix) != pad) and not np.any(np.asarray(sequences) != pad)
        if plain and options == self._own_options:
            return self._own_search(source_ids, sentence_ids)
        return self._search(source_ids, prefix, sequences, sentence_ids, *option_tensors(options).values())

    def _hypotheses(self, sentence, found, row, aligned):
        ids = found.ids[row].numpy()  # (num_return, max_len)
        texts = [t.decode("utf-8") for t in self.tokenizer.decode(ids).numpy()]
        alignments = [None] * len(texts)
        if aligned:
            source = self.tokenizer.processor.encode(sentence, out_type=str)[: self.max_source_length - 1]
            piece = self.tokenizer.processor.id_to_piece
            alignments = [
                word_alignment(source, [piece(int(i)) for i in hypothesis], alignment)
                for hypothesis, alignment in zip(ids, found.alignments[row].numpy())
            ]
        return sentence_hypotheses(texts, found.scores[row].numpy(), found.log_probs[row].numpy(), alignments)

    def score(self, sources, targets):
        """log p(target | source) of each pair of strings (lists of str), float32 `(n,)` in input order.

        Both sides are tokenized and truncated to the model's `max_length` as in
        training; an empty target scores its EOS alone. Higher is likelier; the
        translations' `scores` are these divided by the length penalty.
        """
        sources, targets = list(sources), list(targets)
        if len(sources) != len(targets):
            raise ValueError(f"score needs one target per source; got {len(sources)} and {len(targets)}.")
        scores = np.zeros(len(sources), np.float32)
        for start in range(0, len(sources), self.batch_size):
            batch = slice(start, start + self.batch_size)
            pieces = self.tokenizer.tokenize(tf.constant(targets[batch], tf.string))
            pieces = tf.cast(pieces[:, : self.max_source_length - 1], tf.int32)
            scores[batch] = self._score(self.encode(sources[batch]), pieces).numpy()
        return scores

    def attention(self, text, target=None):
        """Every attention head's weights for one sentence and a target (default: its translation).

        Returns a `SentenceAttention` (for `plots.plot_attention`).
        """
        source_ids = self.encode([text]).numpy()
        if target is None:
            target = self.translate([text])[0][0]
        bos = np.array([self.model.config.bos_id], np.int32)
        target_ids = np.concatenate([bos, self.tokenizer.tokenize([target]).numpy()[0]])[None].astype("int32")
        weights = self.model.attention_weights({"source_ids": source_ids, "target_ids": target_ids})
        weights = {name: [np.asarray(w) for w in layers] for name, layers in weights.items()}
        piece = self.tokenizer.processor.id_to_piece
        return SentenceAttention(
            weights, [piece(int(i)) for i in source_ids[0]], [piece(int(i)) for i in target_ids[0]], target
        )
