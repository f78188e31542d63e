"""Probe Q74: CLI options accepted where they do nothing, and an output path checked too late.

Finding 1: ``--placement top`` given on a single-tier cache or a write-through hierarchy
(``replay`` and ``compare``) was accepted silently, as only a placement other than the
default was refused; now any ``--placement`` given there is refused, as ``--admission``
and ``--write-through`` are on one tier. Finding 2: ``compare --split --policy belady``
(no online policy to tune) exited 0 with an empty split.md; now it is refused. Finding 3:
``replay --out /proc/x.json`` passed the permission check (root passes every
``os.access``) and failed only after the replays; now a file is created and removed in
the output's folder first (``compare -o /proc/x`` alike). Every refusal is one line, exit 2,
before any replay.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from test_cli_errors import _error  # runs the CLI, asserts exit 2 with one line
from tiercache.cli import build_parser
from tiercache.cli import replay as cli_replay
from tiercache.cli import report as cli_report
from tiercache.cli.replay import spec_from_args
from tiercache.results import outfile

REQUESTS = "".join(f'{{"timestamp": {i}, "input_length": 1024, "output_length": 1, "hash_ids": [1, {i + 2}]}}\n'
                   for i in range(6))
QUIET = ["--workers", "1", "--no-progress"]
#: ``/proc`` refuses every new file, to root too.
HAS_PROC = os.path.isdir("/proc/self")


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "good.jsonl"
    path.write_text(REQUESTS)
    return path


@pytest.fixture
def no_sweep(monkeypatch):
    """Any replay fails the test: every refusal here comes before one."""
    def fail(*args, **kwargs):
        pytest.fail("a sweep ran before the refusal")

    monkeypatch.setattr(cli_replay, "sweep", fail)
    monkeypatch.setattr(cli_report, "sweep", fail)


def _run_args(command: str, trace: Path, tmp_path: Path, *options: str) -> list[str]:
    out = ["--out", str(tmp_path / "r.json")] if command == "replay" else ["-o", str(tmp_path / "report")]
    return [command, str(trace), *options, *QUIET, *out]


# ----------------------------------------------------------------------------- finding 1


@pytest.mark.parametrize("command", ["replay", "compare"])
@pytest.mark.parametrize("hierarchy", [("--capacity", "4"), ("--tiers", "hbm=4"),
                                       ("--tiers", "hbm=2,dram=4", "--write-through")],
                         ids=["capacity", "one-tier", "write-through"])
@pytest.mark.parametrize("given", ["top", "TOP", "reuse"])
def test_a_placement_given_where_it_places_nothing_is_refused(tmp_path, trace, capsys, no_sweep, command, hierarchy,
                                                              given):
    err = _error(capsys, *_run_args(command, trace, tmp_path, *hierarchy, "--placement", given))
    placement = given.lower()
    assert err == (f"tiercache {command}: error: --placement {placement}: places blocks among the tiers of an exclusive "
                   "hierarchy; give --tiers with two tiers or more (not --write-through)\n")
    assert sorted(os.listdir(tmp_path)) == ["good.jsonl"]  # no results file, no report folder


def test_placement_top_given_on_an_exclusive_hierarchy_is_still_the_default(trace):
    def spec(*options):
        return spec_from_args(build_parser().parse_args(["replay", str(trace), *options]))[1]

    given = spec("--tiers", "hbm=2,dram=4", "--placement", "top")
    assert given == spec("--tiers", "hbm=2,dram=4") and given.placement == "top"
    assert spec("--capacity", "4").placement == "top"  # left out: the default, wherever it is


# ----------------------------------------------------------------------------- finding 2


@pytest.mark.parametrize("policies", ["belady", "Belady,belady"])
def test_split_with_offline_policies_alone_is_refused(tmp_path, trace, capsys, no_sweep, policies):
    err = _error(capsys, "compare", trace, "--policy", policies, "--capacity", "4", "--split", *QUIET,
                 "-o", tmp_path / "report")
    assert err == (f"tiercache compare: error: --split: --policy {policies} names no online policy to tune (an "
                   "offline policy reads the future, which a policy tuned on the first half cannot); add one, e.g. "
                   "--policy lru\n")
    assert not (tmp_path / "report").exists()


def test_split_with_an_unknown_policy_beside_belady_names_the_unknown_one(tmp_path, trace, capsys, no_sweep):
    err = _error(capsys, "compare", trace, "--policy", "belady,lruu", "--capacity", "4", "--split", *QUIET,
                 "-o", tmp_path / "report")
    assert "unknown eviction policy 'lruu'" in err


# ----------------------------------------------------------------------------- finding 3


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
def test_replay_out_in_proc_is_refused_before_the_replay(tmp_path, trace, capsys, no_sweep):
    err = _error(capsys, "replay", trace, "--capacity", "4", *QUIET, "--out", "/proc/x.json")
    assert err.startswith("tiercache replay: error: --out /proc/x.json: "), err  # root: cannot create; others: not writable


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
def test_compare_o_in_proc_is_refused_before_the_sweep(tmp_path, trace, capsys, no_sweep):
    for out in ("/proc/x", "/proc/x/y"):
        err = _error(capsys, "compare", trace, "--capacity", "4", *QUIET, "-o", out)
        assert err.startswith(f"tiercache compare: error: -o {out}: cannot create a folder under /proc ("), err


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
def test_proc_refuses_a_new_file_whatever_the_permission_bits_say():
    assert outfile.creation_refused("/proc")
    with pytest.raises(Exception, match=r"^--out /proc/x\.json: "):
        outfile.check_output_file("/proc/x.json", "--out")


def test_the_check_leaves_no_file_behind(tmp_path):
    assert outfile.creation_refused(tmp_path) is None
    outfile.check_output_file(str(tmp_path / "r.json"), "--out")
    assert os.listdir(tmp_path) == []
