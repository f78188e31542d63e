"""TieredKVStore: round trips through every tier, reopening, live == replay, faults, threads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

from conftest import DATA, sample_requests, run_threads
from store_helpers import LAYOUT, blocks, key, tiers
from tiercache.config import KVLayout, TierConfig
from tiercache.live.store import TieredKVStore
from tiercache.core.counts import CountError
from tiercache.errors import UserError
from tiercache.policies import EVICTION, get_eviction
from tiercache.sim.sweep import run_sweep


def test_round_trip_from_every_tier_is_bit_identical(tmp_path):
    data = blocks(12, 0)
    with TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme") as store:
        assert store.put([key(i) for i in range(12)], data) == 12
        _, where = store.lookup([key(i) for i in range(12)])
        assert set(where) == {"hbm", "dram", "nvme"}  # tiny HBM/DRAM: blocks spread down
        for i in range(12):
            assert torch.equal(store.get([key(i)])[0], data[i]), i
        store.check_invariants()
        assert store.stats()["tiers"][2]["hits"] > 0


def test_reopen_in_a_new_process_serves_every_block(tmp_path):
    data = blocks(10, 1)
    path = tmp_path / "nvme"
    store = TieredKVStore(LAYOUT, tiers(hbm=1, dram=1), path=path)
    store.put([key(i) for i in range(10)], data)
    assert store.lookup([key(i) for i in range(10)])[1].count("nvme") == 8
    assert store.close() == 2  # the DRAM and HBM blocks are persisted into free NVMe slots
    in_nvme = list(range(10))
    torch.save(data, tmp_path / "data.pt")
    script = textwrap.dedent(
        f"""
        import torch
        from tiercache.config import KVLayout, TierConfig
        from tiercache.live.store import TieredKVStore
        layout = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
        data = torch.load({str(tmp_path / "data.pt")!r})
        tiers = [TierConfig("hbm", 1), TierConfig("dram", 1), TierConfig("nvme", 40)]
        with TieredKVStore(layout, tiers, path={str(path)!r}) as store:
            for i in {in_nvme!r}:
                got = store.get([i.to_bytes(16, "little")])[0]
                assert torch.equal(got, data[i]), i
            store.check_invariants()
        print("ok", len({in_nvme!r}))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok", "10"]


def test_match_prefix_counts_whole_stored_blocks():
    from tiercache.keys import prefix_keys

    tokens = list(range(40))
    keys = prefix_keys(tokens, LAYOUT.block_tokens, "tenant-a")
    with TieredKVStore(LAYOUT, [TierConfig("hbm", 16)]) as store:
        store.put(keys[:6], blocks(6, 2))
        assert store.match_prefix(tokens, "tenant-a") == 24
        assert store.match_prefix(tokens, "tenant-b") == 0  # namespaces never share blocks
        assert store.match_prefix(tokens[:3], "tenant-a") == 0


def test_pinned_blocks_stay_in_hbm():
    with TieredKVStore(LAYOUT, [TierConfig("hbm", 2), TierConfig("dram", 8)]) as store:
        store.put([key(0), key(1)], blocks(2, 3))
        store.pin([key(0)])
        store.put([key(2), key(3)], blocks(2, 4))
        assert store.lookup([key(0)])[1] == ["hbm"]
        store.release([key(0)])
        with pytest.raises(CountError):
            store.release([key(0)])


@pytest.mark.parametrize(
    "bad",
    [
        lambda s: s.put([key(0)], torch.zeros((1, *LAYOUT.block_shape), dtype=torch.float32)),
        lambda s: s.put([key(0)], torch.zeros((1, 3, 3), dtype=torch.float16)),
        lambda s: s.put(["not-bytes"], blocks(1, 0)),
        lambda s: s.put([key(0), key(0)], blocks(2, 0)),
    ],
)
def test_bad_puts_raise_clearly_and_write_nothing(bad):
    with TieredKVStore(LAYOUT, [TierConfig("hbm", 4)]) as store:
        with pytest.raises(UserError):
            bad(store)
        assert store.lookup([key(0)])[0] == 0
        store.check_invariants()


