"""Review R38 finding 1: the windowed loader's arrays grew apart and the compiled scanner wrote
past the end of the timestamp, input and output arrays.

``FlatColumns.reserve`` grew the id counts (``bounds``, one slot longer than the others) by
half of *its* length and the three record arrays by half of theirs: after a growth from an odd
length the id counts had room for one record more, and the gap grew with each growth (61 slots
in one real load). The scanner checks the id-count view only, so it wrote records past the other
three arrays: a valid trace whose first window under-estimated its records loaded with zeros in
place of fields, or aborted the process on a corrupted heap (``trace inspect`` exit 134).
"""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.sim import bulkparse
from tiercache.sim.fastscan import FlatColumns, scan_into
from tiercache.sim.loader import load_trace
from tiercache.sim.tracelines import iter_json_objects


def _line(ts: int, ids: list[int], tokens: int = 7) -> bytes:
    return json.dumps({"timestamp": ts, "input_length": tokens, "output_length": 3, "hash_ids": ids}).encode() + b"\n"


def _views_agree(columns: FlatColumns) -> None:
    ids, counts, stamps, inputs, outputs = columns.free()
    assert len(counts) == len(stamps) == len(inputs) == len(outputs)
    assert len(columns.bounds) == len(columns.stamps) + 1


def test_the_scanner_writes_no_record_past_the_arrays_after_they_grow_from_an_odd_length():
    columns = FlatColumns(ids=1000, records=3)
    columns.append(*(np.array(v, dtype=np.int64) for v in ([0, 1, 2], [1, 1, 1], [0, 1, 2], [7] * 3, [3] * 3)))
    columns.reserve(0, 1)  # 3 records held, room asked for a fourth: the arrays grow from 3
    _views_agree(columns)
    data = _line(3, [3]) + _line(4, [4])
    assert scan_into(columns, data, len(data))
    flat = columns.finish()
    assert flat.timestamps.tolist() == [0, 1, 2, 3, 4]
    assert flat.input_lengths.tolist() == [7] * 5 and flat.output_lengths.tolist() == [3] * 5


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.lists(st.tuples(st.integers(0, 40), st.integers(0, 17)), min_size=1, max_size=25))
def test_the_record_views_stay_one_length_through_any_growth(first, asks):
    columns = FlatColumns(ids=4, records=first)
    for ids, records in asks:
        columns.reserve(ids, records)
        _views_agree(columns)
        columns.commit(records, ids)


def test_a_trace_whose_first_window_underestimates_its_records_loads_as_the_line_reader_reads_it(tmp_path, monkeypatch):
    """Long requests first, then many short ones: the sample sizes the arrays for few records,
    so they grow again and again while the windows are scanned."""
    path = tmp_path / "grows.jsonl"
    long = [_line(t, list(range(20 * t, 20 * t + 20)), tokens=9) for t in range(2)]
    short = [b'{"timestamp":%d,"input_length":%d,"output_length":2,"hash_ids":[%d]}\n' % (t, 3 + t % 5, t % 50)
             for t in range(2, 300)]
    path.write_bytes(b"".join(long + short))
    monkeypatch.setattr(bulkparse, "WINDOW_BYTES", 512, raising=False)
    monkeypatch.setattr(bulkparse, "_SAMPLE_BYTES", 256, raising=False)
    monkeypatch.setattr(bulkparse, "_CHUNK_BYTES", 64, raising=False)
    views = FlatColumns.free
    lengths = []

    def free(columns):
        given = views(columns)
        lengths.append({len(view) for view in given[1:]})
        return given

    monkeypatch.setattr(FlatColumns, "free", free)
    flat = load_trace(str(path)).requests
    assert len(lengths) > 3 and all(len(seen) == 1 for seen in lengths), lengths
    records = [record for _, record in iter_json_objects(str(path))]
    assert flat.timestamps.tolist() == [r["timestamp"] for r in records]
    assert flat.input_lengths.tolist() == [r["input_length"] for r in records]
    assert flat.output_lengths.tolist() == [r["output_length"] for r in records]


