"""Sparse counters (pins, reader references) that fail loudly instead of going negative."""

from __future__ import annotations

from typing import Iterable

__all__ = ["CountError", "increment", "decrement"]


class CountError(RuntimeError):
    """A reference or pin count would go below zero, or a slot state is misused."""


def increment(counts: dict[int, int], ids: Iterable[int]) -> None:
    """Adds one to each id's count (absent ids start at zero)."""
    for block_id in ids:
        counts[block_id] = counts.get(block_id, 0) + 1


def decrement(counts: dict[int, int], ids: Iterable[int], what: str) -> None:
    """Takes one from each id's count, deleting it at zero.

    Raises:
        CountError: an id's count is already zero; ``what`` names the counter in the message.
    """
    ids = list(ids)
    needed: dict[int, int] = {}
    for block_id in ids:  # check the whole batch first: a failed call changes nothing
        needed[block_id] = needed.get(block_id, 0) + 1
        if needed[block_id] > counts.get(block_id, 0):
            raise CountError(f"{what}: block {block_id} has no count to release")
    for block_id in ids:
        count = counts[block_id]
        if count == 1:
            del counts[block_id]
        else:
            counts[block_id] = count - 1
