"""The package's dependencies point one way (issue 16):

    utils <- layers <- model <- decoding, training objective <- data <- training runs,
    evaluation, plots <- cli;  keras_transformer_export (the `export/` folder) outside,
    importing the library, never imported by it.

Read from the source (every `import`, also those inside functions), so a new
module that breaks the direction fails here, not in a user's circular import.
Also: `import keras_transformer` on another backend does not import TensorFlow.
"""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "keras_transformer")

# What each part may import from the package (besides itself).
ALLOWED = {
    "utils": set(),
    "layers": {"utils"},
    "model": {"utils", "layers"},
    "decoding": {"utils", "layers", "model"},
    "training.objective": {"utils", "layers", "model"},
    "data": {"utils"},
    "training": {"utils", "layers", "model", "decoding", "training.objective", "data", "evaluation", "plots"},
    "evaluation": {"utils"},
    "plots": {"utils"},
}
ALLOWED["cli"] = ALLOWED["training"] | {"training"}  # the top: all of the package
ALLOWED["__init__"] = ALLOWED["cli"] - {"plots"}  # the public names; plots are reached through the CLI
OBJECTIVE = {"losses", "schedules", "optimizer", "fused_step"}  # training modules the model core may see

# Deliberate upward imports, each made at call time, with the reason.
EXCEPTIONS = set()


def _part(module):
    """`keras_transformer.training.losses` -> `training.objective`; `keras_transformer.cli` -> `cli`."""
    names = module.split(".")[1:]
    if not names:
        return "__init__"
    if names[0] == "training" and len(names) > 1 and names[1] in OBJECTIVE:
        return "training.objective"
    return names[0]


def _modules():
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                relative = os.path.relpath(path, ROOT)
                module = relative[: -len(".py")].replace(os.sep, ".")
                yield relative, module.removesuffix(".__init__")


def _imports(path):
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            # `from keras_transformer import cli` imports the module `keras_transformer.cli`.
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_the_layout_has_the_parts_the_rules_name():
    parts = {_part(module) for _, module in _modules()}
    assert parts == set(ALLOWED), parts ^ set(ALLOWED)


@pytest.mark.parametrize("relative,module", sorted(_modules()))
def test_dependencies_point_one_way(relative, module):
    here = _part(module)
    wrong = set()
    for imported in _imports(os.path.join(ROOT, relative)):
        if imported.split(".")[0] in ("export", "keras_transformer_export"):
            wrong.add(imported)
        elif imported.startswith("keras_transformer.") and imported.count(".") >= 1:
            there = _part(imported)
            is_module = os.path.exists(os.path.join(ROOT, *imported.split("."))) or os.path.exists(
                os.path.join(ROOT, *imported.split(".")) + ".py"
            )
            if not is_module:
                continue  # a name imported from a module, counted with its module
            if there != here and there not in ALLOWED[here] and (relative, there) not in EXCEPTIONS:
                wrong.add(imported)
    assert not wrong, f"{relative} ({here}) must not import {sorted(wrong)}"


def test_import_does_not_import_tensorflow_on_other_backends():
    pytest.importorskip("jax")
    code = (
        "import sys, keras_transformer as kt\n"
        "kt.Transformer.from_preset('tiny', vocab_size=40)\n"
        "assert 'tensorflow' not in sys.modules, 'TensorFlow was imported'\n"
        "kt.Tokenizer\n"
        "assert 'tensorflow' in sys.modules\n"
    )
    environment = dict(os.environ, KERAS_BACKEND="jax")
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


IMPORT_ORDERS = {
    "keras-first": "import keras\nimport keras_transformer\n",
    "keras_transformer-first": (
        "import sys\nimport keras_transformer\nassert 'keras' not in sys.modules\nimport keras\n"
    ),
    # A layer module first: it imports Keras itself, half-imported (this warned "could not
    # register its layers" and left them unregistered until `layers/__init__` loads Keras first).
    "a-layer-module-first": (
        "from keras_transformer.layers.positional_encoding import sinusoidal_table\nimport keras\n"
    ),
}


@pytest.mark.parametrize("order", sorted(IMPORT_ORDERS))
def test_keras_load_model_reads_our_files_whatever_the_import_order(order, tmp_path):
    """The package root imports nothing heavy, yet `keras.saving.load_model` finds our classes
    (`keras_transformer>Transformer`) once Keras loads, imported before or after us, without a
    warning."""
    import keras_transformer as kt

    path = tmp_path / "tiny.keras"
    kt.Transformer.from_preset("tiny", vocab_size=40).save(path)
    code = (
        IMPORT_ORDERS[order]
        + f"model = keras.saving.load_model({str(path)!r})\nprint(type(model).__name__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["Transformer"]
    assert "could not register" not in result.stderr


def test_missing_tensorflow_is_one_line(monkeypatch):
    from keras_transformer.utils import tensorflow

    monkeypatch.setitem(sys.modules, "tensorflow", None)  # `import tensorflow` raises ImportError
    with pytest.raises(tensorflow.TensorFlowMissing, match=r"^tf\.data pipelines needs TensorFlow.*\n?$"):
        tensorflow.import_tensorflow("tf.data pipelines")


def _python_files(*folders):
    for folder in folders:
        for directory, _, files in os.walk(os.path.join(ROOT, folder)):
            yield from (os.path.join(directory, name) for name in sorted(files) if name.endswith(".py"))


def test_private_keras_names_only_in_the_compatibility_module():
    """`keras.src` (Keras' private modules) is read in `utils/keras_compat.py` only, where each use
    has a test that fails on a Keras upgrade that moves it."""
    allowed = os.path.join(PACKAGE, "utils", "keras_compat.py")
    wrong = [
        os.path.relpath(path, ROOT)
        for path in _python_files("keras_transformer", "export", "scripts", "tests")
        if path != allowed and any(name.startswith("keras.src") for name in _imports(path))
    ]
    assert not wrong, f"keras.src imported outside utils/keras_compat.py: {wrong}"


def test_export_uses_the_librarys_public_names_only():
    """The exporters import no underscore name from the library (what they need is public API)."""
    wrong = []
    for path in _python_files("export"):
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras_transformer."):
                private = [alias.name for alias in node.names if alias.name.startswith("_")]
                private += [part for part in node.module.split(".") if part.startswith("_")]
                wrong += [f"{os.path.relpath(path, ROOT)}: {node.module}.{name}" for name in private]
    assert not wrong, wrong


def test_no_module_imports_the_package_root():
    """A module inside the package imports the part it needs, never `keras_transformer` itself (the
    root imports every part: importing it from inside runs back up the layers). The CLI's
    `__version__` is the one name read from the root."""
    wrong = []
    for relative, module in _modules():
        if module == "keras_transformer":
            continue
        with open(os.path.join(ROOT, relative), encoding="utf-8") as source:
            tree = ast.parse(source.read(), relative)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(
                alias.name == "keras_transformer" for alias in node.names
            ):
                wrong.append(f"{relative}:{node.lineno}")
            elif isinstance(node, ast.ImportFrom) and node.module == "keras_transformer":
                wrong += [
                    f"{relative}:{node.lineno} ({a.name})" for a in node.names if a.name != "__version__"
                ]
    assert not wrong, wrong
