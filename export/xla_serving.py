"""`translate_xla`: a SavedModel signature whose beam search TF Serving runs compiled by XLA.

TF Serving runs a `jit_compile=True` function only when started with
`--xla_cpu_compilation_enabled=true` (experimental since TF Serving 2.5; without
the flag the server calls `tensorflow::DisableXlaCompilation()` and such a
function fails on its first call). XLA compiles one program per input shape,
so the signature never hands the compiled search a shape outside a fixed set:

    text (batch,) -> tokenized ids (batch, len_src)            [plain graph]
      -> in chunks of at most max(batch_sizes) sentences, each chunk padded to
         the smallest bucket `(B, L)` that holds it: B in `batch_sizes` (filler
         rows are an EOS alone), L in `source_lengths` (pad ids; the encoder
         masks them, and each sentence's output limit counts its own ids)
      -> the beam search on (B, L) with the fixed-size cache        [XLA]
         (one function per B, chosen by a `switch_case`, so that the search
         knows B when traced and halves its batch as sentences finish)
      -> the chunk's own rows, detokenized                         [plain graph]

so at most `len(batch_sizes) x len(source_lengths)` programs are ever compiled,
each on the first request of its shape; `warmup_requests` gives one TF Serving
warmup record per bucket, which compile them all while the version loads.

The search is `keras_transformer.decoding.request.decode` with the export's
options and `cache_policy="fixed"` (the growing cache changes shapes every step):
the same tokens as `serving_default`, which keeps its growing cache and no XLA,
for servers started without the flag. Sources with no content are searched here
(the plain graph skips them) and answered "" with score 0 all the same.

A SavedModel with this signature has XLA warmup records, and TF Serving refuses
to load a version whose warmup fails: serve it with the flag, or export without
`--xla` for servers without it.
"""

import dataclasses
import functools

import numpy as np
import tensorflow as tf
import tensorflow.experimental.numpy as tnp

from keras_transformer.decoding import policy
from keras_transformer.decoding.request import decode
from keras_transformer.utils.checks import UserError

SIGNATURE = "translate_xla"
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
SOURCE_LENGTHS = (16, 32, 64, 128)  # ids incl. EOS; the model's max_length is always the last


@dataclasses.dataclass(frozen=True)
class XlaBuckets:
    """The shapes the compiled search runs on: batch sizes and source lengths (ids, EOS included).

    `source_lengths` is completed with the model's `max_length` (`for_model`), so
    every source has a bucket; a batch larger than the largest batch size is cut
    into chunks of that size.
    """

    batch_sizes: tuple = BATCH_SIZES
    source_lengths: tuple = SOURCE_LENGTHS

    def for_model(self, max_length):
        """These buckets, checked, sorted, with source lengths cut to and ending at `max_length`."""
        for name in ("batch_sizes", "source_lengths"):
            values = getattr(self, name)
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise UserError(f"XLA {name.replace('_', ' ')} must be integers >= 1; got {values!r}.")
        lengths = sorted({min(v, max_length) for v in self.source_lengths} | {max_length})
        return XlaBuckets(tuple(sorted(set(self.batch_sizes))), tuple(lengths))

    @property
    def shapes(self):
        """Every `(batch, source length)` a program is compiled for."""
        return [(b, n) for b in self.batch_sizes for n in self.source_lengths]


def _bucket_index(size, sizes):
    """The index of the smallest of `sizes` (sorted, int32 `(k,)`) that is >= `size`, else of the largest."""
    return tf.minimum(tf.reduce_sum(tf.cast(sizes < size, tf.int32)), tf.size(sizes) - 1)


def _bucket(size, sizes):
    """The smallest of `sizes` (sorted, int32 `(k,)`) that is >= `size`, else the largest."""
    return tf.gather(sizes, _bucket_index(size, sizes))


def _run_on(function, source_ids, batch):
    """`function` (traced for `batch` rows) on `source_ids` `(batch, len_src)`."""
    return function(tf.reshape(source_ids, [batch, -1]))


