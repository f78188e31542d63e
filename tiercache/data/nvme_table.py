"""The NVMe store's in-memory index (:class:`SlotTable`: key -> slot, generation, chunk
length and crc32c per slot) and the operations that change it, as the journal and the
snapshot encode them (``encode_ops``/``decode_ops``). ``nvme_index`` makes it durable and
re-exports these names.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import psutil

from ..errors import UserError
from .nvme_free import FreeSlots

__all__ = ["OP_PUT", "OP_DEL", "Op", "Entry", "SlotTable", "encode_ops", "decode_ops", "op_bytes", "TABLE_SLOT_BYTES",
           "check_table_fits"]

OP_PUT = 1
OP_DEL = 2
_OP = struct.Struct("<BQQIIH")  # op, slot, generation, chunk length, chunk crc, key length
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


def op_bytes(key: bytes) -> int:
    """Encoded size of one operation on ``key`` (``encode_ops``)."""
    return _OP.size + len(key)


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
    only after a flush made the retirement durable (a put naming it is refused until then),
    so a crash can never leave the durable index naming a retired slot that holds newer bytes.

    A slot's chunk length is its live entry's; in a slot not live, that of the chunk file its
    last block left on disk, 0 when there is none (never written since open: reopen removes
    the chunk file of every slot not live) or it was removed. A free slot's file holds no
    block a crash must keep (``dead_files``), so the store may remove it for its space.

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
        """Takes the given slots for writes in flight: free or live ones.

        A live slot's key is dropped (a pending delete). Safe before the drop is durable:
        after a crash the durable entry no longer matches the rewritten chunk, so reopen
        drops it and reads check the chunk's crc against the entry (the old entry never
        serves the newer bytes); the caller asked for that key to go.

        A retired or releasing slot is refused: until a flush makes its release durable,
        the durable index may still name it as the only copy of a key that is live
        elsewhere (replaced, or deleted and put again, since the last flush); rewriting
        it would lose that key at a crash. Nothing changes when a slot is refused.

        Raises:
            UserError: a slot out of range, repeated, being written, or whose release is
                not durable yet (naming the slot and what to do).
        """
        if len(set(slots)) != len(slots):
            raise UserError("NVMeStore.put: a slot appears twice in one batch")
        for slot in slots:
            refusal = self._named_slot_refusal(slot)
            if refusal is not None:
                raise UserError(f"NVMeStore.put: slot {slot} {refusal}")
        for slot in slots:
            self._take_back(slot)
        return self._take(slots)

    def _named_slot_refusal(self, slot: int) -> str | None:
        """Why a put may not name ``slot`` now, or None when it may (free or live)."""
        if not 0 <= slot < self.capacity:
            return f"is outside [0, {self.capacity})"
        if slot in self._reserved:
            return "is being written"
        if slot in self._retired:
            return ("is retired: the block it held was replaced or deleted, but not durably yet, so a crash "
                    "would reopen that block from this slot; rewriting it now could lose the block's last "
                    "durable copy. Call flush() first, or name a free slot")
        if slot in self._releasing:
            return ("is being released by a flush still in progress: its release is not durable yet. "
                    "Call flush() first (it waits for that flush), or name a free slot")
        return None

    def _take_back(self, slot: int) -> None:
        """Removes a free or live ``slot`` from its state (a live slot's key is dropped)."""
        if slot in self._free:
            self._free.discard(slot)
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
        self._retired = dict.fromkeys(retired)  # a named put never takes a releasing slot
        self._retired.update(newer)
        self._releasing.difference_update(retired)

    def release(self, retired: list[int]) -> None:
        """A flush made these retirements durable: the slots may be reused."""
        for slot in retired:  # all still releasing: a named put never takes one back
            self._releasing.remove(slot)
            self._free.add(slot)

    def dead_files(self) -> list[int]:
        """The free slots whose chunk file may still be on disk (chunk length not 0), for
        the caller to remove their files (holding the store lock, so that no put takes one
        of these slots meanwhile) and then ``forget_files``.

        Such a file holds no block a crash must keep: a slot is freed once a durable journal
        batch no longer names it (``release``), or when a write that never published fails
        (``abandon``): a slot that was free, or a live one a put named, whose key that put
        dropped (its deletion may not be durable yet, and a reopen without the file drops
        that key, as the caller asked).
        """
        return np.flatnonzero((self._length != 0) & self._free.is_free).tolist()

    def forget_files(self, slots: list[int]) -> None:
        """The chunk files of these slots (none live) are gone from disk."""
        self._length[slots] = 0

    def live_ops(self) -> list[Op]:
        """One put operation per live entry (the content of a snapshot)."""
        return [
            (OP_PUT, key, slot, int(self._gen[slot]), int(self._length[slot]), int(self._crc[slot]))
            for key, slot in self._key_to_slot.items()
        ]

    def unwritten_keys(self) -> list[bytes]:
        """One key per journal record still to come from this state: each pending
        operation's, and each live key's (its deletion)."""
        return [op[1] for op in self._pending] + list(self._key_to_slot)

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
