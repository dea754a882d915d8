"""SentencePiece pieces of a request's texts, for the runtimes that serve without TensorFlow
(`keras_transformer_export.onnx_runtime`, `keras_transformer_export.ctranslate2`).

`SentencePieceProcessor.encode(list_of_texts)` (sentencepiece 0.2) runs the list on a pool of
threads, as many as the machine has cores, started for every call: ~40 µs for an empty list,
~4 µs for one text passed as a string. A server translating one sentence at a time calls it
several times a request (the sources, the target prefixes, the suppressed sequences), right after
ONNX Runtime's intra-op threads finished their last kernel and are still spinning, so the two
sets of threads fight for the cores: ad hoc, on a 2-core Intel Xeon, `OnnxTranslator(mode="lean")`
took 10.3–13.2 ms to translate a test2016 sentence against 7.0–7.3 ms for its graph alone, and
7.2–7.7 ms with one `encode` call per text (the same ids). Tokenizing a corpus for training is
another matter (`keras_transformer.data.tokenizer.Tokenizer.ids_in_python` keeps the threads).
"""


def encode_each(processor, texts, out_type=int):
    """The pieces of each of `texts` (ids, or strings with `out_type=str`): one
    `processor.encode` call per text, no thread pool (module docstring)."""
    return [processor.encode(text, out_type=out_type) for text in texts]
