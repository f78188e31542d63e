"""What keeps the remote tier's faults from stalling this process: the circuit breaker,
the daemon threads remote calls run on, and closing (or abandoning) a Mooncake client.

Mooncake's transfer and lookup calls release the GIL while they wait on the master, but
its ``setup``, ``close`` and the client's destructor hold it for as long as a master that
stopped answering makes them wait (70-100 s measured, 10 min for ``setup``): no Python-side
timeout can bound those. So they are only made while the master is known to answer; a
client of a master that stopped answering is *abandoned*: neither closed nor freed, with the
memory registered with it kept alive (its transfers may still land there).
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence

__all__ = ["Breaker", "DaemonWorker", "UnansweredPuts", "close_client", "abandon_client", "abandoned_count"]


class Breaker:
    """Skips remote calls while the master is known not to answer (a dead master costs nothing).

    Closed (``allow`` True, ``down`` False) until a failure. After one, ``allow`` is False for
    ``retry_s`` and, beyond that, for as long as any remote call is still in flight: a call
    that hangs on a master that stopped answering ends only at Mooncake's own RPC timeout
    (about 30 s), and a new call would hang the same way. Once both have passed, the next call
    is the probe: a success closes the breaker, a failure re-opens it. Calls report through
    ``enter`` / ``leave`` so the breaker knows what is in flight.
    """

    def __init__(self, retry_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._retry_s, self._clock = retry_s, clock
        self._failed_at: float | None = None
        self._in_flight = 0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            if self._failed_at is None:
                return True
            return self._in_flight == 0 and self._clock() - self._failed_at >= self._retry_s

    @property
    def down(self) -> bool:
        """True since a failure and until the next success."""
        return self._failed_at is not None

    @property
    def in_flight(self) -> int:
        """Remote calls started and not yet returned."""
        return self._in_flight

    def enter(self) -> None:
        """A remote call starts."""
        with self._lock:
            self._in_flight += 1

    def leave(self) -> None:
        """A remote call returned (whatever it answered)."""
        with self._lock:
            self._in_flight -= 1

    def failed(self) -> None:
        with self._lock:
            self._failed_at = self._clock()

    def succeeded(self) -> None:
        with self._lock:
            self._failed_at = None


class UnansweredPuts:
    """The keys of puts the store did not answer (skipped, failed or timed out: not stored),
    oldest first, so that whoever holds their bytes can put them again once it answers. A
    put the store answered and refused (no space) is not kept: retrying it would not help.

    Bounded: past ``limit`` keys the oldest are let go (counted in ``let_go``). Filled by the
    I/O thread, taken by the caller's.
    """

    def __init__(self, limit: int) -> None:
        self.limit, self.let_go = limit, 0
        self._keys: dict[bytes, None] = {}
        self._lock = threading.Lock()

    def add(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._keys.update(dict.fromkeys(keys))
            while len(self._keys) > self.limit:
                del self._keys[next(iter(self._keys))]
                self.let_go += 1

    def take(self) -> list[bytes]:
        """The keys kept so far, oldest first; none are kept afterwards."""
        with self._lock:
            keys, self._keys = list(self._keys), {}
            return keys


class DaemonWorker:
    """One daemon thread running submitted calls in order, each resolving a Future.

    A daemon thread: a call stuck on a master that stopped answering never holds up the
    process's exit (a ``ThreadPoolExecutor``'s threads are joined at exit).
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        """Queues ``fn(*args)``; its Future holds the result (or the exception).

        Raises:
            RuntimeError: the worker was stopped (as a shut-down executor does).
        """
        if self._stopped:
            raise RuntimeError("cannot schedule new calls after the worker stopped")
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def stop(self) -> None:
        """Lets the thread end once the calls queued so far ran (never waited for)."""
        self._stopped = True
        self._queue.put(None)

    def _run(self) -> None:
        """Runs the queued calls; holds no reference to a call once it ran (its function may
        be a bound method of the object that owns this worker, which must stay collectable)."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            _call(*item)
            item = None  # not kept while waiting for the next call


def _call(future: Future, fn: Callable, args: tuple) -> None:
    """Runs ``fn(*args)`` into ``future``."""
    try:
        future.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
        future.set_exception(exc)


def close_client(client, keep_alive: tuple) -> None:
    """Closes a client of a master that answers, on a daemon thread (Mooncake unmounts the
    segment and joins its heartbeat: 1-2 s) with ``keep_alive`` (the memory registered with
    it) held until it is done. Mooncake's ``close`` holds the GIL throughout, so the caller
    and every other thread of the process wait those 1-2 s all the same (no Python-side
    thread can take a call that holds the GIL off the process)."""
    threading.Thread(target=_close, args=(client, keep_alive), daemon=True).start()


def _close(client, keep_alive: tuple) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing must not raise
        pass


#: Clients abandoned so far in this process (``abandoned_count``).
_abandoned = 0
_abandoned_lock = threading.Lock()


def abandon_client(client, keep_alive: tuple) -> None:
    """Leaves a client of a master that does not answer open for good: its ``close`` and
    its destructor would hold the GIL (the whole process) until Mooncake gives up on the
    master (70-100 s). One reference to it and to ``keep_alive`` (the memory registered with
    it, which a transfer still in flight may write into) is leaked on purpose, so Python never
    frees either. Its segment stays mounted while this process runs.

    Mooncake still tears the client down at process exit: its C++ ``atexit`` handler (run
    after Python's own exit) tears down every client it tracks, and one whose master is gone
    waits on it, 7-18 s measured per abandoned client, before the process ends (sometimes
    with SIGABRT). ``abandoned_count`` tells a caller that wants to end without that wait
    (``os._exit`` once its own work is flushed) whether any client was abandoned.
    """
    global _abandoned
    ctypes.pythonapi.Py_IncRef(ctypes.py_object((client, keep_alive)))
    with _abandoned_lock:
        _abandoned += 1


def abandoned_count() -> int:
    """How many Mooncake clients this process has abandoned (``abandon_client``) so far."""
    return _abandoned

