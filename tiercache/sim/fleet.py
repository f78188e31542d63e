"""Fleet replay: a request trace over N engine instances plus one shared remote tier.

Each instance runs the live manager (``TierManager`` with ``SimEngine``) over its private
local tiers and, with a shared tier, a last ``remote`` tier: its *view* of the shared store,
exactly as the live store keeps one (``shared_last``). The shared store itself is one more
manager of one tier (capacity ``remote_blocks``, the fleet's policy), standing in for the
Mooncake master and its eviction. Per request, in prefix semantics (``tiercache replay``'s):

1. the instance checks the store for the blocks its local tiers miss (the live store's one
   batched existence check): view entries the store evicted leave the view, and the leading
   run held locally or by the store joins it up to the view's capacity (its head, as the live
   store's ``RemoteLink`` adopts: the head's own view entries are never pushed out for it);
2. the longest prefix found locally or in the store is touched in the store and read,
   pinned while it is read (``keep_all``, as in ``tiercache replay``: each of its blocks is a
   hit, none pushed out by the promotion of another): local hits per tier, remote hits
   promoted into HBM through the manager's move API. The blocks read from the store are
   pinned there too (``_Store.reading``, as a live store's in-flight read pins them): a put
   made while they are read (a block demoted into the view to make room for them) never
   evicts them, so every remote hit is a block the store held when it was read;
3. the rest is recomputed and stored locally, and written to the store as the fleet's write
   mode says (``FleetSpec.write``, the live store's ``RemoteWrite``; ``tiercache.sim.fleetwrite``).
   ``through`` (the live default) writes at once, the instance's view included: the request's
   blocks its view does not list, from its start (the hit part held only locally included, as
   a serving engine's store writes the chunks of a prompt it lacks), all of them or, when they
   are more than the view can take without evicting the request's own view entries, their
   head (``TierManager.publish`` with ``prefix``: no block is written whose parent prefix the
   store lacks, and the prefix it holds is never evicted for one). ``back`` publishes nothing;
   ``selective`` publishes a block once the instance hit it ``write_hits`` times locally (in
   step 2). In every mode a victim of the last local tier is demoted into the view (under
   ``selective`` only one hit that often), or just leaves when the view holds it (then nothing
   is put, as live, even where the view is stale): under ``back`` that is how blocks reach the store.

Every copy into the view is a put into the store (``_ViewEngine``), as the live medium's: a
block the store holds is skipped (``already``: no bytes move, nothing is charged), the others
are written, evicting as the store's policy says (never a block being read: a block no
unpinned victim can make room for is refused, not written, and the view that lists it drops
it at its next lookup, step 1).
So the store holds exactly what was written into it, and ``shared_writes`` (the blocks
written) equals the blocks charged on the links into ``remote``.

Routing (``tiercache.sim.router``): ``round_robin``, ``prefix_affinity`` (by the first block)
or ``kv_aware`` (to the longest cached prefix, load permitting). The result
is one ``RunRecord`` of results.json (``tiercache replay --instances``): its ``instances``
carry each instance's per-tier hits (``remote`` = shared-tier hits), its tiers the counters
summed over the instances (the ``remote`` tier being the shared one), ``shared_writes`` the
store's writes; ``shared=False`` runs the same fleet on private tiers alone (the baseline).
A lower-tier hit is promoted to HBM or read in place, and charged on its link either way
(``HitMeter``, as in ``tiercache replay``). With a hardware profile (``with_network`` for the
remote links) each instance also carries modeled busy seconds per link and TTFT saved:
prefill time of the tokens it reused (attention included: ``tiercache.sim.prefill``) minus the
modeled seconds of the loads that brought them (remote -> DRAM -> HBM included), counted
serially, as ``tiercache replay`` does. A
request reuses its hit blocks' tokens at the trace's block size (``block_tokens_of``: 512 in
Mooncake, 64 in kv-cache-tester, 16 in Bailian), at most its prompt less its last token
(``saved_prompt_tokens``: the engine computes that one); the run's recompute
seconds are the prefill time of every prompt token not reused (tokens ``[c, n)`` of each
request). Every request counts in its instance's ``requests``, one without
blocks too (routed round-robin: it has no prefix).

Memory: a fleet is refused up front (``check_fleet_memory``) when its slot directories and
instance state would need more than half the memory available, as ``tiercache replay``
refuses a sweep (``check_memory``).
"""

