"""The one way this package imports TensorFlow for its TF-only features.

The model core (layers, `Transformer`, loss, metric, searches) runs on any Keras
backend and never imports TensorFlow. The tf.data pipeline, the tf-text
tokenizer graph, the `tf.distribute` strategies, the training run and export
need it; they import it through `import_tensorflow`, which says in one line
what is missing when it is not installed.
"""

from keras_transformer.utils.checks import UserError


class TensorFlowMissing(UserError, ImportError):
    """A TF-only feature was used where TensorFlow is not installed."""


def import_tensorflow(feature):
    """`tensorflow`, or `TensorFlowMissing` naming `feature` and the fix."""
    try:
        import tensorflow
    except ImportError as error:
        raise TensorFlowMissing(
            f"{feature} needs TensorFlow, which is not installed ({error}); "
            "install it with `pip install keras-transformer` (it pins tensorflow), "
            "or use the backend-neutral parts (layers, Transformer, fit on NumPy arrays, search)."
        ) from None
    return tensorflow
