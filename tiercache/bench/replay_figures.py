"""The figures and checks of ``scripts/bench_replay.py``'s side-by-side comparisons, apart
from the runs that produce them (the script replays; this module only counts, checks and
prints, and imports no replay code).

* tiercache against libCacheSim (``Counts``, ``check_counts``, ``policy_row``,
  ``print_policies``): did both sides do the same work, and the rates and ratios of a policy;
* the compiled kernels against the Python manager (``kernel_rows``, ``print_kernel_rates``):
  the same replays both ways, each way in its own interpreter, round by round.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

__all__ = ["MISS_TOLERANCE", "Counts", "check_counts", "policy_row", "print_policies", "counts_verdict", "kernel_rows",
           "print_kernel_rates"]

#: Largest |miss ratio ours - libCacheSim's| accepted per policy: 0 means equal miss counts.
#: ARC learns from a ghost hit one eviction later than libCacheSim (see README); LFU is absent:
#: no agreement is claimed for it, so its counts are printed but not checked.
MISS_TOLERANCE = {"lru": 0.0, "fifo": 0.0, "belady": 0.0, "sieve": 0.0, "s3fifo": 0.0, "arc": 3e-4}


class Counts(NamedTuple):
    """What one run of one side reports having processed: block accesses and misses."""

    accesses: int
    misses: int


def check_counts(policy: str, ours: list[Counts], theirs: list[Counts]) -> list[str]:
    """Why the comparison of ``policy`` does not stand (empty: it does): a side whose runs
    report different counts, sides that processed different numbers of accesses, or miss
    counts apart by more than ``MISS_TOLERANCE`` (as miss ratios; 0: must be equal).

    Args:
        ours: tiercache's counts of every timed run (cold and cached).
        theirs: libCacheSim's counts of every timed run (empty without libCacheSim).
    """
    problems = [f"{policy}: {name}'s runs processed different counts {sorted(set(runs))}"
                for name, runs in (("tiercache", ours), ("libCacheSim", theirs)) if len(set(runs)) > 1]
    if problems or not theirs:
        return problems
    mine, other = ours[0], theirs[0]
    if mine.accesses != other.accesses:
        return [f"{policy}: tiercache processed {mine.accesses:,} accesses, libCacheSim {other.accesses:,}: "
                "not the same work, so the rates do not compare"]
    tolerance = MISS_TOLERANCE.get(policy)
    apart = abs(mine.misses - other.misses) / mine.accesses if mine.accesses else 0.0
    if tolerance is not None and apart > tolerance:
        return [f"{policy}: misses tiercache {mine.misses:,}, libCacheSim {other.misses:,} (miss ratios {apart:.2e} apart; "
                + ("they must be equal)" if tolerance == 0 else f"at most {tolerance:g} accepted)")]
    return []


def policy_row(ours: Counts, cold: list, cached: list, theirs: list, their_counts: Counts | None) -> dict:
    """Rates from median CPU seconds (``time.process_time``: on a shared machine wall time
    also counts time spent descheduled), each side's over the accesses it reported; ratios
    are medians of the per-repeat ratios of those rates, each taken between runs made one
    right after the other. Wall-clock figures are kept too."""
    n = ours.accesses
    cpu = lambda runs: statistics.median(r[1] for r in runs)  # noqa: E731
    wall = lambda runs: statistics.median(r[0] for r in runs)  # noqa: E731
    row = {"tiercache_accesses_per_s": n / cpu(cold), "tiercache_cached_accesses_per_s": n / cpu(cached),
           "tiercache_cpu_s": cpu(cold), "tiercache_cached_cpu_s": cpu(cached), "tiercache_wall_s": wall(cold),
           "tiercache_cached_wall_s": wall(cached), "accesses_tiercache": n,
           "miss_ratio_tiercache": ours.misses / n if n else 0.0, "misses_tiercache": ours.misses}
    if theirs:
        m = their_counts.accesses
        rate_ratio = lambda mine, other, clock: statistics.median(  # noqa: E731
            (n / o[clock]) / (m / t[clock]) for o, t in zip(mine, other, strict=True))
        row.update(libcachesim_accesses_per_s=m / cpu(theirs), libcachesim_cpu_s=cpu(theirs),
                   libcachesim_wall_s=wall(theirs), accesses_libcachesim=m,
                   ratio=rate_ratio(cold, theirs, 1), ratio_cached=rate_ratio(cached, theirs, 1),
                   ratio_wall=rate_ratio(cold, theirs, 0),
                   miss_ratio_libcachesim=their_counts.misses / m if m else 0.0, misses_libcachesim=their_counts.misses)
    return row


def print_policies(result: dict) -> None:
    """The policy comparison: rates per CPU second over each side's own access count, ratios,
    both sides' own miss counts and the counts check (``check_counts``)."""
    print(f"object semantics, one tier of {result['capacity']} blocks, {result['accesses']} block accesses, "
          f"median of {result['repeats']} runs, loading included ({result['timed']})")
    print(f"{'policy':<8} {'tiercache/s':>12} {'cached/s':>12} {'libCacheSim/s':>14} {'ratio':>6} {'cached':>7} "
          f"{'misses ours':>12} {'libCacheSim':>12}  counts   (per CPU second)")
    for name, row in result["policies"].items():
        theirs = f"{row['libcachesim_accesses_per_s']:>14,.0f} {row['ratio']:>6.2f} {row['ratio_cached']:>7.2f}" if "ratio" in row else f"{'-':>14} {'-':>6} {'-':>7}"
        their_misses = f"{row['misses_libcachesim']:>12,}" if "misses_libcachesim" in row else f"{'-':>12}"
        print(f"{name:<8} {row['tiercache_accesses_per_s']:>12,.0f} {row['tiercache_cached_accesses_per_s']:>12,.0f} {theirs} "
              f"{row['misses_tiercache']:>12,} {their_misses}  {counts_verdict(name, row)}")


