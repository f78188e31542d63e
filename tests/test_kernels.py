"""Compiled replay kernels against the Python manager and reference policy classes.

Every registered eviction policy is replayed twice on fresh random request traces (shared
prefixes, repeated ids inside a request, ids seen once): through ``replay`` as it runs
(``ArrayTierManager`` and ``tiercache.sim.chain`` for policies with a kernel) and through
the Python ``TierManager`` with the policy classes (``use_kernels`` forced off). The two
run records must be equal in every count (hits, misses, per-tier inserts, evictions,
demotions, promotions, hits read in place or promoted, bytes per link) in object and prefix
semantics, one tier and three, with modeled seconds equal to rounding. A policy without a
kernel (an out-of-tree one) takes the Python path.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from tiercache.config import TierConfig, layout_preset
from tiercache.policies import EVICTION, KERNELS, get_kernel
from tiercache.policies.base import NO_NEXT_USE
from tiercache.results import Semantics
from tiercache.sim import replay as replay_module
from tiercache.sim.array_manager import ArrayTierManager
from tiercache.sim.hardware import PRESETS
from tiercache.sim.loader import load_trace
from tiercache.sim.prep import dense_and_next_use, dense_and_next_use_sorted
from tiercache.sim.replay import ReplayData, RunSpec, replay, use_kernels
from tiercache.sim.traces import Request, write_requests

numba = pytest.importorskip("numba", reason="the kernels need numba; the Python path is tested everywhere else")

HIERARCHIES = {"single": (("hbm", 60),), "three": (("hbm", 24), ("dram", 40), ("nvme", 64))}


def random_trace(path, seed: int, requests: int = 300) -> str:
    """Requests over a few shared documents plus fresh blocks; ids repeat inside some."""
    rng = np.random.default_rng(seed)
    docs = [list(range(1000 * d, 1000 * d + int(rng.integers(2, 40)))) for d in range(12)]
    fresh = 100_000
    out = []
    for r in range(requests):
        doc = docs[int(rng.zipf(1.5)) % len(docs)]
        ids = doc[: int(rng.integers(1, len(doc) + 1))]
        tail = list(range(fresh, fresh + int(rng.integers(0, 6))))
        fresh += len(tail)
        ids = ids + tail
        if rng.random() < 0.1 and ids:
            ids = ids + [ids[0]]  # a repeat inside one request
        out.append(Request(r * 10, 512 * len(ids) + 7, 4, tuple(ids)))
    name = str(path / f"trace{seed}.jsonl")
    write_requests(name, out)
    return name


def python_record(spec: RunSpec, data: ReplayData, monkeypatch: pytest.MonkeyPatch):
    with monkeypatch.context() as patched:
        patched.setattr(replay_module, "use_kernels", lambda spec: False)
        return replay(spec, data)


def comparable(record) -> dict:
    doc = dataclasses.asdict(record)
    doc.pop("wall_seconds")
    seconds = doc.pop("modeled_seconds")
    ttft = doc.pop("ttft_saved_s", None)
    for tier in doc["tiers"]:
        tier["in_place_seconds"] = tier.pop("in_place_seconds") is not None
        tier["promoted_seconds"] = tier.pop("promoted_seconds") is not None
    return doc | {"seconds": {k: round(v, 4) for k, v in seconds.items()}, "ttft": None if ttft is None else round(ttft, 4)}


@pytest.mark.parametrize("policy", sorted(EVICTION))
@pytest.mark.parametrize("semantics", [Semantics.OBJECT, Semantics.PREFIX])
@pytest.mark.parametrize("hierarchy", sorted(HIERARCHIES))
def test_kernel_replay_equals_python_replay(tmp_path, monkeypatch, policy, semantics, hierarchy):
    tiers = tuple(TierConfig(name, cap) for name, cap in HIERARCHIES[hierarchy])
    spec = RunSpec(policy, semantics, tiers)
    assert use_kernels(spec) == (policy in KERNELS)
    for seed in (1, 2):
        trace = load_trace(random_trace(tmp_path, seed))
        data = ReplayData.prepare(trace, layout_preset("llama-3-8b", 512), PRESETS["h200-pcie5-nvme4"])
        ours, reference = replay(spec, data), python_record(spec, data, monkeypatch)
        assert reference.hits > 0 and reference.misses > 0
        assert comparable(ours) == comparable(reference), (policy, semantics, hierarchy, seed)


@pytest.mark.parametrize("policy", ["lru", "fifo", "belady", "arc", "s3fifo", "sieve"])
def test_kernel_replay_matches_pinned_libcachesim(policy):
    """The compiled replay of the bundled trace gives libCacheSim's miss ratios (golden file)."""
    import json
    from pathlib import Path

    data_dir = Path(__file__).parent / "data"
    golden = json.loads((data_dir / "golden_libcachesim.json").read_text())["miss_ratio"][policy]
    data = ReplayData.prepare(load_trace(data_dir / "mooncake_synthetic_trace.jsonl"), None, None)
    for capacity, expected in golden.items():
        spec = RunSpec(policy, Semantics.OBJECT, (TierConfig("hbm", int(capacity)),))
        assert use_kernels(spec)
        tolerance = 3e-4 if policy == "arc" else 5e-5
        assert abs(replay(spec, data).miss_ratio - expected) <= tolerance, (policy, capacity)


