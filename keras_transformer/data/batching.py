"""The tf.data input pipeline: tokenized pairs, bucketed by length, batched by
token count (the paper batches by ~25000 source and target tokens, §5.1).

    pairs = TokenizedPairs.from_texts(sources, targets, tokenizer, batch_tokens=4096, max_length=128)
    pairs = TokenizedPairs(TokenStore.cached(parallel_text, tokenizer, root), ...)  # from files
    pairs.epoch(3, seed=0)            # epoch 3's batches, in an order fixed by (seed, 3)
    pairs.epochs(3, 10, seed=0, skip=17)  # epochs 3..9 back to back, skipping 17 batches
    make_dataset(sources, targets, tokenizer)  # one epoch that reshuffles itself

Every batch is `({"source_ids": (batch, L), "target_ids": (batch, L)},
labels (batch, L))`, int32, with L a multiple of `bucket_width` (at most
`max_length`); target_ids = BOS + target, labels = target + EOS, source ends
with EOS. Because the order of an epoch depends only on `(seed, epoch)`, a
resumed run sees exactly the batches the interrupted one would have seen.
The ids are read from a `TokenStore` (memory-mapped for a corpus read from
files) as each batch is built, so memory does not grow with the corpus.
"""

import dataclasses
import itertools

import numpy as np
import tensorflow as tf

from keras_transformer.data.token_store import TokenStore


@dataclasses.dataclass
class DatasetInfo:
    """What the pipeline kept: examples, dropped (too long), batches per epoch, padded lengths."""

    examples: int
    dropped: int
    batches: int
    bucket_lengths: tuple


CHUNK_PAIRS = 1 << 16  # pairs per chunk: an epoch visits the chunks in a shuffled order
WINDOW_CHUNKS = 16  # chunks shuffled together (1,048,576 pairs): the shuffle's memory bound


