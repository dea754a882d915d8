"""The runtimes without TensorFlow tokenize a request one text per SentencePiece call
(`keras_transformer_export.request_pieces`): the ids of a call on the whole list, without the
thread pool such a call starts (which fought ONNX Runtime's threads for the cores: +3–6 ms a
sentence at batch 1, module docstring)."""

import numpy as np
import sentencepiece

from keras_transformer_export.request_pieces import encode_each

TEXTS = ["A dog runs.", "", " \t ", "Zwei Männer 🚲 – fahren", "a\x00b", "x " * 300]


class _NoListEncode:
    """A SentencePiece processor that refuses a list of texts (one would start the thread pool)
    and counts its calls."""

    def __init__(self, processor):
        self.processor, self.calls = processor, 0

    def encode(self, text, **options):
        assert isinstance(text, str), f"encode was given {type(text).__name__}, not one text"
        self.calls += 1
        return self.processor.encode(text, **options)

    def __getattr__(self, name):
        return getattr(self.processor, name)


def test_each_text_gets_the_pieces_of_a_call_on_the_whole_list(exported):
    processor = sentencepiece.SentencePieceProcessor(model_file=str(exported[1] / "tokenizer.model"))
    for out_type in (int, str):
        assert encode_each(processor, TEXTS, out_type=out_type) == processor.encode(TEXTS, out_type=out_type)
    assert encode_each(processor, []) == []


def test_onnx_runtime_translates_with_one_encode_call_per_text(exported):
    from keras_transformer_export.onnx_runtime import OnnxTranslator

    sentences = ["a b c", "d e", "f"]
    for mode in ("lean", "split"):
        plain = OnnxTranslator(str(exported[1]), mode)
        spied = OnnxTranslator(str(exported[1]), mode)
        spied.processor = _NoListEncode(spied.processor)
        assert spied.translate(sentences)[0] == plain.translate(sentences)[0], mode
        assert spied.processor.calls > 0
        request = dict(target_prefix=[None, "d", None], suppress_sequences=["e"], num_return=2)
        found, expected = (t.translate_hypotheses(sentences, **request) for t in (spied, plain))
        assert [[h.text for h in s] for s in found] == [[h.text for h in s] for s in expected], mode
        np.testing.assert_allclose(
            [[h.score for h in s] for s in found], [[h.score for h in s] for s in expected]
        )


def test_ctranslate2_tokenizes_with_one_encode_call_per_text(exported):
    from keras_transformer_export.ctranslate2 import CTranslate2Translator

    processor = sentencepiece.SentencePieceProcessor(model_file=str(exported[1] / "tokenizer.model"))
    translator = CTranslate2Translator.__new__(CTranslate2Translator)  # tokenize needs no model
    translator.processor, translator.max_length = _NoListEncode(processor), 4
    expected = [pieces[:3] for pieces in processor.encode(TEXTS, out_type=str)]
    assert translator.tokenize(TEXTS) == expected
    assert translator.processor.calls == len(TEXTS)
