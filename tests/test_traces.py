"""Trace readers (Mooncake and step traces), flat arrays, next_use, oracleGeneral export."""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from tiercache.errors import TraceError, UserError
from tiercache.policies.base import NO_NEXT_USE
from tiercache.sim.oracle import export_oracle_general, read_oracle_general, write_oracle_general
from tiercache.sim.steptrace import StepRecord, iter_steps, load_flat_steps, write_steps
from tiercache.sim.traces import (
    Request,
    TraceKind,
    detect_kind,
    flat_ids,
    iter_requests,
    load_flat,
    next_use,
    request_offsets,
    trace_fingerprint,
    write_requests,
)

HEAD = Path(__file__).parent / "data" / "mooncake_head.jsonl"
SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
GOOD = '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}'
GOOD_STEP = '{"step": 0, "layer": 0, "read": [], "write": [0, 1]}'

# (second line of the file, expected fragment of the message); the first line is valid.
BAD_REQUESTS = [
    ("{not json", "malformed JSON"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1}', "missing field 'hash_ids'"),
    ('{"input_length": 1, "output_length": 1, "hash_ids": []}', "missing field 'timestamp'"),
    ('{"timestamp": 1, "output_length": 1, "hash_ids": []}', "missing field 'input_length'"),
    ('{"timestamp": 1, "input_length": 1, "hash_ids": []}', "missing field 'output_length'"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1, "2"]}', "hash_ids[1]"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1.5]}', "hash_ids[0]"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [0, true]}', "hash_ids[1]"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [3, -1]}', "hash_ids[1]"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [9223372036854775808]}', "2**63"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": 7}', "must be a list"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": {"a": 1}}', "must be a list"),
    ('{"timestamp": true, "input_length": 1, "output_length": 1, "hash_ids": []}', "'timestamp'"),
    ('{"timestamp": 1.5, "input_length": 1, "output_length": 1, "hash_ids": []}', "'timestamp'"),
    ('{"timestamp": 1, "input_length": -4, "output_length": 1, "hash_ids": []}', "'input_length'"),
    ("[1, 2, 3]", "expected a JSON object"),
]

BAD_STEPS = [
    ("{oops", "malformed JSON"),
    ('{"layer": 0, "read": [], "write": []}', "missing field 'step'"),
    ('{"step": 1, "read": [], "write": []}', "missing field 'layer'"),
    ('{"step": 1, "layer": 0, "write": []}', "missing field 'read'"),
    ('{"step": 1, "layer": 0, "read": []}', "missing field 'write'"),
    ('{"step": 1, "layer": 0, "read": [1, -2], "write": []}', "read[1]"),
    ('{"step": 1, "layer": 0, "read": [false], "write": []}', "read[0]"),
    ('{"step": 1, "layer": 0, "read": [], "write": "0"}', "must be a list"),
    ('{"step": 1, "layer": 0, "read": [4, 5, 4], "write": []}', "block 4 more than once"),
    ('{"step": -1, "layer": 0, "read": [], "write": []}', "'step'"),
    ('{"step": 1, "layer": 1.0, "read": [], "write": []}', "'layer'"),
]


def _write(tmp_path: Path, text: str | bytes, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


# ----------------------------------------------------------------------------- Mooncake


def test_iter_requests_reads_head():
    requests = list(iter_requests(HEAD))
    assert len(requests) == 300
    first = requests[0]
    assert (first.timestamp, first.input_length, first.output_length) == (0, 40160, 6)
    assert first.hash_ids == tuple(range(79)) and first.line == 1
    assert requests[-1].line == 300
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in requests)


def test_request_is_frozen_and_slotted():
    request = Request(0, 1, 1, (1,), 1)
    with pytest.raises(AttributeError):
        request.timestamp = 3
    assert not hasattr(request, "__dict__")


def test_flat_arrays_agree_with_iter_requests():
    requests = list(iter_requests(HEAD))
    flat = load_flat(HEAD)
    expected = np.array([i for r in requests for i in r.hash_ids], dtype=np.int64)
    np.testing.assert_array_equal(flat.ids, expected)
    np.testing.assert_array_equal(flat_ids(HEAD), expected)
    starts = np.cumsum([0] + [len(r.hash_ids) for r in requests[:-1]])
    np.testing.assert_array_equal(request_offsets(HEAD), starts)
    np.testing.assert_array_equal(flat.timestamps, [r.timestamp for r in requests])
    np.testing.assert_array_equal(flat.input_lengths, [r.input_length for r in requests])
    assert flat.ids.dtype == np.int64 and flat.offsets.dtype == np.int64 and flat.num_requests == 300


