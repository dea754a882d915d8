"""Names a package exports but imports on first use (PEP 562), and the hook that
registers our serializable classes as soon as Keras is loaded.

`import keras_transformer` imports neither Keras nor TensorFlow: the command
line answers `--help` and usage errors without them (TensorFlow alone takes
seconds to import), and on the JAX or PyTorch backend only the TF-only
features (`Tokenizer`, `make_dataset`, `Translator`, ...) import TensorFlow.
This module imports neither.
"""

import importlib
import importlib.abc
import importlib.util
import json
import os
import sys
import warnings


def _keras_backend():
    """The backend Keras will load, found as Keras finds it (`KERAS_BACKEND`, then `keras.json` in
    `KERAS_HOME` or `~/.keras`), without importing it."""
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as handle:
            return json.load(handle).get("backend", "tensorflow")
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


def _tensorflow_comes_next(name, tensorflow_names):
    """Whether importing the export `name` will import TensorFlow (not imported yet)."""
    if "tensorflow" in sys.modules or importlib.util.find_spec("tensorflow") is None:
        return name in tensorflow_names  # (where it is missing, `import_tensorflow` says so)
    return name in tensorflow_names or ("keras" not in sys.modules and _keras_backend() == "tensorflow")


def lazy_exports(package, exports, tensorflow_names=()):
    """`(__getattr__, __dir__)` for a package module that exports `exports`
    (name -> the module that defines it), each imported on first use.

    Names in `tensorflow_names` import TensorFlow through `import_tensorflow`
    first, so that where it is missing the error names the feature and the fix.
    Where the first use imports TensorFlow (those names, or any on Keras's
    TensorFlow backend), it is imported without its C++ start-up lines, as the
    command line does (`KERAS_TRANSFORMER_TF_LOGS=1` shows them).
    """

    def __getattr__(name):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if _tensorflow_comes_next(name, tensorflow_names):
            from keras_transformer.utils.tensorflow import import_tensorflow_quietly

            import_tensorflow_quietly(f"{package}.{name}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)  # found directly from now on
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__


def _import_all(modules):
    for module in modules:
        importlib.import_module(module)


class _AfterKerasLoads(importlib.abc.MetaPathFinder):
    """Finds `keras` as the other finders do, and imports `modules` once it has loaded."""

    def __init__(self, modules):
        self.modules = modules

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "keras":
            return None
        sys.meta_path.remove(self)  # one shot: the lookup below and every later import go past us
        spec = importlib.util.find_spec("keras")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            try:
                _import_all(self.modules)
            except Exception as error:  # never break the user's `import keras`
                warnings.warn(
                    f"keras_transformer could not register its layers with Keras ({error!r}); "
                    "load models with `keras_transformer.load_model`.",
                    stacklevel=2,
                )

        spec.loader.exec_module = exec_then_register
        return spec


def register_when_keras_loads(modules):
    """Imports `modules` (those that register classes with Keras) now if Keras is loaded, else
    right after it loads, so that `keras.saving.load_model` reads our `.keras` files whatever
    the order of the user's imports."""
    if "keras" in sys.modules:
        _import_all(modules)
    elif not any(isinstance(finder, _AfterKerasLoads) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterKerasLoads(modules))
