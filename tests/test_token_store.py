"""The training corpus read as streams and tokenized once into a cache on disk
(`data/token_store.py`, `corpora.ParallelText`), and the batches built from it
(`data/batching.py`): the same batches as tf.data's bucketing of the same pairs,
every pair once per epoch when the corpus spans many shuffle windows, and bad
text or a full disk leaving nothing behind."""

import errno
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.data import batching, token_store
from keras_transformer.data.batching import TokenizedPairs
from keras_transformer.data.corpora import CorpusError, ParallelText
from keras_transformer.data.token_store import TokenStore
from keras_transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from keras_transformer.utils.files import StorageError


@pytest.fixture(scope="module")
def pairs(synthetic_files):
    sources, targets = (path.read_text(encoding="utf-8").splitlines() for path in synthetic_files)
    return sources, targets


@pytest.fixture(scope="module")
def tokenizer(pairs):
    return Tokenizer.train(pairs[0] + pairs[1], vocab_size=300)


def _write(directory, sources, targets):
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / "a.src", directory / "a.tgt"
    for path, lines in zip(paths, (sources, targets)):
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return paths


def _as_lists(store, side):
    ids, offsets = store.ids[side], store.offsets[side]
    return [list(map(int, ids[offsets[i] : offsets[i + 1]])) for i in range(store.pairs)]


def test_python_tokenization_gives_the_graph_tokenizers_ids(pairs, tokenizer):
    texts = pairs[0][:50] + ["a\x00b", "  spaced   out  ", "", "Ünïcödé ﬁ ½ 日本"]
    assert tokenizer.ids_in_python(texts) == tokenizer.tokenize(tf.constant(texts)).to_list()


def test_the_cache_holds_the_in_memory_ids_and_the_next_run_reuses_it(pairs, tokenizer, tmp_path):
    paths = _write(tmp_path / "text", *pairs)
    text, messages = ParallelText(*paths).checked(), []
    cached = TokenStore.cached(text, tokenizer, tmp_path / "cache", messages.append)
    memory = TokenStore.from_texts(*pairs, tokenizer)
    assert isinstance(cached.ids["source"], np.memmap)
    for side in ("source", "target"):
        assert _as_lists(cached, side) == _as_lists(memory, side)
    assert "tokenized 800 pairs" in messages[-1]
    again = TokenStore.cached(ParallelText(*paths).checked(), tokenizer, tmp_path / "cache", messages.append)
    assert "reused" in messages[-1] and again.path == cached.path
    # Another range of the same files, or changed files, is another cache.
    part = TokenStore.cached(text.part(0, 100), tokenizer, tmp_path / "cache", messages.append)
    assert part.pairs == 100 and part.path != cached.path
    assert _as_lists(part, "target") == _as_lists(memory, "target")[:100]
    paths[1].write_text("\n".join(pairs[1][::-1]) + "\n", encoding="utf-8")
    changed = TokenStore.cached(
        ParallelText(*paths).checked(), tokenizer, tmp_path / "cache", messages.append
    )
    assert changed.path != cached.path and "tokenized" in messages[-1]


def test_a_damaged_cache_is_rebuilt_not_used(pairs, tokenizer, tmp_path):
    text = ParallelText(*_write(tmp_path / "text", *pairs)).checked()
    store = TokenStore.cached(text, tokenizer, tmp_path / "cache")
    expected = _as_lists(store, "source")
    ids_file = store.path / "source.ids"
    damaged = bytearray(ids_file.read_bytes())
    damaged[10] ^= 0xFF  # same size, one byte flipped
    ids_file.write_bytes(bytes(damaged))
    messages = []
    rebuilt = TokenStore.cached(text, tokenizer, tmp_path / "cache", messages.append)
    assert "damaged" in messages[0] and "tokenized" in messages[-1]
    assert _as_lists(rebuilt, "source") == expected
    (rebuilt.path / "manifest.json").unlink()  # a cache whose writer died before the manifest
    assert _as_lists(TokenStore.cached(text, tokenizer, tmp_path / "cache"), "source") == expected


def test_a_full_disk_while_caching_leaves_no_cache_and_says_so(pairs, tokenizer, tmp_path, monkeypatch):
    text = ParallelText(*_write(tmp_path / "text", *pairs)).checked()
    original = token_store._DigestingFile.write

    def fill_up(self, data):
        if self.size + len(data) > 1000:  # the disk fills during the first file of ids
            raise OSError(errno.ENOSPC, "No space left on device")
        original(self, data)

    monkeypatch.setattr(token_store._DigestingFile, "write", fill_up)
    with pytest.raises(StorageError) as raised:
        TokenStore.cached(text, tokenizer, tmp_path / "cache")
    assert raised.value.no_space and "\n" not in str(raised.value)
    assert "--token-cache" in raised.value.hint
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-written is left to be used
    monkeypatch.setattr(token_store._DigestingFile, "write", original)
    assert TokenStore.cached(text, tokenizer, tmp_path / "cache").pairs == 800


