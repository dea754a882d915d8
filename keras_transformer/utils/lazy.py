"""Names a package exports but imports on first use (PEP 562), for the parts that
need TensorFlow: `import keras_transformer` on the JAX or PyTorch backend does
not import it."""

import importlib


def lazy_attribute(package, names, name):
    """`names[name]`'s attribute `name` (imported now), or the `AttributeError` Python gives."""
    if name not in names:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    from keras_transformer.utils.tensorflow import import_tensorflow

    import_tensorflow(f"keras_transformer.{name}")
    return getattr(importlib.import_module(names[name]), name)