def test_blank_lines_are_skipped_and_lines_counted(tmp_path):
    path = _write(tmp_path, f"\n{GOOD}\n\n{GOOD}\n")
    assert [r.line for r in iter_requests(path)] == [2, 4]


@pytest.mark.parametrize("line,fragment", BAD_REQUESTS)
def test_bad_request_lines_name_file_and_line(tmp_path, line, fragment):
    path = _write(tmp_path, f"{GOOD}\n{line}\n")
    for read in (lambda p: list(iter_requests(p)), load_flat):
        with pytest.raises(TraceError) as info:
            read(path)
        assert str(info.value).startswith(f"{path}:2: ") and fragment in str(info.value)
        assert info.value.line == 2


def test_invalid_utf8_is_a_trace_error(tmp_path):
    path = _write(tmp_path, GOOD.encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceError, match=":2: malformed JSON"):
        load_flat(path)


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_empty_trace(tmp_path, text):
    path = _write(tmp_path, text)
    for read in (lambda p: list(iter_requests(p)), load_flat):
        with pytest.raises(TraceError, match="empty") as info:
            read(path)
        assert str(path) in str(info.value)


def test_missing_file_and_directory(tmp_path):
    for path in (tmp_path / "nope.jsonl", tmp_path):
        for read in (lambda p: list(iter_requests(p)), load_flat, trace_fingerprint, detect_kind):
            with pytest.raises(TraceError) as info:
                read(path)
            assert str(path) in str(info.value)


def test_write_requests_round_trip(tmp_path):
    requests = list(iter_requests(HEAD))[:20]
    out = tmp_path / "out.jsonl"
    assert write_requests(out, requests) == 20
    back = list(iter_requests(out))
    assert [(r.timestamp, r.input_length, r.output_length, r.hash_ids) for r in back] == [
        (r.timestamp, r.input_length, r.output_length, r.hash_ids) for r in requests
    ]
    with pytest.raises(UserError, match="cannot write"):
        write_requests(tmp_path / "no" / "dir.jsonl", requests)


def test_fingerprint_is_xxh3_128_of_the_bytes_and_older_results_keep_theirs():
    import xxhash

    from tiercache.sim.loader import load_trace

    fingerprint = trace_fingerprint(HEAD)
    assert fingerprint == "xxh3-128:" + xxhash.xxh3_128_hexdigest(HEAD.read_bytes()) == load_trace(HEAD).fingerprint
    legacy = hashlib.blake2b(HEAD.read_bytes(), digest_size=16).hexdigest()  # what results before it recorded
    assert trace_fingerprint(HEAD, like=legacy) == legacy and trace_fingerprint(HEAD, like=fingerprint) == fingerprint


def test_detect_kind(tmp_path):
    assert detect_kind(HEAD) is TraceKind.REQUESTS
    assert detect_kind(_write(tmp_path, f"\n{GOOD_STEP}\n", "s.jsonl")) is TraceKind.STEPS
    with pytest.raises(TraceError, match=":1: not a known trace"):
        detect_kind(_write(tmp_path, '{"a": 1}\n', "x.jsonl"))


@pytest.mark.skipif(not SAMPLE.exists(), reason="shared sample trace not present")
def test_full_sample_counts_and_speed():
    start = time.perf_counter()
    ids = flat_ids(SAMPLE)
    elapsed = time.perf_counter() - start
    assert len(ids) == 121_877 and len(request_offsets(SAMPLE)) == 3_993
    assert elapsed < 2.0  # loose guard; typically ~0.04 s


# ----------------------------------------------------------------------------- next_use


def _next_use_reference(ids):
    out, last = [NO_NEXT_USE] * len(ids), {}
    for i in range(len(ids) - 1, -1, -1):
        out[i] = last.get(ids[i], NO_NEXT_USE)
        last[ids[i]] = i
    return out


def test_next_use_matches_reference():
    rng = np.random.default_rng(7)
    for ids in (rng.integers(0, 50, size=2000), flat_ids(HEAD), np.array([5]), np.array([], dtype=np.int64)):
        np.testing.assert_array_equal(next_use(ids), _next_use_reference(list(ids)))


def test_next_use_simple_case():
    assert next_use(np.array([3, 1, 3, 3, 2])).tolist() == [2, NO_NEXT_USE, 3, NO_NEXT_USE, NO_NEXT_USE]


# ----------------------------------------------------------------------------- step traces


