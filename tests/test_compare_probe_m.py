"""Probe M: sweep workers that die or fail, and ``compare --split``'s references and errors.

Finding 1: a worker killed by a signal (the OOM killer's SIGKILL), or an out-of-tree policy
raising ``SystemExit``/``KeyboardInterrupt`` in a worker, ended the sweep never (a hang) or
silently; now one line names the run and the cause, exit 2, no worker left behind. Finding 4:
``--split`` with ``--admission``/``--placement`` replayed its lru and belady with them, so no
gap was ever shown and ties did not go to LRU. Findings 6 and 7: ``--split``'s errors blamed
a belady the user never gave and quoted a ``--policy`` the user never typed.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from conftest import module_on_path, random_request_trace
from tiercache.cli import main
from tiercache.results import Semantics, TraceKind
from tiercache.sim.sweep import SweepSpec, plan_runs

#: Out-of-tree policies that fail in a replay, each its own way (``victims`` runs at every eviction).
POLICIES = '''
import os, signal, time
from tiercache.policies.lru import LRU

PARENT = os.getpid()  # imported first by the process that checks --policy: the test's own


class KillsItsWorker(LRU):
    def victims(self, n, protected=()):
        if os.getpid() == PARENT:
            raise RuntimeError("would kill the test process: this policy must run in a worker")
        os.kill(os.getpid(), signal.SIGKILL)


class Exits(LRU):
    def victims(self, n, protected=()):
        raise SystemExit(3)


class Interrupts(LRU):
    def victims(self, n, protected=()):
        raise KeyboardInterrupt


class Raises(LRU):
    def victims(self, n, protected=()):
        raise RuntimeError("refuses to evict")


class Stalls(LRU):
    def victims(self, n, protected=()):
        time.sleep(60)
        return super().victims(n, protected)
'''


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """The module ``probe_m_policies`` on ``sys.path`` (workers fork with it)."""
    with module_on_path(tmp_path_factory.mktemp("oot"), "probe_m_policies", POLICIES) as name:
        yield name


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """200 requests of 1-8 blocks over 26 ids: a hierarchy of 5 blocks evicts at once."""
    return random_request_trace(tmp_path / "t.jsonl", requests=200, ids=26, seed=5)


@contextmanager
def deadline(seconds: int):
    """Fails the test, instead of hanging it, when the body takes longer than ``seconds``."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _replay_error(capsys, *argv, seconds: int = 30) -> tuple[str, float]:
    """Runs ``tiercache replay`` in this process; asserts exit 2 with one line on stderr, no
    traceback and no worker left running; returns the line and the seconds taken."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.perf_counter()
    with deadline(seconds):
        code = main(["replay", *map(str, argv), "--no-progress"])
    elapsed = time.perf_counter() - started
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"workers left running: {left}"
    return err, elapsed


def test_a_worker_killed_by_a_signal_ends_the_sweep_naming_its_run(capsys, trace, policies):
    err, _ = _replay_error(capsys, trace, "--policy", f"{policies}:KillsItsWorker,lru,fifo", "--tiers", "hbm=2,dram=3",
                           "--workers", "2")
    assert (f"the worker process replaying {policies}:KillsItsWorker on --tiers hbm=2,dram=3 (object semantics) "
            "was killed by signal 9 (SIGKILL); the sweep was stopped") in err


@pytest.mark.parametrize("policy,what", [("Exits", "SystemExit: 3"), ("Interrupts", "KeyboardInterrupt")])
def test_systemexit_or_keyboardinterrupt_in_a_worker_is_a_one_line_error(capsys, trace, policies, policy, what):
    err, _ = _replay_error(capsys, trace, "--policy", f"{policies}:{policy},lru", "--tiers", "hbm=2,dram=3", "--workers", "2")
    assert (f"out-of-tree policy {policies}:{policy} failed in the replay of {policies}:{policy} on --tiers hbm=2,dram=3 "
            f"(object semantics): {what}") in err


def test_systemexit_without_workers_is_a_one_line_error(capsys, trace, policies):
    err, _ = _replay_error(capsys, trace, "--policy", f"{policies}:Exits,lru", "--capacity", "4", "--workers", "1")
    assert f"out-of-tree policy {policies}:Exits failed in the replay of {policies}:Exits at capacity 4" in err
    assert "SystemExit: 3" in err


def test_a_failed_run_stops_the_other_workers_at_once(capsys, trace, policies):
    """The stalled run (a minute) is not waited for: its worker is stopped."""
    err, elapsed = _replay_error(capsys, trace, "--policy", f"{policies}:Stalls,{policies}:Raises", "--capacity", "4",
                                 "--workers", "2", seconds=50)
    assert f"out-of-tree policy {policies}:Raises failed" in err and "refuses to evict" in err
    assert elapsed < 30


def test_references_replay_plainly_and_once():
    spec = SweepSpec(("lru", "arc"), (Semantics.OBJECT,), (5,), admission="always", references=("LRU", "belady"))
    assert [r.policy for r in plan_runs(spec, TraceKind.REQUESTS)] == ["lru", "arc", "belady"]


def _split(tmp_path: Path, trace: Path, *options: str) -> tuple[str, list[tuple[str, str, str]]]:
    """``compare --split``: split.md and the second half's runs as (policy, admission, placement)."""
    out = tmp_path / "rep"
    assert main(["compare", str(trace), *options, "--split", "--workers", "1", "--no-progress", "-o", str(out)]) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    return (out / "split.md").read_text(), [(r["policy"], r["admission"], r["placement"]) for r in runs]


