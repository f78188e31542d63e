"""Probe Q13: writing your own policy (out-of-tree eviction, admission, placement, prefetch).

Finding 1: a ``module:Class`` offline policy that is not Belady was drawn as "offline optimum:
the bound", and the report described a belady run (and "the dashed black line (belady)") that
the results did not hold. Finding 2: a policy leaving ``batch_insert_safe`` False (every
out-of-tree policy, lfu, arc, ...) had each of its interleaved demotions charged as a transfer
of its own, ~18% more link time than lru for the same moves. Finding 3: a placement answer
of ``1.0`` passed the range check and crashed later; ``True`` was taken as tier 1. Finding 4:
a policy that emptied the list given to ``on_remove`` broke the manager's bookkeeping.
Finding 5: a policy's ``KeyboardInterrupt`` (``--workers 1``) or own ``BaseException``
subclass was not reported as its failure.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import DATA, random_request_trace, sample_requests
from policy_driver import next_uses
from tiercache.cli import main
from tiercache.config import TierConfig, layout_preset
from tiercache.core.decode import StepDriver
from tiercache.core.manager import TierManager
from tiercache.policies import ADMISSION, EVICTION, Hints, make_admission, make_eviction, make_placement
from tiercache.policies.kernels import HAVE_NUMBA
from tiercache.report import plots
from tiercache.report.model import load_results
from tiercache.results import Semantics
from tiercache.sim.array_manager import ArrayTierManager
from tiercache.sim.engine import LinkUsage, SimEngine
from tiercache.sim.hardware import PRESETS
from tiercache.sim.loader import load_trace
from tiercache.sim.replay import ReplayData, RunSpec, replay

MODULE = "q13_policies"
HEAD = DATA / "mooncake_head.jsonl"
LLAMA, H200 = layout_preset("llama-3-8b", 512), PRESETS["h200-pcie5-nvme4"]
TIERS3 = (("hbm", 2), ("dram", 4), ("nvme", 8))

#: Out-of-tree policies as a user writes them (README "Policies"), in a module of their own.
POLICIES = '''
import os, signal, time
from collections import OrderedDict

from tiercache.policies import AdmissionPolicy, EvictionPolicy, PlacementPolicy, PrefetchPolicy


def _empty(ids):
    """What a consuming policy does to a list it was given (a tuple it cannot change)."""
    if isinstance(ids, list):
        ids.clear()


class MyLRU(EvictionPolicy):
    """A plain LRU; ``batch_insert_safe`` left at its default False."""

    def __init__(self, capacity):
        super().__init__(capacity)
        self.od = OrderedDict()

    def on_insert(self, ids, hints=None):
        for i in ids:
            self.od[i] = None

    def on_access(self, ids, hints=None):
        for i in ids:
            self.od.move_to_end(i)

    def on_remove(self, ids):
        for i in ids:
            del self.od[i]

    def victims(self, n, protected=()):
        out = [i for i in self.od if i not in protected][:n]
        return out if len(out) == n else None

    def __len__(self):
        return len(self.od)

    def __contains__(self, i):
        return i in self.od


class MyLRUBatch(MyLRU):
    batch_insert_safe = True  # the only difference: the same decisions


class OfflineFIFO(MyLRU):
    needs_future = True  # reads the future (a lookahead heuristic, say); here it ignores it

    def on_access(self, ids, hints=None):
        pass


class Consumes(MyLRU):
    """Empties every list it is given once read; pops the ids it removes."""

    def on_insert(self, ids, hints=None):
        super().on_insert(ids, hints)
        _empty(ids)

    def on_access(self, ids, hints=None):
        super().on_access(ids, hints)
        _empty(ids)

    def on_remove(self, ids):
        if isinstance(ids, list):
            while ids:
                del self.od[ids.pop()]
        else:
            super().on_remove(ids)


class ConsumingAdmit(AdmissionPolicy):
    def admit(self, ids):
        answer = [True] * len(ids)
        _empty(ids)
        return answer


class ConsumingTop(PlacementPolicy):
    def insert_tier(self, ids, hints=None):
        _empty(ids)
        return 0

    def promote_tier(self, ids, tier, hints=None):
        _empty(ids)
        return 0


class ConsumingAhead(PrefetchPolicy):
    def plan(self, view):
        wanted = [b for b in view.ahead if not view.in_top(b)]
        for ids in (view.reads, view.candidates, view.ahead):
            _empty(ids)
        return wanted


class Answers(PlacementPolicy):
    insert = 0
    promote = 0

    def insert_tier(self, ids, hints=None):
        return type(self).insert

    def promote_tier(self, ids, tier, hints=None):
        return type(self).promote


class Half(Answers):
    insert = 1.0  # n_tiers / 2 - 0.5 for three tiers


class Yes(Answers):
    insert = True


class Floor(Answers):
    promote = 0.0


class KB(MyLRU):
    def victims(self, n, protected=()):
        raise KeyboardInterrupt


class MyStop(BaseException):
    pass


class Stops(MyLRU):
    def victims(self, n, protected=()):
        raise MyStop("policy gave up")


class CtrlC(MyLRU):
    """A user pressing Ctrl-C while the replay runs (a real SIGINT to this process)."""

    def victims(self, n, protected=()):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # the default handler raises KeyboardInterrupt here
        return super().victims(n, protected)
'''


@pytest.fixture(scope="module")
def pol(tmp_path_factory):
    """The module ``q13_policies`` on ``sys.path`` (forked workers import it too)."""
    folder = tmp_path_factory.mktemp("q13")
    (folder / f"{MODULE}.py").write_text(POLICIES)
    sys.path.insert(0, str(folder))
    yield importlib.import_module(MODULE)
    sys.path.remove(str(folder))
    sys.modules.pop(MODULE, None)


def manager(policy_class, tiers=TIERS3, engine=None, admission=None, placement=None) -> TierManager:
    return TierManager(list(tiers), [policy_class(c) for _, c in tiers],
                       [make_admission("always") if admission is None or i == 0 else admission() for i in range(len(tiers))],
                       engine=engine, placement=placement)


def head_requests() -> list[list[int]]:
    return sample_requests(HEAD)


# -- finding 1: only a Belady run is the bound -------------------------------------------------
def test_an_offline_policy_that_is_not_belady_is_a_reference_and_no_belady_text_appears(tmp_path, pol, capsys):
    out, rep = tmp_path / "r.json", tmp_path / "rep"
    assert main(["replay", str(HEAD), "--policy", f"lru,{MODULE}:OfflineFIFO", "--capacity", "40,160",
                 "--no-progress", "--out", str(out)]) == 0
    assert main(["report", str(out), "-o", str(rep)]) == 0
    capsys.readouterr()
    runs = load_results([str(out)]).runs
    offline = [r for r in runs if r.offline]
    assert {plots._offline_label(r) for r in offline} == {f"{MODULE}:OfflineFIFO (reads the future: a reference, not a bound)"}
    colors = plots.policy_colors(runs)
    assert colors[f"{MODULE}:OfflineFIFO"] != plots._OFFLINE_COLOR  # black is Belady's alone
    md = (rep / "report.md").read_text().replace("\\_", "_")  # Markdown escapes the module's underscore
    for claim in ("The policy belady", "dashed black line", "no policy can miss less", "it is the bound",
                  "the best any policy could do"):
        assert claim not in md, claim
    assert "No run of belady (Belady's MIN) is in these results" in md
    assert (f"{MODULE}:OfflineFIFO reads the future, so no serving system can run it: an offline reference, "
            "not a bound.") in md
    assert f"The dashed line of {MODULE}:OfflineFIFO reads the future: a reference, not a bound." in md


def test_belady_beside_another_offline_policy_keeps_the_bound_and_names_both(tmp_path, pol, capsys):
    out, rep = tmp_path / "r.json", tmp_path / "rep"
    assert main(["replay", str(HEAD), "--policy", f"lru,belady,{MODULE}:OfflineFIFO", "--capacity", "40,160",
                 "--no-progress", "--out", str(out)]) == 0
    assert main(["report", str(out), "-o", str(rep)]) == 0
    capsys.readouterr()
    labels = {r.label: plots._offline_label(r) for r in load_results([str(out)]).runs if r.offline}
    assert labels == {"belady": "belady (offline optimum: the bound)",
                      f"{MODULE}:OfflineFIFO": f"{MODULE}:OfflineFIFO (reads the future: a reference, not a bound)"}
    md = (rep / "report.md").read_text().replace("\\_", "_")  # Markdown escapes the module's underscore
    assert "The policy belady (Belady's MIN)" in md and "no policy can miss less: it is the bound." in md
    assert "The dashed black line (belady) is the best any policy could do." in md
    assert f"The dashed line of {MODULE}:OfflineFIFO reads the future: a reference, not a bound." in md


# -- finding 2: the charge depends on what moves, not on batch_insert_safe -------------------
def test_interleaved_demotions_of_one_chunk_are_charged_as_one_transfer_per_link(pol):
    usages = {}
    for cls in (pol.MyLRU, pol.MyLRUBatch):
        engine = SimEngine(("hbm", "dram", "nvme"), LLAMA.block_bytes, H200)
        m = manager(cls, engine=engine)
        m.access([1, 2])
        m.access([3, 4])  # the two victims of HBM move down: one at a time for MyLRU
        m.check_invariants()
        usages[cls.__name__] = engine.usage
    one = usages["MyLRU"]["hbm->dram"]
    assert (one.blocks, one.bytes, one.transfers) == (2, 2 * LLAMA.block_bytes, 1)
    assert one.seconds == pytest.approx(H200.links["hbm->dram"].seconds(2 * LLAMA.block_bytes), rel=1e-12)
    assert usages["MyLRU"] == usages["MyLRUBatch"]


def _charged(usage: dict[str, LinkUsage]) -> dict:
    return {link: (u.blocks, u.bytes, u.transfers, round(u.seconds, 9)) for link, u in sorted(usage.items())}


def test_a_policy_that_is_not_batch_safe_pays_what_lru_pays_for_the_same_moves(pol):
    data = ReplayData.prepare(load_trace(str(HEAD)), LLAMA, H200)
    tiers = tuple(TierConfig(n, c) for n, c in (("hbm", 10), ("dram", 30), ("nvme", 100)))
    records = {p: replay(RunSpec(p, Semantics.OBJECT, tiers), data) for p in (f"{MODULE}:MyLRU", f"{MODULE}:MyLRUBatch", "lru")}
    mine, batched, lru = records.values()
    assert mine.tiers == batched.tiers == lru.tiers and mine.bytes_moved == lru.bytes_moved
    assert mine.modeled_seconds == batched.modeled_seconds == lru.modeled_seconds


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed: no kernels")
@pytest.mark.parametrize("policy", ["lfu", "arc", "sieve"])
def test_kernels_charge_one_at_a_time_inserts_as_the_python_manager_does(policy):
    requests = head_requests()[:120]
    dense: dict[int, int] = {}
    engine = SimEngine(("hbm", "dram", "nvme"), LLAMA.block_bytes, H200)
    python = TierManager(list(TIERS3), [make_eviction(policy, c, i) for i, (_, c) in enumerate(TIERS3)],
                         [make_admission("always") for _ in TIERS3], engine=engine)
    for ids in requests:
        python.access(ids)
        for block in ids:
            dense.setdefault(block, len(dense))
    kernel = ArrayTierManager(policy, ("hbm", "dram", "nvme"), tuple(c for _, c in TIERS3), len(dense))
    kernel.set_trace_ids(np.arange(len(dense), dtype=np.int32), np.array(list(dense), dtype=np.int64))
    for ids in requests:
        kernel.access([dense[b] for b in ids])
    charged = SimEngine(("hbm", "dram", "nvme"), LLAMA.block_bytes, H200)
    kernel.charge(charged)
    demotions = ("hbm->dram", "dram->nvme", "hbm->nvme")
    assert _charged({k: u for k, u in charged.usage.items() if k in demotions}) == \
        _charged({k: u for k, u in engine.usage.items() if k in demotions})
    assert engine.usage["hbm->dram"].transfers < engine.usage["hbm->dram"].blocks  # coalesced


# -- finding 3: a placement answer is an int ---------------------------------------------------
@pytest.mark.parametrize("cls,answer", [("Half", "1.0 (float)"), ("Yes", "True (bool)")])
def test_a_placement_answer_that_is_not_an_int_is_refused_naming_it(pol, cls, answer):
    m = manager(pol.MyLRU, placement=getattr(pol, cls)(3))
    with pytest.raises(ValueError) as caught:
        m.access([1])
    assert str(caught.value) == f"placement {MODULE}:{cls}: insert_tier answered {answer}, not one of [0, 1, 2]"
    m.check_invariants()
    assert m.locate(1) is None


def test_a_float_promote_answer_is_refused_and_a_numpy_int_is_taken(pol):
    m = manager(pol.MyLRU, placement=pol.Floor(3))
    m.access([1, 2, 3])  # 1 goes down to DRAM
    with pytest.raises(ValueError) as caught:
        m.access([1])
    assert str(caught.value) == f"placement {MODULE}:Floor: promote_tier answered 0.0 (float), not one of [0, 1]"
    numpy_one = type("NumpyOne", (pol.Answers,), {"insert": np.int64(1), "__module__": MODULE})
    m = manager(pol.MyLRU, placement=numpy_one(3))
    m.access([7])
    assert m.locate(7) == 1


# -- finding 4: policies get sequences the manager does not reuse ----------------------------
def _drive(m: TierManager, requests) -> list:
    events = []
    for ids in requests:
        m.access(list(ids))
        m.check_invariants()
        events.extend(m.events.drain())
    return events + [sorted(d.slot_of) for d in m.dirs]


@pytest.mark.parametrize("tiers", [(("hbm", 100),), (("hbm", 50), ("dram", 100), ("nvme", 200))])
def test_a_policy_that_empties_the_lists_it_is_given_runs_as_lru(pol, tiers):
    requests = head_requests()
    assert _drive(manager(pol.Consumes, tiers), requests) == _drive(manager(pol.MyLRU, tiers), requests)


def test_consuming_admission_and_placement_change_nothing(pol):
    tiers = (("hbm", 20), ("dram", 40), ("nvme", 80))
    requests = head_requests()[:150]
    consuming = manager(pol.Consumes, tiers, admission=pol.ConsumingAdmit, placement=pol.ConsumingTop(3))
    assert _drive(consuming, requests) == _drive(manager(pol.MyLRU, tiers), requests)


def test_a_prefetch_policy_that_empties_the_view_leaves_the_callers_lists(pol):
    m = manager(pol.MyLRU, (("hbm", 4), ("dram", 4), ("nvme", 8)))
    m.access([1, 2, 3, 4, 5, 6])  # 1 and 2 in DRAM
    driver = StepDriver(m, pol.ConsumingAhead(4), store_misses=True)
    reads, ahead = [5, 6], [1, 2]
    ticket = driver.begin_read(0, 0, reads, False, ahead=ahead)
    driver.end_read(ticket)
    assert (reads, ahead, ticket.prefetched) == ([5, 6], [1, 2], 2)
    m.wait_all()
    assert (m.locate(1), m.locate(2)) == (0, 0)
    m.check_invariants()


def _unchanging(method, name: str):
    """``method`` checked to leave the ids and hints it is given as they were (the manager
    hands tiercache's own policies its sequences, which it goes on using)."""
    def call(*args):
        before = repr(args)
        answer = method(*args)
        assert repr(args) == before, f"{name} changed what it was given: {before} -> {args!r}"
        return answer
    return call


def _watched(policy, methods: tuple[str, ...]):
    for method in methods:
        setattr(policy, method, _unchanging(getattr(policy, method), f"{type(policy).__name__}.{method}"))
    return policy


def _drive_with_hints(m: TierManager, requests) -> None:
    flat = [b for ids in requests for b in ids]
    uses = next_uses(flat)
    start = 0
    for ids in requests:
        m.access(list(ids), Hints(start, uses[start : start + len(ids)], [None, *ids[:-1]]))
        start += len(ids)
    m.check_invariants()


@pytest.mark.parametrize("name", sorted(EVICTION))
def test_tiercaches_own_eviction_policies_never_change_what_they_are_given(name):
    """Why the manager need not copy for them: each registered policy leaves its ids and hints."""
    tiers = (("hbm", 20), ("dram", 40), ("nvme", 80))
    m = TierManager(list(tiers), [_watched(make_eviction(name, c, i), ("on_insert", "on_access", "on_remove"))
                                  for i, (_, c) in enumerate(tiers)], [make_admission("always") for _ in tiers])
    _drive_with_hints(m, head_requests()[:150])


@pytest.mark.parametrize("admission", sorted(ADMISSION))
def test_tiercaches_own_admission_and_placement_never_change_what_they_are_given(admission):
    tiers = (("hbm", 20), ("dram", 40), ("nvme", 80))
    admissions = [make_admission("always")] + [_watched(make_admission(admission), ("admit",)) for _ in tiers[1:]]
    placement = _watched(make_placement("reuse", 3), ("insert_tier", "promote_tier"))
    m = TierManager(list(tiers), [make_eviction("lru", c, i) for i, (_, c) in enumerate(tiers)], admissions,
                    placement=placement)
    _drive_with_hints(m, head_requests()[:150])


def test_the_live_store_with_a_consuming_policy_stays_consistent(pol, tmp_path):
    torch = pytest.importorskip("torch")
    from tiercache import TieredKVStore
    from tiercache.config import KVLayout

    layout = KVLayout(layers=1, kv_heads=1, head_dim=8, dtype="float16", block_tokens=16)
    with TieredKVStore(layout, [TierConfig("hbm", 4)], eviction=f"{MODULE}:Consumes") as store:
        for i in range(12):
            store.put([i.to_bytes(16, "little")], torch.full((1, *layout.block_shape), float(i), dtype=torch.float16))
            store.check_invariants()
        assert store.manager.dirs[0].n_free == 0 and len(store.manager.policies[0]) == 4


# -- finding 5: a policy's BaseException is its failure; a real Ctrl-C is Ctrl-C --------------
@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return random_request_trace(tmp_path / "t.jsonl", requests=60, ids=26, seed=5)


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("cls,what", [("KB", "KeyboardInterrupt"), ("Stops", "MyStop: policy gave up")])
def test_a_policys_own_base_exception_is_one_line_naming_it_and_the_run(capsys, trace, pol, cls, what, workers):
    code = main(["replay", str(trace), "--policy", f"{MODULE}:{cls},lru", "--capacity", "4", "--workers", workers,
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert (f"out-of-tree policy {MODULE}:{cls} failed in the replay of {MODULE}:{cls} at capacity 4 "
            f"(object semantics): {what}") in err


def test_a_real_ctrl_c_during_an_out_of_tree_replay_is_still_an_interrupt(capsys, trace, pol):
    code = main(["replay", str(trace), "--policy", f"{MODULE}:CtrlC", "--capacity", "4", "--workers", "1", "--no-progress"])
    assert (code, capsys.readouterr().err) == (130, "tiercache: interrupted\n")
