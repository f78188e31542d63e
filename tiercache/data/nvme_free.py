"""The NVMe slot table's free slots: a numpy stack with lazy removal (issue 8 item 12).

It replaces an insertion-ordered dict of Python ints (about 65 B per free slot) with 5 B
per slot of capacity, and is built from a boolean mask in one numpy pass on reopen.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FreeSlots"]


class FreeSlots:
    """Free slots as a numpy stack, newest on top, with O(1) removal of any given slot.

    Behaves like an insertion-ordered set: ``pop`` hands out the most recently added slot
    (after ``SlotTable.finish_load``, the lowest first), ``discard`` removes any slot
    without touching the stack (the entry goes stale and is skipped when it surfaces).

    Invariants: ``is_free`` marks exactly the free slots and ``count`` is their number;
    every free slot's newest entry in ``stack[:top]`` lies above its stale ones, so the
    first entry ``pop`` meets for a free slot is its newest. Memory: 1 B (flag) + 4 B
    (int32 entry; 8 B above 2**31 slots) per slot of capacity.
    """

    def __init__(self, capacity: int, free_descending: np.ndarray) -> None:
        dtype = np.int32 if capacity < 2**31 else np.int64
        self.stack = np.empty(capacity, dtype=dtype)
        self.top = self.count = len(free_descending)
        self.stack[: self.top] = free_descending
        self.is_free = np.zeros(capacity, dtype=np.bool_)
        self.is_free[free_descending] = True

    def __contains__(self, slot: int) -> bool:
        return bool(self.is_free[slot])

    def pop(self, n: int) -> list[int]:
        """The ``n`` newest free slots, newest first (the caller checked ``count``)."""
        stack, is_free, taken = self.stack, self.is_free, []
        top = self.top
        while len(taken) < n:
            top -= 1
            slot = stack.item(top)
            if is_free[slot]:
                is_free[slot] = False
                taken.append(slot)
        self.top, self.count = top, self.count - n
        return taken

    def discard(self, slot: int) -> None:
        """Removes a free slot (its stack entry goes stale)."""
        self.is_free[slot] = False
        self.count -= 1

    def add(self, slot: int) -> None:
        """Makes a non-free slot free, newest."""
        if self.top == len(self.stack):
            self._compact()
        self.stack[self.top] = slot
        self.top += 1
        self.is_free[slot] = True
        self.count += 1

    def _compact(self) -> None:
        """Drops stale entries, keeping each free slot's newest entry, in order."""
        entries = self.stack[: self.top]
        _, newest_from_top = np.unique(entries[::-1], return_index=True)
        newest = np.sort(len(entries) - 1 - newest_from_top)
        newest = newest[self.is_free[entries[newest]]]
        self.top = len(newest)
        self.stack[: self.top] = entries[newest]

    def check(self) -> None:
        """Asserts the invariants of the class docstring."""
        entries = self.stack[: self.top]
        live = entries[self.is_free[entries]]
        assert self.count == int(self.is_free.sum()), "free count disagrees with the free flags"
        assert np.array_equal(np.unique(live), np.flatnonzero(self.is_free)), "a free slot has no stack entry"