# Finding 3: the compiled and numpy paths of the stack distances refuse bad input alike, and a
# ``following`` that is no next-access array cannot make the compiled walk write past its counts.

import pytest  # noqa: E402

from tiercache.sim import mrc, stackdist  # noqa: E402


@pytest.fixture(params=["compiled", "numpy"])
def path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(mrc, "HAVE_NUMBA", False)
    elif not mrc.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    return request.param


def test_two_dimensional_ids_are_refused_on_both_paths(path):
    ids = np.arange(6).reshape(2, 3)
    for call in (mrc.stack_distances, mrc.distance_counts, mrc.reuse_histogram):
        with pytest.raises(ValueError, match="1-D"):
            call(ids)


def test_a_mask_or_next_uses_of_another_length_are_refused_on_both_paths(path):
    ids = np.array([1, 2, 1, 2])
    with pytest.raises(ValueError, match="touched has shape"):
        mrc.distance_counts(ids, np.ones(3, dtype=bool))
    with pytest.raises(ValueError, match="following has shape"):
        mrc.distance_counts(ids, None, np.array([2, 3, -1]))


def test_next_uses_that_name_one_access_twice_are_refused_not_written_past_the_counts():
    if not mrc.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    with pytest.raises(ValueError, match="not the next accesses"):
        stackdist.walk_counts(np.array([2, 2, -1], dtype=np.int32))


# Finding 5: a first window whose strings hold many commas sized the arrays for ids the file
# cannot hold; and a command that runs out of memory ends in one line, not a traceback.

from tiercache.cli import main  # noqa: E402
from tiercache.sim import fastscan  # noqa: E402


def test_the_first_estimate_never_asks_for_more_than_the_file_can_hold():
    sample = b'{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1], "note": "' + b"," * 4000 + b'"}\n'
    size = 100 * len(sample)
    ids, records = fastscan.capacities(sample, len(sample) // 2, size)
    assert ids <= size // 2 + 1 and records <= size // fastscan.MIN_RECORD_BYTES + 1
    plain = b'{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, 2, 3]}\n' * 3
    assert fastscan.capacities(plain, len(plain), len(plain)) == (plain.count(b",") + 4 + 1, 4 + 1)  # as before


def test_out_of_memory_ends_in_one_line(monkeypatch, capsys, tmp_path):
    from tiercache.cli import tracefile

    def exhausted(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(tracefile, "load_trace_cached", exhausted, raising=False)
    monkeypatch.setattr(tracefile, "load_trace", exhausted, raising=False)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n')
    assert main(["trace", "inspect", str(trace)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tiercache trace: error: out of memory"), err


# Finding 4: one record the compiled scanner does not read (an extra field, say) sent its whole
# 64 MiB window to orjson, 5x slower than the scan; now only its chunk goes there.


def test_one_unusual_record_costs_orjson_its_chunk_not_the_window(tmp_path, monkeypatch):
    if not fastscan.HAVE_NUMBA:
        pytest.skip("without numba every record goes to orjson")
    lines = [_line(t, [t, t + 1]) for t in range(400)]
    lines[200] = json.dumps({"timestamp": 200, "input_length": 7, "output_length": 3, "hash_ids": [200, 201],
                             "model": "x"}).encode() + b"\n"
    path = tmp_path / "extra.jsonl"
    path.write_bytes(b"".join(lines))
    monkeypatch.setattr(bulkparse, "WINDOW_BYTES", 1 << 16, raising=False)
    monkeypatch.setattr(bulkparse, "_CHUNK_BYTES", 1 << 10, raising=False)
    parsed = []
    bulk = bulkparse.bulk_into

    def spy(columns, data, end, seconds=False):
        parsed.append(end)
        return bulk(columns, data, end, seconds)

    monkeypatch.setattr(bulkparse, "bulk_into", spy)
    flat = load_trace(str(path)).requests
    assert len(parsed) == 1 and parsed[0] < 2 * 1024 + 200, parsed
    records = [record for _, record in iter_json_objects(str(path))]
    assert flat.timestamps.tolist() == [r["timestamp"] for r in records]
    assert flat.ids.tolist() == [i for r in records for i in r["hash_ids"]]
