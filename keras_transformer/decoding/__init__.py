"""Decoding (§6.1): greedy and beam search over a `Transformer` with a fixed-size
key/value cache (backend-neutral), and `translator.Translator`, strings to
strings (TensorFlow: the tf-text tokenizer)."""

from keras_transformer.decoding.search import Translations, beam_search, greedy_search

__all__ = ["Translations", "beam_search", "greedy_search"]
