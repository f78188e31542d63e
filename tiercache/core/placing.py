"""A placement policy's answers, checked: which tier a hierarchy's new blocks go to, and whether
a hit found below the top is promoted (``TierManager``'s ``placement``; None means the top
tier for both, the manager's behaviour without a placement policy)."""

from __future__ import annotations

from typing import Sequence

from tiercache.policies.base import Hints, PlacementPolicy, in_tree

from .answers import handed, is_int

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
    return _checked(placement, placement.insert_tier(*_handed(placement, ids, hints)), range(n_tiers), "insert_tier")


def promotes(placement: PlacementPolicy | None, ids: Sequence[int], tier: int, hints: Hints | None) -> bool:
    """Whether hits ``ids`` found in ``tier`` move to the top (True without a placement
    policy); False reads them where they lie.

    Raises:
        ValueError: the policy answered neither 0 nor ``tier``.
    """
    if placement is None:
        return True
    asked, asked_hints = _handed(placement, ids, hints)
    return _checked(placement, placement.promote_tier(asked, tier, asked_hints), (0, tier), "promote_tier") == 0


def _handed(placement: PlacementPolicy, ids: Sequence[int], hints: Hints | None) -> tuple[Sequence[int], Hints | None]:
    """What ``placement`` is asked about: the manager's ids and hints for tiercache's own
    policies, copies for any other (``handed``: the manager goes on using its own)."""
    return (ids, hints) if in_tree(placement) else handed(ids, hints)


def _checked(placement: PlacementPolicy, answer: int, allowed, call: str) -> int:
    """``answer`` as a plain int when it is one of ``allowed``: an int (numpy's too), never a
    bool or a float equal to one (``True in range(3)`` and ``1.0 in range(3)`` both hold).

    Raises:
        ValueError: any other answer, naming the policy, the call and what it answered.
    """
    if not is_int(answer):
        _refuse(placement, call, f"{answer!r} ({type(answer).__name__})", allowed)
    if answer not in allowed:
        _refuse(placement, call, repr(answer), allowed)
    return int(answer)


def _refuse(placement: PlacementPolicy, call: str, answered: str, allowed) -> None:
    """Raises the one-line ``ValueError`` for an answer that names no tier ``allowed``."""
    cls = type(placement)
    who = placement.name if in_tree(placement) else f"{cls.__module__}:{cls.__qualname__}"
    raise ValueError(f"placement {who}: {call} answered {answered}, not one of {list(allowed)}")