@pytest.mark.parametrize("option,value,arc", [("--admission", "second_hit", ("arc", "second_hit", "top")),
                                              ("--placement", "reuse", ("arc", "always", "reuse"))])
def test_split_measures_the_gap_against_plain_lru_and_belady(tmp_path, trace, option, value, arc):
    table, runs = _split(tmp_path, trace, "--policy", "arc,fifo", "--tiers", "hbm=3,dram=7", option, value)
    assert sorted(runs) == sorted([arc, ("fifo", *arc[1:]), ("lru", "always", "top"), ("belady", "always", "top")])
    row = table.splitlines()[-1]
    assert "n/a" not in row, row  # LRU and Belady miss, both gaps closed


def test_split_ties_among_the_policy_list_go_by_name_not_to_the_added_lru(tmp_path, trace):
    """A hierarchy holding all 26 ids never evicts: every policy misses the same. The plain lru
    the split adds as a reference is no candidate (probe q27 F2): the tie goes by name."""
    table, _ = _split(tmp_path, trace, "--policy", "arc,fifo", "--tiers", "hbm=30,dram=30", "--admission", "second_hit")
    cells = [c.strip() for c in table.splitlines()[-1].strip("|").split("|")]
    assert cells[7] == "arc+second_hit" and cells[10] == "arc+second_hit", cells  # tuned on the first half, hindsight


def test_split_of_a_step_trace_says_it_does_not_split_even_with_prefetch(tmp_path, capsys):
    steps = tmp_path / "steps.jsonl"
    assert main(["trace", "synth", "sparse", "-o", str(steps), "--blocks", "64", "--steps", "16", "--k", "4",
                 "--seed", "0"]) == 0
    capsys.readouterr()
    code = main(["compare", str(steps), "--policy", "lru,arc", "--tiers", "hbm=8,dram=16", "--prefetch",
                 "topk_speculative", "--split", "--no-progress", "-o", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "only request traces split into halves" in err and "belady" not in err, err


def test_split_quotes_the_policy_as_given(tmp_path, trace, capsys):
    code = main(["compare", str(trace), "--policy", "arc,,fifo", "--capacity", "5", "--split", "--no-progress",
                 "-o", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "--policy 'arc,,fifo': empty item" in err, err


def test_compare_records_placement_in_the_command_that_reruns_it(tmp_path, trace):
    out = tmp_path / "rep"
    assert main(["compare", str(trace), "--policy", "lru", "--tiers", "hbm=3,dram=7", "--placement", "reuse",
                 "--workers", "1", "--no-progress", "-o", str(out)]) == 0
    assert "--placement reuse" in json.loads((out / "results.json").read_text())["command"]


def test_sigterm_to_a_sweep_stops_its_workers(trace, policies):
    """``timeout`` or a scheduler's SIGTERM ended the parent at once and left its workers
    orphaned, blocked forever; now they are killed on the way out (exit 143, as for SIGTERM)."""
    import os
    import subprocess

    folder = next(p for p in sys.path if (Path(p) / f"{policies}.py").exists())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([folder, os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-c", "import sys; from tiercache.cli import main; sys.exit(main())", "replay", str(trace),
            "--policy", f"{policies}:Stalls", "--capacity", "4,5", "--workers", "2", "--no-progress"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    parent = psutil.Process(proc.pid)
    try:
        started = time.monotonic()
        while len(parent.children()) < 2 and time.monotonic() - started < 60:
            time.sleep(0.1)
        workers = parent.children()
        assert len(workers) >= 2, "the workers never started"
        time.sleep(1.0)  # both are inside their stalled replay
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 143, err.decode()
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers outlived the sweep: {alive}"
    finally:
        proc.kill()
        for child in psutil.Process(proc.pid).children() if psutil.pid_exists(proc.pid) else []:
            child.kill()
