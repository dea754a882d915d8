"""A tokenized corpus as flat arrays of token ids, in memory or memory-mapped from a cache
on disk, so that training on a corpus larger than memory needs memory that does not grow with it.

    store = TokenStore.from_texts(sources, targets, tokenizer)           # lists: in memory
    store = TokenStore.cached(ParallelText(...), tokenizer, root, log)   # files: tokenized once
    store.lengths(0, 100)            # (100,) max(source, target) length + 1 of pairs 0..99
    store.batch(indices, 32, rows)   # padded (rows, 32) source, target input and labels

A cache is a directory under `root` named by a digest of what it was made from (the files'
paths, sizes and modification times, the range of pairs, the tokenizer), so the next run on the
same text and vocabulary (a `--resume` included) opens it instead of tokenizing again:

    manifest.json                  format, pairs, dtype, the tokenizer's SHA-256, the text's
                                   fingerprint, each file's size and BLAKE2b digest
    source.ids, target.ids         every sentence's ids back to back, no BOS/EOS (uint16 when
                                   the vocabulary fits, else int32)
    source.offsets, target.offsets int64 (pairs + 1,): sentence i is ids[offsets[i]:offsets[i+1]]

It is written into a temporary sibling directory and renamed into place only when complete
(atomic), and opened only when the manifest and every file's size and digest check out; a
damaged cache is rebuilt. A failed write (a full disk) removes the temporary directory and
raises `StorageError`; bad text (`CorpusError`, file and line named) leaves nothing either.

Shape legend: `pairs` sentence pairs; ids int32 `(rows, length)`.
"""

import hashlib
import itertools
import json
import os
import pathlib
import shutil
import tempfile
import time

import numpy as np

from keras_transformer.data.special_ids import BOS_ID, EOS_ID, PAD_ID
from keras_transformer.utils.files import StorageError, sha256_of

FORMAT = 1
SIDES = ("source", "target")
FILES = ("source.ids", "source.offsets", "target.ids", "target.offsets")


class TokenStore:
    """The ids of aligned sentence pairs: per side, a flat array of ids and `pairs + 1` offsets."""

    def __init__(self, source_ids, source_offsets, target_ids, target_offsets, path=None):
        self.ids = {"source": source_ids, "target": target_ids}
        self.offsets = {"source": source_offsets, "target": target_offsets}
        self.path = path
        self.pairs = len(source_offsets) - 1

    @classmethod
    def from_texts(cls, sources, targets, tokenizer):
        """Tokenizes lists of sentences into memory."""
        arrays = []
        for lines in (sources, targets):
            flat, lengths = _flat(tokenizer.ids_in_python(list(lines)), _dtype(tokenizer))
            arrays += [flat, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)]
        return cls(*arrays)

    @classmethod
    def cached(cls, text, tokenizer, root, log=None):
        """The store of a `ParallelText`: opened from its cache under `root`, or tokenized into a
        new one (streamed, a chunk at a time). `log` is told which, and how long it took."""
        log = log or (lambda message: None)
        key = {"format": FORMAT, "text": text.fingerprint(), "tokenizer": sha256_of(tokenizer.model_proto)}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        directory = pathlib.Path(root) / f"tokens-{digest}"
        started = time.perf_counter()
        store = _open(directory, key)
        if store is not None:
            log(
                f"Token cache: {directory} ({store.pairs:,} pairs) checked and reused in "
                f"{time.perf_counter() - started:.1f} s."
            )
            return store
        if directory.exists():
            log(f"Token cache: {directory} is incomplete or damaged; tokenizing again.")
            shutil.rmtree(directory, ignore_errors=True)
        _build(directory, key, text, tokenizer)
        store = _open(directory, key, digests=False)  # just written and hashed as it was written
        if store is None:
            raise StorageError(directory, OSError("the token cache just written does not read back"))
        megabytes = sum((directory / name).stat().st_size for name in FILES) / 1e6
        log(
            f"Token cache: tokenized {store.pairs:,} pairs into {directory} ({megabytes:,.0f} MB) in "
            f"{time.perf_counter() - started:.0f} s."
        )
        return store

    def side_lengths(self, side, start, stop):
        """`(stop - start,)` int64: the number of ids of sentences start..stop-1 of `side`."""
        return np.diff(self.offsets[side][start : stop + 1])

    def lengths(self, start, stop):
        """`(stop - start,)` int64: each pair's length in the batches, max(source, target) + 1
        (source + EOS; BOS + target and target + EOS)."""
        return (
            np.maximum(self.side_lengths("source", start, stop), self.side_lengths("target", start, stop)) + 1
        )

    def batch(self, indices, length, rows):
        """The pairs `indices` as padded int32 arrays `(rows, length)` (rows beyond `len(indices)`
        all padding): source + EOS, BOS + target (the decoder's input) and target + EOS (labels).
        Every pair must fit: `lengths(...)` <= `length`."""
        indices = np.asarray(indices, np.int64)
        source, source_lengths = self._gather("source", indices, length)
        target, target_lengths = self._gather("target", indices, length)
        count = len(indices)
        source[np.arange(count), source_lengths] = EOS_ID
        labels = target.copy()
        labels[np.arange(count), target_lengths] = EOS_ID
        target_in = np.full_like(target, PAD_ID)
        target_in[:, 0] = BOS_ID
        target_in[:, 1:] = target[:, :-1]
        padding = ((0, rows - count), (0, 0))
        return tuple(np.pad(array, padding, constant_values=PAD_ID) for array in (source, target_in, labels))

    def _gather(self, side, indices, length):
        starts = self.offsets[side][indices]
        lengths = self.offsets[side][indices + 1] - starts
        positions = np.arange(length)
        inside = positions[None, :] < lengths[:, None]
        ids = self.ids[side]
        if len(ids) == 0:
            return np.full(inside.shape, PAD_ID, np.int32), lengths
        values = np.asarray(ids[np.where(inside, starts[:, None] + positions[None, :], 0)], np.int32)
        return np.where(inside, values, PAD_ID).astype(np.int32), lengths


