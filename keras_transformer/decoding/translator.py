"""Text in, text out: tokenize, beam search (§6.1) in a compiled graph,
detokenize; what `keras-transformer translate` and `evaluate` run.

Sentences are sorted by length and translated in batches (less padding),
then put back in input order. A source longer than the model's `max_length`
ids is truncated to it (EOS kept last): the model has no positions beyond.
"""

from typing import NamedTuple

import numpy as np

from keras_transformer.decoding import policy
from keras_transformer.decoding.search import beam_search
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


class Translator:
    """Translates lists of strings with a trained `Transformer` and its `Tokenizer`.

    Args:
        model: a `Transformer`.
        tokenizer: the run's `Tokenizer`.
        beam_size, length_penalty, max_extra_length: of `beam_search` (4, 0.6, 50).
        batch_size: sentences per beam-search call.
        jit_compile: compile the search with XLA.
        cache_policy: of `beam_search`; `"auto"` grows the cache (finished
            sentences leave the batch) unless `jit_compile`.
    """

    def __init__(
        self,
        model,
        tokenizer,
        beam_size=policy.BEAM_SIZE,
        length_penalty=policy.LENGTH_PENALTY,
        max_extra_length=policy.MAX_EXTRA_LENGTH,
        batch_size=64,
        jit_compile=False,
        cache_policy="auto",
    ):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.max_source_length = model.config.max_length

        def search(source_ids):  # (batch, len_src) -> ids (batch, max_len), scores (batch,)
            result = beam_search(
                model,
                source_ids,
                beam_size=beam_size,
                length_penalty=length_penalty,
                max_extra_length=max_extra_length,
                cache_policy=cache_policy,
            )
            return result.ids, result.scores

        self._search = tf.function(
            search, input_signature=[tf.TensorSpec([None, None], tf.int32)], jit_compile=jit_compile
        )
        self._score = tf.function(
            lambda source_ids, pieces: log_likelihood(model, source_ids, pieces),
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

    def translate(self, sentences, progress=None):
        """Translations of `sentences` (a list of str) as `(texts, scores)`, in input order.

        `progress`, if given, is called with the number of sentences done after
        every batch.
        """
        sentences = list(sentences)
        texts, scores = [""] * len(sentences), np.zeros(len(sentences), np.float32)
        if not sentences:
            return texts, scores
        lengths = self.tokenizer.tokenize(tf.constant(sentences, tf.string)).row_lengths().numpy()
        order = np.argsort(lengths, kind="stable")
        for start in range(0, len(order), self.batch_size):
            indices = order[start : start + self.batch_size]
            ids, batch_scores = self._search(self.encode([sentences[i] for i in indices]))
            decoded = self.tokenizer.decode(ids).numpy()
            for index, text, score in zip(indices, decoded, batch_scores.numpy()):
                texts[index], scores[index] = text.decode("utf-8"), score
            if progress is not None:
                progress(min(start + self.batch_size, len(order)))
        return texts, scores

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
