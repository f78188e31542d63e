"""Per-tier slot directory: which block sits in which preallocated slot.

Metadata plane only (numpy, ints). A slot is in one of three states:

* free: on the free stack;
* reserved: taken by an in-flight transfer, not visible to lookups;
* published: holds block ``slot_block[slot]`` and ``slot_of[block] == slot``.

Pins count in-flight transfers reading a published slot; they never go below zero (that
raises) and a pinned block is never a victim.

Memory (issue 8 item 12): at most ``SLOT_BYTES`` = 16 B per slot of capacity, refused up
front when that is more than the memory available: ``slot_block`` (int64, 8 B) and the
freed part of the free stack (int64, grown on demand, 8 B at most; never-used slots cost
nothing, so a new directory costs 8 B per slot); the free stack's top ``SPILL_SLOTS``
entries may sit in a list (~160 KB at most). Per resident block, ``slot_of`` adds a dict entry and the slot's int object
(about 70 B); ``reserved`` and ``pins`` hold only blocks in flight.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import psutil

from ..errors import UserError
from .counts import CountError, decrement, increment

__all__ = ["TierDirectory", "CountError", "SLOT_BYTES"]

SLOT_BYTES = 16  # most per slot of capacity: slot_block (int64) + freed slots (int64)
SPILL_SLOTS = 4096  # most free slots kept as a Python list on top of the numpy stack (~160 KB)


class TierDirectory:
    """Slots of one tier.

    Invariants (``check_invariants``): ``len(slot_of) + len(reserved) + n_free == capacity``;
    the free stack ``capacity - 1 .. _fresh`` + ``_stack[:_top]`` + ``_spill`` holds each
    free slot once, ``n_free`` in all (its last entry is handed out first; a new directory
    hands out slots 0, 1, 2, ... in order; ``_spill`` never holds more than ``SPILL_SLOTS``);
    every published slot maps back to its block through ``slot_block``; pins only on
    published blocks and all positive. Per-block bookkeeping is plain dict work plus O(1) stack moves; ``slot_block``
    is the numpy table the data plane reads.
    """

    def __init__(self, name: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"tier {name}: capacity must be >= 1, got {capacity}")
        check_fits(name, capacity)
        self.name = name
        self.capacity = capacity
        self.slot_of: dict[int, int] = {}
        self.slot_block = np.zeros(capacity, dtype=np.int64)
        self.reserved: set[int] = set()
        # Free stack, top at the end: lowest slots handed out first, so small runs use a dense
        # prefix. Bottom to top: the never-used slots ``capacity - 1 .. _fresh`` (implicit),
        # the freed slots ``_stack[:_top]`` (numpy, grown on demand up to ``capacity``) and
        # ``_spill``, a short list that keeps one-at-a-time frees and takes list-fast.
        self._fresh = 0
        self._stack = np.empty(0, dtype=np.int64)
        self._top = 0
        self._spill: list[int] = []
        self.n_free = capacity  # slots neither published nor reserved (see check_invariants)
        self.pins: dict[int, int] = {}

    # -- queries -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.slot_of

    def slots(self, ids: Sequence[int]) -> np.ndarray:
        """Slots of published ids, in order; raises KeyError for an absent id."""
        slot_of = self.slot_of
        return np.fromiter((slot_of[i] for i in ids), dtype=np.int64, count=len(ids))

    # -- slot lifecycle ------------------------------------------------------------------
    def reserve(self, n: int) -> list[int]:
        """Takes ``n`` free slots (reserved, invisible to lookups); raises if too few."""
        spill = self._spill
        if n <= len(spill):
            taken = spill[len(spill) - n :][::-1]
            del spill[len(spill) - n :]
        else:
            taken = self._take_deep(n)
        self.n_free -= n
        self.reserved.update(taken)
        return taken

    def _take_deep(self, n: int) -> list[int]:
        """The top ``n`` free slots, top first, when they reach below the spill list."""
        if n > self.n_free:
            raise CountError(f"tier {self.name}: {n} slots asked, {self.n_free} free")
        spill, top = self._spill, self._top
        taken = spill[::-1]
        spill.clear()
        k = min(n - len(taken), top)
        taken += self._stack[top - k : top][::-1].tolist()
        self._top = top - k
        fresh = self._fresh
        self._fresh = fresh + n - len(taken)
        taken.extend(range(fresh, self._fresh))
        return taken

    def publish(self, ids: Sequence[int], slots: Sequence[int]) -> None:
        """Makes reserved ``slots`` hold ``ids``; each id must be absent from this tier."""
        if len(ids) != len(slots):
            raise ValueError(f"tier {self.name}: {len(ids)} ids for {len(slots)} slots")
        slot_of, reserved = self.slot_of, self.reserved
        slots = _as_list(slots)
        if not reserved.issuperset(slots):
            raise CountError(f"tier {self.name}: publishing slots that are not reserved")
        for block_id in ids:
            if block_id in slot_of:
                raise KeyError(f"tier {self.name}: block {block_id} is already present")
        reserved.difference_update(slots)
        slot_of.update(zip(ids, slots))
        self.slot_block[slots] = ids

    def insert(self, ids: Sequence[int]) -> list[int]:
        """Reserves and publishes slots for new ids at once; returns their slots."""
        slots = self.reserve(len(ids))
        self.publish(ids, slots)
        return slots

    def claim(self, ids: Sequence[int], slots: Sequence[int]) -> None:
        """Publishes ``ids`` in the given free ``slots`` (adopting stored blocks on reopen).

        Costs a pass over the free slots below the highest claimed one: meant for
        start-up, not the hot path. The other free slots keep their order.
        """
        wanted = np.asarray(_as_list(slots), dtype=np.int64)
        self._sink()
        highest = min(self.capacity - 1, int(wanted.max(initial=-1)))
        low = np.arange(self._fresh, max(self._fresh, highest + 1), dtype=np.int64)
        free = np.concatenate([low[::-1], self._stack[: self._top]])
        keep = ~np.isin(free, wanted)
        if len(np.unique(wanted)) != len(wanted) or len(free) - int(keep.sum()) != len(wanted):
            raise CountError(f"tier {self.name}: claimed slots are repeated or not free")
        self._fresh += len(low)
        self._stack, self._top = free[keep], int(keep.sum())
        self.n_free -= len(wanted)
        self.reserved.update(wanted.tolist())
        self.publish(ids, slots)

    def remove(self, ids: Sequence[int]) -> list[int]:
        """Unpublishes unpinned ids and frees their slots; returns the freed slots."""
        slot_of, pins = self.slot_of, self.pins
        for block_id in ids:
            if block_id in pins:
                raise CountError(f"tier {self.name}: block {block_id} is pinned by a transfer")
            if block_id not in slot_of:
                raise KeyError(f"tier {self.name}: block {block_id} is not present")
        slots = [slot_of.pop(block_id) for block_id in ids]
        spill = self._spill
        spill.extend(slots)
        self.n_free += len(slots)
        if len(spill) > SPILL_SLOTS:
            self._sink()
        return slots

    def release(self, slots: Sequence[int]) -> None:
        """Returns reserved slots (of a failed or abandoned transfer) to the free stack."""
        slots = _as_list(slots)
        if not self.reserved.issuperset(slots):
            raise CountError(f"tier {self.name}: releasing slots that are not reserved")
        self.reserved.difference_update(slots)
        self._spill.extend(slots)
        self.n_free += len(slots)
        if len(self._spill) > SPILL_SLOTS:
            self._sink()

    def _sink(self) -> None:
        """Moves the spill list into the numpy stack, keeping the stack order."""
        top, spill = self._top, self._spill
        if top + len(spill) > len(self._stack):
            grown = np.empty(min(self.capacity, max(2 * len(self._stack), top + len(spill))), dtype=np.int64)
            grown[:top] = self._stack[:top]
            self._stack = grown
        self._stack[top : top + len(spill)] = spill
        self._top = top + len(spill)
        spill.clear()

    # -- pins ----------------------------------------------------------------------------
    def pin(self, ids: Iterable[int]) -> None:
        """Counts one more in-flight transfer reading each published id."""
        ids = list(ids)
        for block_id in ids:
            if block_id not in self.slot_of:
                raise KeyError(f"tier {self.name}: cannot pin absent block {block_id}")
        increment(self.pins, ids)

    def unpin(self, ids: Iterable[int]) -> None:
        """Undoes ``pin``; raises CountError below zero (never clamps)."""
        decrement(self.pins, ids, f"tier {self.name} unpin")

    # -- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Asserts the slot states, maps and counts agree (numpy passes over the slots handed
        out so far, ``_fresh`` of them: the never-used ``_fresh .. capacity - 1`` are checked
        by their count, so a huge tier holding a few blocks checks in O(blocks))."""
        fresh = self._fresh
        free = np.concatenate([self._stack[: self._top], np.asarray(self._spill, dtype=np.int64)])
        used = np.fromiter(self.slot_of.values(), dtype=np.int64, count=len(self.slot_of))
        reserved = np.fromiter(self.reserved, dtype=np.int64, count=len(self.reserved))
        assert 0 <= fresh <= self.capacity, f"{self.name}: never-used slots out of range"
        assert self.n_free == self.capacity - fresh + len(free), f"{self.name}: free count disagrees with the stack"
        assert 0 <= self._top <= len(self._stack) <= self.capacity and len(self._spill) <= SPILL_SLOTS, \
            f"{self.name}: free stack overflows"
        handed_out = np.concatenate([used, reserved, free])  # each slot below fresh once, none above
        assert len(handed_out) == fresh, f"{self.name}: slot count leak"
        assert ((handed_out >= 0) & (handed_out < fresh)).all(), f"{self.name}: slot out of range"
        assert (np.bincount(handed_out, minlength=fresh) == 1).all(), \
            f"{self.name}: slot in two states, shared or freed twice"
        ids = np.fromiter(self.slot_of.keys(), dtype=np.int64, count=len(self.slot_of))
        assert (self.slot_block[used] == ids).all(), f"{self.name}: a slot does not map back to its block"
        for block_id, count in self.pins.items():
            assert count > 0 and block_id in self.slot_of, f"{self.name}: bad pin on {block_id}"


def check_fits(name: str, capacity: int) -> None:
    """Refuses a capacity whose directory (``SLOT_BYTES`` per slot) exceeds available memory.

    Raises:
        UserError: naming the bytes needed and the bytes available.
    """
    need = capacity * SLOT_BYTES
    if need > 1 << 30:  # below 1 GiB asking the OS costs more than it protects
        available = psutil.virtual_memory().available
        if need > available:
            raise UserError(f"tier {name}: a directory of {capacity:,} slots needs {need:,} bytes "
                            f"({SLOT_BYTES} B per slot); only {available:,} bytes are available")

def _as_list(slots: Sequence[int]) -> list[int]:
    return slots.tolist() if isinstance(slots, np.ndarray) else list(slots)
