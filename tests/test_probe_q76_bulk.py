"""Probe Q76 findings 3 and 4: a request trace of any size loads on the fast path, one window
of lines at a time (``bulkparse.load_requests``), with memory bounded by the arrays plus a
window; there was a 1 GiB limit past which the streaming line reader (10x slower, ~60 B per
access) took over.

With a window of a few hundred bytes forced, records straddle windows and lines outgrow the
window: the arrays must equal the whole-file parsers' and the line reader's, an error in a
later window must still get the line reader's message and line, and the fingerprint must
stay the digest of the file's bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache.errors import TraceError
from tiercache.sim import bulkparse, fastscan, loader, tracelines
from tiercache.sim.bulkparse import bulk_requests
from tiercache.sim.fastscan import scan_requests
from tiercache.sim.loader import load_trace
from tiercache.sim.traces import MAX_TOKENS, iter_json_objects, load_flat, trace_fingerprint

FIELDS = ("ids", "offsets", "timestamps", "input_lengths", "output_lengths")


class _Spy:
    """A stand-in for the line reader's entry (``loader.iter_json_objects``) counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return iter_json_objects(*args, **kwargs)


def _windowed(monkeypatch, window: int) -> _Spy:
    """Forces ``window``-byte windows and spies on the line reader."""
    monkeypatch.setattr(bulkparse, "WINDOW_BYTES", window, raising=False)
    spy = _Spy()
    monkeypatch.setattr(loader, "iter_json_objects", spy)
    return spy


def _arrays(flat) -> list[list[int]]:
    return [getattr(flat, field).tolist() for field in FIELDS]


def _mooncake(ts: int, ids: list[int], tokens: int = 512, **extra) -> dict:
    return {"timestamp": ts, "input_length": tokens, "output_length": 3, "hash_ids": ids, **extra}


def _bailian(chat: int, seconds: float, ids: list[int]) -> dict:
    return {"chat_id": chat, "parent_chat_id": chat - 1, "timestamp": seconds, "input_length": 16 * len(ids),
            "output_length": 7, "type": "text", "turn": 1, "hash_ids": ids}


def _write(path: Path, records: list[dict], *, blank_every: int = 0) -> Path:
    lines = [json.dumps(r) for r in records]
    if blank_every:
        lines = [x for i, line in enumerate(lines) for x in ([line, "  "] if i % blank_every == 1 else [line])]
    path.write_text("".join(line + "\n" for line in lines))
    return path


# ----------------------------------------------------------------------------- (a) same arrays


_ID = st.integers(0, 2**63 - 1) | st.integers(0, 99)
_RECORD = st.tuples(st.integers(0, 2**63 - 1), st.integers(0, MAX_TOKENS), st.integers(0, 50),
                    st.lists(_ID, max_size=24))


@st.composite
def _trace_text(draw) -> tuple[bytes, str]:
    """A valid request trace in random layout, and its form: ``plain`` (the scanner's), ``extra``
    (another field: orjson's) or ``bailian`` (seconds)."""
    form = draw(st.sampled_from(["plain", "extra", "bailian"]))
    records = draw(st.lists(_RECORD, min_size=1, max_size=30))
    sep = draw(st.sampled_from([", ", ",", " ,\t"]))
    eol = draw(st.sampled_from(["\n", "\r\n", " \t\n"]))
    lines = []
    for k, (ts, tokens, out, ids) in enumerate(records):
        fields = {"timestamp": ts, "input_length": tokens, "output_length": out, "hash_ids": ids or [k] * (k == 0)}
        if form == "bailian":
            fields.update(chat_id=k, parent_chat_id=-1, timestamp=ts % 10**9 / 8)
        elif form == "extra":
            fields["model"] = "m"
        keys = draw(st.permutations(list(fields)))
        lines.append("{" + sep.join(f'"{key}":{json.dumps(fields[key], separators=(sep, ":"))}' for key in keys) + "}")
        if k and draw(st.integers(0, 5)) == 0:
            lines.append(draw(st.sampled_from(["", "   ", "\t"])))  # blank lines after the first record
    text = eol.join(lines) + draw(st.sampled_from([eol, ""]))  # with and without a last line break
    return text.encode(), form


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trace=_trace_text(), window=st.integers(8, 400))
def test_windows_build_the_whole_file_and_line_reader_arrays(tmp_path, trace, window):
    data, form = trace
    path = tmp_path / "t.jsonl"
    path.write_bytes(data)
    reference = _arrays(load_flat(path))
    whole = bulk_requests(data, seconds=form == "bailian")
    assert whole is not None and _arrays(whole) == reference
    if form == "plain":
        assert _arrays(scan_requests(data)) == reference
    with pytest.MonkeyPatch.context() as monkeypatch:
        spy = _windowed(monkeypatch, window)
        trace = load_trace(path)
    assert spy.calls == 0  # the windowed fast path, not the line reader
    assert _arrays(trace.requests) == reference
    assert trace.offsets.tolist() == reference[1] + [len(reference[0])]
    assert trace.block_tokens == (16 if form == "bailian" else 512)
    assert trace.fingerprint == trace_fingerprint(path)