def test_registry_links_every_kernel_to_a_policy():
    for name in KERNELS:
        module = get_kernel(name)
        assert name in EVICTION and isinstance(module.CODE, int)
        assert module.BATCH_INSERT_SAFE == replay_module.get_eviction(name).batch_insert_safe
    assert len({get_kernel(name).CODE for name in KERNELS}) == len(KERNELS)
    assert set(KERNELS) == set(EVICTION), "every built-in eviction policy has a kernel"
    assert get_kernel("no_such_policy") is None


def test_access_per_request_equals_whole_trace_run(tmp_path):
    """``access`` once per request (the manager API) gives the counts of one ``run`` call."""
    data = ReplayData.prepare(load_trace(random_trace(tmp_path, 3)), None, None)
    caps = tuple(c for _, c in HIERARCHIES["three"])
    names = tuple(n for n, _ in HIERARCHIES["three"])
    whole = ArrayTierManager("arc", names, caps, data.n_ids, data.max_count)
    whole.run(data.dense, data.next_use, data.offsets, 0, data.n_batches, False, np.zeros(data.n_batches, np.int64))
    stepped = ArrayTierManager("arc", names, caps, data.n_ids, data.max_count)
    for r in range(data.n_batches):
        a, b = int(data.offsets[r]), int(data.offsets[r + 1])
        stepped.access(data.dense[a:b], data.next_use[a:b])
        stepped.check_invariants()
    assert whole.stats() == stepped.stats()
    assert stepped.locate(int(data.dense[-1])) == 0


@pytest.mark.parametrize("seed", range(5))
def test_dense_ids_and_next_use_match_the_sorted_reference(seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 50 if seed % 2 else 10**6, size=2000).astype(np.int64)
    fast, reference = dense_and_next_use(ids), dense_and_next_use_sorted(ids)
    for got, want in zip(fast, reference):
        assert np.array_equal(got, want)
    dense, next_use, n_ids = fast
    assert n_ids == len(np.unique(ids)) and dense[0] == 0
    for i in rng.integers(0, len(ids), size=50):
        later = np.nonzero(ids[i + 1 :] == ids[i])[0]
        assert next_use[i] == (i + 1 + later[0] if len(later) else NO_NEXT_USE)


def test_without_numba_replays_take_the_python_path(tmp_path):
    """``TIERCACHE_NO_NUMBA=1`` forces the fallback; its record is the kernels' record."""
    path = random_trace(tmp_path, 4, requests=120)
    code = (
        "import dataclasses, json, sys\n"
        "from tiercache.config import TierConfig\nfrom tiercache.results import Semantics\n"
        "from tiercache.sim.loader import load_trace\n"
        "from tiercache.sim.replay import ReplayData, RunSpec, replay, use_kernels\n"
        "spec = RunSpec('s3fifo', Semantics.PREFIX, (TierConfig('hbm', 20), TierConfig('dram', 30)))\n"
        "record = dataclasses.asdict(replay(spec, ReplayData.prepare(load_trace(sys.argv[1]), None, None)))\n"
        "record.pop('wall_seconds')\n"
        "print(json.dumps({'kernels': use_kernels(spec), 'numba': 'numba' in sys.modules, 'record': record}, default=str))\n"
    )
    import json
    import os

    runs = {}
    for flag in ("1", "0"):
        env = {**os.environ, "TIERCACHE_NO_NUMBA": flag}
        done = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, env=env, check=True)
        runs[flag] = json.loads(done.stdout)
    assert runs["1"]["kernels"] is False and runs["1"]["numba"] is False
    assert runs["0"]["kernels"] is True
    assert runs["1"]["record"] == runs["0"]["record"]