class TokenizedPairs:
    """Tokenized sentence pairs (a `TokenStore`), filtered by length, batched by token count.

    A pair whose source or target needs more than `max_length` ids (EOS/BOS
    included) is dropped and counted in `info.dropped`. Pairs are grouped by
    length into buckets `bucket_width` apart and padded to the bucket's length
    L; a bucket's batches hold `batch_tokens // L` pairs, so every batch has
    one of a few shapes and `fit` traces its step a bounded number of times.

    An epoch's order is computed a window at a time from the store's offsets:
    the chunks of `CHUNK_PAIRS` pairs in an order fixed by `(seed, epoch)`,
    `WINDOW_CHUNKS` of them at a time shuffled together (a corpus of up to
    1,048,576 pairs is shuffled whole); each pair joins its bucket's batch, a
    batch leaves when full, and the part-filled ones leave at the end of the
    epoch (smallest bucket first), so the number of batches is the same every
    epoch. Only the window's indices and the batch being built are in memory.

    Args:
        row_multiple: pad the batch dimension with all-padding rows (which the
            loss ignores) to a multiple of this, so that a batch splits into
            equal shares (multi-worker training slices every batch by rows).
        weights: for a `StoreSequence` of several corpora, each one's share of
            an epoch (a weighted mix; see `_mixture_plan`). None: the corpora
            are simply one after the other.
    """

    def __init__(
        self, store, batch_tokens=4096, max_length=256, bucket_width=8, row_multiple=1, weights=None
    ):
        if min(batch_tokens, max_length, bucket_width, row_multiple) < 1:
            raise ValueError(
                "batch_tokens, max_length, bucket_width and row_multiple must be positive integers."
            )
        self.store = store
        self.bucket_width, self.max_length, self.row_multiple = bucket_width, max_length, row_multiple
        self.bucket_lengths = [
            min(b, max_length) for b in range(bucket_width, max_length + bucket_width, bucket_width)
        ]
        self.batch_sizes = [max(1, batch_tokens // length) for length in self.bucket_lengths]
        parts = store.parts if weights is not None else [store]
        histograms, tokens = [], []
        for part in parts:
            per_bucket, part_tokens = np.zeros(len(self.bucket_lengths), np.int64), 0
            for start in range(0, part.pairs, CHUNK_PAIRS):
                stop = min(start + CHUNK_PAIRS, part.pairs)
                lengths = part.lengths(start, stop)
                keep = lengths <= max_length
                per_bucket += np.bincount(self._buckets(lengths[keep]), minlength=len(self.bucket_lengths))
                part_tokens += int(np.sum(part.side_lengths("target", start, stop)[keep] + 1))
            histograms.append(per_bucket)
            tokens.append(part_tokens)
        self.weights = weights
        if weights is None:
            per_bucket = histograms[0]
            # target ids + EOS of the kept pairs: what the loss counts per epoch
            self.target_tokens = tokens[0]
            dropped = store.pairs - int(per_bucket.sum())
        else:
            kept = np.array([histogram.sum() for histogram in histograms], np.int64)
            if len(weights) != len(parts):
                raise ValueError(
                    f"a weighted mix of {len(parts)} corpora needs as many weights; got {weights}"
                )
            if not kept.all():
                empty = int(np.flatnonzero(kept == 0)[0]) + 1
                raise ValueError(
                    f"training corpus {empty} of the mix has no pair of at most {max_length} tokens; "
                    f"raise --max-length or leave that corpus out"
                )
            shares = np.asarray(weights, np.float64) / np.sum(weights)
            # An epoch has as many pairs as the corpora together; corpus i gives shares[i] of them.
            self.mix_counts = np.maximum(1, np.round(shares * kept.sum())).astype(np.int64)
            scale = self.mix_counts / kept
            per_bucket = np.ceil(sum(h * f for h, f in zip(histograms, scale))).astype(np.int64)
            self.target_tokens = int(sum(t * f for t, f in zip(tokens, scale)))
            dropped = store.pairs - int(kept.sum())
        examples = int(per_bucket.sum())
        self.info = DatasetInfo(
            examples=examples,
            dropped=dropped,
            batches=int(np.sum(-(-per_bucket // np.array(self.batch_sizes)))),
            bucket_lengths=tuple(self.bucket_lengths),
        )

    @classmethod
    def from_texts(cls, sources, targets, tokenizer, **batching):
        """Pairs of sentence lists, tokenized into memory (`TokenStore.from_texts`)."""
        return cls(TokenStore.from_texts(sources, targets, tokenizer), **batching)

    def epoch(self, epoch, seed=0, skip=0):
        """One epoch of batches in the order fixed by `(seed, epoch)`, minus the first `skip`."""
        return self.epochs(epoch, epoch + 1, seed=seed, skip=skip)

    def epochs(self, first, stop, seed=0, skip=0):
        """Epochs `first, ..., stop - 1` back to back (for `fit(steps_per_epoch=info.batches)`)."""
        return self.stream(
            first * self.info.batches + skip, max(0, (stop - first) * self.info.batches - skip), seed
        )

    def stream(self, start, count, seed=0):
        """`count` batches from batch `start` of the stream of every epoch back to back (epoch e's
        batches are numbers `e * info.batches ...`): training counted in steps."""
        per_epoch = self.info.batches
        first, stop = start // per_epoch, -(-(start + count) // per_epoch)

        def plans():
            batches = itertools.chain.from_iterable(self.plan(epoch, seed) for epoch in range(first, stop))
            return itertools.islice(batches, start - first * per_epoch, start - first * per_epoch + count)

        return self._dataset(plans, count)

    def in_order(self):
        """One epoch in corpus order (for validation)."""
        if self.weights is not None:
            raise ValueError("a weighted mix of corpora has no corpus order; validate on one corpus")
        return self._dataset(lambda: self.plan(None, None), self.info.batches)

    def reshuffling(self, seed=0):
        """One epoch that reshuffles itself on every iteration (`fit(shuffle=False)`): the n-th
        iteration is epoch n's order."""
        iterations = itertools.count()
        return self._dataset(lambda: self.plan(next(iterations), seed), self.info.batches)

    def _buckets(self, lengths):
        return np.searchsorted(self.bucket_lengths, lengths)

    def plan(self, epoch, seed):
        """Yields `(pair indices, padded length)` of the epoch's batches in order (`epoch` None:
        corpus order): the plan every dataset of this class reads, fixed by `(seed, epoch)`, for
        a trainer outside `tf.data` (`scripts/sweep_multi30k.py` trains on JAX from it)."""
        if self.weights is not None and epoch is not None:
            yield from self._mixture_plan(epoch, seed)
            return
        pairs = self.store.pairs
        chunks = np.arange(-(-pairs // CHUNK_PAIRS))
        if epoch is not None and len(chunks) > 1:
            chunks = chunks[_permutation(len(chunks), seed, -1 - epoch)]
        pending = [np.zeros(0, np.int64) for _ in self.bucket_lengths]
        for window, first in enumerate(range(0, len(chunks), WINDOW_CHUNKS)):
            ranges = [
                (c * CHUNK_PAIRS, min(pairs, (c + 1) * CHUNK_PAIRS))
                for c in chunks[first : first + WINDOW_CHUNKS]
            ]
            indices = np.concatenate([np.arange(start, stop) for start, stop in ranges])
            lengths = np.concatenate([self.store.lengths(start, stop) for start, stop in ranges])
            keep = lengths <= self.max_length
            indices, buckets = indices[keep], self._buckets(lengths[keep])
            if epoch is not None:
                order = _permutation(len(indices), seed, epoch + (window << 40))
                indices, buckets = indices[order], buckets[order]
            yield from self._fill(indices, buckets, pending)
        yield from self._flush(pending)

    def _fill(self, indices, buckets, pending):
        """The batches that pairs `indices` (in this order, in `buckets`) complete, in the order
        they complete, each bucket's pairs joining `pending[bucket]` (updated)."""
        leaving = []  # (position of the pair that filled the batch, bucket, indices)
        for bucket in np.unique(buckets):
            positions = np.flatnonzero(buckets == bucket)
            members = np.concatenate([pending[bucket], indices[positions]])
            size, waiting = self.batch_sizes[bucket], len(pending[bucket])
            full = len(members) // size
            leaving += [
                (positions[(k + 1) * size - 1 - waiting], bucket, members[k * size : (k + 1) * size])
                for k in range(full)
            ]
            pending[bucket] = members[full * size :]
        leaving.sort(key=lambda batch: batch[0])
        return [(members, self.bucket_lengths[bucket]) for _, bucket, members in leaving]

    def _flush(self, pending):
        """The part-filled batches at the end of an epoch, smallest bucket first."""
        return [(members, self.bucket_lengths[b]) for b, members in enumerate(pending) if len(members)]

    def _mixture_plan(self, epoch, seed):
        """A weighted mix's epoch: corpus i gives `mix_counts[i]` of its kept pairs (all of them as
        often as they fit, then a sample drawn by `(seed, epoch, i)`), shuffled together and batched;
        an epoch is `info.batches` batches (the expected count; a draw that falls short draws
        again). Unlike a single corpus, the epoch's pair numbers are held in memory (8 bytes each)."""
        store, emitted, draw = self.store, 0, 0
        parts = []  # (first pair number, lengths, kept pairs) of each corpus, once per epoch
        for part in range(len(self.mix_counts)):
            start, stop = int(store.starts[part]), int(store.starts[part + 1])
            lengths = store.lengths(start, stop)
            parts.append((start, lengths, np.flatnonzero(lengths <= self.max_length)))
        while emitted < self.info.batches:
            chosen, buckets = [], []
            for part, ((start, lengths, kept), count) in enumerate(zip(parts, self.mix_counts)):
                repeats, rest = divmod(int(count), len(kept))
                sample = kept[
                    _permutation(len(kept), seed, -(1 << 60) - (epoch << 12) - (draw << 8) - part)[:rest]
                ]
                picked = np.concatenate([np.tile(kept, repeats), sample])
                chosen.append(start + picked)
                buckets.append(self._buckets(lengths[picked]))
            indices, buckets = np.concatenate(chosen), np.concatenate(buckets)
            order = _permutation(len(indices), seed, epoch + (draw << 40))
            pending = [np.zeros(0, np.int64) for _ in self.bucket_lengths]
            batches = self._fill(indices[order], buckets[order], pending) + self._flush(pending)
            yield from batches[: self.info.batches - emitted]
            emitted += len(batches)
            draw += 1

    def _dataset(self, plans, count):
        """A dataset of the batches `plans()` lists, gathered from the store as they are needed."""
        multiple = self.row_multiple

        def batches():
            for indices, length in plans():
                rows = -(-len(indices) // multiple) * multiple
                source, target_in, labels = self.store.batch(indices, length, rows)
                yield {"source_ids": source, "target_ids": target_in}, labels

        ids = tf.TensorSpec((None, None), tf.int32)
        dataset = tf.data.Dataset.from_generator(
            batches, output_signature=({"source_ids": ids, "target_ids": ids}, ids)
        )
        # The batch count is the same every epoch (each bucket holds the same pairs); declaring
        # it lets Keras size its epochs (and TF checks it).
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(count))
        return dataset.prefetch(tf.data.AUTOTUNE)


def _permutation(count, seed, stream):
    """A permutation of `range(count)` fixed by `(seed, stream)` (TF's stateless shuffle)."""
    seeds = tf.constant([seed, stream], tf.int64)
    return tf.random.experimental.stateless_shuffle(tf.range(count, dtype=tf.int64), seed=seeds).numpy()


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
    pairs = TokenizedPairs.from_texts(
        sources,
        targets,
        tokenizer,
        batch_tokens=batch_tokens,
        max_length=max_length,
        bucket_width=bucket_width,
    )
    return (pairs.reshuffling(seed) if shuffle else pairs.in_order()), pairs.info
