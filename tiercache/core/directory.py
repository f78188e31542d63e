"""Per-tier slot directory: which block sits in which preallocated slot.

Metadata plane only (numpy, ints). A slot is in one of three states:

* free: on the free stack;
* reserved: taken by an in-flight transfer, not visible to lookups;
* published: holds block ``slot_block[slot]`` and ``slot_of[block] == slot``.

Pins count in-flight transfers reading a published slot; they never go below zero (that
raises) and a pinned block is never a victim.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

__all__ = ["TierDirectory", "CountError"]

_FREE, _RESERVED, _PUBLISHED = 0, 1, 2


class CountError(RuntimeError):
    """A reference or pin count would go below zero, or a slot state is misused."""


class TierDirectory:
    """Slots of one tier.

    Invariants (``check_invariants``): ``len(slot_of) + reserved + free == capacity``; every
    published slot maps back to its block; pins only on published blocks and all positive.
    """

    def __init__(self, name: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"tier {name}: capacity must be >= 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.slot_of: dict[int, int] = {}
        self.slot_block = np.zeros(capacity, dtype=np.int64)
        self.state = np.zeros(capacity, dtype=np.int8)
        # Free stack: lowest slots handed out first, so small runs use a dense prefix.
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self._n_free = capacity
        self.pins: dict[int, int] = {}

    # -- queries -------------------------------------------------------------------------
    @property
    def n_free(self) -> int:
        """Slots neither published nor reserved."""
        return self._n_free

    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.slot_of

    def slots(self, ids: Sequence[int]) -> np.ndarray:
        """Slots of published ids, in order; raises KeyError for an absent id."""
        slot_of = self.slot_of
        return np.fromiter((slot_of[i] for i in ids), dtype=np.int64, count=len(ids))

    # -- slot lifecycle ------------------------------------------------------------------
    def reserve(self, n: int) -> np.ndarray:
        """Takes ``n`` free slots (reserved, invisible to lookups); raises if too few."""
        if n > self._n_free:
            raise CountError(f"tier {self.name}: {n} slots asked, {self._n_free} free")
        top = self._n_free
        taken = self._free[top - n : top][::-1].copy()
        self._n_free = top - n
        self.state[taken] = _RESERVED
        return taken

    def publish(self, ids: Sequence[int], slots: np.ndarray) -> None:
        """Makes reserved ``slots`` hold ``ids``; each id must be absent from this tier."""
        if len(ids) != len(slots):
            raise ValueError(f"tier {self.name}: {len(ids)} ids for {len(slots)} slots")
        if not np.all(self.state[slots] == _RESERVED):
            raise CountError(f"tier {self.name}: publishing slots that are not reserved")
        slot_of = self.slot_of
        for block_id, slot in zip(ids, slots.tolist()):
            if block_id in slot_of:
                raise KeyError(f"tier {self.name}: block {block_id} is already present")
            slot_of[block_id] = slot
        self.slot_block[slots] = ids
        self.state[slots] = _PUBLISHED

    def insert(self, ids: Sequence[int]) -> np.ndarray:
        """Reserves and publishes slots for new ids at once; returns their slots."""
        slots = self.reserve(len(ids))
        self.publish(ids, slots)
        return slots

    def remove(self, ids: Sequence[int]) -> np.ndarray:
        """Unpublishes unpinned ids and frees their slots; returns the freed slots."""
        slot_of, pins = self.slot_of, self.pins
        for block_id in ids:
            if block_id in pins:
                raise CountError(f"tier {self.name}: block {block_id} is pinned by a transfer")
        slots = np.fromiter((slot_of.pop(i) for i in ids), dtype=np.int64, count=len(ids))
        self.release(slots, _PUBLISHED)
        return slots

    def release(self, slots: np.ndarray, expected_state: int = _RESERVED) -> None:
        """Returns slots in ``expected_state`` (reserved by default) to the free stack."""
        if not np.all(self.state[slots] == expected_state):
            raise CountError(f"tier {self.name}: releasing slots in the wrong state")
        n = len(slots)
        self.state[slots] = _FREE
        self._free[self._n_free : self._n_free + n] = slots
        self._n_free += n

    # -- pins ----------------------------------------------------------------------------
    def pin(self, ids: Iterable[int]) -> None:
        """Counts one more in-flight transfer reading each published id."""
        pins, slot_of = self.pins, self.slot_of
        for block_id in ids:
            if block_id not in slot_of:
                raise KeyError(f"tier {self.name}: cannot pin absent block {block_id}")
            pins[block_id] = pins.get(block_id, 0) + 1

    def unpin(self, ids: Iterable[int]) -> None:
        """Undoes ``pin``; raises CountError below zero (never clamps)."""
        pins = self.pins
        for block_id in ids:
            count = pins.get(block_id, 0)
            if count <= 0:
                raise CountError(f"tier {self.name}: unpin of block {block_id} that is not pinned")
            if count == 1:
                del pins[block_id]
            else:
                pins[block_id] = count - 1

    # -- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Asserts the slot states, maps and counts agree."""
        published = np.flatnonzero(self.state == _PUBLISHED)
        reserved = int(np.count_nonzero(self.state == _RESERVED))
        assert len(published) == len(self.slot_of), f"{self.name}: published slots != map size"
        assert len(published) + reserved + self._n_free == self.capacity, f"{self.name}: slot count leak"
        free = self._free[: self._n_free]
        assert len(np.unique(free)) == len(free), f"{self.name}: slot freed twice"
        assert np.all(self.state[free] == _FREE), f"{self.name}: free stack holds a used slot"
        for block_id, slot in self.slot_of.items():
            assert self.slot_block[slot] == block_id, f"{self.name}: slot {slot} does not map back to {block_id}"
        for block_id, count in self.pins.items():
            assert count > 0 and block_id in self.slot_of, f"{self.name}: bad pin on {block_id}"
