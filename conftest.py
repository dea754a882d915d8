"""Test set-up shared by tests/ and the doctests in keras_transformer/.

Two logical CPU devices must exist before TensorFlow initializes its runtime,
so that MirroredStrategy can be tested on a CPU-only machine.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)


@pytest.fixture(autouse=True)
def _seed_and_float32_policy():
    """Every test starts seeded, in float32, and leaves the global policy as it found it."""
    keras.utils.set_random_seed(0)
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")


def pytest_collection_modifyitems(items):
    """Runs the tests that use the trained `reverse_model` fixture first.

    The fixture times `model.fit` against a 90 s bound; trained first, it does
    not share the process with what earlier tests leave behind (the 214M
    parameter `big` model, tf.data threads). The order is otherwise unchanged.
    """
    items.sort(key=lambda item: 0 if "reverse_model" in getattr(item, "fixturenames", ()) else 1)