from __future__ import annotations

import heapq
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import numpy as np
import psutil

import tiercache
from tiercache.config import Codec, KVLayout, Mode, RemoteWrite, Route, Semantics, TierConfig
from tiercache.core.guards import request_hints, slice_hints
from tiercache.core.manager import TierManager
from tiercache.core.remoteview import adopt, drop_stale, view_head
from tiercache.core.plans import Ev, TransferPlan
from tiercache.core.stats import HierarchyStats, TierCounters
from tiercache.errors import UserError
from tiercache.policies import get_eviction, make_admission, make_eviction
from tiercache.remote_config import DEFAULT_WRITE_HITS
from tiercache.results import InstanceRecord, LayoutInfo, ResultsDocument, RunRecord
from tiercache.results.hwinfo import HardwareInfo

from .engine import SimEngine
from .fleetwrite import Writer
from .hardware import NETWORK_PRESETS, HardwareProfile
from .hitcost import HitCost, HitMeter
from .loader import Trace
from .prefill import PrefillCost, causal_pairs
from .replay import block_tokens_of, modeled_seconds, tier_record
from .reuse import reusable_blocks, saved_prompt_tokens
from .router import Router
from .sweep import SLOT_BYTES, _gb

__all__ = ["Route", "FleetSpec", "replay_fleet", "sweep_fleet", "check_fleet_policy", "check_fleet_memory",
           "INSTANCE_BYTES"]

#: Memory one instance costs besides its slot directories, before any block is stored: its
#: manager, policies, engine and counters (about 6 KB, measured with tracemalloc).
INSTANCE_BYTES = 8192


@dataclass(frozen=True)
class FleetSpec:
    """A fleet: ``instances`` engines with private ``tiers`` and a shared tier of
    ``remote_blocks`` (0: none), one eviction ``policy`` everywhere, a ``route``, and when the
    instances write to the shared tier (``write``; ``write_hits``: the local hits after which
    ``selective`` writes a block, unused by the other modes)."""

    instances: int
    tiers: tuple[TierConfig, ...]
    remote_blocks: int
    route: Route = Route.ROUND_ROBIN
    policy: str = "lru"
    write: RemoteWrite = RemoteWrite.THROUGH
    write_hits: int = DEFAULT_WRITE_HITS

    def __post_init__(self) -> None:
        if type(self.instances) is not int or self.instances < 1:
            raise ValueError(f"FleetSpec.instances must be an integer of at least 1, got {self.instances!r}")
        if not self.tiers or any(t.name == "remote" for t in self.tiers):
            raise ValueError("FleetSpec.tiers: the private tiers (hbm[, dram][, nvme]); the shared one is remote_blocks")
        if any(t.codec is not Codec.NONE for t in self.tiers):
            raise ValueError("FleetSpec.tiers: a fleet replay does not model quantised tiers (codec none only)")
        if self.remote_blocks < 0:
            raise ValueError(f"FleetSpec.remote_blocks must be non-negative, got {self.remote_blocks}")
        if not isinstance(self.write, RemoteWrite):
            raise ValueError(f"FleetSpec.write must be a RemoteWrite, got {self.write!r}")
        if not isinstance(self.route, Route):  # a name would fall through to some rule's branch
            raise ValueError(f"FleetSpec.route must be a Route, got {self.route!r}")
        if type(self.write_hits) is not int or self.write_hits < 1:
            raise ValueError(f"FleetSpec.write_hits must be an integer of at least 1, got {self.write_hits!r}")