def test_bad_text_found_mid_stream_names_file_and_line_and_leaves_nothing(pairs, tokenizer, tmp_path):
    source, target = _write(tmp_path / "text", *pairs)
    raw = target.read_bytes().split(b"\n")
    raw[700] = b"caf\xe9"  # Latin-1, line 701
    target.write_bytes(b"\n".join(raw))
    with pytest.raises(CorpusError, match=rf"{target}, line 701: not valid UTF-8"):
        TokenStore.cached(ParallelText(source, target).checked(), tokenizer, tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []
    target.write_text("\n".join(pairs[1][:-3]) + "\n", encoding="utf-8")
    with pytest.raises(
        CorpusError, match=rf"has 800 lines but .* has 797: line 798 of {source} has no partner"
    ):
        ParallelText(source, target).checked()


def _reference_batches(store, pairs, order):
    """What tf.data's own bucketing makes of the kept pairs in `order` (the pipeline before the
    token store): `bucket_by_sequence_length`, then padding to the bucket's length."""

    def example(i):
        source, target = (
            np.asarray(store.ids[s][store.offsets[s][i] : store.offsets[s][i + 1]], np.int32)
            for s in ("source", "target")
        )
        return np.append(source, EOS_ID), np.append(BOS_ID, target), np.append(target, EOS_ID)

    examples = [example(i) for i in order]
    dataset = tf.data.Dataset.from_generator(
        lambda: iter(examples), output_signature=(tf.TensorSpec([None], tf.int32),) * 3
    )
    batched = dataset.bucket_by_sequence_length(
        lambda source, target_in, labels: tf.maximum(tf.shape(source)[0], tf.shape(labels)[0]),
        bucket_boundaries=[length + 1 for length in pairs.bucket_lengths[:-1]],
        bucket_batch_sizes=pairs.batch_sizes,
        padding_values=(PAD_ID,) * 3,
    )
    result = []
    for source, target_in, labels in batched.as_numpy_iterator():
        longest = max(source.shape[1], labels.shape[1])
        length = min(-(-longest // pairs.bucket_width) * pairs.bucket_width, pairs.max_length)
        result.append(
            tuple(np.pad(a, ((0, 0), (0, length - a.shape[1]))) for a in (source, target_in, labels))
        )
    return result


def test_batches_are_tf_data_bucketing_of_the_epochs_shuffled_pairs(pairs, tokenizer):
    store = TokenStore.from_texts(*pairs, tokenizer)
    batched = TokenizedPairs(store, batch_tokens=256, max_length=24)
    assert 0 < batched.info.dropped < 800
    lengths = store.lengths(0, store.pairs)
    kept = np.flatnonzero(lengths <= 24)
    for epoch in (0, 3):
        order = kept[batching._permutation(len(kept), 7, epoch)]
        expected = _reference_batches(store, batched, order)
        got = [
            (x["source_ids"], x["target_ids"], y) for x, y in batched.epoch(epoch, seed=7).as_numpy_iterator()
        ]
        assert len(got) == len(expected) == batched.info.batches
        for mine, reference in zip(got, expected):
            for a, b in zip(mine, reference):
                np.testing.assert_array_equal(a, b)
    in_order = [y for _, y in batched.in_order().as_numpy_iterator()]
    for mine, reference in zip(in_order, _reference_batches(store, batched, kept)):
        np.testing.assert_array_equal(mine, reference[2])


def test_many_shuffle_windows_give_every_pair_once_per_epoch_in_a_fixed_order(pairs, tokenizer, monkeypatch):
    monkeypatch.setattr(batching, "CHUNK_PAIRS", 50)  # 16 chunks, shuffled 3 at a time
    monkeypatch.setattr(batching, "WINDOW_CHUNKS", 3)
    store = TokenStore.from_texts(*pairs, tokenizer)
    batched = TokenizedPairs(store, batch_tokens=256, max_length=24, row_multiple=2)
    kept = sorted(np.flatnonzero(store.lengths(0, store.pairs) <= 24))

    def plan(epoch, seed=0):
        return [tuple(indices) for indices, _ in batched.plan(epoch, seed)]

    epochs = {epoch: plan(epoch) for epoch in range(3)}
    for batches in epochs.values():
        assert len(batches) == batched.info.batches
        assert sorted(i for batch in batches for i in batch) == kept
    assert epochs[0] != epochs[1] != epochs[2] and plan(1) == epochs[1] and plan(1, seed=1) != epochs[1]
    # The first chunk is not always first: the chunks are shuffled, not only the pairs within them.
    first_pairs = {min(epochs[e][0]) // 50 for e in range(3)} | {min(plan(e)[0]) // 50 for e in range(3, 8)}
    assert len(first_pairs) > 1
    # A resumed epoch skips what was trained: the dataset from batch 5 is the plan's tail.
    tail = [y for _, y in batched.epoch(1, skip=5).as_numpy_iterator()]
    assert len(tail) == batched.info.batches - 5
    assert all(y.shape[0] % 2 == 0 for y in tail)
    for labels, indices in zip(tail, epochs[1][5:]):
        expected = store.batch(list(indices), labels.shape[1], labels.shape[0])[2]
        np.testing.assert_array_equal(labels, expected)


def test_a_weighted_mix_gives_each_corpus_its_share_of_every_epoch(pairs, tokenizer):
    from keras_transformer.data.token_store import StoreSequence

    big = TokenStore.from_texts(pairs[0][:600], pairs[1][:600], tokenizer)
    small = TokenStore.from_texts(pairs[0][600:], pairs[1][600:], tokenizer)  # 200 pairs
    with pytest.raises(ValueError, match=r"training corpus 1 of the mix has no pair of at most 2 tokens"):
        TokenizedPairs(StoreSequence([big, small]), batch_tokens=256, max_length=2, weights=[1, 3])
    mixed = TokenizedPairs(StoreSequence([big, small]), batch_tokens=256, max_length=24, weights=[1, 3])
    kept = [int(np.sum(store.lengths(0, store.pairs) <= 24)) for store in (big, small)]
    assert list(mixed.mix_counts) == [round(sum(kept) / 4), round(3 * sum(kept) / 4)]

    def plan(epoch, seed=0):
        return [tuple(indices) for indices, _ in mixed.plan(epoch, seed)]

    epochs = [plan(epoch) for epoch in range(3)]
    for batches in epochs:
        assert len(batches) == mixed.info.batches
        drawn = np.concatenate(batches)
        from_small = np.sum(drawn >= 600)
        assert abs(from_small / len(drawn) - 0.75) < 0.05  # the small corpus, upsampled to 3/4
        small_kept = np.flatnonzero(small.lengths(0, 200) <= 24) + 600
        assert set(small_kept) <= set(drawn)  # each of its pairs at least once (it fits twice)
    assert epochs[0] != epochs[1] and plan(1) == epochs[1] and plan(1, seed=5) != epochs[1]
    labels = [y for _, y in mixed.epoch(2, seed=0).as_numpy_iterator()]
    assert len(labels) == mixed.info.batches
    np.testing.assert_array_equal(
        labels[3],
        StoreSequence([big, small]).batch(list(epochs[2][3]), labels[3].shape[1], labels[3].shape[0])[2],
    )


def test_a_tagged_corpus_starts_every_source_with_its_tag_piece(pairs, tmp_path):
    from keras_transformer.data.corpora import MixedText, TrainingFiles

    paths = _write(tmp_path / "text", pairs[0][:100], pairs[1][:100])
    mix = MixedText([TrainingFiles(*paths, 1.0), TrainingFiles(*paths, 0.5, "<BT>")]).checked()
    sources, targets = mix.sample(1000)
    tokenizer = Tokenizer.train(sources + targets, vocab_size=300, user_defined_symbols=mix.tags)
    tag_id = tokenizer.processor.piece_to_id("<BT>")
    plain, tagged = (TokenStore.cached(part, tokenizer, tmp_path / "cache") for part in mix.parts)
    assert plain.path != tagged.path  # the tag is part of the cache's key
    # The tag is text before the source, tokenized as a translator tokenizes "<BT> a sentence":
    # SentencePiece's word boundary, then the tag as one piece.
    expected = tokenizer.ids_in_python([f"<BT> {source}" for source in pairs[0][:100]])
    assert _as_lists(tagged, "source") == expected
    assert all(ids[:2] == [tokenizer.processor.piece_to_id("▁"), tag_id] for ids in expected)
    assert _as_lists(tagged, "target") == _as_lists(plain, "target")


def test_token_store_reads_without_tensorflow():
    """Reading token ids into batches needs neither TensorFlow nor SentencePiece (a JAX-only machine
    trains from them: `scripts/sweep_multi30k.py`)."""
    code = (
        "import sys; sys.modules['tensorflow'] = sys.modules['sentencepiece'] = None\n"
        "import numpy as np\n"
        "from keras_transformer.data.token_store import TokenStore\n"
        "store = TokenStore(np.array([5, 6, 7], np.uint16), np.array([0, 2, 3]), np.array([8, 9], np.uint16),"
        " np.array([0, 1, 2]))\n"
        "source, target_in, labels = store.batch([1, 0], 3, 2)\n"
        "print(source.tolist(), target_in.tolist(), labels.tolist())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split("\n")[0] == (
        f"[[7, {EOS_ID}, {PAD_ID}], [5, 6, {EOS_ID}]] [[{BOS_ID}, 9, {PAD_ID}], [{BOS_ID}, 8, {PAD_ID}]] "
        f"[[9, {EOS_ID}, {PAD_ID}], [8, {EOS_ID}, {PAD_ID}]]"
    )
