import urllib.error

import numpy as np
import pytest

from keras_transformer.data import corpora as data
from keras_transformer.data.batching import make_dataset
from keras_transformer.data.synthetic import ARTICLES, SyntheticLanguagePair


def test_synthetic_corpus_is_deterministic_and_splits_are_disjoint():
    first, second = data.load_corpus("synthetic"), data.load_corpus("synthetic")
    assert first.splits == second.splits
    sizes = {name: len(sources) for name, (sources, _) in first.splits.items()}
    assert sizes == data.SYNTHETIC_SIZES
    train, val, test = (set(first[name][0]) for name in ("train", "val", "test"))
    assert not (train & val) and not (train & test) and not (val & test)


def test_synthetic_pair_needs_real_translation():
    pair = SyntheticLanguagePair()
    splits = pair.corpus({"train": 3000})
    sources, targets = splits["train"]
    lengths = [len(s.split()) for s in sources]
    assert min(lengths) >= 3 and max(lengths) <= 25
    assert all(len(s.split()) == len(t.split()) for s, t in zip(sources, targets))  # word for word
    source_words = {w for s in sources for w in s.split()}
    assert 200 <= len(source_words) <= 1000  # a few hundred words
    assert any(ch in "äöüß" for t in targets for ch in t)  # UTF-8 beyond ASCII
    verbs = {t for _, t in pair.transitive} | {t for _, t in pair.intransitive}
    for target in targets:  # SOV: every clause ends with an agreeing verb
        for clause in target.split(" und "):
            last = clause.split()[-1]
            assert any(last in (verb + "t", verb + "en") for verb in verbs), clause
    nouns = {s: gender for s, _, gender in pair.nouns}
    checked = 0
    for source, target in zip(sources, targets):  # subject article agrees with the noun
        words, translated = source.split(), target.split()
        if words[0] == "the" and words[1] in nouns:
            assert translated[0] == ARTICLES[(True, nouns[words[1]], "nom")]
            checked += 1
    assert checked > 50


def test_synthetic_direction_can_be_reversed():
    forward = data.load_corpus("synthetic")
    backward = data.load_corpus("synthetic", source_lang="de", target_lang="en")
    assert backward["val"] == (forward["val"][1], forward["val"][0])


def test_aligned_files_are_read(tmp_path):
    (tmp_path / "a.src").write_text("one\n two \nthree\n", encoding="utf-8")
    (tmp_path / "a.tgt").write_text("eins\nzwei\ndrei\n", encoding="utf-8")
    corpus = data.load_corpus(f"files:{tmp_path / 'a.src'},{tmp_path / 'a.tgt'}")
    assert corpus["train"] == (["one", "two", "three"], ["eins", "zwei", "drei"])


def test_files_can_name_validation_and_test_splits(tmp_path):
    for name, lines in (("tr", "a\nb\n"), ("dev", "c\n"), ("te", "d\ne\nf\n")):
        (tmp_path / f"{name}.en").write_text(lines, encoding="utf-8")
        (tmp_path / f"{name}.de").write_text(lines.upper(), encoding="utf-8")
    pair = lambda name: f"{tmp_path / name}.en,{tmp_path / name}.de"  # noqa: E731
    corpus = data.load_corpus(f"files:train={pair('tr')};val={pair('dev')}; test={pair('te')}")
    assert sorted(corpus.splits) == ["test", "train", "val"]
    assert corpus["val"] == (["c"], ["C"]) and corpus["test"] == (["d", "e", "f"], ["D", "E", "F"])
    only_test = data.load_corpus(f"files:test={pair('te')}", source_lang="en", target_lang="de")
    assert sorted(only_test.splits) == ["test"] and only_test.source_lang == "en"
    with pytest.raises(data.CorpusError, match=r"has no split 'train'; it has \['test'\]"):
        only_test["train"]
    # The Python equivalent.
    direct = data.Corpus.from_files(
        train=(tmp_path / "tr.en", tmp_path / "tr.de"), test=(tmp_path / "te.en", tmp_path / "te.de")
    )
    assert direct["test"] == corpus["test"] and "val" not in direct.splits


