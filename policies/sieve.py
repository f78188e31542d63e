"""SIEVE: a FIFO queue with a visited bit and a hand that sweeps from old to new."""

from __future__ import annotations

from typing import Collection, Sequence

from ._checks import enough_unprotected, require_new, require_tracked
from .base import EvictionPolicy, Hints


class Sieve(EvictionPolicy):
    """SIEVE (Zhang et al., NSDI'24), as in libCacheSim's ``Sieve``.

    New blocks enter at the head (newest end) with the visited bit clear; a hit sets the bit.
    To evict, the hand starts where it last stopped (the tail, oldest end, at first or after
    passing the head), clears set bits while moving toward the head, wrapping to the tail, and
    stops at the first clear bit. After the victim is removed the hand rests on its newer
    neighbour.

    Differences from libCacheSim: none in eviction order. Protected ids are passed over
    without clearing their bit (libCacheSim has no protection); ``victims(n)`` continues the
    sweep past earlier picks exactly as ``n`` single evictions would.

    The hand rests on the last victim until it is removed (``on_remove`` then moves it to the
    newer neighbour), so a victim that is never removed is simply offered again.

    Invariants: ``_visited`` holds the tracked ids; ``_newer``/``_older`` form one doubly
    linked list from ``_tail`` (oldest) to ``_head`` (newest) over exactly those ids; ``_hand``
    is None or a tracked id.
    """

    name = "sieve"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._visited: dict[int, bool] = {}
        self._newer: dict[int, int | None] = {}
        self._older: dict[int, int | None] = {}
        self._head: int | None = None
        self._tail: int | None = None
        self._hand: int | None = None

    def on_insert(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        require_new(self.name, ids, self._visited)
        for block_id in ids:
            self._visited[block_id] = False
            self._older[block_id] = self._head
            self._newer[block_id] = None
            if self._head is None:
                self._tail = block_id
            else:
                self._newer[self._head] = block_id
            self._head = block_id

    def on_access(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        visited = self._visited
        require_tracked(self.name, ids, visited)
        for block_id in ids:
            visited[block_id] = True

    def on_remove(self, ids: Sequence[int]) -> None:
        require_tracked(self.name, ids, self._visited, distinct=True)
        for block_id in ids:
            self._unlink(block_id)

    def victims(self, n: int, protected: Collection[int] = ()) -> list[int] | None:
        if n <= 0:
            return []
        if not enough_unprotected(self._visited, protected, n):
            return None  # checked first: the sweep below clears bits
        visited, newer = self._visited, self._newer
        chosen: list[int] = []
        picked: set[int] = set()
        node = self._hand if self._hand is not None else self._tail
        while True:
            if node not in protected and node not in picked:
                if visited[node]:
                    visited[node] = False
                else:
                    chosen.append(node)
                    if len(chosen) == n:
                        break
                    picked.add(node)
            node = newer[node]
            if node is None:
                node = self._tail
        self._hand = node
        return chosen

    def __len__(self) -> int:
        return len(self._visited)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._visited

    def _unlink(self, block_id: int) -> None:
        """Removes ``block_id`` from the list, moving the hand to its newer neighbour."""
        newer = self._newer.pop(block_id)
        older = self._older.pop(block_id)
        del self._visited[block_id]
        if self._hand == block_id:
            self._hand = newer  # None: the next sweep starts again from the tail
        if newer is None:
            self._head = older
        else:
            self._older[newer] = older
        if older is None:
            self._tail = newer
        else:
            self._newer[older] = newer

    def check_invariants(self) -> None:
        order = []
        node, prev = self._tail, None
        while node is not None:
            assert self._older[node] == prev, f"broken older link at {node}"
            order.append(node)
            assert len(order) <= len(self._visited), "cycle in the SIEVE list"
            prev, node = node, self._newer[node]
        assert prev == self._head, "head is not the newest node"
        assert set(order) == self._visited.keys() == self._newer.keys() == self._older.keys()
        assert self._hand is None or self._hand in self._visited, "hand on an untracked id"
