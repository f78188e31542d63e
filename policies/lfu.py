"""LFU: evict the least frequently used block; ties go to the least recently used."""

from __future__ import annotations

from .priority import PriorityPolicy


class LFU(PriorityPolicy):
    """Least frequently used, the bucket key being the hit count since insertion (1 on insert).

    A hit moves the block to the back of the next bucket, so within one frequency the bucket
    order is the order of last access: ties between equal counts evict the least recently
    used block first. Counts are forgotten when a block is removed (no aging, no history),
    as in libCacheSim's LFU, which also evicts the oldest entry of the lowest-count list.

    ``batch_insert_safe`` is False: a new block (count 1) can be the next victim when every
    older block has been hit, so evicting a run's victims up front differs from interleaving.
    """

    name = "lfu"
    initial_priority = 1

    def priority_after_hit(self, priority: int) -> int:
        return priority + 1
