"""The dense LRU miss-ratio curve of a report, from one stack-distance pass over the trace.

Replays give a handful of points per policy; the one-pass curve (``tiercache.sim.mrc``)
shows LRU at hundreds of capacities for the cost of one replay. It needs the trace itself,
so it is drawn only when the trace (a file, or a kv-cache-tester folder) is found and has
the fingerprint the results recorded (``same_trace``), or is handed over in memory (a half of
``compare --split``, which no file holds).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import re

import numpy as np

from ..errors import UserError
from ..sim.mrc import ReuseHistogram, reuse_histogram
from ..results.records import legacy_fingerprint
from ..sim.loader import Trace, load_trace, trace_fingerprint
from . import fmt
from .model import Run, TraceInfo

if TYPE_CHECKING:  # plots loads matplotlib: only a drawn report needs it
    from .plots import Curve

__all__ = ["LRUCurve", "dense_lru_curve", "same_trace", "DENSE_POINTS"]

# The path a half of ``compare --split`` records: the trace's, ``#`` and its name
# (``sim.split.HALVES``, which this plane may not import).
_HALF = re.compile(r"#(first|second)-half$")

#: Capacities on the dense curve (log-spaced over the plotted range).
DENSE_POINTS = 200


@dataclass(frozen=True)
class LRUCurve:
    """The dense curve, its histogram, and a sentence for the reader.

    ``curve`` and ``histogram`` are None when the trace was not available; ``note`` then
    says why.
    """

    curve: Curve | None
    histogram: ReuseHistogram | None
    note: str


def dense_lru_curve(trace: TraceInfo, source: str | Trace | None, runs: list[Run]) -> LRUCurve:
    """Computes the curve over the capacities of ``runs`` (object semantics, one tier).

    Args:
        trace: the trace the results describe.
        source: where to read it (None means ``trace.path`` as recorded), or the trace itself
            (used only if it has the recorded fingerprint).
        runs: the object-semantics single-tier runs the curve is drawn with.
    """
    if isinstance(source, Trace):
        loaded = source if source.fingerprint == trace.fingerprint else \
            "The dense one-pass LRU curve is left out: the trace given is not the one these results came from."
    else:
        loaded = _load_same_trace(trace, source or trace.path)
    if isinstance(loaded, str):
        return LRUCurve(None, None, loaded)
    from .plots import Curve  # loads matplotlib: the curve is about to be drawn

    histogram = reuse_histogram(loaded.ids)
    capacities = _dense_capacities([r.capacity_blocks for r in runs])
    curve = Curve(capacities, histogram.miss_ratios(capacities), f"lru, one-pass curve ({len(capacities)} capacities)")
    return LRUCurve(curve, histogram, _agreement_note(histogram, runs, len(capacities)))


def same_trace(path: str, recorded: str) -> bool:
    """Whether the trace at ``path`` has the fingerprint ``recorded`` that a results file holds.

    A trace file's fingerprint is its bytes' (an earlier version's results: their blake2b);
    a kv-cache-tester file's or folder's covers its files, their names and the arrival seed
    and gap, so it is computed by loading the workload as ``tiercache replay`` does (seed 0,
    the default gap). The cheap byte hash is tried first; only a file it does not match, or a
    folder, is loaded.

    Raises:
        UserError: ``path`` cannot be read (or, when it must be loaded, is not a trace).
    """
    if legacy_fingerprint(recorded):
        return not Path(path).is_dir() and trace_fingerprint(path, like=recorded) == recorded
    if not Path(path).is_dir() and trace_fingerprint(path) == recorded:
        return True
    return load_trace(path).fingerprint == recorded


def _load_same_trace(trace: TraceInfo, path: str) -> Trace | str:
    """The trace at ``path`` (a file or a kv-cache-tester folder) when it is the results'
    trace; otherwise why not."""
    half = _HALF.search(path or "")
    if half and not Path(path).exists():  # its fingerprint is no file's: --trace could not match
        return (f"The dense one-pass LRU curve is left out: these results are of the {half[1]} half of "
                f"{path[:half.start()]}, which no file holds (the report compare --split writes draws it).")
    if not path or not Path(path).exists():
        return f"The dense one-pass LRU curve is left out: the trace {path or '(not recorded)'} was not found (give --trace)."
    try:
        loaded = load_trace(path)
        same = (same_trace(path, trace.fingerprint) if legacy_fingerprint(trace.fingerprint)
                else loaded.fingerprint == trace.fingerprint)
    except UserError as exc:
        return f"The dense one-pass LRU curve is left out: {exc}."
    if not same:
        return f"The dense one-pass LRU curve is left out: {path} is not the trace these results came from (fingerprint differs)."
    return loaded


def _dense_capacities(capacities: list[int]) -> np.ndarray:
    """Log-spaced capacities over the plotted range, including every replayed capacity."""
    lo, hi = max(1.0, min(capacities) / 1.6), max(capacities) * 1.6
    dense = np.geomspace(lo, hi, DENSE_POINTS).round().astype(np.int64)
    return np.unique(np.concatenate((dense, np.asarray(capacities, dtype=np.int64))))


def _agreement_note(histogram: ReuseHistogram, runs: list[Run], points: int) -> str:
    """Says whether the curve reproduces the replayed LRU points (it must, exactly)."""
    lru = [r for r in runs if r.label == "lru"]
    head = (
        f"The wide pale line is LRU at {points} capacities, computed in one pass from reuse (stack) distances "
        f"instead of one replay per capacity. LRU reaches the compulsory floor from "
        f"{fmt.integer(histogram.max_useful_capacity)} blocks on."
    )
    if not lru:
        return head
    expected = histogram.misses([r.capacity_blocks for r in lru])
    wrong = [r for r, m in zip(lru, expected) if int(m) != r.misses]
    if not wrong:
        where = "the one replayed capacity" if len(lru) == 1 else f"all {len(lru)} replayed capacities"
        return f"{head} It matches the replayed LRU misses exactly at {where}."
    listed = ", ".join(fmt.integer(r.capacity_blocks) for r in wrong)
    return f"{head} Warning: it disagrees with the replayed LRU misses at {listed} blocks."
