"""Sparse counters (pins, reader references) that fail loudly instead of going negative."""

from __future__ import annotations

from typing import Iterable

__all__ = ["CountError", "increment", "decrement", "not_decremented"]


class CountError(RuntimeError):
    """A reference or pin count would go below zero, or a slot state is misused."""


def increment(counts: dict[int, int], ids: Iterable[int]) -> None:
    """Adds one to each id's count (absent ids start at zero), in one ``dict.update``: an
    interrupt never leaves part of the ids counted."""
    new: dict[int, int] = {}
    for block_id in ids:
        new[block_id] = new.get(block_id, counts.get(block_id, 0)) + 1
    counts.update(new)


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


def not_decremented(ids: list[int], before: dict[int, int], counts: dict[int, int]) -> list[int]:
    """The entries of ``ids`` (repeats included) a ``decrement`` of ``ids`` that stopped
    part-way did not take off, given each id's count ``before`` it: what a retry still owes."""
    done = {block_id: before[block_id] - counts.get(block_id, 0) for block_id in before}
    left = []
    for block_id in ids:
        if done[block_id] > 0:
            done[block_id] -= 1
        else:
            left.append(block_id)
    return left
