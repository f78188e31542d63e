"""probeT findings F1-F5: escaped keys do not defeat the bulk parser's byte-count shortcuts
(bool and float block ids, a Bailian record in a Mooncake trace), a repeated key beside deep
nesting is refused, and the trace cache treats any unreadable entry as a miss and leaves no
temporary folder behind when a write fails.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest

from tiercache.errors import TraceError
from tiercache.sim import tracecache
from tiercache.sim.bulkparse import bulk_requests
from tiercache.sim.loader import load_trace
from tiercache.sim.tracecache import load_trace_cached
from tiercache.sim.traces import load_flat

SECOND = '{"timestamp": 1, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n'


def _refusal(reader, path: Path) -> str:
    with pytest.raises(TraceError) as info:
        reader(path)
    return str(info.value)


def _requests(path: Path, count: int = 4) -> Path:
    """A small Mooncake trace of ``count`` requests sharing a prefix."""
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 512 * (t + 1), "output_length": 1,
                                        "hash_ids": list(range(t + 1))}) + "\n" for t in range(count)))
    return path


# ----------------------------------------------------------------------------- F5: bool and float ids


@pytest.mark.parametrize("value, shown", [("true", "True"), ("25e-1", "2.5")])
def test_a_bool_or_float_id_is_refused_when_a_key_is_escaped(tmp_path, value, shown):
    # The escaped "e" of timestamp and the "e" of true / 25e-1 balanced the plain-bytes count.
    path = tmp_path / "t.jsonl"
    path.write_text('{"tim\\u0065stamp": 0, "input_length": 512, "output_length": 1, '
                    f'"hash_ids": [{value}, 5]}}\n' + SECOND)
    assert bulk_requests(path.read_bytes()) is None
    message = _refusal(load_trace, path)
    assert message == _refusal(load_flat, path)
    assert message == f"{path}:1: hash_ids[0] must be an integer block id, got {shown}"


def test_an_escaped_key_in_an_ordinary_trace_still_loads_through_the_bulk_parser(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"tim\\u0065stamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [3, 5]}\n' + SECOND)
    bulk = bulk_requests(path.read_bytes())
    assert bulk is not None and bulk.ids.tolist() == [3, 5, 1] and bulk.timestamps.tolist() == [0, 1]
    assert load_trace(path).ids.tolist() == [3, 5, 1]


# ----------------------------------------------------------------------------- F4: escaped parent_chat_id


def test_a_bailian_record_with_an_escaped_key_is_refused_in_a_mooncake_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n'
                    '{"timestamp": 5, "input_length": 512, "output_length": 1, "hash_ids": [1, 2], '
                    '"chat_id": 7, "parent\\u005fchat_id": 3}\n')
    assert bulk_requests(path.read_bytes()) is None
    message = _refusal(load_trace, path)
    assert message == _refusal(load_flat, path)
    assert message.startswith(f"{path}:2: the record has 'chat_id' and 'parent_chat_id' (a Bailian record)")


# ----------------------------------------------------------------------------- F3: deep nesting


@pytest.mark.parametrize("depth", [1000, 1020])
def test_a_repeated_key_beside_deep_nesting_is_refused(tmp_path, depth):
    # Python's json (used to find the repeated key) stops near 1,000 levels, orjson at 1,024.
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "timestamp": 777, "input_length": 1, "output_length": 1, '
                    f'"hash_ids": [1, 2], "x": {"[" * depth}{"]" * depth}}}\n')
    assert _refusal(load_trace, path) == f"{path}:1: malformed record: JSON nested too deeply"


# ----------------------------------------------------------------------------- F1: damaged .npy header


@pytest.mark.parametrize("damage", [
    lambda data: data.replace(b"'shape': (", b"'shape': (99999999999", 1),  # MemoryError from numpy
    lambda data: data.replace(b",), }", b",(, }", 1),  # tokenize.TokenError from numpy's header parser
], ids=["huge-shape", "unclosed-paren"])
def test_a_damaged_npy_header_is_a_cache_miss_and_the_entry_is_replaced(tmp_path, damage):
    trace, cache = _requests(tmp_path / "t.jsonl"), tmp_path / "cache"
    first = load_trace_cached(trace, cache)
    npy = tracecache._entry(cache, first.fingerprint) / "next_use.npy"
    npy.write_bytes(damage(npy.read_bytes()))
    again = load_trace_cached(trace, cache)
    assert again.fingerprint == first.fingerprint
    assert np.array_equal(again.ids, load_trace(trace).ids) and np.array_equal(again.next_use, first.next_use)
    assert np.array_equal(np.load(npy), first.next_use)  # replaced by a good entry


def test_an_interrupt_while_reading_an_entry_is_not_swallowed(tmp_path, monkeypatch):
    trace, cache = _requests(tmp_path / "t.jsonl"), tmp_path / "cache"
    load_trace_cached(trace, cache)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tracecache.np, "load", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_trace_cached(trace, cache)


# ----------------------------------------------------------------------------- F2: full disk


def test_a_cache_write_that_fails_leaves_no_partial_folder(tmp_path, monkeypatch):
    trace, cache = _requests(tmp_path / "t.jsonl"), tmp_path / "cache"
    save = np.save
    calls = []

    def disk_full_on_the_third_file(file, *args, **kwargs):
        calls.append(file)
        if len(calls) % 3 == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(file, *args, **kwargs)

    monkeypatch.setattr(tracecache.np, "save", disk_full_on_the_third_file)
    want = load_trace(trace)
    for _ in range(3):
        got = load_trace_cached(trace, cache)
        assert np.array_equal(got.ids, want.ids) and got.fingerprint == want.fingerprint
    assert len(calls) == 9 and sorted(p.name for p in cache.iterdir()) == []
