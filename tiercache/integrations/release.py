"""Releasing the rows of a ``TieredCache`` dropped without ``free()`` (as a ``DynamicCache`` is
dropped): its sequences' blocks would otherwise stay held until the ``TieredKVCache`` closes.

``release_when_dropped`` ties a cache's list of live sequences to a ``weakref.finalize`` of the
cache. The finalizer holds the list (which the cache mutates in place, never replaces) and
nothing that leads back to the cache, so it neither keeps the cache alive nor forms a cycle.
It runs when the cache is garbage-collected, not at interpreter exit (the process's end
releases everything), and a sequence of a closed store is only marked freed
(``Sequence.free``).

A collection can happen at any allocation, so also inside a store call of the same thread
(a cache caught in a reference cycle): a release there would run in the middle of that call.
While the store's lock is entered, the rows wait in a queue instead, released by the next
``release_deferred`` (every ``TieredCache`` construction and forward pass calls it).
"""

from __future__ import annotations

import threading
import warnings
import weakref

from tiercache.live.sequence import Sequence

__all__ = ["release_deferred", "release_when_dropped"]

_deferred: list[Sequence] = []  # rows of dropped caches whose release waits for a safe point
_deferred_lock = threading.Lock()


def release_when_dropped(cache: object, sequences: list[Sequence]) -> None:
    """Frees every sequence in ``sequences`` (the list as it is then) when ``cache`` is
    garbage-collected; ``sequences`` must not refer back to ``cache``."""
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
    """Frees ``sequences`` now, or queues those whose store's lock is entered (a call in
    progress, maybe this thread's). A finalizer must not raise: a failed release warns."""
    for seq in list(sequences):
        if seq.cache.store._lock._depth:
            with _deferred_lock:
                _deferred.append(seq)
            continue
        try:
            seq.free()
        except Exception as exc:  # noqa: BLE001 - reported, not raised, from a finalizer
            warnings.warn(f"TieredCache: releasing a dropped cache's row failed ({exc}); its blocks stay held "
                          "until the TieredKVCache closes", RuntimeWarning, stacklevel=2)
    sequences.clear()
