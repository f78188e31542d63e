"""Small helpers of the tier manager: protection sets and hint slicing.

``Guard`` and ``HeldWithoutCopy`` are the read-only sets ``_make_room`` passes to an
eviction policy as ``protected`` (pinned, referenced, held blocks); they test membership
without building a union. The hint helpers cut a request's ``Hints`` down to the ids a
plan carries (hints are aligned with the ids they came with); ``chain_parents`` and
``request_hints`` give a request's ids their prefix-tree parents, one rule for the replay and
the live store alike.
"""

from __future__ import annotations

import operator
from typing import Sequence

from tiercache.policies.base import Hints

__all__ = ["Either", "Guard", "HeldWithoutCopy", "slice_hints", "distinct_prefix", "pick_hints", "chain_parents",
           "request_hints", "parent_map"]

_NOTHING: frozenset = frozenset()


class Guard:
    """Ids that may not be victims: pinned in the tier, referenced, explicitly protected, or
    (in the last tier only) held by a live sequence."""

    __slots__ = ("pins", "refs", "extra", "held")

    def __init__(self, pins: dict, refs: dict, extra, held=_NOTHING) -> None:
        self.pins, self.refs, self.extra, self.held = pins, refs, extra, held

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.pins or block_id in self.refs or block_id in self.extra or block_id in self.held

    def __bool__(self) -> bool:
        return bool(self.pins or self.refs or self.extra or self.held)

    def _union(self) -> set[int]:
        return set(self.pins).union(self.refs, self.extra, self.held)

    def __iter__(self):
        # Policies count protected ids they track; all three sets are small (in-flight,
        # referenced, the current run), so materialising the union is cheap.
        return iter(self._union())

    def __len__(self) -> int:
        return len(self._union())


class Either:
    """Ids in ``first`` or ``second`` (a call's kept ids or held ones), without building their
    union for a membership test: a decode's held blocks may number millions."""

    __slots__ = ("first", "second")

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.first or block_id in self.second

    def __bool__(self) -> bool:
        return bool(self.first or self.second)

    def __iter__(self):
        yield from self.first
        yield from (b for b in self.second if b not in self.first)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class HeldWithoutCopy:
    """Held ids that no lower tier holds a copy of (write-through: dropping one of those
    from an upper tier would take it out of the hierarchy)."""

    __slots__ = ("held", "below")

    def __init__(self, held: dict, below: list) -> None:
        self.held, self.below = held, below

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.held and not any(block_id in slots for slots in self.below)

    def __bool__(self) -> bool:
        return bool(self.held)

    def __iter__(self):
        return (b for b in self.held if b in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def slice_hints(hints: Hints | None, a: int, b: int) -> Hints | None:
    """The hints of ids[a:b] (hints are aligned with the ids they came with; ``time`` is that
    of ids[a], as an out-of-tree policy may read it)."""
    if hints is None or (a == 0 and hints.next_use is None and hints.parents is None):
        return hints  # nothing to cut, and the slice starts at the batch's time: as it is
    next_use = None if hints.next_use is None else hints.next_use[a:b]
    parents = None if hints.parents is None else hints.parents[a:b]
    return Hints(hints.time + a, next_use, parents)


def distinct_prefix(ids: Sequence[int], a: int, b: int) -> int:
    """Length of the longest prefix of ids[a:b] without a repeated id.

    A repeated id inside a run of misses would be a hit the second time; cutting the run
    there keeps batching exactly equal to one-at-a-time handling.
    """
    run = ids[a:b]
    if len(set(run)) == len(run):
        return len(run)
    seen: set[int] = set()
    for offset, block_id in enumerate(run):
        if block_id in seen:
            return offset
        seen.add(block_id)
    return len(run)


def pick_hints(hints: Hints, positions: list[int]) -> Hints:
    """Hints of the ids at ``positions``."""
    next_use = None if hints.next_use is None else [hints.next_use[p] for p in positions]
    parents = None if hints.parents is None else [hints.parents[p] for p in positions]
    return Hints(hints.time, next_use, parents)


def chain_parents(ids: Sequence[int], first: int | None = None) -> list[int | None]:
    """Each id's parent when ``ids`` are blocks of one prefix in order: the id before it
    (``first`` for the first: the block the chain continues, None at a root), and None for an
    id equal to the one before it (traces whose ids do not chain the prefix repeat a block:
    a block is never its own parent)."""
    if not len(ids):
        return []
    parents = [first, *ids[:-1]]
    if any(map(operator.eq, parents, ids)):  # C-level check; the fix is rare
        parents = [None if p == i else p for p, i in zip(parents, ids)]
    return parents


def request_hints(policies: Sequence, ids: Sequence[int]) -> Hints | None:
    """The hints of one request's ids read in order (``TierManager.access``), as a replay in
    object semantics gives them: each id's parent (``chain_parents``) when a tier's eviction
    policy reads parents (``needs_parents``), else None (nothing to build)."""
    if not any(policy.needs_parents for policy in policies):
        return None
    return Hints(parents=chain_parents(ids))


def parent_map(policies: Sequence, ids: Sequence[int | None]) -> dict[int, int | None] | None:
    """Each id's parent when ``ids`` are one request (``request_hints``), by id (a None id,
    a key that collided, names no block); None when no tier's policy reads parents."""
    hints = request_hints(policies, ids)
    return None if hints is None else {b: p for b, p in zip(ids, hints.parents) if b is not None}
