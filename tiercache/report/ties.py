"""What the summary says where the miss ratio cannot rank a cache's policies, and whether
it can advise a Belady run.

In a recorded live decode no block a live sequence holds may leave the tiers, so every
policy misses the same (usually 0%); more generally, a cache whose online runs all miss the
same share has no winner by miss ratio: ``best_per_capacity`` picks one by its tie rule (LRU
first), not because it is better. The key finding of such a cache says the miss ratio cannot
tell the policies apart and compares what does differ: the reads served from HBM, the bytes
moved (with a layout) and the modeled time (with hardware).

A step trace that holds a recorded run's decode fields refuses ``belady`` (``check_run``:
they give no future), so the summary advises adding it only where it can run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import UserError
from ..results import Semantics, TraceKind
from ..sim.loader import Trace, load_trace
from . import fmt
from .lru_curve import same_trace
from .model import ReportData, Run
from .summary import BELADY, CapacityBest, by_layout, is_offline, tier_layout

__all__ = ["tied_runs", "tie_finding", "tie_note", "belady_advice"]

#: What a tied cache's finding compares, in order: a phrase for the leaders, the figure of a
#: run, whether more is better, how to show it.
_MEASURES: tuple[tuple[str, Callable[[Run], float | None], bool, Callable[[float], str]], ...] = (
    ("the most reads from HBM", lambda r: r.tiers[0].hits, True, lambda v: fmt.integer(int(v))),
    ("the fewest bytes", lambda r: sum(r.bytes_moved.values()) if r.bytes_moved else None, False, fmt.size),
    ("the least modeled time", lambda r: r.modeled_seconds.get("total") if r.modeled_seconds else None, False, fmt.seconds),
)
_VERBS = ("serve", "move", "take")


def tied_runs(best: CapacityBest, runs: tuple[Run, ...] | list[Run], candidates: frozenset[str] | None) -> list[Run]:
    """The online runs of ``best``'s cache (among ``candidates``, where given) when there are two
    or more and every one misses the same share; otherwise an empty list."""
    key = (best.semantics, best.mode, tier_layout(best.best), best.best.prefetch)
    group = by_layout([r for r in runs if not r.is_fleet]).get(key, [])
    online = [r for r in group if not is_offline(r) and (candidates is None or r.label in candidates)]
    if len(online) < 2 or len({r.miss_ratio for r in online}) > 1:
        return []
    return online


def tie_finding(best: CapacityBest, tied: list[Run], where: str) -> str:
    """The key finding of a cache whose online runs ``tied`` all miss the same share (``where``
    names the cache): that the miss ratio cannot tell them apart, then what differs."""
    labels = [r.label for r in tied]
    belady = f"; {best.belady.label} {fmt.percent(best.belady.miss_ratio)}" if best.belady is not None else ""
    text = (f"{where}, every online policy misses {fmt.percent(tied[0].miss_ratio)} of accesses ({_listed(labels)}"
            f"{belady}), so the miss ratio cannot tell them apart")
    clauses = [clause for clause in (_compare(tied, measure, verb) for measure, verb in zip(_MEASURES, _VERBS)) if clause]
    if not clauses:
        return f"{text} (nor can the reads served from HBM, the bytes moved or the modeled time, where recorded)."
    return f"{text}; what differs: {'; '.join(clauses)}."


def tie_note(tied: list[CapacityBest]) -> str:
    """The sentence under the best table on its caches ``tied`` (at least one), whose online
    runs all miss the same share."""
    caches = "one cache" if len(tied) == 1 else f"{len(tied)} caches"
    why = (" (in a recorded decode no block a live sequence holds leaves the tiers)"
           if any(b.semantics is Semantics.DECODE for b in tied) else "")
    return (f"In {caches} every online policy misses the same share{why}, so the table's pick there is the tie "
            "rule's (LRU first), not a better policy; the key findings compare those policies by what differs.")


def belady_advice(data: ReportData, trace: str | Trace | None) -> str:
    """What follows "no gap closed is measured" where no Belady run is in the results: how to
    get one, or (a step trace with a recorded run's decode fields) why none can be made."""
    if data.trace.kind is not TraceKind.STEPS:
        return f" (add {BELADY} to --policy for them)"
    recorded = _recorded(data, trace)
    if recorded:
        return (f"; none can be made on this trace: {BELADY} needs the future (next uses), which a decode run "
                "recorded live (its optional decode fields) does not give")
    condition = (", without --prefetch; a step trace recorded from a live decode refuses it" if recorded is None else
                 ", without --prefetch" if any(r.prefetch not in ("none", None) for r in data.runs) else "")
    return f" (add {BELADY} to --policy for them{condition})"


def _recorded(data: ReportData, trace: str | Trace | None) -> bool | None:
    """Whether the results' step trace holds a recorded run's decode fields; None when the trace
    is not at hand (``trace``, or the recorded path, missing or not the results' own)."""
    if isinstance(trace, Trace):
        return bool(trace.steps.decode) if trace.fingerprint == data.trace.fingerprint and trace.steps else None
    path = trace or data.trace.path
    try:
        if not Path(path).is_file() or not same_trace(path, data.trace.fingerprint):
            return None
        loaded = load_trace(path)
    except (UserError, OSError):
        return None
    return bool(loaded.steps is not None and loaded.steps.decode)


def _compare(runs: list[Run], measure: tuple, verb: str) -> str | None:
    """``arc serves the most reads from HBM (38; lru 31)``; None where a run lacks the figure
    or every run has the same."""
    phrase, figure, more_is_better, show = measure
    values = [figure(r) for r in runs]
    if any(v is None for v in values) or len(set(values)) == 1:
        return None
    best = max(values) if more_is_better else min(values)
    leaders = [r.label for r, v in zip(runs, values) if v == best]
    others = ", ".join(f"{r.label} {show(v)}" for r, v in zip(runs, values) if v != best)
    return f"{_listed(leaders)} {verb}{'s' if len(leaders) == 1 else ''} {phrase} ({show(best)}; {others})"


def _listed(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
