"""Atomic file writes: a reader (a server polling a directory, a process
restarted after SIGKILL) sees the old file or the new one, never half of one.

The new content goes to a temporary file in the destination's directory,
which is then renamed over the destination (`os.replace`, atomic on POSIX).
"""

import contextlib
import os
import tempfile


@contextlib.contextmanager
def atomic_path(path, suffix=""):
    """Yields a temporary path to write; renames it to `path` when the block succeeds.

    `suffix` keeps a file type that writers insist on (`.weights.h5`, `.keras`).
    On an exception the temporary file is removed and `path` is untouched.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".partial-", suffix=suffix)
    os.close(handle)
    try:
        yield temporary
        umask = os.umask(0)  # mkstemp files are private (0600): give the usual permissions
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def atomic_write(path, content):
    """Writes `content` (str as UTF-8, or bytes) to `path` atomically, flushed to disk."""
    data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
    with atomic_path(path) as temporary:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
