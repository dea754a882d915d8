"""A shared SentencePiece vocabulary (the paper's shared source-target BPE,
§5.1), trained with `sentencepiece` and applied in-graph with
`tensorflow_text`, so the same tokenizer object goes into exported SavedModels.

Special ids (the `TransformerConfig` defaults): 0 `<pad>`, 1 `<unk>`,
2 `<s>` (BOS), 3 `</s>` (EOS).

Normalization, i.e. what `detokenize(tokenize(text))` gives back
(`Tokenizer.normalize` in Python): NUL read as a space, Unicode NFKC, then
leading and trailing spaces removed and runs of spaces collapsed to one (other
whitespace, such as tabs, is kept). Characters outside the vocabulary round-trip through UTF-8
byte pieces (byte fallback), so no text is lost to `<unk>`.

Shape legend: strings (batch,); ids (batch, length) int32, ragged or padded.
"""

import io
import os
import re
import unicodedata

import sentencepiece
import tensorflow as tf
import tensorflow_text

from keras_transformer.data.special_ids import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from keras_transformer.utils.checks import UserError
from keras_transformer.utils.files import atomic_write

_SPACES = re.compile(" +")


# SentencePiece's trainer errors that a user can act on, and what to tell them.
_TRAINING_ERRORS = (
    (
        re.compile(r"<= (\d+)"),
        "vocab_size={vocab_size} is too large for this corpus: SentencePiece can build at most "
        "{0} pieces from it. Use a vocabulary of at most {0} or train on more text.",
    ),
    (
        re.compile(r"smaller than required_chars\. \d+ vs (\d+)"),
        "vocab_size={vocab_size} is too small for this corpus: it needs at least {0} pieces "
        "(256 bytes for byte fallback, the special ids and every character of the corpus).",
    ),
)


def _training_error_message(error, vocab_size):
    for pattern, message in _TRAINING_ERRORS:
        match = pattern.search(error)
        if match:
            return message.format(*match.groups(), vocab_size=vocab_size)
    return f"SentencePiece could not train a vocabulary: {error}"


