"""Prefetch ``none``: never brings anything up ahead of a read (the baseline)."""

from __future__ import annotations

from .base import PrefetchPolicy, PrefetchView


class NoPrefetch(PrefetchPolicy):
    """Plans nothing: every block a step reads is fetched when the step reads it."""

    name = "none"

    def plan(self, view: PrefetchView) -> list[int]:
        return []
