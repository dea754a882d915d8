"""The one way this package imports TensorFlow for its TF-only features.

The model core (layers, `Transformer`, loss, metric, searches) runs on any Keras
backend and never imports TensorFlow. The tf.data pipeline, the tf-text
tokenizer graph, the `tf.distribute` strategies, the training run and export
need it; they import it through `import_tensorflow`, which says in one line
what is missing when it is not installed.
"""

import os
import re
import sys
import tempfile

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


# Set to 1 to see TensorFlow's C++ start-up lines in the command line's output.
SHOW_LOGS_VARIABLE = "KERAS_TRANSFORMER_TF_LOGS"

# What TensorFlow's C++ libraries print while they load and find the devices, whatever
# TF_CPP_MIN_LOG_LEVEL says (absl writes before its logging is initialized): absl's banner,
# informational lines ("I0000 ..."; oneDNN, CUDA drivers, CPU features) and the continuation
# of the last one; and, on a machine without an NVIDIA driver, CUDA's failed initialization.
_START_UP_LINE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\)|I\d{4} |To enable the following instructions"
)
_NO_CUDA_LINE = re.compile(r"E\d{4} .*failed call to cuInit")


def _is_start_up_line(line):
    if _START_UP_LINE.match(line):
        return True
    return bool(_NO_CUDA_LINE.match(line)) and not os.path.exists("/dev/nvidiactl")


def import_tensorflow_quietly(feature):
    """`import_tensorflow(feature)` without TensorFlow's C++ start-up lines on stderr.

    For the command line and the package's lazy names (`kt.Transformer`): it points file descriptor 2 at a
    temporary file while TensorFlow loads, then writes back everything but the
    start-up lines (warnings and errors stay), and finds the devices meanwhile
    (which logs too). Does nothing special when TensorFlow
    is already imported or `KERAS_TRANSFORMER_TF_LOGS=1`.
    """
    if "tensorflow" in sys.modules or os.environ.get(SHOW_LOGS_VARIABLE) == "1":
        return import_tensorflow(feature)
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            tensorflow = import_tensorflow(feature)
            tensorflow.config.list_physical_devices()  # device discovery logs too, once
            return tensorflow
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode("utf-8", errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not _is_start_up_line(line)))
            sys.stderr.flush()
