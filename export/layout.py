"""Where exports go on disk, written so that a reader never sees half of one.

TF Serving's layout: `DIR/<model_name>/<version>/` (version: a positive
integer; the server polls `DIR/<model_name>` and loads the highest version),
with a `DIR/models.config` listing the models for `--model_config_file`.

An export is built in a hidden sibling directory (`.partial-...`, which TF
Serving ignores: it only loads directories named by an integer) and renamed
into place when complete, so a killed exporter leaves no visible version and
the versions already there are untouched; the next export deletes what a
killed one left. Replacing an existing version
(`overwrite=True`) moves the old one aside first, renames the new one in,
then deletes the old one: at every moment the path holds a complete export
or nothing. A write the storage refuses (a full disk) removes the partial
directory and raises `keras_transformer.utils.files.StorageError`.

One exporter at a time per destination (`export_lock`): a second one is
refused with the first one's pid.
"""

import contextlib
import errno
import os
import re
import shutil
import tempfile

from keras_transformer.training.locking import WriterLock
from keras_transformer.utils.checks import UserError
from keras_transformer.utils.files import StorageError, atomic_write

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def check_model_name(name):
    """`name` if usable as a TF Serving model name and directory, else a `UserError`."""
    if not isinstance(name, str) or not _MODEL_NAME.match(name):
        raise UserError(
            f"Model name {name!r} is not usable: use letters, digits, '_', '-' and "
            f"'.', starting with a letter or digit."
        )
    return name


def versions(model_dir):
    """The complete versions (integer directory names) under `model_dir`, ascending."""
    if not os.path.isdir(model_dir):
        return []
    return sorted(
        int(entry)
        for entry in os.listdir(model_dir)
        if entry.isdigit() and os.path.isdir(os.path.join(model_dir, entry))
    )


def next_version(model_dir):
    """1 for a new model, else one more than the highest version."""
    existing = versions(model_dir)
    return existing[-1] + 1 if existing else 1


def check_free(path, overwrite=False):
    """The absolute `path`; a `UserError` if it exists and not `overwrite`."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not overwrite:
        raise UserError(
            f"{path} already exists. Choose another --out/--version, or pass --overwrite to replace it."
        )
    return path


def export_lock(export_format, out):
    """The `WriterLock` of an export's destination.

    `saved_model`: the TF Serving base directory `out` (its versions and
    `models.config`); `onnx`: `out` is replaced as a whole, so the lock file
    `.<name>.lock` lives beside it in its parent.
    """
    out = os.path.abspath(out)
    if export_format == "saved_model":
        return WriterLock(out)
    return WriterLock(os.path.dirname(out), lock_name=f".{os.path.basename(out)}.lock")


@contextlib.contextmanager
def atomic_directory(path, overwrite=False):
    """Yields a temporary directory to fill; it becomes `path` when the block succeeds.

    Raises `UserError` before any work if `path` exists and not `overwrite`.
    On an exception (or a kill) the temporary directory is removed (or left
    hidden) and `path` is untouched.
    """
    path = check_free(path, overwrite)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    remove_abandoned(parent)
    temporary = tempfile.mkdtemp(dir=parent, prefix=f".partial-{os.path.basename(path)}-{os.getpid()}-")
    try:
        yield temporary
        os.chmod(temporary, 0o755)  # mkdtemp makes it private
        if os.path.exists(path):
            old = tempfile.mkdtemp(dir=parent, prefix=f".replaced-{os.path.basename(path)}-")
            os.rename(path, os.path.join(old, "previous"))
            os.rename(temporary, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(temporary, path)
    except Exception as error:
        # TensorFlow's writers raise their own error types; the message tells a full disk.
        if isinstance(error, OSError) or "No space left on device" in str(error):
            raise StorageError(
                path,
                error if isinstance(error, OSError) else OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
            ) from error
        raise
    finally:
        if os.path.exists(temporary):
            shutil.rmtree(temporary, ignore_errors=True)


def remove_abandoned(parent):
    """Deletes `.partial-*` directories in `parent` left by exporters that were killed.

    The exporter's process id is in the name; a directory whose process no
    longer runs on this machine is abandoned (one still running is left alone).
    """
    for entry in os.listdir(parent):
        match = re.match(r"^\.partial-.+-(\d+)-[^-]+$", entry)
        if match and not _process_exists(int(match.group(1))):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _process_exists(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def write_models_config(base_dir, serving_root="/models"):
    """Writes `base_dir/models.config` listing every model directory that holds a version.

    `base_path`s point where the TF Serving container sees `base_dir`
    (`docker run -v BASE_DIR:/models ...`). Returns the path.
    """
    entries = []
    for name in sorted(os.listdir(base_dir)):
        if _MODEL_NAME.match(name) and versions(os.path.join(base_dir, name)):
            entries.append(
                f'  config {{\n    name: "{name}"\n    base_path: '
                f'"{serving_root}/{name}"\n    model_platform: "tensorflow"\n  }}\n'
            )
    path = os.path.join(base_dir, "models.config")
    atomic_write(
        path,
        "# TF Serving --model_config_file; written by keras-transformer export.\n"
        "model_config_list {\n" + "".join(entries) + "}\n",
    )
    return path
