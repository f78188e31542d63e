"""Probe Q75 (differential fuzz of the replay paths): three findings, none a mismatch.

Finding 1: a promotion's victims go only to the tier right below HBM, so a run found in
NVMe is read in place on every hit when DRAM is smaller than the run, though NVMe has room.
That is the documented model (``core/room.py``: a guarded placement is declined, never
passed down); the README said a victim passes a tier that cannot make room, which holds for
new blocks only. The README now says so, and the behaviour it describes is pinned here.
Finding 2: ``RunSpec`` accepted repeated or out-of-order tier names (``CacheConfig`` refuses
them), and the compiled and Python paths then diverged (a missing link raised on one, counted
failed transfers on the other); it now refuses them as ``CacheConfig`` does. Finding 3:
``scripts/bench_replay.py --capacity`` below 10 aborted the process inside libCacheSim's
S3-FIFO, and below 20 compared against a libCacheSim run that missed every access; that side
is now not run there (``LIBCACHESIM_MIN_CAPACITY``, shared with ``policy_zoo.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_script_bench_honesty import _script
from tiercache.config import CacheConfig, ConfigError, TierConfig
from tiercache.results import Semantics
from tiercache.sim.loader import load_trace
from tiercache.sim.oracle import LIBCACHESIM_MIN_CAPACITY, libcachesim_runs_at
from tiercache.sim.replay import ReplayData, RunSpec, replay

README = Path(__file__).resolve().parents[1] / "README.md"


def _trace(tmp_path: Path, requests: list[list[int]]):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 1,
                                        "hash_ids": ids}) + "\n" for t, ids in enumerate(requests)))
    return ReplayData.prepare(load_trace(path), None, None)


@pytest.mark.parametrize("names", [("dram", "dram"), ("hbm", "nvme", "hbm"), ("nvme", "dram"), ("dram", "hbm")])
def test_runspec_refuses_tiers_that_cache_config_refuses(names):
    tiers = tuple(TierConfig(name, 2) for name in names)
    with pytest.raises(ConfigError, match=r"^RunSpec\.tiers: tier(s must be ordered| names repeat)"):
        RunSpec("lru", Semantics.OBJECT, tiers)
    with pytest.raises(ConfigError, match=r"^CacheConfig: "):
        CacheConfig(tiers)


@pytest.mark.parametrize("names", [("hbm",), ("dram",), ("dram", "nvme"), ("hbm", "nvme"), ("hbm", "dram", "nvme")])
def test_runspec_takes_every_ordered_subset_of_the_tiers(names):
    spec = RunSpec("lru", Semantics.OBJECT, tuple(TierConfig(name, 2) for name in names))
    assert [t.name for t in spec.tiers] == list(names)


def test_runspec_refuses_no_tier():
    with pytest.raises(ConfigError, match=r"^RunSpec\.tiers: at least one tier"):
        RunSpec("lru", Semantics.OBJECT, ())


@pytest.mark.parametrize("dram, hbm_hits, skipped", [(2, 0, 9), (3, 6, 0)])
def test_a_promotion_whose_victims_dram_cannot_take_is_read_in_place_as_the_readme_says(tmp_path, dram, hbm_hits, skipped):
    """Run [1, 2, 3] pushed to NVMe by six new blocks, then hit three times: with DRAM of 2
    blocks HBM's 3 victims find no room there and do not pass it to NVMe (which has room), so
    every hit is read in place; with DRAM of 3 the first hit promotes the run."""
    data = _trace(tmp_path, [[1, 2, 3], [4, 5, 6, 7, 8, 9], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    tiers = (TierConfig("hbm", 4), TierConfig("dram", dram), TierConfig("nvme", 100))
    record = replay(RunSpec("lru", Semantics.OBJECT, tiers), data)
    hbm, _, nvme = record.tiers
    assert (hbm.hits, nvme.promote_skipped) == (hbm_hits, skipped)
    assert nvme.hits == 9 - hbm_hits


def test_the_readme_says_a_promotions_victims_do_not_pass_dram():
    text = " ".join(README.read_text().split())
    assert "a promotion's victims go only to that tier, never past it to NVMe" in text
    assert "with `--tiers hbm=4,dram=2,nvme=100` a run of 3 NVMe blocks is read in place on every hit" in text
    assert "a victim passes a tier that cannot make room, and leaves" not in text


class _FakeLibCacheSim:
    """Stands in for the libcachesim module: ``_sides`` only stores a closure over it."""


@pytest.mark.parametrize("capacity", [1, 5, 9, 19])
def test_bench_replay_runs_no_libcachesim_s3fifo_below_its_minimum(capacity):
    bench = _script("bench_replay")
    sides = bench._sides(_FakeLibCacheSim(), "t", "o", "c", "s3fifo", capacity, 10)
    assert set(sides) == {"cold", "cached"}
    assert set(bench._sides(_FakeLibCacheSim(), "t", "o", "c", "lru", capacity, 10)) == {"cold", "cached", "libcachesim"}


def test_bench_replay_runs_libcachesim_s3fifo_from_its_minimum():
    bench = _script("bench_replay")
    assert "libcachesim" in bench._sides(_FakeLibCacheSim(), "t", "o", "c", "s3fifo", LIBCACHESIM_MIN_CAPACITY["S3FIFO"], 10)


def test_policy_zoo_and_bench_replay_share_one_minimum():
    zoo = _script("policy_zoo")
    assert zoo.runs_at is libcachesim_runs_at and zoo.LIBCACHESIM_MIN_CAPACITY is LIBCACHESIM_MIN_CAPACITY
    assert not libcachesim_runs_at("S3FIFO", 19) and libcachesim_runs_at("S3FIFO", 20) and libcachesim_runs_at("Sieve", 1)
