"""Parallel corpora: the built-in `synthetic` pair, aligned text files, and
Multi30k EN-DE (downloaded into a cache, or read from a local copy).

    load_corpus("synthetic")
    load_corpus("files:train.src,train.tgt")
    load_corpus("files:train=train.src,train.tgt;val=dev.src,dev.tgt;test=test.src,test.tgt")
    load_corpus("multi30k", data_dir="../shared/data/multi30k", source_lang="en", target_lang="de")

A `Corpus` holds splits of (sources, targets) string lists. Loaded with
`stream=True` (as training loads it), a training split read from files is a
`ParallelText` instead: the files are read as streams when they are used, so a
corpus larger than memory can be trained on (`token_store.py` tokenizes it
once into a cache on disk). Every problem with the input is a `CorpusError` (a
`UserError`) whose message names the file, the line and what to do.
`batching.py` turns a split into batches for `model.fit` (`make_dataset`,
`TokenizedPairs`).
"""

import dataclasses
import gzip
import math
import os
import pathlib
import random
import shutil
import tempfile
import urllib.error
import urllib.request

from keras_transformer.data.synthetic import SyntheticLanguagePair
from keras_transformer.utils.checks import UserError
from keras_transformer.utils.files import sha256_of

DATASETS = ("synthetic", "multi30k", "files:SRC,TGT", "files:train=SRC,TGT;val=SRC,TGT;test=SRC,TGT")
FILE_SPLITS = ("train", "val", "test")
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


class CorpusError(UserError):
    """A corpus that cannot be used, with a message that says why and what to do."""


