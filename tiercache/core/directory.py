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

from .counts import CountError, decrement, increment

__all__ = ["TierDirectory", "CountError"]

class TierDirectory:
    """Slots of one tier.

    Invariants (``check_invariants``): ``len(slot_of) + len(reserved) + n_free == capacity``;
    every published slot maps back to its block through ``slot_block``; pins only on
    published blocks and all positive. Per-block bookkeeping is plain dict/list work (a few
    hundred nanoseconds per block); ``slot_block`` is the numpy table the data plane reads.
    """

    def __init__(self, name: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"tier {name}: capacity must be >= 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.slot_of: dict[int, int] = {}
        self.slot_block = np.zeros(capacity, dtype=np.int64)
        self.reserved: set[int] = set()
        # Free stack: lowest slots handed out first, so small runs use a dense prefix.
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self.pins: dict[int, int] = {}

    # -- queries -------------------------------------------------------------------------
    @property
    def n_free(self) -> int:
        """Slots neither published nor reserved."""
        return len(self._free)

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
        free = self._free
        if n > len(free):
            raise CountError(f"tier {self.name}: {n} slots asked, {len(free)} free")
        taken = free[len(free) - n :][::-1]
        del free[len(free) - n :]
        self.reserved.update(taken)
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

        Costs a pass over the free stack: meant for start-up, not the hot path.
        """
        wanted = set(_as_list(slots))
        if len(wanted) != len(slots) or not wanted.issubset(self._free):
            raise CountError(f"tier {self.name}: claimed slots are repeated or not free")
        self._free = [slot for slot in self._free if slot not in wanted]
        self.reserved.update(wanted)
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
        self._free.extend(slots)
        return slots

    def release(self, slots: Sequence[int]) -> None:
        """Returns reserved slots (of a failed or abandoned transfer) to the free stack."""
        slots = _as_list(slots)
        if not self.reserved.issuperset(slots):
            raise CountError(f"tier {self.name}: releasing slots that are not reserved")
        self.reserved.difference_update(slots)
        self._free.extend(slots)

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
        """Asserts the slot states, maps and counts agree."""
        free = self._free
        used = set(self.slot_of.values())
        assert len(used) == len(self.slot_of), f"{self.name}: two blocks share a slot"
        assert len(used) + len(self.reserved) + len(free) == self.capacity, f"{self.name}: slot count leak"
        assert len(set(free)) == len(free), f"{self.name}: slot freed twice"
        assert used.isdisjoint(free) and used.isdisjoint(self.reserved), f"{self.name}: slot in two states"
        assert self.reserved.isdisjoint(free), f"{self.name}: reserved slot on the free stack"
        for block_id, slot in self.slot_of.items():
            assert self.slot_block[slot] == block_id, f"{self.name}: slot {slot} does not map back to {block_id}"
        for block_id, count in self.pins.items():
            assert count > 0 and block_id in self.slot_of, f"{self.name}: bad pin on {block_id}"


def _as_list(slots: Sequence[int]) -> list[int]:
    return slots.tolist() if isinstance(slots, np.ndarray) else list(slots)
