"""leaf_lru: radix-cache style LRU that evicts prefix-tree leaves before their parents."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Collection, Sequence

from ._checks import hint_values, require_new, require_tracked
from ._heap import Entry, LazyHeap
from .base import EvictionPolicy, Hints


class LeafLRU(EvictionPolicy):
    """Evicts leaves of the prefix tree first, least recently used leaf first.

    KV blocks form a prefix tree: a block is only useful while its parent (the previous block
    of the same prefix) is cached, so evicting a parent before its children strands them.
    Like SGLang's radix cache, only blocks none of whose children are tracked are candidates;
    when a leaf is removed its parent may become a leaf. ``victims(n)`` follows that cascade
    within one call (after picking a leaf it may pick the parent it exposes). When fewer than
    ``n`` unprotected leaves exist (e.g. every child of a parent is protected) the rest is
    taken in plain LRU order, so ``victims`` succeeds whenever ``n`` unprotected ids exist.

    Parents come from ``Hints.parents`` on ``on_insert`` (``None`` for a root); without that
    hint every block is a root and the policy is plain LRU. A parent need not be tracked, nor
    inserted before its children: children are counted per parent id either way. There is no
    libCacheSim counterpart.

    ``batch_insert_safe`` is False: inserting a child turns its parent from a leaf into an
    inner node, so victims chosen before a run of inserts can differ from interleaved ones.

    Invariants: ``_order`` holds the tracked ids, least recent first, and ``_tick`` their
    last-use ticks, increasing along ``_order``; ``_parent`` maps each tracked id to its parent;
    ``_children[p]`` counts the tracked ids whose parent is ``p`` (no zero entries);
    ``_leaves`` holds exactly the tracked ids with no tracked child, keyed by tick.
    """

    name = "leaf_lru"
    needs_parents = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[int, None] = OrderedDict()
        self._tick: dict[int, int] = {}
        self._parent: dict[int, int | None] = {}
        self._children: dict[int, int] = {}
        self._leaves = LazyHeap()
        self._clock = 0

    def on_insert(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        require_new(self.name, ids, self._tick)
        parents = hint_values(self.name, hints, "parents", len(ids), required=False)
        if parents is None:
            parents = [None] * len(ids)
        elif any(p == b for b, p in zip(ids, parents)):
            raise ValueError(f"{self.name}: a block cannot be its own parent")
        for block_id, parent in zip(ids, parents):
            self._touch(block_id)
            self._parent[block_id] = parent
            if parent is not None:
                self._add_child(parent)
            if block_id not in self._children:
                self._leaves.set(block_id, self._tick[block_id])

    def on_access(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        require_tracked(self.name, ids, self._tick)
        for block_id in ids:
            self._touch(block_id)
            if block_id in self._leaves:
                self._leaves.set(block_id, self._tick[block_id])

    def on_remove(self, ids: Sequence[int]) -> None:
        require_tracked(self.name, ids, self._tick, distinct=True)
        for block_id in ids:
            del self._order[block_id]
            del self._tick[block_id]
            self._leaves.discard(block_id)
            parent = self._parent.pop(block_id)
            if parent is not None:
                self._drop_child(parent)

    def victims(self, n: int, protected: Collection[int] = ()) -> list[int] | None:
        if n <= 0:
            return []
        chosen = self._leaf_victims(n, protected)
        if len(chosen) < n:
            picked = set(chosen)
            for block_id in self._order:  # fallback: plain LRU over what is left
                if block_id not in protected and block_id not in picked:
                    chosen.append(block_id)
                    if len(chosen) == n:
                        break
        return chosen if len(chosen) == n else None

    def __len__(self) -> int:
        return len(self._tick)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._tick

    def _leaf_victims(self, n: int, protected: Collection[int]) -> list[int]:
        """Up to ``n`` unprotected leaves in LRU order, including parents exposed on the way.

        Leaves taken from the heap are pushed back (victims stay tracked until on_remove);
        ``exposed`` is a private heap of parents whose tracked children were all picked.
        """
        taken: list[Entry] = []
        exposed: list[tuple[int, int]] = []
        freed: dict[int, int] = {}
        chosen: list[int] = []
        while len(chosen) < n:
            top = self._leaves.peek()
            if top is not None and (not exposed or top[0] < exposed[0][0]):
                taken.append(self._leaves.pop())
                block_id = top[2]
            elif exposed:
                block_id = heapq.heappop(exposed)[1]
            else:
                break
            if block_id in protected:
                continue
            chosen.append(block_id)
            parent = self._parent[block_id]
            if parent is not None and parent in self._tick:
                freed[parent] = freed.get(parent, 0) + 1
                if freed[parent] == self._children[parent]:
                    heapq.heappush(exposed, (self._tick[parent], parent))
        self._leaves.restore(taken)
        return chosen

    def _touch(self, block_id: int) -> None:
        """Makes ``block_id`` the most recently used id."""
        self._clock += 1
        self._tick[block_id] = self._clock
        self._order[block_id] = None
        self._order.move_to_end(block_id)

    def _add_child(self, parent: int) -> None:
        count = self._children.get(parent, 0) + 1
        self._children[parent] = count
        if count == 1:
            self._leaves.discard(parent)  # a tracked parent stops being a leaf

    def _drop_child(self, parent: int) -> None:
        count = self._children[parent] - 1
        if count:
            self._children[parent] = count
            return
        del self._children[parent]
        if parent in self._tick:
            self._leaves.set(parent, self._tick[parent])  # the parent is a leaf again

    def check_invariants(self) -> None:
        assert self._order.keys() == self._tick.keys(), "recency order != tracked ids"
        ticks = [self._tick[b] for b in self._order]
        assert ticks == sorted(ticks), "ticks not increasing along the LRU order"
        assert self._parent.keys() == self._tick.keys(), "parent map != tracked ids"
        counts: dict[int, int] = {}
        for parent in self._parent.values():
            if parent is not None:
                counts[parent] = counts.get(parent, 0) + 1
        assert counts == self._children, "child counts out of date"
        self._leaves.check_invariants()
        leaves = {b for b in self._tick if b not in self._children}
        assert self._leaves.ids() == leaves, "leaf heap != leaves"
        assert all(self._leaves.key(b) == self._tick[b] for b in leaves), "stale leaf key"
