"""Probe Q23 findings on trace input: ``--block-tokens`` has the bound of a step trace's header
(and a refused header value is shown with its digits), a kv-cache-tester folder reads its
``*.json`` files in any case and its ``*.json.gz`` files and warns of the entries it skips, a
block size is said to be implied only when most mismatched requests fit it, and a trace-cache
entry is bound to the fingerprint it is filed under."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

from tiercache.cli import main
from tiercache.sim import tracecache
from tiercache.sim.blockfit import block_fit
from tiercache.sim.tracecache import load_trace_cached

QUIET = ["--workers", "1", "--no-progress"]


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error(capsys, *argv) -> str:
    code, _, err = _run(capsys, *argv)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


# ----------------------------------------------------------------------------- finding 1


def test_block_tokens_past_a_headers_bound_is_refused_naming_the_option_and_a_refused_header_shows_its_digits(
        tmp_path: Path, capsys) -> None:
    records = '{"step": 0, "layer": 0, "read": [5, 6], "write": [0, 1]}\n{"step": 1, "layer": 0, "read": [0, 1], "write": []}\n'
    bare = tmp_path / "nh.jsonl"
    bare.write_text(records)
    out = tmp_path / "big.json"
    modeled = ["--policy", "lru", "--tiers", "hbm=1,dram=10", "--model", "llama-3-8b", "--hardware", "h200-pcie5-nvme4"]
    for value in ("99999999999999999999", str(2**31)):
        err = _one_error(capsys, "replay", bare, *modeled, *QUIET, "--block-tokens", value, "--out", out)
        assert err.startswith("tiercache replay: error: --block-tokens") and "[1, 2**31)" in err and value in err, err
        assert not out.exists()  # refused before any replay
        err = _one_error(capsys, "trace", "export", bare, "-o", tmp_path / "x.og", "--model", "llama-3-8b",
                         "--block-tokens", value)
        assert "--block-tokens" in err and "[1, 2**31)" in err, err
    code, text, _ = _run(capsys, "replay", bare, *modeled, *QUIET, "--block-tokens", str(2**31 - 1))
    assert code == 0 and "2,147,483,647 tokens" in text
    header = tmp_path / "hdr.jsonl"
    header.write_text('{"block_tokens": 99999999999999999999}\n' + records)
    err = _one_error(capsys, "replay", header, "--capacity", "10", *QUIET)
    assert err.endswith("got 99999999999999999999"), err


# ----------------------------------------------------------------------------- finding 2


def _conversation(ids: list[int]) -> str:
    return json.dumps({"block_size": 64, "requests": [{"t": 0, "in": 64 * len(ids), "out": 1, "hash_ids": ids}]})


def test_a_conversation_folder_reads_json_in_any_case_and_gzipped_and_warns_once_of_the_entries_it_skips(
        tmp_path: Path, capsys) -> None:
    folder = tmp_path / "w"
    (folder / "day2").mkdir(parents=True)
    (folder / "a.json").write_text(_conversation([0, 1]))
    (folder / "b.json.gz").write_bytes(gzip.compress(_conversation([2, 3, 4]).encode()))
    (folder / "c.JSON").write_text(_conversation([5]))
    (folder / "day2" / "d.json").write_text(_conversation([6]))
    (folder / "notes.txt").write_text("not a conversation")
    code, out, err = _run(capsys, "replay", folder, "--capacity", "10", *QUIET)
    assert code == 0 and out.startswith("w: 3 requests, 6 block accesses"), out
    (warning,) = err.strip().splitlines()
    assert warning.startswith(f"warning: {folder}: 2 entries not read") and "day2" in warning, warning
    code, out, err = _run(capsys, "trace", "inspect", folder)
    assert code == 0 and "requests                     3" in out and err.strip() == warning, (out, err)
    # a folder of gzipped conversations alone is a workload; a damaged one is refused by name
    only = tmp_path / "gz"
    only.mkdir()
    shutil.copy(folder / "b.json.gz", only / "b.json.gz")
    code, out, err = _run(capsys, "replay", only, "--capacity", "10", *QUIET)
    assert code == 0 and out.startswith("gz: 1 requests, 3 block accesses") and not err, (out, err)
    (only / "c.json.gz").write_bytes(gzip.compress(_conversation([7]).encode())[:-6])
    err = _one_error(capsys, "replay", only, "--capacity", "10", *QUIET)
    assert f"{only / 'c.json.gz'}: " in err and "gzip" in err, err


# ----------------------------------------------------------------------------- finding 3


def test_a_block_size_is_said_to_be_implied_only_when_more_than_half_of_the_mismatched_requests_fit_it(
        tmp_path: Path, capsys) -> None:
    def misfits(fitting_64: int, total: int) -> tuple[list[int], list[int]]:
        # 100 tokens in two ids fits 64-token blocks only; 1000 tokens in three ids fits no power of two
        return [2] * fitting_64 + [3] * (total - fitting_64), [100] * fitting_64 + [1000] * (total - fitting_64)

    assert block_fit(*misfits(1, 100), 512).implied_block_tokens is None
    assert block_fit(*misfits(50, 100), 512).implied_block_tokens is None
    assert block_fit(*misfits(51, 100), 512).implied_block_tokens == 64
    trace = tmp_path / "t.jsonl"
    counts, lengths = misfits(1, 100)
    trace.write_text("".join(json.dumps({"timestamp": k, "input_length": n, "output_length": 1,
                                         "hash_ids": list(range(10 * k, 10 * k + c))}) + "\n"
                             for k, (c, n) in enumerate(zip(counts, lengths))))
    code, out, _ = _run(capsys, "trace", "inspect", trace)
    assert code == 0 and f"100 of 100 (100.00%) (first: {trace}:1)" in out and "imply" not in out, out
    code, _, err = _run(capsys, "replay", trace, "--capacity", "10", *QUIET)
    assert code == 0 and "100 of 100 requests" in err and "imply" not in err, err


# ----------------------------------------------------------------------------- finding 4


def test_a_trace_cache_entry_filed_under_another_traces_fingerprint_is_a_miss_parsed_again(
        tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    p, q = tmp_path / "p.jsonl", tmp_path / "q.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 6, "hash_ids": [0, 1]}\n')
    q.write_text('{"timestamp": 0, "input_length": 512, "output_length": 6, "hash_ids": [42]}\n')
    tp, tq = load_trace_cached(p, cache), load_trace_cached(q, cache)
    parses = []
    load = tracecache.load_trace
    monkeypatch.setattr(tracecache, "load_trace", lambda name: parses.append(name) or load(name))
    assert load_trace_cached(p, cache).ids.tolist() == [0, 1] and parses == []  # a proper entry is used
    entry = tracecache._entry(cache, tp.fingerprint)
    shutil.rmtree(entry)
    shutil.copytree(tracecache._entry(cache, tq.fingerprint), entry)  # q's entry filed under p's name
    again = load_trace_cached(p, cache)
    assert again.ids.tolist() == [0, 1] and again.fingerprint == tp.fingerprint and parses == [str(p)]
    assert load_trace_cached(p, cache).ids.tolist() == [0, 1] and parses == [str(p)]  # replaced by p's own
