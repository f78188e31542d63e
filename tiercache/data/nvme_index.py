"""The NVMe store's index: key -> slot, made durable by a journal and atomic snapshots.

In memory, :class:`SlotTable` (``nvme_table``) maps keys to slots and keeps per slot the generation, the
encoded chunk length and its crc32c, so that a chunk is only served when it is exactly
the one the index published. On disk, :class:`IndexFiles` keeps

* ``tiercache.index``: a snapshot of every live entry, replaced atomically (temp file,
  fdatasync, ``os.replace``, directory fsync);
* ``tiercache.journal``: batches of operations appended since that snapshot, each with
  a sequence number, length and crc32c, so a torn tail is detected and ignored, and a
  damaged batch in the middle is repaired or skipped (see ``nvme_journal``).

A flush appends one batch for all blocks published since the last flush (never one index
write per block); when the journal outgrows the snapshot, the flush writes a new snapshot
instead and empties the journal. Batches whose sequence number is not above the
snapshot's are stale and skipped on replay.

Journal space is reserved before the data it will name is written (``IndexFiles.promise``:
space is allocated past the journal's end in steps, ``reserve_space``), so on a full disk a
block's write fails before any of its data is written, and a flush writes into space
already allocated. The file's size stays the end of its last batch where the filesystem
can allocate past it (``FALLOC_FL_KEEP_SIZE``); elsewhere the preallocated zero bytes
after the last batch read as a torn tail: the scan stops there and ``load`` cuts them off.

On a disk short of space (the journal's room, or a snapshot, refused with ENOSPC), a flush compacts
as soon as the journal outgrows the snapshot, not only past ``_JOURNAL_MIN_BYTES``, so the
journal does not eat the disk's last pages; the snapshot is written before the journal is
emptied, so it needs room of its own, which the store may make by removing dead chunk files
(``compact``'s ``reclaim``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import threading
from typing import Callable

from ..errors import UserError
from .buffers import PAGE, round_up
from .chunkio import fsync_dir, open_file, read_small_file, replace_file, unlink_quietly
from .chunkio import write_file_durably as _write_file_durably
from .libc import libc_function
from .nvme_journal import HEADER as _JOURNAL_HEADER
from .nvme_journal import MAGIC as _JOURNAL_MAGIC
from .nvme_journal import REPAIR_MAX_BYTES, fix_one_bit, scan_journal, sealed_crc
from .nvme_table import (OP_DEL, OP_PUT, TABLE_SLOT_BYTES, Entry, Op, SlotTable, check_table_fits, decode_ops,
                         encode_ops, op_bytes)

__all__ = ["OP_PUT", "OP_DEL", "Entry", "SlotTable", "IndexFiles", "encode_ops", "decode_ops", "TABLE_SLOT_BYTES",
           "check_table_fits", "record_cost", "put_cost", "DISK_FULL"]

# Headers end with a crc32c over the header fields before it and the body, so a flipped
# sequence number or count is caught like a flipped entry.
_SNAPSHOT_HEADER = struct.Struct("<4sQQI")  # magic, sequence, entry count, crc
_SNAPSHOT_MAGIC = b"TCS1"
SNAPSHOT_NAME = "tiercache.index"
SNAPSHOT_TMP_NAME = SNAPSHOT_NAME + ".tmp"  # written, fsynced, then renamed over SNAPSHOT_NAME
JOURNAL_NAME = "tiercache.journal"
_JOURNAL_MIN_BYTES = 4 << 20
#: ``close`` snapshots a journal past this and past the snapshot (``wants_snapshot(final=True)``):
#: a reopen then replays at most this much history beyond what is live (about 3 ms).
_JOURNAL_CLOSE_BYTES = 64 << 10
_RESERVE_STEP = 16 << 10  # the journal grows by this much at a time (or by the page it needs, on a full disk)
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})  # the errnos of a write refused for lack of space


_fallocate = libc_function("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])
_FALLOC_FL_KEEP_SIZE = 1


def reserve_space(fd: int, offset: int, length: int) -> None:
    """Allocates ``length`` bytes of the file at ``offset``, keeping its size where the
    filesystem allows (``FALLOC_FL_KEEP_SIZE``), else with ``posix_fallocate`` (which
    extends the file with zero bytes).

    Raises:
        OSError: the space cannot be allocated (ENOSPC, EDQUOT, EIO).
    """
    if _fallocate is not None:
        if _fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise OSError(code, os.strerror(code))
    os.posix_fallocate(fd, offset, length)


def record_cost(keys: list[bytes]) -> int:
    """Journal bytes that one operation on each of ``keys`` may take: its record and, at
    worst, a batch header of its own."""
    return sum(op_bytes(key) for key in keys) + len(keys) * _JOURNAL_HEADER.size


def put_cost(key: bytes) -> int:
    """Journal bytes promised for a put of ``key``: its own record and its deletion's."""
    return 2 * record_cost([key])