def counts_verdict(policy: str, row: dict) -> str:
    """One word on the counts check of a row: MISMATCH, equal, within the tolerance, not compared."""
    if row["problems"]:
        return "MISMATCH"
    if "misses_libcachesim" not in row or policy not in MISS_TOLERANCE:
        return "not compared"
    return "equal" if MISS_TOLERANCE[policy] == 0 else f"within {MISS_TOLERANCE[policy]:g}"


def kernel_rows(runs: dict[str, list[dict]]) -> dict:
    """Per case (``policy@capacity``), the kernels against the Python manager over the rounds of
    ``runs`` (``{"kernel": [case -> run], "python": [...]}``, one entry per round, each run
    ``cpu_s``, ``accesses``, ``misses`` and ``kernel``: the path it took): rates from median CPU
    seconds, ``ratio`` the median of the per-round ratios (the kernels' rate over Python's), and
    ``problems`` (empty when the comparison stands): a run that took the other path, or counts
    that differ between runs (the two paths must give the same records).

    Raises:
        ValueError: the sides ran different numbers of rounds.
    """
    kernel, python = runs["kernel"], runs["python"]
    if len(kernel) != len(python) or not kernel:
        raise ValueError(f"kernel_rows: {len(kernel)} kernel rounds against {len(python)} Python rounds")
    rows = {}
    for case in kernel[0]:
        mine, theirs = [r[case] for r in kernel], [r[case] for r in python]
        counts = sorted({(r["accesses"], r["misses"]) for r in mine + theirs})
        problems = [f"{case}: the {side} side took the {'kernel' if side == 'Python' else 'Python'} path"
                    for side, side_runs, wanted in (("kernel", mine, True), ("Python", theirs, False))
                    if any(r["kernel"] is not wanted for r in side_runs)]
        if len(counts) > 1:
            problems.append(f"{case}: the runs counted different (accesses, misses) {counts}: not the same records")
        n = mine[0]["accesses"]
        rows[case] = {"kernel_accesses_per_s": n / statistics.median(r["cpu_s"] for r in mine),
                      "python_accesses_per_s": n / statistics.median(r["cpu_s"] for r in theirs),
                      "ratio": statistics.median(p["cpu_s"] / k["cpu_s"] for k, p in zip(mine, theirs)),
                      "accesses": n, "misses": mine[0]["misses"], "problems": problems}
    return rows


def print_kernel_rates(result: dict) -> None:
    """The table of ``kernel_rows``: block accesses per CPU second both ways, and their ratio."""
    print(f"prefix semantics, one tier, the replay alone (prepared trace), {result['accesses']:,} block accesses, "
          f"median of {result['repeats']} rounds (CPU seconds), each way in its own interpreter:")
    print(f"{'policy':<9} {'capacity':>8} {'kernels/s':>12} {'Python/s':>10} {'kernels/Python':>15}")
    for case, row in result["kernel_rates"].items():
        policy, capacity = case.split("@")
        print(f"{policy:<9} {int(capacity):>8,} {row['kernel_accesses_per_s']:>12,.0f} {row['python_accesses_per_s']:>10,.0f} "
              f"{row['ratio']:>14.1f}x{'  MISMATCH' if row['problems'] else ''}")
