"""Probe Q29: policy names and out-of-tree blame.

Finding 1: ``RunSpec`` recorded a policy name as given (``"LRU"``, ``" Belady "``), though the
README says registered names are case-insensitive and recorded in lower case, and the results
reader kept such names: a report over them found no ``lru``/``belady`` reference and showed no
gap closed. ``RunSpec`` now records registered names as registered, and the reader reads a
name without a colon (only registered names lack one) in lower case.

Finding 2: when a run held two out-of-tree policies and one of them broke, the error named both;
it now names the one whose code raised, or the one the contract check names.
"""

from __future__ import annotations

import json

import pytest

from conftest import module_on_path, random_request_trace
from tiercache.cli import main
from tiercache.config import TierConfig
from tiercache.results import Semantics, read_results
from tiercache.sim.loader import load_trace
from tiercache.sim.replay import ReplayData, RunSpec, replay

POLICIES = '''
from tiercache.policies.base import AdmissionPolicy
from tiercache.policies.lru import LRU

class Fine(LRU):
    pass

class Raises(LRU):
    def victims(self, n, protected=()):
        raise RuntimeError("refuses to evict")

class Admits(AdmissionPolicy):
    def admit(self, ids):
        return [True for _ in ids]

class AnswersOne(AdmissionPolicy):
    def admit(self, ids):
        return [1 for _ in ids]
'''


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """The module ``probe_q29_policies`` on ``sys.path``."""
    with module_on_path(tmp_path_factory.mktemp("oot"), "probe_q29_policies", POLICIES) as name:
        yield name


@pytest.fixture
def trace(tmp_path):
    return random_request_trace(tmp_path / "t.jsonl", requests=200, ids=26, seed=7)


@pytest.mark.parametrize("given,recorded", [("LRU", "lru"), (" Belady ", "belady"), ("S3FIFO", "s3fifo")])
def test_runspec_records_a_registered_name_as_registered(trace, given, recorded):
    data = ReplayData.prepare(load_trace(trace), None, None)
    spec = RunSpec(given, Semantics.OBJECT, (TierConfig("hbm", 6),), admission="ALWAYS", placement="Top")
    record = replay(spec, data)
    assert (record.policy, record.admission, record.placement) == (recorded, "always", "top")
    assert record.misses == replay(RunSpec(recorded, Semantics.OBJECT, (TierConfig("hbm", 6),)), data).misses


def test_runspec_refuses_a_name_that_is_not_a_string():
    with pytest.raises(TypeError, match="RunSpec.policy"):
        RunSpec(None, Semantics.OBJECT, (TierConfig("hbm", 6),))


def test_a_results_file_with_upper_case_names_still_has_its_references(tmp_path, trace, capsys):
    out = tmp_path / "results.json"
    assert main(["replay", str(trace), "--policy", "lru,fifo,belady", "--capacity", "4,8", "--out", str(out),
                 "--no-progress"]) == 0
    document = json.loads(out.read_text())
    spelt = {"lru": "LRU", "belady": " Belady", "fifo": "fifo"}
    for run in document["runs"]:
        run["policy"] = spelt[run["policy"]]
    (tmp_path / "upper.json").write_text(json.dumps(document))
    assert sorted({r.policy for r in read_results(tmp_path / "upper.json").runs}) == ["belady", "fifo", "lru"]
    capsys.readouterr()
    assert main(["report", str(out), "--out", str(tmp_path / "r1")]) == 0
    assert main(["report", str(tmp_path / "upper.json"), "--out", str(tmp_path / "r2")]) == 0
    assert (tmp_path / "r1" / "results.csv").read_text() == (tmp_path / "r2" / "results.csv").read_text()
    assert "No run of belady" not in (tmp_path / "r2" / "report.md").read_text()


def test_an_out_of_tree_name_keeps_its_case(tmp_path, trace, policies):
    out = tmp_path / "results.json"
    assert main(["replay", str(trace), "--policy", f"{policies}:Fine", "--capacity", "4", "--out", str(out),
                 "--no-progress"]) == 0
    assert [r.policy for r in read_results(out).runs] == [f"{policies}:Fine"]


@pytest.mark.parametrize("eviction,admission,blamed,cleared", [
    ("Raises", "Admits", "Raises", "Admits"),  # the eviction policy's own code raised
    ("Fine", "AnswersOne", "AnswersOne", "Fine"),  # the contract check names the admission policy
])
def test_the_error_names_only_the_policy_that_broke(capsys, trace, policies, eviction, admission, blamed, cleared):
    code = main(["replay", str(trace), "--policy", f"{policies}:{eviction}", "--tiers", "hbm=3,dram=4",
                 "--admission", f"{policies}:{admission}", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    line = next(line for line in err.splitlines() if "failed in the replay" in line)
    assert line.startswith(f"tiercache replay: error: out-of-tree policy {policies}:{blamed} failed in the replay of")
    assert f"policy {policies}:{cleared}" not in line and f"{policies}:{cleared}, " not in line
