"""Argument checks shared by the eviction policies.

Every hook validates its whole batch before changing anything, so a call that raises
``KeyError`` leaves the policy exactly as it was (the contract tests rely on this).
"""

from __future__ import annotations

from typing import Container, Sequence

from .base import Hints, enough_unprotected


def require_new(name: str, ids: Sequence[int], tracked: Container[int]) -> None:
    """Raises KeyError unless every id is untracked and the ids are distinct."""
    for block_id in ids:
        if block_id in tracked:
            raise KeyError(f"{name}: block {block_id} is already tracked")
    if len(ids) > 1 and len(set(ids)) != len(ids):
        raise KeyError(f"{name}: duplicate ids in one on_insert call")


def require_tracked(name: str, ids: Sequence[int], tracked: Container[int], distinct: bool = False) -> None:
    """Raises KeyError if an id is untracked (or, with ``distinct``, repeated)."""
    for block_id in ids:
        if block_id not in tracked:
            raise KeyError(f"{name}: block {block_id} is not tracked")
    if distinct and len(ids) > 1 and len(set(ids)) != len(ids):
        raise KeyError(f"{name}: duplicate ids in one on_remove call")


def hint_values(name: str, hints: Hints | None, field: str, count: int, required: bool) -> Sequence | None:
    """Returns ``hints.<field>`` checked to align with ``count`` ids.

    Returns None when the hint is absent and not ``required``; raises ValueError when it is
    absent but ``required`` or when its length differs from the batch's.
    """
    values = getattr(hints, field) if hints is not None else None
    if values is None:
        if required:
            raise ValueError(f"{name}: needs Hints.{field} on every on_insert/on_access")
        return None
    if len(values) != count:
        raise ValueError(f"{name}: Hints.{field} has {len(values)} entries for {count} ids")
    return values
