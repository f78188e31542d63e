"""One writer per NVMe store: an exclusive ``flock`` on a lock file in the store directory.

The lock is taken before the store reads or changes anything on disk (start-up sweeps
delete files, so two openers would destroy each other's unflushed chunks) and held for the
store's lifetime. ``flock`` locks belong to the open file description: the kernel drops
them when the holder closes the file or dies (SIGKILL included), so a stale lock file
never blocks a reopen, and a second open in the same process is refused like one from
another process. The lock file is never unlinked: removing it would let a third opener
lock a fresh inode while the holder still has the old one.
"""

from __future__ import annotations

import fcntl
import os

from ..errors import UserError

__all__ = ["LOCK_NAME", "StoreLock"]

LOCK_NAME = "tiercache.lock"


class StoreLock:
    """An exclusive lock on a store directory, held until ``release``.

    Invariant: while the object holds a file descriptor, this open file description holds
    ``LOCK_EX`` on ``<root>/tiercache.lock`` and the file names this process's pid.
    """

    def __init__(self, fd: int, path: str) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, root: str) -> "StoreLock":
        """Locks ``root`` for this process without waiting.

        Raises:
            UserError: another open store holds the lock (the message names its pid), or
                the lock file cannot be opened (a directory, a symlink, no permission).
        """
        path = os.path.join(root, LOCK_NAME)
        try:  # O_NOFOLLOW: a symlink here would make us lock (and write) some other file
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise UserError(f"{path}: cannot open the store's lock file ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if isinstance(exc, BlockingIOError):
                raise UserError(f"{root}: store in use by {holder} (lock file {path}); "
                                "close that store first, or use another path") from None
            raise UserError(f"{path}: cannot lock the store ({exc.strerror})") from None
        _write_holder(fd)
        return cls(fd, path)

    @property
    def held(self) -> bool:
        """True until ``release``."""
        return self._fd is not None

    def release(self) -> None:
        """Drops the lock (closing the descriptor releases the flock); idempotent."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _write_holder(fd: int) -> None:
    """Records this pid for the error message of the next opener (best effort: a full
    disk may refuse even these bytes, and the lock holds without them)."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass


def _read_holder(fd: int) -> str:
    """Who holds the lock, in words: "pid N", "pid N (this process)" or unknown."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    if not text.isdigit():
        return "another process (pid unknown)"
    pid = int(text)
    return f"pid {pid} (this process)" if pid == os.getpid() else f"pid {pid}"
