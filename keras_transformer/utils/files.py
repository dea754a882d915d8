"""Atomic file writes: a reader (a server polling a directory, a process
restarted after SIGKILL) sees the old file or the new one, never half of one.

The new content goes to a temporary file in the destination's directory,
which is then renamed over the destination (`os.replace`, atomic on POSIX).

A write that the storage refuses (a full disk, a quota, a read-only or failing
device) raises `StorageError`, a one-line message naming the file, after
removing the temporary file: nothing partial is left, and the destination
still holds its previous content. Writers that could crash the process on such
a failure (HDF5 does, after ENOSPC) serialize into memory first and hand the
bytes to `atomic_write`, whose plain file I/O fails cleanly.
"""

import contextlib
import errno
import hashlib
import os
import pathlib
import tempfile


class StorageError(Exception):
    """Saving failed because of the storage, not the input: full disk, quota, I/O error.

    `str(error)` is one line: `"<reason> while saving <path>"`; `hint` says what
    to do (the command line prints both and exits with status 1).
    """

    def __init__(self, path, error, hint="free space and run the command again"):
        reason = os.strerror(error.errno) if getattr(error, "errno", None) else str(error)
        self.path, self.errno, self.hint = os.fspath(path), getattr(error, "errno", None), hint
        super().__init__(f"{reason[:1].lower()}{reason[1:]} while saving {self.path}")

    @property
    def no_space(self):
        return self.errno in (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def atomic_path(path, suffix=""):
    """Yields a temporary path to write; renames it to `path` when the block succeeds.

    `suffix` keeps a file type that writers insist on (`.weights.h5`, `.keras`).
    On an exception the temporary file is removed and `path` is untouched; an
    `OSError` becomes a `StorageError` naming `path`.
    """
    directory = os.path.dirname(os.path.abspath(path))
    temporary = None
    try:
        os.makedirs(directory, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=".partial-", suffix=suffix)
        os.close(handle)
        yield temporary
        umask = os.umask(0)  # mkstemp files are private (0600): give the usual permissions
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    except OSError as error:
        raise StorageError(path, error) from error
    finally:
        if temporary is not None and os.path.exists(temporary):
            os.remove(temporary)


def atomic_write(path, content):
    """Writes `content` (str as UTF-8, or bytes) to `path` atomically, flushed to disk."""
    data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
    suffix = "".join(pathlib.PurePath(path).suffixes)[-32:]  # `.weights.h5`: the type shows
    with atomic_path(path, suffix=suffix) as temporary:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())


def sha256_of(path_or_bytes):
    """The hex SHA-256 of a file (by path) or of bytes."""
    digest = hashlib.sha256()
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        digest.update(path_or_bytes)
        return digest.hexdigest()
    with open(path_or_bytes, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
