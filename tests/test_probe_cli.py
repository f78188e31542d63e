"""CLI option validation found by the adversarial probe (findings 10, 11, 13, 15, 23, 24, 25).

Every bad option exits 2 with one line naming it, never a traceback, and is refused before
any replay; none of these tests replays a request trace on the compiled kernels.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from tiercache.cli import build_parser
from tiercache.cli.replay import Once, OnceFlag, parse_semantics, spec_from_args
from tiercache.config import KVLayout, parse_layout, parse_tiers
from tiercache.errors import UserError
from tiercache.results import Semantics
from tiercache.sim.hardware import load_profile
from tiercache.sim.sweep import SweepSpec
from tiercache.sizes import Capacity
from test_cli_errors import _error  # runs the CLI, asserts exit 2 with one line

REQUESTS = ('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n'
            '{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [1, 3]}\n')
STEPS = ('{"block_tokens": 16}\n'
         '{"step": 0, "layer": 0, "read": [], "write": [0, 1, 2, 3]}\n'
         '{"step": 1, "layer": 0, "read": [0, 1, 2, 3], "write": []}\n')
#: A step trace with a decode field recorded by the live cache (it replays through StepDriver).
RECORDED = ('{"block_tokens": 16}\n'
            '{"step": 0, "layer": 0, "read": [], "write": [0, 1], "hold": [0, 1]}\n'
            '{"step": 1, "layer": 0, "read": [0, 1], "write": []}\n')


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "good.jsonl"
    path.write_text(REQUESTS)
    return path


@pytest.fixture
def steps(tmp_path: Path) -> Path:
    path = tmp_path / "steps.jsonl"
    path.write_text(STEPS)
    return path




def _spec(*argv) -> SweepSpec:
    args = build_parser().parse_args(["replay", *map(str, argv)])
    return spec_from_args(args)[1]


# ----------------------------------------------------------------------------- finding 10


@pytest.mark.parametrize("option", ["--policy", "--admission", "--placement"])
@pytest.mark.parametrize("target", ["..foo:X", ".foo:X"])
def test_relative_policy_module_is_a_one_line_error(capsys, trace, option, target):
    err = _error(capsys, "replay", trace, "--tiers", "hbm=1,dram=1", f"{option}={target}", "--no-progress")
    assert repr(target) in err and "absolute module:Class" in err


def test_relative_prefetch_module_is_a_one_line_error(capsys, steps):
    err = _error(capsys, "replay", steps, "--prefetch=..x:Y", "--no-progress")
    assert "prefetch policy '..x:Y'" in err and "absolute module:Class" in err


@pytest.mark.parametrize("option,base", [("--policy", "EvictionPolicy"), ("--admission", "AdmissionPolicy"),
                                         ("--placement", "PlacementPolicy")])
def test_an_abstract_base_is_not_a_policy(capsys, trace, option, base):
    err = _error(capsys, "replay", trace, "--tiers", "hbm=1,dram=1", f"{option}=tiercache.policies.base:{base}",
                 "--no-progress")
    assert "does not implement" in err and f"abstract {base}" in err


def test_a_policy_module_that_fails_on_import_is_a_one_line_error(capsys, trace, tmp_path, monkeypatch):
    (tmp_path / "probe_broken_policy.py").write_text("raise RuntimeError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = _error(capsys, "replay", trace, "--policy", "probe_broken_policy:P", "--no-progress")
    assert "probe_broken_policy:P" in err and "RuntimeError: broken on purpose" in err


def test_an_out_of_tree_policy_that_raises_is_a_one_line_error(capsys, trace, tmp_path, monkeypatch):
    (tmp_path / "probe_raising_policy.py").write_text(
        "from tiercache.policies.lru import LRU\n\n"
        "class Raising(LRU):\n"
        "    def on_insert(self, ids, hints=None):\n"
        "        raise RuntimeError('refuses every block')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = _error(capsys, "replay", trace, "--policy", "probe_raising_policy:Raising", "--workers", "1", "--no-progress")
    assert "out-of-tree policy probe_raising_policy:Raising failed" in err and "refuses every block" in err


def test_offline_policy_with_prefetch_is_refused_before_the_replay(capsys, steps):
    err = _error(capsys, "replay", steps, "--prefetch", "topk_speculative", "--policy", "belady",
                 "--tiers", "hbm=1,dram=1", "--no-progress")
    assert "--policy belady" in err and "--prefetch topk_speculative" in err and "needs the future" in err


def test_offline_policy_on_a_recorded_decode_trace_is_refused(capsys, tmp_path):
    path = tmp_path / "recorded.jsonl"
    path.write_text(RECORDED)
    err = _error(capsys, "replay", path, "--policy", "lru,belady", "--tiers", "hbm=1,dram=2", "--no-progress")
    assert "--policy belady" in err and str(path) in err and "needs the future" in err


def test_bench_checks_its_options_with_quick(capsys, tmp_path):
    for option, fragment in (("--seed=-1", "--seed: must be an integer from 0 to 2**64-1"),
                             ("--blocks=0", "--blocks must be a positive integer"),
                             ("--threads=-2", "--threads: must be an integer from 1 to 256"),
                             ("--reps=0", "--reps must be a positive integer"),
                             ("--model=nope", "--model: unknown model preset 'nope'"),
                             ("--block-tokens=0", "--block-tokens: must be a positive integer")):
        err = _error(capsys, "bench", "--quick", "--dir", tmp_path, "--json", tmp_path / "b.json", option)
        assert fragment in err, option
    assert os.listdir(tmp_path) == []  # refused before the temporary folder was made


def test_remote_serve_refuses_an_unusable_host_and_log(capsys, tmp_path):
    err = _error(capsys, "remote-serve", "--host", "bad host")
    assert "--host bad host: cannot listen there" in err
    err = _error(capsys, "remote-serve", "--log", tmp_path / "missing" / "x.log")
    assert "--log" in err and "does not exist" in err


# ----------------------------------------------------------------------------- finding 11


@pytest.mark.parametrize("option,value", [("--rpc-port", "99999"), ("--rpc-port", "0"), ("--metadata-port", "65536"),
                                          ("--metadata-port", "-1"), ("--rpc-port", "x")])
def test_remote_serve_ports_are_1_to_65535(capsys, option, value):
    err = _error(capsys, "remote-serve", f"{option}={value}")
    assert f"argument {option}" in err


# ----------------------------------------------------------------------------- finding 13


def test_replay_refuses_to_write_results_over_its_trace(capsys, trace, tmp_path):
    err = _error(capsys, "replay", trace, "--out", trace, "--no-progress")
    assert f"--out {trace}: is the trace" in err
    os.link(trace, tmp_path / "hard.jsonl")
    _error(capsys, "replay", tmp_path / "hard.jsonl", "--out", trace, "--no-progress")
    assert trace.read_text() == REQUESTS


def test_replay_refuses_to_write_results_into_a_trace_folder(capsys, tmp_path):
    folder = tmp_path / "kv"
    folder.mkdir()
    conversation = {"block_size": 64, "requests": [{"t": 0, "in": 64, "out": 1, "hash_ids": [1]}]}
    (folder / "a.json").write_text(json.dumps(conversation))
    err = _error(capsys, "replay", folder, "--out", folder / "results.json", "--no-progress")
    assert "lies in the trace folder" in err
    assert os.listdir(folder) == ["a.json"]


# ----------------------------------------------------------------------------- findings 15 and 23


@pytest.mark.parametrize("text,shown", [("1.5", "1.5 blocks"), ("1.2345k", "1234.5 blocks"), ("0.0001k", "0.1 blocks"),
                                        ("0.1B", "0.1 bytes")])
def test_a_fraction_of_a_block_or_byte_is_refused(text, shown):
    with pytest.raises(UserError, match="not a whole number"):
        Capacity.parse(text, "--capacity")
    with pytest.raises(UserError, match=shown):
        Capacity.parse(text, "--capacity")


@pytest.mark.parametrize("text,blocks", [("1.5k", 1500), ("1.1k", 1100), ("2.5M", 2_500_000), ("4096", 4096)])
def test_a_whole_number_of_blocks_with_a_fraction_in_its_spelling_is_fine(text, blocks):
    assert Capacity.parse(text).blocks == blocks


def test_fractional_capacities_name_the_option(capsys, trace):
    assert "--capacity '1.5'" in _error(capsys, "replay", trace, "--capacity", "1.5")
    assert "--tiers dram: '1.5' is 1.5 blocks" in _error(capsys, "replay", trace, "--tiers", "hbm=2k,dram=1.5")


def test_negative_and_zero_capacities_read_alike(capsys, trace):
    for text in ("-1", "0", "-2k", "0B"):
        assert f"--capacity {text!r}: must be positive, got {text!r}" in _error(capsys, "replay", trace, f"--capacity={text}")


def test_a_byte_size_under_one_block_says_so(capsys, trace):
    err = _error(capsys, "replay", trace, "--capacity", "3B", "--model", "llama-3-8b")
    assert "less than one block" in err


# ----------------------------------------------------------------------------- finding 24


def test_missing_prefill_speed_names_the_profile_file(capsys, trace, tmp_path):
    profile = tmp_path / "links_only.json"
    links = {name: {"bandwidth_Bps": 1e9, "latency_s": 0} for name in ("dram->hbm", "hbm->dram", "nvme->dram", "dram->nvme")}
    profile.write_text(json.dumps({"name": "x", "links": links, "prefill_tokens_per_s": None}))
    err = _error(capsys, "replay", trace, "--model", "llama-3-8b", "--hardware", profile)
    assert err.startswith(f"tiercache replay: error: {profile}: hardware profile 'x' has no prefill speed")
    assert load_profile(profile).source == str(profile)


# ----------------------------------------------------------------------------- finding 25


@pytest.mark.parametrize("option", ["--policy", "--semantics", "--out", "--model", "--admission", "--hardware"])
def test_an_empty_option_value_is_an_error(capsys, trace, option):
    assert f"{option}: empty value" in _error(capsys, "replay", trace, f"{option}=")


@pytest.mark.parametrize("argv,fragment", [
    (["--capacity", "4,,5"], "--capacity '4,,5': empty item"),
    (["--capacity", "4,"], "--capacity '4,': empty item"),
    (["--policy", "lru,,fifo"], "--policy 'lru,,fifo': empty item"),
    (["--semantics", "object,"], "--semantics 'object,': empty item"),
    (["--tiers", "hbm=2,,dram=2"], "--tiers 'hbm=2,,dram=2': empty item"),
    (["--tiers", "hbm=2,,remote=2"], "--tiers 'hbm=2,,remote=2': empty item"),
    (["--tiers", "hbm=2:"], "--tiers hbm: '2:' has an empty codec"),
    (["--layout", "layers=32,kv_heads=8,head_dim=128,layers=4"], "--layout: layers given twice"),
    (["--layout", "layers=32,,kv_heads=8,head_dim=128"], "--layout 'layers=32,,kv_heads=8,head_dim=128': empty item"),
    (["--no-progress", "--no-progress"], "--no-progress given twice"),
    (["--tiers", "hbm=1,dram=1", "--write-through", "--write-through"], "--write-through given twice"),
    (["--out", "a.json", "--out", "b.json"], "--out given twice ('a.json' and 'b.json')"),
])
def test_options_silently_accepted_before_are_errors(capsys, trace, argv, fragment):
    assert fragment in _error(capsys, "replay", trace, *argv)


def test_tier_and_layout_parsers_refuse_empty_items_and_repeats():
    with pytest.raises(UserError, match="empty item"):
        parse_tiers("hbm=2,,dram=2", None)
    with pytest.raises(UserError, match="empty codec"):
        parse_tiers("hbm=2:", None)
    with pytest.raises(UserError, match="given twice"):
        parse_layout("layers=32,kv_heads=8,head_dim=128,head_dim=64")
    assert parse_layout("layers=2,kv_heads=2,head_dim=64") == KVLayout(2, 2, 64)


class _Raising(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(message)


def test_an_option_spelled_two_ways_is_refused_once_given_even_with_a_default():
    """What ``compare -o x --out y`` needs: ``Once`` counts occurrences, not non-None values."""
    parser = _Raising()
    parser.add_argument("-o", "--out", default="report", action=Once)
    parser.add_argument("--flag", action=OnceFlag)
    assert parser.parse_args(["-o", "x"]).out == "x" and parser.parse_args([]).out == "report"
    assert parser.parse_args(["--flag"]).flag is True and parser.parse_args([]).flag is False
    with pytest.raises(UserError, match=r"--out / -o given twice \('x' and 'y'\)"):
        parser.parse_args(["--out", "x", "-o", "y"])
    with pytest.raises(UserError, match="--flag given twice"):
        parser.parse_args(["--flag", "--flag"])


def test_semantics_both_may_be_listed_with_others():
    assert parse_semantics("both,prefix") == (Semantics.OBJECT, Semantics.PREFIX)
    assert parse_semantics("prefix,both") == (Semantics.PREFIX, Semantics.OBJECT)
    assert parse_semantics(None) == (Semantics.OBJECT,)


def test_policy_names_are_recorded_as_registered(trace):
    spec = _spec(trace, "--policy", "LRU,lru,Belady", "--tiers", "hbm=1,dram=1", "--admission", "SECOND_HIT",
                 "--placement", "Top")
    assert (spec.policies, spec.admission, spec.placement) == (("lru", "belady"), "second_hit", "top")
    assert _spec(trace, "--policy", "tiercache.policies.lru:LRU").policies == ("tiercache.policies.lru:LRU",)


def test_placement_spelled_in_capitals_still_needs_a_hierarchy(capsys, trace):
    err = _error(capsys, "replay", trace, "--placement", "REUSE", "--capacity", "4")
    assert "--placement reuse: places blocks among the tiers" in err


def test_fleet_options_match_policy_names_as_registered(capsys, trace):
    err = _error(capsys, "replay", trace, "--tiers", "hbm=1,remote=2", "--admission", "ALWAYS", "--placement", "REUSE")
    assert "--placement REUSE: does not apply to a fleet replay" in err
