"""The tf.data input pipeline: tokenized pairs, bucketed by length, batched by
token count (the paper batches by ~25000 source and target tokens, §5.1).

    pairs = TokenizedPairs(sources, targets, tokenizer, batch_tokens=4096, max_length=128)
    pairs.epoch(3, seed=0)            # epoch 3's batches, in an order fixed by (seed, 3)
    pairs.epochs(3, 10, seed=0, skip=17)  # epochs 3..9 back to back, skipping 17 batches
    make_dataset(sources, targets, tokenizer)  # one epoch that reshuffles itself

Every batch is `({"source_ids": (batch, L), "target_ids": (batch, L)},
labels (batch, L))`, int32, with L a multiple of `bucket_width` (at most
`max_length`); target_ids = BOS + target, labels = target + EOS, source ends
with EOS. Because the order of an epoch depends only on `(seed, epoch)`, a
resumed run sees exactly the batches the interrupted one would have seen.
"""

import dataclasses

import numpy as np
import tensorflow as tf

from keras_transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID


@dataclasses.dataclass
class DatasetInfo:
    """What the pipeline kept: examples, dropped (too long), batches per epoch, padded lengths."""

    examples: int
    dropped: int
    batches: int
    bucket_lengths: tuple


class TokenizedPairs:
    """Sentence pairs tokenized once, filtered by length, ready to batch.

    A pair whose source or target needs more than `max_length` ids (EOS/BOS
    included) is dropped and counted in `info.dropped`. Pairs are grouped by
    length into buckets `bucket_width` apart and padded to the bucket's length
    L; a bucket's batches hold `batch_tokens // L` pairs, so every batch has
    one of a few shapes and `fit` traces its step a bounded number of times.

    Args:
        row_multiple: pad the batch dimension with all-padding rows (which the
            loss ignores) to a multiple of this, so that a batch splits into
            equal shares (multi-worker training slices every batch by rows).
    """

    def __init__(
        self, sources, targets, tokenizer, batch_tokens=4096, max_length=256, bucket_width=8, row_multiple=1
    ):
        if min(batch_tokens, max_length, bucket_width, row_multiple) < 1:
            raise ValueError(
                "batch_tokens, max_length, bucket_width and row_multiple must be positive integers."
            )
        source_ids = tokenizer.tokenize(tf.constant(list(sources)))
        target_ids = tokenizer.tokenize(tf.constant(list(targets)))
        lengths = np.maximum(source_ids.row_lengths().numpy(), target_ids.row_lengths().numpy()) + 1
        keep = lengths <= max_length
        self.source_ids = tf.ragged.boolean_mask(source_ids, keep)
        self.target_ids = tf.ragged.boolean_mask(target_ids, keep)
        self.bucket_width, self.max_length, self.row_multiple = bucket_width, max_length, row_multiple
        self.bucket_lengths = [
            min(b, max_length) for b in range(bucket_width, max_length + bucket_width, bucket_width)
        ]
        self.batch_sizes = [max(1, batch_tokens // length) for length in self.bucket_lengths]
        per_bucket = np.bincount(
            np.searchsorted(self.bucket_lengths, lengths[keep]), minlength=len(self.bucket_lengths)
        )
        batches = int(np.sum(-(-per_bucket // np.array(self.batch_sizes))))
        self.info = DatasetInfo(
            examples=int(keep.sum()),
            dropped=int((~keep).sum()),
            batches=batches,
            bucket_lengths=tuple(self.bucket_lengths),
        )

    def epoch(self, epoch, seed=0, skip=0):
        """One epoch of batches in the order fixed by `(seed, epoch)`, minus the first `skip`."""
        return self.epochs(epoch, epoch + 1, seed=seed, skip=skip)

    def epochs(self, first, stop, seed=0, skip=0):
        """Epochs `first, ..., stop - 1` back to back (for `fit(steps_per_epoch=info.batches)`)."""
        count = self.info.examples
        source_ids, target_ids = self.source_ids, self.target_ids

        def one_epoch(epoch):
            order = tf.random.experimental.stateless_shuffle(
                tf.range(count, dtype=tf.int64), seed=tf.stack([tf.constant(seed, tf.int64), epoch])
            )
            pairs = tf.data.Dataset.from_tensor_slices(order).map(lambda i: (source_ids[i], target_ids[i]))
            return self._batch(pairs)

        dataset = tf.data.Dataset.range(first, stop).flat_map(one_epoch).skip(skip)
        total = max(0, (stop - first) * self.info.batches - skip)
        return dataset.apply(tf.data.experimental.assert_cardinality(total)).prefetch(tf.data.AUTOTUNE)

    def in_order(self):
        """One epoch in corpus order (for validation)."""
        pairs = tf.data.Dataset.from_tensor_slices((self.source_ids, self.target_ids))
        return self._with_cardinality(self._batch(pairs))

    def reshuffling(self, seed=0):
        """One epoch that reshuffles itself on every iteration (`fit(shuffle=False)`)."""
        pairs = tf.data.Dataset.from_tensor_slices((self.source_ids, self.target_ids))
        pairs = pairs.shuffle(max(1, self.info.examples), seed=seed, reshuffle_each_iteration=True)
        return self._with_cardinality(self._batch(pairs))

    def _with_cardinality(self, dataset):
        # The batch count is the same every epoch (each bucket holds the same
        # pairs); declaring it lets Keras size its epochs (and TF checks it).
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(self.info.batches))
        return dataset.prefetch(tf.data.AUTOTUNE)

    def _batch(self, pairs):
        def add_specials(source, target):
            eos, bos = tf.constant([EOS_ID], tf.int32), tf.constant([BOS_ID], tf.int32)
            return tf.concat([source, eos], 0), tf.concat([bos, target], 0), tf.concat([target, eos], 0)

        batches = pairs.map(add_specials).bucket_by_sequence_length(
            element_length_func=lambda source, target_in, labels: tf.maximum(
                tf.shape(source)[0], tf.shape(labels)[0]
            ),
            bucket_boundaries=[length + 1 for length in self.bucket_lengths[:-1]],
            bucket_batch_sizes=self.batch_sizes,
            padded_shapes=([None], [None], [None]),
            padding_values=(PAD_ID, PAD_ID, PAD_ID),
        )
        return batches.map(self._pad_to_bucket, num_parallel_calls=tf.data.AUTOTUNE)

    def _pad_to_bucket(self, source, target_in, labels):
        longest = tf.maximum(tf.shape(source)[1], tf.shape(labels)[1])
        width = self.bucket_width
        length = tf.minimum((longest + width - 1) // width * width, self.max_length)
        rows = tf.shape(source)[0]
        extra_rows = (self.row_multiple - rows % self.row_multiple) % self.row_multiple

        def pad(ids):
            return tf.pad(ids, [[0, extra_rows], [0, length - tf.shape(ids)[1]]], constant_values=PAD_ID)

        return {"source_ids": pad(source), "target_ids": pad(target_in)}, pad(labels)


def make_dataset(
    sources, targets, tokenizer, batch_tokens=4096, max_length=256, bucket_width=8, shuffle=True, seed=0
):
    """One epoch of batches for `model.fit` (see `TokenizedPairs`).

    Returns:
        `(dataset, info)`: the dataset yields `({"source_ids": (batch, L),
        "target_ids": (batch, L)}, labels (batch, L))` int32; `info` is a
        `DatasetInfo`. With `shuffle`, the dataset reshuffles itself every
        epoch: call `fit(..., shuffle=False)`.
    """
    pairs = TokenizedPairs(sources, targets, tokenizer, batch_tokens, max_length, bucket_width)
    return (pairs.reshuffling(seed) if shuffle else pairs.in_order()), pairs.info
