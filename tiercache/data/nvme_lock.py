"""One writer per NVMe store: an exclusive ``flock`` on a lock file in the store directory.

The lock is taken before the store reads or changes anything on disk (start-up sweeps
delete files, so two openers would destroy each other's unflushed chunks) and held for the
store's lifetime. ``flock`` locks belong to the open file description: the kernel drops
them when the holder closes the file or dies (SIGKILL included), so a stale lock file
never blocks a reopen, and a second open in the same process is refused like one from
another process. The lock file is never unlinked: removing it would let a third opener
lock a fresh inode while the holder still has the old one.

A ``fork`` would share the locked open file description with the child, which would then
keep the store locked after the parent closes it (for as long as the child lives). So every
held lock is registered, and an at-fork handler closes the child's copies of their
descriptors (closing, never ``LOCK_UN``: unlocking would release the parent's lock too).
``O_CLOEXEC`` does the same across ``exec``. Until the child has run that handler (or
exec'd), its copy still holds the flock that the parent may have released meanwhile: an
acquire refused while the lock file names this process and no lock of this process holds it
is tried again for ``FORK_GRACE_S`` before it is refused.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time

from ..errors import UserError

__all__ = ["LOCK_NAME", "StoreLock"]

LOCK_NAME = "tiercache.lock"
#: How long an acquire waits for a child forked while this process held the lock to drop its
#: copy (its at-fork handler, or exec, closes it within milliseconds).
FORK_GRACE_S = 1.0

#: Every ``StoreLock`` of this process that holds its descriptor (strong references: a
#: lock is only ever dropped by ``release``).
_HELD: set["StoreLock"] = set()
#: Held while a lock is taken or released and across a fork: neither is ever half done in a
#: child (a flock's descriptor copied while the lock is out of ``_HELD``, so the child would
#: keep it). Reentrant: a signal handler, or another library's at-fork handler, that closes a
#: store or forks while it is held must not wait for itself (review R44-2/3).
_RELEASING = threading.RLock()


class StoreLock:
    """An exclusive lock on a store directory, held until ``release``.

    Invariant: while the object holds a file descriptor, this open file description holds
    ``LOCK_EX`` on ``<root>/tiercache.lock``, the file names the pid of the process that
    acquired it, ``dir_fd`` holds open the folder that lock file is in (the store's: what
    its writes are made relative to, whatever ``root`` names later), and the object is in
    ``_HELD``. In a child forked meanwhile the object holds no descriptor (``held`` is
    False there, ``dir_fd`` None).
    """

    def __init__(self, fd: int, dir_fd: int, path: str) -> None:
        self._fd: int | None = fd
        self.dir_fd: int | None = dir_fd
        self.path = path

    @classmethod
    def acquire(cls, root: str) -> "StoreLock":
        """Locks ``root`` for this process without waiting.

        Raises:
            UserError: another open store holds the lock (the message names its pid), or
                the lock file cannot be opened (a directory, a symlink, no permission).
        """
        path = os.path.join(root, LOCK_NAME)
        try:
            dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise UserError(f"{root}: cannot open the store's folder ({exc.strerror})") from None
        lock = cls._take(root, dir_fd, path)  # closes dir_fd itself when it fails
        try:
            _write_holder(lock._fd)
        except BaseException:  # Ctrl-C: not left locked for the process's life
            lock.release()
            raise
        return lock

    @classmethod
    def _take(cls, root: str, dir_fd: int, path: str) -> "StoreLock":
        """Locks and registers under ``_RELEASING``, so that no fork falls between the flock
        and ``_HELD`` (a child would keep it: review R44-1). Held by a child forked a moment
        ago, it tries again for ``FORK_GRACE_S``, sleeping with ``_RELEASING`` free (never
        when the caller already holds it: a signal handler's acquire would block forks).
        On any failure (Ctrl-C while it waits included) it closes what it opened, ``dir_fd``
        too, and releases a lock it had taken."""
        deadline = time.monotonic() + FORK_GRACE_S
        reentered = _RELEASING._is_owned()
        fd = lock = None
        try:
            while True:
                with _RELEASING:
                    try:
                        fd = _lock_file(root, dir_fd, patient=not reentered and time.monotonic() < deadline)
                    except _ForkedCopy:
                        fd = None
                    else:
                        lock = cls(fd, dir_fd, path)
                        _HELD.add(lock)
                        return lock
                time.sleep(0.002)
        except BaseException:
            with _RELEASING:
                if lock is not None:
                    lock.release()  # both descriptors
                else:
                    for opened in (fd, dir_fd):
                        if opened is not None:
                            os.close(opened)
            raise

    @property
    def held(self) -> bool:
        """True until ``release``."""
        return self._fd is not None

    def release(self) -> None:
        """Drops the lock (closing the descriptor releases the flock) and the folder's
        descriptor; idempotent. A store releases it only once no write of its own is in
        flight: closed under one, the folder's number could be reused by the next folder this
        process opens, and the write would land there."""
        with _RELEASING:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                dir_fd, self.dir_fd = self.dir_fd, None
                _HELD.discard(self)
                os.close(fd)
                os.close(dir_fd)


class _ForkedCopy(Exception):
    """The lock is held through a copy of a descriptor this process held: a child forked
    meanwhile, maybe not yet past its at-fork handler."""


def _lock_file(root: str, dir_fd: int, patient: bool = False) -> int:
    """Opens ``tiercache.lock`` in the folder ``dir_fd`` holds and locks it without waiting.

    Raises:
        _ForkedCopy: ``patient``, and the lock is held by a child forked from this process
            (the lock file names this pid, no lock of this process holds it).
        UserError: as ``StoreLock.acquire``.
    """
    path = os.path.join(root, LOCK_NAME)
    try:  # O_NOFOLLOW: a symlink here would make us lock (and write) some other file
        fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
    except OSError as exc:
        raise UserError(f"{path}: cannot open the store's lock file ({exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException as exc:
        if not isinstance(exc, OSError):  # Ctrl-C
            os.close(fd)
            raise
        forked, holder = _held_by_a_fork(fd), _read_holder(fd)
        os.close(fd)
        if isinstance(exc, BlockingIOError) and forked and patient:
            raise _ForkedCopy() from None
        if isinstance(exc, BlockingIOError):
            raise UserError(f"{root}: store in use by {holder} (lock file {path}); "
                            "close that store first, or use another path") from None
        raise UserError(f"{path}: cannot lock the store ({exc.strerror})") from None
    return fd


def _drop_inherited_locks() -> None:
    """``os.register_at_fork`` child handler: the child holds no store lock. ``release``
    closes only the child's copy of each descriptor; the parent's keeps its flock. The
    fork happened with ``_RELEASING`` taken (``before``), so no release was half done."""
    _RELEASING.release()
    for lock in list(_HELD):
        lock.release()



def _write_holder(fd: int) -> None:
    """Records this pid for the error message of the next opener (best effort: a full
    disk may refuse even these bytes, and the lock holds without them)."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass


def _held_by_a_fork(fd: int) -> bool:
    """True if the lock file names this process but no lock of this process holds it: a
    child's copy (``os.fork``'s before its at-fork handler ran, or a subprocess's before its
    exec, which runs no handler). Another program locking the lock file of a store this
    process closed would pass too: it is refused after ``FORK_GRACE_S``, not at once."""
    try:
        return os.pread(fd, 32, 0).strip() == str(os.getpid()).encode() and not _held_here(fd)
    except OSError:
        return False


def _read_holder(fd: int) -> str:
    """Who holds the lock, in words: "pid N", "pid N (this process)" or unknown.

    The file names the pid that acquired the lock; "this process" is said only when this
    process really holds a lock on the same file. Otherwise a lock acquired by this pid is
    held by a process it forked outside ``os.fork`` (which runs no at-fork handler).
    """
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    if not text.isdigit():
        return "another process (pid unknown)"
    pid = int(text)
    if pid != os.getpid():
        return f"pid {pid}"
    if _held_here(fd):
        return f"pid {pid} (this process: another open store on this path)"
    return f"a process forked from this one (pid {pid}) while it had the store open"


def _held_here(fd: int) -> bool:
    """True if a lock this process holds is on the same file as ``fd``."""
    mine = os.fstat(fd)
    for lock in list(_HELD):
        held = lock._fd
        if held is None:
            continue
        try:
            other = os.fstat(held)
        except OSError:  # released meanwhile by another thread
            continue
        if (other.st_dev, other.st_ino) == (mine.st_dev, mine.st_ino):
            return True
    return False


os.register_at_fork(before=_RELEASING.acquire, after_in_parent=_RELEASING.release, after_in_child=_drop_inherited_locks)
