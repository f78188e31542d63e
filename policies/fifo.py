"""FIFO: evict the block inserted first; hits change nothing."""

from __future__ import annotations

from ._checks import require_tracked
from .priority import PriorityPolicy


class FIFO(PriorityPolicy):
    """First in, first out: one bucket in insertion order; hits leave blocks in place.

    Same eviction order as libCacheSim's FIFO (exact miss-ratio match).
    """

    name = "fifo"
    batch_insert_safe = True  # new blocks are the newest inserts, so they are evicted last

    def priority_after_hit(self, priority: int) -> None:
        return None

    def on_access(self, ids, hints=None) -> None:
        """Hits leave FIFO order unchanged; only the ids are checked."""
        require_tracked(self.name, ids, self._priority)
