#!/usr/bin/env python3
"""How much of the LRU-to-Belady gap a ranking by online-visible block classes can close, fitted
in hindsight.

An online policy sees, for each block, only what happened before: how often the block was used,
how many requests its root has had, how long its request was, where in the request it sits.
This script fits, on the whole trace, each class's reuse-gap distribution and ranks blocks the
way LHD does (Beckmann et al., NSDI 2018): by hit density, the expected hits per unit of space
and time left to a block of that class at its age, assuming it is kept at most ``horizon``
capacities. Eviction samples 64 leaves of the prefix tree (LHD samples; only leaves, as
``LeafPriorityPolicy``, since an inner block strands its subtree) and takes the lowest density.

The curves are fitted on the very accesses they then rank, so the figure is optimistic for any
online policy that ranks by these classes and by age: it is what such a policy would reach if it
had learned every class's curve perfectly in advance. It is not a bound on every policy (LHD's
density is a heuristic and the eviction is sampled). Two class sets are reported: ``coarse``
(earlier uses, capped at 3; the root's earlier requests, capped at 6) and ``rich`` (those, plus
the request's length in powers of 4, capped at 4, the distance to the request's end, capped at
3, and the depth in powers of 2, capped at 6; length and distance to the end are known only when
the request ends, so a policy would re-rank the request's blocks then).

    python scripts/class_bound.py tests/data/mooncake_synthetic_trace.jsonl --capacity 1000,4000,16000

On the bundled Mooncake sample the hindsight rankings close 4% / 1% (coarse / rich) of the gap
at 1k blocks, 12% / 20% at 4k and 31% / 41% at 16k; on ``tests/data/kvtester_sample`` 57% / 47%
at 500 blocks, 46% / 58% at 1000 and 70% / 72% at 2000. Even with perfect curves, ranking by these
classes falls well short of 30% of the sample's gap at 1k and 4k blocks: what is left there is
when each session comes back. ``--fit first-half`` fits the curves on the first half of the
accesses and scores the second half (LRU and Belady too): on the bundled sample the rankings are
then worse than LRU at 1k and 4k blocks (-37% / -42% and -50% / -55% of the gap, coarse / rich)
and close 40% / 41% at 16k; on the kv-cache-tester sample 41% / 21% at 500 blocks, -53% / -10% at
1000, 22% / -61% at 2000.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys

import numpy as np

from tiercache.report.fmt import percent_or_na
from tiercache.results.outfile import replace_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from belady_gap import NEVER, analysis_parser, belady_hits, lru_hits, next_uses, parse_checked, requests_of  # noqa: E402

#: Age bins of a density table (log-spaced from capacity / 64 to the horizon).
BINS = 64
#: Leaves sampled per eviction (LHD's associativity).
SAMPLES = 64

Class = tuple[int, ...]


def classes_of(ids: list[int], offsets: list[int], rich: bool) -> list[Class]:
    """Each access's class: (earlier uses, root's earlier requests[, length, to end, depth])."""
    uses: dict[int, int] = {}
    requests: dict[int, int] = {}
    result: list[Class] = []
    for a, b in zip(offsets, offsets[1:]):
        root_seen = min(requests.get(ids[a], 0), 6)
        requests[ids[a]] = requests.get(ids[a], 0) + 1
        length = min(((b - a).bit_length() - 1) // 2, 4)  # floor(log4(length))
        for position in range(a, b):
            block = ids[position]
            cls: Class = (min(uses.get(block, 0), 3), root_seen)
            uses[block] = uses.get(block, 0) + 1
            if rich:
                cls += (length, min(b - 1 - position, 3), min((position - a + 1).bit_length() - 1, 6))
            result.append(cls)
    return result


def age_edges(capacity: int, horizon: float) -> np.ndarray:
    """Bin edges of ages in block accesses: 0, then log-spaced up to ``horizon`` capacities."""
    return np.concatenate([[0.0], np.geomspace(capacity / 64, horizon * capacity, BINS)])


def density_tables(upcoming: list[int], classes: list[Class], edges: np.ndarray) -> dict[Class, np.ndarray]:
    """Per class, hit density by age bin: P(reused between the bin's start and the horizon) over
    the expected space-time spent there (a block not reused by the horizon leaves at it)."""
    horizon = edges[-1]
    gaps: dict[Class, list[float]] = {}
    for position, cls in enumerate(classes):
        gap = upcoming[position] - position if upcoming[position] < NEVER else math.inf
        gaps.setdefault(cls, []).append(gap)
    widths = np.diff(edges)
    tables = {}
    for cls, values in gaps.items():
        counts, _ = np.histogram([g for g in values if g < horizon], bins=edges)
        after = 1.0 - np.cumsum(counts) / len(values)  # P(gap > bin end)
        before = np.concatenate([[1.0], after[:-1]])  # P(gap > bin start)
        space = np.cumsum((((before + after) / 2) * widths)[::-1])[::-1]  # from the bin's start to the horizon
        hits = before - after[-1]
        tables[cls] = np.divide(hits, space, out=np.zeros(BINS), where=space > 0)
    return tables


class _Leaves:
    """The cached prefix tree's leaves, sampled uniformly (swap-remove array)."""

    def __init__(self) -> None:
        self.items: list[int] = []
        self.index: dict[int, int] = {}

    def add(self, block: int) -> None:
        if block not in self.index:
            self.index[block] = len(self.items)
            self.items.append(block)

    def discard(self, block: int) -> None:
        slot = self.index.pop(block, None)
        if slot is None:
            return
        last = self.items.pop()
        if slot < len(self.items):
            self.items[slot] = last
            self.index[last] = slot


def ranked_hits(ids: list[int], offsets: list[int], capacity: int, classes: list[Class],
                tables: dict[Class, np.ndarray], edges: np.ndarray, seed: int = 0) -> np.ndarray:
    """Per access, whether the density-ranked cache hits it (prefix semantics, every block stored)."""
    rng = random.Random(seed)
    cached: dict[int, tuple[int, Class]] = {}  # id -> (last use, class then)
    parent: dict[int, int | None] = {}
    children: dict[int, int] = {}
    leaves = _Leaves()
    hit = np.zeros(len(ids), dtype=bool)
    for a, b in zip(offsets, offsets[1:]):
        hitting, previous = True, None
        for position in range(a, b):
            block = ids[position]
            hitting = hitting and block in cached
            hit[position] = hitting
            if block not in cached:
                if len(cached) >= capacity:
                    _evict(_pick(position, cached, leaves, tables, edges, rng), cached, parent, children, leaves)
                parent[block] = previous
                if previous is not None:
                    children[previous] = children.get(previous, 0) + 1
                    leaves.discard(previous)
                if block not in children:
                    leaves.add(block)
            cached[block] = (position, classes[position])
            previous = block
    return hit


def _pick(now: int, cached: dict, leaves: _Leaves, tables: dict, edges: np.ndarray, rng: random.Random) -> int:
    """The sampled leaf with the lowest hit density at its age."""
    best, lowest = None, math.inf
    for _ in range(SAMPLES):
        block = leaves.items[rng.randrange(len(leaves.items))]
        last, cls = cached[block]
        age_bin = min(int(np.searchsorted(edges, now - last, side="right")) - 1, BINS - 1)
        density = tables[cls][age_bin]
        if density < lowest:
            best, lowest = block, density
    return best


def _evict(block: int, cached: dict, parent: dict, children: dict, leaves: _Leaves) -> None:
    """Drops a leaf; its parent becomes a leaf when it was the last cached child."""
    leaves.discard(block)
    del cached[block]
    up = parent.pop(block)
    if up is None:
        return
    children[up] -= 1
    if children[up] == 0:
        del children[up]
        if up in cached:
            leaves.add(up)


def bound_rows(path: str, capacities: list[int], horizon: float, fit: str = "all") -> list[dict]:
    """``rows_of`` the trace at ``path`` (``requests_of``: a step trace is refused)."""
    ids, offsets = requests_of(path)
    return rows_of(ids, offsets, capacities, horizon, fit)


def rows_of(ids: list[int], offsets: list[int], capacities: list[int], horizon: float, fit: str = "all") -> list[dict]:
    """Per capacity: LRU, Belady and both class rankings' miss ratios and gap closed (None
    where LRU misses no more than Belady: no gap to close, printed ``n/a`` as gap_closed.py does).

    With ``fit`` "all" the curves are fitted on the whole trace and every access is scored.
    With "first-half" they are fitted on the first half of the accesses (their reuse gaps may
    reach into the second half, which only helps) and every figure, LRU's and Belady's too, is
    the miss ratio over the second half: whether what the classes say carries forward in time.
    A class the first half never saw falls back to the curve of all its accesses together.
    """
    upcoming = next_uses(ids)
    start, end = (len(ids) // 2 if fit == "first-half" else 0), (len(ids) // 2 if fit == "first-half" else len(ids))
    rows = []
    for capacity in capacities:
        lru = 1 - lru_hits(ids, offsets, capacity)[start:].mean()
        belady = 1 - belady_hits(ids, offsets, capacity, upcoming)[start:].mean()
        row = {"capacity": capacity, "fit": fit, "lru_miss": lru, "belady_miss": belady}
        edges = age_edges(capacity, horizon)
        for name, rich in (("coarse", False), ("rich", True)):
            classes = classes_of(ids, offsets, rich)
            tables = density_tables(upcoming[:end], classes[:end], edges)
            pooled = density_tables(upcoming[:end], [()] * end, edges)[()]
            tables.update({cls: pooled for cls in set(classes) - tables.keys()})
            miss = 1 - ranked_hits(ids, offsets, capacity, classes, tables, edges)[start:].mean()
            row[f"{name}_miss"] = miss
            row[f"{name}_gap_closed"] = (lru - miss) / (lru - belady) if lru > belady else None
        rows.append(row)
    return rows


def horizon_capacities(text: str) -> float:
    """argparse type of ``--horizon``: a finite number of capacities above 1/64, where the
    first age bin ends (``age_edges`` must increase).

    Raises:
        argparse.ArgumentTypeError: not a number, or not above 1/64 (argparse names the option).
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of capacities, got {text!r}") from None
    if not 1 / 64 < value < math.inf:  # nan fails both comparisons
        raise argparse.ArgumentTypeError(f"expected a finite number of capacities above 1/64, got {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options and the trace (``args.ids``, ``args.offsets``), every one checked before any
    ranking: a bad capacity or horizon, an unwritable ``--json``, or a trace that is missing,
    malformed or of steps ends in one line (exit 2)."""
    parser = analysis_parser(__doc__)
    parser.add_argument("--horizon", type=horizon_capacities, default=4.0,
                        help="longest stay, in capacities (default 4)")
    parser.add_argument("--fit", choices=("all", "first-half"), default="all",
                        help="fit on the whole trace (default), or on its first half and score the second")
    return parse_checked(parser, argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = rows_of(args.ids, args.offsets, args.capacity, args.horizon, args.fit)
    print(f"{'capacity':>8} {'LRU':>7} {'Belady':>7} {'coarse':>7} {'closed':>7} {'rich':>7} {'closed':>7}")
    for row in rows:
        print(f"{row['capacity']:>8} {row['lru_miss']:7.4f} {row['belady_miss']:7.4f} {row['coarse_miss']:7.4f} "
              f"{percent_or_na(row['coarse_gap_closed']):>7} {row['rich_miss']:7.4f} "
              f"{percent_or_na(row['rich_gap_closed']):>7}")
    if args.json:  # whole or not at all; strict JSON: no gap is null
        replace_file(args.json, json.dumps(rows, indent=2, allow_nan=False), f"--json {args.json}")


if __name__ == "__main__":
    main()
