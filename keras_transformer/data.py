"""Parallel corpora: the built-in `synthetic` pair, aligned text files, and
Multi30k EN-DE (downloaded into a cache, or read from a local copy).

    load_corpus("synthetic")
    load_corpus("files:train.src,train.tgt")
    load_corpus("multi30k", data_dir="../shared/data/multi30k", source_lang="en", target_lang="de")

A `Corpus` holds splits of (sources, targets) string lists. Every problem
with the input is a `CorpusError` (a `ValueError`) whose message names the
file, the line and what to do. `make_dataset` turns a split into batches for
`model.fit`.
"""

import dataclasses
import gzip
import hashlib
import os
import pathlib
import shutil
import tempfile
import urllib.error
import urllib.request

import numpy as np
import tensorflow as tf

from keras_transformer.synthetic import SyntheticLanguagePair
from keras_transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID

DATASETS = ("synthetic", "multi30k", "files:SRC,TGT")
SYNTHETIC_SIZES = {"train": 20000, "val": 500, "test": 500}
MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/{name}.gz"
MULTI30K_SPLITS = {"train": "train", "val": "val", "test": "test2016"}
MULTI30K_SHA256 = {
    "train.en": "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6",
    "train.de": "2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72",
    "val.en": "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227",
    "val.de": "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660",
    "test2016.en": "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182",
    "test2016.de": "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16",
}


class CorpusError(ValueError):
    """A corpus that cannot be used, with a message that says why and what to do."""


@dataclasses.dataclass
class Corpus:
    """Named splits of aligned sentences: `splits[name] = (sources, targets)`."""

    splits: dict
    source_lang: str = "src"
    target_lang: str = "tgt"

    def __getitem__(self, name):
        if name not in self.splits:
            raise CorpusError(f"This corpus has no split {name!r}; it has {sorted(self.splits)}.")
        return self.splits[name]


def cache_dir():
    """Where downloads go: $KERAS_TRANSFORMER_CACHE or ~/.cache/keras_transformer."""
    return pathlib.Path(os.environ.get("KERAS_TRANSFORMER_CACHE",
                                       pathlib.Path.home() / ".cache" / "keras_transformer"))


def load_corpus(dataset, data_dir=None, source_lang="en", target_lang="de", seed=0):
    """Loads `synthetic`, `multi30k` or `files:SRC,TGT` (see the module docstring)."""
    if dataset == "synthetic":
        splits = SyntheticLanguagePair().corpus(SYNTHETIC_SIZES, seed=seed)
        corpus = Corpus(splits, "en", "de")
        return corpus if (source_lang, target_lang) != ("de", "en") else _swap(corpus)
    if dataset == "multi30k":
        return _multi30k(data_dir, source_lang, target_lang)
    if dataset.startswith("files:"):
        paths = dataset[len("files:"):].split(",")
        if len(paths) != 2 or not all(paths):
            raise CorpusError(f"files: takes two comma-separated paths (files:SRC,TGT); got {dataset!r}.")
        return Corpus({"train": read_parallel_files(*paths)}, source_lang, target_lang)
    raise CorpusError(f"Unknown dataset {dataset!r}; use one of {list(DATASETS)}.")


def _swap(corpus):
    return Corpus({name: (targets, sources) for name, (sources, targets) in corpus.splits.items()},
                  corpus.target_lang, corpus.source_lang)