@pytest.mark.parametrize("policy", ["lru", "session"])
def test_array_manager_refuses_ids_outside_its_dense_range(policy):
    """The compiled code does not check bounds; the manager's entry points do, by name."""
    manager = ArrayTierManager(policy, ("hbm", "dram"), (4, 8), 10)
    for bad in ([3, 10], [-1], [2**40]):
        with pytest.raises(ValueError, match="not a dense id"):
            manager.access(np.array(bad))
        with pytest.raises(ValueError, match="not a dense id"):
            manager.prefix_length(bad)
    with pytest.raises(ValueError, match="not a dense id"):
        manager.locate(-1)
    with pytest.raises(ValueError, match="next uses"):
        manager.access(np.array([1, 2]), np.array([5]))
    ids = np.array([0, 1, 2, 99], dtype=np.int32)
    nus = np.zeros(4, dtype=np.int64)
    with pytest.raises(ValueError, match="not a dense id"):
        manager.run(ids, nus, np.array([0, 2, 4]), 0, 2, True, np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="offsets"):
        manager.run(ids, nus, np.array([0, 3, 9]), 0, 2, True, np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="requests"):
        manager.run(ids, nus, np.array([0, 2, 4]), 0, 5, True, np.zeros(2, np.int64))
    manager.run(ids, nus, np.array([0, 2, 4]), 0, 1, True, np.zeros(2, np.int64))  # the first request is fine
    manager.access(np.array([3, 9]))
    manager.check_invariants()
    assert manager.locate(9) == 0 and manager.prefix_length([3, 9, 5]) == 2


# Requests whose misses push their own later blocks down, or out and back in: the cases where
# a block's next use "as last seen" matters (found by an adversarial fuzz; each differed once).
PUSHED_DOWN = {
    "dropped_then_demoted": ([[5, 10], [8, 2, 3, 6, 6, 2], [7, 3, 8, 5, 4], [0, 5, 8, 2]], (2, 2)),
    "demoted_before_its_turn": ([[5, 8], [3], [6, 8, 0, 4, 3], [5, 6], [8, 7, 0, 3]], (2, 3)),
}


def _write_ids(path, requests) -> str:
    write_requests(path, [Request(t, 512 * len(ids), 1, tuple(ids)) for t, ids in enumerate(requests)])
    return str(path)


def _small_random_requests(seed: int) -> tuple[list[list[int]], tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    n_ids = int(rng.integers(2, 13))
    requests = [[int(b) for b in rng.integers(0, n_ids, size=int(rng.integers(1, 7)))] for _ in range(int(rng.integers(1, 9)))]
    return requests, tuple(int(c) for c in rng.integers(1, 5, size=int(rng.integers(1, 4))))


@pytest.mark.parametrize("case", [*PUSHED_DOWN, *(f"random-{s}" for s in range(120))])
def test_belady_kernel_equals_python_when_a_request_pushes_its_own_blocks_down(tmp_path, monkeypatch, case):
    """Belady's lower tiers learn a demoted block's next use from the manager (``FUT``, and
    ``TierManager._future``). It must be the use the block is about to get when a later id of
    the same request pushes it down, including after it was dropped and came back as a miss:
    both paths then give the same record on tiny hierarchies."""
    requests, caps = PUSHED_DOWN[case] if case in PUSHED_DOWN else _small_random_requests(int(case.split("-")[1]))
    tiers = tuple(TierConfig(name, cap) for name, cap in zip(("hbm", "dram", "nvme"), caps))
    data = ReplayData.prepare(load_trace(_write_ids(tmp_path / "t.jsonl", requests)), None, None)
    for semantics in (Semantics.OBJECT, Semantics.PREFIX):
        spec = RunSpec("belady", semantics, tiers)
        assert comparable(replay(spec, data)) == comparable(python_record(spec, data, monkeypatch)), (case, semantics)


@pytest.mark.parametrize("policy", sorted(set(KERNELS) - {"belady"}))
def test_every_kernel_equals_python_on_tiny_random_hierarchies(tmp_path, monkeypatch, policy):
    """Review Q60: the kernels were compared with the Python manager on tiny hierarchies
    (1-3 tiers of 1-4 blocks, where a request outgrows the hierarchy, pushes its own blocks
    down and out, and repeats ids) for Belady only; every kernel policy, both semantics."""
    for seed in range(100):
        requests, caps = _small_random_requests(1000 + seed)
        tiers = tuple(TierConfig(name, cap) for name, cap in zip(("hbm", "dram", "nvme"), caps))
        data = ReplayData.prepare(load_trace(_write_ids(tmp_path / "t.jsonl", requests)), None, None)
        for semantics in (Semantics.OBJECT, Semantics.PREFIX):
            spec = RunSpec(policy, semantics, tiers)
            assert comparable(replay(spec, data)) == comparable(python_record(spec, data, monkeypatch)), (seed, semantics)