class StoreSequence:
    """Several `TokenStore`s read as one (the corpora of a weighted mix): pair i of part p is
    number `starts[p] + i`. It has a store's `pairs`, `lengths`, `side_lengths` and `batch`."""

    def __init__(self, stores):
        self.parts = list(stores)
        self.starts = np.concatenate([[0], np.cumsum([store.pairs for store in self.parts])]).astype(np.int64)
        self.pairs = int(self.starts[-1])

    def _pieces(self, start, stop):
        for part, store in enumerate(self.parts):
            low, high = max(start, self.starts[part]), min(stop, self.starts[part + 1])
            if low < high:
                yield store, int(low - self.starts[part]), int(high - self.starts[part])

    def side_lengths(self, side, start, stop):
        pieces = [store.side_lengths(side, low, high) for store, low, high in self._pieces(start, stop)]
        return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)

    def lengths(self, start, stop):
        pieces = [store.lengths(low, high) for store, low, high in self._pieces(start, stop)]
        return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)

    def batch(self, indices, length, rows):
        indices = np.asarray(indices, np.int64)
        parts = np.searchsorted(self.starts, indices, side="right") - 1
        result = [np.full((rows, length), PAD_ID, np.int32) for _ in range(3)]
        for part in np.unique(parts):
            where = np.flatnonzero(parts == part)
            arrays = self.parts[part].batch(indices[where] - self.starts[part], length, len(where))
            for array, values in zip(result, arrays):
                array[where] = values[: len(where)]
        return tuple(result)


def _dtype(tokenizer):
    return np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def _flat(id_lists, dtype):
    """`(ids back to back, lengths)` of a list of id lists."""
    lengths = np.fromiter(map(len, id_lists), np.int64, len(id_lists))
    return np.fromiter(itertools.chain.from_iterable(id_lists), dtype, int(lengths.sum())), lengths


class _DigestingFile:
    """A file written once, front to back, its size and BLAKE2b digest kept as it goes."""

    def __init__(self, path):
        self.file, self.digest, self.size = open(path, "wb"), hashlib.blake2b(), 0

    def write(self, data):
        self.file.write(data)
        self.digest.update(data)
        self.size += len(data)

    def close(self):
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def _build(directory, key, text, tokenizer):
    """Tokenizes `text` into `directory` atomically (see the module docstring)."""
    dtype = _dtype(tokenizer)
    temporary = None
    files = {}
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        temporary = pathlib.Path(tempfile.mkdtemp(dir=directory.parent, prefix=".partial-tokens-"))
        files = {name: _DigestingFile(temporary / name) for name in FILES}
        ends = {side: 0 for side in SIDES}
        for side in SIDES:
            files[f"{side}.offsets"].write(np.zeros(1, np.int64).tobytes())
        pairs = 0
        for chunk in text.chunks():
            pairs += len(chunk[0])
            for side, lines in zip(SIDES, chunk):
                flat, lengths = _flat(tokenizer.ids_in_python(lines), dtype)
                files[f"{side}.ids"].write(flat.tobytes())
                offsets = ends[side] + np.cumsum(lengths)
                files[f"{side}.offsets"].write(offsets.astype(np.int64).tobytes())
                ends[side] = int(offsets[-1]) if len(offsets) else ends[side]
        for file in files.values():
            file.close()
        manifest = dict(
            key,
            pairs=pairs,
            dtype=np.dtype(dtype).name,
            files={
                name: {"bytes": file.size, "blake2b": file.digest.hexdigest()} for name, file in files.items()
            },
        )
        with open(temporary / "manifest.json", "w") as handle:
            json.dump(manifest, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.rename(temporary, directory)
        except OSError:
            if _open(directory, key) is None:  # not another process's complete cache
                raise
    except OSError as error:
        raise StorageError(
            directory, error, hint="free space, or give --token-cache a directory on a disk with room"
        ) from None
    finally:
        for file in files.values():
            if not file.file.closed:
                file.file.close()
        if temporary is not None and temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)


def _open(directory, key, digests=True):
    """The store in `directory` if it is a complete cache of `key` whose files check out (sizes,
    and with `digests` their BLAKE2b digests), else None."""
    try:
        with open(directory / "manifest.json") as handle:
            manifest = json.load(handle)
        if {name: manifest[name] for name in key} != json.loads(json.dumps(key)):
            return None
        arrays = []
        for name in FILES:
            path, expected = directory / name, manifest["files"][name]
            if path.stat().st_size != expected["bytes"] or (
                digests and _blake2b(path) != expected["blake2b"]
            ):
                return None
            dtype = np.int64 if name.endswith(".offsets") else np.dtype(manifest["dtype"])
            arrays.append(np.memmap(path, dtype, mode="r") if expected["bytes"] else np.zeros(0, dtype))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    store = TokenStore(*arrays, path=directory)
    if store.pairs != manifest["pairs"] or len(arrays[3]) != len(arrays[1]):
        return None
    return store


def _blake2b(path):
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "blake2b").hexdigest()
