"""The lock of a live store (and of its decode cache): one call at a time, each call whole.

``CallGuard`` is what ``TieredKVStore._lock`` is: a reentrant lock whose every ``with``
block is also a ``deferred_interrupts`` section, so a Ctrl-C during a store, cache or
sequence call is raised when the call has finished (its pins, plans, holds and keys whole),
never between two of its statements.

A ``close`` that runs inside another call of the same thread (a signal handler calling
``close`` while the main thread is in a ``put``) cannot be refused without raising at an
arbitrary point of that call either; it runs, and the interrupted call then raises a
``UserError`` saying the store was closed under it instead of whatever internal error its
remaining statements hit on the closed store.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from tiercache.core.interrupts import enter_deferred, exit_deferred, uninterruptible
from tiercache.errors import UserError

__all__ = ["CallGuard"]


class CallGuard:
    """A reentrant lock that defers Ctrl-C to the end of the outermost call.

    Invariants: ``_depth`` is the owner thread's nesting depth (only the owner changes it);
    ``_closed_at`` is the depth at which ``closing`` ran inside an outer call (0: none), reset
    when the outermost call ends; ``_closing`` while a ``closing`` block runs.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._closed_at = 0
        self._closing = False  # a ``closing`` block is running (a close inside it is part of it)

    def __enter__(self) -> "CallGuard":
        self._lock.acquire()  # first: a Ctrl-C (or a raising handler) while blocked here leaves nothing behind
        try:
            enter_deferred()
        except BaseException:
            self._lock.release()
            raise
        self._depth += 1
        return self

    def __exit__(self, kind, exc, tb) -> None:
        depth = self._depth
        closed_under = self._closed_at > depth and (exc is None or (isinstance(exc, Exception) and not isinstance(exc, UserError)))
        self._depth = depth - 1
        if depth == 1:
            self._closed_at = 0
        self._lock.release()
        exit_deferred()  # raises a Ctrl-C that arrived during the call
        if closed_under:
            raise UserError("TieredKVStore: the store was closed during this call (close() from a signal handler?); "
                            "the call's outcome is unknown") from exc

    def held_by_this_thread(self) -> bool:
        """Whether this thread is inside a call (``threading.Condition`` asks an RLock the same way)."""
        return self._lock._is_owned()

    @contextmanager
    def if_free(self) -> Iterator[bool]:
        """Holds the lock for the block if no thread holds it, without waiting (yields True);
        yields False, holding nothing, if another thread does. For a finalizer, which must
        never wait for a call it may be running inside or be waited for by."""
        acquired = self._lock.acquire(blocking=False)
        try:
            yield acquired
        finally:
            if acquired:
                self._lock.release()

    @contextmanager
    def closing(self) -> Iterator["CallGuard"]:
        """The guard for ``close``: entered inside another call, it marks that call's
        remaining work as running on a closed store (see the module docstring)."""
        with self, uninterruptible():  # a close runs to its end: a Ctrl-C waits for it
            outermost = not self._closing
            if outermost and self._depth > 1:
                self._closed_at = self._depth
            self._closing = True
            try:
                yield self
            finally:
                self._closing = not outermost
