"""A placement policy's answers, checked: which tier a hierarchy's new blocks go to, and whether
a hit found below the top is promoted (``TierManager``'s ``placement``; None means the top
tier for both, the manager's behaviour without a placement policy)."""

from __future__ import annotations

from typing import Sequence

from tiercache.policies.base import Hints, PlacementPolicy, in_tree

__all__ = ["check_placement", "insert_tier", "promotes"]


def check_placement(placement: PlacementPolicy | None, write_through: bool, shared_last: bool) -> None:
    """Raises ValueError for a placement policy in a hierarchy it cannot place in: an
    inclusive one (every block goes everywhere) or one with a shared tier."""
    if placement is not None and (write_through or shared_last):
        raise ValueError("a placement policy needs an exclusive hierarchy without a shared tier")


def insert_tier(placement: PlacementPolicy | None, ids: Sequence[int], hints: Hints | None, n_tiers: int) -> int:
    """The tier new blocks ``ids`` are stored in (0 without a placement policy or ids).

    Raises:
        ValueError: the policy answered a tier the hierarchy does not have.
    """
    if placement is None or not ids:
        return 0
    return _checked(placement, placement.insert_tier(ids, hints), range(n_tiers), "insert_tier")


def promotes(placement: PlacementPolicy | None, ids: Sequence[int], tier: int, hints: Hints | None) -> bool:
    """Whether hits ``ids`` found in ``tier`` move to the top (True without a placement
    policy); False reads them where they lie.

    Raises:
        ValueError: the policy answered neither 0 nor ``tier``.
    """
    if placement is None:
        return True
    return _checked(placement, placement.promote_tier(ids, tier, hints), (0, tier), "promote_tier") == 0


def _checked(placement: PlacementPolicy, answer: int, allowed, call: str) -> int:
    if answer not in allowed:
        cls = type(placement)
        who = placement.name if in_tree(placement) else f"{cls.__module__}:{cls.__qualname__}"
        raise ValueError(f"placement {who}: {call} answered {answer!r}, not one of {list(allowed)}")
    return answer
