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


# Session fixtures that cost a minute or more (and `document_run`, which the longest document
# tests share below): under pytest-xdist (`make test` runs two workers), every test that uses one
# of them goes to the same worker, so each is built once.
_EXPENSIVE_FIXTURES = ("reverse_model", "trained_run", "document_run")


@pytest.hookimpl(wrapper=True)  # runs before xdist's own hook, which reads the xdist_group markers
def pytest_collection_modifyitems(items):
    """Runs the tests that use the trained `reverse_model` fixture first, and groups the tests
    of each expensive session fixture onto one xdist worker (`--dist loadgroup`).

    The fixture times `model.fit` against a bound; trained first, it does not
    share the process with what earlier tests leave behind (the 214M parameter
    `big` model, tf.data threads). The order is otherwise unchanged.
    """
    items.sort(key=lambda item: 0 if "reverse_model" in getattr(item, "fixturenames", ()) else 1)
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "::test_document_code_runs[" in item.nodeid:  # their run is chosen in tests/test_docs.py
            own = item.nodeid.endswith(_OWN_TRAINED_RUN)
            item.add_marker(pytest.mark.xdist_group("document_run" if own else "trained_run"))
            continue
        for fixture in _EXPENSIVE_FIXTURES:
            if fixture in names:
                item.add_marker(pytest.mark.xdist_group(fixture))
                break
    return (yield)


# The four longest document tests (minutes each: they run the commands of the document) go to a
# group of their own on the other worker, with a cheaper run of their own (`document_run`, in
# tests/conftest.py): the `trained_run` group alone would otherwise take most of the suite's time
# on one worker. tests/test_docs.py reads the group to pick the run.
_OWN_TRAINED_RUN = tuple(
    f"test_document_code_runs[{document}]"
    for document in ("README.md", "docs/deployment.md", "docs/cli.md", "docs/decoding.md")
)
