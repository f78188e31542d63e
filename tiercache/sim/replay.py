"""Trace replay: the real ``TierManager`` driven by ``SimEngine`` over a recorded trace.

Two semantics for request traces (Mooncake format):

* ``object``: the flat stream of block ids, each an independent object; one-to-one
  comparable with libCacheSim (LRU/FIFO/Belady miss ratios agree exactly).
* ``prefix``: a request uses its longest cached prefix; every block after the first miss
  is recomputed and stored, as a real prefix cache does.

Step traces (long-sequence decode) replay their ``read`` ids as accesses and their
``write`` ids as newly computed blocks, one record at a time through the live decode
protocol whatever the prefetch policy (``tiercache.sim.decode_replay``); an offline policy's
next use of a block there is its next read before any later write of its id, and a write of
an id still cached refreshes it to the write's own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Iterable

import numpy as np
import psutil

from tiercache.config import TIER_NAMES, CacheConfig, Codec, KVLayout, TierConfig, check_tier_names
from tiercache.core.guards import chain_parents, slice_hints
from tiercache.core.manager import TierManager
from tiercache.core.stats import HierarchyStats, TierCounters
from tiercache.errors import UserError
from tiercache.policies import (ADMISSION, EVICTION, PLACEMENT, PREFETCH, Hints, canonical_name, get_eviction, make_admission,
                                make_eviction, make_placement)
from tiercache.policies.admission_always import AlwaysAdmit
from tiercache.results import Mode, RunRecord, Semantics, TierRecord, TraceKind

from .array_manager import ArrayTierManager, kernel_replay_possible, state_bytes
from .decode_replay import DecodeReplay
from .engine import SimEngine
from .hitcost import HitCost, HitMeter
from .hardware import HardwareProfile
from .loader import Trace
from .prefill import PrefillCost, causal_pairs, mean_read_index
from .prep import dense_and_next_use, step_next_use
from .reuse import reusable_blocks, reusable_caps, saved_prompt_tokens
from .traces import MOONCAKE_BLOCK_TOKENS

__all__ = ["RunSpec", "ReplayData", "replay", "check_run", "check_placement", "use_kernels", "load_kernels", "tier_record",
           "block_tokens_of", "modeled_seconds", "Semantics"]


@dataclass(frozen=True)
class RunSpec:
    """One replay: a policy on a hierarchy under a semantics.

    Invariants: ``semantics`` is a ``Semantics`` (``DECODE`` exactly for step traces, which
    ``replay`` checks); ``tiers`` non-empty, names unique and fastest first (hbm, dram, nvme;
    ``check_tier_names``), as ``CacheConfig`` has them.
    """

    policy: str
    semantics: Semantics
    tiers: tuple[TierConfig, ...]
    admission: str = "always"
    write_through: bool = False
    prefetch: str = "none"
    placement: str = "top"

    def __post_init__(self) -> None:
        if not isinstance(self.semantics, Semantics):
            raise TypeError(f"RunSpec.semantics: a Semantics member, got {self.semantics!r}")
        check_tier_names(self.tiers, "RunSpec.tiers")
        self._canonicalise_names()

    def _canonicalise_names(self) -> None:
        """Records every policy name as registered (``canonical_name``: ``" LRU"`` ->
        ``"lru"``), as the CLI and ``SweepSpec`` do, so a run made through this API is
        labelled, and found as a report's reference, like theirs; frozen, hence setattr."""
        for field, table in (("policy", EVICTION), ("admission", ADMISSION), ("prefetch", PREFETCH),
                             ("placement", PLACEMENT)):
            value = getattr(self, field)
            if not isinstance(value, str):
                raise TypeError(f"RunSpec.{field}: a policy name (str), got {value!r}")
            object.__setattr__(self, field, canonical_name(value, table))

    @property
    def mode(self) -> Mode:
        """One tier, exclusive tiers or write-through."""
        if len(self.tiers) == 1:
            return Mode.SINGLE
        return Mode.WRITE_THROUGH if self.write_through else Mode.EXCLUSIVE


def check_placement(placement: str, cache: CacheConfig | None) -> None:
    """Refuses a placement policy (``top`` too, where the caller knows it was asked for)
    unless ``cache`` is an exclusive hierarchy of two tiers or more: elsewhere there are no
    tiers to place blocks among.

    Raises:
        UserError: names ``placement`` and the hierarchy it needs.
    """
    if cache is None or len(cache.tiers) < 2 or cache.write_through:
        raise UserError(f"--placement {placement}: places blocks among the tiers of an exclusive hierarchy; "
                        "give --tiers with two tiers or more (not --write-through)")


