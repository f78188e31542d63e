"""Admission ``tinylfu``: a block enters a lower tier only when a count-min sketch says it recurs."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .base import AdmissionPolicy

#: Default sketch width (counters per row); memory is 4 rows x width x 4 B.
DEFAULT_WIDTH = 1 << 16
#: Default frequency estimate a block needs to be admitted.
DEFAULT_THRESHOLD = 2
_MASK64 = (1 << 64) - 1
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)


def _mix(value: int) -> int:
    """splitmix64's finaliser: a stable 64-bit mix of an int (never Python's ``hash``)."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK64
    return value ^ (value >> 31)


class TinyLFUAdmit(AdmissionPolicy):
    """Frequency-gated admission for DRAM/NVMe: admit a block once its estimated frequency
    (including this sighting) reaches ``threshold``.

    Sightings are counted in a count-min sketch (4 rows of ``width`` 32-bit counters, one
    stable hash per row, conservative update: only the rows at the current minimum grow). Every
    ``10 x width`` sightings all counters are halved (TinyLFU's reset), so frequencies describe
    the recent past and memory is fixed whatever the trace. An estimate never undercounts a
    block's sightings since the last reset (halving aside); collisions may overcount.

    Sources and departures: TinyLFU (Einziger, Friedman and Manes, 2017) and Caffeine's
    W-TinyLFU admission; Dynamo's block manager gates offload on frequency the same way.
    Departure: TinyLFU compares the candidate's estimate with the victim's, but tiercache's
    admission contract sees only the candidates (``admit(ids)``), so the victim is replaced by a
    fixed threshold; and the sketch counts what the tier is offered (demotions or write-through
    copies), not every access, so "frequency" is how often a block falls out of the tier above.

    Invariant: every counter is in ``[0, 2**32)``; ``_added < 10 x width``.
    """

    name = "tinylfu"

    def __init__(self, width: int = DEFAULT_WIDTH, threshold: int = DEFAULT_THRESHOLD) -> None:
        if width < 1 or threshold < 1:
            raise ValueError(f"tinylfu: width and threshold must be >= 1, got {width}, {threshold}")
        self.width, self.threshold = width, threshold
        self._rows = np.zeros((len(_SEEDS), width), dtype=np.uint32)
        self._added = 0

    def _cells(self, block_id: int) -> list[int]:
        return [_mix(block_id ^ seed) % self.width for seed in _SEEDS]

    def estimate(self, block_id: int) -> int:
        """Estimated sightings of ``block_id`` since the counters were last halved."""
        return int(min(self._rows[row, cell] for row, cell in enumerate(self._cells(block_id))))

    def admit(self, ids: Sequence[int]) -> list[bool]:
        return [self._record(block_id) >= self.threshold for block_id in ids]

    def _record(self, block_id: int) -> int:
        """Counts one sighting (conservative update) and returns the new estimate."""
        cells = self._cells(block_id)
        rows = self._rows
        low = min(int(rows[row, cell]) for row, cell in enumerate(cells))
        new = min(low + 1, 0xFFFFFFFF)
        for row, cell in enumerate(cells):
            if rows[row, cell] < new:
                rows[row, cell] = new
        self._added += 1
        if self._added >= 10 * self.width:
            rows >>= 1
            self._added = 0
        return new

    def check_invariants(self) -> None:
        assert self._added < 10 * self.width, "reset overdue"
