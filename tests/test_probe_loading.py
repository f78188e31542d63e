"""Trace loading against adversarial input: a damaged trace-cache entry, token counts that
would wrap int64, over-long lines, traces without accesses, integers past 2**64, bytes that
are not UTF-8, kv-cache-tester detection and traces that mix the Bailian and Mooncake formats.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tiercache.cli import main
from tiercache.errors import TraceError
from tiercache.sim import traces, tracecache, tracelines
from tiercache.sim.bulkparse import bulk_requests
from tiercache.sim.fastscan import scan_requests
from tiercache.sim.loader import load_trace
from tiercache.sim.prep import dense_and_next_use_sorted
from tiercache.sim.tracecache import load_trace_cached
from tiercache.sim.traces import MAX_TOKENS, FlatTrace, Request, check_token_counts, first_long_line, write_requests


def _line(ts=0, tokens=1024, ids=(1, 2), **extra) -> str:
    record = {"timestamp": ts, "input_length": tokens, "output_length": 1, "hash_ids": list(ids), **extra}
    return json.dumps(record)


def _write(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _user_error(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# ----------------------------------------------------------------------------- finding 1: trace cache


def _small_trace(tmp_path: Path) -> Path:
    rng = np.random.default_rng(7)
    requests = [Request(t, int(rng.integers(1, 4000)), 1, tuple(int(x) for x in rng.integers(0, 40, size=5)))
                for t in range(60)]
    path = tmp_path / "small.jsonl"
    write_requests(path, requests)
    return path


def _damage(entry: Path, mode: str) -> None:
    def load(key):
        return np.load(entry / f"{key}.npy")

    def save(key, value):
        np.save(entry / f"{key}.npy", value)

    if mode == "truncated":
        with open(entry / "ids.npy", "r+b") as handle:
            handle.truncate(100)
    elif mode == "garbage":
        (entry / "dense.npy").write_bytes(b"garbage")
    elif mode == "missing":
        (entry / "next_use.npy").unlink()
    elif mode == "short_dense":
        save("dense", load("dense")[:10])
    elif mode == "dense_big":
        dense = load("dense")
        dense[5] = 10**9
        save("dense", dense)
    elif mode == "dense_neg":
        dense = load("dense")
        dense[5] = -3
        save("dense", dense)
    elif mode == "dense_shuffled":  # same values, same ranges: only the digest tells
        dense = load("dense")
        np.random.default_rng(0).shuffle(dense)
        save("dense", dense)
    elif mode == "next_use_big":
        save("next_use", np.full_like(load("next_use"), 2**40))
    elif mode == "offsets_bad":
        offsets = load("offsets")
        offsets[3] = 10**7
        save("offsets", offsets)
    elif mode == "offsets_short":
        save("offsets", load("offsets")[:5])
    elif mode == "block_tokens_empty":
        save("block_tokens", np.array([], dtype=np.int64))
    elif mode == "block_tokens_zero":
        save("block_tokens", np.array([0], dtype=np.int64))
    elif mode == "ids_float":
        save("ids", load("ids").astype(np.float64))
    elif mode == "input_lengths_short":
        save("input_lengths", load("input_lengths")[:3])
    else:
        raise AssertionError(mode)


@pytest.mark.parametrize("mode", ["truncated", "garbage", "missing", "short_dense", "dense_big", "dense_neg",
                                  "dense_shuffled", "next_use_big", "offsets_bad", "offsets_short",
                                  "block_tokens_empty", "block_tokens_zero", "ids_float", "input_lengths_short"])
def test_a_damaged_cache_entry_is_parsed_again_and_replaced(tmp_path, monkeypatch, mode):
    path, cache = _small_trace(tmp_path), tmp_path / "cache"
    load_trace_cached(path, cache)
    (entry,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    _damage(entry, mode)

    again = load_trace_cached(path, cache)  # a miss: parsed again, the entry rewritten
    reference = load_trace(path)
    dense, next_use, _ = dense_and_next_use_sorted(reference.ids)
    assert again.ids.dtype == np.int64 and again.dense.dtype == np.int32
    assert np.array_equal(again.ids, reference.ids) and np.array_equal(again.offsets, reference.offsets)
    assert np.array_equal(again.input_lengths, reference.input_lengths) and again.block_tokens == 512
    assert np.array_equal(again.dense, dense) and np.array_equal(again.next_use, next_use)

    def no_parse(*args, **kwargs):
        raise AssertionError("the replaced entry should have been read")

    monkeypatch.setattr(tracecache, "load_trace", no_parse)
    third = load_trace_cached(path, cache)
    assert np.array_equal(third.dense, dense)
    assert [p.name for p in cache.iterdir()] == [entry.name]  # no partial or stale folder left


# ----------------------------------------------------------------------------- finding 3: token counts


@pytest.mark.parametrize("field", ["input_length", "output_length"])
def test_token_counts_past_2_40_are_refused_by_every_parser(tmp_path, field):
    bad = json.loads(_line(ts=1, ids=[1, 3]))
    bad[field] = MAX_TOKENS + 1
    path = _write(tmp_path / "big.jsonl", _line(tokens=MAX_TOKENS), json.dumps(bad))
    data = path.read_bytes()
    assert scan_requests(data) is None and bulk_requests(data) is None
    with pytest.raises(TraceError, match=rf"big.jsonl:2: field '{field}' must be at most 2\*\*40 tokens, got {MAX_TOKENS + 1}"):
        load_trace(path)
    with pytest.raises(TraceError, match=r":2: .*at most 2\*\*40"):
        traces.load_flat(path)


def test_2_62_input_tokens_no_longer_wrap_the_prefill_sum(tmp_path, capsys):
    path = _write(tmp_path / "huge_in.jsonl", _line(tokens=2**62, ids=[1, 2]), _line(ts=1, tokens=2**62, ids=[1, 3]))
    err = _user_error(capsys, "replay", path, "--semantics", "prefix", "--capacity", "4", "--no-progress")
    assert "huge_in.jsonl:1: field 'input_length' must be at most 2**40 tokens" in err


def test_the_sum_of_input_tokens_is_bounded():
    n = (1 << 22) + 1  # 2**22 requests at 2**40 tokens sum to 2**62: one more is past the bound
    lengths = np.full(n, MAX_TOKENS, dtype=np.int64)
    zeros = np.zeros(n, dtype=np.int64)
    flat = FlatTrace(zeros[:1], zeros, zeros, lengths, zeros)
    with pytest.raises(TraceError, match=r"sum to .* more than 2\*\*62"):
        check_token_counts("t.jsonl", flat)
    check_token_counts("t.jsonl", FlatTrace(zeros[:1], zeros[:-1], zeros[:-1], lengths[:-1], zeros[:-1]))


def test_kvtester_token_counts_are_bounded(tmp_path):
    conv = {"block_size": 64, "requests": [{"t": 0, "in": MAX_TOKENS + 1, "out": 1, "hash_ids": [1]}]}
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "a.json").write_text(json.dumps(conv))
    with pytest.raises(TraceError, match=r"a\.json.*requests\[0\]\.in must be an integer in \[0, 2\*\*40\]"):
        load_trace(tmp_path / "kv")


# ----------------------------------------------------------------------------- finding 14: line limit


def test_first_long_line_matches_the_line_reader_bound():
    assert first_long_line(b"ab\ncd\n", limit=3) is None  # "ab\n" is 3 bytes: fits
    assert first_long_line(b"ab\nabc\nx\n", limit=3) == 2
    assert first_long_line(b"ab\nabcd", limit=3) == 2  # a last line without a break
    assert first_long_line(b"abc", limit=3) is None
    assert first_long_line(b"a\n" * 10 + b"x" * 8 + b"\n" + b"a\n" * 5, limit=8) == 11


@pytest.mark.parametrize("second", [None, _line(ids=[True]), _line(extra=1.5)])
def test_a_line_over_the_limit_is_refused_whatever_follows(tmp_path, monkeypatch, second):
    monkeypatch.setattr(tracelines, "MAX_LINE_BYTES", 1000)
    long_line = _line(ids=[1] * 400)
    assert len(long_line) > 1000
    path = _write(tmp_path / "long.jsonl", *([long_line] if second is None else [long_line, second]))
    data = path.read_bytes()
    assert scan_requests(data) is None and bulk_requests(data) is None
    with pytest.raises(TraceError, match=r"long.jsonl:1: line longer than"):
        load_trace(path)


def test_an_error_before_a_long_line_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(tracelines, "MAX_LINE_BYTES", 1000)
    path = _write(tmp_path / "long.jsonl", _line(), _line(ids=[True]), _line(ids=[1] * 400))
    with pytest.raises(TraceError, match=r"long.jsonl:2: hash_ids\[0\] must be an integer"):
        load_trace(path)


# ----------------------------------------------------------------------------- finding 16: no accesses


def test_a_trace_without_block_accesses_is_refused(tmp_path, capsys):
    path = _write(tmp_path / "empty_ids.jsonl", _line(ts=2, tokens=1, ids=[]))
    with pytest.raises(TraceError, match="empty_ids.jsonl: the trace has records but no block accesses"):
        load_trace(path)
    with pytest.raises(TraceError, match="no block accesses"):
        load_trace_cached(path, tmp_path / "cache")
    for argv in (["replay", path, "--capacity", "2", "--no-progress"],
                 ["compare", path, "--capacity", "2", "-o", tmp_path / "report", "--no-progress"]):
        assert "no block accesses" in _user_error(capsys, *argv)


# ----------------------------------------------------------------------------- finding 18: huge integers


@pytest.mark.parametrize("text,expected", [
    (_line(ts=2, ids=[1]).replace("[1]", "[18446744073709551621]"),
     ":2: hash_ids[0] must be in [0, 2**63), got 18446744073709551621"),
    (_line(ts=2).replace('"timestamp": 2', '"timestamp": 1180591620717411303424'),
     ":2: field 'timestamp' must be in [0, 2**63), got 1180591620717411303424"),
    (_line(ts=2).replace('"input_length": 1024', '"input_length": 100000000000000000000000'),
     ":2: field 'input_length' must be in [0, 2**63), got 100000000000000000000000"),
    (_line(ts=2, ids=[1]).replace("[1]", "[1.5]"), ":2: hash_ids[0] must be an integer block id, got 1.5"),
])
def test_integers_past_2_64_are_named_exactly(tmp_path, text, expected):
    path = _write(tmp_path / "big.jsonl", _line(), text)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}{expected}"


def test_a_bailian_timestamp_past_2_63_ms_names_the_limit(tmp_path):
    first = _line(ts=1.5, chat_id=1, parent_chat_id=-1)
    path = _write(tmp_path / "bl.jsonl", first, _line(ts=9.3e15, chat_id=2, parent_chat_id=1))
    with pytest.raises(TraceError, match=r"bl.jsonl:2: field 'timestamp' must be a non-negative number of seconds "
                                         r"below 2\*\*63 ms .*got 9300000000000000.0"):
        load_trace(path)


# ----------------------------------------------------------------------------- finding 19: UTF-8


def test_bytes_that_are_not_utf8_are_named_with_line_column_and_reason(tmp_path):
    path = tmp_path / "nonutf8.jsonl"
    path.write_bytes(_line().encode() + b'\n{"timestamp": 2, "x": "\xff\xfe"}\n')
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}:2: malformed JSON: not UTF-8: byte 0xff at column 24 (invalid start byte)"
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_bytes((_line() + "\n").encode("utf-16"))
    with pytest.raises(TraceError, match=r"utf16.jsonl:1: malformed JSON: not UTF-8: byte 0xff at column 1"):
        load_trace(utf16)


# ----------------------------------------------------------------------------- finding 21: kv-cache-tester


@pytest.mark.parametrize("files", [[], ["a.txt", "b.csv"]])
def test_a_folder_without_conversation_files_says_so(tmp_path, files):
    folder = tmp_path / "kv"
    folder.mkdir()
    for name in files:
        (folder / name).write_text("x")
    with pytest.raises(TraceError, match=r"kv: cannot open trace: a folder with no conversation files \(\*\.json\)"):
        load_trace(folder)


def test_mooncake_jsonl_named_json_is_read_as_jsonl(tmp_path):
    lines = [_line(ids=[1, 2], block_size=512), _line(ts=1, ids=[1, 3], block_size=512)]
    as_json, as_jsonl = _write(tmp_path / "mc.json", *lines), _write(tmp_path / "mc.jsonl", *lines)
    trace = load_trace(as_json)
    assert trace.ids.tolist() == load_trace(as_jsonl).ids.tolist() == [1, 2, 1, 3]
    assert trace.block_tokens == 512


def test_a_conversation_named_jsonl_gets_a_hint(tmp_path):
    path = _write(tmp_path / "conv.jsonl", json.dumps({"block_size": 64, "requests": [
        {"t": 0, "in": 1, "out": 1, "hash_ids": [1]}]}))
    with pytest.raises(TraceError, match=r"conv.jsonl:1: not a known trace: .*kv-cache-tester conversation.*\*\.json"):
        load_trace(path)


def test_a_one_line_conversation_file_is_still_a_conversation(tmp_path):
    path = _write(tmp_path / "conv.json", json.dumps({"block_size": 64, "requests": [
        {"t": 0, "in": 1, "out": 1, "hash_ids": [1, 2]}]}))
    assert load_trace(path).block_tokens == 64


# ----------------------------------------------------------------------------- finding 25: mixed formats


def test_a_bailian_trace_with_mooncake_records_is_refused(tmp_path):
    path = _write(tmp_path / "mixed.jsonl", _line(ts=1.5, chat_id=1, parent_chat_id=-1), _line(ts=1000))
    assert bulk_requests(path.read_bytes(), seconds=True) is None
    with pytest.raises(TraceError, match=r"mixed.jsonl:2: the record lacks 'chat_id' or 'parent_chat_id', but the "
                                         r"first record is a Bailian record"):
        load_trace(path)


def test_a_mooncake_trace_with_bailian_records_is_refused(tmp_path):
    path = _write(tmp_path / "mixed.jsonl", _line(ts=0), _line(ts=1, chat_id=1, parent_chat_id=-1))
    assert bulk_requests(path.read_bytes()) is None
    with pytest.raises(TraceError, match=r"mixed.jsonl:2: the record has 'chat_id' and 'parent_chat_id'"):
        load_trace(path)


def test_a_mooncake_trace_may_mention_parent_chat_id_in_a_value(tmp_path):
    path = _write(tmp_path / "ok.jsonl", _line(ts=0, note="parent_chat_id"), _line(ts=1))
    assert load_trace(path).ids.tolist() == [1, 2, 1, 2]


def test_the_readers_agree_on_a_bailian_sample():
    sample = Path(__file__).parent / "data" / "bailian_sample.jsonl"
    bulk = load_trace(sample)
    lines = traces.load_flat(sample)
    assert np.array_equal(bulk.ids, lines.ids) and np.array_equal(bulk.requests.timestamps, lines.timestamps)
    assert os.path.getsize(sample) > 0
