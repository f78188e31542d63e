"""The fast request-trace readers and the binary trace cache give what the line reader gives.

``load_trace`` reads a request trace in the plain form with a compiled scanner
(``fastscan``), else with one orjson call per chunk (``bulkparse``), and falls back to the
validating line reader for anything unusual; ``load_trace_cached`` keeps
the parsed arrays (plus dense ids and next uses) in ``.npy`` files keyed by the fingerprint.
Both must build exactly the arrays of the line reader (``load_flat``), and every malformed
trace must still raise the line reader's error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tiercache.errors import TraceError
from tiercache.sim.bulkparse import bulk_requests
from tiercache.sim.fastscan import scan_requests
from tiercache.sim.loader import load_trace
from tiercache.sim.prep import dense_and_next_use_sorted
from tiercache.sim.replay import ReplayData
from tiercache.sim import tracecache
from tiercache.sim.tracecache import load_trace_cached
from tiercache.sim.traces import Request, load_flat, trace_fingerprint, write_requests

SAMPLE = Path(__file__).parent / "data" / "mooncake_synthetic_trace.jsonl"


def random_requests(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    requests = [Request(int(t), int(rng.integers(0, 9000)), int(rng.integers(0, 50)),
                        tuple(int(x) for x in rng.integers(0, 2**62, size=int(rng.integers(0, 12)))))
                for t in sorted(rng.integers(0, 10**6, size=200))]
    out = path / f"random{seed}.jsonl"
    write_requests(out, requests)
    return out


def assert_same_arrays(trace, path) -> None:
    reference = load_flat(path)
    for field in ("ids", "timestamps", "input_lengths", "output_lengths"):
        assert np.array_equal(getattr(trace.requests, field), getattr(reference, field)), field
    assert np.array_equal(trace.offsets[:-1], reference.offsets) and trace.offsets[-1] == len(reference.ids)
    assert trace.fingerprint == trace_fingerprint(path)


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_bulk_parse_equals_the_line_reader(tmp_path, seed):
    path = SAMPLE if seed is None else random_requests(tmp_path, seed)
    assert bulk_requests(path.read_bytes()) is not None  # the fast path was taken
    assert_same_arrays(load_trace(path), path)


@pytest.mark.parametrize("seed", range(4))
def test_scanner_equals_orjson_on_random_spacing_and_key_order(tmp_path, seed):
    """The compiled scanner reads the plain form in any key order and JSON spacing."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(seed)
    space = lambda: " " * int(rng.integers(0, 3)) + ("\t" if rng.random() < 0.1 else "")  # noqa: E731
    lines = []
    for _ in range(150):
        fields = {"timestamp": int(rng.integers(0, 2**40)), "input_length": int(rng.integers(0, 10**6)),
                  "output_length": int(rng.integers(0, 100)),
                  "hash_ids": [int(x) for x in rng.integers(0, 2**63 - 1, size=int(rng.integers(0, 9)), dtype=np.int64)]}
        keys = list(fields)
        rng.shuffle(keys)
        parts = []
        for key in keys:
            value = fields[key]
            text = ("[" + space() + ("," + space()).join(map(str, value)) + space() + "]") if isinstance(value, list) else str(value)
            parts.append(f'{space()}"{key}"{space()}:{space()}{text}{space()}')
        lines.append("{" + ",".join(parts) + "}" + ("\r" if rng.random() < 0.1 else ""))
        if rng.random() < 0.05:
            lines.append("  ")
    data = ("\n".join(lines) + "\n").encode()
    path = tmp_path / "spaced.jsonl"
    path.write_bytes(data)
    scanned, reference = scan_requests(data), load_flat(path)
    assert scanned is not None
    for field in ("ids", "offsets", "timestamps", "input_lengths", "output_lengths"):
        assert np.array_equal(getattr(scanned, field), getattr(reference, field)), field
    assert_same_arrays(load_trace(path), path)