def test_step_trace_round_trip(tmp_path):
    records = [StepRecord(0, 0, (), (0, 1)), StepRecord(1, 1, (0, 1), ()), StepRecord(1, 0, (1,), (2,))]
    path = tmp_path / "s.jsonl"
    assert write_steps(path, records) == 3
    back = list(iter_steps(path))
    assert [(r.step, r.layer, r.read, r.write) for r in back] == [(r.step, r.layer, r.read, r.write) for r in records]
    assert [r.line for r in back] == [1, 2, 3]
    flat = load_flat_steps(path)
    assert flat.ids.tolist() == [0, 1, 0, 1, 1, 2]
    assert flat.is_write.tolist() == [True, True, False, False, False, True]
    assert flat.offsets.tolist() == [0, 2, 4] and flat.steps.tolist() == [0, 1, 1] and flat.layers.tolist() == [0, 1, 0]


@pytest.mark.parametrize("line,fragment", BAD_STEPS)
def test_bad_step_lines_name_file_and_line(tmp_path, line, fragment):
    path = _write(tmp_path, f"{GOOD_STEP}\n{line}\n")
    with pytest.raises(TraceError) as info:
        list(iter_steps(path))
    assert str(info.value).startswith(f"{path}:2: ") and fragment in str(info.value)


def test_decreasing_step_is_rejected(tmp_path):
    text = "\n".join(json.dumps({"step": s, "layer": 0, "read": [], "write": []}) for s in (0, 3, 3, 2))
    with pytest.raises(TraceError, match=r":4: step 2 is before .* step 3"):
        list(iter_steps(_write(tmp_path, text)))


def test_empty_step_trace(tmp_path):
    with pytest.raises(TraceError, match="empty"):
        load_flat_steps(_write(tmp_path, "\n"))


# ----------------------------------------------------------------------------- oracleGeneral


def test_oracle_round_trip(tmp_path):
    out = tmp_path / "t.oracleGeneral"
    ids = np.array([5, 7, 5, 9, 7, 5])
    assert write_oracle_general(out, ids, times=np.arange(6) * 10, sizes=3) == 6
    assert out.stat().st_size == 6 * 24
    rec = read_oracle_general(out)
    assert rec["obj_id"].tolist() == ids.tolist()
    assert rec["clock_time"].tolist() == [0, 10, 20, 30, 40, 50]
    assert rec["obj_size"].tolist() == [3] * 6
    # 1-based position of the next access (libCacheSim's traceConv convention), -1 for none.
    assert rec["next_access_vtime"].tolist() == [3, 5, 6, -1, -1, -1]


def test_oracle_export_of_request_trace(tmp_path):
    out = tmp_path / "head.oracleGeneral"
    result = export_oracle_general(HEAD, out)
    flat = load_flat(HEAD)
    rec = read_oracle_general(out)
    assert result.records == len(flat.ids) == len(rec) and result.obj_size == 1
    np.testing.assert_array_equal(rec["obj_id"], flat.ids)
    assert rec["clock_time"][0] == flat.timestamps[0] and rec["clock_time"][-1] == flat.timestamps[-1]


def test_oracle_range_errors(tmp_path):
    with pytest.raises(UserError, match="clock times"):
        write_oracle_general(tmp_path / "x", np.array([1]), times=2**32)
    with pytest.raises(UserError, match="sizes must be >= 1"):
        write_oracle_general(tmp_path / "x", np.array([1]), sizes=0)
    with pytest.raises(UserError, match="non-negative"):
        write_oracle_general(tmp_path / "x", np.array([-1]))
    (tmp_path / "bad").write_bytes(b"\x00" * 25)
    with pytest.raises(UserError, match="whole number"):
        read_oracle_general(tmp_path / "bad")


def _lru_miss_ratio(ids, capacity):
    cache, misses = OrderedDict(), 0
    for x in ids:
        if x in cache:
            cache.move_to_end(x)
        else:
            misses += 1
            cache[x] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return misses / len(ids)


def test_libcachesim_reads_export(tmp_path):
    lcs = pytest.importorskip("libcachesim")
    out = tmp_path / "head.oracleGeneral"
    export_oracle_general(HEAD, out)
    reader = lcs.TraceReader(str(out), lcs.TraceType.ORACLE_GENERAL_TRACE)
    miss_ratio, _ = lcs.LRU(cache_size=100).process_trace(reader)
    assert miss_ratio == pytest.approx(_lru_miss_ratio(flat_ids(HEAD).tolist(), 100), abs=1e-12)


@pytest.mark.skipif(not SAMPLE.exists(), reason="shared sample trace not present")
def test_libcachesim_lru_golden_on_sample(tmp_path):
    lcs = pytest.importorskip("libcachesim")
    out = tmp_path / "sample.oracleGeneral"
    export_oracle_general(SAMPLE, out)
    reader = lcs.TraceReader(str(out), lcs.TraceType.ORACLE_GENERAL_TRACE)
    miss_ratio, _ = lcs.LRU(cache_size=1000).process_trace(reader)
    assert round(miss_ratio, 5) == 0.91754
