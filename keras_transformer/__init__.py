"""keras-transformer: the Transformer of "Attention Is All You Need" (Vaswani et
al., 2017) as a Keras 3 library."""

__version__ = "0.1.0"

from keras_transformer.attention import masked_softmax, scaled_dot_product_attention
from keras_transformer.config import PRESETS, TransformerConfig
from keras_transformer.data import Corpus, CorpusError, load_corpus, make_dataset
from keras_transformer.decoder import Decoder, DecoderLayer
from keras_transformer.decoding import Translations, beam_search, greedy_search
from keras_transformer.dropout import Dropout
from keras_transformer.embedding import TokenEmbedding
from keras_transformer.encoder import Encoder, EncoderLayer
from keras_transformer.evaluation import Scores, score_translations
from keras_transformer.feed_forward import PositionwiseFeedForward
from keras_transformer.losses import LabelSmoothedCrossEntropy, MaskedTokenAccuracy
from keras_transformer.masks import causal_mask, combine_masks, padding_mask
from keras_transformer.multi_head_attention import ATTENTION_MODES, MultiHeadAttention
from keras_transformer.positional_encoding import SinusoidalPositionalEncoding, sinusoidal_table
from keras_transformer.schedules import NoamSchedule
from keras_transformer.tokenizer import Tokenizer
from keras_transformer.toy_tasks import sequence_task
from keras_transformer.training import compile_transformer, make_optimizer
from keras_transformer.transformer import Transformer

__all__ = [
    "ATTENTION_MODES",
    "PRESETS",
    "Corpus",
    "CorpusError",
    "Scores",
    "Tokenizer",
    "load_corpus",
    "make_dataset",
    "score_translations",
    "Translations",
    "beam_search",
    "greedy_search",
    "Decoder",
    "DecoderLayer",
    "Dropout",
    "Encoder",
    "EncoderLayer",
    "LabelSmoothedCrossEntropy",
    "MaskedTokenAccuracy",
    "MultiHeadAttention",
    "NoamSchedule",
    "PositionwiseFeedForward",
    "SinusoidalPositionalEncoding",
    "TokenEmbedding",
    "Transformer",
    "TransformerConfig",
    "causal_mask",
    "combine_masks",
    "compile_transformer",
    "make_optimizer",
    "masked_softmax",
    "padding_mask",
    "scaled_dot_product_attention",
    "sequence_task",
    "sinusoidal_table",
]
