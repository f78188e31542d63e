"""Which process a live store belongs to: a forked child and a copy get a clear refusal.

A store's media belong to the process that opened it: its NVMe I/O threads, its journal and
directory lock, its pools. A child forked while it is open (``os.fork``, ``multiprocessing``'s
fork start method) inherits the objects but none of the threads that serve them, so a call
there would wait forever for an I/O job that nobody runs, and closing would write to the
parent's files. Hence:

* ``OwnerGuard`` is the store's ``CallGuard``: a call from any other process than the opener
  raises ``UserError`` at once, before the lock is taken (a parent thread may have held it at
  the fork, and the child's copy of it is never released). ``owned`` tells ``close`` to do
  nothing there: the parent still owns the store.
* Making the first guard registers an at-fork hook that sets torch's intra-op threads to 1 in
  the child (as PyTorch's own ``DataLoader`` workers do): opening a store runs parallel torch
  ops (zeroing its pools), and GNU OpenMP's thread team, which they start, is dead in a forked
  child, whose first parallel op would then wait for it forever. So the child can open and use
  a store of its own.
* ``NoCopies`` refuses ``copy.copy``, ``copy.deepcopy`` and pickling: a copy would share the
  tiers (closing it would close them under the original), and a pickle cannot carry them to
  another process.
"""

from __future__ import annotations

import os
import threading

import torch

from tiercache.errors import UserError

from .guard import CallGuard

__all__ = ["OwnerGuard", "NoCopies"]

_fork_hook_registered = False
_fork_hook_lock = threading.Lock()


def _single_threaded_torch() -> None:
    """``os.register_at_fork`` child handler: torch ops run on the calling thread only (the
    parent's OpenMP threads do not exist in the child)."""
    torch.set_num_threads(1)


def _register_fork_hook() -> None:
    """Registers ``_single_threaded_torch`` for every later fork, once per process."""
    global _fork_hook_registered
    with _fork_hook_lock:
        if not _fork_hook_registered:
            os.register_at_fork(after_in_child=_single_threaded_torch)
            _fork_hook_registered = True


class OwnerGuard(CallGuard):
    """A ``CallGuard`` that admits calls from the process that made it (the store's opener) only.

    Invariants: ``pid`` is the opener's pid and never changes; in any other process entering
    the guard (every store, cache and sequence call) raises ``UserError`` without touching the
    lock; once one exists, every fork of this process gets the at-fork hook (module docstring).
    """

    def __init__(self) -> None:
        super().__init__()
        self.pid = os.getpid()
        _register_fork_hook()

    @property
    def owned(self) -> bool:
        """True in the process that opened the store, False in a child forked since."""
        return os.getpid() == self.pid

    def check_owner(self) -> None:
        """Raises UserError in any process but the store's opener (a child forked since)."""
        if not self.owned:
            raise UserError(f"TieredKVStore: this store was opened by process {self.pid}; "
                            "a forked child must open a store of its own")

    def __enter__(self) -> "OwnerGuard":
        self.check_owner()  # first: the lock may be held by a parent thread that does not exist here
        return super().__enter__()


class NoCopies:
    """Refuses ``copy.copy``, ``copy.deepcopy`` and pickling (all three go through
    ``__reduce_ex__``) with a TypeError: "<class>: <copy_refusal>", which says why and what to
    do instead (as ``TieredCache`` does)."""

    copy_refusal = ("a store cannot be copied or pickled (it owns its tiers' memory, files, I/O threads and lock); "
                    "to use its blocks in another process, open a TieredKVStore on the same path there, once this one is closed")

    def __reduce_ex__(self, protocol):
        raise TypeError(f"{type(self).__name__}: {self.copy_refusal}")
