#!/usr/bin/env python3
"""Where the LRU-to-Belady gap lies: the accesses Belady hits and LRU misses, in prefix semantics.

For each capacity, replays the trace through a plain LRU and a plain Belady (single tier,
prefix semantics: a request's blocks hit until its first miss; every block is then stored)
and describes the accesses only Belady hits: how long ago the block was last used (in
capacities of block accesses), how often it was used before, and its depth in its request.
An online policy has to keep those blocks that long, picked by what it can see then.

It also reports a frequency oracle: a cache that only ever holds the ``capacity`` blocks
accessed most often over the whole trace (it knows every block's future popularity, not when
it comes). Where the oracle closes little of the gap, popularity alone cannot: the gap is in
timing.

Two more columns say what online information is worth. The dead-first oracle is an LRU that
knows which blocks are never used again and evicts those first: the most a perfect dead-block
predictor paired with plain recency reaches (a policy that also reorders live blocks can do
better). The one-use-first oracle is the same LRU told only which blocks are used once in the
whole trace: a perfect predictor of one-off blocks (the usual dead-block predictors' target),
with no idea when a reused block's last use has come. The class accuracy is Hawkeye's view (Jain & Lin, 2016): each access is labelled by
whether Belady keeps the block until its next use and grouped by what a policy sees then (the
block's earlier uses and its request root's earlier requests, each capped at 3); answering each
class's majority label is right on ``class_accuracy`` of the accesses, against
``constant_accuracy`` for one answer for all. Equal figures mean those features say nothing
about Belady's choices at that capacity.

    python scripts/belady_gap.py tests/data/mooncake_synthetic_trace.jsonl --capacity 1000,4000,16000

The miss ratios are the ones ``tiercache replay`` reports for ``lru`` and ``belady``
(``tests/test_belady_gap.py`` checks this on the bundled sample).
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections import OrderedDict

import numpy as np

from tiercache.bench.script_args import ScriptParser, positive_ints, refuse_bad_outputs
from tiercache.config import TraceKind
from tiercache.errors import UserError
from tiercache.results.outfile import replace_file
from tiercache.sim.loader import load_trace

#: Never used again (sorts after every position).
NEVER = 1 << 62


def requests_of(path: str) -> tuple[list[int], list[int]]:
    """The trace's block ids in access order and its request offsets (``len(requests) + 1``).

    Raises:
        UserError: a trace that cannot be read (``TraceError``: the file and line), or a step
            trace (its reads and writes are no requests: prefix semantics means nothing there).
    """
    trace = load_trace(path)
    if trace.kind is not TraceKind.REQUESTS:
        raise UserError(f"{path}: a step trace; this script analyses request traces (Mooncake, Bailian or "
                        f"kv-cache-tester), whose requests reuse a prefix")
    return [int(b) for b in trace.ids], [int(o) for o in trace.offsets]


def checked_requests(parser: argparse.ArgumentParser, path: str) -> tuple[list[int], list[int]]:
    """``requests_of(path)``, where a trace it refuses ends in one line (``parser.error``, exit 2)."""
    try:
        return requests_of(path)
    except UserError as exc:
        parser.error(str(exc))


def next_uses(ids: list[int]) -> list[int]:
    """Position of each access's next access to the same id (``NEVER`` if none)."""
    upcoming: dict[int, int] = {}
    result = [NEVER] * len(ids)
    for position in range(len(ids) - 1, -1, -1):
        result[position] = upcoming.get(ids[position], NEVER)
        upcoming[ids[position]] = position
    return result


