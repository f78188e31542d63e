"""Probe q17: what results record of a hardware profile, and traces whose hash_ids do not fit their lengths."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tiercache.cli import main
from tiercache.results import read_results
from tiercache.sim.hardware import PRESETS, save_profile

DATA = Path(__file__).parent / "data"
HEAD = DATA / "mooncake_head.jsonl"
QUIET = ["--workers", "1", "--no-progress"]
MODELED = ["--semantics", "prefix", "--model", "llama-3-8b"]


def _slow(tmp_path: Path, name: str) -> str:
    """The h200 preset's links with a 28x slower prefill, as a profile JSON called ``name``."""
    path = tmp_path / f"{name}.json"
    save_profile(PRESETS["h200-pcie5-nvme4"], path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data | {"name": name, "prefill_tokens_per_s": 1000}))
    return str(path)


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_report_compares_the_hardware_profiles_numbers_not_its_name(tmp_path: Path, capsys) -> None:
    tiered, hbm = str(tmp_path / "tiered.json"), str(tmp_path / "hbm.json")
    # a profile JSON may not pass for a preset: same name, other numbers is refused on loading
    impostor = _slow(tmp_path, "h200-pcie5-nvme4")
    assert main(["replay", str(HEAD), "--tiers", "hbm=50,dram=200", *MODELED, "--hardware", impostor, *QUIET]) == 2
    assert "is a preset's" in _error(capsys)
    # a JSON holding the preset's own numbers is that preset
    same = tmp_path / "h200-pcie5-nvme4.json"
    save_profile(PRESETS["h200-pcie5-nvme4"], same)
    assert main(["replay", str(HEAD), "--capacity", "50", *MODELED, "--hardware", str(same), "--out", hbm, *QUIET]) == 0
    # two custom profiles of one name but other numbers never merge into one report
    assert main(["replay", str(HEAD), "--tiers", "hbm=50,dram=200", *MODELED, "--hardware", _slow(tmp_path, "box"),
                 "--out", tiered, *QUIET]) == 0
    document = read_results(tiered)
    assert document.hardware == "box" and document.hardware_profile.prefill_tokens_per_s == 1000
    assert document.hardware_profile.links["dram->hbm"] == (55e9, 10e-6)
    assert document.hardware_profile.digest.startswith("xxh3-64:")
    (tmp_path / "other").mkdir()
    save_profile(PRESETS["h200-pcie5-nvme4"], tmp_path / "other" / "box.json")
    data = json.loads((tmp_path / "other" / "box.json").read_text()) | {"name": "box"}
    (tmp_path / "other" / "box.json").write_text(json.dumps(data))
    fast = str(tmp_path / "fast.json")
    assert main(["replay", str(HEAD), "--capacity", "50", *MODELED, "--hardware", str(tmp_path / "other" / "box.json"),
                 "--out", fast, *QUIET]) == 0
    capsys.readouterr()
    assert main(["report", tiered, fast, "-o", str(tmp_path / "rep")]) == 2
    assert "used another hardware" in (err := _error(capsys)) and "prefill 28000 vs 1000 tokens/s" in err
    # the same numbers under another name merge: the preset's JSON copy and the box with the preset's numbers
    assert main(["report", hbm, fast, "-o", str(tmp_path / "rep")]) == 0
    assert f"{fast} duplicates {hbm}" in capsys.readouterr().err  # one run: counted once, and said so
    # a file written before hardware_profile reads as not recorded; its modeled times were a
    # flat per-token rate, so it is refused beside a newer file, whatever the names
    old = json.loads(Path(fast).read_text())
    del old["hardware_profile"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert read_results(tmp_path / "old.json").hardware_profile is None
    assert main(["report", str(tmp_path / "old.json"), tiered, "-o", str(tmp_path / "rep")]) == 2  # both "box"
    assert "older tiercache" in _error(capsys)


def test_a_fleet_run_merges_with_a_one_engine_run_on_the_same_machine_and_the_report_names_the_network(
        tmp_path: Path, capsys) -> None:
    fleet, one, rdma = (str(tmp_path / n) for n in ("fleet.json", "one.json", "rdma.json"))
    hardware = ["--model", "llama-3-8b", "--hardware", "h200-pcie5-nvme4"]
    assert main(["replay", str(HEAD), "--instances", "2", "--tiers", "hbm=50,dram=200,remote=400", *hardware,
                 "--out", fleet, *QUIET]) == 0
    assert main(["replay", str(HEAD), "--tiers", "hbm=50,dram=200", "--semantics", "prefix", *hardware,
                 "--out", one, *QUIET]) == 0
    assert read_results(fleet).hardware == "h200-pcie5-nvme4+tcp-25g"
    assert read_results(fleet).hardware_profile.network.name == "tcp-25g"
    assert main(["report", fleet, one, "-o", str(tmp_path / "rep")]) == 0
    assert "| hardware (link model) | h200-pcie5-nvme4, shared tier over tcp-25g |" in (
        tmp_path / "rep" / "report.md").read_text()
    # fleets over two networks: a document records one network for all its runs
    assert main(["replay", str(HEAD), "--instances", "2", "--tiers", "hbm=50,dram=200,remote=400", *hardware,
                 "--network", "rdma-200g", "--out", rdma, *QUIET]) == 0
    capsys.readouterr()
    assert main(["report", one, fleet, rdma, "-o", str(tmp_path / "rep2")]) == 2
    assert "over another network (rdma-200g) than" in _error(capsys)


def _misfit_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "hash_ids" in line]


