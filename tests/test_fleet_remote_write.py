"""Fleet replay under the live store's shared-tier write modes (``RemoteWrite``).

``tiercache replay --instances N`` with ``remote=`` in ``--tiers`` modelled only ``through``
(every request published at once); ``--remote-write through|back|selective`` (with
``--write-hits N`` for selective) now models each as ``tiercache.live.remote.RemoteLink`` does:
``back`` writes a block only as a victim of the last private tier, ``selective`` publishes a
block once the instance hit it ``write_hits`` times locally and lets only such blocks down as
victims. Results record the mode (schema 9; older files read as ``through``), two runs that
differ only in it are two runs, and the printed header and the report name it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tiercache.cli import main
from tiercache.config import RemoteWrite, Route, TierConfig
from tiercache.results import SCHEMA_VERSION, ResultsDocument, read_results
from tiercache.sim import fleet
from tiercache.sim.fleet import FleetSpec, replay_fleet
from tiercache.sim.loader import load_trace
from test_cli_errors import _error  # runs the CLI, asserts exit 2 with one line

HEAD = Path(__file__).parent / "data" / "mooncake_head.jsonl"
FLEET = ["replay", str(HEAD), "--instances", "3", "--tiers", "hbm=100,dram=300,remote=2000", "--no-progress"]


def _trace(tmp_path: Path, requests: list[list[int]]):
    """A Mooncake trace (512-token blocks), each prompt exactly its blocks' tokens."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(r), "output_length": 1, "hash_ids": r}) + "\n"
                            for i, r in enumerate(requests)))
    return load_trace(path)


def _spec(write: RemoteWrite, write_hits: int = 2, instances: int = 2, hbm: int = 2) -> FleetSpec:
    return FleetSpec(instances, (TierConfig("hbm", hbm),), 8, Route.ROUND_ROBIN, "lru", write, write_hits)


def _store_after_each(spec: FleetSpec, trace) -> tuple[list[set[int]], list[int]]:
    """The blocks the shared store holds after each request, and each instance's remote hits
    at the end: ``replay_fleet``'s loop, one request at a time."""
    store = fleet._Store(spec.remote_blocks, spec.policy)
    instances = [fleet._Instance(spec, store, None, None) for _ in range(spec.instances)]
    ids, offsets = trace.ids.tolist(), trace.offsets.tolist()
    held = []
    router = fleet.router_of(spec.route, instances)
    for request in range(trace.records):
        run = ids[offsets[request] : offsets[request + 1]]
        instance = instances[router.pick(request, run)]
        fleet._request(instance, store, run, 512 * len(run), 512)
        held.append(set(store.slot_of))
    for instance in instances:
        instance.consume()
        instance.manager.check_invariants()
    return held, [instance.stats.tiers[-1].hits for instance in instances]


# Round robin over 2 instances of one 2-block HBM: requests 0, 2, 4 on instance 0, 1 and 3 on instance 1.
TWICE_THEN_PUSHED_OUT = [[1, 2], [1, 2], [3, 4], [5, 6], [1, 2]]


def test_through_writes_every_request_to_the_shared_tier_when_it_is_served(tmp_path):
    held, remote_hits = _store_after_each(_spec(RemoteWrite.THROUGH), _trace(tmp_path, TWICE_THEN_PUSHED_OUT))
    assert held == [{1, 2}, {1, 2}, {1, 2, 3, 4}, {1, 2, 3, 4, 5, 6}, {1, 2, 3, 4, 5, 6}]
    assert remote_hits == [2, 2]  # instance 1 reads 1, 2 at once; instance 0 after its HBM lost them
    run = replay_fleet(_spec(RemoteWrite.THROUGH), _trace(tmp_path, TWICE_THEN_PUSHED_OUT))
    assert run.shared_writes == 6 and run.remote_write is RemoteWrite.THROUGH and run.write_hits is None


def test_back_writes_only_the_victims_of_the_last_private_tier(tmp_path):
    held, remote_hits = _store_after_each(_spec(RemoteWrite.BACK), _trace(tmp_path, TWICE_THEN_PUSHED_OUT))
    # nothing until instance 0's HBM pushes 1, 2 out (request 2); instance 1's copies of them
    # find the store holding them (request 3: no write); request 4 reads them back and pushes 3, 4 down
    assert held == [set(), set(), {1, 2}, {1, 2}, {1, 2, 3, 4}]
    assert remote_hits == [2, 0]  # instance 1 asked for 1, 2 before any instance had let them go
    run = replay_fleet(_spec(RemoteWrite.BACK), _trace(tmp_path, TWICE_THEN_PUSHED_OUT))
    assert run.shared_writes == 4 and run.shared_hits == 2 and run.remote_write is RemoteWrite.BACK
    assert run.tiers[0].demotions == 6  # 1, 2 (twice) and 3, 4: every write a victim of HBM


