"""Holds of live sequences on blocks, and the holds a lost block leaves behind.

A live sequence lists the ids of its full blocks and holds each listing once: a held block
may move between tiers, never leave the hierarchy. A block does leave when its stored bytes
prove unreadable (``TransferMixin._drop_lost``); the sequences listing it still release it
once each at ``free``. Meanwhile another sequence may store the same content again: the same
key, so the same id, held anew. The holds the loss ended therefore stay counted apart, as
orphan holds of the id (``orphan_holds``, as readers' references in ``orphan_refs``), and a
release spends an id's orphan holds before its holds, so a sequence that lost a block never
releases the hold of one that stored it again.
"""

from __future__ import annotations

from typing import Sequence

from .counts import decrement, increment

__all__ = ["HoldMixin", "held_capacity", "orphans_first"]


def held_capacity(capacities: Sequence[int], write_through: bool) -> int:
    """The blocks a hierarchy of tiers of ``capacities`` can hold for live sequences (held
    blocks never leave it): every tier's, or under write-through the last tier's (every block
    has a copy there). The live cache and the step-trace replay both check holds against it."""
    return capacities[-1] if write_through else sum(capacities)


def orphans_first(ids: Sequence[int], orphans: dict[int, int]) -> tuple[list[int], list[int]]:
    """Splits releases of ``ids`` (repeats count) into those an id's orphan counts take and
    the rest, per repeat: each id spends its ``orphans`` count first, then goes to the
    live count, so an id pinned (or held) once before its loss and once after it is
    released twice in one call. Returns ``(orphaned, live)``; changes nothing."""
    if not orphans:
        return [], list(ids)
    orphaned, live, spare = [], [], {}
    for block_id in ids:
        left = spare.get(block_id, orphans.get(block_id, 0))
        if left > 0:
            spare[block_id] = left - 1
            orphaned.append(block_id)
        else:
            live.append(block_id)
    return orphaned, live


class HoldMixin:
    """Hold counting of ``TierManager`` (split out to keep modules small).

    Relies on the manager's ``held``, ``orphan_holds`` and ``locate``. Invariants: every
    count is positive and every held id is resident (``_check_holds``); for every id,
    ``held[id] + orphan_holds[id]`` is the number of live listings of it (holds taken with
    ``hold``, ``hold_listed`` or an insert with ``hold``, not given back with ``unhold`` or
    ``release_listed``: ``TieredKVCache.check_invariants`` compares them with its sequences'
    lists); and ``orphan_holds[id]`` never exceeds the listings taken before the id's last
    loss (a loss turns the holds of all listings into orphans, a listing of an absent id adds
    one, a release only ever takes one away), so ``held[id]`` covers every listing taken since:
    a block a live sequence stored or held while resident stays until that sequence frees it.
    """

    held: dict[int, int]
    orphan_holds: dict[int, int]

    def hold(self, ids: Sequence[int]) -> None:
        """Counts one more live sequence holding each resident id.

        A held block may be demoted and promoted like any other, but it never leaves the
        hierarchy: the last tier (every tier in write-through mode) never chooses it as a
        victim, a demotion that finds no room below keeps it where it is, and admission
        below never refuses it. Callers keep the held blocks within the hierarchy's
        capacity (``TieredKVCache`` checks before it stores).

        Raises:
            KeyError: an id is not resident (nothing is counted then).
        """
        for block_id in ids:
            if self.locate(block_id) is None:
                raise KeyError(f"hold of block {block_id}, which is not resident")
        increment(self.held, ids)

    def unhold(self, ids: Sequence[int]) -> None:
        """Undoes ``hold``; raises CountError below zero (never clamps)."""
        decrement(self.held, ids, "unhold")

    def hold_listed(self, ids: Sequence[int]) -> None:
        """Counts one more listing of each of ``ids`` by a live sequence: a resident id is
        held (``hold``), an absent one (lost before the listing: a fork of a sequence that
        lost a block lists it too) counts as an orphan hold, which its release spends."""
        present = [block_id for block_id in ids if self.locate(block_id) is not None]
        absent = [block_id for block_id in ids if self.locate(block_id) is None]
        increment(self.held, present)
        increment(self.orphan_holds, absent)

    def release_listed(self, ids: Sequence[int]) -> None:
        """Ends one listing of each of ``ids`` (repeats count): an id's orphan holds are spent
        first, its hold only when it has none left, so the release of a listing that a loss
        ended never takes the hold of a sequence that stored the block again. An id with
        neither (a replayed record naming a block never stored) is skipped.

        Raises:
            CountError: an id that is held is released more often than it is held and
                orphan-held (nothing is released then); a repeat past an orphan-only id's
                count is skipped, as an id with neither is.
        """
        orphans, rest = orphans_first(ids, self.orphan_holds)
        present = [block_id for block_id in rest if block_id in self.held]
        decrement(self.held, present, "unhold")  # checked whole first: one that raises releases nothing
        decrement(self.orphan_holds, orphans, "unhold")

    def hold_count(self, block_id: int) -> int:
        """The listings of ``block_id`` that are still to be released: held or orphan-held."""
        return self.held.get(block_id, 0) + self.orphan_holds.get(block_id, 0)

    def _orphan_holds(self, block_id: int) -> None:
        """A block leaving the hierarchy unreadable: its holds become orphan holds (added to
        any older ones: each listing still releases once)."""
        if block_id in self.held:
            self.orphan_holds[block_id] = self.orphan_holds.get(block_id, 0) + self.held.pop(block_id)

    def _check_holds(self) -> None:
        """Asserts the counts are positive and every held id is resident (an orphan-held id
        may be resident again: stored anew)."""
        for block_id, count in self.held.items():
            assert count > 0 and self.locate(block_id) is not None, f"bad hold on {block_id}"
        for block_id, count in self.orphan_holds.items():
            assert count > 0, f"bad orphan hold on {block_id}"