def lru_hits(ids: list[int], offsets: list[int], capacity: int) -> np.ndarray:
    """Per access, whether LRU of ``capacity`` blocks hits it in prefix semantics."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = np.zeros(len(ids), dtype=bool)
    for a, b in zip(offsets, offsets[1:]):
        hitting = True
        for position in range(a, b):
            block = ids[position]
            hitting = hitting and block in cache
            hit[position] = hitting
            if block in cache:
                cache.move_to_end(block)
            else:
                if len(cache) >= capacity:
                    cache.popitem(last=False)
                cache[block] = None
    return hit


def belady_hits(ids: list[int], offsets: list[int], capacity: int, upcoming: list[int]) -> np.ndarray:
    """Per access, whether Belady (evict the block used farthest in the future) hits it."""
    cache: dict[int, int] = {}  # id -> next use
    heap: list[tuple[int, int]] = []  # (-next use, id), stale entries skipped
    hit = np.zeros(len(ids), dtype=bool)
    for a, b in zip(offsets, offsets[1:]):
        hitting = True
        for position in range(a, b):
            block = ids[position]
            hitting = hitting and block in cache
            hit[position] = hitting
            if block not in cache:
                while len(cache) >= capacity:
                    negative, victim = heapq.heappop(heap)
                    if cache.get(victim) == -negative:
                        del cache[victim]
            cache[block] = upcoming[position]
            heapq.heappush(heap, (-upcoming[position], block))
    return hit


def frequency_oracle_hits(ids: list[int], offsets: list[int], capacity: int) -> np.ndarray:
    """Per access, whether a cache holding only the ``capacity`` most accessed ids (ties: the
    first seen) hits it: in that set, seen before, and every earlier block of the request hit."""
    counts: dict[int, int] = {}
    for block in ids:
        counts[block] = counts.get(block, 0) + 1
    keep = set(sorted(counts, key=lambda b: -counts[b])[:capacity])  # sorted() is stable: first seen wins ties
    seen: set[int] = set()
    hit = np.zeros(len(ids), dtype=bool)
    for a, b in zip(offsets, offsets[1:]):
        hitting = True
        for position in range(a, b):
            block = ids[position]
            hitting = hitting and block in keep and block in seen
            hit[position] = hitting
            seen.add(block)
    return hit


def dead_first_hits(ids: list[int], offsets: list[int], capacity: int, upcoming: list[int]) -> np.ndarray:
    """Per access, whether an LRU that evicts never-used-again blocks first hits it (dead
    blocks leave in LRU order, then live ones)."""
    return _dead_first(ids, offsets, capacity, [u >= NEVER for u in upcoming])


def one_use_first_hits(ids: list[int], offsets: list[int], capacity: int) -> np.ndarray:
    """Per access, whether an LRU that evicts first the blocks used only once in the whole trace
    hits it: the most a perfect predictor of single-use blocks, told at their one use, adds to
    recency. It knows nothing about when a reused block's last use has come."""
    counts: dict[int, int] = {}
    for block in ids:
        counts[block] = counts.get(block, 0) + 1
    return _dead_first(ids, offsets, capacity, [counts[block] == 1 for block in ids])


def _dead_first(ids: list[int], offsets: list[int], capacity: int, dead_after: list[bool]) -> np.ndarray:
    """Prefix-semantics LRU whose victims are taken first among blocks whose latest access was
    flagged in ``dead_after`` (in LRU order), then among the rest."""
    dead: OrderedDict[int, None] = OrderedDict()
    live: OrderedDict[int, None] = OrderedDict()
    hit = np.zeros(len(ids), dtype=bool)
    for a, b in zip(offsets, offsets[1:]):
        hitting = True
        for position in range(a, b):
            block = ids[position]
            cached = block in dead or block in live
            hitting = hitting and cached
            hit[position] = hitting
            dead.pop(block, None)
            live.pop(block, None)
            if not cached and len(dead) + len(live) >= capacity:
                (dead if dead else live).popitem(last=False)
            (dead if dead_after[position] else live)[block] = None
    return hit


def class_accuracy(ids: list[int], offsets: list[int], belady: np.ndarray, upcoming: list[int]) -> tuple[float, float]:
    """(majority-per-class accuracy, one-answer accuracy) of predicting, at each access, whether
    Belady keeps the block until its next use, from (earlier uses, root's earlier requests)."""
    uses: dict[int, int] = {}
    requests: dict[int, int] = {}
    counts: dict[tuple[int, int], list[int]] = {}
    for a, b in zip(offsets, offsets[1:]):
        root_seen = min(requests.get(ids[a], 0), 3)
        requests[ids[a]] = requests.get(ids[a], 0) + 1
        for position in range(a, b):
            block = ids[position]
            cls = (min(uses.get(block, 0), 3), root_seen)
            uses[block] = uses.get(block, 0) + 1
            kept = upcoming[position] < NEVER and bool(belady[upcoming[position]])
            tally = counts.setdefault(cls, [0, 0])
            tally[0] += 1
            tally[1] += kept
    total = sum(n for n, _ in counts.values())
    kept_all = sum(k for _, k in counts.values())
    majority = sum(max(k, n - k) for n, k in counts.values())
    return majority / total, max(kept_all, total - kept_all) / total