def read_lines(path):
    """The lines of a UTF-8 text file, stripped; `CorpusError` on a missing or non-UTF-8 file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such file.")
    lines = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                lines.append(raw.decode("utf-8").strip())
            except UnicodeDecodeError as error:
                raise CorpusError(
                    f"{path}, line {number}: not valid UTF-8 ({error.reason} at byte "
                    f"{error.start}); convert the file to UTF-8, e.g. with iconv.") from None
    return lines


def read_parallel_files(source_path, target_path):
    """Aligned sentences from two files, line i of one translating line i of the other."""
    sources, targets = read_lines(source_path), read_lines(target_path)
    if len(sources) != len(targets):
        raise CorpusError(
            f"{source_path} has {len(sources)} lines but {target_path} has {len(targets)}; "
            f"line i of one must translate line i of the other.")
    if not any(sources) or not any(targets):
        raise CorpusError(f"{source_path} / {target_path}: the corpus is empty (no non-empty line).")
    return sources, targets


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _multi30k(data_dir, source_lang, target_lang):
    languages = {"en", "de"}
    if {source_lang, target_lang} != languages:
        raise CorpusError(f"multi30k is English-German: use --source-lang en --target-lang de "
                          f"or the reverse; got {source_lang}->{target_lang}.")
    directory = pathlib.Path(data_dir) if data_dir else cache_dir() / "multi30k"
    for name, expected in MULTI30K_SHA256.items():
        path = directory / name
        if not path.is_file():
            if data_dir:
                raise CorpusError(f"{path}: missing from --data-dir; it should hold "
                                  f"{', '.join(MULTI30K_SHA256)}.")
            _download(name, path)
        if sha256(path) != expected:
            raise CorpusError(f"{path}: sha256 mismatch (expected {expected}); the file is "
                              f"corrupt or not the official Multi30k one. Delete it to download again.")
    splits = {split: read_parallel_files(directory / f"{name}.{source_lang}",
                                         directory / f"{name}.{target_lang}")
              for split, name in MULTI30K_SPLITS.items()}
    return Corpus(splits, source_lang, target_lang)


def _download(name, path):
    url = MULTI30K_URL.format(name=name)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            compressed = response.read()
    except (urllib.error.URLError, OSError) as error:
        raise CorpusError(
            f"Could not download {url} ({error}). Offline? Put the Multi30k files "
            f"{', '.join(MULTI30K_SHA256)} (uncompressed UTF-8) in {path.parent}, or pass "
            f"--data-dir DIR pointing at a copy.") from None
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{name}-")
    with os.fdopen(handle, "wb") as file:
        file.write(gzip.decompress(compressed))
    shutil.move(temporary, path)


@dataclasses.dataclass
class DatasetInfo:
    """What `make_dataset` kept: examples, dropped (too long), batches per epoch, padded lengths."""

    examples: int
    dropped: int
    batches: int
    bucket_lengths: tuple


def make_dataset(sources, targets, tokenizer, batch_tokens=4096, max_length=256,
                 bucket_width=8, shuffle=True, seed=0):
    """Batches of token ids for `model.fit`, bucketed by length and sized by tokens.

    Sentences are tokenized (SentencePiece, in-graph); a pair whose source or
    target needs more than `max_length` ids (EOS/BOS included) is dropped and
    counted. Pairs are grouped by length into buckets `bucket_width` apart and
    padded to the bucket's length L; a bucket's batches hold `batch_tokens // L`
    pairs (the paper batches by ~25000 tokens, §5.1). Every batch therefore has
    one of a few shapes, so `fit` traces its step a bounded number of times.

    Returns:
        `(dataset, info)`: the dataset yields `({"source_ids": (batch, L),
        "target_ids": (batch, L)}, labels (batch, L))` int32, target_ids =
        BOS + target, labels = target + EOS; `info` is a `DatasetInfo`. The
        dataset reshuffles itself every epoch: call `fit(..., shuffle=False)`.
    """
    if batch_tokens < 1 or max_length < 1 or bucket_width < 1:
        raise ValueError("batch_tokens, max_length and bucket_width must be positive integers.")
    source_ids = tokenizer.tokenize(tf.constant(list(sources)))
    target_ids = tokenizer.tokenize(tf.constant(list(targets)))
    lengths = np.maximum(source_ids.row_lengths().numpy(), target_ids.row_lengths().numpy()) + 1
    keep = lengths <= max_length
    source_ids = tf.ragged.boolean_mask(source_ids, keep)
    target_ids = tf.ragged.boolean_mask(target_ids, keep)
    boundaries = list(range(bucket_width, max_length + bucket_width, bucket_width))
    padded = [min(b, max_length) for b in boundaries]
    dataset = tf.data.Dataset.from_tensor_slices((source_ids, target_ids))
    if shuffle:
        dataset = dataset.shuffle(int(keep.sum()) or 1, seed=seed, reshuffle_each_iteration=True)

    def add_specials(source, target):
        eos, bos = tf.constant([EOS_ID], tf.int32), tf.constant([BOS_ID], tf.int32)
        return tf.concat([source, eos], 0), tf.concat([bos, target], 0), tf.concat([target, eos], 0)

    dataset = dataset.map(add_specials, num_parallel_calls=tf.data.AUTOTUNE)
    dataset = dataset.bucket_by_sequence_length(
        element_length_func=lambda source, target_in, labels: tf.maximum(
            tf.shape(source)[0], tf.shape(labels)[0]),
        bucket_boundaries=[length + 1 for length in padded[:-1]],
        bucket_batch_sizes=[max(1, batch_tokens // length) for length in padded],
        padded_shapes=([None], [None], [None]), padding_values=(PAD_ID, PAD_ID, PAD_ID),
        pad_to_bucket_boundary=False,
    )
    dataset = dataset.map(_pad_to_bucket(bucket_width, max_length), num_parallel_calls=tf.data.AUTOTUNE)
    # The batch count is the same every epoch (each bucket holds the same
    # pairs); declaring it lets Keras size its epochs (and TF checks it).
    per_bucket = np.bincount(np.searchsorted(padded, lengths[keep]), minlength=len(padded))
    batch_sizes = np.array([max(1, batch_tokens // length) for length in padded])
    batches = int(np.sum(-(-per_bucket // batch_sizes)))
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(batches))
    info = DatasetInfo(examples=int(keep.sum()), dropped=int((~keep).sum()), batches=batches,
                       bucket_lengths=tuple(padded))
    return dataset.prefetch(tf.data.AUTOTUNE), info


def _pad_to_bucket(bucket_width, max_length):
    def pad(source, target_in, labels):
        longest = tf.maximum(tf.shape(source)[1], tf.shape(labels)[1])
        length = tf.minimum((longest + bucket_width - 1) // bucket_width * bucket_width, max_length)

        def to_length(ids):
            return tf.pad(ids, [[0, 0], [0, length - tf.shape(ids)[1]]], constant_values=PAD_ID)

        return {"source_ids": to_length(source), "target_ids": to_length(target_in)}, to_length(labels)
    return pad
