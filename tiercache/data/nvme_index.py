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
"""

from __future__ import annotations

import os
import struct

from ..errors import UserError
from .chunkio import fsync_dir
from .chunkio import write_file_durably as _write_file_durably
from .nvme_journal import HEADER as _JOURNAL_HEADER
from .nvme_journal import MAGIC as _JOURNAL_MAGIC
from .nvme_journal import REPAIR_MAX_BYTES, fix_one_bit, scan_journal, sealed_crc
from .nvme_table import (OP_DEL, OP_PUT, TABLE_SLOT_BYTES, Entry, Op, SlotTable, check_table_fits, decode_ops,
                         encode_ops)

__all__ = ["OP_PUT", "OP_DEL", "Entry", "SlotTable", "IndexFiles", "encode_ops", "decode_ops", "TABLE_SLOT_BYTES",
           "check_table_fits"]

# Headers end with a crc32c over the header fields before it and the body, so a flipped
# sequence number or count is caught like a flipped entry.
_SNAPSHOT_HEADER = struct.Struct("<4sQQI")  # magic, sequence, entry count, crc
_SNAPSHOT_MAGIC = b"TCS1"
SNAPSHOT_NAME = "tiercache.index"
SNAPSHOT_TMP_NAME = SNAPSHOT_NAME + ".tmp"  # written, fsynced, then renamed over SNAPSHOT_NAME
JOURNAL_NAME = "tiercache.journal"
_JOURNAL_MIN_BYTES = 4 << 20


class IndexFiles:
    """The durable side of the index: snapshot plus journal in the store directory.

    Invariant: the snapshot followed by the journal's valid batches with a higher sequence
    number is exactly the state at the last successful ``append``/``snapshot``.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.snapshot_path = os.path.join(root, SNAPSHOT_NAME)
        self.journal_path = os.path.join(root, JOURNAL_NAME)
        self.seq = 0
        self.snapshot_bytes = 0
        self.journal_bytes = 0
        self.need_snapshot = False  # set when a failed append may have left a torn tail
        self.repaired_batches = 0  # journal batches with one flipped bit, repaired at load
        self.lost_batches = 0  # journal batches damaged beyond repair, skipped at load
        self.repaired_snapshot = False  # the snapshot had one flipped bit, repaired at load
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
        self._journal_fd = _open_journal(self.journal_path)
        if end != os.fstat(self._journal_fd).st_size:
            os.ftruncate(self._journal_fd, end)  # drop the torn tail so new batches follow valid ones
            os.fsync(self._journal_fd)
        self.journal_bytes = end
        table.finish_load()

    def _read_snapshot(self) -> list[Op]:
        """The snapshot's operations; one flipped bit (a snapshot of at most
        ``REPAIR_MAX_BYTES``) is repaired, counted in ``repaired_snapshot``, and makes the
        next flush rewrite it (``need_snapshot``).

        Raises:
            UserError: damaged beyond one bit (or too large to search): naming the file.
        """
        data = _read_file(self.snapshot_path, "index snapshot")
        try:
            seq, ops = _parse_snapshot(data)
        except (struct.error, ValueError) as exc:
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
        data = _read_file(self.journal_path, "journal", missing_ok=True)
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

    def wants_snapshot(self) -> bool:
        """True when the next flush should rewrite the snapshot instead of appending."""
        return self.need_snapshot or self.journal_bytes > max(_JOURNAL_MIN_BYTES, self.snapshot_bytes)

    def append(self, ops: list[Op]) -> None:
        """Appends one batch and makes it durable (fdatasync). On OSError the journal may
        hold a torn tail, so ``need_snapshot`` is set and the error re-raised."""
        body = encode_ops(ops)
        header = _seal(_JOURNAL_HEADER, _JOURNAL_MAGIC, self.seq + 1, len(body), body)
        try:
            written = os.pwrite(self._journal_fd, header + body, self.journal_bytes)
            if written != len(header) + len(body):
                raise OSError(f"short journal write ({written} bytes)")
            os.fdatasync(self._journal_fd)
        except OSError:
            self.need_snapshot = True
            raise
        self.seq += 1
        self.journal_bytes += written

    def snapshot(self, ops: list[Op]) -> None:
        """Atomically replaces the snapshot with ``ops`` (all live entries), then empties
        the journal. Crash between the two: the old batches carry sequence numbers at or
        below the new snapshot's and are skipped on replay."""
        body = encode_ops(ops)
        header = _seal(_SNAPSHOT_HEADER, _SNAPSHOT_MAGIC, self.seq + 1, len(ops), body)
        tmp = os.path.join(self.root, SNAPSHOT_TMP_NAME)
        try:
            _write_file_durably(tmp, header + body)
            os.replace(tmp, self.snapshot_path)
            fsync_dir(self.root)
        except OSError:
            self.need_snapshot = True
            raise
        self.seq += 1
        self.snapshot_bytes = len(header) + len(body)
        self._reset_journal()

    def _reset_journal(self) -> None:
        if self._journal_fd is None:
            self._journal_fd = _open_journal(self.journal_path)
        try:
            os.ftruncate(self._journal_fd, 0)
            os.fsync(self._journal_fd)
        except OSError:
            self.need_snapshot = True  # stale batches are harmless, but appends must not follow them
            raise
        self.journal_bytes = 0
        self.need_snapshot = False

    def close(self) -> None:
        """Closes the journal file descriptor (idempotent)."""
        if self._journal_fd is not None:
            os.close(self._journal_fd)
            self._journal_fd = None


def _decodes(body: bytes) -> bool:
    """True when ``body`` parses as operations."""
    try:
        decode_ops(body)
    except ValueError:
        return False
    return True


def _read_file(path: str, what: str, missing_ok: bool = False) -> bytes:
    """The bytes of an index file (b"" if missing and ``missing_ok``).

    Raises:
        UserError: unreadable (a directory, no permission, I/O error), naming the file.
    """
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        if missing_ok:
            return b""
        raise UserError(f"{path}: {what} missing") from None
    except OSError as exc:
        raise UserError(f"{path}: {what} unreadable ({exc.strerror or exc})") from None


def _open_journal(path: str) -> int:
    """Opens the journal for appending; UserError naming it if that is impossible."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
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
