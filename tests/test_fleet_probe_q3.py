"""Fleet replay against probe Q3 (findings F1 and F2).

F1: the blocks a request reads from the shared store are pinned there until it has read
them, as a live store's in-flight read pins them: making room in HBM for them demotes blocks
into the instance's view, and those puts must not evict the blocks being read (a FIFO store
did: request #2120 of the sample trace counted 25 remote hits, and their bytes, for blocks
the store no longer held). F2: tier names in ``--tiers`` are case-insensitive, ``remote``
included, and the unknown-tier error names ``remote=CAP``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercache.cli import main
from tiercache.config import TierConfig, layout_preset, parse_tiers
from tiercache.core.manager import TierManager
from tiercache.sim import fleet
from tiercache.sim.fleet import FleetSpec, Route, replay_fleet
from tiercache.sim.loader import load_trace
from test_cli_errors import _error  # runs the CLI, asserts exit 2 with one line
from test_fleet_probe_n import _trace  # a Mooncake trace of the given requests

DATA = Path(__file__).parent / "data"
LAYOUT = layout_preset("llama-3-8b", 512)


def _charged_into_remote(run) -> int:
    """Blocks charged on the links into the shared tier."""
    return sum(n // LAYOUT.block_bytes for link, n in run.bytes_moved.items() if link.endswith("->remote"))


@pytest.fixture
def store_reads(monkeypatch):
    """Watches every read out of the shared store: per read (an instance's ``keep_all`` access
    of a matched prefix), the blocks its view lists, and any of them a put made during the
    read evicted from the store (``stale``: served though the store no longer held it)."""
    seen = {"reads": 0, "stale": []}
    reading: list[set[int]] = []
    access, put = TierManager.access, fleet._Store.put

    def watched_access(self, ids, *args, keep_all=False, **kwargs):
        store = getattr(self.engine, "store", None)
        if not keep_all or store is None:
            return access(self, ids, *args, keep_all=keep_all, **kwargs)
        from_store = {b for b in ids if self.locate(b) == self.shared}
        seen["reads"] += len(from_store)
        reading.append(from_store)
        try:
            return access(self, ids, *args, keep_all=True, **kwargs)
        finally:
            reading.pop()

    def watched_put(self, ids):
        written = put(self, ids)
        if reading:
            gone = {b for b in reading[-1] if b not in self.slot_of}
            seen["stale"] += sorted(gone)
            reading[-1] -= gone
        return written

    monkeypatch.setattr(TierManager, "access", watched_access)
    monkeypatch.setattr(fleet._Store, "put", watched_put)
    return seen


# ----------------------------------------------------------------------------- F1


def test_a_put_made_while_a_block_is_read_from_the_store_evicts_another(tmp_path, store_reads):
    """Three instances, HBM 1, a FIFO store of 2. Request 4 (instance 1) reads block 20 from
    the store, which holds {20, 0}; making HBM room demotes instance 1's block 10 into its
    view, a put. The store evicted its oldest, 20, the very block being read, and still
    counted 20 a remote hit, then served 0 to instance 2's last request as well. Pinned, 20
    stays and the put evicts 0: the last request is a miss (remote hits 0, 2, 0, not 0, 2, 1).

    Since probe r16 a request writes through the blocks of its prefix its view lacks, its hit
    part included (``publish(run, prefix=True)``): request 1 (a remote hit of 10) lists 10 in instance 1's view
    again (the store holds it: nothing is written), so request 4's demotion of 10 puts
    nothing (its view lists it, stale), the store keeps {20, 0} and the last request hits 0.
    The pin itself is asserted below (``stale`` empty over the sample trace) and by the
    refused-put test."""
    trace = _trace(tmp_path, [[10], [10], [20], [0], [20], [0]])
    run = replay_fleet(FleetSpec(3, (TierConfig("hbm", 1),), 2, Route.ROUND_ROBIN, "fifo"), trace, LAYOUT)
    assert [i.tier_hits["remote"] for i in run.instances] == [0, 2, 1]
    assert store_reads["stale"] == [] and store_reads["reads"] == 3
    # three one-block requests found whole, each computing its last prompt token (probe q17)
    assert run.hits == run.shared_hits == 3 and run.prefill_tokens_saved == 3 * 511
    assert run.bytes_moved["remote->hbm"] == 3 * LAYOUT.block_bytes
    assert run.shared_writes == 3 == _charged_into_remote(run)  # 10, 20, 0


@pytest.mark.parametrize("policy", ["fifo", "arc", "s3fifo", "lru"])
def test_every_shared_hit_is_a_block_the_store_held_when_it_was_read(store_reads, policy):
    """The sample trace over 3 instances of HBM 100 and a store of 500 blocks: FIFO, ARC and
    S3-FIFO stores evicted blocks being read (17, 7 and 5 of them); none now, and every block
    written is charged once on its link into ``remote``, refused puts (no unpinned victim)
    neither written nor charged."""
    spec = FleetSpec(3, (TierConfig("hbm", 100),), 500, Route.ROUND_ROBIN, policy)
    run = replay_fleet(spec, load_trace(DATA / "mooncake_synthetic_trace.jsonl"), LAYOUT)
    assert store_reads["reads"] > 1000 and store_reads["stale"] == []
    assert run.shared_writes == _charged_into_remote(run)
    assert run.shared_hits == sum(i.tier_hits["remote"] for i in run.instances) > 1000


def test_a_put_no_unpinned_victim_can_make_room_for_is_refused_and_not_charged(tmp_path):
    """A store of one block, pinned while it is read: a put in the meantime writes nothing,
    is charged nothing, and the block being read stays."""
    store = fleet._Store(1, "fifo")
    assert store.put([5]) == 1
    with store.reading([5, 6]):  # 6 is not held: nothing to pin
        assert store.put([7]) == 0 and store.holds(5) and not store.holds(7)
    assert store.manager.refs == {} and store.writes == 1
    assert store.put([7]) == 1 and not store.holds(5) and store.writes == 2


# ----------------------------------------------------------------------------- F2


def test_tier_names_are_case_insensitive_as_codecs_and_policies_are():
    tiers = parse_tiers("HBM=10,Dram=20,NVMe=30:INT8", None)
    assert [(t.name, t.capacity_blocks, t.codec.value) for t in tiers] == [("hbm", 10, "none"), ("dram", 20, "none"),
                                                                           ("nvme", 30, "int8")]


def test_remote_in_any_case_is_the_shared_tier(capsys):
    head = DATA / "mooncake_head.jsonl"
    assert main(["replay", str(head), "--tiers", "hbm=100,remote=100", "--no-progress"]) == 0
    lower = capsys.readouterr().out
    assert main(["replay", str(head), "--tiers", "HBM=100,REMOTE=100", "--no-progress"]) == 0
    assert capsys.readouterr().out == lower and "tiers hbm=100,remote=100 (remote: shared)" in lower
    err = _error(capsys, "replay", head, "--tiers", "Remote=100,hbm=100", "--no-progress")
    assert "remote=CAP must be given once, as the last tier" in err


def test_an_unknown_tier_error_names_remote(capsys):
    err = _error(capsys, "replay", DATA / "mooncake_head.jsonl", "--tiers", "hbm=100,l4=100", "--no-progress")
    assert "--tiers: unknown tier 'l4'; known: hbm, dram, nvme; remote=CAP last for a fleet replay" in err
