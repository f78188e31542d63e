"""The NVMe store's index: key -> slot, made durable by a journal and atomic snapshots.

In memory, :class:`SlotTable` maps keys to slots and keeps per slot the generation, the
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
from dataclasses import dataclass

import numpy as np
import psutil

from ..errors import UserError
from .chunkio import fsync_dir
from .chunkio import write_file_durably as _write_file_durably
from .nvme_free import FreeSlots
from .nvme_journal import HEADER as _JOURNAL_HEADER
from .nvme_journal import MAGIC as _JOURNAL_MAGIC
from .nvme_journal import REPAIR_MAX_BYTES, fix_one_bit, scan_journal, sealed_crc

__all__ = ["OP_PUT", "OP_DEL", "Entry", "SlotTable", "IndexFiles", "encode_ops", "decode_ops", "TABLE_SLOT_BYTES",
           "check_table_fits"]

OP_PUT = 1
OP_DEL = 2
_OP = struct.Struct("<BQQIIH")  # op, slot, generation, chunk length, chunk crc, key length
# Headers end with a crc32c over the header fields before it and the body, so a flipped
# sequence number or count is caught like a flipped entry.
_SNAPSHOT_HEADER = struct.Struct("<4sQQI")  # magic, sequence, entry count, crc
_SNAPSHOT_MAGIC = b"TCS1"
SNAPSHOT_NAME = "tiercache.index"
JOURNAL_NAME = "tiercache.journal"
_JOURNAL_MIN_BYTES = 4 << 20
TABLE_SLOT_BYTES = 29  # SlotTable per slot of capacity (see its docstring)

# An operation: (op, key, slot, generation, length, crc). Plain tuples: one per block.
Op = tuple


@dataclass(frozen=True)
class Entry:
    """Where a key's block lives and what its chunk must look like to be served."""

    slot: int
    generation: int
    length: int
    crc: int


def encode_ops(ops: list[Op]) -> bytes:
    """Serializes operations (see ``_OP``) followed by each key's bytes."""
    parts = []
    for op, key, slot, gen, length, crc in ops:
        parts.append(_OP.pack(op, slot, gen, length, crc, len(key)))
        parts.append(key)
    return b"".join(parts)


def decode_ops(payload: bytes) -> list[Op]:
    """Parses ``encode_ops`` output.

    Raises:
        ValueError: truncated or unknown operation.
    """
    ops, pos = [], 0
    while pos < len(payload):
        if pos + _OP.size > len(payload):
            raise ValueError("truncated operation")
        op, slot, gen, length, crc, key_len = _OP.unpack_from(payload, pos)
        pos += _OP.size
        if op not in (OP_PUT, OP_DEL) or pos + key_len > len(payload):
            raise ValueError("bad operation")
        ops.append((op, payload[pos : pos + key_len], slot, gen, length, crc))
        pos += key_len
    return ops