class IndexFiles:
    """The durable side of the index: snapshot plus journal in the store directory.

    Invariants: the snapshot followed by the journal's valid batches with a higher sequence
    number is exactly the state at the last successful ``append``/``snapshot``; the journal
    has ``allocated >= journal_bytes + owed`` bytes allocated, where ``owed`` is what the
    operations not yet written may take (``promise``), except after a reopen or snapshot
    that could not allocate it all (best effort, ``owe``). ``short_of_space`` is set from a
    refusal for lack of space (``disk_full``) until a snapshot empties the journal.
    """

    def __init__(self, root: str, dir_fd: int | None = None) -> None:
        self.root = root
        self.dir_fd = dir_fd  # the store's folder, held open: the files written are its, whatever root names later
        self.snapshot_path = os.path.join(root, SNAPSHOT_NAME)
        self.journal_path = os.path.join(root, JOURNAL_NAME)
        self.seq = 0
        self.snapshot_bytes = 0
        self.journal_bytes = 0
        self.need_snapshot = False  # set when a failed append may have left a torn tail
        self.repaired_batches = 0  # journal batches with one flipped bit, repaired at load
        self.lost_batches = 0  # journal batches damaged beyond repair, skipped at load
        self.repaired_snapshot = False  # the snapshot had one flipped bit, repaired at load
        self.allocated = 0  # journal bytes allocated on disk: appends below this need no new space
        self.owed = 0  # journal bytes promised to operations not written yet
        self.short_of_space = False  # the disk refused a write since the last snapshot: compact early
        self._room_lock = threading.Lock()  # guards allocated/owed and the journal's end
        self._journal_fd: int | None = None

    def create(self) -> None:
        """Writes an empty snapshot and journal for a new store."""
        self.snapshot([])

    def load(self, table: SlotTable) -> None:
        """Replays snapshot then journal into ``table``; cuts a torn journal tail.

        Raises:
            UserError: the snapshot is missing or damaged (written atomically, so this is
                disk damage or a foreign file; never silently treated as empty).
        """
        ops = self._read_snapshot()
        try:
            for op in ops:
                table.apply(op)
            end = self._replay_journal(table)
        except ValueError as exc:  # a checksummed record names an impossible slot
            raise UserError(f"{self.root}: index damaged ({exc})") from None
        self._journal_fd = _open_journal(self.journal_path, self.dir_fd)
        self.journal_bytes = self.allocated = end  # first: ``close`` cuts the journal to this, never below
        if end != os.fstat(self._journal_fd).st_size:
            try:  # drop the torn tail so new batches follow valid ones
                os.ftruncate(self._journal_fd, end)
                os.fsync(self._journal_fd)
            except OSError as exc:  # the caller closes the journal
                raise UserError(f"{self.journal_path}: cannot cut the journal's torn tail ({exc.strerror or exc})") from None
        table.finish_load()

    def _read_snapshot(self) -> list[Op]:
        """The snapshot's operations; one flipped bit (a snapshot of at most
        ``REPAIR_MAX_BYTES``) is repaired, counted in ``repaired_snapshot``, and makes the
        next flush rewrite it (``need_snapshot``).

        Raises:
            UserError: damaged beyond one bit (or too large to search): naming the file.
        """
        data = _read_file(self.snapshot_path, "index snapshot", self.dir_fd)
        try:
            seq, ops = _parse_snapshot(data)
        except (struct.error, ValueError) as exc:
            if _unsealed_format(data):
                raise UserError(f"{self.snapshot_path}: index snapshot written by an older tiercache (before its "
                                "headers were sealed by their crc); open the store with the tiercache that wrote "
                                "it, or give the tier another directory") from None
            repaired = _repair_snapshot(data)
            if repaired is None:
                raise UserError(f"{self.snapshot_path}: index snapshot damaged ({exc})") from None
            seq, ops = repaired
            self.repaired_snapshot = True
        self.seq, self.snapshot_bytes = seq, len(data)
        return ops

    def _replay_journal(self, table: SlotTable) -> int:
        """Applies verified newer batches; returns the offset just after the last one.

        Batches at or below the snapshot's sequence number are stale (a crash between a
        snapshot and the journal reset) and skipped. A gap in the sequence numbers is a
        damaged batch that could not be repaired: counted in ``lost_batches``. Any repair
        or loss sets ``need_snapshot`` so the next flush rewrites a clean index.
        """
        data = _read_file(self.journal_path, "journal", self.dir_fd, missing_ok=True)
        scan = scan_journal(data, _decodes)
        for seq, body in scan.batches:
            if seq > self.seq:
                self.lost_batches += seq - self.seq - 1
                for op in decode_ops(body):
                    table.apply(op)
                self.seq = seq
        self.repaired_batches = scan.repaired
        self.need_snapshot = bool(scan.repaired or self.lost_batches or self.repaired_snapshot)
        return scan.end

    def lose_tail(self, acknowledged: int) -> None:
        """Counts the batches after the replayed ones up to sequence ``acknowledged`` in
        ``lost_batches``: the caller knows they were made durable (a clean close reached
        that sequence number), so a journal tail missing them was damaged or cut, not torn
        by a crash. Sets ``need_snapshot``, like any loss. ``load`` cut the damaged tail
        off, so new batches follow the replayed ones without a gap (which a later replay
        would count again)."""
        if acknowledged > self.seq:
            self.lost_batches += acknowledged - self.seq
            self.need_snapshot = True

    def wants_snapshot(self, final: bool = False) -> bool:
        """True when the next flush should rewrite the snapshot instead of appending: the
        journal is longer than the snapshot and than ``_JOURNAL_MIN_BYTES`` (than the
        snapshot alone when short of space: a snapshot at most as long as the journal it
        replaces gives pages back, and costs at most one more write of the journal's bytes).

        ``final`` (the flush of ``close``) lowers the floor to ``_JOURNAL_CLOSE_BYTES``: a
        journal longer than that and than the snapshot it follows is replaced by a snapshot
        of the live entries, so a reopen reads what is live, not up to 4 MiB of history, and
        the close costs at most one more write of the journal's bytes."""
        least = _JOURNAL_CLOSE_BYTES if final else _JOURNAL_MIN_BYTES
        floor = self.snapshot_bytes if self.short_of_space else max(least, self.snapshot_bytes)
        return self.need_snapshot or self.journal_bytes > floor

    def disk_full(self) -> None:
        """The disk refused a write for lack of space: compact as soon as it pays (``wants_snapshot``)."""
        self.short_of_space = True

    def promise(self, nbytes: int) -> None:
        """Reserves ``nbytes`` of journal space for records to come (``put_cost`` before a
        block's data is written), allocating more of the file when needed.

        Raises:
            OSError: the space cannot be allocated (ENOSPC); nothing is promised.
        """
        with self._room_lock:
            self._allocate(self.journal_bytes + self.owed + nbytes)
            self.owed += nbytes

    def settle(self, nbytes: int) -> None:
        """Returns promised journal space: its records were written, or will never be."""
        with self._room_lock:
            self.owed -= nbytes

    def owe(self, nbytes: int) -> None:
        """Promises ``nbytes`` that are owed already (the records a reopened index may still
        write), allocating what fits: a full disk must not refuse the open."""
        with self._room_lock:
            self.owed += nbytes
            self._allocate_quietly()

    def _allocate_quietly(self) -> None:
        """Allocates room for what is owed, if the disk has it (caller holds the lock)."""
        try:
            self._allocate(self.journal_bytes + self.owed)
        except OSError:
            pass

    def _allocate(self, need: int) -> None:
        """Grows the journal file to at least ``need`` allocated bytes, by a whole step if
        the disk has it, else by the pages needed (caller holds ``_room_lock``)."""
        if need <= self.allocated:
            return
        sizes = sorted({round_up(need, _RESERVE_STEP), round_up(need, PAGE)}, reverse=True)
        for size in sizes:
            try:
                reserve_space(self._journal_fd, self.allocated, size - self.allocated)
            except OSError as exc:
                if exc.errno in DISK_FULL:
                    self.disk_full()
                if exc.errno != errno.ENOSPC or size == sizes[-1]:
                    raise
                continue
            self.allocated = size
            return

    def append(self, ops: list[Op]) -> None:
        """Appends one batch and makes it durable (fdatasync). On OSError the journal may
        hold a torn tail, so ``need_snapshot`` is set and the error re-raised."""
        body = encode_ops(ops)
        header = _seal(_JOURNAL_HEADER, _JOURNAL_MAGIC, self.seq + 1, len(body), body)
        try:
            with self._room_lock:  # never beside an emulated posix_fallocate at the same offsets
                written = os.pwrite(self._journal_fd, header + body, self.journal_bytes)
                self.allocated = max(self.allocated, self.journal_bytes + written)
            if written != len(header) + len(body):
                raise OSError(f"short journal write ({written} bytes)")
            os.fdatasync(self._journal_fd)
        except OSError:
            self.need_snapshot = True
            raise
        self.seq += 1
        self.journal_bytes += written

    def compact(self, live: list[Op], ops: list[Op], reclaim: Callable[[], int] = lambda: 0) -> None:
        """Writes a snapshot of ``live`` (every live entry); on a full disk, calls ``reclaim``
        (which gives disk space back and returns how many files it removed) and, if that
        removed any, tries once more; failing that, appends ``ops`` (the operations since
        the last flush) instead, into the journal's reserved room. Either makes the same
        state durable; ``need_snapshot`` stays set after the append, so the next flush tries
        the snapshot again.

        Raises:
            OSError: the snapshot failed otherwise, or the append failed too.
        """
        try:
            self._snapshot_or_reclaim(live, reclaim)
        except OSError as exc:
            if exc.errno not in DISK_FULL:
                raise
            self.append(ops)

    def _snapshot_or_reclaim(self, live: list[Op], reclaim: Callable[[], int]) -> None:
        """``snapshot(live)``, once more after ``reclaim`` when the disk was full and it
        removed something."""
        try:
            self.snapshot(live)
        except OSError as exc:
            if exc.errno not in DISK_FULL:
                raise
            self.disk_full()
            if not reclaim():
                raise
            self.snapshot(live)

    def snapshot(self, ops: list[Op]) -> None:
        """Atomically replaces the snapshot with ``ops`` (all live entries), then empties
        the journal. Crash between the two: the old batches carry sequence numbers at or
        below the new snapshot's and are skipped on replay. A failed write removes its temp
        file (on a full disk, the pages it took are what the next put needs)."""
        body = encode_ops(ops)
        header = _seal(_SNAPSHOT_HEADER, _SNAPSHOT_MAGIC, self.seq + 1, len(ops), body)
        tmp = os.path.join(self.root, SNAPSHOT_TMP_NAME)
        try:
            _write_file_durably(tmp, header + body, self.dir_fd)
            replace_file(tmp, self.snapshot_path, self.dir_fd)
            fsync_dir(self.root, self.dir_fd)
        except OSError:
            self.need_snapshot = True
            unlink_quietly(tmp, self.dir_fd)  # reopen never reads it
            raise
        self.seq += 1
        self.snapshot_bytes = len(header) + len(body)
        self._reset_journal()

    def _reset_journal(self) -> None:
        if self._journal_fd is None:
            self._journal_fd = _open_journal(self.journal_path, self.dir_fd)
        try:
            with self._room_lock:
                os.ftruncate(self._journal_fd, 0)
                self.journal_bytes = self.allocated = 0
            os.fsync(self._journal_fd)
        except OSError:
            self.need_snapshot = True  # stale batches are harmless, but appends must not follow them
            raise
        self.need_snapshot = self.short_of_space = False
        with self._room_lock:  # the truncation freed the space promised: take it back
            self._allocate_quietly()

    def close(self) -> None:
        """Returns the journal's unused allocation (best effort: a reopen cuts it anyway)
        and closes its file descriptor (idempotent)."""
        if self._journal_fd is not None:
            try:
                os.ftruncate(self._journal_fd, self.journal_bytes)
            except OSError:
                pass
            os.close(self._journal_fd)
            self._journal_fd = None


