"""Data: corpora (Multi30k download and cache, aligned text files, the built-in
synthetic pair), toy tasks, the SentencePiece tokenizer, and the tf.data
batching pipeline.

`Tokenizer` (its in-graph tf-text ops) and `make_dataset` (tf.data) need
TensorFlow; they are imported on first use, so reading corpora does not.
"""

from keras_transformer.data.corpora import Corpus, CorpusError, load_corpus
from keras_transformer.data.toy_tasks import sequence_task
from keras_transformer.utils.lazy import lazy_exports

TENSORFLOW_NAMES = ("Tokenizer", "make_dataset")
__getattr__, __dir__ = lazy_exports(
    __name__,
    {"Tokenizer": "keras_transformer.data.tokenizer", "make_dataset": "keras_transformer.data.batching"},
    TENSORFLOW_NAMES,
)

__all__ = ["Corpus", "CorpusError", "Tokenizer", "load_corpus", "make_dataset", "sequence_task"]