class Tokenizer:
    """A SentencePiece model with in-graph tokenization and detokenization.

    Example:
    >>> tokenizer = Tokenizer.train(["a cat sat on the mat", "the dog sat"] * 20, vocab_size=280)
    >>> ids = tokenizer.encode(["the cat sat"])  # (1, length), EOS-terminated
    >>> [s.decode() for s in tokenizer.decode(ids).numpy()]
    ['the cat sat']
    """

    def __init__(self, model_proto):
        self.model_proto = bytes(model_proto)
        self.processor = sentencepiece.SentencePieceProcessor(model_proto=self.model_proto)

    def _ops(self):
        """The tf-text tokenizer, created where it is used.

        Its SentencePiece resource is owned by a kernel: one created eagerly is
        destroyed when TensorFlow clears its eager kernel cache (as
        `tf.random.set_seed` / `keras.utils.set_random_seed` do). Created per
        eager call, or inside the `tf.function`/`tf.data` graph that uses it
        (where the model is parsed once per function), it cannot go stale.
        """
        return tensorflow_text.SentencepieceTokenizer(model=self.model_proto, out_type=tf.int32)

    @classmethod
    def train(
        cls,
        texts,
        vocab_size,
        path=None,
        model_type="bpe",
        character_coverage=1.0,
        max_sentences=2_000_000,
        cap_to_corpus=False,
        user_defined_symbols=(),
    ):
        """Trains a vocabulary of `vocab_size` pieces on an iterable of strings.

        Args:
            texts: iterable of sentences (both languages, for a shared vocabulary).
            vocab_size: number of pieces, the special ids included.
            path: if given, where to save the model (`save`).
            model_type: `"bpe"` (the paper's byte-pair encoding) or `"unigram"`.
            character_coverage: share of characters kept as pieces (1.0: all;
                the rest go through byte fallback).
            max_sentences: at most this many sentences are sampled for training.
            cap_to_corpus: when the corpus supports fewer than `vocab_size`
                pieces, build as many as it supports instead of raising (a
                default size on a small corpus); `vocab_size` tells the result.
            user_defined_symbols: strings that are always one piece each (the
                source-side tags of a weighted mix, such as `<BT>`).

        Raises:
            ValueError: empty corpus, or a vocabulary the corpus cannot support.
        """
        sentences = [line for line in (str(t).strip() for t in texts) if line]
        if not sentences:
            raise UserError("Cannot train a vocabulary on an empty corpus (no non-empty line).")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 8:
            raise UserError(f"vocab_size must be an integer >= 8; got {vocab_size!r}.")
        model = io.BytesIO()
        arguments = dict(
            sentence_iterator=iter(sentences),
            model_writer=model,
            model_type=model_type,
            character_coverage=character_coverage,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            byte_fallback=True,
            normalization_rule_name="nfkc",
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
        if user_defined_symbols:
            arguments["user_defined_symbols"] = list(user_defined_symbols)
        try:
            sentencepiece.SentencePieceTrainer.train(vocab_size=vocab_size, **arguments)
        except RuntimeError as error:
            most = _TRAINING_ERRORS[0][0].search(str(error))
            if not (cap_to_corpus and most and int(most.group(1)) >= 8):
                raise UserError(_training_error_message(str(error), vocab_size)) from None
            model = arguments["model_writer"] = io.BytesIO()
            arguments["sentence_iterator"] = iter(sentences)
            sentencepiece.SentencePieceTrainer.train(vocab_size=int(most.group(1)), **arguments)
        tokenizer = cls(model.getvalue())
        if path is not None:
            tokenizer.save(path)
        return tokenizer

    @classmethod
    def load(cls, path):
        """Loads a model saved with `save` (a SentencePiece `.model` file)."""
        with open(path, "rb") as handle:
            return cls(handle.read())

    def save(self, path):
        """Writes the SentencePiece model to `path` atomically (never half-written)."""
        atomic_write(path, self.model_proto)

    @property
    def vocab_size(self):
        return self.processor.get_piece_size()

    @staticmethod
    def normalize(text):
        """The text that a tokenize/detokenize round trip gives back (see module docstring)."""
        return _SPACES.sub(" ", unicodedata.normalize("NFKC", text.replace("\x00", " "))).strip(" ")

    def tokenize(self, strings, repair_utf8=False):
        """Strings `(batch,)` -> ragged int32 ids `(batch, (length))`, no BOS/EOS.

        With `repair_utf8`, invalid UTF-8 bytes are first replaced by U+FFFD
        (as `keras-transformer translate` does with its input lines); without
        it they go to SentencePiece as they are.
        """
        if repair_utf8:
            strings = tf.strings.unicode_transcode(
                strings, "UTF-8", "UTF-8", errors="replace", replacement_char=0xFFFD
            )
        # NUL reads as a space: ONNX Runtime's SentencePiece op (onnxruntime-extensions) ends a
        # string at NUL, so the exported text graph would lose the rest of the sentence.
        strings = tf.strings.regex_replace(strings, r"\x00", " ")
        return self._ops().tokenize(strings)

    def ids_in_python(self, texts):
        """Lists of the ids of `texts` (Python strings), the ids `tokenize` gives (NUL read as a
        space, no BOS/EOS), computed by SentencePiece outside any graph: for tokenizing a corpus
        into a token cache (`token_store.py`)."""
        texts = [text.replace("\x00", " ") for text in texts]
        return self.processor.encode(texts, num_threads=os.cpu_count() or 1)

    def encode(self, strings, max_length=None, add_eos=True, pad_to_max_length=True, repair_utf8=False):
        """Strings `(batch,)` -> padded int32 ids `(batch, length)` for Keras layers.

        Appends EOS when `add_eos`; with `max_length`, longer sentences are
        truncated (keeping the EOS last) and, if `pad_to_max_length`, the
        result is padded to `max_length` (else to its longest sentence).
        `repair_utf8`: see `tokenize`.
        """
        ids, lengths = _padded(self.tokenize(strings, repair_utf8=repair_utf8))  # (batch, longest)
        if max_length is not None:
            keep = max_length - (1 if add_eos else 0)
            ids, lengths = ids[:, :keep], tf.minimum(lengths, keep)
        if add_eos:
            ids = tf.pad(ids, [[0, 0], [0, 1]], constant_values=PAD_ID)
            positions = tf.range(tf.shape(ids)[1])[None, :]
            ids = tf.where(tf.equal(positions, lengths[:, None]), tf.constant(EOS_ID, tf.int32), ids)
        if max_length is not None and pad_to_max_length:
            ids = tf.pad(ids, [[0, 0], [0, max_length - tf.shape(ids)[1]]], constant_values=PAD_ID)
            ids = tf.ensure_shape(ids, [None, max_length])
        return ids

    def detokenize(self, ids):
        """Ragged or padded ids -> strings; special ids are dropped."""
        if not isinstance(ids, tf.RaggedTensor):
            ids = tf.RaggedTensor.from_tensor(tf.convert_to_tensor(ids, tf.int32))
        keep = tf.logical_or(ids > EOS_ID, tf.equal(ids, UNK_ID))  # drop <pad>, <s>, </s>
        return self._ops().detokenize(tf.ragged.boolean_mask(ids, keep))

    def decode(self, ids):
        """Decoder output `(batch, length)` -> strings, cut at the first EOS."""
        ids = tf.convert_to_tensor(ids, tf.int32)
        before_eos = tf.equal(tf.cumsum(tf.cast(tf.equal(ids, EOS_ID), tf.int32), axis=1), 0)
        return self.detokenize(tf.ragged.boolean_mask(ids, before_eos))


def _padded(ragged):
    """`(ids (batch, longest) padded with PAD_ID, lengths (batch,))` of ragged ids, with dense
    ops only. tf2onnx converts `RaggedTensor.to_tensor` and ragged concatenation with a division
    by the longest row, which fails (integer division by zero) on a batch of empty sentences;
    this gathers each row's ids from the flat values instead."""
    splits = tf.cast(ragged.row_splits, tf.int32)
    starts, lengths = splits[:-1], splits[1:] - splits[:-1]
    longest = tf.reduce_max(tf.concat([lengths, [0]], axis=0))  # 0 for a batch of none
    positions = tf.range(longest)[None, :]
    values = tf.concat([tf.cast(ragged.flat_values, tf.int32), [PAD_ID]], axis=0)  # PAD last
    inside = positions < lengths[:, None]
    index = tf.where(inside, starts[:, None] + positions, tf.shape(values)[0] - 1)
    return tf.gather(values, index), lengths
