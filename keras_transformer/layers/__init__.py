"""The paper's sublayers (§3.1-3.5) as serializable Keras layers, backend-neutral.

Shape legend: batch, len_q / len_k (query / key positions), d_model.
"""

# Keras first: loading it registers our serializable classes (`keras_transformer.utils.lazy`),
# which imports these modules; were Keras first imported by one of them, half-imported, that
# registration would fail (a `from keras_transformer.layers.X import ...` as a process's
# first import warned "could not register its layers" and left them unregistered).
import keras  # noqa: F401  (isort: skip)

from keras_transformer.layers.attention import masked_softmax, scaled_dot_product_attention
from keras_transformer.layers.decoder import Decoder, DecoderLayer
from keras_transformer.layers.decoding_cache import CacheHistory, DecodingCache, LayerCache
from keras_transformer.layers.dropout import Dropout
from keras_transformer.layers.embedding import TokenEmbedding
from keras_transformer.layers.encoder import Encoder, EncoderLayer
from keras_transformer.layers.feed_forward import PositionwiseFeedForward
from keras_transformer.layers.masks import causal_mask, combine_masks, padding_mask
from keras_transformer.layers.multi_head_attention import ATTENTION_MODES, MultiHeadAttention
from keras_transformer.layers.positional_encoding import SinusoidalPositionalEncoding, sinusoidal_table

__all__ = [
    "ATTENTION_MODES",
    "CacheHistory",
    "Decoder",
    "DecoderLayer",
    "DecodingCache",
    "Dropout",
    "Encoder",
    "EncoderLayer",
    "LayerCache",
    "MultiHeadAttention",
    "PositionwiseFeedForward",
    "SinusoidalPositionalEncoding",
    "TokenEmbedding",
    "causal_mask",
    "combine_masks",
    "masked_softmax",
    "padding_mask",
    "scaled_dot_product_attention",
    "sinusoidal_table",
]
