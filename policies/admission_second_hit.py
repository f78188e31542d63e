"""Admission ``second_hit``: place a block only from its second sighting on."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from .base import AdmissionPolicy

#: Default number of distinct ids remembered (a few MiB of Python dict at most).
DEFAULT_HISTORY = 1 << 16


class SecondHitAdmit(AdmissionPolicy):
    """Frequency filter: refuses a block on its first sighting, admits it on later ones.

    Sightings are remembered in a FIFO of at most ``history`` distinct ids: an id is recorded
    on its first sighting and forgotten when ``history`` newer ids have been recorded after it
    (sightings of a remembered id do not refresh its place). A block is admitted when it is
    seen while remembered, so "second sighting" means within the last ``history`` first
    sightings; one-hit wonders never enter a tier and cost one dict entry each, for a bounded
    time. Memory is O(history) whatever the trace.

    Within one ``admit`` call ids are taken in order, so an id repeated in the same call is
    refused at its first position and admitted at the next.

    Invariant: ``_seen`` holds at most ``history`` ids, oldest first sighting first.
    """

    name = "second_hit"

    def __init__(self, history: int = DEFAULT_HISTORY) -> None:
        if history < 1:
            raise ValueError(f"second_hit: history must be >= 1, got {history}")
        self.history = history
        self._seen: OrderedDict[int, None] = OrderedDict()

    def admit(self, ids: Sequence[int]) -> list[bool]:
        seen = self._seen
        out = []
        for block_id in ids:
            if block_id in seen:
                out.append(True)
                continue
            out.append(False)
            seen[block_id] = None
            if len(seen) > self.history:
                seen.popitem(last=False)  # FIFO aging: forget the oldest first sighting
        return out

    def __contains__(self, block_id: int) -> bool:
        """Whether ``block_id`` is remembered (its next sighting would be admitted)."""
        return block_id in self._seen

    def check_invariants(self) -> None:
        assert len(self._seen) <= self.history, "history over its bound"