# Instance 0 hits 1 and 2 locally on request 2, and 1 again on request 4 (write_hits 2: published
# then); instance 1 then reads 1 from the store but computes 2, which was never published.
HIT_TWICE = [[1, 2], [9], [1, 2], [9], [1], [1, 2], [3, 4]]


def test_selective_publishes_a_block_once_it_was_hit_write_hits_times_locally(tmp_path):
    held, remote_hits = _store_after_each(_spec(RemoteWrite.SELECTIVE), _trace(tmp_path, HIT_TWICE))
    # request 6 pushes 1 (hot, listed in the view: leaves with no put) and 2 (hit once: refused) out of HBM
    assert held == [set(), set(), set(), set(), {1}, {1}, {1}]
    assert remote_hits == [0, 1]
    run = replay_fleet(_spec(RemoteWrite.SELECTIVE), _trace(tmp_path, HIT_TWICE))
    assert run.shared_writes == 1 and run.remote_write is RemoteWrite.SELECTIVE and run.write_hits == 2
    assert run.tiers[1].refused == 2  # instance 1's 9 (hit once) and instance 0's 2 (hit once) went nowhere


def test_selective_with_one_local_hit_publishes_at_the_first_hit(tmp_path):
    held, remote_hits = _store_after_each(_spec(RemoteWrite.SELECTIVE, write_hits=1), _trace(tmp_path, HIT_TWICE))
    assert held[:3] == [set(), set(), {1, 2}] and held[3] == {1, 2, 9}
    assert remote_hits == [0, 2]  # request 5 reads 1, 2 from the store


def test_selective_forgets_a_blocks_local_hits_once_it_left_the_instance_as_the_live_store_does(tmp_path):
    # one instance, one HBM slot: 1 is hit once, pushed out by 2 (cold: dropped, its count
    # forgotten), computed again and hit once more: one hit since it came back, not published
    held, _ = _store_after_each(_spec(RemoteWrite.SELECTIVE, instances=1, hbm=1), _trace(tmp_path, [[1], [1], [2], [1], [1]]))
    assert held == [set()] * 5
    held, _ = _store_after_each(_spec(RemoteWrite.SELECTIVE, instances=1, hbm=1), _trace(tmp_path, [[1], [1], [1], [2]]))
    assert held == [set(), set(), {1}, {1}]  # two hits while it stayed: published


def test_a_fleet_spec_refuses_a_write_mode_it_cannot_model():
    with pytest.raises(ValueError, match="write must be a RemoteWrite"):
        FleetSpec(2, (TierConfig("hbm", 2),), 8, Route.ROUND_ROBIN, "lru", "back")
    with pytest.raises(ValueError, match="write_hits must be an integer of at least 1"):
        FleetSpec(2, (TierConfig("hbm", 2),), 8, Route.ROUND_ROBIN, "lru", RemoteWrite.SELECTIVE, 0)


# ----------------------------------------------------------------------------- results


def _fleet_document(tmp_path: Path, *options: str) -> ResultsDocument:
    out = tmp_path / f"fleet{'_'.join(options)}.json"
    assert main(FLEET + [*options, "--out", str(out)]) == 0
    return read_results(out)


def test_results_record_the_write_mode_of_the_shared_run_and_read_it_back(tmp_path):
    document = _fleet_document(tmp_path, "--remote-write", "selective", "--write-hits", "3")
    shared, private = document.runs
    assert (shared.remote_write, shared.write_hits) == (RemoteWrite.SELECTIVE, 3)
    assert (private.remote_write, private.write_hits) == (None, None)  # no shared tier: no write mode
    data = document.to_json()
    assert data["schema_version"] == SCHEMA_VERSION == 10
    assert (data["runs"][0]["remote_write"], data["runs"][0]["write_hits"]) == ("selective", 3)
    assert ResultsDocument.from_json(json.loads(json.dumps(data)), "again.json") == document


@pytest.mark.parametrize("version", [5, 8])
def test_a_fleet_run_of_an_older_results_file_reads_as_written_through(tmp_path, version):
    document = _fleet_document(tmp_path)
    data = document.to_json()
    data["schema_version"] = version
    for run in data["runs"]:
        del run["remote_write"], run["write_hits"]
        if version < 8:
            for key in ("offline", "prefetched", "prefetch_used", "prefetch_wasted"):
                run.pop(key)
        if version < 6:
            del run["prefetch"]
    old = ResultsDocument.from_json(data, "old.json")
    assert [r.remote_write for r in old.runs] == [RemoteWrite.THROUGH, None]
    assert old.runs[0].key == document.runs[0].key  # the same run as a replay writes it today


