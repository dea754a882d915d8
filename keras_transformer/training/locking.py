"""One writer per directory: an exclusive lock that the OS releases when its holder dies.

`train`, `average` and `export` hold a `WriterLock` on the directory they
write for as long as they write it. The lock is `fcntl.flock` on a lock file
in that directory, held through an open file descriptor: the kernel drops it
when the process exits for any reason (SIGKILL included), so a dead writer
never leaves a stale lock, and the file left behind is harmless. The holder
writes its pid into the file so that a second writer can say who holds it.

Readers (`translate`, `evaluate`) take no lock: every file is replaced
atomically (`files.py`), so they read the last complete version.
"""

import errno
import fcntl
import os

from keras_transformer.utils.checks import UserError

LOCK_NAME = ".keras-transformer.lock"


class DirectoryBusy(UserError):
    """Another process holds the writer lock of the directory."""


class WriterLock:
    """An exclusive, non-blocking writer lock on `directory` (see the module docstring).

    Args:
        directory: the directory to lock (created when the lock is taken).
        lock_name: the lock file's name inside `directory`.

    `acquire()` raises `DirectoryBusy` naming the directory and the holder's
    pid when another process (or another `WriterLock` in this one) holds it.
    Use as a context manager, or `acquire()`/`release()`.
    """

    def __init__(self, directory, lock_name=LOCK_NAME):
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, lock_name)
        self._fd = None

    @property
    def held(self):
        return self._fd is not None

    def acquire(self):
        if self.held:
            return self
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = _read_pid(fd)
            os.close(fd)
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise DirectoryBusy(
                f"{self.directory} is being written by another process "
                f"(pid {holder or 'unknown'}); wait for it to finish or stop it, "
                f"or choose another directory."
            ) from None
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:  # a full disk: the lock holds all the same, only the pid is not shown
            pass
        return self

    def release(self):
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc_info):
        self.release()


def _read_pid(fd):
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return text if text.isdigit() else None