class SlotTable:
    """The in-memory index. Not thread safe: the store holds its lock around every call.

    Every slot is in exactly one state: free, reserved (a write in flight), live (a key
    maps to it), retired (its key was deleted or replaced, and that fact is not yet
    durable) or releasing (retired, in a flush in progress). A retired slot becomes free
    only after a flush made the retirement durable, so a crash can never leave the durable
    index naming a slot that holds newer bytes.

    Memory per slot of capacity: 16 B of numpy (generation, chunk length, crc), 8 B for
    the slot's key pointer and 5 B of ``FreeSlots``: 29 B. Per live entry, the key's bytes
    object, a dict entry and the slot's int. Reserved, retired and releasing slots are
    small sets (writes in flight, retirements not yet durable).
    """

    def __init__(self, capacity: int) -> None:
        check_table_fits(capacity)
        self.capacity = capacity
        self._key_to_slot: dict[bytes, int] = {}
        self._slot_key: list[bytes | None] = [None] * capacity
        self._gen = np.zeros(capacity, dtype=np.uint64)  # 0: no live block
        self._length = np.zeros(capacity, dtype=np.uint32)
        self._crc = np.zeros(capacity, dtype=np.uint32)
        self._free = FreeSlots(capacity, np.empty(0, dtype=np.int64))  # filled by finish_load
        self._reserved: set[int] = set()
        self._retired: dict[int, None] = {}  # ordered: released in this order
        self._releasing: set[int] = set()  # retired slots a flush in progress will free
        self._pending: list[Op] = []
        self._next_gen = 1

    def __len__(self) -> int:
        return len(self._key_to_slot)

    @property
    def free_count(self) -> int:
        """Slots a put can take now."""
        return self._free.count

    @property
    def retired_count(self) -> int:
        """Slots that become free at the next successful flush."""
        return len(self._retired)

    def apply(self, op: Op) -> None:
        """Replays one durable operation while loading (free list rebuilt by ``finish_load``)."""
        kind, key, slot, gen, length, crc = op
        if slot >= self.capacity:
            raise ValueError(f"slot {slot} beyond capacity {self.capacity}")
        if kind == OP_DEL:
            if self._key_to_slot.get(key) == slot:
                self._unlink(key, slot)
            return
        self._evict_key(key)
        if self._slot_key[slot] is not None:
            self._unlink(self._slot_key[slot], slot)
        self._link(key, slot, gen, length, crc)
        self._next_gen = max(self._next_gen, gen + 1)

    def finish_load(self) -> None:
        """After replay: every slot without a live key is free (lowest slots handed out first)."""
        free = np.ones(self.capacity, dtype=np.bool_)
        free[np.fromiter(self._key_to_slot.values(), dtype=np.int64, count=len(self._key_to_slot))] = False
        self._free = FreeSlots(self.capacity, np.flatnonzero(free)[::-1])

    def _link(self, key: bytes, slot: int, gen: int, length: int, crc: int) -> None:
        self._key_to_slot[key] = slot
        self._slot_key[slot] = key
        self._gen[slot], self._length[slot], self._crc[slot] = gen, length, crc

    def _unlink(self, key: bytes, slot: int) -> None:
        del self._key_to_slot[key]
        self._slot_key[slot] = None
        self._gen[slot] = 0

    def _evict_key(self, key: bytes) -> int | None:
        """Unlinks ``key`` if live; returns its old slot."""
        old = self._key_to_slot.get(key)
        if old is not None:
            self._unlink(key, old)
        return old

    def reserve(self, n: int) -> list[tuple[int, int]] | None:
        """Takes ``n`` free slots for writes in flight; None (and no change) if too few."""
        if n > self._free.count:
            return None
        return self._take(self._free.pop(n))

    def reserve_at(self, slots: list[int]) -> list[tuple[int, int]]:
        """Takes the given slots for writes in flight, whatever they hold.

        A live slot's key is dropped (a pending delete); a retired slot is taken back. Safe
        before the drop is durable because reads check the chunk's crc against the index
        entry: an old durable entry never serves the newer bytes.

        Raises:
            UserError: a slot out of range, repeated, or already being written.
        """
        if len(set(slots)) != len(slots):
            raise UserError("NVMeStore.put: a slot appears twice in one batch")
        for slot in slots:
            if not 0 <= slot < self.capacity or slot in self._reserved:
                state = "being written" if slot in self._reserved else f"outside [0, {self.capacity})"
                raise UserError(f"NVMeStore.put: slot {slot} is {state}")
        for slot in slots:
            self._take_back(slot)
        return self._take(slots)

    def _take_back(self, slot: int) -> None:
        """Removes ``slot`` from whichever state it is in (free, retired, releasing, live)."""
        if slot in self._free:
            self._free.discard(slot)
        elif slot in self._retired:
            del self._retired[slot]
        elif slot in self._releasing:
            self._releasing.discard(slot)  # the flush in progress will not free it
        else:
            key = self._slot_key[slot]
            self._unlink(key, slot)
            self._pending.append((OP_DEL, key, slot, 0, 0, 0))

    def _take(self, slots: list[int]) -> list[tuple[int, int]]:
        """Marks slots reserved and gives each a fresh generation."""
        self._reserved.update(slots)
        gens = range(self._next_gen, self._next_gen + len(slots))
        self._next_gen += len(slots)
        return list(zip(slots, gens))

    def publish(self, key: bytes, slot: int, gen: int, length: int, crc: int) -> None:
        """A reserved slot's chunk is in place: map ``key`` to it (retiring any older slot)."""
        self._reserved.remove(slot)
        old = self._evict_key(key)
        if old is not None:
            self._retired[old] = None
        self._link(key, slot, gen, length, crc)
        self._pending.append((OP_PUT, key, slot, gen, length, crc))

    def abandon(self, slot: int) -> None:
        """A reserved slot's write failed: it was never published, so it is free at once."""
        self._reserved.remove(slot)
        self._free.add(slot)

    def delete(self, key: bytes) -> bool:
        """Unmaps ``key``; its slot is retired until the deletion is durable."""
        old = self._evict_key(key)
        if old is None:
            return False
        self._retired[old] = None
        self._pending.append((OP_DEL, key, old, 0, 0, 0))
        return True

    def lookup(self, key: bytes) -> Entry | None:
        """The live entry of ``key``, or None."""
        slot = self._key_to_slot.get(key)
        if slot is None:
            return None
        return Entry(slot, int(self._gen[slot]), int(self._length[slot]), int(self._crc[slot]))

    def is_current(self, entry: Entry) -> bool:
        """True while ``entry``'s slot still holds the same generation (not deleted or reused)."""
        return int(self._gen[entry.slot]) == entry.generation

    def take_pending(self) -> tuple[list[Op], list[int]]:
        """Hands the unflushed operations and retired slots to a flush."""
        ops, retired = self._pending, list(self._retired)
        self._pending, self._retired = [], {}
        self._releasing.update(retired)
        return ops, retired

    def restore_pending(self, ops: list[Op], retired: list[int]) -> None:
        """A flush failed: its operations go back in front of newer ones, in order."""
        self._pending = ops + self._pending
        newer = self._retired
        self._retired = dict.fromkeys(s for s in retired if s in self._releasing)
        self._retired.update(newer)
        self._releasing.difference_update(retired)

    def release(self, retired: list[int]) -> None:
        """A flush made these retirements durable: the slots may be reused."""
        for slot in retired:
            if slot in self._releasing:  # else a put naming this slot took it back meanwhile
                self._releasing.discard(slot)
                self._free.add(slot)

    def live_ops(self) -> list[Op]:
        """One put operation per live entry (the content of a snapshot)."""
        return [
            (OP_PUT, key, slot, int(self._gen[slot]), int(self._length[slot]), int(self._crc[slot]))
            for key, slot in self._key_to_slot.items()
        ]

    def items(self) -> list[tuple[bytes, int]]:
        """``(key, slot)`` of every live entry."""
        return list(self._key_to_slot.items())

    def live_slots(self) -> dict[int, tuple[int, int]]:
        """``slot -> (chunk length, chunk crc)`` of every live entry."""
        return {slot: (int(self._length[slot]), int(self._crc[slot])) for slot in self._key_to_slot.values()}

    def drop_slot(self, slot: int) -> None:
        """Forgets a live slot whose chunk is missing on disk (found at open)."""
        key = self._slot_key[slot]
        if key is not None:
            self._unlink(key, slot)
            self._retired[slot] = None
            self._pending.append((OP_DEL, key, slot, 0, 0, 0))

    def check_invariants(self) -> None:
        """Raises AssertionError unless the slot states partition the slots."""
        self._free.check()
        owners = np.zeros(self.capacity, dtype=np.int64)
        owners += self._free.is_free
        for group in (self._reserved, self._key_to_slot.values(), self._retired, self._releasing):
            np.add.at(owners, np.fromiter(group, dtype=np.int64, count=len(group)), 1)
        assert (owners == 1).all(), "slot states do not partition the slots"
        for key, slot in self._key_to_slot.items():
            assert self._slot_key[slot] == key and self._gen[slot] > 0, f"slot {slot} disagrees with key"


def check_table_fits(capacity: int, where: str = "NVMeStore") -> None:
    """Refuses a capacity whose ``SlotTable`` would not fit in the memory available now.

    Raises:
        UserError: naming the bytes needed (``TABLE_SLOT_BYTES`` per slot) and available.
    """
    need = capacity * TABLE_SLOT_BYTES
    available = psutil.virtual_memory().available if need > 1 << 30 else need  # small: not worth asking
    if need > available:
        raise UserError(f"{where}: an index of {capacity:,} slots needs {need:,} bytes of memory "
                        f"({TABLE_SLOT_BYTES} B per slot); only {available:,} bytes are available")


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
        tmp = self.snapshot_path + ".tmp"
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
