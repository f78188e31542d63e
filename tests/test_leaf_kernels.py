"""The prefix-tree kernels (``leaf_lru``, ``cost``, ``session``) hook by hook against their classes.

Fresh random hook sequences drive a policy class and its kernel side by side: inserts with a
random parent (tracked or not, or none), accesses with a parent hint, victim calls with a
random protected set, removals. Trace ids are a shuffle of the dense ids, so ties of key
(frequent in ``cost``) must break by trace id as the class breaks them. Every victims answer
must be the same list in the same order, and sizes must agree throughout.
"""

from __future__ import annotations

import numpy as np
import pytest

from tiercache.policies import make_eviction
from tiercache.policies.base import Hints

numba = pytest.importorskip("numba", reason="the kernels need numba")

from tiercache.policies.kernels import PROT, S_PARENTS, S_REQ, leafprio  # noqa: E402
from tiercache.sim.array_manager import ArrayTierManager  # noqa: E402


class KernelDriver:
    """One tier's kernel state, driven with dense ids one hook call at a time."""

    def __init__(self, policy: str, capacity: int, trace_ids: np.ndarray) -> None:
        self.manager = ArrayTierManager(policy, ("hbm",), (capacity,), len(trace_ids))
        self.manager.set_trace_ids(np.arange(len(trace_ids)), trace_ids)
        from tiercache.policies import get_kernel

        self.module = get_kernel(policy)
        self.P, self.M, self.X, self.G = self.manager.P, self.manager.M, self.manager.X, self.manager.G
        self.T = len(self.M) - 1

    def _call(self, hook, x: int, parent: int | None) -> None:
        arr = np.array([x if parent is None else parent, x], dtype=np.int32)
        self.M[self.T, S_PARENTS] = 0 if parent is None else 1
        self.M[self.T, S_REQ] = 0
        hook(self.P, self.M, self.X, self.G, 0, arr, 1, 2)

    def insert(self, x: int, parent: int | None) -> None:
        self._call(self.module.on_insert, x, parent)

    def access(self, x: int, parent: int | None) -> None:
        self._call(self.module.on_access, x, parent)

    def remove(self, ids: list[int]) -> None:
        arr = np.array(ids, dtype=np.int32)
        self.module.on_remove(self.P, self.M, self.X, self.G, 0, arr, 0, len(arr))

    def victims(self, n: int, protected: set[int]) -> list[int] | None:
        for x in protected:
            self.G[PROT, x] = 1
        ok = self.module.victims(self.P, self.M, self.X, self.G, 0, n)
        for x in protected:
            self.G[PROT, x] = 0
        return [int(v) for v in self.P[0, :n, -1]] if ok else None

    def __len__(self) -> int:
        return int(self.M[0, leafprio.SIZE])


@pytest.mark.parametrize("policy", ["leaf_lru", "cost", "session"])
@pytest.mark.parametrize("seed", range(6))
def test_kernel_hooks_equal_the_class(policy, seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(8, 40)) if seed % 2 else int(rng.integers(100, 160))  # large: session's follow budget
    n_ids = 3 * capacity
    trace = (rng.permutation(n_ids) * 7 + 3).astype(np.int64)  # trace id of dense id x
    reference, kernel = make_eviction(policy, capacity), KernelDriver(policy, capacity, trace)
    tracked: set[int] = set()
    compared = 0
    for _ in range(4000):
        op = rng.random()
        x = int(rng.integers(n_ids))
        parent = None if rng.random() < 0.25 else int(rng.integers(n_ids))
        parent = None if parent == x else parent
        hints = Hints(parents=[None if parent is None else int(trace[parent])])
        if x in tracked and op < 0.5:
            reference.on_access([int(trace[x])], hints)
            kernel.access(x, parent)
        elif x not in tracked and len(tracked) < capacity:
            reference.on_insert([int(trace[x])], hints)
            kernel.insert(x, parent)
            tracked.add(x)
        elif tracked:
            n = int(rng.integers(1, min(6, len(tracked)) + 1))
            share = rng.choice([0.0, 0.3, 0.8])  # much protected: leaves hidden, key order taken
            protected = {p for p in tracked if rng.random() < share}
            want = reference.victims(n, {int(trace[p]) for p in protected})
            got = kernel.victims(n, protected)
            assert (None if got is None else [int(trace[v]) for v in got]) == want, (policy, seed, compared)
            compared += 1
            if want is not None:
                gone = got if rng.random() < 0.7 else [int(v) for v in rng.choice(sorted(tracked), n, replace=False)]
                reference.on_remove([int(trace[v]) for v in gone])
                kernel.remove(gone)
                tracked -= set(gone)
        assert len(kernel) == len(reference) == len(tracked)
    reference.check_invariants()
    assert compared > 100


def test_state_bytes_is_what_the_manager_allocates_and_guards_replay(tmp_path, monkeypatch):
    """``state_bytes`` equals the arrays made; a replay whose kernel state would not fit in a
    quarter of the available memory takes the Python manager, with the same record."""
    import dataclasses

    from tiercache.config import TierConfig
    from tiercache.results import Semantics
    from tiercache.sim import replay as replay_module
    from tiercache.sim.array_manager import state_bytes
    from tiercache.sim.loader import load_trace
    from tiercache.sim.replay import ReplayData, RunSpec, kernel_state_fits, replay
    from tiercache.sim.traces import Request, write_requests

    for policy in ("lru", "lfu", "arc", "session", "cost"):
        made = ArrayTierManager(policy, ("hbm", "dram"), (10, 20), 500, 7)
        assert state_bytes(policy, 2, 500, 7) == sum(a.nbytes for a in (made.P, made.M, made.X, made.G)) - made.M.nbytes
    path = str(tmp_path / "t.jsonl")
    write_requests(path, [Request(i, 512 * 3, 1, (i % 5, 100 + i, 200 + i % 7)) for i in range(200)])
    data = ReplayData.prepare(load_trace(path), None, None)
    spec = RunSpec("session", Semantics.PREFIX, (TierConfig("hbm", 8),))
    need = state_bytes("session", 1, data.n_ids, data.max_count)
    assert kernel_state_fits(spec, data, 4 * need) and not kernel_state_fits(spec, data, 4 * need - 4)
    fast = dataclasses.asdict(replay(spec, data))
    monkeypatch.setattr(replay_module, "kernel_state_fits", lambda spec, data: False)
    monkeypatch.setattr(replay_module, "_replay_kernels", None)  # would raise if taken
    slow = dataclasses.asdict(replay(spec, data))
    fast.pop("wall_seconds"), slow.pop("wall_seconds")
    assert fast == slow
