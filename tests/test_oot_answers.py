"""Probe M, finding 5: what an out-of-tree policy answers is checked where it is asked.

``victims()`` answering too many ids, repeated ones, ids the tier does not hold or was told
to protect, a generator or a spurious None, and ``admit()`` answering too few (or non-bool)
answers used to replay silently with different counts (or fail with a stray TypeError). Now
the manager refuses each in one ``ValueError`` naming the policy, the method and what was
wrong (``tiercache.core.answers``), and the CLI prints it in one line, exit 2. Policies of
tiercache itself are asked directly: the hot path pays nothing. The policies below are defined
in this test module, so they are out-of-tree.
"""

from __future__ import annotations

import random
import sys
import textwrap

import pytest

from conftest import random_request_trace
from tiercache.cli import main
from tiercache.core.answers import plan_asker
from tiercache.core.decode import StepDriver
from tiercache.core.manager import TierManager
from tiercache.policies import PrefetchPolicy, PrefetchView, in_tree, make_admission, make_eviction, make_prefetch
from tiercache.policies.admission_always import AlwaysAdmit
from tiercache.policies.base import AdmissionPolicy
from tiercache.policies.lru import LRU

HERE = __name__  # the module the policies below are defined in (not tiercache: out-of-tree)


class Plain(LRU):
    """Keeps the contract: LRU itself, out-of-tree."""


class Long(LRU):
    def victims(self, n, protected=()):
        return super().victims(n + 1, protected) or super().victims(n, protected)


class Short(LRU):
    def victims(self, n, protected=()):
        return super().victims(1, protected)


class Dup(LRU):
    def victims(self, n, protected=()):
        found = super().victims(1, protected)
        return None if found is None else found * n


class Liar(LRU):
    def victims(self, n, protected=()):
        return [123456789] * n


class IgnoresProtected(LRU):
    def victims(self, n, protected=()):
        return super().victims(n)


class Gen(LRU):
    def victims(self, n, protected=()):
        found = super().victims(n, protected)
        return None if found is None else (v for v in found)


class NeverEvicts(LRU):
    def victims(self, n, protected=()):
        return None


class ShortAdmit(AdmissionPolicy):
    def admit(self, ids):
        return [True] * (len(ids) - 1)


class IntAdmit(AdmissionPolicy):
    def admit(self, ids):
        return [1] * len(ids)


class EveryOther(AdmissionPolicy):
    """Keeps the contract: refuses every other id it is asked about."""

    def __init__(self):
        self.k = 0

    def admit(self, ids):
        answers = []
        for _ in ids:
            self.k += 1
            answers.append(self.k % 2 == 0)
        return answers


def _manager(eviction=LRU, caps=(2, 3), admission=AlwaysAdmit, top=None) -> TierManager:
    """A hierarchy of ``caps`` whose tiers admit with ``admission`` (the top one: ``top``, if given)."""
    tiers = [(name, cap) for name, cap in zip(("hbm", "dram", "nvme"), caps)]
    admissions = [(top or admission)()] + [admission() for _ in tiers[1:]]
    return TierManager(tiers, [eviction(cap) for _, cap in tiers], admissions)


@pytest.mark.parametrize("policy,problem", [
    (Long, "victims(1) of tier hbm answered 2 ids, not 1"),
    (Short, None),  # one id for n = 1 is right: see the batch below
    (Liar, "victims(1) of tier hbm answered id 123456789, which tier hbm does not hold"),
    (Gen, "victims(1) of tier hbm answered an object of type generator, not a list of ids or None"),
    (NeverEvicts, "victims(1) of tier hbm answered None, but at least 1 of the ids it holds are unprotected"),
])
def test_a_victims_answer_that_breaks_the_contract_is_refused(policy, problem):
    manager = _manager(policy)
    manager.access([1, 2])
    if problem is None:
        manager.access([3])
        manager.check_invariants()
        return
    with pytest.raises(ValueError) as caught:
        manager.access([3])
    assert str(caught.value) == f"eviction policy {HERE}:{policy.__name__}: {problem}"


@pytest.mark.parametrize("policy,problem", [
    (Short, "victims(2) of tier hbm answered 1 id, not 2"),
    (Dup, "victims(2) of tier hbm answered id 1 twice"),
])
def test_a_batch_of_victims_must_be_n_distinct_ids(policy, problem):
    manager = _manager(policy, caps=(2,))
    manager.access([1, 2])
    with pytest.raises(ValueError) as caught:
        manager.access([3, 4])  # lru is batch-insert safe: one chunk, two victims asked at once
    assert str(caught.value) == f"eviction policy {HERE}:{policy.__name__}: {problem}"


def test_a_protected_victim_is_refused():
    manager = _manager(IgnoresProtected)
    manager.access([1, 2])
    manager.ref([1])  # a reader: never a victim
    with pytest.raises(ValueError, match=f"^eviction policy {HERE}:IgnoresProtected: victims\\(1\\) of tier hbm "
                                         "answered id 1, which it was told to protect"):
        manager.access([3])
    assert manager.locate(1) == 0 and manager.locate(3) is None  # refused before anything moved