@pytest.mark.parametrize(
    "dataset, message",
    [
        ("files:dev=a,b", "unknown split 'dev'; use train, val, test"),
        ("files:test=a,b;test=c,d", "the test split is given twice"),
        ("files:val=a", "val takes two comma-separated paths"),
        ("files:a,b,c", "train takes two comma-separated paths"),
        ("files:;", "names no files"),
        ("files:", "names no files"),
        ("files:a,b;;val=c,d", "has an empty entry between ';'"),
    ],
)
def test_bad_files_syntax_says_how_to_write_it(dataset, message):
    with pytest.raises(data.CorpusError, match=message):
        data.load_corpus(dataset)


@pytest.mark.parametrize(
    "source, target, message",
    [
        (None, b"x\n", "no such file"),
        (b"ok\n\xff\xfe bad\n", b"a\nb\n", "line 2: not valid UTF-8"),
        (b"a\nb\nc\n", b"a\nb\n", "has 3 lines but"),
        (b"\n\n", b"\n\n", "the corpus is empty"),
    ],
)
def test_bad_files_give_a_message_naming_the_problem(tmp_path, source, target, message):
    source_path, target_path = tmp_path / "s.txt", tmp_path / "t.txt"
    if source is not None:
        source_path.write_bytes(source)
    target_path.write_bytes(target)
    with pytest.raises(data.CorpusError, match=message):
        data.load_corpus(f"files:{source_path},{target_path}")


def test_unknown_dataset_lists_the_known_ones():
    with pytest.raises(data.CorpusError, match=r"Unknown dataset 'wmt14'; use one of \['synthetic'"):
        data.load_corpus("wmt14")


def test_multi30k_local_copy_is_verified_and_loaded(multi30k_dir):
    corpus = data.load_corpus("multi30k", data_dir=multi30k_dir)
    assert [len(corpus[name][0]) for name in ("train", "val", "test")] == [29000, 1014, 1000]
    assert corpus["val"][0][0].startswith("A group of men")
    reverse = data.load_corpus("multi30k", data_dir=multi30k_dir, source_lang="de", target_lang="en")
    assert reverse["val"][1][0] == corpus["val"][0][0]


def test_multi30k_corrupt_copy_is_refused(multi30k_dir, tmp_path):
    for name in data.MULTI30K_SHA256:
        (tmp_path / name).write_bytes((multi30k_dir / name).read_bytes())
    (tmp_path / "val.de").write_text("tampered\n", encoding="utf-8")
    with pytest.raises(data.CorpusError, match="val.de: sha256 mismatch"):
        data.load_corpus("multi30k", data_dir=tmp_path)