@dataclass(frozen=True)
class ReplayData:
    """A trace prepared once for many runs, plus what turns blocks into bytes and seconds.

    Invariants: batch ``b`` (a request or a step record) owns ``ids[offsets[b]:offsets[b + 1]]``
    (``offsets`` ends with ``len(ids)``); ``next_use`` and ``dense`` are aligned with ``ids``
    (a step trace's ``next_use`` is the next read of an id before any later write of it:
    ``prep.step_next_use``);
    ``dense`` numbers the distinct ids ``0 .. n_ids - 1`` in first-access order; ``profile``
    is set only with a ``layout`` (seconds need bytes). Arrays, not lists: 20 B per access
    (ids 8, next use 8, dense 4), shared with forked workers; the Python manager's path
    builds lists of its own when it runs (``id_list``...).
    """

    trace: Trace
    ids: np.ndarray
    offsets: np.ndarray
    next_use: np.ndarray
    layout: KVLayout | None
    profile: HardwareProfile | None
    block_tokens: int
    dense: np.ndarray
    n_ids: int
    max_count: int

    @classmethod
    def prepare(cls, trace: Trace, layout: KVLayout | None, profile: HardwareProfile | None) -> "ReplayData":
        """The replay arrays of ``trace``; a request block is the trace's (512 tokens in Mooncake), a step block the layout's."""
        if profile is not None and layout is None:
            raise ValueError("ReplayData: a hardware profile needs a layout (bytes per block)")
        block_tokens = block_tokens_of(trace, layout)
        if trace.dense is not None and trace.next_use is not None:  # from the binary trace cache
            dense, nu, n_ids = trace.dense, trace.next_use, int(trace.dense.max(initial=-1)) + 1
        else:
            dense, nu, n_ids = dense_and_next_use(trace.ids)
        if trace.is_write is not None:  # a step trace: a read is a use, a write a new block (step_next_use)
            nu = step_next_use(nu, trace.is_write)
        counts = np.zeros(max(n_ids, 1), dtype=np.int64)  # add.at reads int32 ids in place (bincount made an int64 copy)
        np.add.at(counts, dense, 1)
        max_count = int(counts.max())
        return cls(trace, trace.ids, trace.offsets, nu, layout, profile, block_tokens, dense, n_ids, max_count)

    @property
    def n_batches(self) -> int:
        """Requests (or step records)."""
        return len(self.offsets) - 1

    @property
    def is_write(self) -> np.ndarray | None:
        """Per access, whether a step stores the block (step traces only)."""
        return self.trace.is_write

    def bounds(self, batch: int) -> tuple[int, int]:
        """Slice of ``ids`` owned by ``batch``."""
        return self.offset_list[batch], self.offset_list[batch + 1]

    # Lists for the Python manager's path (slicing lists and hashing ints is what it is fast at).
    @cached_property
    def mean_read_index(self) -> float:
        """The trace's mean read position (``prefill.mean_read_index``), computed once per trace
        (a sweep computes it before forking its workers, which inherit it)."""
        return mean_read_index(self.offsets, self.is_write)

    @cached_property
    def id_list(self) -> list[int]:
        return self.ids.tolist()

    @cached_property
    def offset_list(self) -> list[int]:
        return self.offsets.tolist()

    @cached_property
    def next_use_list(self) -> list[int]:
        return self.next_use.tolist()


def block_tokens_of(trace: Trace, layout: KVLayout | None) -> int:
    """Tokens per block of a replay of ``trace``: a request trace's own (512 in Mooncake, 64 in
    the kv-cache-tester sample, 16 in Bailian), a step block the layout's (1 without one)."""
    if trace.kind is TraceKind.REQUESTS:
        return trace.block_tokens or MOONCAKE_BLOCK_TOKENS
    return layout.block_tokens if layout else 1


def _engine(spec: RunSpec, data: ReplayData) -> SimEngine:
    """The simulated engine of a run: per-link costs, each tier's block in its codec's bytes."""
    names = tuple(t.name for t in spec.tiers)
    return SimEngine(names, data.layout.block_bytes if data.layout else None, data.profile,
                     tier_block_bytes=tuple(t.codec.block_bytes(data.layout) for t in spec.tiers) if data.layout else None,
                     tier_quantised=tuple(t.codec is not Codec.NONE for t in spec.tiers))