@pytest.mark.parametrize("caps,where", [((1, 4), "dram"), ((4,), "hbm")])
def test_an_admit_answer_that_breaks_the_contract_is_refused(caps, where):
    """Below the top (a victim demoted: ``room``) and in the top (a new block: the manager)."""
    manager = _manager(caps=caps, admission=ShortAdmit if where == "dram" else IntAdmit, top=None if where == "hbm" else AlwaysAdmit)
    if where == "dram":
        manager.access([1])
        message = f"admission policy {HERE}:ShortAdmit: admit(1 id) of tier dram answered 0 answers, not 1"
    else:
        message = f"admission policy {HERE}:IntAdmit: admit(2 ids) of tier hbm answered 1 for id 1, not True or False"
    with pytest.raises(ValueError) as caught:
        manager.access([2] if where == "dram" else [1, 2])
    assert str(caught.value) == message


def test_a_well_formed_out_of_tree_policy_replays_exactly_as_the_built_in_one():
    rng = random.Random(3)
    requests = [[rng.randint(0, 40) for _ in range(rng.randint(1, 6))] for _ in range(300)]
    counts = []
    for eviction, admission in ((LRU, AlwaysAdmit), (Plain, AlwaysAdmit), (LRU, EveryOther), (Plain, EveryOther)):
        manager = _manager(eviction, caps=(3, 5, 9), admission=admission, top=AlwaysAdmit)
        for ids in requests:
            manager.access(list(dict.fromkeys(ids)))
        manager.check_invariants()
        counts.append((sorted(manager.events.drain()), [sorted(d.slot_of) for d in manager.dirs]))
    assert counts[0] == counts[1] and counts[2] == counts[3]


def test_built_in_policies_are_asked_directly():
    manager = TierManager([("hbm", 2), ("dram", 3)], [make_eviction("lru", 2), make_eviction("arc", 3)],
                          [make_admission("always"), make_admission("tinylfu")])
    assert all(in_tree(p) for p in manager.policies + manager.admissions)
    assert [f.__func__ for f in manager._victims] == [type(p).victims for p in manager.policies]
    assert [f.__func__ for f in manager._admit] == [type(a).admit for a in manager.admissions]
    assert not in_tree(Plain(2)) and not in_tree(EveryOther())


class Wild(PrefetchPolicy):
    def __init__(self, answer):
        super().__init__(limit=2)
        self.answer = answer

    def plan(self, view):
        return self.answer


@pytest.mark.parametrize("answer,problem", [
    ((5,), None),
    ([5, 5], "answered id 5 twice"),
    ([5, 6, 3], "answered 3 ids, over its limit of 2"),
    ([9], "answered id 9, which the view does not name"),
    ([2], "answered id 2, which is already in the top tier"),
    ({5}, "answered an object of type set, not a list of ids"),
    (["5"], "answered '5' as an id, not an int"),
])
def test_a_prefetch_plan_that_breaks_the_contract_is_refused(answer, problem):
    view = PrefetchView(7, 1, (1, 2), (3, 4), (5, 6), lambda b: b in (2, 4))
    plan = plan_asker(Wild(answer))
    if problem is None:
        assert plan(view) == [5]
        return
    with pytest.raises(ValueError) as caught:
        plan(view)
    assert str(caught.value) == f"prefetch policy {HERE}:Wild: plan(step 7, layer 1) {problem}"
    built_in = make_prefetch("layer_ahead")
    assert plan_asker(built_in).__func__ is type(built_in).plan



def test_the_decode_loop_asks_an_out_of_tree_prefetch_policy_through_the_check():
    """``StepDriver`` (live decode and step replays) refuses a wrong plan before moving anything."""
    manager = TierManager([("hbm", 2), ("dram", 4)], [make_eviction("lru", 2), make_eviction("lru", 4)],
                          [AlwaysAdmit(), AlwaysAdmit()])
    driver = StepDriver(manager, Wild([7, 7]))
    manager.access([1, 2, 3, 4], store_misses=True)
    with pytest.raises(ValueError, match="plan\\(step 0, layer 0\\) answered id 7 twice"):
        driver.begin_read(0, 0, [1], in_place=False, ahead=[7])
    assert not manager.refs  # the read's reference was taken back
    assert manager.locate(7) is None  # nothing was moved for the refused plan

OOT = '''
from tiercache.policies.lru import LRU
from tiercache.policies.base import AdmissionPolicy


class Long(LRU):
    def victims(self, n, protected=()):
        return super().victims(n + 1, protected) or super().victims(n, protected)


class ShortAdmit(AdmissionPolicy):
    def admit(self, ids):
        return [True]
'''


@pytest.mark.parametrize("option,problem", [
    (["--policy", "{m}:Long", "--tiers", "hbm=2,dram=3"], "eviction policy {m}:Long: victims(1) of tier hbm answered 2 ids, not 1"),
    (["--admission", "{m}:ShortAdmit", "--tiers", "hbm=3,dram=7"],
     "admission policy {m}:ShortAdmit: admit(2 ids) of tier dram answered 1 answer, not 2"),
])
def test_the_cli_reports_a_broken_contract_in_one_line(tmp_path, monkeypatch, capsys, option, problem):
    module = f"oot_answers_{option[1].rpartition(':')[2].lower()}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(OOT))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    trace = random_request_trace(tmp_path / "t.jsonl", requests=60, ids=26, seed=1)
    code = main(["replay", str(trace), *(o.format(m=module) for o in option), "--workers", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert problem.format(m=module) in err


def test_a_policy_module_that_exits_when_imported_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit('usage: run me as a script')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n')
    assert main(["replay", str(trace), "--policy", "exits_on_import:X", "--capacity", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot load eviction policy 'exits_on_import:X'" in err and "SystemExit" in err
