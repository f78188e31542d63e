"""Trace replay: the real ``TierManager`` driven by ``SimEngine`` over a recorded trace.

Two semantics for request traces (Mooncake format):

* ``object``: the flat stream of block ids, each an independent object; one-to-one
  comparable with libCacheSim (LRU/FIFO/Belady miss ratios agree exactly).
* ``prefix``: a request uses its longest cached prefix; every block after the first miss
  is recomputed and stored, as a real prefix cache does.

Step traces (long-sequence decode) replay their ``read`` ids as accesses and their
``write`` ids as newly computed blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from tiercache.config import TIER_NAMES, KVLayout, TierConfig
from tiercache.core.manager import TierManager
from tiercache.core.stats import HierarchyStats
from tiercache.errors import UserError
from tiercache.policies import Hints, get_eviction, make_admission, make_eviction

from .engine import SimEngine

__all__ = ["RunSpec", "ReplayData", "replay", "Semantics", "SEMANTICS"]


class Semantics(enum.Enum):
    """How a request trace is replayed (see the module docstring)."""

    OBJECT = "object"
    PREFIX = "prefix"

    @classmethod
    def parse(cls, text: str, option: str = "--semantics") -> "Semantics":
        """The member named by ``text`` (``"object"`` or ``"prefix"``).

        Raises:
            UserError: unknown name; the message lists the known ones.
        """
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise UserError(f"{option}: unknown {text!r}; known: {', '.join(SEMANTICS)}") from None


#: The names of ``Semantics``, as the CLI and results files spell them.
SEMANTICS = tuple(s.value for s in Semantics)


@dataclass(frozen=True)
class RunSpec:
    """One replay: a policy on a hierarchy under a semantics.

    Invariants: ``semantics`` is a ``Semantics`` (a name given as a string is parsed);
    ``tiers`` non-empty, fastest first.
    """

    policy: str
    semantics: Semantics
    tiers: tuple[TierConfig, ...]
    admission: str = "always"
    write_through: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.semantics, Semantics):
            object.__setattr__(self, "semantics", Semantics.parse(str(self.semantics)))

    @property
    def mode(self) -> str:
        """``single``, ``exclusive`` or ``write_through``."""
        if len(self.tiers) == 1:
            return "single"
        return "write_through" if self.write_through else "exclusive"


@dataclass(frozen=True)
class ReplayData:
    """A trace loaded once for many runs, plus what turns blocks into bytes and seconds.

    Invariants: request ``r`` owns ``ids[offsets[r]:offsets[r+1]]``; ``next_use`` aligned
    with ``ids``; for step traces ``is_write`` is aligned with ``ids`` (else None).
    """

    ids: list[int]
    offsets: np.ndarray
    next_use: list[int]
    input_lengths: np.ndarray | None
    is_write: np.ndarray | None
    layout: KVLayout | None
    profile: object | None
    block_tokens: int

    @property
    def n_batches(self) -> int:
        """Requests (or step records)."""
        return len(self.offsets)

    def bounds(self, batch: int) -> tuple[int, int]:
        """Slice of ``ids`` owned by ``batch``."""
        end = self.offsets[batch + 1] if batch + 1 < len(self.offsets) else len(self.ids)
        return int(self.offsets[batch]), int(end)


def build_manager(spec: RunSpec, data: ReplayData) -> tuple[TierManager, SimEngine]:
    """The live manager with a simulated engine for ``spec``."""
    names = tuple(t.name for t in spec.tiers)
    engine = SimEngine(names, data.layout.block_bytes if data.layout else None, data.profile)
    manager = TierManager(
        [(t.name, t.capacity_blocks) for t in spec.tiers],
        [make_eviction(spec.policy, t.capacity_blocks) for t in spec.tiers],
        [make_admission(spec.admission if i > 0 else "always") for i, _ in enumerate(spec.tiers)],
        engine=engine,
        write_through=spec.write_through,
    )
    return manager, engine


def replay(spec: RunSpec, data: ReplayData, on_progress: Callable[[int], None] | None = None) -> dict:
    """Replays ``data`` under ``spec`` and returns the run record (see ``run_record``).

    ``on_progress(n)`` is called with the number of batches done since the last call.
    Admission applies to lower tiers only; the top tier admits every computed block.
    """
    manager, engine = build_manager(spec, data)
    stats = HierarchyStats.for_tiers((t.name, t.capacity_blocks) for t in spec.tiers)
    policy = get_eviction(spec.policy)
    # Hints cost a list per request: build only what the policy reads.
    step = _step_function(spec, data, manager, policy.needs_parents)
    needs_future = policy.needs_future
    started = time.perf_counter()
    saved_tokens = 0
    for batch in range(data.n_batches):
        saved_tokens += step(batch, needs_future)
        if batch % 256 == 255:  # events are counts: draining in chunks changes no total
            stats.consume(manager.events.drain())
            if on_progress is not None:
                on_progress(256)
    stats.consume(manager.events.drain())
    if on_progress is not None:
        on_progress(data.n_batches % 256)
    wall = time.perf_counter() - started
    manager.check_invariants()
    return run_record(spec, data, stats, engine, saved_tokens, wall)


def _hints(data: ReplayData, a: int, b: int, needs_future: bool, needs_parents: bool) -> Hints:
    parents = [None, *data.ids[a : b - 1]] if needs_parents and b > a else None
    return Hints(a, data.next_use[a:b] if needs_future else None, parents)


def _step_function(spec: RunSpec, data: ReplayData, manager: TierManager, needs_parents: bool) -> Callable[[int, bool], int]:
    """The per-batch handler for the trace kind and semantics; returns tokens saved."""
    ids = data.ids

    def object_step(batch: int, needs_future: bool) -> int:
        a, b = data.bounds(batch)
        manager.access(ids[a:b], _hints(data, a, b, needs_future, needs_parents))
        return 0

    def prefix_step(batch: int, needs_future: bool) -> int:
        a, b = data.bounds(batch)
        run, hints = ids[a:b], _hints(data, a, b, needs_future, needs_parents)
        hit = manager.prefix_length(run)
        manager.access(run[:hit], _cut(hints, 0, hit))
        manager.access(run[hit:], _cut(hints, hit, b - a), count_hits=False)
        return min(hit * data.block_tokens, int(data.input_lengths[batch]))

    def decode_step(batch: int, needs_future: bool) -> int:
        a, b = data.bounds(batch)
        writes = data.is_write[a:b]
        reads = [i for i, w in zip(ids[a:b], writes) if not w]
        manager.access(reads, _hints_for(data, a, b, writes, False, needs_future))
        fresh = [k for k in range(a, b) if writes[k - a] and manager.locate(ids[k]) is None]
        future = [data.next_use[k] for k in fresh] if needs_future else None
        manager.insert([ids[k] for k in fresh], Hints(a, future, None) if needs_future else None)
        return 0

    if data.is_write is not None:
        return decode_step
    return prefix_step if spec.semantics is Semantics.PREFIX else object_step


def _cut(hints: Hints, a: int, b: int) -> Hints:
    next_use = None if hints.next_use is None else hints.next_use[a:b]
    parents = None if hints.parents is None else hints.parents[a:b]
    return Hints(hints.time + a, next_use, parents)


def _hints_for(data: ReplayData, a: int, b: int, writes: np.ndarray, want: bool, needs_future: bool) -> Hints | None:
    if not needs_future:
        return None
    return Hints(a, [n for n, w in zip(data.next_use[a:b], writes) if bool(w) == want], None)


def run_record(spec: RunSpec, data: ReplayData, stats: HierarchyStats, engine: SimEngine, saved_tokens: int, wall: float) -> dict:
    """The JSON record of one run (the ``runs`` entries of results.json)."""
    accesses = stats.accesses
    record = {
        "policy": spec.policy,
        "admission": spec.admission,
        "semantics": spec.semantics.value if data.is_write is None else "decode",
        "mode": spec.mode,
        "capacity_blocks": sum(t.capacity_blocks for t in spec.tiers),
        "accesses": accesses,
        "hits": stats.hits,
        "misses": stats.misses,
        "miss_ratio": stats.misses / accesses if accesses else 0.0,
        "hit_ratio": stats.hits / accesses if accesses else 0.0,
        "tiers": [_tier_record(t) for t in stats.tiers],
        "wall_seconds": round(wall, 4),
    }
    if data.layout is not None:
        record["bytes_moved"] = {link: u.bytes for link, u in sorted(engine.usage.items())}
    if data.profile is not None and data.layout is not None:
        record["modeled_seconds"] = _modeled_seconds(stats, engine, data)
    if spec.semantics is Semantics.PREFIX and data.input_lengths is not None:
        record.update(_prefix_figures(stats, engine, data, saved_tokens))
    return record


def _tier_record(counters) -> dict:
    return {
        "name": counters.name,
        "capacity_blocks": counters.capacity_blocks,
        "hits": counters.hits,
        "inserts": counters.inserts,
        "evictions": counters.evictions,
        "demotions": counters.demotions,
        "promotions": counters.promotions,
        "copies": counters.copies,
        "refused": counters.refused,
    }


def _modeled_seconds(stats: HierarchyStats, engine: SimEngine, data: ReplayData) -> dict:
    """Busy seconds per link, recompute time of misses, and their serial sum ("total")."""
    seconds = {link: round(u.seconds, 6) for link, u in sorted(engine.usage.items())}
    seconds["recompute"] = round(stats.misses * data.block_tokens / data.profile.prefill_tokens_per_s, 6)
    seconds["total"] = round(sum(seconds.values()), 6)
    return seconds


def _prefix_figures(stats: HierarchyStats, engine: SimEngine, data: ReplayData, saved_tokens: int) -> dict:
    """Prefill tokens saved against no cache, and modeled TTFT saved when hardware is known.

    TTFT saved = prefill time of the saved tokens minus the modeled busy seconds of the load
    links (``dram->hbm``, ``nvme->dram``, ``nvme->hbm``: a block brought up from a slower tier
    for a hit). Write-backs and demotions (``hbm->dram``, ...) run off the TTFT path and are
    not counted. Every load second is counted in full, serially: an upper bound on their cost,
    since real loads may overlap compute.
    """
    total_tokens = int(data.input_lengths.sum())
    figures = {"prefill_tokens": total_tokens, "prefill_tokens_saved": saved_tokens}
    if data.profile is not None and data.layout is not None:
        rate = data.profile.prefill_tokens_per_s
        figures["ttft_saved_s"] = round(saved_tokens / rate - _load_seconds(engine), 6)
    return figures


def _load_seconds(engine: SimEngine) -> float:
    """Busy seconds of links whose destination tier is faster than their source (loads)."""
    total = 0.0
    for link, usage in engine.usage.items():
        src, _, dst = link.partition("->")
        if TIER_NAMES.index(dst) < TIER_NAMES.index(src):
            total += usage.seconds
    return total


def __getattr__(name: str):
    # ``run_sweep`` lives in sweep.py (which imports this module); re-exported lazily here.
    if name == "run_sweep":
        from .sweep import run_sweep

        return run_sweep
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
