"""The NVMe tier: a durable block store in zarr v3 format, read and written from I/O threads.

``NVMeStore`` keeps blocks in a zarr v3 array (one chunk per block, see ``chunkio``) and an
index key -> slot (see ``nvme_index``). It decides nothing: the manager chooses what to
store and evicts before the store is full; the store moves bytes and keeps its index
consistent across crashes.

Writes: a new chunk goes to a temp file, is fdatasync'ed and renamed over the slot's chunk
file; a reused slot whose chunk file has the same length is overwritten in place and
fdatasync'ed, crc trailer first (``overwrite_in_place``, default on: allocating new space
costs a journal commit per block, which halves durable write throughput on ext4). The block is then
visible to ``get`` in this process. Before any of its data is written, a put reserves the
journal space its index entry (and its later deletion's) will take (``IndexFiles.promise``),
so a full disk fails the put (counted in ``failed_writes``), never the flush that would make
complete blocks durable. ``flush`` fsyncs the directory if anything was renamed,
then appends the new index entries to the journal: a block is stored across a crash only
once its entry is durable, and no durable entry names a chunk that is not. Slots freed by
``delete`` or by a replacing put are reused only after that is durable (a put naming such a
slot is refused). Their chunk files stay for the next write of the slot, until a write
finds the disk full: it then removes the chunk files of free slots, giving their space
back, and is tried once more (``nvme_write``). One process at a time opens a store
(``nvme_lock``); on reopen, an entry is adopted only if its chunk's length and crc trailer
match it, and chunk files without an adopted entry are garbage and removed (``nvme_open``).

Reads verify the chunk's length and crc32c against the index entry, so torn, stale or
flipped bytes are reported as misses (``stats["corrupt_reads"]``), never as data; a read
that fails with an I/O error keeps the chunk and raises ``ReadIOError``. That
check also covers a put that names a live slot: the old entry, durable until the next
flush, no longer matches the rewritten chunk.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from ..config import Codec, KVLayout
from ..errors import UserError
from . import chunkio
from .codecs import codec_for
from .buffers import PAGE, HostBytes, aligned_tensor, block_list, round_up, torch_dtype
from .iojobs import after_threads, run_batch, shutdown_within
from .nvme_read import NVMeReads
from .nvme_index import IndexFiles, record_cost
from .nvme_lock import StoreLock
from .nvme_open import check_arguments, check_encoded, check_key, check_keys, check_slots, mark_clean, open_store
from .nvme_results import FailedWrite, PutResult, StoreFullError
from .nvme_write import NVMeWrites, folder_identity

__all__ = ["NVMeStore", "PutResult", "StoreFullError"]

_DROP_WAIT_S = 0.1  # how long a dropped store waits for its I/O threads before leaving its files to them
_STAT_NAMES = (
    "puts", "failed_writes", "gets", "hits", "misses", "corrupt_reads", "read_errors", "deletes",
    "flushes", "failed_flushes", "bytes_written", "bytes_read", "garbage_removed", "recovered_dropped",
    "journal_repaired", "journal_skipped", "snapshot_repaired", "chunks_reclaimed",
)


class NVMeStore(NVMeReads, NVMeWrites):
    """A crash-consistent block store on local disk, in zarr v3 format.

    Invariants: never holds more than ``capacity`` blocks (a put that does not fit raises
    ``StoreFullError`` and writes nothing); a key is served only from the chunk its index
    entry names, verified by length and crc32c; every method is thread safe (one lock
    guards the index, I/O runs outside it, but for the removal of dead chunk files on a
    full disk, ``_reclaim_space``). Callers of ``submit_put``/``submit_get`` keep
    the source/destination tensors alive and untouched until the future is done.
    """

    close_timeout_s = 300.0  # how long ``close`` waits for its I/O threads (a hung disk)

    def __init__(
        self,
        path: str | os.PathLike,
        layout: KVLayout,
        capacity_blocks: int | str | None = None,
        compression: str | None = None,
        create: bool = True,
        io_threads: int = 4,
        direct_io: bool = True,
        overwrite_in_place: bool = True,
        codec: Codec | str = Codec.NONE,
    ) -> None:
        """Opens the store at ``path``, creating it when absent and ``create`` is set.

        Args:
            path: directory of the zarr array (created if missing).
            layout: block layout; must match the layout stored in an existing store.
            capacity_blocks: slots (``4096``) or a size (``"64GiB"``); None reopens with the
                stored capacity. Must match an existing store's capacity.
            compression: None (default) or ``"lz4"`` (Blosc lz4, byte shuffle).
            create: create a missing store; False makes a missing store an error.
            io_threads: I/O worker threads.
            direct_io: read with O_DIRECT where the filesystem allows it.
            overwrite_in_place: rewrite a reused slot's same-size chunk file in place
                instead of temp file + rename (zarr readers running concurrently with a
                crash may then see a torn chunk of a slot that no index entry names).
            codec: how blocks are stored (``Codec.NONE``: as given; ``int8``/``fp8``/``int4``:
                quantised by the I/O threads on ``put``, dequantised on ``get``). Recorded
                in the store; must match an existing store's codec.

        Raises:
            UserError: path is not a str (or PathLike of one) or holds a NUL byte (naming
                it), is a file or a non-store directory, another open store holds
                it (names that process's pid), layout/capacity/compression/codec differ from
                the stored ones, a store file is malformed (names it), capacity below one
                block, bad arguments.
        """
        self.path = check_arguments(path, layout, compression, io_threads)
        self.layout = layout
        self.codec = codec if isinstance(codec, Codec) else Codec.parse(str(codec), "NVMeStore codec")
        self.codec.check_head_dim(layout.head_dim, "NVMeStore")
        self.compression = compression
        self.overwrite_in_place = bool(overwrite_in_place)
        self.stats = dict.fromkeys(_STAT_NAMES, 0)
        self.last_failed_write: FailedWrite | None = None  # the latest block write that failed (its OSError, its file)
        chunk_shape, _, self.chunk_bytes = chunkio.chunk_geometry(layout, self.codec)
        self._block_codec = None if self.codec is Codec.NONE else codec_for(self.codec)
        self._dtype = torch_dtype(layout.dtype)
        self._ndim = 1 + len(chunk_shape)
        self._chunk_prefix = os.path.join(self.path, "c.")
        self._chunk_suffix = ".0" * len(chunk_shape)
        self._in_place_layout = compression is None and self.chunk_bytes % PAGE == 0
        self._host_bytes = HostBytes(self.chunk_bytes)
        self._dir_dirty = False  # a chunk was renamed into place since the last directory fsync
        self._lock, self._flush_lock = threading.Lock(), threading.Lock()
        self._closed, self._pid = False, os.getpid()  # only this process may use or close it (_check_owner)
        self.capacity = self._open(capacity_blocks, create)  # takes the directory lock
        self._start(direct_io, io_threads)

    def _start(self, direct_io: bool, io_threads: int) -> None:
        """Codec, O_DIRECT probe and I/O pool; a failure here releases what the open holds (R42-2)."""
        try:
            self._codec = chunkio.ChunkCodec(self.chunk_bytes, self.compression,
                                             self.layout.dtype_bytes if self._block_codec is None else 1)
            self.direct_io = direct_io and chunkio.supports_direct(os.path.join(self.path, "zarr.json"), self.folder_fd)
            self._start_io(io_threads)
        except BaseException:
            self._closed = True
            self._release_files()
            raise

    def _start_io(self, io_threads: int) -> None:
        """The I/O pool. Its thread initializer holds the store weakly: an idle worker must
        not keep a dropped store alive (``__del__`` releases it)."""
        self._local = threading.local()
        self._io_threads = io_threads
        self._executor = ThreadPoolExecutor(io_threads, "tiercache-nvme", initializer=_init_io_thread,
                                            initargs=(weakref.ref(self),))

    # ----- opening -------------------------------------------------------------------

    def _open(self, capacity_blocks: int | str | None, create: bool) -> int:
        """Creates or reopens the store under its lock; makes any recovery durable."""
        opened = open_store(self.path, self.layout, self.compression, capacity_blocks, create, self.codec)
        self._table, self._files, self._dir_lock = opened.table, opened.files, opened.lock
        self._folder = folder_identity(self.folder_fd)  # the folder the lock holds (``check_folder``)
        self._folder_warned = False
        self.stats.update(opened.counts)
        if opened.needs_flush:
            try:
                self.flush()
            except BaseException:
                self._release_files()
                raise
        return opened.capacity

    def _init_thread(self) -> None:
        """Allocates one I/O thread's staging buffers, once, so the hot path allocates nothing."""
        local = self._local
        chunk_tensor, local.chunk_owner = aligned_tensor((round_up(self._codec.max_chunk_bytes),), torch.uint8)
        local.chunk = chunk_tensor.numpy()
        trailer, local.trailer_owner = aligned_tensor((PAGE,), torch.uint8)
        local.trailer = trailer.numpy()
        local.block, local.block_owner = aligned_tensor(self.layout.block_shape, torch_dtype(self.layout.dtype))
        if self._block_codec is not None:  # the encoded block, page-aligned for O_DIRECT
            encoded, local.encoded_owner = aligned_tensor((round_up(self.chunk_bytes),), torch.uint8)
            local.encoded = encoded[: self.chunk_bytes]

    # ----- validation ----------------------------------------------------------------

    def _check_owner(self) -> None:
        """Refuses a child forked while the store was open: the I/O threads are the parent's."""
        if self._pid != os.getpid():
            raise UserError(f"{self.path}: this store was opened by process {self._pid}; a forked child must open a store of its own")

    def _check_open(self) -> None:
        self._check_owner()
        if self._closed:
            raise UserError(f"{self.path}: store is closed")

    _check_key = staticmethod(check_key)
    _check_keys = staticmethod(check_keys)

    # ----- writes --------------------------------------------------------------------

    def submit_put(
        self, keys: Sequence[bytes], blocks: torch.Tensor | Sequence[torch.Tensor], slots: Sequence[int] | None = None
    ) -> Future:
        """Starts writing ``blocks[i]`` under ``keys[i]``; returns a future of ``list[PutResult]``.

        Slots are reserved before returning, so capacity errors are raised here. A put of a
        key already stored replaces it (the old slot is retired). Visible to ``get`` when
        the future is done; durable across a crash after the next ``flush``.

        Args:
            keys: one distinct ``bytes`` key per block.
            blocks: a tensor ``[n, *block_shape]`` or a list of per-block tensors.
            slots: slots to write (a manager tracking NVMe slots itself, e.g. from a
                ``TransferPlan``; a live slot's key is dropped), or None: free slots.

        Raises:
            UserError: keys not bytes or repeated, blocks of wrong dtype/shape/count, a
                named slot out of range, repeated, already being written, or retired
                (its old block's replacement or deletion not durable yet: ``flush`` first).
            StoreFullError: fewer free slots than blocks; nothing is written.
        """
        self._check_open()
        keys = self._check_keys(keys, "NVMeStore.put")
        views = block_list(blocks, self.layout, len(keys), "NVMeStore.put blocks")
        return self._submit_put(keys, views, slots, encoded=False)

    def submit_put_encoded(self, keys: Sequence[bytes], encoded: Sequence[torch.Tensor],
                           slots: Sequence[int] | None = None) -> Future:
        """``submit_put`` of blocks already encoded with this store's codec: each a 1-D
        uint8 host tensor of ``chunk_bytes`` (``BlockCodec.encode_into``), written as is,
        so a block moved between two tiers of one codec is never quantised twice.

        Raises:
            UserError: as ``submit_put``, or a buffer that is not ``chunk_bytes`` of uint8.
            StoreFullError: fewer free slots than blocks; nothing is written.
        """
        self._check_open()
        keys = self._check_keys(keys, "NVMeStore.put_encoded")
        return self._submit_put(keys, self._check_encoded(encoded, len(keys), "NVMeStore.put_encoded"), slots, encoded=True)

    def _submit_put(self, keys: list[bytes], views: list[torch.Tensor], slots: Sequence[int] | None, encoded: bool) -> Future:
        if len(set(keys)) != len(keys):
            raise UserError("NVMeStore.put: a key appears twice in one batch")
        reserved, named = self._reserve(len(keys), slots), slots is not None
        return run_batch(self._executor, self._io_threads, len(keys),
                         lambda i: self._write_one(keys[i], *reserved[i], views[i], named, encoded), list)

    def _check_encoded(self, buffers: Sequence[torch.Tensor], count: int, what: str) -> list[torch.Tensor]:
        """Encoded blocks must be ``count`` contiguous 1-D uint8 host tensors of ``chunk_bytes``."""
        return check_encoded(buffers, count, self.chunk_bytes, self.codec, what)

    def put(
        self, keys: Sequence[bytes], blocks: torch.Tensor | Sequence[torch.Tensor], slots: Sequence[int] | None = None
    ) -> list[PutResult]:
        """Blocking ``submit_put``: writes the blocks and returns one ``PutResult`` per key."""
        return self.submit_put(keys, blocks, slots).result()

    def _reserve(self, n: int, slots: Sequence[int] | None) -> list[tuple[int, int]]:
        """Reserves ``n`` slots (the given ones, or free ones) and their generations."""
        if slots is not None:
            slots = check_slots(slots)
            if len(slots) != n:
                raise UserError(f"NVMeStore.put: {n} keys but {len(slots)} slots")
        with self._lock:
            if slots is not None:
                return self._table.reserve_at(slots)
            reserved = self._table.reserve(n)
        if reserved is None:
            raise StoreFullError(self._full_message(n))
        return reserved

    def _full_message(self, wanted: int) -> str:
        table = self._table
        return (f"{self.path}: store full: {wanted} blocks to put, {table.free_count} of {self.capacity} slots free"
                f" ({table.retired_count} more after the next flush); evict before putting")

    # ----- index -----------------------------------------------------------------------

    @property
    def folder_fd(self) -> int | None:
        """The store's folder, held open by its lock (None once released): the files it writes
        after opening land there or nowhere, never in a folder made anew under its path."""
        return self._dir_lock.dir_fd

    def chunk_path(self, slot: int) -> str:
        """The chunk file of ``slot`` (for tools and benchmarks; the index says if it is live)."""
        return self._chunk_prefix + str(slot) + self._chunk_suffix

    def contains(self, key: bytes) -> bool:
        """True when ``key`` is stored (visible in this process; durable only after flush)."""
        key = self._check_key(key, "NVMeStore.contains")
        with self._lock:
            return self._table.lookup(key) is not None

    def slot_of(self, key: bytes) -> int | None:
        """The slot holding ``key``, or None."""
        key = self._check_key(key, "NVMeStore.slot_of")
        with self._lock:
            entry = self._table.lookup(key)
        return None if entry is None else entry.slot

    def items(self) -> list[tuple[bytes, int]]:
        """``(key, slot)`` of every stored block: what a manager adopts on reopen."""
        with self._lock:
            return self._table.items()

    # ----- the medium interface (``media.Medium``, shared with the pools) ---------------

    keyed = True  # blocks are named by content key: ``forget`` receives keys

    def delete(self, keys: Sequence[bytes]) -> int:
        """Removes keys (absent ones are ignored); returns how many were stored.

        Their slots become free after the next ``flush`` makes the deletion durable.
        """
        self._check_open()
        keys = self._check_keys(keys, "NVMeStore.delete")
        with self._lock:
            removed = sum(self._table.delete(k) for k in keys)
            self.stats["deletes"] += removed
        return removed

    forget = delete  # blocks that left this tier are deleted
    durable_items = items  # what a reopened store adopts

    def flush(self) -> None:
        """Makes every completed put and delete durable (``_flush``).

        Raises:
            UserError: the store is closed (its index files may belong to another store by
                now: review R43-1).
        """
        self._check_open()
        self._flush()

    def _flush(self, final: bool = False) -> None:
        """Makes every completed put and delete durable.

        Order: directory fsync if a chunk was renamed into place since the last flush
        (renames durable before the index names them), then one journal batch (or a new
        snapshot when the journal has grown past it, ``IndexFiles.wants_snapshot``, and the
        disk has room for it, if need be once the dead chunk files of free slots are
        removed), then retired slots are freed. On OSError nothing is lost: the batch stays
        pending for the next flush, the error is counted (``failed_flushes``) and re-raised;
        a folder removed or replaced since open (``check_folder``) is such an error, even
        with nothing pending.
        ``final`` (``close``) snapshots whenever the journal is longer than the snapshot
        (``IndexFiles.wants_snapshot``), so a reopen replays the live entries only.
        """
        self._check_owner()
        with self._flush_lock:
            if self._closed and not final:  # checked again here: a close may have run since flush() checked
                raise UserError(f"{self.path}: store is closed")
            with self._lock:
                ops, retired = self._table.take_pending()
                compact = self._files.wants_snapshot(final)
                snapshot = self._table.live_ops() if compact else None
                dir_dirty, self._dir_dirty = self._dir_dirty, False
            try:
                self.check_folder()  # a folder removed or replaced: what was written there is not durable
                if not ops and not retired and not compact:
                    return
                if dir_dirty:  # in-place overwrites change no directory entry
                    chunkio.fsync_dir(self.path, self.folder_fd)
                if compact:
                    self._files.compact(snapshot, ops, self._reclaim_space)
                else:
                    self._files.append(ops)
            except OSError:
                with self._lock:
                    self._table.restore_pending(ops, retired)
                    self._dir_dirty = self._dir_dirty or dir_dirty
                    self.stats["failed_flushes"] += 1
                raise
            self._files.settle(record_cost([op[1] for op in ops]))  # these records are written
            self._release(retired)

    def _release(self, retired: list[int]) -> None:
        """Frees retired slots, whose release the flush made durable. Their chunk files stay
        for the next write of the slot, a full disk (``_reclaim_space``) or reopen's sweep."""
        with self._lock:
            self._table.release(retired)
            self.stats["flushes"] += 1

    # ----- housekeeping ----------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._table)

    @property
    def free_blocks(self) -> int:
        """Slots a put can take now (retired slots join after the next flush)."""
        with self._lock:
            return self._table.free_count

    def check_invariants(self) -> None:
        """Raises AssertionError unless the index's slot states partition the slots."""
        with self._lock:
            self._table.check_invariants()

    def drop_cache(self) -> None:
        """Evicts this store's files from the page cache, for cold-read measurements."""
        with self._lock:
            slots = list(self._table.live_slots())
        for slot in slots:
            chunkio.drop_file_cache(self.chunk_path(slot), self.folder_fd)

    def close(self) -> None:
        """Waits for I/O in flight, flushes, and releases threads, files and the lock.

        Idempotent. Every file descriptor (journal, lock) is closed even when the flush
        fails; the store then reopens with what its last successful flush made durable. In a
        child forked while the store was open it does nothing: the parent still owns the store.

        Raises:
            OSError: the final flush failed (disk full, I/O error); same errno, and the
                message names the store and says what is not durable. ``ETIMEDOUT``: the
                I/O threads did not finish within ``close_timeout_s`` (closed all the same).
        """
        if self._closed or self._pid != os.getpid():
            return
        self._closed = True  # new submissions now fail; the ones in flight still finish
        finished = shutdown_within(self._executor, self.close_timeout_s)
        try:
            self._flush(final=True)
        except OSError as exc:
            raise OSError(exc.errno, f"{self.path}: closed, but the final flush failed ({exc.strerror or exc}):"
                          " blocks put or deleted since the last successful flush are not durable") from exc
        else:
            if finished:
                mark_clean(self.path, self._files.seq, self.folder_fd)  # the next open may skip the trailer checks
        finally:
            self._release_files(finished)
        if not finished:
            raise OSError(errno.ETIMEDOUT, f"{self.path}: closed, but I/O threads did not finish within "
                          f"{self.close_timeout_s:g} s: the blocks they were writing are not durable; the path "
                          "stays locked until they have finished")

    def _release_files(self, now: bool = True) -> None:
        """Closes the journal, then drops the lock and the folder (``_release``): at once when
        no I/O thread runs (``now``), else once they have finished. Until then no store opened
        on the path takes a slot a late write still writes (review R42-1), and the late writes
        keep their journal room and their folder (R41-1)."""
        release = functools.partial(_release, self._files, self._dir_lock)  # no reference to the store
        if now:
            release()
        else:
            after_threads(self._executor, release)

    def __del__(self) -> None:
        """A store dropped without ``close`` (a caller's bug): its I/O threads stop and its
        journal and directory lock are released, so the path reopens in this process; nothing
        is flushed, so it reopens as after a killed process, with what the last flush made
        durable. Warns (ResourceWarning). In a forked child it does nothing (the parent owns all that)."""
        if getattr(self, "_closed", True) or not hasattr(self, "_executor") or self._pid != os.getpid():
            return  # closed, __init__ failed before there was anything to release, or a forked child
        self._closed = True
        try:
            warnings.warn(f"NVMeStore({self.path!r}) was not closed: closed without a final flush", ResourceWarning,
                          stacklevel=2)
        except Exception:  # noqa: BLE001  (interpreter shutdown: the warnings machinery may be gone)
            pass
        finished = False
        try:  # idle workers end at once; one still writing keeps the path locked until it is done
            finished = shutdown_within(self._executor, _DROP_WAIT_S)
        finally:
            self._release_files(finished)

    def __enter__(self) -> "NVMeStore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NVMeStore({self.path!r}, {len(self)}/{self.capacity} blocks, compression={self.compression!r})"


def _release(files: IndexFiles, lock: StoreLock) -> None:
    """``NVMeStore._release_files``' work: the journal closed, then the lock and the folder
    released (even if closing failed)."""
    try:
        files.close()
    finally:
        files.dir_fd = None  # the lock's descriptor: its number is another folder's once released
        lock.release()


def _init_io_thread(store_ref: "weakref.ref[NVMeStore]") -> None:
    """Thread initializer of a store's I/O pool (``NVMeStore._init_thread``), by weak reference."""
    store = store_ref()
    if store is not None:
        store._init_thread()