def _decodes(body: bytes) -> bool:
    """True when ``body`` parses as operations."""
    try:
        decode_ops(body)
    except ValueError:
        return False
    return True


def _read_file(path: str, what: str, dir_fd: int | None, missing_ok: bool = False) -> bytes:
    """The bytes of an index file (b"" if missing and ``missing_ok``), in the folder
    ``dir_fd`` holds open when given.

    Raises:
        UserError: unreadable (a directory, no permission, I/O error), naming the file.
    """
    try:
        return read_small_file(path, dir_fd)
    except FileNotFoundError:
        if missing_ok:
            return b""
        raise UserError(f"{path}: {what} missing") from None
    except OSError as exc:
        raise UserError(f"{path}: {what} unreadable ({exc.strerror or exc})") from None


def _open_journal(path: str, dir_fd: int | None) -> int:
    """Opens the journal for appending (in the folder ``dir_fd`` holds, when given);
    UserError naming it if that is impossible."""
    try:
        return open_file(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd)
    except OSError as exc:
        raise UserError(f"{path}: journal cannot be opened for writing ({exc.strerror or exc})") from None


def _seal(header: struct.Struct, magic: bytes, seq: int, field: int, body: bytes) -> bytes:
    """Packs a header whose last field is the crc of the fields before it and the body."""
    head = header.pack(magic, seq, field, 0)[:-4]
    return head + sealed_crc(head, body).to_bytes(4, "little")