def build_manager(spec: RunSpec, data: ReplayData) -> tuple[TierManager, SimEngine]:
    """The live manager with a simulated engine for ``spec``."""
    engine = _engine(spec, data)
    manager = TierManager(
        [(t.name, t.capacity_blocks) for t in spec.tiers],
        [make_eviction(spec.policy, t.capacity_blocks, i) for i, t in enumerate(spec.tiers)],
        [make_admission(spec.admission if i > 0 else "always") for i, _ in enumerate(spec.tiers)],
        engine=engine,
        write_through=spec.write_through,
        placement=None if spec.placement == "top" else make_placement(spec.placement, len(spec.tiers)),
    )
    return manager, engine


def replay(spec: RunSpec, data: ReplayData, on_progress: Callable[[int], None] | None = None) -> RunRecord:
    """Replays ``data`` under ``spec`` and returns the run's record.

    ``on_progress(n)`` is called with the number of batches done since the last call.
    Admission applies to lower tiers only; the top tier admits every computed block.
    """
    if (spec.semantics is Semantics.DECODE) != (data.trace.kind is TraceKind.STEPS):
        raise ValueError(f"replay: {spec.semantics.value} semantics on a {data.trace.kind.value} trace")
    if use_kernels(spec) and kernel_state_fits(spec, data):
        return _replay_kernels(spec, data, on_progress)
    manager, engine = build_manager(spec, data)
    stats = HierarchyStats.for_tiers((t.name, t.capacity_blocks) for t in spec.tiers)
    policy = get_eviction(spec.policy)
    # Hints cost a list per request: build only what the policy reads.
    step = _step_function(spec, data, manager, policy.needs_parents)
    needs_future = policy.needs_future
    meter = HitMeter(engine, len(spec.tiers))
    started = time.perf_counter()
    saved_tokens = np.zeros(data.n_batches, dtype=np.int64)
    for batch in range(data.n_batches):
        saved_tokens[batch] = step(batch, needs_future)
        if batch % 256 == 255:  # events are counts: draining in chunks changes no total
            _consume(manager, stats, meter)
            if on_progress is not None:
                on_progress(256)
    manager.wait_all()  # moves still in flight (a decode run's last prefetches) land, as at the end of a live run
    prefetch_counts = step.finish() if isinstance(step, DecodeReplay) else None
    _consume(manager, stats, meter)
    if on_progress is not None:
        on_progress(data.n_batches % 256)
    wall = time.perf_counter() - started
    manager.check_invariants()
    return run_record(spec, data, stats, meter, saved_tokens, wall, prefetch_counts)


def check_run(spec: RunSpec, trace: Trace) -> None:
    """Refuses, before any replay, a run that ``replay`` could not carry out on ``trace``.

    An offline policy (``needs_future``) runs a plain step trace with next-use hints
    (``DecodeReplay``), but not a recorded decode run's fields nor a prefetch policy: the
    driver's prefetch planning and a recorded run give no next uses.

    A recorded decode run whose sequences hold blocks (``hold`` fields) is refused under
    ``--write-through`` with an admission that does not admit everything, as
    ``TieredKVCache`` refuses it: a held block whose lower copies were refused could only
    stay in HBM.

    Raises:
        UserError: such a run; the message names ``--policy`` and what gives no future, or
            the write-through and admission options.
    """
    decode = trace.steps.decode if trace.kind is TraceKind.STEPS and trace.steps is not None else None
    holds = bool(decode) and any(fields.hold for fields in decode.values())
    if holds and spec.write_through and type(make_admission(spec.admission)) is not AlwaysAdmit:
        raise UserError(f"--write-through with --admission {spec.admission}: the decode cache refuses that hierarchy "
                        f"(a held block whose lower copies were refused could only stay in HBM), so the run recorded in "
                        f"{trace.path} cannot be replayed under it; drop one of them")
    if trace.kind is not TraceKind.STEPS or not get_eviction(spec.policy).needs_future:
        return
    if spec.prefetch != "none":
        raise UserError(f"--policy {spec.policy}: an offline policy needs the future (next uses), which a replay with "
                        f"--prefetch {spec.prefetch} does not give; drop one of them")
    if trace.steps is not None and trace.steps.decode:
        raise UserError(f"--policy {spec.policy}: an offline policy needs the future (next uses), which the decode run "
                        f"recorded in {trace.path} (its optional decode fields) does not give")


