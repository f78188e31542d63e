"""The room a recorded decode needs: the blocks its live sequences hold at once.

A live sequence's blocks may move down the hierarchy but never leave it, so the live decode
cache refuses an append whose new blocks would take what live sequences hold past the tiers'
capacity (``Sequence._check_room``: the sum of the tiers, the last tier's under write-through).
A replay on such tiers would store fewer blocks than the trace writes and report a miss ratio
for a decode that cannot run. ``HeldPeaks`` reads, from the trace alone (its ``hold`` and
``release`` fields, counted as the live cache counts them: distinct blocks, a block several
sequences hold once), which write first passes a capacity, so that a sweep refuses that run.
A trace without those fields (a synthetic one) holds nothing and fits any capacity.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from .loader import Trace
from .tracelines import record_line

__all__ = ["HeldPeak", "HeldPeaks"]


@dataclass(frozen=True)
class HeldPeak:
    """A write record after which live sequences hold more blocks than after any write before.

    Invariants: ``record`` is a record index (0-based, the header not counted); ``new`` of the
    ``held`` distinct blocks held after it are its own, not held before it (``new >= 1``).
    """

    record: int
    held: int
    new: int


@dataclass(frozen=True)
class HeldPeaks:
    """The record-breaking write records of a step trace, in file order.

    Invariant: ``held`` strictly increases along ``peaks``, so the first write that passes a
    capacity is the first peak above it (``first_over``).
    """

    path: str
    header_lines: int
    peaks: tuple[HeldPeak, ...]

    @classmethod
    def of(cls, trace: Trace) -> "HeldPeaks":
        """The peaks of ``trace`` (none for a request trace or one without decode fields)."""
        decode = trace.steps.decode if trace.steps is not None else None
        header = 1 if trace.block_tokens is not None else 0
        if not decode:
            return cls(trace.path, header, ())
        return cls(trace.path, header, tuple(_peaks(decode, trace.offsets, trace.steps.is_write)))

    def first_over(self, capacity: int) -> HeldPeak | None:
        """The first write after which live sequences hold more than ``capacity`` blocks, or None."""
        index = bisect.bisect_right([peak.held for peak in self.peaks], capacity)
        return self.peaks[index] if index < len(self.peaks) else None

    def refusal(self, capacity: int, cache: str) -> str | None:
        """Why the trace cannot be replayed on ``cache`` (its tiers, as a message names them)
        of ``capacity`` blocks for held blocks, as one line starting ``FILE:LINE:``; None if it can."""
        peak = self.first_over(capacity)
        if peak is None:
            return None
        line = record_line(self.path, peak.record + self.header_lines)
        before = peak.held - peak.new
        return (f"{self.path}:{line}: the decode recorded there does not fit {cache}: {peak.new} new block(s) do not "
                f"fit: live sequences hold {before} of the tiers' {capacity} blocks; {peak.held - capacity} more "
                "block(s) are needed (the live cache refuses such an append: a live sequence's blocks never leave "
                "the tiers)")


def _peaks(decode: dict, offsets: np.ndarray, is_write: np.ndarray) -> list[HeldPeak]:
    """The record-breaking writes (``HeldPeaks``) of records ``decode`` (index -> fields, in
    file order); ``offsets`` (with the end) and ``is_write`` tell which records write."""
    holds: dict[int, int] = {}
    peaks: list[HeldPeak] = []
    for record, fields in decode.items():
        for block_id in fields.release:  # before the record's reads and writes, as the replay releases
            count = holds.get(block_id, 0)
            if count > 1:
                holds[block_id] = count - 1
            elif count:
                del holds[block_id]
        before = len(holds)
        for block_id in fields.hold:
            holds[block_id] = holds.get(block_id, 0) + 1
        writes = bool(is_write[offsets[record] : offsets[record + 1]].any())
        if writes and len(holds) > before and len(holds) > (peaks[-1].held if peaks else 0):
            peaks.append(HeldPeak(record, len(holds), len(holds) - before))
    return peaks
