"""``tiercache report`` after probe L: prefetch is part of a run, older fingerprints join their
trace, ties do not depend on file order, fleet runs left out of gaps.md are named, cosmetics.

F1: a decode replay's prefetch policy is recorded (results schema 7) and is part of the run's
key and label; a run is compared only with LRU and Belady made with the same prefetch policy.
F6: a blake2b (pre-xxh3) results file whose trace still lies at its recorded path joins that
trace; malformed fingerprints are refused. F7: the best online policy of a tie is the same
whatever the file order. F8: fleet runs left out of gaps.md are named, an empty gaps.md is an
error. F9: messages and Markdown cells.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import DATA
from test_report import make_document, make_run, write_json
from tiercache.cli import main
from tiercache.errors import UserError
from tiercache.results import read_results
from tiercache.sim.traces import trace_fingerprint

TIERS = "hbm=4,dram=8,nvme=30"


def _across(capsys, out: Path, *paths, extra=()) -> tuple[int, str, str]:
    code = main(["report", "--across", *map(str, paths), "-o", str(out), *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _rows(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in table.splitlines()[2:] if line.startswith("|")]


def _replay(trace: Path, out: Path, policies: str, prefetch: str | None = None, extra=()) -> Path:
    argv = ["replay", str(trace), "--tiers", TIERS, "--policy", policies, "--workers", "1", "--no-progress",
            "--out", str(out), *extra]
    assert main(argv + (["--prefetch", prefetch] if prefetch else [])) == 0
    return out


@pytest.fixture(scope="module")
def decode(tmp_path_factory) -> dict[str, Path]:
    """A small step trace and replays of it: without prefetch (with Belady), with topk_speculative."""
    folder = tmp_path_factory.mktemp("decode")
    trace = folder / "steps.jsonl"
    assert main(["trace", "synth", "sparse", "-o", str(trace), "--steps", "60", "--blocks", "32", "--layers", "2",
                 "--seed", "1"]) == 0
    return {
        "trace": trace,
        "plain": _replay(trace, folder / "plain.json", "lru,arc,belady"),
        "lru_plain": _replay(trace, folder / "lru_plain.json", "lru"),
        "prefetch": _replay(trace, folder / "prefetch.json", "lru,leaf_lru", "topk_speculative"),
        "lru_prefetch": _replay(trace, folder / "lru_prefetch.json", "lru", "topk_speculative"),
    }


def _as_version_6(source: Path, target: Path) -> Path:
    """``source`` as schema 6 wrote it: no ``prefetch`` in any run."""
    document = json.loads(source.read_text())
    document["schema_version"] = 6
    for run in document["runs"]:
        run.pop("prefetch")
    return Path(write_json(target, document))


# ----------------------------------------------------------------------------- F1: prefetch


def test_replay_records_the_prefetch_policy_in_the_run_its_key_and_label(decode):
    plain, prefetched = read_results(decode["lru_plain"]).runs[0], read_results(decode["lru_prefetch"]).runs[0]
    assert json.loads(decode["lru_prefetch"].read_text())["runs"][0]["prefetch"] == "topk_speculative"
    assert (plain.prefetch, prefetched.prefetch) == ("none", "topk_speculative")
    assert plain.key != prefetched.key
    assert (plain.label, prefetched.label) == ("lru", "lru (prefetch topk_speculative)")


def test_fleet_and_request_replays_record_no_prefetch(tmp_path):
    fleet = tmp_path / "fleet.json"
    assert main(["replay", str(DATA / "mooncake_head.jsonl"), "--tiers", "hbm=50,remote=200", "--instances", "2",
                 "--policy", "lru", "--no-progress", "--out", str(fleet)]) == 0
    assert json.loads(fleet.read_text())["runs"][0]["prefetch"] == "none"


def test_a_prefetch_run_is_not_credited_against_references_made_without_it(decode, tmp_path, capsys):
    code, alone, _ = _across(capsys, tmp_path / "one", decode["plain"])
    code, both, err = _across(capsys, tmp_path / "two", decode["plain"], decode["prefetch"])
    assert code == 0
    rows = _rows(both)
    assert rows[0] == _rows(alone)[0]  # the plain cache's row is unchanged
    assert rows[1][7] in ("lru (prefetch topk_speculative)", "leaf_lru (prefetch topk_speculative)")
    assert rows[1][6] == "n/a" and rows[1][9] == "n/a"  # no Belady can prefetch: no gap
    assert "caches hold decode runs with prefetch topk_speculative: their gap closed is left out, since" in err


def test_one_policy_with_and_without_prefetch_are_two_runs_not_a_stale_one(decode, tmp_path, capsys):
    code, table, err = _across(capsys, tmp_path / "g", decode["lru_plain"], decode["lru_prefetch"])
    assert code == 0 and "stale" not in err
    assert [r[7] for r in _rows(table)] == ["lru", "lru (prefetch topk_speculative)"]


def test_version_6_decode_runs_read_as_prefetch_not_recorded_unless_belady_shows_none(decode, tmp_path, capsys):
    old_prefetch = _as_version_6(decode["prefetch"], tmp_path / "old_prefetch.json")
    old_plain = _as_version_6(decode["plain"], tmp_path / "old_plain.json")
    assert {r.prefetch for r in read_results(old_prefetch).runs} == {None}
    assert read_results(old_prefetch).runs[0].label == "lru (prefetch not recorded)"
    code, table, err = _across(capsys, tmp_path / "g", old_plain, old_prefetch)
    assert code == 0
    rows = _rows(table)
    assert "prefetch" not in rows[0][7] and rows[0][9] != "n/a"  # Belady in the file: replayed without prefetch
    assert rows[1][7] == "lru (prefetch not recorded)" and rows[1][9] == "n/a" and "prefetch not recorded" in err


def test_older_versions_read_prefetch_as_none_where_it_cannot_have_run(tmp_path):
    version_1 = read_results(write_json(tmp_path / "v1.json", make_document()))
    assert {r.prefetch for r in version_1.runs} == {"none"}


def test_prefetch_outside_decode_semantics_is_refused(tmp_path):
    path = tmp_path / "r.json"
    assert main(["replay", str(DATA / "mooncake_head.jsonl"), "--capacity", "100", "--policy", "lru",
                 "--no-progress", "--out", str(path)]) == 0
    document = json.loads(path.read_text())
    document["runs"][0]["prefetch"] = "topk_speculative"
    write_json(path, document)
    with pytest.raises(UserError, match="r.json: run 1: field 'prefetch' must be 'none' in object semantics"):
        read_results(path)


# ----------------------------------------------------------------------------- F6: fingerprints


def _trace_documents(tmp_path: Path, legacy_name: str) -> tuple[str, str]:
    trace = tmp_path / "trace.jsonl"
    shutil.copy(DATA / "mooncake_head.jsonl", trace)
    runs = [make_run(p, 100, m) for p, m in (("lru", 0.9), ("fifo", 0.8), ("belady", 0.6))]
    new = make_document(trace_fingerprint(trace), runs, str(trace))
    old = make_document(trace_fingerprint(trace, like="0" * 32), runs, str(trace))
    old["trace"]["name"] = legacy_name
    return write_json(tmp_path / "new.json", new), write_json(tmp_path / "old.json", old)


@pytest.mark.parametrize("legacy_name", ["my_trace.jsonl", "renamed.jsonl"])
def test_a_blake2b_results_file_of_a_trace_still_there_joins_it(tmp_path, capsys, legacy_name):
    new, old = _trace_documents(tmp_path, legacy_name)
    code, alone, _ = _across(capsys, tmp_path / "one", new)
    code, both, err = _across(capsys, tmp_path / "two", new, old)
    assert code == 0 and both == alone
    assert f"{old} records its trace by an older (blake2b) fingerprint" in err
    assert f"{old} duplicates {new}" in err


@pytest.mark.parametrize("fingerprint", ["", "xxh3-128:", "A" * 32, "xxh3-128:" + "F" * 32, "f" * 31])
def test_malformed_fingerprints_are_refused_naming_the_file(tmp_path, fingerprint):
    path = write_json(tmp_path / "fp.json", make_document(fingerprint))
    with pytest.raises(UserError, match=r"fp.json: trace: field 'fingerprint' must be 'xxh3-128:' and 32 lower-case hex"):
        read_results(path)


# ----------------------------------------------------------------------------- F7: ties


def test_the_best_policy_of_a_tie_does_not_depend_on_file_order(tmp_path, capsys):
    tie = {"lru": 0.9, "arc": 0.8, "sieve": 0.8, "belady": 0.6}
    a = write_json(tmp_path / "a.json", make_document(runs=[make_run(p, 100, tie[p]) for p in ("lru", "arc", "sieve", "belady")]))
    b = write_json(tmp_path / "b.json", make_document(runs=[make_run(p, 100, tie[p]) for p in ("lru", "sieve", "belady")]))
    _, ab, _ = _across(capsys, tmp_path / "ab", a, b)
    _, ba, _ = _across(capsys, tmp_path / "ba", b, a)
    assert ab == ba and _rows(ab)[0][7] == "arc"


# ----------------------------------------------------------------------------- F8: fleet runs


def test_fleet_runs_left_out_of_gaps_are_named_and_a_fleet_only_table_is_an_error(tmp_path, capsys):
    fleet = tmp_path / "fleet.json"
    assert main(["replay", str(DATA / "mooncake_head.jsonl"), "--tiers", "hbm=50,remote=200", "--instances", "2",
                 "--policy", "lru,arc", "--no-progress", "--out", str(fleet)]) == 0
    capsys.readouterr()
    code, table, err = _across(capsys, tmp_path / "g", fleet)
    assert code == 2 and table == "" and not (tmp_path / "g").exists()
    assert f"note: {fleet}: 4 of its 4 runs are fleet runs (--instances), which are not in gaps.md" in err
    assert "error: no row for gaps.md" in err
    plain = write_json(tmp_path / "plain.json", make_document())
    code, table, err = _across(capsys, tmp_path / "mixed", plain, fleet)
    assert code == 0 and f"{fleet}: 4 of its 4 runs are fleet runs" in err


# ----------------------------------------------------------------------------- F9: cosmetics


def test_a_run_repeated_inside_one_file_with_other_counts_names_the_file_once(tmp_path, capsys):
    path = write_json(tmp_path / "self.json", make_document(runs=[make_run("lru", 100, 0.9), make_run("lru", 100, 0.8)]))
    code, _, err = _across(capsys, tmp_path / "g", path)
    assert code == 2 and f"{path} holds lru at 100 blocks (object, single) twice with different counts" in err


def test_a_directory_is_not_reported_missing(tmp_path, capsys):
    (tmp_path / "dir.json").mkdir()
    code, _, err = _across(capsys, tmp_path / "g", tmp_path / "dir.json")
    assert code == 2 and "dir.json: is a directory, not a results file" in err


def test_a_pipe_in_a_trace_name_is_escaped_in_gaps(tmp_path, capsys):
    document = make_document()
    document["trace"]["name"] = "tr|ace.jsonl"
    code, table, _ = _across(capsys, tmp_path / "g", write_json(tmp_path / "r.json", document))
    assert code == 0
    assert all(line.count(" | ") == 9 for line in table.splitlines()[2:])  # ten cells, the pipe escaped
    assert table.splitlines()[2].startswith("| tr\\|ace.jsonl | object |")


def test_trace_with_across_is_refused(tmp_path, capsys):
    path = write_json(tmp_path / "r.json", make_document())
    code, _, err = _across(capsys, tmp_path / "g", path, extra=("--trace", "/nonexistent"))
    assert code == 2 and "--trace and --across are exclusive" in err and not (tmp_path / "g").exists()


def test_short_fingerprint_labels_lengthen_until_they_differ(tmp_path, capsys):
    a = write_json(tmp_path / "a.json", make_document("xxh3-128:" + "a" * 14 + "0" * 18))
    b = write_json(tmp_path / "b.json", make_document("xxh3-128:" + "a" * 14 + "1" * 18))
    code, table, _ = _across(capsys, tmp_path / "g", a, b)
    names = {row[0] for row in _rows(table)}
    assert code == 0 and names == {f"my_trace.jsonl (xxh3-128:{'a' * 14}{d})" for d in "01"}