def test_a_trace_whose_hash_ids_misfit_its_lengths_is_counted_by_inspect_and_warned_once_by_replay(
        tmp_path: Path, capsys) -> None:
    # 128-token blocks in Mooncake form: 2048-token requests with 16 ids (512-token blocks: 4)
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join([
        '{"timestamp": 0, "input_length": 2048, "output_length": 1, "hash_ids": [1, 2, 3, 4]}', "",
        '{"timestamp": 1, "input_length": 2048, "output_length": 1, "hash_ids": ' + str(list(range(10, 26))) + "}",
        '{"timestamp": 2, "input_length": 2000, "output_length": 1, "hash_ids": ' + str(list(range(10, 26))) + "}"]) + "\n")
    assert main(["trace", "inspect", str(trace)]) == 0
    out = capsys.readouterr().out
    assert f"2 of 3 (66.67%); their lengths imply 128-token blocks (first: {trace}:3)" in out
    assert main(["replay", str(trace), "--capacity", "100", *QUIET]) == 0  # warned, never refused
    (warning,) = _misfit_lines(capsys)
    assert warning.startswith(f"warning: {trace}:3: 2 of 3 requests") and "imply 128-token blocks" in warning
    assert main(["replay", str(trace), "--instances", "2", "--tiers", "hbm=5,remote=10", *QUIET]) == 0
    assert len(_misfit_lines(capsys)) == 1
    # the bundled traces fit: no warning; a kv-cache-tester workload is checked at its block_size
    for bundled in ("mooncake_head.jsonl", "mooncake_synthetic_trace.jsonl", "bailian_sample.jsonl", "kvtester_sample"):
        assert main(["replay", str(DATA / bundled), "--capacity", "100", *QUIET]) == 0
        assert _misfit_lines(capsys) == [], bundled
    folder = tmp_path / "kv"
    shutil.copytree(DATA / "kvtester_sample", folder)
    conv = folder / "conv_00000.json"
    data = json.loads(conv.read_text())
    data["requests"][0]["in"] = 64 * 40  # 22 ids of 64 tokens: 1 of 141 requests misfits, under 1%
    conv.write_text(json.dumps(data))
    assert main(["replay", str(folder), "--capacity", "100", *QUIET]) == 0
    assert _misfit_lines(capsys) == []
    assert main(["trace", "inspect", str(folder)]) == 0
    assert f"1 of 141 (0.71%) (first: {conv} requests[0])" in capsys.readouterr().out
    data["requests"][1]["in"] = 64 * 40
    conv.write_text(json.dumps(data))
    assert main(["replay", str(folder), "--capacity", "100", *QUIET]) == 0
    (warning,) = _misfit_lines(capsys)
    assert "2 of 141 requests (1.42%) list other than ceil(input_length / 64) hash_ids" in warning