class _Store:
    """The shared store: one tier of ``capacity`` blocks under the fleet's policy.

    Invariants: ``writes`` counts every block ``put`` added, each exactly once; nothing else
    adds a block (``touch`` refreshes only blocks the store holds). A block being read
    (``reading``) is never evicted until the read ends, under any policy, as a live store's
    in-flight read pins it: a put that finds no other room is refused (nothing written).
    """

    def __init__(self, capacity: int, policy: str) -> None:
        self.manager = TierManager([("remote", capacity)], [make_eviction(policy, capacity)], [make_admission("always")])
        self.slot_of = self.manager.dirs[0].slot_of
        self.writes = 0

    def holds(self, block_id: int) -> bool:
        return block_id in self.slot_of

    def touch(self, ids: list[int]) -> None:
        """Reads refresh the blocks the store holds in its policy (never a write)."""
        self._access([b for b in ids if b in self.slot_of])

    @contextmanager
    def reading(self, ids: list[int]):
        """Pins the blocks of ``ids`` the store holds (reader references) while the ``with``
        body reads them: no put evicts them meanwhile. Released on leaving, however it is left."""
        pinned = [b for b in dict.fromkeys(ids) if b in self.slot_of]
        self.manager.ref(pinned)
        try:
            yield
        finally:
            self.manager.unref(pinned)

    def put(self, ids) -> int:
        """A put, as the live medium's: names the store holds are skipped (``already``), the
        others written (evicting as the policy says, never a block being read); returns how
        many were written (a block refused for want of an unpinned victim is not)."""
        new = [b for b in dict.fromkeys(ids) if b not in self.slot_of]
        written = sum(count for kind, _, count, _ in self._access(new) if kind == Ev.INSERT)
        self.writes += written
        return written

    def _access(self, ids: list[int]) -> list[tuple[int, int, int, int]]:
        """Accesses ``ids`` in the store's manager; returns its events."""
        if not ids:
            return []
        self.manager.access(ids)
        return self.manager.events.drain()


@dataclass
class _ViewEngine(SimEngine):
    """An instance's engine: with a ``store``, a copy into the last tier (the view) is a
    ``_Store.put``, as the live remote tier's copy is a ``RemoteStore.put``
    (``tiercache.data.remote``).

    Invariant: such a copy is charged on its link for the blocks the put wrote alone (a put
    that wrote none is no transfer); every other plan is ``SimEngine``'s.
    """

    store: _Store | None = None

    def submit(self, plan: TransferPlan) -> None:
        if self.store is None or plan.dst_tier != len(self.tier_names) - 1:
            super().submit(plan)
            return
        written = self.store.put(plan.ids)
        done = self._occupy(plan.src_tier, plan.dst_tier, written) if written else self.clock.now
        heapq.heappush(self._pending, (done, plan.job_id))


class _Instance:
    """One engine: its manager (private tiers + view of the store), counters, requests."""

    def __init__(self, spec: FleetSpec, store: _Store | None, block_bytes: int | None,
                 profile: HardwareProfile | None) -> None:
        shared = store is not None
        tiers = [(t.name, t.capacity_blocks) for t in spec.tiers] + ([("remote", spec.remote_blocks)] if shared else [])
        self.writer = Writer(spec.write, spec.write_hits) if shared else None
        admissions = [make_admission("always") for _ in spec.tiers] + ([self.writer.admission()] if shared else [])
        self.engine = _ViewEngine(tuple(n for n, _ in tiers), block_bytes, profile, store=store)
        self.manager = TierManager(tiers, [make_eviction(spec.policy, c, i) for i, (_, c) in enumerate(tiers)], admissions,
                                   engine=self.engine, shared_last=shared, events=self.writer.events() if shared else None)
        self.stats = HierarchyStats.for_tiers(tiers)
        self.meter = HitMeter(self.engine, len(tiers))
        self.requests = 0
        self.saved: list[int] = []  # each of its requests' prompt tokens saved
        self.remote = len(tiers) - 1 if shared else None

    def consume(self) -> None:
        """Counts the events since the last call (a drained batch never splits a hit from the
        promotion or skipped promotion before it: both come from one access)."""
        events = self.manager.events.drain()
        self.stats.consume(events)
        self.meter.consume(events)