@pytest.mark.parametrize("layout", ["blank lines", "crlf", "no final newline", "leading blank"])
def test_bulk_parse_handles_line_layouts(tmp_path, layout):
    text = random_requests(tmp_path, 5).read_text()
    lines = text.splitlines()
    text = {"blank lines": "\n\n".join(lines) + "\n\n", "crlf": "\r\n".join(lines) + "\r\n",
            "no final newline": "\n".join(lines), "leading blank": "\n  \n" + text}[layout]
    path = tmp_path / "layout.jsonl"
    path.write_bytes(text.encode())
    assert_same_arrays(load_trace(path), path)


@pytest.mark.parametrize("bad", [
    '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1, true]}',
    '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1, 2.0]}',
    '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [-1]}',
    '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [9223372036854775808]}',
    '{"timestamp": 1, "input_length": -1, "output_length": 1, "hash_ids": [1]}',
    '{"timestamp": 1, "input_length": 1, "hash_ids": [1]}',
    '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1]',
    '[1, 2]',
    '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [01]}',
    '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1,]}',
])
def test_bulk_parse_defers_every_error_to_the_line_reader(tmp_path, bad):
    good = '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [7]}'
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n{bad}\n")
    assert bulk_requests(path.read_bytes()) is None
    assert scan_requests(path.read_bytes()) is None
    with pytest.raises(TraceError, match=r"bad.jsonl:2: "):
        load_trace(path)


def test_scanner_declines_what_it_does_not_read_and_orjson_takes_it(tmp_path):
    """An extra field is valid JSON: not the plain form, read by orjson. A repeated key is
    not the plain form either, and refused (which value is meant is ambiguous; see
    test_trace_parse_probe_b.py)."""
    path = tmp_path / "extra.jsonl"
    path.write_text('{"timestamp": 2, "input_length": 1, "output_length": 1, "hash_ids": [1], "model": "x"}\n'
                    '{"timestamp": 3, "input_length": 1, "output_length": 1, "hash_ids": [2], "model": "x"}\n')
    assert scan_requests(path.read_bytes()) is None
    assert_same_arrays(load_trace(path), path)
    assert load_trace(path).requests.timestamps.tolist() == [2, 3]
    path.write_text('{"timestamp": 1, "timestamp": 2, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n')
    assert scan_requests(path.read_bytes()) is None
    with pytest.raises(TraceError, match=r"extra.jsonl:1: key 'timestamp' appears more than once"):
        load_trace(path)


def test_cache_entry_is_written_once_and_read_back(tmp_path):
    cache = tmp_path / "cache"
    first = load_trace_cached(SAMPLE, cache)
    entries = sorted(p.name for p in cache.iterdir())
    assert entries == [tracecache._entry_name(first.fingerprint)]
    again = load_trace_cached(SAMPLE, cache)
    assert_same_arrays(again, SAMPLE)
    dense, next_use, _ = dense_and_next_use_sorted(again.ids)
    assert np.array_equal(again.dense, dense) and np.array_equal(again.next_use, next_use)
    plain, cached = ReplayData.prepare(load_trace(SAMPLE), None, None), ReplayData.prepare(again, None, None)
    assert (plain.n_ids, plain.max_count) == (cached.n_ids, cached.max_count)
    assert np.array_equal(plain.dense, cached.dense) and np.array_equal(plain.next_use, cached.next_use)
    # 20 B per access: ids, next use, dense ids.
    assert cached.ids.nbytes + cached.next_use.nbytes + cached.dense.nbytes == 20 * len(cached.ids)


def test_a_changed_trace_gets_a_new_entry(tmp_path):
    cache, path = tmp_path / "cache", random_requests(tmp_path, 3)
    before = load_trace_cached(path, cache)
    path.write_text(path.read_text() + '{"timestamp": 9999999, "input_length": 1, "output_length": 1, "hash_ids": [5]}\n')
    after = load_trace_cached(path, cache)
    assert after.fingerprint != before.fingerprint and len(after.ids) == len(before.ids) + 1
    assert len(list(cache.iterdir())) == 2
    assert_same_arrays(after, path)