@pytest.mark.parametrize("change, fragment", [
    (lambda runs: runs[0].pop("remote_write"), "run 1: missing field(s) remote_write"),
    (lambda runs: runs[0].update(remote_write=None), "run 1: field 'remote_write' must be through/back/selective"),
    (lambda runs: runs[0].update(remote_write="lazy"), "run 1: field 'remote_write' must be null or through/back/selective"),
    (lambda runs: runs[1].update(remote_write="back"), "run 2: inconsistent counts: remote_write belongs to fleet runs"),
    (lambda runs: runs[0].update(write_hits=2), "run 1: inconsistent counts: write_hits belongs to selective"),
    (lambda runs: runs[0].update(remote_write="selective"), "run 1: inconsistent counts: write_hits belongs to selective"),
    (lambda runs: runs[0].update(remote_write="selective", write_hits=0), "field 'write_hits' must be"),
])
def test_a_results_file_with_a_wrong_write_mode_is_refused_naming_the_run(tmp_path, change, fragment):
    data = _fleet_document(tmp_path).to_json()
    change(data["runs"])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    err = _error_of(lambda: read_results(path))
    assert fragment in err, err


def _error_of(call) -> str:
    from tiercache.errors import UserError

    with pytest.raises(UserError) as caught:
        call()
    return str(caught.value)


def test_two_fleet_runs_that_differ_only_in_write_mode_are_two_runs(tmp_path):
    through = _fleet_document(tmp_path).runs[0]
    back = dataclasses.replace(through, remote_write=RemoteWrite.BACK)
    selective = dataclasses.replace(through, remote_write=RemoteWrite.SELECTIVE, write_hits=2)
    keys = {through.key, back.key, selective.key, dataclasses.replace(selective, write_hits=3).key}
    assert len(keys) == 4


# ----------------------------------------------------------------------------- the command


def test_the_printed_header_and_the_report_name_each_write_mode(tmp_path, capsys):
    files = []
    for options in ((), ("--remote-write", "back"), ("--remote-write", "selective")):
        files.append(tmp_path / f"{len(files)}.json")
        assert main(FLEET + [*options, "--out", str(files[-1])]) == 0
        header = capsys.readouterr().out.splitlines()[0]
        mode = options[1] if options else "through"
        expected = "write selective (after 2 local hits)" if mode == "selective" else f"write {mode}"
        assert f"(round_robin), lru, {expected}, tiers hbm=100,dram=300,remote=2000 (remote: shared)" in header
    runs = [read_results(f).runs[0] for f in files]
    assert len({r.shared_hits for r in runs}) > 1  # the modes write differently
    assert main(["report", *map(str, files), "-o", str(tmp_path / "r")]) == 0
    report = (tmp_path / "r" / "report.md").read_text()
    for expected in ("write through", "write back", "write selective (after 2 local hits)"):
        assert f"3 instances (round\\_robin, lru, {expected})" in report
    assert "Fleet 3:" in report and "Fleet 4:" not in report  # the private-tier baseline is one run
    rows = (tmp_path / "r" / "results.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert {"remote_write", "write_hits"} <= set(header)
    written = sorted(row.split(",")[header.index("remote_write")] for row in rows[1:])
    assert written == ["", "back", "selective", "through"]


@pytest.mark.parametrize("argv, fragment", [
    (["--remote-write", "back"], "--remote-write back: applies to a fleet replay; add remote=CAP"),
    (["--write-hits", "3"], "--write-hits 3: applies to a fleet replay; add remote=CAP"),
    (["--tiers", "hbm=100", "--remote-write", "selective"], "--remote-write selective: applies to a fleet replay"),
    (["--instances", "2", "--remote-write", "back"], "--instances 2: the instances of a fleet replay share a remote tier"),
    (["--tiers", "hbm=100,remote=500", "--write-hits", "3"],
     "--write-hits 3: applies to --remote-write selective (through writes every block it computes)"),
    (["--tiers", "hbm=100,remote=500", "--remote-write", "back", "--write-hits", "3"],
     "--write-hits 3: applies to --remote-write selective (back writes"),
    (["--tiers", "hbm=100,remote=500", "--remote-write", "selective", "--write-hits", "0"],
     "--write-hits: must be an integer in [1, 2**63), got 0"),
    (["--tiers", "hbm=100,remote=500", "--remote-write", "lazy"], "--remote-write: invalid choice: 'lazy'"),
])
def test_bad_write_mode_options_exit_2_naming_the_option(capsys, argv, fragment):
    assert fragment in _error(capsys, "replay", HEAD, "--no-progress", *argv)