def _refresh_view(instance: _Instance, store: _Store, run: list[int]) -> None:
    """Step 1: the view agrees with the store for the part of ``run`` not held locally, as the
    live store's ``RemoteLink.refresh_prefix``: view entries the store evicted leave it, and
    the prefix's head (``view_head``) not held by any tier is adopted (``core.remoteview``, the
    rules the live store follows).

    Invariant: the head's own view entries stay (room is made from other entries only), so
    the request reads the whole prefix the local tiers and the store hold whenever that
    prefix's blocks in the view or held by no tier number at most the view's capacity; a
    longer prefix keeps its head."""
    m, remote = instance.manager, instance.remote
    drop_stale(m, remote, [b for b in run if m.locate(b) == remote and not store.holds(b)])
    head = view_head(m, remote, _held_prefix(m, remote, store, run))
    fresh = list(dict.fromkeys(b for b in head if m.locate(b) is None))
    if fresh:
        instance.consume()  # count what came before; the adoption below is not traffic
        adopt(m, remote, fresh, frozenset(head))
        m.events.drain()  # adoption is a lookup, not traffic


def _held_prefix(m: TierManager, remote: int, store: _Store, run: list[int]) -> list[int]:
    """The leading blocks of ``run`` held by a local tier or by the store."""
    for n, block_id in enumerate(run):
        tier = m.locate(block_id)
        if (tier is None or tier == remote) and not store.holds(block_id):
            return run[:n]
    return run


def _request(instance: _Instance, store: _Store | None, run: list[int], input_length: int, block_tokens: int) -> int:
    """One request in prefix semantics (blocks of ``block_tokens`` tokens); returns the prompt
    tokens it saved (``saved_prompt_tokens``). A request without blocks is counted and reuses nothing."""
    instance.requests += 1
    if not run:
        instance.saved.append(0)
        return 0
    m = instance.manager
    if store is not None:
        _refresh_view(instance, store, run)
    hit = m.prefix_length(run[: reusable_blocks(block_tokens, input_length)])
    hints = request_hints(m.policies, run)  # each block's parent, as the replay and the live store give it
    if store is None:
        m.access(run[:hit], slice_hints(hints, 0, hit), keep_all=True)  # pinned: every block reused is a hit
    else:
        hot = instance.writer.read(m, instance.remote, run[:hit])  # selective: local hits counted as it reads
        from_store = [b for b in run[:hit] if m.locate(b) == instance.remote]
        store.touch(from_store)
        with store.reading(from_store):  # pinned in the store too: a remote hit is a block it holds
            m.access(run[:hit], slice_hints(hints, 0, hit), keep_all=True)
        instance.writer.forget_departed(m)
    m.access(run[hit:], slice_hints(hints, hit, len(run)), count_hits=False)
    if store is not None:
        instance.writer.served(m, run, hot)  # through: the blocks the store lacks, from the start, are put into it
    saved = saved_prompt_tokens(hit, block_tokens, input_length)  # the last token is computed
    instance.saved.append(saved)
    return saved


def router_of(route: Route, instances: list[_Instance]) -> Router:
    """The fleet's router (``tiercache.sim.router``), seeing each instance's local tiers."""
    return Router(route, [partial(_local_run, each.manager, each.remote) for each in instances])


def _local_run(m: TierManager, remote: int | None, run: list[int]) -> int:
    """How many leading blocks of ``run`` the local tiers of ``m`` hold (the view of the
    shared tier, ``remote``, not counted: every instance reads the store alike)."""
    for n, block_id in enumerate(run):
        tier = m.locate(block_id)
        if tier is None or tier == remote:
            return n
    return len(run)


def replay_fleet(spec: FleetSpec, trace: Trace, layout: KVLayout | None = None, shared: bool = True,
                 profile: HardwareProfile | None = None) -> RunRecord:
    """Replays ``trace`` over the fleet; returns the run's record with its ``instances``.

    With ``layout`` the record carries bytes per link (blocks of ``layout.block_bytes``);
    with ``profile`` (which needs a layout) modeled seconds per link and TTFT saved.

    Raises:
        UserError: the fleet would not fit in memory (``check_fleet_memory``).
    """
    if profile is not None and layout is None:
        raise ValueError("replay_fleet: a hardware profile needs a layout (bytes per block)")
    check_fleet_memory(spec)
    shared = shared and spec.remote_blocks > 0
    block_bytes = layout.block_bytes if layout else None
    store = _Store(spec.remote_blocks, spec.policy) if shared else None
    instances = [_Instance(spec, store, block_bytes, profile) for _ in range(spec.instances)]
    ids, offsets, lengths = trace.ids.tolist(), trace.offsets.tolist(), trace.input_lengths
    block_tokens = block_tokens_of(trace, layout)
    saved = np.zeros(trace.records, dtype=np.int64)
    router = router_of(spec.route, instances)
    started = time.perf_counter()
    for request in range(trace.records):
        run = ids[offsets[request] : offsets[request + 1]]
        instance = instances[router.pick(request, run)]
        saved[request] = _request(instance, store, run, int(lengths[request]), block_tokens)
        if request % 256 == 255:
            for each in instances:
                each.consume()
    for each in instances:
        each.consume()
        each.manager.check_invariants()
    if store is not None:
        store.manager.check_invariants()  # every read's pins released (reader references on resident ids only)
    wall = time.perf_counter() - started
    recompute = None
    if profile is not None:  # every prompt token not reused, tokens [c, n) of each request
        lengths = trace.input_lengths.astype(np.int64)
        recompute = PrefillCost.of(profile, layout).seconds(int(lengths.sum() - saved.sum()), causal_pairs(lengths, saved))
    return _record(spec, instances, store, layout, profile, int(trace.input_lengths.sum()), recompute, wall)