def translate_xla_function(graphs, buckets=XlaBuckets()):
    """The `translate_xla` signature of `graphs` (a `TranslationGraphs`): a `tf.function`
    strings `(batch,)` -> `{"translation": strings (batch,), "score": float32 (batch,)}`,
    as `serving_default` (module docstring)."""
    config = graphs.config
    buckets = buckets.for_model(config.max_length)

    def search(source_ids):  # (B, L) -> best ids (B, max_len), scores (B,)
        found = decode(
            graphs.model, source_ids, graphs.options, graphs.beam_size, cache_policy="fixed",
            never=graphs.never,
        )  # fmt: skip
        return found.ids[:, 0], found.scores[:, 0]

    # One function per batch size, traced with that size: the fixed-cache search then knows how
    # often it can halve its batch as sentences finish (`keras_transformer.decoding.search`).
    compiled = [
        tf.function(
            search,
            input_signature=[tf.TensorSpec([size, None], tf.int32)],
            jit_compile=True,
            autograph=False,
        )
        for size in buckets.batch_sizes
    ]
    batch_sizes = tf.constant(buckets.batch_sizes, tf.int32)
    largest = buckets.batch_sizes[-1]
    blank = tf.constant(graphs.blank)

    def translate_xla(text):
        source_ids = graphs.checked_source_ids(graphs.source_ids(text, repair_utf8=True))
        count, width = tf.shape(source_ids)[0], tf.shape(source_ids)[1]
        length = _bucket(width, tf.constant(buckets.source_lengths, tf.int32))
        source_ids = tf.pad(source_ids, [[0, 0], [0, length - width]])
        max_len = policy.output_limits(length, config.max_length, tnp, graphs.max_extra_length)
        chunks = tf.maximum((count + largest - 1) // largest, 1)  # a batch of 0: one empty chunk

        def chunk(index, ids, scores):
            rows = source_ids[index * largest : (index + 1) * largest]
            size = tf.shape(rows)[0]
            which = _bucket_index(size, batch_sizes)
            filler = tf.one_hot(
                tf.zeros([batch_sizes[which] - size], tf.int32), length,
                on_value=config.eos_id, off_value=config.pad_id, dtype=tf.int32,
            )  # fmt: skip
            padded = tf.concat([rows, filler], axis=0)
            found_ids, found_scores = tf.switch_case(
                which,
                [
                    functools.partial(_run_on, function, padded, n)
                    for function, n in zip(compiled, buckets.batch_sizes)
                ],
            )
            return index + 1, ids.write(index, found_ids[:size]), scores.write(index, found_scores[:size])

        arrays = (
            tf.TensorArray(tf.int32, size=chunks, infer_shape=False, element_shape=[None, None]),
            tf.TensorArray(tf.float32, size=chunks, infer_shape=False, element_shape=[None]),
        )
        _, ids, scores = tf.while_loop(lambda index, *_: index < chunks, chunk, (0, *arrays))
        ids = tf.reshape(ids.concat(), [count, max_len])
        empty = policy.empty_sources(source_ids, blank, tnp)  # "" and 0, as everywhere
        ids = tf.where(empty[:, None], tf.constant(config.pad_id, tf.int32), ids)
        return {"translation": graphs.tokenizer.decode(ids), "score": tf.where(empty, 0.0, scores.concat())}

    return tf.function(
        translate_xla, input_signature=[tf.TensorSpec([None], tf.string, name="text")], autograph=False
    )


def bucket_sentences(tokenizer, buckets, max_length):
    """One text per source length of `buckets.for_model(max_length)` whose ids (EOS included)
    fall in that bucket and no smaller one: the warmup requests' sentences."""
    lengths = buckets.for_model(max_length).source_lengths
    sentences = []
    for below, length in zip((0, *lengths), lengths):
        words = length - 1
        while words > 1 and len(tokenizer.processor.encode(" ".join(["a"] * words))) + 1 > length:
            words -= 1
        text = " ".join(["a"] * words)
        ids = len(tokenizer.processor.encode(text)) + 1
        if not below < ids <= length:  # a vocabulary where "a" is not a piece of its own
            raise UserError(f"no warmup sentence of {below + 1}-{length} tokens could be made ({ids}).")
        sentences.append(text)
    return sentences


def warmup_requests(graphs, model_name, buckets=XlaBuckets()):
    """TF Serving `PredictRequest`s for `translate_xla`: one per `(batch, source length)` bucket."""
    from keras_transformer_export.tf_serving import predict_request

    buckets = buckets.for_model(graphs.config.max_length)
    sentences = bucket_sentences(graphs.tokenizer, buckets, graphs.config.max_length)
    return [
        predict_request(model_name, SIGNATURE, text=np.array([sentence] * batch, object))
        for batch in buckets.batch_sizes
        for sentence in sentences
    ]
