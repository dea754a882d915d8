"""The encoder-decoder model (Figure 1) and its configuration and presets; backend-neutral."""

from keras_transformer.model.config import PRESETS, TransformerConfig
from keras_transformer.model.transformer import Transformer

__all__ = ["PRESETS", "Transformer", "TransformerConfig"]