def use_kernels(spec: RunSpec) -> bool:
    """Whether ``replay`` runs ``spec`` on the compiled kernels (``ArrayTierManager``): numba
    installed, a kernel for the policy, request semantics, exclusive tiers admitting all, the
    default placement."""
    return (spec.semantics is not Semantics.DECODE and spec.placement == "top"
            and kernel_replay_possible(spec.policy, spec.admission, spec.write_through))


def kernel_state_fits(spec: RunSpec, data: ReplayData, available: int | None = None) -> bool:
    """Whether the kernels' arrays for ``spec`` on ``data`` (they grow with the trace's
    distinct ids, not the capacity) take at most a quarter of ``available`` (default: the
    memory psutil reports available now); otherwise the Python manager replays it, whose
    state grows with the capacity."""
    available = psutil.virtual_memory().available if available is None else available
    return state_bytes(spec.policy, len(spec.tiers), data.n_ids, data.max_count) <= available // 4


#: Requests per compiled call between progress reports.
_KERNEL_CHUNK = 4096


def _replay_kernels(spec: RunSpec, data: ReplayData, on_progress: Callable[[int], None] | None) -> RunRecord:
    """``replay`` on ``ArrayTierManager``: the same record, whole requests per compiled call."""
    engine = _engine(spec, data)
    manager = ArrayTierManager(spec.policy, engine.tier_names, tuple(t.capacity_blocks for t in spec.tiers), data.n_ids,
                               data.max_count)
    manager.set_trace_ids(data.dense, data.ids)
    prefix = spec.semantics is Semantics.PREFIX
    hit_len = np.zeros(max(data.n_batches, 1), dtype=np.int64)
    caps = reusable_caps(data.trace.input_lengths, data.offsets, data.block_tokens, prefix)
    _load_kernels(manager, data, prefix, hit_len)
    started = time.perf_counter()  # the replay alone: the kernels are compiled (or loaded) already
    for first in range(0, data.n_batches, _KERNEL_CHUNK):
        last = min(first + _KERNEL_CHUNK, data.n_batches)
        # prepare's arrays are good: dense ids in 0 .. n_ids - 1 (bincount refuses negatives, n_ids
        # is the largest + 1), offsets from the loader.
        manager.run(data.dense, data.next_use, data.offsets, first, last, prefix, hit_len, trusted=True, caps=caps)
        if on_progress is not None:
            on_progress(last - first)
    wall = time.perf_counter() - started
    manager.check_invariants()
    meter = HitMeter(engine, len(spec.tiers))
    meter.costs = manager.charge(engine)
    saved = np.zeros(data.n_batches, dtype=np.int64)
    if prefix:  # as saved_prompt_tokens, per request
        lengths = data.trace.input_lengths.astype(np.int64)
        saved = np.minimum(hit_len[: data.n_batches] * data.block_tokens, np.maximum(lengths - 1, 0))
    return run_record(spec, data, manager.stats(), meter, saved, wall)


def load_kernels(specs: Iterable[RunSpec], data: ReplayData) -> None:
    """Compiles (first time on this machine) or loads from numba's cache the replay kernels, in
    this process, if any of ``specs`` will replay ``data`` on them. A sweep calls it before it
    forks its workers: they inherit the compiled code, where each would otherwise compile the
    same kernels at the same time (N workers: N times the CPU, and more wall time on a busy
    machine).

    Invariant: replays nothing and changes nothing in ``data``. One compiled signature serves
    every policy, semantics and hierarchy (the chain dispatches on the kernel's number; the
    state arrays' types do not depend on them), so a manager of one id over one tier compiles
    what every run needs. Without numba (or when no run can use the kernels) it does nothing.
    """
    spec = next((s for s in specs if use_kernels(s) and kernel_state_fits(s, data)), None)
    if spec is not None:
        manager = ArrayTierManager(spec.policy, (spec.tiers[0].name,), (1,), 1)
        _load_kernels(manager, data, spec.semantics is Semantics.PREFIX, np.zeros(1, dtype=np.int64))


def _load_kernels(manager: ArrayTierManager, data: ReplayData, prefix: bool, hit_len: np.ndarray) -> None:
    """Makes numba compile (first time on this machine: about a minute) or load from its cache
    the compiled replay for the argument types ``_replay_kernels`` passes, by a call over no
    request, so that a run's ``wall_seconds`` times the replay alone, never the compilation.

    Invariant: the call replays nothing (requests ``0 .. -1``): the manager's state, counters
    and ``hit_len`` are as before it.
    """
    manager.run(data.dense, data.next_use, data.offsets, 0, 0, prefix, hit_len, trusted=True, caps=hit_len)


