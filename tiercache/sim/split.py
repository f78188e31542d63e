"""Halves of a request trace, for comparisons that tune on one half and report on the other.

A policy (or a parameter, or the choice of a winner) picked on the first half and measured on
the second cannot have been fitted to what it is measured on; each half replays from a cold
cache, as a trace of its own.
"""

from __future__ import annotations


from tiercache.results import SPLIT_HALVES, TraceKind

from .loader import Trace
from .traces import FlatTrace, half_fingerprint

__all__ = ["split_halves", "HALVES"]

#: The two halves' names, in trace order (``results.SPLIT_HALVES``, which the report reads too).
HALVES = SPLIT_HALVES


def split_halves(trace: Trace) -> tuple[Trace, Trace]:
    """The first ``records // 2`` requests and the rest, each a ``Trace`` with its own fingerprint.

    A half's path is the trace's with ``#first-half`` / ``#second-half`` appended (no file is
    written), its fingerprint that of the whole trace's fingerprint and the half's name.

    Raises:
        ValueError: a step trace, fewer than two requests, or a half without block accesses.
    """
    if trace.kind is not TraceKind.REQUESTS:
        raise ValueError(f"{trace.path}: only request traces split into halves (a step trace is one sequence)")
    if trace.records < 2:
        raise ValueError(f"{trace.path}: {trace.records} request(s); a split needs at least two")
    middle = trace.records // 2
    for name, (first, last) in zip(HALVES, ((0, middle), (middle, trace.records))):
        if trace.offsets[last] == trace.offsets[first]:
            raise ValueError(f"{trace.path}: the {name.replace('-', ' ')} (requests {first + 1}-{last}) has no block access; "
                             "a split needs block accesses in both halves")
    return _part(trace, 0, middle, HALVES[0]), _part(trace, middle, trace.records, HALVES[1])


def _part(trace: Trace, first: int, last: int, name: str) -> Trace:
    """Requests ``[first, last)`` of ``trace`` as a trace of their own."""
    flat = trace.requests
    a, b = int(trace.offsets[first]), int(trace.offsets[last])
    ids = trace.ids[a:b].copy()
    offsets = trace.offsets[first : last + 1] - a
    part = FlatTrace(ids, offsets[:-1].copy(), flat.timestamps[first:last].copy(), flat.input_lengths[first:last].copy(),
                     flat.output_lengths[first:last].copy())
    fingerprint = half_fingerprint(trace.fingerprint, name)
    return Trace(f"{trace.path}#{name}", trace.kind, fingerprint, ids, offsets.copy(), requests=part,
                 block_tokens=trace.block_tokens)
