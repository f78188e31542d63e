"""Alibaba Bailian (Qwen) request traces: seconds as float timestamps, 16-token blocks, chat
fields. Both readers (bulk and line by line) agree, bad timestamps name file, line and field,
the block size reaches the replay's layout and survives the binary trace cache."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from tiercache.cli import main
from tiercache.errors import TraceError
from tiercache.sim.bulkparse import bulk_requests
from tiercache.sim.loader import load_trace
from tiercache.sim.tracecache import load_trace_cached
from tiercache.sim.traces import BAILIAN_BLOCK_TOKENS, flat_requests, iter_json_objects, request_format

SAMPLE = Path(__file__).parent / "data" / "bailian_sample.jsonl"


def _record(chat: int, parent: int, seconds, ids: list[int], **extra) -> dict:
    return {"chat_id": chat, "parent_chat_id": parent, "timestamp": seconds, "input_length": 16 * len(ids) - 3,
            "output_length": 7, "type": "text", "turn": 1, "hash_ids": ids, **extra}


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _line_reader(path: Path):
    return flat_requests(str(path), iter_json_objects(path))


def test_sample_reads_as_bailian_with_millisecond_timestamps() -> None:
    records = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    trace = load_trace(SAMPLE)
    assert request_format(records[0]) == "bailian"
    assert trace.block_tokens == BAILIAN_BLOCK_TOKENS == 16
    assert trace.requests.timestamps.tolist() == [round(r["timestamp"] * 1000) for r in records]
    assert trace.ids.tolist() == [i for r in records for i in r["hash_ids"]]
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 16) for r in records)  # the format's own rule


@pytest.mark.parametrize("seed", range(3))
def test_bulk_and_line_readers_agree(tmp_path, seed) -> None:
    rng = random.Random(seed)
    stamps = sorted(rng.choice([rng.randint(0, 10**6), rng.uniform(0, 10**6), 0.0005, 2.5]) for _ in range(300))
    records = [_record(k, rng.choice([-1, k - 1]), s, [rng.randrange(2**40) for _ in range(rng.randint(1, 9))])
               for k, s in enumerate(stamps)]
    path = _write(tmp_path / "t.jsonl", records)
    fast, slow = bulk_requests(path.read_bytes(), seconds=True), _line_reader(path)
    assert fast is not None  # the bulk path took it
    for field in ("ids", "offsets", "timestamps", "input_lengths", "output_lengths"):
        assert np.array_equal(getattr(fast, field), getattr(slow, field)), field
    assert slow.timestamps.tolist() == [round(s * 1000) for s in stamps]


def test_integer_seconds_are_seconds_too(tmp_path) -> None:
    path = _write(tmp_path / "t.jsonl", [_record(0, -1, 0, [1, 2]), _record(1, 0, 3, [1, 2, 3])])
    trace = load_trace(path)
    assert trace.requests.timestamps.tolist() == [0, 3000] and trace.block_tokens == 16


def test_a_mooncake_trace_keeps_its_milliseconds_and_blocks(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1, 2], "chat_id": 3}\n')
    trace = load_trace(path)  # one chat field alone is not the Bailian format
    assert trace.requests.timestamps.tolist() == [5] and trace.block_tokens == 512


@pytest.mark.parametrize("bad", ['"soon"', "-1.5", "true", "null", "1e300"])
def test_bad_timestamp_names_file_line_and_field(tmp_path, bad) -> None:
    good = json.dumps(_record(0, -1, 1.5, [1, 2]))
    wrong = json.dumps(_record(1, 0, 0, [1, 2, 3])).replace('"timestamp": 0', f'"timestamp": {bad}')
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + wrong + "\n")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    message = str(info.value)
    assert str(path) in message and ":2:" in message and "'timestamp'" in message and "seconds" in message


def test_block_size_survives_the_trace_cache(tmp_path) -> None:
    first = load_trace_cached(SAMPLE, tmp_path)
    again = load_trace_cached(SAMPLE, tmp_path)  # read from the cache entry
    assert first.block_tokens == again.block_tokens == 16
    assert np.array_equal(again.requests.timestamps, load_trace(SAMPLE).requests.timestamps)


def test_replay_models_16_token_blocks(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    code = main(["replay", str(SAMPLE), "--policy", "lru,session,belady", "--semantics", "prefix", "--capacity", "300",
                 "--model", "llama-3-8b", "--hardware", "h200-pcie5-nvme4", "--no-progress", "--out", str(out)])
    assert code == 0, capsys.readouterr()
    doc = json.loads(out.read_text())
    assert doc["layout"]["block_tokens"] == 16
    misses = {r["policy"]: r["miss_ratio"] for r in doc["runs"]}
    assert misses["belady"] <= misses["lru"] and misses["belady"] <= misses["session"]
    assert all(r["prefill_tokens_saved"] > 0 for r in doc["runs"])


def test_inspect_shows_the_block_size(capsys) -> None:
    assert main(["trace", "inspect", str(SAMPLE)]) == 0
    assert "tokens per block             16" in capsys.readouterr().out