def test_bad_configurations(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        TieredKVStore(LAYOUT, tiers(), path=tmp_path / "file")
    with pytest.raises(UserError, match="needs path"):
        TieredKVStore(LAYOUT, tiers())
    with pytest.raises(UserError, match="order"):
        TieredKVStore(LAYOUT, [TierConfig("dram", 4)])
    TieredKVStore(LAYOUT, tiers(), path=tmp_path / "s").close()
    other = KVLayout(layers=4, kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
    with pytest.raises(UserError):
        TieredKVStore(other, tiers(), path=tmp_path / "s")


def test_corrupt_nvme_chunk_is_a_counted_miss_never_data(tmp_path):
    data = blocks(8, 5)
    with TieredKVStore(LAYOUT, tiers(hbm=1, dram=1), path=tmp_path / "nvme") as store:
        store.put([key(i) for i in range(8)], data)
        store.flush()
        victim = next(i for i, t in enumerate(store.lookup([key(i) for i in range(8)])[1]) if t == "nvme")
        medium = store._media[2]
        chunk = medium.chunk_path(medium.slot_of(key(victim)))
        raw = bytearray(open(chunk, "rb").read())
        raw[10] ^= 0xFF
        open(chunk, "wb").write(bytes(raw))
        store.pin([key(victim)])
        before = store.stats()
        with pytest.raises(KeyError):
            store.get([key(victim)])
        assert store.lookup([key(victim)])[1] == [None]
        stats = store.stats()
        assert stats["nvme"]["corrupt_reads"] >= 1 and stats["tiers"][2]["lost"] == 1
        assert (stats["hits"], stats["misses"]) == (before["hits"], before["misses"] + 1)  # a miss, not a hit
        store.release([key(victim)])  # the reader's pin still balances after the loss
        store.check_invariants()
        others = [i for i in range(8) if i != victim]
        for i in others:
            assert torch.equal(store.get([key(i)])[0], data[i])


@pytest.mark.parametrize("reader", ["get", "get_prefix"])
def test_corrupt_chunk_read_in_place_leaves_the_hierarchy(tmp_path, reader):
    """A run of blocks too long for HBM is read where it lies, past the manager: a corrupt
    chunk found so must still leave the manager's directory (it kept answering lookups with a
    block it could not serve, and the tier's slot count drifted)."""
    data = blocks(12, 7)
    with TieredKVStore(LAYOUT, tiers(hbm=2, dram=2), path=tmp_path / "nvme") as store:
        keys = [key(i) for i in range(12)]
        store.put(keys, data)
        store.flush()
        on_nvme = [i for i, t in enumerate(store.lookup(keys)[1]) if t == "nvme"]
        victim = on_nvme[1]
        medium = store._media[2]
        chunk = medium.chunk_path(medium.slot_of(key(victim)))
        raw = bytearray(open(chunk, "rb").read())
        raw[50] ^= 0xFF
        open(chunk, "wb").write(bytes(raw))
        wanted = [key(i) for i in on_nvme[:3]]
        if reader == "get":
            with pytest.raises(KeyError):
                store.get(wanted)
        else:
            assert len(store.get_prefix(wanted)) == 1  # the prefix ends at the unreadable block
        assert store.lookup([key(victim)])[1] == [None]
        assert store.stats()["tiers"][2]["lost"] == 1
        store.check_invariants()


def test_failed_nvme_write_keeps_the_victim_and_refuses_the_put(tmp_path, monkeypatch):
    """A full disk: the write-back that would make room fails, so nothing is dropped for it;
    the new block is refused, visibly (issue 8, items 7 and 8)."""
    import tiercache.data.chunkio as chunkio

    data = blocks(3, 6)
    with TieredKVStore(LAYOUT, tiers(hbm=1, dram=1), path=tmp_path / "nvme") as store:
        store.put([key(0), key(1)], data[:2])

        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(chunkio, "write_chunk_file", full)
        monkeypatch.setattr(chunkio, "overwrite_chunk_file", full)
        assert store.put([key(2)], data[2:]) == 0  # demoting 0 dram -> nvme fails: 2 refused
        assert store.lookup([key(0), key(1), key(2)])[1] == ["dram", "hbm", None]
        assert store.stats()["tiers"][1]["failed_transfers"] == 1
        store.check_invariants()
        monkeypatch.undo()
        assert store.put([key(2)], data[2:]) == 1
        for i in range(3):
            assert torch.equal(store.get([key(i)])[0], data[i]), i
        store.check_invariants()


ONLINE = sorted(name for name in EVICTION if not get_eviction(name).needs_future)


@pytest.mark.parametrize("policy", ONLINE)
def test_live_store_and_replay_agree_on_per_tier_hits(tmp_path, policy):
    """Probe Q60: the live store gave a request's ids no parents, so the prefix-tree
    policies (leaf_lru, session, cost) ranked every block as a root there and counted other
    hits than the replay (only lru was compared)."""
    requests = sample_requests(DATA / "mooncake_head.jsonl")
    caps = {"hbm": 40, "dram": 120, "nvme": 400} if policy == "lru" else {"hbm": 40, "dram": 120}  # NVMe: 10 s a run
    spec = ",".join(f"{k}={v}" for k, v in caps.items())
    replayed = run_sweep(str(DATA / "mooncake_head.jsonl"), [policy], [], ["object"], tiers=spec, workers=1, progress=False)
    run = replayed["runs"][0]
    live_tiers = [TierConfig(name, cap, eviction=policy) for name, cap in caps.items()]
    tiny = KVLayout(layers=1, kv_heads=1, head_dim=4, dtype="float16", block_tokens=2)
    with TieredKVStore(tiny, live_tiers, path=tmp_path / "nvme" if "nvme" in caps else None) as store:
        for request in requests:
            keys = [key(i) for i in request]
            store.access(keys, torch.zeros((len(keys), *tiny.block_shape), dtype=torch.float16))
        stats = store.stats()
        store.check_invariants()
    assert [t["hits"] for t in stats["tiers"]] == [t["hits"] for t in run["tiers"]]
    assert stats["misses"] == run["misses"]


def test_a_get_gives_the_ids_it_touches_their_parents_in_the_request(monkeypatch):
    """A get reads its keys as a request (``request_hints``): each id's parent is the key
    before it, as a replay gives it; a policy that reads no parents is given none."""
    from tiercache.core.manager import TierManager
    from tiercache.keys import key_to_int

    seen = []
    real = TierManager.access

    def spy(self, ids, hints=None, *args, **kwargs):
        seen.append((list(ids), None if hints is None else list(hints.parents)))
        return real(self, ids, hints, *args, **kwargs)

    monkeypatch.setattr(TierManager, "access", spy)
    one, two, three = (key_to_int(key(i)) for i in (1, 2, 3))
    for policy, parents in (("leaf_lru", [None, three, one]), ("session", [None, three, one]), ("lru", None)):
        with TieredKVStore(LAYOUT, [TierConfig("hbm", 8, eviction=policy)]) as store:
            store.put([key(1), key(2), key(3)], blocks(3, 3))
            seen.clear()
            store.get([key(3), key(1), key(2)])
            assert seen == [([three, one, two], parents)], policy


def test_a_put_and_a_prefetch_give_their_blocks_their_parents_in_the_call():
    """Review R33: a put and a prefetch gave a leaf policy no parents (every block a root),
    so a serving loop (put, prefetch the next request, get) still ranked blocks as roots."""
    from tiercache.keys import key_to_int

    chain = [key_to_int(key(i)) for i in range(4)]
    want = dict(zip(chain, [None, *chain[:-1]]))
    with TieredKVStore(LAYOUT, [TierConfig("hbm", 4, eviction="leaf_lru"), TierConfig("dram", 8, eviction="leaf_lru")],
                       device="cpu") as store:
        store.put([key(i) for i in range(4)], blocks(4, 3))
        assert store.manager.policies[0]._parent == want
        store.put([key(i) for i in range(10, 14)], blocks(4, 4))  # pushes the chain down to DRAM (a demotion
        # carries no parents, in a replay too: below the top tier a policy sees moves, never a request)
        store.wait(store.prefetch([key(i) for i in range(4)]))
        assert store.lookup([key(i) for i in range(4)])[1] == ["hbm"] * 4
        assert store.manager.policies[0]._parent == want  # was {id: None} for each


def test_threads_putting_prefetching_and_getting_for_a_soak_period(tmp_path):
    """Four threads of a serving loop (put, prefetch the next request, read stats, get,
    flush) for 5 s (``TIERCACHE_SOAK_SECONDS`` sets a longer soak): no errors, invariants
    hold, and the reopened store has every block."""
    import time

    errors: list[BaseException] = []
    touched: set[int] = set()
    data = blocks(64, 8)
    path = tmp_path / "nvme"
    seconds = float(os.environ.get("TIERCACHE_SOAK_SECONDS", "5"))
    with TieredKVStore(LAYOUT, tiers(hbm=4, dram=8, nvme=128), path=path) as store:
        deadline = time.monotonic() + seconds

        def worker(offset: int) -> None:
            rng = np.random.default_rng(offset)
            try:
                while time.monotonic() < deadline:
                    i = (int(rng.integers(0, 32)) + (offset * 8 if rng.random() < 0.5 else 0)) % 64
                    store.put([key(i)], data[i : i + 1])
                    touched.add(i)
                    if rng.random() < 0.3:  # a serving loop prefetching the next request
                        store.prefetch([key(int(j)) for j in rng.integers(0, 64, size=3)])
                    if rng.random() < 0.1:
                        store.stats()
                    if rng.random() < 0.05:
                        store.flush()
                    assert torch.equal(store.get([key(i)])[0], data[i])
            except BaseException as exc:  # noqa: BLE001 - collected for the main thread
                errors.append(exc)

        run_threads(worker, 4, timeout=seconds + 60)
        assert not errors, errors[0]
        store.check_invariants()
        # 140 slots for 64 keys: nothing may have been evicted, so every block put is stored.
        put = {i for i in range(64) if store.lookup([key(i)])[0]}
        assert len(put) == sum(1 for i in range(64) if i in touched)
    with TieredKVStore(LAYOUT, tiers(hbm=4, dram=8, nvme=128), path=path) as again:
        for i in sorted(touched):
            assert torch.equal(again.get([key(i)])[0], data[i]), i


def test_prefetch_runs_in_the_background_until_polled(tmp_path):
    """A delayed NVMe read: the plan stays in flight, lookups see the old tier, poll publishes."""
    gate = threading.Event()
    data = blocks(6, 9)
    with TieredKVStore(LAYOUT, tiers(hbm=2, dram=2), path=tmp_path / "nvme") as store:
        store.put([key(i) for i in range(6)], data)
        medium = store._media[2]
        original = medium._read_one

        def delayed(*args):
            gate.wait(10)  # the wrapper delays I/O on command
            return original(*args)

        medium._read_one = delayed
        assert store.lookup([key(0)])[1] == ["nvme"]
        assert store.prefetch([key(0), key(1)]).blocks == 2
        assert store.poll() == 0 and store.lookup([key(0), key(1)])[1] == ["nvme", "nvme"]
        assert store.stats()["queue_depth"] == 1
        store.check_invariants()
        gate.set()
        for _ in range(200):
            if store.poll():
                break
            threading.Event().wait(0.01)
        assert store.lookup([key(0), key(1)])[1] == ["hbm", "hbm"]
        assert torch.equal(store.get([key(0)])[0], data[0])
        store.check_invariants()


def test_offline_policies_are_refused_by_the_live_store():
    with pytest.raises(UserError, match="future"):
        TieredKVStore(LAYOUT, [TierConfig("hbm", 4)], eviction="belady")


def test_get_into_a_reused_buffer_and_zero_copy_slots(tmp_path):
    data = blocks(6, 10)
    with TieredKVStore(LAYOUT, tiers(hbm=3, dram=3), path=tmp_path / "nvme") as store:
        store.put([key(i) for i in range(6)], data)
        out = torch.empty((2, *LAYOUT.block_shape), dtype=torch.float16)
        assert store.get([key(0), key(5)], out=out) is out
        assert torch.equal(out, data[[0, 5]])
        slots = store.get_slots([key(1), key(2)])
        assert torch.equal(store.hbm_tensor[slots], data[[1, 2]])
        with pytest.raises(UserError):
            store.get([key(0)], out=torch.empty((2, *LAYOUT.block_shape), dtype=torch.float16))
        store.check_invariants()


def test_match_prefix_confirms_hits_by_token_ids():
    tokens = list(range(100, 124))
    with TieredKVStore(LAYOUT, [TierConfig("hbm", 16)]) as store:
        assert store.put_tokens(tokens, blocks(6, 11), "ns") == 6
        assert store.match_prefix(tokens, "ns") == 24
        # Simulate a hash collision: the stored tokens of block 2 differ from the prompt's.
        from tiercache.keys import key_to_int, prefix_keys

        third = key_to_int(prefix_keys(tokens, LAYOUT.block_tokens, "ns")[2])
        store._map.tokens[third] = store._map.tokens[third] + 1
        assert store.match_prefix(tokens, "ns") == 8
        assert store.stats()["token_mismatches"] == 1