def _consume(manager: TierManager, stats: HierarchyStats, meter: HitMeter) -> None:
    """Feeds the events drained since the last call to the counters and the hit meter (a
    batch boundary never splits a hit from the event before it: both come from one access)."""
    events = manager.events.drain()
    stats.consume(events)
    meter.consume(events)


def _hints(data: ReplayData, a: int, b: int, needs_future: bool, needs_parents: bool) -> Hints:
    """Hints of batch ``ids[a:b]``: next uses, and each id's parent (``chain_parents``: the id
    before it in the request; the live store gives a request's ids the same, ``request_hints``)."""
    parents = chain_parents(data.id_list[a:b]) if needs_parents and b > a else None
    return Hints(a, data.next_use_list[a:b] if needs_future else None, parents)


def _step_function(spec: RunSpec, data: ReplayData, manager: TierManager, needs_parents: bool) -> Callable[[int, bool], int]:
    """The per-batch handler for the trace kind and semantics; returns tokens saved."""
    ids, input_lengths = data.id_list, data.trace.input_lengths

    def object_step(batch: int, needs_future: bool) -> int:
        a, b = data.bounds(batch)
        manager.access(ids[a:b], _hints(data, a, b, needs_future, needs_parents))
        return 0

    def prefix_step(batch: int, needs_future: bool) -> int:
        a, b = data.bounds(batch)
        run, hints = ids[a:b], _hints(data, a, b, needs_future, needs_parents)
        hit = manager.prefix_length(run[: reusable_blocks(data.block_tokens, int(input_lengths[batch]))])
        # The engine pins the matched prefix while it serves it: its own promotions push none
        # of it out of the hierarchy, so every block counted as reused below is a hit.
        manager.access(run[:hit], slice_hints(hints, 0, hit), keep_all=True)
        manager.access(run[hit:], slice_hints(hints, hit, b - a), count_hits=False)
        return saved_prompt_tokens(hit, data.block_tokens, int(input_lengths[batch]))

    if spec.semantics is Semantics.DECODE:  # one protocol for every --prefetch (decode_replay)
        return DecodeReplay(spec.policy, spec.prefetch, data, manager)
    return prefix_step if spec.semantics is Semantics.PREFIX else object_step


def run_record(spec: RunSpec, data: ReplayData, stats: HierarchyStats, meter: HitMeter, saved_tokens: np.ndarray,
               wall: float, prefetch_counts: dict[str, int] | None = None) -> RunRecord:
    """The record of one run (an entry of results.json's ``runs``), with whether its policy
    is offline (reads the future) as its class says, so a report never has to import it, and
    a decode run's ``prefetch_counts`` (``PrefetchTally.counts``; None for other runs).
    ``saved_tokens`` holds each request's prompt tokens saved (all 0 outside prefix semantics):
    both replay paths pass the same array, so their modeled seconds agree exactly."""
    accesses, engine = stats.accesses, meter.engine
    layout, profile = data.layout, data.profile
    tiers = tuple(tier_record(t, c, layout is not None, profile is not None, config.codec, layout)
                  for t, c, config in zip(stats.tiers, meter.costs, spec.tiers))
    return RunRecord(
        policy=spec.policy, admission=spec.admission, semantics=spec.semantics, mode=spec.mode,
        capacity_blocks=sum(t.capacity_blocks for t in spec.tiers), accesses=accesses, hits=stats.hits,
        misses=stats.misses, recomputed=stats.recomputed,
        miss_ratio=stats.misses / accesses if accesses else 0.0, hit_ratio=stats.hits / accesses if accesses else 0.0,
        tiers=tiers, wall_seconds=round(wall, 4),
        bytes_moved={link: u.bytes for link, u in sorted(engine.usage.items())} if layout else {},
        modeled_seconds=modeled_seconds({link: u.seconds for link, u in engine.usage.items()},
                                        _recompute_seconds(spec, data, stats, saved_tokens)) if layout and profile else {},
        **_prefix_figures(spec, engine, data, saved_tokens), placement=spec.placement, prefetch=spec.prefetch,
        offline=bool(get_eviction(spec.policy).needs_future), **(prefetch_counts or {}),
    )


