"""Belady's MIN, evicting the block whose next use is farthest away: the offline optimum of one
tier in object semantics. In prefix semantics (it keeps blocks a request recomputes anyway) and
per tier of a hierarchy it is a reference that a policy can beat, not a bound."""

from __future__ import annotations

from typing import Collection, Sequence

from ._checks import hint_values, require_new, require_tracked
from ._heap import Entry, LazyHeap
from .base import EvictionPolicy, Hints


class Belady(EvictionPolicy):
    """Offline MIN: the victim is the tracked block used again farthest in the future.

    Every ``on_insert``/``on_access`` must carry ``Hints.next_use`` (one logical time per id,
    ``NO_NEXT_USE`` for never); otherwise ValueError. Blocks are kept in a max-heap on next
    use with lazy invalidation, so ``victims`` costs O(log n) amortized per returned id plus
    O(log n) per protected id it passes.

    Ties (only possible between blocks never used again) go to the block whose next use was
    recorded first. libCacheSim's Belady breaks such ties differently, which never changes the
    miss count (a block that is never used again costs no miss however late it is evicted).
    Like libCacheSim's, this policy always inserts on a miss; it never bypasses.

    Invariant: ``_heap`` holds exactly the tracked ids, keyed by minus their next use.
    """

    name = "belady"
    needs_future = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._heap = LazyHeap()

    def on_insert(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        require_new(self.name, ids, self._heap)
        self._record(ids, hints)

    def on_access(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        require_tracked(self.name, ids, self._heap)
        self._record(ids, hints)

    def on_remove(self, ids: Sequence[int]) -> None:
        require_tracked(self.name, ids, self._heap, distinct=True)
        for block_id in ids:
            self._heap.discard(block_id)

    def victims(self, n: int, protected: Collection[int] = ()) -> list[int] | None:
        if n <= 0:
            return []
        heap = self._heap
        taken: list[Entry] = []
        chosen: list[int] = []
        while len(chosen) < n:
            entry = heap.pop()
            if entry is None:
                break
            taken.append(entry)
            if entry[2] not in protected:
                chosen.append(entry[2])
        # Victims stay tracked until on_remove, so every popped entry goes back.
        heap.restore(taken)
        return chosen if len(chosen) == n else None

    def next_use(self, block_id: int) -> int:
        """The recorded next use of a tracked block."""
        return -self._heap.key(block_id)

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._heap

    def _record(self, ids: Sequence[int], hints: Hints | None) -> None:
        next_use = hint_values(self.name, hints, "next_use", len(ids), required=True)
        for block_id, when in zip(ids, next_use):
            self._heap.set(block_id, -when)

    def check_invariants(self) -> None:
        self._heap.check_invariants()
