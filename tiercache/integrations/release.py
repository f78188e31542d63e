"""Releasing the rows of a ``TieredCache`` dropped without ``free()`` (as a ``DynamicCache`` is
dropped): its sequences' blocks would otherwise stay held until the ``TieredKVCache`` closes.

``release_when_dropped`` ties a cache's list of live sequences to a ``weakref.finalize`` of the
cache. The finalizer holds the list (which the cache mutates in place, never replaces) and
nothing that leads back to the cache, so it neither keeps the cache alive nor forms a cycle.
It runs when the cache is garbage-collected, not at interpreter exit (the process's end
releases everything), and a sequence of a closed store is only marked freed
(``Sequence.free``).

A collection can happen at any allocation of any thread, so the finalizer never waits for
the store's lock (a reentrant lock, ``CallGuard``). Per sequence, as its store's lock stands:

* free: taken without waiting, and the rows are freed at once;
* held by this thread (a cache caught in a reference cycle, collected inside a store call):
  a release there would run in the middle of that call, so the rows wait in a queue,
  released by the next ``release_deferred`` (every ``TieredCache`` construction and forward
  pass calls it);
* held by another thread: the rows are handed to one daemon thread (``DaemonWorker``) that
  waits for the lock and frees them as soon as that call ends. The collecting thread itself
  must not wait: it may be a thread the lock's holder is waiting for (an I/O pool thread
  whose task allocated, or a thread the holder joins), and both would wait forever. The
  daemon thread holds nothing else and nothing waits on it.

A child forked meanwhile has none of the parent's threads: an at-fork handler gives it a
releaser of its own (made at its first cache) and fresh locks, and drops the rows queued in the
parent. Rows of a store the child did not open are never released there: the parent owns them
(``tiercache.live.ownership``).
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref

from tiercache.data.remote_guard import DaemonWorker
from tiercache.live.sequence import Sequence

__all__ = ["release_deferred", "release_when_dropped"]

_deferred: list[Sequence] = []  # rows collected inside their store's call, released at a safe point
_deferred_lock = threading.RLock()  # reentrant: a collection while it is held may queue rows
_releaser: DaemonWorker | None = None  # frees rows whose store another thread is using; made once
_releaser_lock = threading.Lock()


def _forget_releaser_in_child() -> None:
    """``os.register_at_fork`` child handler: the parent's releaser thread does not exist in the
    child (rows handed to it would never be freed), nor do the owners of the parent's locks;
    the rows queued in the parent belong to the parent's stores."""
    global _releaser, _releaser_lock, _deferred_lock
    _releaser, _releaser_lock, _deferred_lock = None, threading.Lock(), threading.RLock()
    del _deferred[:]


os.register_at_fork(after_in_child=_forget_releaser_in_child)


def release_when_dropped(cache: object, sequences: list[Sequence]) -> None:
    """Frees every sequence in ``sequences`` (the list as it is then) when ``cache`` is
    garbage-collected; ``sequences`` must not refer back to ``cache``."""
    global _releaser
    with _releaser_lock:  # made here, not in a finalizer: every finalizer finds it made
        if _releaser is None:
            _releaser = DaemonWorker("tiercache-release")
    finalizer = weakref.finalize(cache, _release, sequences)
    finalizer.atexit = False


def release_deferred() -> None:
    """Frees the rows whose release was deferred (see the module docstring). Call it outside
    every store call."""
    if not _deferred:
        return
    with _deferred_lock:
        rows = _deferred[:]
        del _deferred[:]
    _release(rows)


def _release(sequences: list[Sequence]) -> None:
    """Frees ``sequences`` now where their store's lock is free, else queues them (lock held by
    this thread) or hands them to the daemon releaser (held by another thread); skips those of
    a store another process opened (a forked child's copy of the parent's cache: the parent
    owns them). Never waits for a lock; a finalizer must not raise: a failed release warns."""
    for seq in list(sequences):
        guard = seq.cache.store.guard
        if not guard.owned:
            continue
        if guard.held_by_this_thread():
            with _deferred_lock:
                _deferred.append(seq)
            continue
        with guard.if_free() as free:
            if free:
                _free(seq)
        if not free:
            _releaser.submit(_free, seq)
    sequences.clear()


def _free(seq: Sequence) -> None:
    """``seq.free()``, a failure reported as a warning (it runs in a finalizer or the daemon
    releaser, where nothing could catch it)."""
    try:
        seq.free()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        warnings.warn(f"TieredCache: releasing a dropped cache's row failed ({exc}); its blocks stay held "
                      "until the TieredKVCache closes", RuntimeWarning, stacklevel=2)
