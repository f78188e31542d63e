"""FIFO: evict the block inserted first; hits change nothing."""

from __future__ import annotations

from collections import OrderedDict
from typing import Collection, Sequence

from .base import EvictionPolicy, Hints


class FIFO(EvictionPolicy):
    """First in, first out.

    Invariant: ``_order`` holds every tracked id once, oldest insert first.
    """

    name = "fifo"
    batch_insert_safe = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[int, None] = OrderedDict()

    def on_insert(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        order = self._order
        for block_id in ids:
            if block_id in order:
                raise KeyError(f"fifo: block {block_id} inserted twice")
            order[block_id] = None

    def on_access(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        order = self._order
        for block_id in ids:
            if block_id not in order:
                raise KeyError(f"fifo: access to untracked block {block_id}")

    def on_remove(self, ids: Sequence[int]) -> None:
        order = self._order
        for block_id in ids:
            del order[block_id]

    def victims(self, n: int, protected: Collection[int] = ()) -> list[int] | None:
        if n <= 0:
            return []
        chosen = []
        for block_id in self._order:
            if block_id not in protected:
                chosen.append(block_id)
                if len(chosen) == n:
                    return chosen
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._order
