"""Bad CLI input exits 2 with one line naming the file and line or the option (issue 8 items 11, 15, 18)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercache.cli import main
from tiercache.errors import UserError
from tiercache.config import TierConfig
from tiercache.results import Semantics
from tiercache.sim.replay import RunSpec

HEAD = Path(__file__).parent / "data" / "mooncake_head.jsonl"
REQUEST = '{{"timestamp": {ts}, "input_length": {n}, "output_length": 1, "hash_ids": [1, 2]}}\n'


def _error(capsys, *argv) -> str:
    """Runs the CLI, asserts exit 2 with one line and no traceback, returns that line."""
    code = main([str(a) for a in argv])
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


def test_endless_line_is_refused_without_reading_it_whole(capsys):
    err = _error(capsys, "replay", "/dev/zero")
    assert "/dev/zero:1:" in err and "longer than" in err


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