def test_records_straddle_many_windows(tmp_path, monkeypatch):
    """Windows of 100 bytes over 60 records of ~90-200 bytes: every record is cut by a window
    end somewhere, the carried part is moved to the front and some lines outgrow the window
    (which then stays grown)."""
    rng = np.random.default_rng(3)
    records = [_mooncake(t, [int(x) for x in rng.integers(0, 10**6, size=int(rng.integers(0, 20)))]) for t in range(60)]
    path = _write(tmp_path / "t.jsonl", records, blank_every=7)
    calls = []
    scan = fastscan.scan_into
    monkeypatch.setattr(bulkparse, "scan_into", lambda columns, data, end: calls.append(end) or scan(columns, data, end))
    spy = _windowed(monkeypatch, 100)
    trace = load_trace(path)
    assert spy.calls == 0 and len(calls) > 20 and max(calls) > 100  # many windows, some grown
    assert _arrays(trace.requests) == _arrays(load_flat(path))


@pytest.mark.parametrize("form", ["plain", "bailian"])
def test_arrays_grow_when_the_first_window_underestimates(tmp_path, monkeypatch, form):
    """The first window sizes the arrays (its ids and lines per byte); denser windows later
    make them grow, the scanner's window is scanned again, and nothing is lost."""
    sparse = [_mooncake(t, []) if form == "plain" else _bailian(t, t / 4, []) for t in range(20)]
    dense = [_mooncake(t, list(range(40))) if form == "plain" else _bailian(t, t / 4, list(range(40)))
             for t in range(20, 60)]
    path = _write(tmp_path / "t.jsonl", sparse + dense)
    grown = []
    real = fastscan._grown
    monkeypatch.setattr(fastscan, "_grown", lambda *args: grown.append(args[2]) or real(*args))
    spy = _windowed(monkeypatch, 1500)
    trace = load_trace(path)
    assert spy.calls == 0 and grown
    assert _arrays(trace.requests) == _arrays(load_flat(path))


# ----------------------------------------------------------------------------- (b) errors in later windows


_BAD = {
    "bad id": ('{"timestamp": 9, "input_length": 1, "output_length": 1, "hash_ids": [4, true]}',
               r"hash_ids\[1\] must be an integer block id"),
    "record broken over lines": ('{"timestamp": 9, "input_length": 1, "output_length": 1,\n"hash_ids": [4]}',
                                 "malformed JSON"),
    "repeated key": ('{"timestamp": 9, "input_length": 1, "output_length": 1, "hash_ids": [4], "hash_ids": [5]}',
                     "appears more than once"),
    "too many tokens": (json.dumps(_mooncake(9, [4], tokens=MAX_TOKENS + 1)), r"at most 2\*\*40 tokens"),
    "a bailian record": (json.dumps(_bailian(9, 1.5, [4])), "one trace holds one format"),
    "a line over the limit": (json.dumps(_mooncake(9, list(range(200)))), "line longer than"),
}