def _parse_snapshot(data: bytes) -> tuple[int, list[Op]]:
    """``(seq, ops)`` of snapshot bytes whose magic, crc and entry count verify.

    Raises:
        ValueError, struct.error: they do not.
    """
    magic, seq, count, crc = _SNAPSHOT_HEADER.unpack_from(data, 0)
    body = data[_SNAPSHOT_HEADER.size :]
    if magic != _SNAPSHOT_MAGIC or sealed_crc(data[: _SNAPSHOT_HEADER.size - 4], body) != crc:
        raise ValueError("bad magic or checksum")
    ops = decode_ops(body)
    if len(ops) != count:
        raise ValueError("entry count mismatch")
    return seq, ops


def _unsealed_format(data: bytes) -> bool:
    """True when ``data`` is a snapshot of the first format, whose crc covered the body alone
    (the header fields were sealed in later): a store an older tiercache wrote, not damage."""
    if len(data) < _SNAPSHOT_HEADER.size:
        return False
    magic, _, _, crc = _SNAPSHOT_HEADER.unpack_from(data, 0)
    return magic == _SNAPSHOT_MAGIC and sealed_crc(b"", data[_SNAPSHOT_HEADER.size :]) == crc


def _repair_snapshot(data: bytes) -> tuple[int, list[Op]] | None:
    """``_parse_snapshot`` of ``data`` with its one flipped bit fixed, or None (not one bit,
    or larger than ``REPAIR_MAX_BYTES``: the search is Python)."""
    if not _SNAPSHOT_HEADER.size <= len(data) <= REPAIR_MAX_BYTES:
        return None
    fixed = bytearray(data)
    if not fix_one_bit(fixed, _SNAPSHOT_HEADER.size - 4, _SNAPSHOT_HEADER.size):
        return None
    try:
        return _parse_snapshot(bytes(fixed))
    except (struct.error, ValueError):
        return None