def describe(ids: list[int], offsets: list[int], capacity: int, upcoming: list[int]) -> dict:
    """Miss ratios of LRU and Belady and the shape of the accesses only Belady hits."""
    lru, bel = lru_hits(ids, offsets, capacity), belady_hits(ids, offsets, capacity, upcoming)
    only = bel & ~lru
    gaps, uses, depths = [], [], []
    last: dict[int, int] = {}
    count: dict[int, int] = {}
    for r, (a, b) in enumerate(zip(offsets, offsets[1:])):
        for position in range(a, b):
            block = ids[position]
            if only[position]:
                gaps.append((position - last[block]) / capacity)
                uses.append(count[block])
                depths.append(position - a)
            last[block] = position
            count[block] = count.get(block, 0) + 1
    quantiles = (0.1, 0.5, 0.9)

    def q(values: list[float]) -> list[float]:
        return [round(float(v), 2) for v in np.quantile(values, quantiles)] if values else []

    oracle = frequency_oracle_hits(ids, offsets, capacity)
    dead_first = dead_first_hits(ids, offsets, capacity, upcoming)
    one_use_first = one_use_first_hits(ids, offsets, capacity)
    by_class, constant = class_accuracy(ids, offsets, bel, upcoming)
    return {"capacity": capacity, "lru_miss": 1 - lru.mean(), "belady_miss": 1 - bel.mean(),
            "frequency_oracle_miss": 1 - oracle.mean(), "dead_first_miss": 1 - dead_first.mean(),
            "one_use_first_miss": 1 - one_use_first.mean(),
            "class_accuracy": by_class, "constant_accuracy": constant,
            "belady_hits_lru_also": float((bel & lru).sum() / max(1, bel.sum())),
            "belady_only_share": float(only.sum() / len(ids)),
            "gap_capacities_q10_50_90": q(gaps), "prior_uses_q10_50_90": q(uses), "depth_q10_50_90": q(depths),
            "beyond_2_capacities": float(np.mean(np.array(gaps) > 2.0)) if gaps else 0.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options and the trace (``args.ids``, ``args.offsets``), every one checked before any
    replay: a bad capacity, an unwritable ``--json``, or a trace that is missing, malformed or
    of steps ends in one line (exit 2)."""
    return parse_checked(analysis_parser(__doc__), argv)


def analysis_parser(doc: str) -> ScriptParser:
    """The options the gap-analysis scripts share: a request trace, ``--capacity`` (a comma
    list of capacities in blocks) and ``--json``; ``doc``'s first line describes the script."""
    parser = ScriptParser(description=doc.split("\n")[0])
    parser.add_argument("trace", help="request trace file or kv-cache-tester folder")
    parser.add_argument("--capacity", type=positive_ints, default="1000,4000,16000",
                        help="comma list of capacities in blocks")
    parser.add_argument("--json", help="write the rows here")
    return parser


def parse_checked(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser``'s options and the trace (``args.ids``, ``args.offsets``), every one checked
    before any replay: an unwritable ``--json`` or a trace that is missing, malformed or of
    steps ends in one line (exit 2). A capacity given twice is replayed once (in the order given)."""
    args = parser.parse_args(argv)
    args.capacity = list(dict.fromkeys(args.capacity))
    refuse_bad_outputs(parser, {"--json": args.json}, inputs=[args.trace])
    args.ids, args.offsets = checked_requests(parser, args.trace)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ids, offsets = args.ids, args.offsets
    upcoming = next_uses(ids)
    rows = [describe(ids, offsets, capacity, upcoming) for capacity in args.capacity]
    print(f"{'capacity':>8} {'LRU':>7} {'Belady':>7} {'freq':>7} {'dead1st':>7} {'1use1st':>7} {'class':>5} {'const':>5} {'both':>6} "
          f"{'B only':>7} {'gap/capacity q10,50,90':>24} {'>2 cap':>7} {'prior uses q10,50,90':>21} {'depth q10,50,90':>18}")
    for row in rows:
        print(f"{row['capacity']:>8} {row['lru_miss']:7.4f} {row['belady_miss']:7.4f} {row['frequency_oracle_miss']:7.4f} "
              f"{row['dead_first_miss']:7.4f} {row['one_use_first_miss']:7.4f} {row['class_accuracy']:5.3f} {row['constant_accuracy']:5.3f} "
              f"{row['belady_hits_lru_also']:6.2f} "
              f"{row['belady_only_share']:7.4f} {str(row['gap_capacities_q10_50_90']):>24} {row['beyond_2_capacities']:7.2f} "
              f"{str(row['prior_uses_q10_50_90']):>21} {str(row['depth_q10_50_90']):>18}")
    if args.json:  # whole or not at all
        replace_file(args.json, json.dumps(rows, indent=2, allow_nan=False), f"--json {args.json}")


if __name__ == "__main__":
    main()