_SPEED = {"hbm": 0, "dram": 1, "nvme": 2, "remote": 3}


def _load_seconds(instance: _Instance) -> float:
    """Busy seconds of the links that bring blocks up (towards HBM): the TTFT path."""
    return sum(u.seconds for link, u in instance.engine.usage.items()
               if _SPEED[link.split("->")[1]] < _SPEED[link.split("->")[0]])


def _instance_record(index: int, instance: _Instance, layout: KVLayout | None, profile: HardwareProfile | None) -> InstanceRecord:
    stats, usage = instance.stats, sorted(instance.engine.usage.items())
    ttft, saved = None, np.asarray(instance.saved, dtype=np.int64)
    if profile is not None:  # as tiercache replay: the prefill of each request's saved tokens [0, c)
        prefill = PrefillCost.of(profile, layout).seconds(int(saved.sum()), causal_pairs(saved))
        ttft = round(prefill - _load_seconds(instance), 6)
    return InstanceRecord(
        instance=index, requests=instance.requests, accesses=stats.accesses, hits=stats.hits, misses=stats.misses,
        tier_hits={t.name: t.hits for t in stats.tiers}, bytes_moved={k: u.bytes for k, u in usage} if layout else {},
        modeled_seconds={k: round(u.seconds, 6) for k, u in usage} if profile else {},
        prefill_tokens_saved=int(saved.sum()), ttft_saved_s=ttft)


def _summed_tier(instances: list[_Instance], tier: int, layout: KVLayout | None, has_seconds: bool):
    """One tier's counters and hit costs summed over the instances, as a ``TierRecord``."""
    first = instances[0].stats.tiers[tier]
    counters, cost = TierCounters(first.name, first.capacity_blocks), HitCost()
    for instance in instances:
        for key, value in instance.stats.tiers[tier].as_dict().items():
            if key not in ("name", "capacity_blocks"):
                setattr(counters, key, getattr(counters, key) + value)
        for key, value in instance.meter.costs[tier].__dict__.items():
            setattr(cost, key, getattr(cost, key) + value)
    return tier_record(counters, cost, layout is not None, has_seconds, Codec.NONE, layout)


def _summed(mappings) -> dict:
    total: dict = {}
    for mapping in mappings:
        for key, value in mapping.items():
            total[key] = total.get(key, 0) + value
    return dict(sorted(total.items()))


