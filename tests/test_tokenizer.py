import numpy as np
import pytest
import tensorflow as tf

import keras_transformer as kt
from keras_transformer.data.tokenizer import Tokenizer


def _lines(path):
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle]


@pytest.fixture(scope="module")
def multi30k_tokenizer(multi30k_dir):
    texts = _lines(multi30k_dir / "train.en") + _lines(multi30k_dir / "train.de")
    return Tokenizer.train(texts, vocab_size=4000)


@pytest.fixture(scope="module")
def tokenizer():
    """Trained on the built-in synthetic corpus (always available) plus a little English."""
    sources, targets = kt.load_corpus("synthetic")["train"]
    english = [
        "A man is sleeping.",
        "Two young, White males are outside near many bushes.",
        "A little girl climbing into a wooden playhouse.",
        "A dog runs.",
        "A cat.",
    ] * 20
    return Tokenizer.train(sources + targets + english, vocab_size=1000)


@pytest.mark.parametrize("language", ["en", "de"])
def test_round_trip_of_every_multi30k_val_sentence(multi30k_tokenizer, multi30k_dir, language):
    sentences = _lines(multi30k_dir / f"val.{language}")
    assert len(sentences) == 1014
    expected = [Tokenizer.normalize(s) for s in sentences]
    eager = [s.decode() for s in multi30k_tokenizer.decode(multi30k_tokenizer.encode(sentences)).numpy()]
    assert eager == expected

    @tf.function
    def round_trip(strings):
        return multi30k_tokenizer.decode(multi30k_tokenizer.encode(strings))

    graph = [s.decode() for s in round_trip(tf.constant(sentences)).numpy()]
    assert graph == expected


def test_special_ids_match_the_model_defaults(tokenizer):
    config = kt.TransformerConfig.from_preset("tiny", vocab_size=tokenizer.vocab_size)
    pieces = [tokenizer.processor.id_to_piece(i) for i in range(4)]
    assert pieces == ["<pad>", "<unk>", "<s>", "</s>"]
    assert (config.pad_id, config.bos_id, config.eos_id) == (0, 2, 3)
    assert tokenizer.vocab_size == 1000


def test_encode_pads_appends_eos_and_truncates(tokenizer):
    ids = tokenizer.encode(["A man.", "Two young, White males are outside near many bushes."])
    ids = np.asarray(ids)
    assert ids.dtype == np.int32 and ids.shape[0] == 2
    short = ids[0][ids[0] != 0]
    assert short[-1] == 3 and np.all(ids[0][len(short) :] == 0)
    clipped = np.asarray(tokenizer.encode(["Two young, White males are outside."], max_length=4))
    assert clipped.shape == (1, 4) and clipped[0, -1] == 3


def test_decode_stops_at_the_first_eos(tokenizer):
    ids = np.asarray(tokenizer.encode(["A dog runs.", "A cat."]))
    joined = np.concatenate([ids[:1, : ids[0].tolist().index(3) + 1], ids[1:, :3]], axis=1)
    assert tokenizer.decode(joined).numpy()[0].decode() == "A dog runs."


@pytest.mark.parametrize(
    "text",
    [
        "emoji 😀 ok",
        "日本語のテキスト",
        "tab\tinside",
        "a\x00b",
        "\u00a0non-breaking  spaces  ",
        "ﬁ ligature",
    ],
)
def test_text_outside_the_vocabulary_round_trips(tokenizer, text):
    back = tokenizer.decode(tokenizer.encode([text])).numpy()[0].decode()
    assert back == Tokenizer.normalize(text)


def test_save_and_load_give_the_same_ids(tokenizer, tmp_path):
    path = tmp_path / "run" / "tokenizer.model"
    tokenizer.save(path)
    loaded = Tokenizer.load(path)
    sentences = ["A little girl climbing into a wooden playhouse."]
    np.testing.assert_array_equal(loaded.encode(sentences), tokenizer.encode(sentences))
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.model"]  # no temporary left


def test_vocabulary_the_corpus_cannot_support_is_reported():
    with pytest.raises(ValueError, match=r"vocab_size=5000 is too large for this corpus.*at most \d+"):
        Tokenizer.train(["a b c"] * 10, vocab_size=5000)


def test_empty_corpus_is_reported():
    with pytest.raises(ValueError, match="empty corpus"):
        Tokenizer.train(["", "   "], vocab_size=100)


def test_survives_reseeding_tensorflow(tokenizer):
    before = np.asarray(tokenizer.encode(["A dog."]))
    tf.random.set_seed(1)  # clears TensorFlow's eager kernel cache
    np.testing.assert_array_equal(tokenizer.encode(["A dog."]), before)


def test_vocabulary_too_small_for_the_characters_is_reported():
    with pytest.raises(
        ValueError, match=r"vocab_size=100 is too small for this corpus: it needs at least \d+"
    ):
        Tokenizer.train(["abcdefghij klmnopqrst"] * 10, vocab_size=100)


def test_default_vocabulary_is_capped_to_the_built_in_corpus_but_an_explicit_one_is_not():
    """`train --data synthetic` with the defaults works (the corpus supports fewer than 8000
    pieces); an explicit `--vocab-size` that is too large stays an error."""
    from keras_transformer.data.corpora import load_corpus
    from keras_transformer.training.setup import _train_tokenizer
    from keras_transformer.utils.checks import UserError

    lines = []
    pairs, _ = load_corpus("synthetic", None, "en", "de").train_and_validation(lines.append)
    tokenizer = _train_tokenizer(pairs, None, 0, lines.append)
    assert 8 <= tokenizer.vocab_size < 8000
    assert lines[-1] == (
        f"Vocabulary: {tokenizer.vocab_size} pieces, the most this corpus supports "
        f"(the default is 8000; --vocab-size sets it)."
    )
    with pytest.raises(
        UserError,
        match=r"^vocab_size=8000 is too large for this corpus: "
        rf"SentencePiece can build at most {tokenizer.vocab_size} ",
    ):
        _train_tokenizer(pairs, 8000, 0, lines.append)
