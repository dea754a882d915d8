"""Decoding (§6.1): greedy and beam search over a `Transformer` with a
key/value cache (backend-neutral, `search`), the decoding policy they share
with the exported runtimes (`policy`, no Keras), and `translator.Translator`,
strings to strings (TensorFlow: the tf-text tokenizer).

The search names are imported on first use, so `decoding.policy` and the other
rules (`controls`, `sampling`, `alignments`) are read without Keras (the command
line, the ONNX Runtime driver). `request.decode` runs one request's options.
"""

from keras_transformer.utils.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(
            ["Translations", "beam_search", "greedy_search", "sample"], "keras_transformer.decoding.search"
        ),
        **dict.fromkeys(["align", "decode"], "keras_transformer.decoding.request"),
    },
)

__all__ = ["Translations", "align", "beam_search", "decode", "greedy_search", "sample"]
