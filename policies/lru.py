"""LRU: evict the least recently used block."""

from __future__ import annotations

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
