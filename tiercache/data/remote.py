"""The remote tier's medium: a Mooncake Store client shared by many processes.

``RemoteStore`` is one ``MooncakeDistributedStore`` client (``mooncake_master`` plus the
clients' memory segments; TCP here, RDMA on clusters). A block is one value named by its
full 16-byte content key (the key already chains the namespace, so tenants never share)
under a tag of the layout (and model), and carries a 64-byte header in front of its bytes
(``remote_values``). The checksum is seeded with the key, so a value whose bytes, size,
layout or key do not match (corrupt, truncated, written by something else) is a counted
miss, never served.

Transfers are batched and zero-copy, 16 blocks a call, on a wire thread while the I/O
thread checksums the previous (or next) piece (Mooncake's calls and xxhash release the GIL).
Where the caller gives each payload's header place right before it (a pool's header room,
``pools.HEADER_ROOM``), ``batch_put_from`` / ``batch_get_into`` move ``[header | block]`` as
one buffer; otherwise ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``
move a header row of a registered array and the payload, two buffers a value (13-16% slower
over TCP here). A value's bytes are the same either way. Jobs return futures the engine settles; existence checks run on a
third thread with a timeout.

Failures never raise to the caller: a failed call counts as an error, and for ``retry_s``
after it, and for as long as a call is still hanging, every remote call is skipped (a miss)
instead of waiting on a dead master (``remote_guard.Breaker``); then the next call tries
again (reconnecting if the client had to be rebuilt). A read that got no answer says so
(``remote_reads.NO_ANSWER``): unlike a value missing or damaged, it drops nothing. A
transfer already in flight when the master stops answering ends when Mooncake's own RPC
timeout fires (about 30 s); lookups, and the existence check that starts every put and
every read, never wait longer than ``timeout_s`` (so a read or put started after the
master froze waits no longer).

A put writes only the names the store does not hold yet (Mooncake's put of an existing name
is a no-op that reports success): ``puts`` counts values written, ``already`` the ones found
there. A second check confirms what a put wrote: Mooncake also reports success for a name whose
put a killed writer left unfinished (until the master discards it, 15-30 s), and nothing is
stored; such a put counts in ``put_failed``. The keys of puts the store did not answer are
kept (``unanswered_puts``, bounded) for whoever holds their bytes to put again. A value
that fails verification is removed (``removed``), so that the next publisher can write a
good one. Otherwise leaving this process's view never deletes a value
(``forget`` is a no-op): others may be reading it, and Mooncake's own eviction reclaims the space.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from typing import Callable, Sequence

import numpy as np
import torch

from tiercache.config import Codec, KVLayout, RemoteConfig
from tiercache.errors import UserError
from tiercache.extras import install_hint

from .buffers import normal_tensors
from .pools import HEADER_BYTES  # a pool's header room ends with exactly one header
from .remote_guard import Breaker, DaemonWorker, UnansweredPuts, abandon_client, close_client
from .remote_master import servers_answer
from .remote_reads import HEADER_SLOTS, NO_ANSWER, RemoteReads
from .remote_values import header_rows, layout_tag, pack_header, pieces, transfer_call, transport_error, value_name

__all__ = ["RemoteStore", "ALREADY_THERE", "NO_ANSWER", "HEADER_BYTES", "value_name", "layout_tag", "load_client", "Breaker"]

#: A put's answer for a key the store already held: truthy (the key is there), no write.
ALREADY_THERE = 2

_UNANSWERED_KEPT = 1 << 16  # keys of unanswered puts kept for a retry (16 B each)


def load_client():
    """A new, unconnected ``MooncakeDistributedStore``.

    Raises:
        UserError: Mooncake Store is not installed (or its system libraries are missing).
    """
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise UserError(f"the remote tier needs Mooncake Store: {install_hint('mooncake')}: {exc}") from None
    return MooncakeDistributedStore()


class RemoteStore(RemoteReads):
    """The remote tier: Mooncake Store values of 64-byte header + block bytes.

    Invariants: ``staging`` and ``headers`` are registered with the client for its whole
    life; a value is served only if its header (magic, version, key, size, layout) and its
    checksum match; no method raises for a remote failure (counted in ``stats``).

    Args:
        config: how to reach the store (``RemoteConfig``).
        layout: the block layout.
        client: an unconnected client to use (tests inject faults); default a new one.
        codec: the codec whose error this store's values may carry (``live.remote.lossy_codec``:
            a quantised tier above the remote one publishes decoded lossy blocks); part of the
            layout tag, so only stores that accept that error share them. Default exact.
    """

    keyed = True
    #: Leaving this process's view never deletes a value others may read.
    shared = True

    def __init__(self, config: RemoteConfig, layout: KVLayout, client=None, clock: Callable[[], float] = time.monotonic,
                 codec: Codec = Codec.NONE) -> None:
        self.config, self.layout, self.codec = config, layout, codec
        self._pid, self._closed = os.getpid(), False  # ``__del__`` closes a dropped store in its own process only
        self.tag = layout_tag(layout, codec)
        self.block_bytes = layout.block_bytes
        self.breaker = Breaker(config.retry_s, clock)
        self.stats = {"puts": 0, "already": 0, "put_failed": 0, "gets": 0, "missing": 0, "corrupt": 0, "removed": 0,
                      "unreadable": 0, "exists_calls": 0, "found": 0, "errors": 0, "skipped": 0, "recovered": 0,
                      "abandoned": 0}
        self._make_client = (lambda: client) if client is not None else load_client
        self.unanswered_puts = UnansweredPuts(_UNANSWERED_KEPT)  # put again by the live store's link (``RemoteLink``)
        self.client = None
        self._registered: dict[int, tuple] = {}  # pointer -> (bytes, array) registered with the current client
        # Payload rows for transfers that cannot use a pool in place (NVMe, GPU); the last
        # row is read_block's own (the engine thread reads one block at a time).
        self.staging = np.zeros((config.staging_blocks + 1, self.block_bytes), np.uint8)
        self._free_rows = list(range(config.staging_blocks))
        self._rows_lock = threading.Lock()
        self.headers = np.zeros((2 * HEADER_SLOTS, HEADER_BYTES), np.uint8)
        # Daemon threads: a call stuck on a dead master never holds up exit. Transfer calls
        # (which release the GIL) run on the wire, so the I/O thread checksums one piece
        # while the next one moves.
        self._io = DaemonWorker("tiercache-remote-io")
        self._wire = DaemonWorker("tiercache-remote-wire")
        self._lookups = DaemonWorker("tiercache-remote-lookup")
        self._connector = DaemonWorker("tiercache-remote-connect")
        self._connect_lock = threading.Lock()
        self._connecting: Future | None = None
        self._make_client()  # fails here, clearly, when Mooncake is not installed
        try:  # a live master answers in milliseconds; a dead one is retried in the background
            self._start_connect().result(timeout=config.timeout_s)
        except FutureTimeout:
            pass

    # -- connection ----------------------------------------------------------------------
    def _start_connect(self) -> Future:
        """Starts setting the client up in the background (once at a time)."""
        with self._connect_lock:
            if self._connecting is None or self._connecting.done():
                self._connecting = self._connector.submit(self._connect)
            return self._connecting

    def usable(self) -> bool:
        """Whether a remote call would be tried now: the breaker lets calls through and the
        client is set up (if it is not, a (re)connect is started, ``_ready``)."""
        return self.breaker.allow() and self._ready()

    def _ready(self) -> bool:
        """True when the client is set up; else starts a (re)try when the breaker allows.
        Setting up against a dead master takes Mooncake about 90 s: never waited for."""
        if self.client is not None:
            return True
        if self.breaker.allow():
            self._start_connect()
        return False

    def _connect(self) -> bool:
        """Sets a new client up; False (counted, breaker open) if it failed.

        Mooncake's ``setup`` holds the GIL while it retries a master or metadata server
        that does not answer (90 s to 10 min), freezing every thread of the process; so
        both are first checked to answer within ``timeout_s`` (``servers_answer``). A client
        whose setup failed is torn down before the breaker opens: its destructor holds the GIL
        too (about 1 s), and ``retry_s`` then counts from the end of that freeze, so a setup
        that keeps failing freezes the process at most once per ``retry_s`` of free running.
        """
        client = None
        try:
            if not servers_answer(self.config):
                raise ConnectionError("the master or the metadata server does not answer")
            client = self._make_client()
            c = self.config
            rc = client.setup(c.local_host, c.metadata, c.segment_bytes, c.buffer_bytes, c.protocol, c.device, c.master)
        except Exception:  # noqa: BLE001 - any client failure is a remote failure
            rc = -1
        if rc != 0:
            client = None  # torn down now (the GIL held ~1 s), before retry_s starts counting
            self.stats["errors"] += 1
            self.breaker.failed()
            return False
        self._registered = {}
        self.client = client
        self.register(self.staging, answered=True)
        self.register(self.headers, answered=True)
        self.breaker.succeeded()
        return True

    def register(self, array: np.ndarray | torch.Tensor, answered: bool = False) -> None:
        """Registers host memory (a pool's tensor, the staging rows) for zero-copy transfers.

        Mooncake's ``register_buffer`` publishes the segment to the metadata server and
        holds the GIL while a master that stopped answering makes it wait (12 s measured),
        so it is made only once the master ``answered`` just now, or answers an existence
        check (at most ``timeout_s``); else it is left for the next transfer to retry."""
        pointer = array.ctypes.data if isinstance(array, np.ndarray) else array.data_ptr()
        size = array.nbytes
        if self.client is None or self._registered.get(pointer, (None,))[0] == size:
            return
        if not answered and self._ask([value_name(self.tag, bytes(16))]) is None:
            return
        if self.client.register_buffer(pointer, size) == 0:
            self._registered[pointer] = (size, array)  # kept: an abandoned client may still write there

    def _call(self, what: str, fn, n: int):
        """Runs one client call unless the breaker is open; None when skipped or failed."""
        if not self.breaker.allow() or not self._ready():
            self.stats["skipped"] += n
            return None
        self.breaker.enter()
        try:
            codes = fn(self.client)
        except Exception:  # noqa: BLE001 - a client exception is a remote failure, never the caller's
            codes = None
        finally:
            self.breaker.leave()
        if codes is None or (len(codes) and all(transport_error(c) for c in codes)):
            self.stats["errors"] += 1
            self.breaker.failed()
            return None
        if self.breaker.down:
            self.stats["recovered"] += 1  # the master answers again (the client reconnected)
        self.breaker.succeeded()
        return codes

    # -- staging rows ------------------------------------------------------------------
    def take_rows(self, n: int) -> list[int] | None:
        """``n`` free staging rows, or None when fewer are free (nothing taken)."""
        with self._rows_lock:
            if len(self._free_rows) < n:
                return None
            rows, self._free_rows = self._free_rows[:n], self._free_rows[n:]
            return rows

    def give_rows(self, rows: Sequence[int]) -> None:
        """Returns rows taken with ``take_rows``."""
        with self._rows_lock:
            self._free_rows.extend(rows)

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def row_block(self, row: int, dtype: torch.dtype) -> torch.Tensor:
        """A staging row as a block tensor (a view of the registered row): a normal tensor
        even under the caller's ``torch.inference_mode()``, since NVMe I/O threads (never in
        inference mode) decode into it (``buffers.normal_tensors``)."""
        with normal_tensors():
            return torch.from_numpy(self.staging[row]).view(dtype).view(self.layout.block_shape)

    # -- lookups -------------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> np.ndarray:
        """Which keys the store holds now (False for all when it cannot be asked in time)."""
        found = self.present(keys)
        return np.zeros(len(keys), bool) if found is None else found

    def present(self, keys: Sequence[bytes]) -> np.ndarray | None:
        """Which keys the store holds now; None when it could not be asked (skipped, failed
        or timed out after ``timeout_s``): no answer, which says nothing about what it holds."""
        if not keys:
            return np.zeros(0, bool)
        found = self._ask([value_name(self.tag, k) for k in keys], "exists_calls")
        if found is not None:
            self.stats["found"] += int(found.sum())
        return found

    def _ask(self, names: list[str], counter: str | None = None) -> np.ndarray | None:
        """Which of ``names`` the store holds: one ``batch_is_exist`` on the lookup thread,
        waited for at most ``timeout_s``; None (counted) when skipped, failed or timed out.
        ``counter`` counts the calls made."""
        if not self.breaker.allow():  # never queue behind a call that is hanging
            self.stats["skipped"] += len(names)
            return None
        if counter is not None:
            self.stats[counter] += 1
        future = self._lookups.submit(self._call, "exists", lambda c: c.batch_is_exist(names), len(names))
        try:
            codes = future.result(timeout=self.config.timeout_s)
        except FutureTimeout:  # the call still hangs: the breaker stays open until it returns
            self.stats["errors"] += 1
            self.breaker.failed()
            return None
        return None if codes is None else np.asarray(codes) == 1

    # -- transfers (futures of one bool per key) -----------------------------------------
    def submit_put(self, keys: Sequence[bytes], payloads: Sequence[np.ndarray], then: Callable[[], None] | None = None,
                   headers: Sequence[np.ndarray] | None = None) -> Future:
        """Starts storing ``payloads[i]`` (contiguous uint8 views of registered memory)
        under ``keys[i]``; the future holds one answer per key: True (written), False (not
        stored) or ``ALREADY_THERE`` (truthy: the store held it, nothing was written). ``then``
        runs once it is done.
        ``headers[i]``, when given, is the registered ``HEADER_BYTES`` right before
        ``payloads[i]`` (a pool's header room): header and block then go as one buffer."""
        return self._io.submit(_run_then, lambda: self._put(keys, payloads, headers), then)

    def submit_get(self, keys: Sequence[bytes], payloads: Sequence[np.ndarray], then: Callable[[], None] | None = None,
                   headers: Sequence[np.ndarray] | None = None) -> Future:
        """Starts reading the blocks of ``keys`` into ``payloads`` (registered uint8 views);
        the future holds one answer per key: True (a verified block), False (the store does
        not hold it, or it failed verification) or ``NO_ANSWER`` (the store was not asked or
        did not answer: skipped, failed or timed out; says nothing about what it holds).
        ``headers`` as in ``submit_put`` (the value's header lands right before its block)."""
        return self._io.submit(_run_then, lambda: self._get(keys, payloads, headers), then)

    def _put(self, keys: Sequence[bytes], payloads: Sequence[np.ndarray], inline: Sequence[np.ndarray] | None) -> list[bool]:
        ok: list[bool] = []
        for a in range(0, len(keys), HEADER_SLOTS):
            part = None if inline is None else inline[a : a + HEADER_SLOTS]
            ok.extend(self._put_batch(keys[a : a + HEADER_SLOTS], payloads[a : a + HEADER_SLOTS], part))
        return ok

    def _put_batch(self, keys: Sequence[bytes], payloads: Sequence[np.ndarray], inline: Sequence[np.ndarray] | None) -> list[bool]:
        """Up to 256 keys, True for each the store holds afterwards. One existence check
        (at most ``timeout_s``; nothing is put when it fails) picks the names not there
        yet: Mooncake's put of an existing name writes nothing and reports success. Each
        piece's headers (checksums) are made while the previous piece is on the wire; one
        batch put per piece (``transfer_call``); a second check confirms what landed
        (``_landed``). The keys of puts the store did not answer go to ``unanswered_puts``."""
        names = [value_name(self.tag, k) for k in keys]
        present = self._ask(names)
        if present is None:
            self.stats["put_failed"] += len(keys)
            self.unanswered_puts.add(keys)
            return [False] * len(keys)
        todo = [i for i in range(len(keys)) if not present[i]]
        rows = header_rows(inline, self.headers[:HEADER_SLOTS], payloads)
        headers, payloads = [rows[i] for i in todo], [payloads[i] for i in todo]
        moving = []
        for a, b in pieces(len(todo)):
            for i in range(a, b):
                key, payload = keys[todo[i]], payloads[i]
                pack_header(headers[i], key, payload, self.tag)
            call = transfer_call("put", [names[n] for n in todo[a:b]], headers[a:b], payloads[a:b])
            moving.append((a, b, self._wire.submit(self._call, "put", call, b - a)))
        written = []
        for a, b, future in moving:
            codes = future.result()
            unanswered = range(a, b) if codes is None else [i for i, c in zip(range(a, b), codes) if transport_error(c)]
            self.unanswered_puts.add([keys[todo[i]] for i in unanswered])
            written.extend([False] * (b - a) if codes is None else [code == 0 for code in codes])
        written = self._landed([names[n] for n in todo], written)
        self.stats["already"] += len(keys) - len(todo)
        self.stats["puts"] += sum(written)
        self.stats["put_failed"] += len(written) - sum(written)
        ok = [ALREADY_THERE if there else False for there in present.tolist()]
        for i, done in zip(todo, written):
            ok[i] = done
        return ok

    def _landed(self, names: list[str], written: list[bool]) -> list[bool]:
        """``written`` (Mooncake's answers: 0 for each name put) less the names the store
        does not hold right after: Mooncake also answers 0 for a name whose put another
        writer started and never finished (a client killed mid-put) until the master
        discards that put (15-30 s), and nothing was stored. One existence check (at most
        ``timeout_s``); when it gets no answer, Mooncake's answers stand."""
        asked = [n for n, done in zip(names, written) if done]
        there = self._ask(asked) if asked else None
        if there is None:
            return written
        held = dict(zip(asked, there.tolist()))
        return [done and held[name] for name, done in zip(names, written)]

    # -- the medium interface ------------------------------------------------------------
    def write(self, slots: Sequence[int], blocks: torch.Tensor) -> None:
        """Never asked: new blocks are born in the top tier."""
        raise TypeError("the remote tier is never the top tier")

    def forget(self, keys: Sequence[bytes]) -> None:
        """Nothing: a value leaving this process's view stays in the store for the others."""

    def durable_items(self) -> list[tuple[bytes, int]]:
        """Nothing to adopt on reopen: lookups find what the store holds."""
        return []

    def flush(self) -> None:
        """Nothing to make durable here (the store's own replication does that)."""

    def close(self) -> None:
        """Finishes the transfers queued so far and closes the client, waiting at most about
        ``timeout_s`` on a master that stopped answering.

        One existence check (at most ``timeout_s``) first tells whether the master answers.
        If it does, queued transfers finish and the client is closed on a daemon thread
        (``close_client``; values it held become misses for the others). If it does not, or
        stops answering meanwhile, nothing more is waited for and the client is abandoned
        (``abandon_client``, counted in ``abandoned``): Mooncake's close would hold the GIL,
        freezing the whole process, for 70-100 s.
        """
        self._closed = True
        answers = self.client is not None and self._ask([value_name(self.tag, bytes(16))]) is not None  # a probe
        drained = answers and self._drain()
        for worker in (self._io, self._wire, self._lookups, self._connector):
            worker.stop()
        client, self.client = self.client, None
        if client is None:
            return
        keep = (self.staging, self.headers, *(array for _, array in self._registered.values()))
        if drained and not self.breaker.down:
            close_client(client, keep)
        else:
            self.stats["abandoned"] += 1
            abandon_client(client, keep)

    def __del__(self) -> None:
        """A store dropped without ``close`` (a caller's bug) is closed as ``close`` closes it
        (its transfers finish, its worker threads end, the client is closed or, with a master
        that does not answer, abandoned), on a daemon thread: the master's probe may wait up
        to ``timeout_s``, which a finalizer must not. Warns (ResourceWarning; closed even when
        that warning is made an error). In a forked child, or once the interpreter is
        finalizing (a store still referenced at exit), it does nothing: the client is the
        parent's, or Mooncake's exit handler tears it down."""
        if getattr(self, "_closed", True) or not hasattr(self, "_connector") or self._pid != os.getpid():
            return  # closed, __init__ failed before there was anything to close, or a forked child
        if sys.is_finalizing():
            return  # a thread started now never runs (3.11: its start waits forever); Mooncake's exit handler closes
        try:
            warnings.warn(f"{self!r} dropped without close(); closing it now", ResourceWarning, stacklevel=2)
        except Exception:  # noqa: BLE001 - ResourceWarning made an error (-W error): close all the same
            pass
        try:
            threading.Thread(target=self.close, name="tiercache-remote-dropped", daemon=True).start()
        except RuntimeError:  # no new threads at interpreter shutdown (3.12+)
            pass

    def _drain(self) -> bool:
        """Waits for the transfers queued so far; False as soon as the master is known not
        to answer (a failure, with a call still in flight)."""
        marker = self._io.submit(lambda: None)  # one I/O thread: done once every earlier job is
        while not marker.done():
            if self.breaker.down and self.breaker.in_flight:
                return False
            wait_futures([marker], timeout=0.05)
        return True

    def __repr__(self) -> str:
        return f"RemoteStore(master={self.config.master}, layout tag {self.tag:016x})"


def _run_then(work: Callable[[], list[bool]], then: Callable[[], None] | None) -> list[bool]:
    try:
        return work()
    finally:
        if then is not None:
            then()