@dataclasses.dataclass
class Corpus:
    """Named splits of aligned sentences: `splits[name] = (sources, targets)`."""

    splits: dict
    source_lang: str = "src"
    target_lang: str = "tgt"

    @classmethod
    def from_files(cls, train=None, val=None, test=None, source_lang="src", target_lang="tgt", stream=False):
        """A corpus read from aligned UTF-8 files: each split given is a `(source path, target
        path)` pair (`read_parallel_files`). Training needs `train` (without `val` it holds out a
        part of it); `evaluate` reads the split it is asked for. With `stream`, the training split
        is a `ParallelText` (checked, not read). `train` may be a list of `TrainingFiles` (or
        `(source, target, weight, tag)` tuples): several corpora mixed by weight (a `MixedText`).

        Example:
            Corpus.from_files(train=[("a.en", "a.de", 0.7), ("bt.en", "bt.de", 0.3, "<BT>")],
                              val=("dev.en", "dev.de"), stream=True)"""
        given = {name: paths for name, paths in (("train", train), ("val", val), ("test", test)) if paths}
        if not given:
            raise CorpusError("Corpus.from_files needs at least one of train, val, test.")
        splits = {}
        for name, paths in given.items():
            if name == "train" and isinstance(paths, list):  # several corpora, weighted
                mix = MixedText(
                    [files if isinstance(files, TrainingFiles) else TrainingFiles(*files) for files in paths]
                )
                splits[name] = mix.checked() if stream else mix.read()
            elif name == "train" and stream:
                splits[name] = ParallelText(*paths).checked()
            else:
                splits[name] = read_parallel_files(*paths)
        return cls(splits, source_lang, target_lang)

    def train_and_validation(self, log=None):
        """`(train pairs, validation pairs)` as training uses them: the `val` split, or without one
        the last 5% of `train` (at most 1000 pairs) held out (`log`, if given, is told so). A
        streamed training split stays a `ParallelText`; the validation pairs are lists."""
        train_pairs = self["train"]
        if "val" in self.splits:
            return train_pairs, self["val"]
        if isinstance(train_pairs, MixedText):
            raise CorpusError(
                "Several training corpora are mixed: give a validation split too (val=SRC,TGT)."
            )
        count = train_pairs.count if isinstance(train_pairs, ParallelText) else len(train_pairs[0])
        held_out = max(1, min(1000, count // 20))
        if count - held_out < 1:
            raise CorpusError(f"The corpus has {count} pair(s): too few to train and validate.")
        if log is not None:
            log(f"No validation split given: holding out the last {held_out} pairs for validation.")
        if isinstance(train_pairs, ParallelText):
            return train_pairs.part(0, count - held_out), tuple(train_pairs.part(count - held_out, count))
        sources, targets = train_pairs
        return (sources[:-held_out], targets[:-held_out]), (sources[-held_out:], targets[-held_out:])

    def validation_pairs(self):
        """`(sources, targets)` that training validates on (`train_and_validation`)."""
        return self["val"] if "val" in self.splits else self.train_and_validation()[1]

    def __getitem__(self, name):
        if name not in self.splits:
            raise CorpusError(f"This corpus has no split {name!r}; it has {sorted(self.splits)}.")
        return self.splits[name]


def cache_dir():
    """Where downloads go: $KERAS_TRANSFORMER_CACHE or ~/.cache/keras_transformer."""
    return pathlib.Path(
        os.environ.get("KERAS_TRANSFORMER_CACHE", pathlib.Path.home() / ".cache" / "keras_transformer")
    )


def load_corpus(dataset, data_dir=None, source_lang="en", target_lang="de", seed=0, stream=False):
    """Loads `synthetic`, `multi30k` or `files:SRC,TGT` (see the module docstring). With `stream`,
    a training split read from files is a `ParallelText` (read when used), not lists."""
    if dataset == "synthetic":
        splits = SyntheticLanguagePair().corpus(SYNTHETIC_SIZES, seed=seed)
        corpus = Corpus(splits, "en", "de")
        return corpus if (source_lang, target_lang) != ("de", "en") else _swap(corpus)
    if dataset == "multi30k":
        return _multi30k(data_dir, source_lang, target_lang, stream)
    if dataset.startswith("files:"):
        return Corpus.from_files(
            **parse_files(dataset), source_lang=source_lang, target_lang=target_lang, stream=stream
        )
    raise CorpusError(f"Unknown dataset {dataset!r}; use one of {list(DATASETS)}.")


def parse_files(dataset):
    """`files:SRC,TGT` (a training split) or `files:train=SRC,TGT;val=SRC,TGT;test=SRC,TGT` (any of
    the three, each once) -> `{split: (source path, target path)}`. Several corpora mixed by
    weight: `train=SRC,TGT@WEIGHT#TAG` given more than once (`@WEIGHT`, default 1, and `#TAG`, a
    source-side tag such as `<BT>`, are optional) -> `{"train": [TrainingFiles, ...]}`."""
    usage = "files:SRC,TGT or files:train=SRC,TGT[@WEIGHT][#TAG];...;val=SRC,TGT;test=SRC,TGT"
    body = dataset[len("files:") :]
    parts = [part.strip() for part in body.split(";")]
    if not any(parts):
        raise CorpusError(f"{dataset!r} names no files; use {usage}.")
    if not all(parts):
        raise CorpusError(f"{dataset!r} has an empty entry between ';' (a stray ';'?); use {usage}.")
    if len(parts) == 1 and "=" not in parts[0]:
        parts = [f"train={parts[0]}"]
    splits, training = {}, []
    for part in parts:
        name, _, paths = part.partition("=")
        name = name.strip()
        if name not in FILE_SPLITS:
            raise CorpusError(f"{dataset!r}: unknown split {name!r}; use {', '.join(FILE_SPLITS)} ({usage}).")
        if name == "train":
            training.append(_training_files(dataset, paths, usage))
            continue
        if name in splits:
            raise CorpusError(f"{dataset!r}: the {name} split is given twice ({usage}).")
        splits[name] = _two_paths(dataset, name, paths, usage)
    if len(training) == 1 and training[0].weight == 1.0 and training[0].tag is None:
        splits["train"] = (training[0].source, training[0].target)
    elif training:
        splits["train"] = training
    return splits


@dataclasses.dataclass(frozen=True)
class TrainingFiles:
    """One training corpus of a weighted mix: aligned files, its weight (the share of each epoch's
    pairs it gives, relative to the others') and an optional source-side tag (e.g. `<BT>` on
    back-translated pairs, Caswell et al. 2019), one vocabulary piece prepended to every source."""

    source: str
    target: str
    weight: float = 1.0
    tag: str = None


def _two_paths(dataset, name, paths, usage):
    paths = [path.strip() for path in paths.split(",")]
    if len(paths) != 2 or not all(paths):
        raise CorpusError(f"{dataset!r}: {name} takes two comma-separated paths, SRC,TGT ({usage}).")
    return tuple(paths)


def _training_files(dataset, text, usage):
    text, _, tag = text.partition("#")
    text, _, weight = text.partition("@")
    source, target = _two_paths(dataset, "train", text, usage)
    tag = tag.strip() or None
    if tag is not None and (" " in tag or not tag.isprintable()):
        raise CorpusError(f"{dataset!r}: the tag {tag!r} must be one word without spaces, such as <BT>.")
    try:
        value = float(weight) if weight.strip() else 1.0
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise CorpusError(
            f"{dataset!r}: the weight of {source},{target} must be a number > 0; got {weight.strip()!r}."
        )
    return TrainingFiles(source, target, value, tag)


def _swap(corpus):
    return Corpus(
        {name: (targets, sources) for name, (sources, targets) in corpus.splits.items()},
        corpus.target_lang,
        corpus.source_lang,
    )


def _utf8_line(raw, path, number):
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError as error:
        raise CorpusError(
            f"{path}, line {number}: not valid UTF-8 ({error.reason} at byte "
            f"{error.start}); convert the file to UTF-8, e.g. with iconv."
        ) from None


def count_lines(path):
    """The number of lines of a file as `ParallelText` reads them, read in blocks (no decoding)."""
    count, last = 0, b"\n"
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


class ParallelText:
    """Aligned sentences in two UTF-8 files, line i of one translating line i of the other, read
    as a stream: a training corpus larger than memory.

    `checked()` counts both files' lines (a mismatch is a `CorpusError` naming the line without a
    partner) without decoding them; `chunks` streams `(sources, targets)` lists, every line
    checked as it is read; `sample` draws pairs for a vocabulary; `part` is a range of the pairs.
    Unpacked (`sources, targets = text`), it reads the whole range into two lists.
    """

    def __init__(self, source_path, target_path, start=0, stop=None, tag=None):
        self.paths = (pathlib.Path(source_path), pathlib.Path(target_path))
        self.start, self.stop, self.tag = start, stop, tag

    def checked(self):
        """Self, after checking that both files exist, are aligned and are not empty."""
        for path in self.paths:
            if not path.is_file():
                raise CorpusError(f"{path}: no such file.")
        counts = [count_lines(path) for path in self.paths]
        if counts[0] != counts[1]:
            longer = 0 if counts[0] > counts[1] else 1
            raise CorpusError(
                f"{self.paths[0]} has {counts[0]} lines but {self.paths[1]} has {counts[1]}: line "
                f"{min(counts) + 1} of {self.paths[longer]} has no partner; line i of one must "
                f"translate line i of the other."
            )
        if counts[0] == 0:
            raise CorpusError(f"{self.paths[0]} / {self.paths[1]}: the corpus is empty (no non-empty line).")
        self.stop = counts[0] if self.stop is None else min(self.stop, counts[0])
        return self

    @property
    def count(self):
        """The number of pairs in the range (after `checked`)."""
        if self.stop is None:
            self.checked()
        return self.stop - self.start

    def part(self, start, stop):
        """Pairs `start .. stop - 1` of this range, as a `ParallelText`."""
        return ParallelText(*self.paths, self.start + start, self.start + min(stop, self.count), self.tag)

    def fingerprint(self):
        """What identifies the text: each file's absolute path, size and modification time, the
        range and the tag (a token cache is keyed by it)."""
        files = [(str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns) for path in self.paths]
        stop = self.stop if self.stop is not None else self.count
        return {"files": files, "start": self.start, "stop": stop, "tag": self.tag}

    def chunks(self, size=65536, keep=None):
        """Yields `(sources, targets)` lists of up to `size` pairs, in order; with `keep` (sorted
        pair numbers within the range), only those pairs. A line that is not UTF-8, or a file that
        ends before its partner, is a `CorpusError` naming the file and the line."""
        stop = self.count + self.start
        wanted = iter(keep) if keep is not None else None
        want = next(wanted, None) if wanted is not None else None
        sources, targets, any_source, any_target = [], [], False, False
        with open(self.paths[0], "rb") as source_file, open(self.paths[1], "rb") as target_file:
            for number in range(1, stop + 1):
                raw_source, raw_target = source_file.readline(), target_file.readline()
                if not raw_source or not raw_target:
                    ended = self.paths[0] if not raw_source else self.paths[1]
                    other = self.paths[1] if not raw_source else self.paths[0]
                    raise CorpusError(
                        f"{ended} ends before line {number} but {other} goes on (was a file changed "
                        f"while it was read?); line i of one must translate line i of the other."
                    )
                index = number - 1 - self.start
                if index < 0 or (wanted is not None and index != want):
                    continue
                source = _utf8_line(raw_source, self.paths[0], number)
                target = _utf8_line(raw_target, self.paths[1], number)
                any_source, any_target = any_source or bool(source), any_target or bool(target)
                sources.append(f"{self.tag} {source}" if self.tag else source)
                targets.append(target)
                if wanted is not None:
                    want = next(wanted, None)
                    if want is None:
                        break
                if len(sources) == size:
                    yield sources, targets
                    sources, targets = [], []
        if sources:
            yield sources, targets
        if keep is None and not (any_source and any_target):
            raise CorpusError(f"{self.paths[0]} / {self.paths[1]}: the corpus is empty (no non-empty line).")

    def sample(self, pairs, seed=0):
        """`(sources, targets)`: every pair when the range holds at most `pairs`, in order; else
        `pairs` of them drawn at random (fixed by `seed`), in corpus order."""
        if self.count <= pairs:
            keep = None
        else:
            keep = sorted(random.Random(seed).sample(range(self.count), pairs))
        sources, targets = [], []
        for chunk_sources, chunk_targets in self.chunks(keep=keep):
            sources += chunk_sources
            targets += chunk_targets
        return sources, targets

    def __iter__(self):
        return iter(self.sample(self.count))

    def __repr__(self):
        paths = ", ".join(repr(str(path)) for path in self.paths)
        return f"ParallelText({paths}, {self.start}, {self.stop}, {self.tag!r})"


class MixedText:
    """Several training corpora (`TrainingFiles`) mixed by weight: each is a `ParallelText` (with
    its tag); `weights` are the shares of each epoch's pairs (`batching.TokenizedPairs`)."""

    def __init__(self, files):
        self.files = list(files)
        self.parts = [ParallelText(f.source, f.target, tag=f.tag) for f in self.files]
        self.weights = [f.weight for f in self.files]
        self.tags = sorted({f.tag for f in self.files if f.tag})

    def checked(self):
        for part in self.parts:
            part.checked()
        return self

    @property
    def count(self):
        return sum(part.count for part in self.parts)

    def sample(self, pairs, seed=0):
        """Pairs for a vocabulary: from each corpus its share of `pairs` by size (`ParallelText.sample`)."""
        sources, targets, total = [], [], self.count
        for part in self.parts:
            part_sources, part_targets = part.sample(max(1, pairs * part.count // total), seed)
            sources += part_sources
            targets += part_targets
        return sources, targets

    def read(self):
        """`(sources, targets)` of every corpus, one after the other (tags applied, weights not)."""
        return self.checked().sample(self.count)


def read_parallel_files(source_path, target_path):
    """Aligned sentences from two files, line i of one translating line i of the other, as two
    lists (`ParallelText`'s checks: aligned, UTF-8, not empty)."""
    return tuple(ParallelText(source_path, target_path).checked())


def _multi30k(data_dir, source_lang, target_lang, stream=False):
    languages = {"en", "de"}
    if {source_lang, target_lang} != languages:
        raise CorpusError(
            f"multi30k is English-German: use --source-lang en --target-lang de "
            f"or the reverse; got {source_lang}->{target_lang}."
        )
    directory = pathlib.Path(data_dir) if data_dir else cache_dir() / "multi30k"
    for name, expected in MULTI30K_SHA256.items():
        path = directory / name
        if not path.is_file():
            if data_dir:
                raise CorpusError(
                    f"{path}: missing from --data-dir; it should hold {', '.join(MULTI30K_SHA256)}."
                )
            _download(name, path)
        if sha256_of(path) != expected:
            raise CorpusError(
                f"{path}: sha256 mismatch (expected {expected}); the file is "
                f"corrupt or not the official Multi30k one. Delete it to download again."
            )
    splits = {}
    for split, name in MULTI30K_SPLITS.items():
        paths = directory / f"{name}.{source_lang}", directory / f"{name}.{target_lang}"
        streamed = stream and split == "train"
        splits[split] = ParallelText(*paths).checked() if streamed else read_parallel_files(*paths)
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
            f"--data-dir DIR pointing at a copy."
        ) from None
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{name}-")
    with os.fdopen(handle, "wb") as file:
        file.write(gzip.decompress(compressed))
    shutil.move(temporary, path)
