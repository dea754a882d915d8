"""keras-transformer: the Transformer of "Attention Is All You Need" (Vaswani et
al., 2017) as a Keras 3 library."""

__version__ = "0.1.0"

# The model core below runs on any Keras backend and does not import TensorFlow;
# `Tokenizer` (tf-text) and `make_dataset` (tf.data) are imported on first use.

from keras_transformer.data import Corpus, CorpusError, load_corpus, sequence_task
from keras_transformer.decoding import Translations, beam_search, greedy_search
from keras_transformer.evaluation import Scores, score_translations
from keras_transformer.layers import (
    ATTENTION_MODES,
    Decoder,
    DecoderLayer,
    DecodingCache,
    Dropout,
    Encoder,
    EncoderLayer,
    LayerCache,
    MultiHeadAttention,
    PositionwiseFeedForward,
    SinusoidalPositionalEncoding,
    TokenEmbedding,
    causal_mask,
    combine_masks,
    masked_softmax,
    padding_mask,
    scaled_dot_product_attention,
    sinusoidal_table,
)
from keras_transformer.model import PRESETS, Transformer, TransformerConfig
from keras_transformer.training import (
    LabelSmoothedCrossEntropy,
    MaskedTokenAccuracy,
    NoamSchedule,
    compile_transformer,
    make_optimizer,
)

# The jobs that need TensorFlow (tf-text, tf.function), imported on first use.
TENSORFLOW_NAMES = {
    "Translator": "keras_transformer.decoding.translator",
    "load_translator": "keras_transformer.training.run_directory",
}


def __getattr__(name):
    """`Tokenizer`, `make_dataset`, `Translator` and `load_translator`, imported on first use."""
    from keras_transformer import data
    from keras_transformer.utils.lazy import lazy_attribute

    if name in data.TENSORFLOW_NAMES:
        return getattr(data, name)
    return lazy_attribute(__name__, TENSORFLOW_NAMES, name)


__all__ = [
    "ATTENTION_MODES",
    "PRESETS",
    "Corpus",
    "CorpusError",
    "Scores",
    "Tokenizer",
    "Translator",
    "load_corpus",
    "load_translator",
    "make_dataset",
    "score_translations",
    "Translations",
    "beam_search",
    "greedy_search",
    "Decoder",
    "DecoderLayer",
    "DecodingCache",
    "Dropout",
    "Encoder",
    "EncoderLayer",
    "LabelSmoothedCrossEntropy",
    "MaskedTokenAccuracy",
    "LayerCache",
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
