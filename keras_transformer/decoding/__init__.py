"""Decoding (§6.1): greedy and beam search over a `Transformer` with a
key/value cache (backend-neutral, `search`), the decoding policy they share
with the exported runtimes (`policy`, no Keras), and `translator.Translator`,
strings to strings (TensorFlow: the tf-text tokenizer).

The search names are imported on first use, so `decoding.policy` is read
without Keras (the command line, the ONNX Runtime driver).
"""

from keras_transformer.utils.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    dict.fromkeys(["Translations", "beam_search", "greedy_search"], "keras_transformer.decoding.search"),
)

__all__ = ["Translations", "beam_search", "greedy_search"]
