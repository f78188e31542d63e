"""What a report concludes from its runs: groups, the best online policy, the gap it closes.

The gap closed by a policy in one cache is ``(miss_LRU - miss_policy) / (miss_LRU -
miss_Belady)``: 0 is no better than LRU, 1 is as good as Belady's replay. Only in one tier in
object semantics is Belady's MIN the offline optimum, so that no gap closed passes 1
(``belady_is_bound``). In prefix semantics it keeps blocks a request will recompute anyway
after an earlier miss, and in a hierarchy MIN per tier, with promotions and demotions, is not
the hierarchy's optimum: a policy can miss less than Belady's replay there, and its gap closed
is then above 1 (reported as it is, never clipped, with a note: ``beats_belady``). It is only
defined where LRU and Belady ran over the same tier layout (the tiers' names, capacities and
codecs, fastest first), semantics and mode, with the same prefetch policy as the run, and LRU
misses more than Belady's replay. The references are the plain ``lru`` and ``belady`` runs
(admission ``always``, placement ``top``); a cache that holds neither measures each run against
the ``lru`` and ``belady`` runs made with its own admission and placement (``lru+tinylfu`` and
``belady+tinylfu``), labelled so, with a note that such a Belady is no bound (``references``,
``own_references``); a cache that holds one plain run of the two gives no gap closed
(``half_references``: beside a plain ``lru`` the filtered pair would credit a run that misses
more than it). Two hierarchies with
the same total capacity (HBM 5 + DRAM 35 and HBM 20 + DRAM 20) are different caches: each has its
own LRU and Belady references. A decode
replay with a prefetch policy is another cache again (what it misses is not what eviction
alone misses); as Belady cannot prefetch, such a run gets no gap, and a run whose prefetch
policy was not recorded (results versions 3 to 6) is compared with nothing.

Ties for the best online policy go to LRU (a policy that only ties it does not beat it), then
to a run with a gap closed, then to the label first in alphabetical order: the same runs name
the same winner, whatever the order of the files or of ``--policy``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping

from ..config import REMOTE_TIER, TIER_NAMES
from ..errors import UserError
from ..results import Mode, Semantics, TierRecord
from . import fmt
from .model import Run, run_label

__all__ = ["BELADY", "BASELINE", "is_offline", "is_belady", "policy_labels", "by_group", "tier_layout", "by_layout", "gap_closed",
           "references", "is_plain", "OWN_REFERENCES", "OWN_NOT_BOUND", "own_references", "half_references",
           "run_references", "belady_is_bound", "beats_belady", "beats_plain_belady", "gap_text", "beyond_clause",
           "belady_caveat", "BEYOND_BELADY",
           "CapacityBest", "best_per_capacity", "unreferenced_prefetch", "layouts_need_naming", "is_background",
           "background_seconds", "request_path_seconds", "request_seconds", "Payoff", "hierarchy_payoffs"]

BELADY = "belady"
BASELINE = "lru"
# Names of offline oracles that may come from results files whose policy is not registered here.
_OFFLINE_NAMES = frozenset({"belady", "min", "opt"})


def is_offline(run: Run | str) -> bool:
    """True for a run whose policy reads the future (Belady): a reference, it does not compete.

    A run says so itself (``Run.offline``, recorded since results version 8), so one results
    file gives the same answer wherever the report is built, whether or not an out-of-tree
    policy's module imports there. Where that is not recorded (older files), or given only a
    policy name, the registry answers (importing an out-of-tree ``module:Class``), and failing
    that the names ``belady``, ``min`` and ``opt``.
    """
    if not isinstance(run, str) and run.offline is not None:
        return run.offline
    policy = run if isinstance(run, str) else run.policy
    from tiercache.policies import get_eviction  # registry import is lazy and torch-free

    try:
        return bool(getattr(get_eviction(policy), "needs_future", False))
    except UserError:
        return policy.strip().lower() in _OFFLINE_NAMES


def is_belady(run: Run) -> bool:
    """Whether ``run`` replayed Belady's MIN (the registry's ``belady``): the only offline
    policy a report calls the bound (where ``belady_is_bound``); any other that reads the
    future (a ``module:Class`` with ``needs_future``) is a reference, which a policy can beat."""
    return run.policy == BELADY


def policy_labels(runs: tuple[Run, ...] | list[Run]) -> list[str]:
    """Policy labels in legend order: LRU first, others as first seen, offline ones last."""
    labels = list(dict.fromkeys(run.label for run in runs))
    offline = {run.label for run in runs if is_offline(run)}
    first = [label for label in labels if label == BASELINE]
    middle = [label for label in labels if label != BASELINE and label not in offline]
    return first + middle + [label for label in labels if label in offline]


def by_group(runs: tuple[Run, ...] | list[Run]) -> dict[tuple[Semantics, Mode], list[Run]]:
    """Runs keyed by (semantics, mode): the runs one miss-ratio plot compares."""
    groups: dict[tuple[Semantics, Mode], list[Run]] = defaultdict(list)
    for run in runs:
        groups[(run.semantics, run.mode)].append(run)
    return dict(groups)


def tier_layout(run: Run) -> tuple[tuple[str, int, str], ...]:
    """The run's tiers as (name, capacity in blocks, codec), fastest first.

    Runs of one semantics and mode compare one-to-one only over the same layout; the total
    capacity alone does not name a cache.
    """
    return run.tier_shape


def by_layout(runs: tuple[Run, ...] | list[Run]) -> dict[tuple[Semantics, Mode, tuple, str | None], list[Run]]:
    """Runs keyed by (semantics, mode, tier layout, prefetch policy): the runs one gap-closed
    figure compares.

    Keys come in ``by_group`` order, and within a group by total capacity, then layout, then
    prefetch (``none`` first, then by name, not recorded last).
    """
    result: dict[tuple[Semantics, Mode, tuple, str | None], list[Run]] = {}
    for (semantics, mode), group in by_group(runs).items():
        caches: dict[tuple, list[Run]] = defaultdict(list)
        for run in group:
            caches[(tier_layout(run), run.prefetch)].append(run)
        for layout, prefetch in sorted(caches, key=_cache_order):
            result[(semantics, mode, layout, prefetch)] = caches[(layout, prefetch)]
    return result


def _cache_order(cache: tuple[tuple, str | None]) -> tuple:
    layout, prefetch = cache
    return sum(t[1] for t in layout), layout, prefetch is None, prefetch != "none", prefetch or ""


def _reference(runs: list[Run], policy: str, like: Run | None = None) -> Run | None:
    """The run of ``policy`` among runs of one cache (``by_layout``: one prefetch policy) made
    with ``like``'s admission and placement, or where ``like`` is None the plain one (default
    admission and placement); None where there is none or its prefetch policy is not recorded,
    since runs of unknown prefetch cannot be known to compare."""
    wanted = policy if like is None else run_label(policy, like.admission, like.placement)
    return next((r for r in runs if r.policy == policy and r.prefetch is not None
                 and run_label(r.policy, r.admission, r.placement) == wanted), None)


def is_plain(run: Run) -> bool:
    """Whether ``run`` ran with the default admission (``always``) and placement (``top``)."""
    return run_label(run.policy, run.admission, run.placement) == run.policy


def references(runs: list[Run], run: Run) -> tuple[Run | None, Run | None]:
    """The LRU and Belady runs that ``run``'s gap closed is measured against, among the runs of
    its cache (``by_layout``): the plain ``lru`` and ``belady`` where either is there (one
    alone: no gap); where neither is, the two made with ``run``'s own admission and placement
    (``lru+tinylfu`` and ``belady+tinylfu``) where both are; else none.

    Invariants: where both are given, they share one admission and placement; a run is never
    measured against a filtered pair in a cache that holds a plain ``lru`` (which it may miss
    more than) or a plain ``belady``.
    """
    plain = _reference(runs, BASELINE), _reference(runs, BELADY)
    if any(ref is not None for ref in plain):
        return plain
    own = _reference(runs, BASELINE, run), _reference(runs, BELADY, run)
    return own if all(ref is not None for ref in own) else (None, None)


#: Which references a cache without plain ones takes (``references``), for table notes.
OWN_REFERENCES = (f"where a cache holds no plain {BASELINE} and {BELADY} runs (admission always, placement top), the "
                  f"gap closed is measured against the {BASELINE} and {BELADY} runs made with the policy's own "
                  "admission and placement")
#: What such a Belady is (it always goes with ``OWN_REFERENCES``).
OWN_NOT_BOUND = (f"such a {BELADY} (Belady's MIN behind an admission filter, or with a placement other than top) is no "
                 f"bound of anything: the filter or placement keeps MIN from storing what it would, so the plain "
                 f"{BELADY} may miss less and a policy may miss less than it (its gap closed then passes 100%, marked with "
                 f"the reference's label, as \"(beats {BELADY}+tinylfu)\")")


def own_references(pairs) -> str | None:
    """Two sentences (no final full stop) on the (lru, belady) reference pairs of ``pairs``
    that are not the plain runs (``references``), naming them, and that such a Belady is no
    bound (``OWN_NOT_BOUND``); None when there are none."""
    named = sorted({f"{lru.label} and {belady.label}" for lru, belady in pairs
                    if lru is not None and belady is not None and not is_plain(lru)})
    return f"{OWN_REFERENCES}, labelled so: {'; '.join(named)}. {OWN_NOT_BOUND[0].upper()}{OWN_NOT_BOUND[1:]}" if named else None


def half_references(runs: list[Run] | int) -> str | None:
    """A sentence (no full stop) on the caches of ``runs`` (or that many caches) that hold one
    plain reference of the two beside runs made with another admission or placement, which
    get no gap closed (``references``); None when there are none."""
    count = runs if isinstance(runs, int) else sum(map(_half_referenced, by_layout([r for r in runs if not r.is_fleet]).values()))
    if not count:
        return None
    return (f"{count} {'cache holds' if count == 1 else 'caches hold'} a plain {BASELINE} run without a plain {BELADY} "
            f"one (or the reverse) beside runs made with another admission or placement: no run there has a gap closed, "
            f"since the {BASELINE} and {BELADY} runs made with a policy's own admission and placement are references "
            f"only where a cache holds neither plain run (beside the plain {BASELINE} they would credit a run that "
            f"misses more than it); add the missing plain run for a gap")


def gap_closed(run: Run, lru: Run | None, belady: Run | None) -> float | None:
    """Fraction of the LRU-to-Belady miss-ratio gap that ``run`` closes, or None if undefined.

    Above 1 where ``run`` misses less than Belady's replay, which only a cache where Belady is
    no bound allows (``belady_is_bound``).
    """
    if lru is None or belady is None:
        return None
    gap = lru.miss_ratio - belady.miss_ratio
    if gap <= 0:
        return None  # LRU misses no more than Belady's replay here: no gap to close
    return (lru.miss_ratio - run.miss_ratio) / gap


def _half_referenced(group: list[Run]) -> bool:
    """Whether a cache's runs (``by_layout``) hold one plain reference of the two beside runs
    made with another admission or placement, which then get no gap (``references``)."""
    return (sum(_reference(group, name) is not None for name in (BASELINE, BELADY)) == 1
            and any(not is_plain(r) for r in group))


def belady_is_bound(run: Run) -> bool:
    """Whether Belady's MIN is the offline optimum of ``run``'s cache, so no policy can miss less.

    True only for one tier in object semantics: every access is one lookup and every miss is
    stored (no admission policy applies to one tier), which is the paging problem MIN solves.
    In prefix semantics MIN keeps blocks a request recomputes anyway after an earlier miss, in a
    hierarchy MIN per tier (with promotions and demotions) is not the hierarchy's optimum, and
    in decode semantics it is not shown to be one: there Belady's replay is a reference only.
    """
    return run.semantics is Semantics.OBJECT and not run.is_hierarchy and not run.is_fleet


def beats_belady(run: Run, belady: Run | None) -> bool:
    """Whether ``run`` misses less than ``belady``, Belady's replay of the same cache (possible
    only where ``belady_is_bound`` is False, or ``belady`` is not the plain run)."""
    return belady is not None and run.miss_ratio < belady.miss_ratio


def beats_plain_belady(run: Run | None, belady: Run | None) -> bool:
    """``beats_belady`` against the plain ``belady`` run only (``BEYOND_BELADY`` explains that;
    beating a filtered one is ``OWN_NOT_BOUND``'s)."""
    return run is not None and belady is not None and is_plain(belady) and beats_belady(run, belady)


def gap_text(gap: float, reference: str = BELADY) -> str:
    """A gap closed as a percentage, as it is (never clipped); above 100% it says the policy
    missed less than ``reference``, the label of the Belady run it was measured against:
    ``200.0% (beats belady)``, ``120.0% (beats belady+tinylfu)``."""
    text = fmt.percent(gap)
    return f"{text} (beats {reference})" if gap > 1 else text


def beyond_clause(belady: Run) -> str:
    """A finding's clause for a policy that missed less than ``belady`` (its reference): why
    that is possible, for the plain run or for one made with an admission filter or placement."""
    if is_plain(belady):
        return (f"; it misses less than {BELADY}'s replay, which is no bound here (Belady's MIN is the offline "
                "optimum only in one tier in object semantics)")
    return (f"; it misses less than {belady.label}, Belady's replay with that admission and placement, which is no "
            f"bound (the filter or placement keeps MIN from storing what it would; the plain {BELADY} may miss less)")


#: Why Belady's replay is no bound, by kind of cache (``belady_caveat``).
_NOT_BOUND_WHY = {
    "prefix": "In prefix semantics MIN keeps blocks that a request recomputes anyway after an earlier miss.",
    "hierarchy": "In a hierarchy, MIN in each tier (with promotions and demotions) is not the optimum of the whole.",
}
#: What a gap closed above 100% (or a miss ratio below Belady's) means, for table notes.
BEYOND_BELADY = (f"a gap closed above 100% (or a miss ratio below {BELADY}'s) means the policy missed less than "
                 f"{BELADY}'s replay, which is the offline optimum only in one tier in object semantics (in prefix "
                 "semantics and in a hierarchy it is not)")


def belady_caveat(runs: list[Run]) -> str | None:
    """Sentences on the caches of ``runs`` where Belady's replay is no bound (``belady_is_bound``):
    why, and that a policy may miss less than it there and close more than 100% of the gap;
    None if there are none. Ends with a full stop."""
    engine = [r for r in runs if not r.is_fleet]
    where = _where_not_bound(engine)
    if not where:
        return None
    why = [text for kind, text in _NOT_BOUND_WHY.items()
           if any(r.is_hierarchy if kind == "hierarchy" else r.semantics.value == kind for r in engine)]
    return " ".join(why + [f"In {where}, {BELADY} is a reference, Belady's replay, which a policy may beat: it then "
                           f"misses less than {BELADY} and closes more than 100% of the gap (none is defined where {BASELINE} "
                           f"itself misses no more than {BELADY})."])


def _where_not_bound(runs: list[Run]) -> str:
    """``prefix semantics and in hierarchies of tiers``: the kinds of cache of ``runs`` (one-engine
    runs) where Belady is no bound (``belady_is_bound``); empty if none."""
    kinds = [f"{s.value} semantics" for s in sorted({r.semantics for r in runs} - {Semantics.OBJECT}, key=lambda s: s.value)]
    if any(r.is_hierarchy for r in runs):
        kinds.append("hierarchies of tiers")
    return " and in ".join(kinds)


def run_references(runs: list[Run]) -> dict[tuple, tuple[Run | None, Run | None]]:
    """Each run's (lru, belady) references (``references``), by run key: LRU and Belady over the
    same (semantics, mode, tier layout) made with the same prefetch policy; none for a fleet run."""
    refs: dict[tuple, tuple[Run | None, Run | None]] = {run.key: (None, None) for run in runs if run.is_fleet}
    for group in by_layout([run for run in runs if not run.is_fleet]).values():
        for run in group:
            refs[run.key] = references(group, run)
    return refs


def gaps_for(runs: list[Run]) -> dict[tuple, float | None]:
    """Gap closed of every run, by run key, against its references (``run_references``)."""
    by_run = {run.key: run for run in runs}
    return {key: gap_closed(by_run[key], *refs) for key, refs in run_references(runs).items()}


@dataclass(frozen=True)
class CapacityBest:
    """The best online policy in one cache: one (semantics, mode, tier layout, prefetch policy).

    Invariant: ``best``, ``lru`` and ``belady`` (where not None) share that tier layout and
    prefetch policy (a recorded one: runs whose prefetch was not recorded have no references);
    ``lru`` and ``belady`` are ``best``'s references (``references``); ``half_referenced``:
    the cache holds one plain reference of the two beside runs made with another admission or
    placement, so none of them has a gap (``half_references``).
    """

    semantics: Semantics
    mode: Mode
    capacity_blocks: int
    best: Run
    lru: Run | None
    belady: Run | None
    half_referenced: bool = False

    @property
    def gap_closed(self) -> float | None:
        """Share of the LRU-Belady gap the best policy closes (above 1 where it beats Belady's replay)."""
        return gap_closed(self.best, self.lru, self.belady)

    @property
    def beats_belady(self) -> bool:
        """Whether the best policy misses less than Belady's replay of this cache (never where
        ``belady_is_bound``)."""
        return beats_belady(self.best, self.belady)

    @property
    def tiers(self) -> tuple[TierRecord, ...]:
        """The tiers of this cache, fastest first."""
        return self.best.tiers


def best_per_capacity(runs: tuple[Run, ...] | list[Run], candidates: frozenset[str] | None = None) -> list[CapacityBest]:
    """One entry per cache (semantics, mode, tier layout, prefetch policy) with at least one
    online run (whose label is among ``candidates``, where given), in ``by_layout`` order.

    Ties go to LRU (of that cache: the plain reference run, then an ``lru`` run with other
    admission or placement), then to a run with both references (``references``: one with a
    gap closed), then to the label first in alphabetical order: the winner
    depends on the runs only, never on the order of files or policies. ``candidates`` limits
    the winner only: the references are the cache's whatever it is (``compare --split`` picks
    among its ``--policy`` list, not the plain ``lru`` it adds as a reference).
    """
    runs = [r for r in runs if not r.is_fleet]  # a fleet replay is a configuration, not a capacity point
    result = []
    for (semantics, mode, _, _), group in by_layout(runs).items():
        online = [r for r in group if not is_offline(r) and (candidates is None or r.label in candidates)]
        if online:
            lru = _reference(group, BASELINE)
            best = min(online, key=lambda r: (r.miss_ratio, r is not lru, r.policy != BASELINE,
                                              None in references(group, r), r.label))
            result.append(CapacityBest(semantics, mode, best.capacity_blocks, best, *references(group, best),
                                       half_referenced=_half_referenced(group)))
    return result


def unreferenced_prefetch(best: list[CapacityBest]) -> str | None:
    """A sentence on the caches of ``best`` made with a prefetch policy (or with one not
    recorded), which have no gap closed: Belady cannot prefetch, and runs made otherwise are
    not their references; None when there are none."""
    kinds = sorted({"not recorded" if b.best.prefetch is None else b.best.prefetch for b in best if b.best.prefetch != "none"})
    if not kinds:
        return None
    count = sum(b.best.prefetch != "none" for b in best)
    unknown = "; a prefetch policy not recorded, by results files before schema 7, matches none" \
        if "not recorded" in kinds else ""
    return (f"{count} of {len(best)} caches hold decode runs with prefetch {', '.join(kinds)}: their gap closed is left "
            f"out, since their {BASELINE} and {BELADY} references must be made with the same prefetch policy "
            f"({BELADY} cannot prefetch{unknown})")


def layouts_need_naming(runs: list[Run]) -> bool:
    """Whether capacity alone does not name each run's cache, so a table must show its tiers:
    some run is a hierarchy or quantised, or two layouts of one (semantics, mode) share a capacity."""
    if any(r.is_hierarchy or r.tiers[0].codec != "none" for r in runs):
        return True
    layouts = {(r.semantics, r.mode, tier_layout(r)) for r in runs}
    return len(layouts) != len({(s, m, sum(t[1] for t in shape)) for s, m, shape in layouts})


#: Tiers fastest first, the shared remote tier last: a link to a later one moves blocks down.
_SPEED_ORDER = TIER_NAMES + (REMOTE_TIER,)


def is_background(link: str) -> bool:
    """Whether ``link`` (``"src->dst"`` of ``modeled_seconds``) moves blocks down, away from
    HBM: a write-back or a demotion, which runs beside the requests on its own link (the link
    model gives every directed link its own bandwidth). ``recompute``, loads towards HBM and
    any name that is not a link between known tiers are on the request path."""
    src, arrow, dst = link.partition("->")
    known = arrow and src in _SPEED_ORDER and dst in _SPEED_ORDER
    return bool(known) and _SPEED_ORDER.index(dst) > _SPEED_ORDER.index(src)


def background_seconds(seconds: Mapping[str, float]) -> dict[str, float]:
    """The busy seconds of each background link (``is_background``) of a run's ``modeled_seconds``."""
    return {link: value for link, value in seconds.items() if is_background(link)}


def request_path_seconds(seconds: Mapping[str, float]) -> float:
    """Recompute plus every load of a run's ``modeled_seconds``, counted serially: all but the
    background links and the ``total``."""
    return sum(value for link, value in seconds.items() if link != "total" and not is_background(link))


def request_seconds(seconds: Mapping[str, float]) -> float:
    """How long a run's requests take in the model: the request path, or the busiest
    background link where it is busy longer (the requests cannot finish before the writes they
    leave behind: a link cannot carry more than its busy seconds' worth)."""
    return max([request_path_seconds(seconds), *background_seconds(seconds).values()])


@dataclass(frozen=True)
class Payoff:
    """A hierarchy run beside the HBM-only run of the same policy with the hierarchy's HBM tier.

    The figure that judges it (``measure``): in prefix semantics with hardware, modeled TTFT
    saved (higher is better; background write-backs and demotions run off the TTFT path and
    do not count); otherwise, with hardware, modeled request time (``request_seconds``: recompute
    of misses plus every load towards HBM, counted serially; write-backs and demotions run
    beside it on their own links and count only where one link is busy longer; lower is
    better); without hardware, the miss ratio.
    """

    hierarchy: Run
    hbm_only: Run

    @property
    def ttft_saved(self) -> tuple[float, float] | None:
        """Modeled TTFT saved (HBM only, hierarchy), or None unless both runs have it."""
        alone, tiered = self.hbm_only.ttft_saved_s, self.hierarchy.ttft_saved_s
        return None if alone is None or tiered is None else (alone, tiered)

    @property
    def request_seconds(self) -> tuple[float, float] | None:
        """Modeled request time (HBM only, hierarchy; ``request_seconds``), or None unless both
        runs have modeled seconds."""
        alone, tiered = self.hbm_only.modeled_seconds, self.hierarchy.modeled_seconds
        return None if "total" not in alone or "total" not in tiered else (request_seconds(alone), request_seconds(tiered))

    @property
    def background(self) -> dict[str, float]:
        """The hierarchy's write-backs and demotions: busy seconds per background link."""
        return background_seconds(self.hierarchy.modeled_seconds)

    @property
    def writes_hold_up(self) -> bool:
        """Whether a background link of the hierarchy is busy longer than its request path, so
        that link's seconds, not the request path's, are its request time."""
        return request_seconds(self.hierarchy.modeled_seconds) > request_path_seconds(self.hierarchy.modeled_seconds)

    @property
    def measure(self) -> str:
        """``"ttft"``, ``"time"`` or ``"misses"``: the figure ``pays_off`` compares."""
        if self.ttft_saved is not None:
            return "ttft"
        return "misses" if self.request_seconds is None else "time"

    @property
    def pays_off(self) -> bool:
        """Whether the hierarchy does better by ``measure``: more TTFT saved, less modeled
        request time, or fewer misses."""
        if self.measure == "ttft":
            return self.ttft_saved[1] > self.ttft_saved[0]
        if self.measure == "time":
            return self.request_seconds[1] < self.request_seconds[0]
        return self.hierarchy.miss_ratio < self.hbm_only.miss_ratio


def hierarchy_payoffs(runs: tuple[Run, ...] | list[Run]) -> list[Payoff]:
    """Every one-engine hierarchy run that has an HBM-only counterpart in ``runs``.

    The counterpart is a one-engine single-tier run of the same eviction policy, semantics and
    (recorded) prefetch policy whose one tier is the hierarchy's top tier (name, capacity and codec): what the hierarchy
    adds to HBM. Fleet runs sum several engines, so they pair with nothing here.
    """
    engine = [r for r in runs if not r.is_fleet]
    alone = {(r.policy, r.semantics, r.prefetch, tier_layout(r)): r for r in engine if len(r.tiers) == 1}
    pairs = []
    for run in engine:
        if run.is_hierarchy and run.prefetch is not None:
            match = alone.get((run.policy, run.semantics, run.prefetch, tier_layout(run)[:1]))
            if match is not None:
                pairs.append(Payoff(run, match))
    return pairs
