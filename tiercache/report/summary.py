"""What a report concludes from its runs: groups, the best online policy, the gap it closes.

The gap closed by a policy at one capacity is ``(miss_LRU - miss_policy) / (miss_LRU -
miss_Belady)``: 0 is no better than LRU, 1 is as good as the offline optimum. It is only
defined where LRU and Belady ran at the same capacity, semantics and mode, and LRU is not
already optimal.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..errors import UserError
from ..results import Mode, Semantics
from .model import Run

__all__ = ["BELADY", "BASELINE", "is_offline", "policy_labels", "by_group", "gap_closed", "CapacityBest", "best_per_capacity",
           "Payoff", "hierarchy_payoffs"]

BELADY = "belady"
BASELINE = "lru"
# Names of offline oracles that may come from results files whose policy is not registered here.
_OFFLINE_NAMES = frozenset({"belady", "min", "opt"})


def is_offline(policy: str) -> bool:
    """True for policies that read the future (Belady): they bound, they do not compete."""
    from tiercache.policies import get_eviction  # registry import is lazy and torch-free

    try:
        return bool(getattr(get_eviction(policy), "needs_future", False))
    except UserError:
        return policy.strip().lower() in _OFFLINE_NAMES


def policy_labels(runs: tuple[Run, ...] | list[Run]) -> list[str]:
    """Policy labels in legend order: LRU first, others as first seen, offline ones last."""
    labels = list(dict.fromkeys(run.label for run in runs))
    offline = {run.label for run in runs if is_offline(run.policy)}
    first = [label for label in labels if label == BASELINE]
    middle = [label for label in labels if label != BASELINE and label not in offline]
    return first + middle + [label for label in labels if label in offline]


def by_group(runs: tuple[Run, ...] | list[Run]) -> dict[tuple[Semantics, Mode], list[Run]]:
    """Runs keyed by (semantics, mode): the runs one miss-ratio plot compares."""
    groups: dict[tuple[Semantics, Mode], list[Run]] = defaultdict(list)
    for run in runs:
        groups[(run.semantics, run.mode)].append(run)
    return dict(groups)


def _reference(runs: list[Run], policy: str) -> dict[int, Run]:
    """Runs of one plain policy (default admission) by capacity."""
    return {r.capacity_blocks: r for r in runs if r.policy == policy and r.label == policy}


def gap_closed(run: Run, lru: Run | None, belady: Run | None) -> float | None:
    """Fraction of the LRU-to-Belady miss-ratio gap that ``run`` closes, or None if undefined."""
    if lru is None or belady is None:
        return None
    gap = lru.miss_ratio - belady.miss_ratio
    if gap <= 0:
        return None  # LRU already optimal here: nothing to close
    return (lru.miss_ratio - run.miss_ratio) / gap


def gaps_for(runs: list[Run]) -> dict[tuple, float | None]:
    """Gap closed of every run, by run key, computed within each (semantics, mode) group."""
    gaps: dict[tuple, float | None] = {run.key: None for run in runs if run.is_fleet}  # a fleet is no capacity point
    for group in by_group([run for run in runs if not run.is_fleet]).values():
        lru, belady = _reference(group, BASELINE), _reference(group, BELADY)
        for run in group:
            cap = run.capacity_blocks
            gaps[run.key] = gap_closed(run, lru.get(cap), belady.get(cap))
    return gaps


@dataclass(frozen=True)
class CapacityBest:
    """The best online policy at one capacity of one (semantics, mode) group."""

    semantics: Semantics
    mode: Mode
    capacity_blocks: int
    best: Run
    lru: Run | None
    belady: Run | None

    @property
    def gap_closed(self) -> float | None:
        """Share of the LRU-Belady gap the best policy closes."""
        return gap_closed(self.best, self.lru, self.belady)


def best_per_capacity(runs: tuple[Run, ...] | list[Run]) -> list[CapacityBest]:
    """One entry per (semantics, mode, capacity) with at least one online run.

    Ties go to the policy listed first in legend order, so LRU wins a tie with itself.
    """
    runs = [r for r in runs if not r.is_fleet]  # a fleet replay is a configuration, not a capacity point
    order = {label: i for i, label in enumerate(policy_labels(runs))}
    result = []
    for (semantics, mode), group in by_group(runs).items():
        lru, belady = _reference(group, BASELINE), _reference(group, BELADY)
        for cap in sorted({r.capacity_blocks for r in group}):
            online = [r for r in group if r.capacity_blocks == cap and not is_offline(r.policy)]
            if online:
                best = min(online, key=lambda r: (r.miss_ratio, order[r.label]))
                result.append(CapacityBest(semantics, mode, cap, best, lru.get(cap), belady.get(cap)))
    return result


@dataclass(frozen=True)
class Payoff:
    """A hierarchy run beside the HBM-only run of the same policy with the hierarchy's HBM capacity."""

    hierarchy: Run
    hbm_only: Run

    @property
    def seconds(self) -> tuple[float, float] | None:
        """Modeled total seconds (HBM only, hierarchy), or None unless both runs have them."""
        alone, tiered = self.hbm_only.modeled_seconds.get("total"), self.hierarchy.modeled_seconds.get("total")
        return None if alone is None or tiered is None else (alone, tiered)

    @property
    def pays_off(self) -> bool:
        """Whether the hierarchy does better: less modeled time where modeled, else fewer misses."""
        if self.seconds is not None:
            return self.seconds[1] < self.seconds[0]
        return self.hierarchy.miss_ratio < self.hbm_only.miss_ratio


def hierarchy_payoffs(runs: tuple[Run, ...] | list[Run]) -> list[Payoff]:
    """Every hierarchy run that has an HBM-only counterpart in ``runs``.

    The counterpart is a single-tier run of the same eviction policy and semantics whose one
    tier is the hierarchy's top tier at the same capacity (what the hierarchy adds to HBM).
    """
    alone = {(r.policy, r.semantics, r.tiers[0].name, r.capacity_blocks): r
             for r in runs if len(r.tiers) == 1}
    pairs = []
    for run in runs:
        if run.is_hierarchy:
            top = run.tiers[0]
            match = alone.get((run.policy, run.semantics, top.name, top.capacity_blocks))
            if match is not None:
                pairs.append(Payoff(run, match))
    return pairs