def test_multi30k_offline_says_what_to_download_and_where(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_TRANSFORMER_CACHE", str(tmp_path))

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(data.urllib.request, "urlopen", offline)
    with pytest.raises(data.CorpusError) as error:
        data.load_corpus("multi30k")
    message = str(error.value)
    assert "Offline?" in message and str(tmp_path / "multi30k") in message
    assert "train.en" in message and "--data-dir" in message
    assert not any((tmp_path / "multi30k").iterdir())  # nothing half-written


@pytest.fixture(scope="module")
def synthetic_tokenized():
    from keras_transformer.data.tokenizer import Tokenizer

    sources, targets = data.load_corpus("synthetic")["train"]
    return sources[:1500], targets[:1500], Tokenizer.train(sources + targets, vocab_size=800)


def test_dataset_batches_by_tokens_in_padded_buckets(synthetic_tokenized):
    sources, targets, tokenizer = synthetic_tokenized
    dataset, info = make_dataset(sources, targets, tokenizer, batch_tokens=512, max_length=32)
    lengths = (
        np.maximum(
            tokenizer.tokenize(sources).row_lengths().numpy(),
            tokenizer.tokenize(targets).row_lengths().numpy(),
        )
        + 1
    )
    assert info.dropped == int((lengths > 32).sum()) > 0
    assert info.examples + info.dropped == 1500
    seen = []
    for inputs, labels in dataset:
        source, target_in, labels = (
            np.asarray(t) for t in (inputs["source_ids"], inputs["target_ids"], labels)
        )
        batch, length = source.shape
        assert target_in.shape == labels.shape == (batch, length)
        assert length % 8 == 0 and length <= 32 and batch * length <= 512
        assert np.all(target_in[:, 0] == 2)  # BOS
        for row_in, row_out, row_source in zip(target_in, labels, source):
            real = row_out[row_out != 0]
            assert real[-1] == 3 and np.array_equal(row_in[1 : len(real)], real[:-1])  # shifted by one
            seen.append(tuple(row_source[row_source != 0]))
    assert len(seen) == info.examples == len(set(seen))  # each kept pair exactly once
    assert len(list(dataset)) == info.batches == int(dataset.cardinality())


def test_dataset_trains_with_fit(synthetic_tokenized):
    import keras_transformer as kt

    sources, targets, tokenizer = synthetic_tokenized
    dataset, _ = make_dataset(sources[:300], targets[:300], tokenizer, batch_tokens=1024, max_length=64)
    model = kt.Transformer.from_preset("tiny", vocab_size=tokenizer.vocab_size)
    kt.compile_transformer(model, warmup_steps=50)
    history = model.fit(dataset, epochs=2, shuffle=False, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert history.history["loss"][1] < history.history["loss"][0]


def test_train_step_is_not_retraced_after_the_first_epoch(synthetic_tokenized):
    import keras

    import keras_transformer as kt
    from keras_transformer.data.batching import TokenizedPairs

    sources, targets, tokenizer = synthetic_tokenized
    pairs = TokenizedPairs.from_texts(
        sources[:400], targets[:400], tokenizer, batch_tokens=512, max_length=64
    )
    shapes = {tuple(inputs["source_ids"].shape) for inputs, _ in pairs.epoch(0)}
    assert len(shapes) > 3  # several bucket lengths and batch sizes
    model = kt.Transformer.from_preset("tiny", vocab_size=tokenizer.vocab_size)
    kt.compile_transformer(model, warmup_steps=50)
    traces = []
    original_train_step = model.train_step

    def counting_train_step(data):  # Python runs this only while TensorFlow traces
        traces.append(1)
        return original_train_step(data)

    model.train_step = counting_train_step
    per_epoch = []
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: per_epoch.append(len(traces)))
    model.fit(
        pairs.epochs(0, 3),
        epochs=3,
        steps_per_epoch=pairs.info.batches,
        shuffle=False,
        verbose=0,
        callbacks=[record],
    )
    assert per_epoch[0] >= 1 and per_epoch[0] == per_epoch[-1], per_epoch


def test_several_training_corpora_take_weights_and_tags_and_bad_ones_are_one_line():
    from keras_transformer.data.corpora import TrainingFiles, parse_files

    splits = parse_files("files:train=a.en,a.de@0.7;train=bt.en,bt.de@0.3#<BT>;val=v.en,v.de")
    assert splits == {
        "train": [TrainingFiles("a.en", "a.de", 0.7), TrainingFiles("bt.en", "bt.de", 0.3, "<BT>")],
        "val": ("v.en", "v.de"),
    }
    assert parse_files("files:train=a.en,a.de")["train"] == ("a.en", "a.de")  # one corpus: as before
    for dataset, message in [
        ("files:train=a.en,a.de@0;val=v.en,v.de", r"the weight of a.en,a.de must be a number > 0; got '0'"),
        ("files:train=a.en,a.de@-1", r"must be a number > 0; got '-1'"),
        ("files:train=a.en,a.de@heavy", r"got 'heavy'"),
        ("files:train=a.en,a.de@nan", r"got 'nan'"),
        ("files:train=a.en,a.de#<B T>", r"the tag '<B T>' must be one word"),
        ("files:val=v.en,v.de;val=w.en,w.de", r"the val split is given twice"),
    ]:
        with pytest.raises(data.CorpusError, match=message):
            parse_files(dataset)
