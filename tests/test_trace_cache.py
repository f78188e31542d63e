"""The bulk request-trace parser and the binary trace cache give what the line reader gives.

``load_trace`` reads a request trace with one orjson call per chunk (``bulkparse``) and
falls back to the validating line reader for anything unusual; ``load_trace_cached`` keeps
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
from tiercache.sim.loader import load_trace
from tiercache.sim.prep import dense_and_next_use_sorted
from tiercache.sim.replay import ReplayData
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
])
def test_bulk_parse_defers_every_error_to_the_line_reader(tmp_path, bad):
    good = '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [7]}'
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n{bad}\n")
    assert bulk_requests(path.read_bytes()) is None
    with pytest.raises(TraceError, match=r"bad.jsonl:2: "):
        load_trace(path)


def test_cache_entry_is_written_once_and_read_back(tmp_path):
    cache = tmp_path / "cache"
    first = load_trace_cached(SAMPLE, cache)
    entries = sorted(p.name for p in cache.iterdir())
    assert entries == [f"{first.fingerprint}-v1"]
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
