"""Review R34 leftovers, fixed: a prefetch whose keys include one whose id collided with
another key's gave the next block the block before the collision as its parent (the keys
without an id were dropped before the parents were read); a put gives it none.
"""

from __future__ import annotations

import pytest

from store_helpers import LAYOUT, blocks, key, tiers
from tiercache.live import keymap
from tiercache.live.store import TieredKVStore


def test_a_prefetch_breaks_the_parent_chain_at_a_key_it_cannot_reach(tmp_path, monkeypatch):
    keys = [key(i) for i in range(4)]
    with TieredKVStore(LAYOUT, tiers(hbm=1, dram=2, nvme=8), eviction="leaf_lru", path=tmp_path / "nvme",
                       device="cpu") as store:
        store.put(keys, blocks(4, 1))
        ids = store._map.ids(keys, register=False)
        real_id = keymap.key_to_int  # key(99)'s id made keys[1]'s: a 63-bit collision, which get refuses
        monkeypatch.setattr(keymap, "key_to_int", lambda k: real_id(keys[1] if k == key(99) else k))
        seen = []
        real = store.manager.prefetch
        monkeypatch.setattr(store.manager, "prefetch", lambda ids_, parents=None: seen.append(parents) or real(ids_, parents=parents))
        store.wait(store.prefetch([keys[0], key(99), keys[2], keys[3]]))
        assert seen == [{ids[0]: None, ids[2]: None, ids[3]: ids[2]}]  # was {.., ids[2]: ids[0], ..}
        store.check_invariants()


def test_every_sim_module_the_loader_imports_tags_the_trace_cache():
    """Review R34: the trace cache's entry names carry a digest of the parser's modules, which
    left out kvtester and steptrace (whose detection decides how a file is read)."""
    import ast
    from pathlib import Path

    from tiercache.sim import tracecache

    sim = Path(tracecache.__file__).parent

    def sim_imports(module: str) -> set[str]:
        """The ``tiercache.sim`` modules ``module`` imports (``from .x import``, ``from . import x``)."""
        found = set()
        for node in ast.walk(ast.parse((sim / f"{module}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module} if node.module else {alias.name for alias in node.names}
        return {m.partition(".")[0] for m in found if (sim / f"{m.partition('.')[0]}.py").exists()}

    reached, todo = set(), ["loader", "tracecache"]
    while todo:  # what the loader and the cache import, and what those import, within the package
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(sim_imports(module))
    missing = reached - set(tracecache._PARSER_MODULES)
    assert "kvfolder" in reached and not missing, missing


@pytest.mark.parametrize("refusal", ["fork", "thread", "sem_open"])
def test_a_replay_whose_workers_cannot_start_runs_in_one_process(monkeypatch, refusal):
    """Review R34: only a full /dev/shm fell back to one process; a fork refused at the
    process limit (EAGAIN, in the first submit), a manager thread that cannot start, or a
    Python without sem_open (the pool's constructor) printed a traceback."""
    import multiprocessing.context
    from concurrent.futures import ProcessPoolExecutor

    from conftest import DATA
    from tiercache.sim import sweep
    from tiercache.sim.sweep import run_sweep

    trace = str(DATA / "mooncake_head.jsonl")
    want = run_sweep(trace, ["lru", "fifo"], [100], ["object"], workers=1, progress=False)["runs"]
    errors = {"fork": OSError(11, "Resource temporarily unavailable"), "thread": RuntimeError("can't start new thread"),
              "sem_open": NotImplementedError("This Python build lacks multiprocessing.synchronize")}

    def refuse(*args, **kwargs):
        raise errors[refusal]

    if refusal == "fork":
        monkeypatch.setattr(multiprocessing.context.ForkProcess, "start", refuse)
    elif refusal == "thread":
        monkeypatch.setattr(ProcessPoolExecutor, "_start_executor_manager_thread", refuse)
    else:
        monkeypatch.setattr(sweep, "ProcessPoolExecutor", refuse)
    with pytest.warns(RuntimeWarning, match=r"worker processes could not start \(.*\); the 2 replays run one after"):
        got = run_sweep(trace, ["lru", "fifo"], [100], ["object"], workers=2, progress=False)["runs"]
    assert [(r["policy"], r["hits"], r["misses"]) for r in got] == [(r["policy"], r["hits"], r["misses"]) for r in want]
    assert sweep._WORKER_DATA is None and sweep._STARTED is None  # nothing of the replay's data kept


def test_slicing_hints_gives_the_slice_its_own_time_even_without_next_uses_or_parents():
    """The replay's own copy of the slicing rule (``_cut``) is gone; the shared one kept a
    batch's time for a slice when the hints held nothing else (an out-of-tree policy reads it)."""
    from tiercache.core.guards import slice_hints
    from tiercache.policies.base import Hints

    assert slice_hints(Hints(5), 2, 4) == Hints(7)
    assert slice_hints(Hints(5, (1, 2, 3, 4), (None, 1, 2, 3)), 1, 3) == Hints(6, (2, 3), (1, 2))
    assert slice_hints(None, 0, 3) is None
