"""Shared driver for prefix-tree policies that evict the lowest-keyed *leaf* first.

KV blocks form a prefix tree: a block can only serve a prefix hit while its parent is cached,
so evicting an inner block strands its descendants (they take space and serve nothing until
the parent is recomputed). :class:`LeafPriorityPolicy` keeps the prefix tree of the tracked
blocks (parents from ``Hints.parents``) and offers only leaves -- blocks none of whose children
is tracked -- as victims, lowest key first, as SGLang's radix cache does with recency. A
subclass only says what a block's key is after an insert or an access (``_key_after``); the
driver does the tree bookkeeping, the validation and the victim walk once for all of them.

``victims(n)`` follows the leaf cascade inside one call (after picking every tracked child of a
parent, that parent becomes a candidate with its own key). When fewer than ``n`` unprotected
leaves exist (every child of a parent is protected) the rest is taken in plain key order over
all tracked blocks, so ``victims`` succeeds whenever ``n`` unprotected ids exist.
"""

from __future__ import annotations

import heapq
from typing import Collection, Container, Sequence

from ._checks import hint_values, require_new, require_tracked
from ._heap import Entry, LazyHeap
from .base import EvictionPolicy, Hints


class LeafPriorityPolicy(EvictionPolicy):
    """Leaves of the prefix tree, lowest key first; keys come from ``_key_after``.

    ``batch_insert_safe`` is False: inserting a child turns its parent from a leaf into an
    inner node, so victims chosen before a run of inserts can differ from interleaved ones.

    Invariants: ``_key`` maps every tracked id to its key; ``_parent`` maps each
    tracked id to its parent (None for a root); ``_children[p]`` counts tracked ids whose
    parent is ``p`` (no zero entries); ``_leaves`` holds exactly the tracked ids with no
    tracked child, with the same keys as ``_key``.
    """

    needs_parents = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._key: dict[int, float] = {}
        self._parent: dict[int, int | None] = {}
        self._children: dict[int, int] = {}
        self._leaves = LazyHeap()
        self._clock = 0

    # -- what a subclass provides ----------------------------------------------------------
    def _key_after(self, block_id: int, parent: int | None, inserted: bool) -> float:
        """The key of ``block_id`` after an insert (``inserted``) or an access at ``_clock``.

        Lower keys are evicted first. Called once per id per hook, after the clock advanced.
        """
        raise NotImplementedError

    def _forget(self, block_id: int) -> None:
        """Called when ``block_id`` stops being tracked (a subclass may keep a ghost)."""

    # -- the eviction contract --------------------------------------------------------------
    def on_insert(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        require_new(self.name, ids, self._parent)
        parents = hint_values(self.name, hints, "parents", len(ids), required=False)
        if parents is None:
            parents = [None] * len(ids)
        elif any(p == b for b, p in zip(ids, parents)):
            raise ValueError(f"{self.name}: a block cannot be its own parent")
        for block_id, parent in zip(ids, parents):
            self._clock += 1
            self._parent[block_id] = parent
            if parent is not None:
                self._add_child(parent)
            self._set_key(block_id, self._key_after(block_id, parent, True))

    def on_access(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        require_tracked(self.name, ids, self._parent)
        for block_id in ids:
            self._clock += 1
            self._set_key(block_id, self._key_after(block_id, self._parent[block_id], False))

    def on_remove(self, ids: Sequence[int]) -> None:
        require_tracked(self.name, ids, self._parent, distinct=True)
        for block_id in ids:
            del self._key[block_id]
            self._leaves.discard(block_id)
            parent = self._parent.pop(block_id)
            if parent is not None:
                self._drop_child(parent)
            self._forget(block_id)

    def victims(self, n: int, protected: Collection[int] = ()) -> list[int] | None:
        if n <= 0:
            return []
        chosen = self._leaf_victims(n, protected)
        if len(chosen) < n:
            chosen.extend(self._key_order_victims(n - len(chosen), protected, set(chosen)))
        return chosen if len(chosen) == n else None

    def __len__(self) -> int:
        return len(self._parent)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._parent

    # -- internals ---------------------------------------------------------------------------
    def _set_key(self, block_id: int, key: float) -> None:
        self._key[block_id] = key
        if block_id not in self._children:
            self._leaves.set(block_id, key)

    def _leaf_victims(self, n: int, protected: Collection[int], avoid: Container[int] | None = None,
                      budget: int = 0) -> list[int]:
        """Up to ``n`` unprotected leaves by key, including parents exposed on the way.

        With ``avoid``, candidates in it are passed over, at most ``budget`` of them: the pass
        stops (short) at the ``budget``-th, so the caller can fall back to plain key order.
        Entries taken from the heap are pushed back (victims stay tracked until on_remove);
        ``exposed`` is a private heap of parents whose tracked children were all picked.
        """
        taken: list[Entry] = []
        exposed: list[tuple[float, int]] = []
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
            if avoid is not None and block_id in avoid:
                budget -= 1
                if budget <= 0:
                    break
                continue
            chosen.append(block_id)
            parent = self._parent[block_id]
            if parent is not None and parent in self._parent:
                freed[parent] = freed.get(parent, 0) + 1
                if freed[parent] == self._children[parent]:
                    heapq.heappush(exposed, (self._key[parent], parent))
        self._leaves.restore(taken)
        return chosen

    def _key_order_victims(self, n: int, protected: Collection[int], picked: set[int]) -> list[int]:
        """Fallback: up to ``n`` unprotected, unpicked ids in key order over all tracked ids.

        Only reached when protected ids hide leaves (a hierarchy's in-flight or referenced
        blocks), so a sort over the tracked ids is cheaper overall than a second heap.
        """
        ordered = sorted((key, block_id) for block_id, key in self._key.items()
                         if block_id not in protected and block_id not in picked)
        return [block_id for _, block_id in ordered[:n]]

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
        if parent in self._parent:
            self._leaves.set(parent, self._key[parent])  # the parent is a leaf again

    def check_invariants(self) -> None:
        assert self._key.keys() == self._parent.keys(), "keys != tracked ids"
        counts: dict[int, int] = {}
        for parent in self._parent.values():
            if parent is not None:
                counts[parent] = counts.get(parent, 0) + 1
        assert counts == self._children, "child counts out of date"
        self._leaves.check_invariants()
        leaves = {b for b in self._parent if b not in self._children}
        assert self._leaves.ids() == leaves, "leaf heap != leaves"
        assert all(self._leaves.key(b) == self._key[b] for b in leaves), "stale leaf key"