def _record(spec: FleetSpec, instances: list[_Instance], store: _Store | None, layout: KVLayout | None,
            profile: HardwareProfile | None, prefill_tokens: int, recompute: float | None, wall: float) -> RunRecord:
    rows = tuple(_instance_record(i, each, layout, profile) for i, each in enumerate(instances))
    tiers = tuple(_summed_tier(instances, t, layout, profile is not None) for t in range(len(instances[0].stats.tiers)))
    accesses, hits = sum(r.accesses for r in rows), sum(r.hits for r in rows)
    misses = accesses - hits
    saved = sum(r.prefill_tokens_saved for r in rows)
    seconds = {}
    if profile is not None:  # per link over all instances, and prefill time of every token not reused
        seconds = modeled_seconds(_summed(r.modeled_seconds for r in rows), recompute)
    return RunRecord(
        policy=spec.policy, admission="always", semantics=Semantics.PREFIX, offline=False,
        mode=Mode.EXCLUSIVE if len(tiers) > 1 else Mode.SINGLE, capacity_blocks=sum(t.capacity_blocks for t in tiers),
        accesses=accesses, hits=hits, misses=misses, recomputed=sum(i.stats.recomputed for i in instances),
        miss_ratio=misses / accesses if accesses else 0.0, hit_ratio=hits / accesses if accesses else 0.0,
        tiers=tiers, wall_seconds=round(wall, 4), bytes_moved=_summed(r.bytes_moved for r in rows),
        modeled_seconds=seconds, prefill_tokens=prefill_tokens, prefill_tokens_saved=saved,
        ttft_saved_s=None if profile is None else round(sum(r.ttft_saved_s for r in rows), 6),
        instances=rows, route=spec.route, shared_writes=None if store is None else store.writes, prefetch="none",
        remote_write=None if store is None else spec.write,
        write_hits=spec.write_hits if store is not None and spec.write is RemoteWrite.SELECTIVE else None)


def check_fleet_policy(policy: str) -> None:
    """A fleet's instances run online: a policy that reads the future (Belady) cannot run.

    Raises:
        ValueError: ``policy`` needs the future of the accesses.
    """
    if getattr(get_eviction(policy), "needs_future", False):
        raise ValueError(f"{policy} reads the future of each tier's accesses, which a fleet replay does not hand "
                         "its instances; give online policies")


def check_fleet_memory(spec: FleetSpec, available: int | None = None) -> None:
    """Refuses a fleet whose state would need more than half of ``available`` (default: the
    memory psutil reports available now), the limit ``check_memory`` sets a sweep: per
    instance ``SLOT_BYTES`` per slot of its tiers (its view of the shared tier included) and
    ``INSTANCE_BYTES``, plus the shared store's slots. Stored blocks cost more on top, but
    never more blocks than the trace holds.

    Raises:
        UserError: the need, the limit and the most instances that fit.
    """
    available = psutil.virtual_memory().available if available is None else available
    slots = sum(t.capacity_blocks for t in spec.tiers) + spec.remote_blocks
    each, store = slots * SLOT_BYTES + INSTANCE_BYTES, spec.remote_blocks * SLOT_BYTES
    need = spec.instances * each + store
    if need <= available // 2:
        return
    fits = max(0, (available // 2 - store) // each)
    advice = (f"the most that fits is about {fits:,} instances" if fits
              else "not one instance fits: lower the capacities in --tiers")
    raise UserError(
        f"--instances/--tiers: a fleet of {spec.instances:,} instance(s) needs about {_gb(need)} ({slots:,} slots per "
        f"instance, its view of the shared tier included, at ~{SLOT_BYTES} B per slot, ~{INSTANCE_BYTES:,} B of state "
        f"per instance, and the shared store's {spec.remote_blocks:,} slots), over half of the {_gb(available)} "
        f"available; {advice}")


def sweep_fleet(trace: Trace, specs: list[FleetSpec], layout: KVLayout | None, profile: HardwareProfile | None,
                command: str) -> ResultsDocument:
    """A results document of fleet replays: per spec, the run with its shared tier (when it
    has one) followed by the same fleet on private tiers alone (the shared tier's baseline).

    Raises:
        ValueError: a policy that reads the future (``check_fleet_policy``).
        UserError: a fleet that would not fit in memory, before any replay runs.
    """
    for spec in specs:  # every fleet is checked before the first one runs
        check_fleet_policy(spec.policy)
        check_fleet_memory(spec)
    runs = []
    for spec in specs:
        if spec.remote_blocks:
            runs.append(replay_fleet(spec, trace, layout, profile=profile))
        runs.append(replay_fleet(spec, trace, layout, shared=False, profile=profile))
    return ResultsDocument(tiercache_version=tiercache.__version__, command=command, trace=trace.info(),
                           layout=None if layout is None else LayoutInfo.from_layout(layout),
                           hardware=None if profile is None else profile.name, runs=tuple(runs),
                           hardware_profile=None if profile is None else HardwareInfo.of(profile, NETWORK_PRESETS, layout))
