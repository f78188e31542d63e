"""FIFO: evict the block inserted first; hits change nothing."""

from __future__ import annotations

from .priority import PriorityPolicy


class FIFO(PriorityPolicy):
    """First in, first out: one bucket in insertion order; hits leave blocks in place.

    Same eviction order as libCacheSim's FIFO (exact miss-ratio match).
    """

    name = "fifo"
    batch_insert_safe = True  # new blocks are the newest inserts, so they are evicted last

    def priority_after_hit(self, priority: int) -> None:
        return None
