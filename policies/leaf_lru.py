"""leaf_lru: radix-cache style LRU that evicts prefix-tree leaves before their parents."""

from __future__ import annotations

from ._leafprio import LeafPriorityPolicy


class LeafLRU(LeafPriorityPolicy):
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

    The tree bookkeeping and the victim walk are ``LeafPriorityPolicy``'s; a block's key is
    the tick of its last insert or access, so key order is LRU order.

    Invariants (beyond ``LeafPriorityPolicy``'s): keys are distinct ticks, the latest use's
    the largest.
    """

    name = "leaf_lru"

    def _key_after(self, block_id: int, parent: int | None, inserted: bool) -> float:
        return self._clock

    def check_invariants(self) -> None:
        super().check_invariants()
        assert len(set(self._key.values())) == len(self._key), "two blocks share a tick"
        assert all(key <= self._clock for key in self._key.values()), "a tick from the future"