def tier_record(counters: TierCounters, cost: HitCost, has_bytes: bool, has_seconds: bool, codec: Codec,
                layout: KVLayout | None) -> TierRecord:
    """A tier's counters and its hits split by how they were served (bytes need a layout,
    seconds hardware too), with its codec and bytes per block."""
    if cost.in_place + cost.promoted != counters.hits:
        raise AssertionError(f"{counters.name}: {counters.hits} hits, {cost.in_place} read in place + {cost.promoted} promoted")
    costs = {"hits_in_place": cost.in_place, "hits_promoted": cost.promoted,
             "in_place_bytes": cost.in_place_bytes if has_bytes else None,
             "promoted_bytes": cost.promoted_bytes if has_bytes else None,
             "in_place_seconds": round(cost.in_place_seconds, 6) if has_seconds else None,
             "promoted_seconds": round(cost.promoted_seconds, 6) if has_seconds else None}
    return TierRecord(**counters.as_dict(), **costs, codec=codec.value, block_bytes=codec.block_bytes(layout) if layout else None)


def _recompute_seconds(spec: RunSpec, data: ReplayData, stats: HierarchyStats, saved_tokens: np.ndarray) -> float:
    """Prefill seconds of what the run recomputes (``tiercache.sim.prefill``). Prefix semantics:
    each request's prompt tokens not reused, ``[c, n)``, attention over their prefix included.
    Object and decode semantics count blocks, not prompts: a whole block per miss, standing at
    the trace's mean read position (``mean_read_index``: a request's ``i``-th block, a step
    record's ``i``-th read, holds tokens ``[i B, (i + 1) B)``); a miss of a per-layer block (a
    step trace's: one layer's KV) is one layer's share of that block's prefill."""
    cost = PrefillCost.of(data.profile, data.layout)
    if spec.semantics is Semantics.PREFIX:
        lengths = data.trace.input_lengths.astype(np.int64)
        return cost.seconds(int(lengths.sum() - saved_tokens.sum()), causal_pairs(lengths, saved_tokens))
    layout = data.layout
    layers = layout.layers if layout.per_layer else 1
    return cost.block_seconds(stats.misses, data.block_tokens, data.mean_read_index, layers)


def modeled_seconds(link_seconds: dict[str, float], recompute_seconds: float) -> dict:
    """Busy seconds per link (``link_seconds``), the prefill time of what the run recomputes
    ("recompute"), and their serial sum ("total"); each rounded to the microsecond."""
    seconds = {link: round(value, 6) for link, value in sorted(link_seconds.items())}
    seconds["recompute"] = round(recompute_seconds, 6)
    seconds["total"] = round(sum(seconds.values()), 6)
    return seconds


def _prefix_figures(spec: RunSpec, engine: SimEngine, data: ReplayData, saved_tokens: np.ndarray) -> dict:
    """Prefill tokens saved against no cache, and modeled TTFT saved when hardware is known.

    Empty outside prefix semantics. A request saves at most ``input_length - 1`` tokens
    (``saved_prompt_tokens``). TTFT saved = the prefill time the saved tokens would have taken
    (a request's ``c`` saved tokens: ``time(0, n) - time(c, n)``, the prefill of tokens
    ``[0, c)``, attention included: ``tiercache.sim.prefill``) minus the modeled busy seconds
    of the load links (``dram->hbm``, ``nvme->dram``, ``nvme->hbm``: a block brought up from a
    slower tier for a hit, promoted or read in place). Write-backs and demotions (``hbm->dram``,
    ...) run off the TTFT path and are not counted. Every load second is counted in full,
    serially: an upper bound on their cost, since real loads may overlap compute.
    """
    if spec.semantics is not Semantics.PREFIX:
        return {}
    saved = int(saved_tokens.sum())
    figures = {"prefill_tokens": int(data.trace.input_lengths.sum()), "prefill_tokens_saved": saved}
    if data.profile is not None:
        prefill = PrefillCost.of(data.profile, data.layout).seconds(saved, causal_pairs(saved_tokens))
        figures["ttft_saved_s"] = round(prefill - _load_seconds(engine), 6)
    return figures


def _load_seconds(engine: SimEngine) -> float:
    """Busy seconds of links whose destination tier is faster than their source (loads)."""
    total = 0.0
    for link, usage in engine.usage.items():
        src, _, dst = link.partition("->")
        if TIER_NAMES.index(dst) < TIER_NAMES.index(src):
            total += usage.seconds
    return total
