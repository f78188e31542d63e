"""Bad CLI input exits 2 with one line naming the file and line or the option (issue 8 items 11, 15, 18)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiercache.cli import main
from tiercache.errors import UserError
from tiercache import config
from tiercache.config import TierConfig
from tiercache.results import Semantics
from tiercache.sim.replay import RunSpec

HEAD = Path(__file__).parent / "data" / "mooncake_head.jsonl"
REQUEST = '{{"timestamp": {ts}, "input_length": {n}, "output_length": 1, "hash_ids": [1, 2]}}\n'


def _error(capsys, *argv) -> str:
    """Runs the CLI, asserts exit 2 with one line and no traceback, returns that line."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # an argparse error: the same one line and status
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# ----------------------------------------------------------------------------- item 11


@pytest.mark.parametrize("field", ["ts", "n"])
def test_integer_beyond_int64_is_a_trace_error(tmp_path, capsys, field):
    path = tmp_path / "big.jsonl"
    values = {"ts": 0, "n": 10} | {field: 2**63}
    path.write_text(REQUEST.format(ts=0, n=10) + REQUEST.format(**values))
    err = _error(capsys, "replay", path)
    assert f"{path}:2:" in err and "2**63" in err


def test_deeply_nested_json_is_a_trace_error(tmp_path, capsys):
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    err = _error(capsys, "trace", "inspect", path)
    assert f"{path}:1:" in err and "nested too deeply" in err


def test_endless_line_is_refused_without_reading_it_whole(capsys, tmp_path):
    from tiercache.sim.traces import MAX_LINE_BYTES

    path = tmp_path / "zeros.jsonl"
    with open(path, "wb") as handle:
        handle.truncate(MAX_LINE_BYTES + (1 << 20))  # sparse: one line of NUL bytes, no disk used
    err = _error(capsys, "replay", str(path))
    assert f"{path}:1:" in err and "longer than" in err


def test_a_device_as_the_trace_is_refused_unread(capsys):
    err = _error(capsys, "replay", "/dev/zero")
    assert "/dev/zero: cannot open trace: not a regular file" in err


@pytest.mark.parametrize("capacity", [str(10**12), "1000000000k"])
def test_huge_capacity_is_refused_with_the_memory_it_needs(capsys, capacity):
    err = _error(capsys, "replay", HEAD, "--capacity", capacity, "--no-progress")
    assert "--capacity" in err and "GB" in err and "B per slot" in err


def test_memory_check_counts_concurrent_runs():
    from tiercache.sim.sweep import SLOT_BYTES, check_memory

    runs = [RunSpec("lru", Semantics.OBJECT, (TierConfig("hbm", 1000),)) for _ in range(4)]
    check_memory(runs, 4, available=2 * 4000 * SLOT_BYTES)
    with pytest.raises(UserError, match="4 concurrent run"):
        check_memory(runs, 4, available=2 * 3999 * SLOT_BYTES)
    check_memory(runs, 1, available=2 * 1000 * SLOT_BYTES)


# ----------------------------------------------------------------------------- item 15: units


def test_byte_capacity_with_model_is_converted(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["replay", HEAD, "--capacity", "16GiB", "--model", "llama-3-8b", "--no-progress", "--workers", "1", "--out", out]
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    run = json.loads(out.read_text())["runs"][0]
    assert run["capacity_blocks"] == 16 * 1024**3 // (512 * 128 * 1024)  # 512-token blocks of 128 KiB per token


@pytest.mark.parametrize("text,blocks,nbytes", [("4k", 4000, None), ("4096", 4096, None), ("2M", 2_000_000, None),
                                                ("16GiB", None, 16 * 1024**3), ("512MB", None, 512 * 10**6)])
def test_capacity_spellings(text, blocks, nbytes):
    capacity = config.Capacity.parse(text)
    assert (capacity.blocks, capacity.nbytes) == (blocks, nbytes)


@pytest.mark.parametrize("text", ["4Ki", "4Mi", "3x"])
def test_ambiguous_capacity_names_the_spellings(capsys, text):
    err = _error(capsys, "replay", HEAD, "--capacity", text)
    assert f"--capacity {text!r}" in err and "4k (4,000)" in err and "16GiB" in err


def test_size_without_b_is_not_bytes():
    with pytest.raises(UserError, match="not a byte size"):
        config.parse_size("4k")
    assert config.parse_size("4KiB") == 4096 and config.parse_size("4kB") == 4000


# ----------------------------------------------------------------------------- item 18: silent acceptance


@pytest.mark.parametrize("argv,fragment", [
    (["--tiers", "hbm=10,dram=20", "--tiers", "hbm=5"], "--tiers given twice"),
    (["--capacity", "10", "--capacity", "20"], "--capacity given twice"),
    (["--admission", "second_hit"], "--admission second_hit: applies to the lower tiers"),
    (["--tiers", "hbm=10", "--admission", "second_hit"], "--admission second_hit: applies to the lower tiers"),
    (["--write-through"], "--write-through: applies"),
    (["--workers", "0"], "--workers: must be at least 1"),
    (["--block-tokens", "16"], "is a request trace"),
])
def test_options_that_would_be_ignored_are_errors(capsys, argv, fragment):
    err = _error(capsys, "replay", HEAD, "--no-progress", *argv)
    assert fragment in err and err.startswith("tiercache replay: error: ")


def test_semantics_both_is_object_and_prefix(capsys):
    assert main(["replay", str(HEAD), "--capacity", "100", "--semantics", "both", "--no-progress", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert " object " in out and " prefix " in out


def test_semantics_on_a_step_trace_is_an_error(tmp_path, capsys):
    path = tmp_path / "scan.jsonl"
    assert main(["trace", "synth", "scan", "-o", str(path), "--blocks", "4", "--steps", "16"]) == 0
    capsys.readouterr()
    err = _error(capsys, "replay", path, "--semantics", "prefix")
    assert "step trace" in err and "drop --semantics" in err


def test_sparse_k_covering_every_block_is_an_error(tmp_path, capsys):
    err = _error(capsys, "trace", "synth", "sparse", "--k", "100", "--blocks", "10", "-o", tmp_path / "s.jsonl")
    assert "--k 100" in err and "every block" in err


def test_help_lists_presets_and_version_exists(capsys):
    for argv in (["--help"], ["replay", "--help"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert "leaf_lru" in out and "second_hit" in out and "llama-3-70b" in out and "h200-pcie5-nvme4" in out
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("tiercache ")
