"""keras-transformer: the Transformer of "Attention Is All You Need" (Vaswani et
al., 2017) as a Keras 3 library."""

__version__ = "0.1.0"

# Every name is imported on first use (PEP 562): `import keras_transformer` imports
# neither Keras nor TensorFlow, so the command line starts fast. The model core runs
# on any Keras backend; the names in TENSORFLOW_NAMES need TensorFlow (tf-text, tf.data,
# tf.function). Our classes are registered with Keras as soon as it loads, so
# `keras.saving.load_model` reads a `.keras` file whatever the import order.

from keras_transformer.utils.lazy import lazy_exports, register_when_keras_loads

EXPORTS = {
    **dict.fromkeys(["Corpus", "CorpusError", "load_corpus"], "keras_transformer.data.corpora"),
    "sequence_task": "keras_transformer.data.toy_tasks",
    "Tokenizer": "keras_transformer.data.tokenizer",
    "make_dataset": "keras_transformer.data.batching",
    **dict.fromkeys(
        ["Translations", "beam_search", "greedy_search", "sample"], "keras_transformer.decoding.search"
    ),
    **dict.fromkeys(["DecodingOptions", "Hypotheses", "Hypothesis"], "keras_transformer.decoding.controls"),
    **dict.fromkeys(["align", "decode"], "keras_transformer.decoding.request"),
    "Translator": "keras_transformer.decoding.translator",
    **dict.fromkeys(["Scores", "score_translations"], "keras_transformer.evaluation"),
    **dict.fromkeys(
        [
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
        ],
        "keras_transformer.layers",
    ),
    **dict.fromkeys(["PRESETS", "Transformer", "TransformerConfig"], "keras_transformer.model"),
    "Ensemble": "keras_transformer.model.ensemble",
    **dict.fromkeys(
        [
            "LabelSmoothedCrossEntropy",
            "MaskedTokenAccuracy",
            "NoamSchedule",
            "compile_transformer",
            "make_optimizer",
        ],
        "keras_transformer.training",
    ),
    **dict.fromkeys(["load_model", "load_translator"], "keras_transformer.training.run_directory"),
    "train": "keras_transformer.training.trainer",
    "TrainingOptions": "keras_transformer.training.options",
}
TENSORFLOW_NAMES = ("Tokenizer", "make_dataset", "Translator", "load_translator", "train")

# The modules whose classes a `.keras` file names (`keras_transformer>Transformer`, ...).
SERIALIZABLE_MODULES = (
    "keras_transformer.model",  # the model and every layer
    "keras_transformer.training.losses",
    "keras_transformer.training.schedules",
)

__getattr__, __dir__ = lazy_exports(__name__, EXPORTS, TENSORFLOW_NAMES)
register_when_keras_loads(SERIALIZABLE_MODULES)

__all__ = sorted(EXPORTS)
