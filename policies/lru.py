"""LRU: evict the least recently used block."""

from __future__ import annotations

from ._checks import require_tracked
from .priority import PriorityPolicy


class LRU(PriorityPolicy):
    """Least recently used: one bucket, a hit moves the block to its back.

    Same eviction order as libCacheSim's LRU (exact miss-ratio match, see
    ``tests/test_policy_libcachesim.py``).
    """

    name = "lru"
    batch_insert_safe = True  # new blocks are the most recent, so they are evicted last

    def priority_after_hit(self, priority: int) -> int:
        return priority

    def on_access(self, ids, hints=None) -> None:
        """Moves each id to the back of the single bucket (the generic walk, without the
        per-id ``priority_after_hit`` call: this is the replay's hottest loop)."""
        require_tracked(self.name, ids, self._priority)
        if ids:
            move = self._buckets[self.initial_priority].move_to_end
            for block_id in ids:
                move(block_id)