@pytest.mark.parametrize("window", [64, 300, 1 << 20])
@pytest.mark.parametrize("bad", list(_BAD))
def test_an_error_deep_in_a_later_window_names_its_line(tmp_path, monkeypatch, bad, window):
    monkeypatch.setattr(tracelines, "MAX_LINE_BYTES", 500)
    line, message = _BAD[bad]
    good = [json.dumps(_mooncake(t, [t, t + 1, t + 2])) for t in range(80)]
    text = "\n".join(good[:50] + ["", "  "] + good[50:70] + [line] + good[70:]) + "\n"
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    spy = _windowed(monkeypatch, window)
    with pytest.raises(TraceError, match=message) as raised:
        load_trace(path)
    assert spy.calls == 1  # the line reader named it
    assert str(raised.value).startswith(f"{path}:73: ")
    with pytest.raises(TraceError) as reference:
        loader.flat_requests(str(path), iter_json_objects(path))
    assert str(raised.value) == str(reference.value)


def test_a_bailian_trace_with_a_mooncake_record_later_is_refused(tmp_path, monkeypatch):
    records = [_bailian(k, k / 2, [k]) for k in range(40)]
    records[33] = _mooncake(5, [1])
    path = _write(tmp_path / "mixed.jsonl", records)
    _windowed(monkeypatch, 200)
    with pytest.raises(TraceError, match=r"mixed.jsonl:34: the record lacks 'chat_id' or 'parent_chat_id'"):
        load_trace(path)


def test_a_line_longer_than_any_window_may_hold_defers(tmp_path, monkeypatch):
    """A line with no break that passes ``MAX_LINE_BYTES`` stops the window from growing."""
    monkeypatch.setattr(tracelines, "MAX_LINE_BYTES", 1000)
    path = _write(tmp_path / "long.jsonl", [_mooncake(0, [1])] * 3 + [_mooncake(1, [7] * 600)])
    _windowed(monkeypatch, 128)
    with pytest.raises(TraceError, match=r"long.jsonl:4: line longer than"):
        load_trace(path)


# ----------------------------------------------------------------------------- (c) no size limit


def test_a_trace_over_the_former_size_limit_takes_the_fast_path(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    records = [_mooncake(t, [int(x) for x in rng.integers(0, 2**40, size=12)]) for t in range(300)]
    path = _write(tmp_path / "big.jsonl", records)
    monkeypatch.setattr(loader, "MAX_BULK_BYTES", 4096, raising=False)  # the old limit, far below the file
    monkeypatch.setattr(bulkparse, "MAX_BULK_BYTES", 4096, raising=False)
    spy = _windowed(monkeypatch, 2048)
    monkeypatch.setattr(loader, "flat_requests", lambda *a: pytest.fail("the line reader parsed the trace"))
    trace = load_trace(path)
    assert path.stat().st_size > 10 * 4096 and spy.calls == 0
    monkeypatch.undo()
    assert _arrays(trace.requests) == _arrays(load_flat(path))


# ----------------------------------------------------------------------------- (d) fingerprint


@pytest.mark.parametrize("layout", ["plain", "no last break", "crlf", "exact windows", "long line", "bailian"])
def test_the_fingerprint_is_the_digest_of_the_whole_file(tmp_path, monkeypatch, layout):
    records = [_mooncake(t, [t] * (300 if layout == "long line" and t == 7 else 3)) for t in range(40)]
    if layout == "bailian":
        records = [_bailian(k, k / 4, [k, k + 1]) for k in range(40)]
    text = "".join(json.dumps(r) + "\n" for r in records)
    text = {"no last break": text.rstrip("\n"), "crlf": text.replace("\n", "\r\n")}.get(layout, text)
    data = text.encode()
    window = 128
    if layout == "exact windows":  # the file ends exactly where a window does
        line = json.dumps(_mooncake(0, [1])) + "\n"
        data, window = (line * 64).encode(), len(line) * 8
    path = tmp_path / "f.jsonl"
    path.write_bytes(data)
    spy = _windowed(monkeypatch, window)
    trace = load_trace(path)
    assert spy.calls == 0
    assert trace.fingerprint == "xxh3-128:" + xxhash.xxh3_128(data).hexdigest() == trace_fingerprint(path)
