"""Fleet replay against probe Q22 (findings 1 and 2).

1. Copying store blocks into an instance's view made room by evicting any view entry but
   the blocks copied in, so the request's own prefix entries could go and its read stopped
   short (2 instances, hbm=1, remote=2, lru: one remote hit instead of two; the
   kv-cache-tester sample lost 523 blocks over 5 requests). The view now keeps the prefix's
   head as the live store's ``RemoteLink`` does.
2. A request with more new blocks than the shared tier holds wrote none of them through
   (``TierManager.publish`` asked for room for all at once): now its head, as many blocks as
   the shared tier can take, is written, charged on its link and read by other instances.
"""

from __future__ import annotations

from pathlib import Path

from tiercache.config import Route, TierConfig, layout_preset
from tiercache.sim import fleet
from tiercache.sim.fleet import FleetSpec, replay_fleet
from tiercache.sim.loader import load_trace
from test_fleet_probe_n import _trace  # a Mooncake trace of the given requests

DATA = Path(__file__).parent / "data"
LAYOUT = layout_preset("llama-3-8b", 512)
_REQUEST = fleet._request  # the unwatched one (a test may watch several replays)


def _short_reads(monkeypatch, spec: FleetSpec, trace) -> list[tuple[int, int]]:
    """Replays ``spec``; returns ``(held, read)`` for each request that read a shorter prefix
    than the local tiers and the store held when it arrived, its view permitting: the blocks
    of that prefix in the view or held by no tier (to adopt) number at most the view's
    capacity (as ``core.remoteview.view_head`` counts them for both)."""
    short = []

    def watched(instance, store, run, input_length, block_tokens):
        m, view, held, used = instance.manager, instance.manager.dirs[instance.remote], 0, 0
        for block_id in run:
            tier = m.locate(block_id)
            local = tier is not None and tier != instance.remote
            used += block_id in view.slot_of or tier is None
            if not (local or store.holds(block_id)) or used > view.capacity:
                break
            held += 1
        seen = {}
        m.prefix_length = lambda ids: seen.setdefault("read", type(m).prefix_length(m, ids))
        try:
            saved = _REQUEST(instance, store, run, input_length, block_tokens)
        finally:
            del m.prefix_length  # the class's method again
        if seen.get("read", 0) < held:
            short.append((held, seen.get("read", 0)))
        return saved

    monkeypatch.setattr(fleet, "_request", watched)
    replay_fleet(spec, trace)
    return short


def test_a_request_reads_the_whole_prefix_its_local_tiers_and_the_store_hold_when_it_fits_its_view(tmp_path, monkeypatch):
    trace = _trace(tmp_path, [[22, 2], [22, 20], [20, 22]])
    spec = FleetSpec(2, (TierConfig("hbm", 1),), 2, Route.ROUND_ROBIN, "lru")
    run = replay_fleet(spec, trace)
    # request 3 (instance 0): the store holds 20 and 22, the view lists 22 (and 2, which the
    # store evicted for 20); adopting 20 must push 2 out of the view, not 22.
    assert run.instances[0].tier_hits == {"hbm": 0, "remote": 2}
    assert _short_reads(monkeypatch, spec, trace) == []
    sample = load_trace(DATA / "kvtester_sample")
    for policy in ("lru", "fifo"):  # 5 requests of each read up to 256 blocks too few
        spec = FleetSpec(8, (TierConfig("hbm", 20),), 500, Route.ROUND_ROBIN, policy)
        assert _short_reads(monkeypatch, spec, sample) == []


def test_a_request_with_more_new_blocks_than_the_shared_tier_writes_its_head_through(tmp_path):
    trace = _trace(tmp_path, [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
    spec = FleetSpec(2, (TierConfig("hbm", 8),), 4, Route.ROUND_ROBIN, "lru")
    run = replay_fleet(spec, trace, LAYOUT)
    first, second = run.instances
    # instance 0 computes 6 blocks and writes its head, blocks 1-4 (as many as the shared tier holds)
    assert first.bytes_moved == {"hbm->remote": 4 * LAYOUT.block_bytes}
    assert second.tier_hits == {"hbm": 0, "remote": 4} and second.misses == 2  # instance 1 reads that head
    # ... and writes nothing: its 2 new blocks, 5 and 6, would extend a head the store holds
    # only by evicting it (r16: an unreachable tail is never written)
    assert run.shared_writes == 4 and run.bytes_moved["hbm->remote"] == 4 * LAYOUT.block_bytes
    # a store as large as the request takes it all at once, as before
    whole = replay_fleet(FleetSpec(2, (TierConfig("hbm", 8),), 6, Route.ROUND_ROBIN, "lru"), trace, LAYOUT)
    assert whole.shared_writes == 6 and whole.instances[1].tier_hits["remote"] == 6
