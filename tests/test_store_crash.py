"""The live store killed with SIGKILL at random moments: during put, get, prefetch, flush, close.

The child runs a serving-like loop over a small three-tier store (so blocks keep moving
between HBM, DRAM and NVMe): it puts new blocks, prefetches and reads old ones (checking
their bytes), flushes, and now and then closes and reopens the store. Before every flush
(and every close) it prints ``F`` and the keys the NVMe tier holds; after it, ``S``. A set
printed by an ``F`` that was followed by its ``S`` is durable: the reopened store must hold
each of those keys unless its deletion could have been the one being flushed when the kill
came (then it is absent from the in-progress ``F``). Whatever the reopened store holds must be
bit-identical to what was put: nothing torn, nothing stale, nothing invented. (The NVMe
store reuses a slot only once the deletion that freed it is durable, so a flushed block's
bytes stay intact until a flush records that it left; the child's store gets enough spare
slots that no flush happens unannounced, and says ``X`` if one did.)
"""

from __future__ import annotations

import os
import random
import sys
import textwrap

import torch

from conftest import kill_at_random
from tiercache.config import KVLayout, TierConfig
from tiercache.live.store import TieredKVStore

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=32, dtype="bfloat16", block_tokens=16)
TIERS = [TierConfig("hbm", 3), TierConfig("dram", 4), TierConfig("nvme", 24)]

CHILD = textwrap.dedent("""
    import random, sys, torch
    import tiercache.live.media
    from tiercache.config import KVLayout, TierConfig
    from tiercache.live.store import TieredKVStore

    # Room for every deletion between two of the loop's flushes, so the store never has to
    # flush on its own to recycle slots: every flush is one the log below announces.
    tiercache.live.media.spare_slots = lambda capacity: 64

    LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=32, dtype="bfloat16", block_tokens=16)
    TIERS = [TierConfig("hbm", 3), TierConfig("dram", 4), TierConfig("nvme", 24)]

    def key(i):
        return b"k%015d" % i

    def block(i):
        g = torch.Generator().manual_seed(i)
        return torch.randint(-2**15, 2**15, (1, *LAYOUT.block_shape), dtype=torch.int16, generator=g).view(torch.bfloat16)

    def say(*words):
        sys.stdout.write(" ".join(map(str, words)) + "\\n")  # one write: no torn lines
        sys.stdout.flush()

    def flushes(store):
        return store._media[2].stats["flushes"]

    def on_nvme(store, known):
        where = store.lookup([key(i) for i in known])[1]
        return [i for i, w in zip(known, where) if w == "nvme"]

    path, start, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    store = TieredKVStore(LAYOUT, TIERS, path=path)
    known = [int(k[1:]) for k, _ in store._media[2].items()]
    i, step = start, 0
    while True:
        seen = flushes(store)
        store.put([key(i), key(i + 1)], torch.cat([block(i), block(i + 1)]))
        known += [i, i + 1]
        i += 2
        stored = [j for j, w in zip(known, store.lookup([key(j) for j in known])[1]) if w]
        if rng.random() < 0.4:
            store.prefetch([key(j) for j in rng.sample(stored, min(3, len(stored)))])
            stored = [j for j, w in zip(known, store.lookup([key(j) for j in known])[1]) if w]  # it may evict
        if rng.random() < 0.4:
            picked = rng.sample(stored, min(2, len(stored)))
            got = store.get([key(j) for j in picked])
            if not all(torch.equal(got[n].view(torch.int16), block(j)[0].view(torch.int16)) for n, j in enumerate(picked)):
                say("BAD", *picked)
        if flushes(store) != seen:
            say("X")  # a flush nobody announced: the durable set is unknown until the next one
        step += 1
        if step % 3 == 0:
            store.wait()  # moves in flight settle first, so the set below is where blocks are
            say("F", *on_nvme(store, known))
            store.flush()
            say("S")
        if step % 11 == 0:
            store.wait()
            say("F", *on_nvme(store, known))
            store.close()
            say("S")
            store = TieredKVStore(LAYOUT, TIERS, path=path)
            known = [int(k[1:]) for k, _ in store._media[2].items()]
""")


def key(i: int) -> bytes:
    return b"k%015d" % i


def block(i: int) -> torch.Tensor:
    """Random bits as bf16 (NaNs included): compare them as int16, bit for bit."""
    g = torch.Generator().manual_seed(i)
    return torch.randint(-(2**15), 2**15, (1, *LAYOUT.block_shape), dtype=torch.int16, generator=g).view(torch.bfloat16)


def must_survive(lines: list[str]) -> set[int]:
    """Keys of the last confirmed ``F`` set, less those a flush in progress may have deleted."""
    confirmed: set[int] = set()
    pending: set[int] | None = None
    for line in lines:
        words = line.split()
        if words[0] == "F":
            pending = {int(w) for w in words[1:]}
        elif words[0] == "S" and pending is not None:
            confirmed, pending = pending, None
        elif words[0] == "X":
            confirmed = set()
    return confirmed if pending is None else confirmed & pending


def test_sigkill_at_random_moments_loses_no_flushed_block_and_serves_nothing_wrong(tmp_path):
    path = str(tmp_path / "store")
    rng = random.Random(20261130)
    kills, checked = int(os.environ.get("TIERCACHE_CRASH_KILLS", "8")), 0
    for run in range(kills):
        argv = [sys.executable, "-c", CHILD, path, str(100_000 * (run + 1)), str(rng.randrange(2**31))]
        lines = kill_at_random(argv, rng, (0.0, 1.2))
        assert not [line for line in lines if line.startswith("BAD")], "the child read wrong bytes"
        expected = must_survive(lines)
        with TieredKVStore(LAYOUT, TIERS, path=path) as store:
            nvme = store._media[2]
            held = {int(k[1:]): slot for k, slot in nvme.items()}
            missing = expected - set(held)
            assert not missing, f"run {run}: flushed blocks lost: {sorted(missing)[:5]}"
            out = torch.empty(LAYOUT.block_shape, dtype=torch.bfloat16)
            for i, slot in held.items():  # read in place: a get would move blocks around
                nvme.read_block(slot, key(i), out)
                assert torch.equal(out.view(torch.int16), block(i)[0].view(torch.int16)), f"run {run}: block {i} is wrong"
            store.check_invariants()
            checked += len(expected)
    assert checked > 0, "no kill came after a confirmed flush: the test checked nothing"
