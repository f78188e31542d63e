"""Review R47 findings on this session's store and CLI fixes:

- R47-1 (high): ``TieredKVCache.close(persist=None)`` marked the cache closed before the store
  refused the flag, so the next ``close()`` persisted nothing and kept the store locked.
- R47-2: a creation whose journal reset failed (EIO on its fsync) leaked the journal's descriptor.
- R47-3: ``store_exists`` took a folder it could not list for no store; and a creation another
  process finished between that check and the open was refused a capacity it had room for.
  (R48-1: answering True for a folder it cannot list finished an unfinished creation at its
  recorded capacity; it answers None, and the tier's capacity is tried first.)
- R47-4: an open's OSErrors (a full disk, out of descriptors) had become UserErrors, which
  callers telling a failing disk from bad input no longer caught.
- R47-5: Ctrl-C while the lock recorded its holder left the path locked.
- R47-6: a results file that could not be written, beside a standard output that refused the
  tables, was reported as the standard output's error alone.
- R47-7: a bad trace-cache budget refused traces the cache never holds.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest

from tiercache import TieredKVStore
from tiercache.config import TierConfig
from tiercache.data import chunkio, nvme_index, nvme_lock, nvme_open
from tiercache.data.nvme import NVMeStore
from tiercache.errors import UserError
from tiercache.live import media
from tiercache.live.cache import TieredKVCache
from tiercache.sim.tracecache import load_trace_cached

from store_helpers import LAYOUT, blocks, key
from test_cli_stdout_probe_q80 import _FullDisk

DATA = Path(__file__).parent / "data"


def _descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_cache_close_refusing_its_flag_stays_open_and_closes_after(tmp_path):
    tiers = [TierConfig("hbm", 4), TierConfig("dram", 4), TierConfig("nvme", 40)]
    cache = TieredKVCache(LAYOUT, tiers, path=tmp_path / "s", device="cpu")
    with pytest.raises(UserError, match=r"^TieredKVCache\.close: persist must be True or False, got NoneType None$"):
        cache.close(persist=None)
    cache.close()
    NVMeStore(tmp_path / "s", cache.layout).close()  # the lock was released (the cache stores per layer)


def test_a_creation_whose_journal_fails_leaks_no_descriptor(tmp_path, monkeypatch):
    real = os.fsync

    def failing(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(nvme_index.JOURNAL_NAME):
            raise OSError(errno.EIO, "injected EIO")
        return real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    before = _descriptors()
    for n in range(3):
        with pytest.raises((OSError, UserError)):
            NVMeStore(tmp_path / f"s{n}", LAYOUT, capacity_blocks=10)
    assert _descriptors() == before


def _unlistable_once(monkeypatch) -> None:
    """The first listing of a folder by ``store_exists`` fails (EMFILE, or no permission)."""
    real, failed = nvme_open._unfinished_creation, []

    def unlistable(path, dir_fd=None):
        if dir_fd is None and not failed:
            failed.append(path)
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path, dir_fd)

    monkeypatch.setattr(nvme_open, "_unfinished_creation", unlistable)


def test_a_store_whose_folder_could_not_be_listed_opens_at_its_own_capacity(tmp_path, monkeypatch):
    NVMeStore(tmp_path / "s", LAYOUT, capacity_blocks=2000).close()
    _unlistable_once(monkeypatch)
    with TieredKVStore(LAYOUT, [TierConfig("hbm", 2), TierConfig("nvme", 1000)], path=tmp_path / "s", device="cpu") as store:
        assert store.put([key(0)], blocks(1, 1)) == 1


def test_an_unfinished_creation_whose_folder_could_not_be_listed_is_created_at_the_tiers_capacity(tmp_path, monkeypatch):
    """Review R48-1: taken for a store, it was finished at its recorded 16 slots, and every
    later open of the 100-block tier was refused."""
    NVMeStore(tmp_path / "done", LAYOUT, capacity_blocks=16).close()
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "zarr.json").write_bytes((tmp_path / "done" / "zarr.json").read_bytes())
    _unlistable_once(monkeypatch)
    with TieredKVStore(LAYOUT, [TierConfig("hbm", 2), TierConfig("nvme", 100)], path=tmp_path / "s", device="cpu"):
        pass
    with NVMeStore(tmp_path / "s", LAYOUT) as nvme:
        assert nvme.capacity == 112


def test_a_store_created_meanwhile_by_another_process_opens_at_its_own_capacity(tmp_path, monkeypatch):
    NVMeStore(tmp_path / "s", LAYOUT, capacity_blocks=2000).close()  # as the other process left it
    real, calls = media.store_exists, []

    def checked_before_it_finished(path):
        calls.append(path)
        return False if len(calls) == 1 else real(path)

    monkeypatch.setattr(media, "store_exists", checked_before_it_finished)
    with TieredKVStore(LAYOUT, [TierConfig("hbm", 2), TierConfig("nvme", 1000)], path=tmp_path / "s", device="cpu") as store:
        assert store.put([key(0)], blocks(1, 1)) == 1
    assert len(calls) == 2


def test_an_open_failing_on_the_disk_stays_an_oserror_and_releases_the_lock(tmp_path, monkeypatch):
    NVMeStore(tmp_path / "s", LAYOUT, capacity_blocks=10).close()

    def out_of_descriptors(path, dir_fd=None):
        raise OSError(errno.EMFILE, "Too many open files", path)

    monkeypatch.setattr(chunkio, "scan_folder", out_of_descriptors)
    with pytest.raises(OSError) as info:
        NVMeStore(tmp_path / "s", LAYOUT)
    assert not isinstance(info.value, UserError) and info.value.errno == errno.EMFILE
    monkeypatch.undo()
    NVMeStore(tmp_path / "s", LAYOUT).close()


def test_ctrl_c_while_the_holder_is_recorded_releases_the_lock(tmp_path, monkeypatch):
    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(nvme_lock, "_write_holder", interrupted)
    before = _descriptors()
    with pytest.raises(KeyboardInterrupt):
        nvme_lock.StoreLock.acquire(str(tmp_path))
    assert _descriptors() == before
    monkeypatch.undo()
    nvme_lock.StoreLock.acquire(str(tmp_path)).release()


def test_a_results_file_not_written_is_reported_when_stdout_refuses_the_tables_too(tmp_path, monkeypatch, capsys):
    from tiercache.cli import main, replay

    def refused(path, results, option):
        raise UserError(f"{option} {path}: cannot write (File too large)")

    monkeypatch.setattr(replay, "write_results", refused)
    monkeypatch.setattr(sys, "stdout", _FullDisk())
    trace = DATA / "mooncake_head.jsonl"
    assert main(["replay", str(trace), "--capacity", "50", "--no-progress", "--out", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err.endswith("cannot write (File too large)\n")


def test_a_bad_budget_leaves_traces_the_cache_never_holds_alone(monkeypatch):
    monkeypatch.setenv("TIERCACHE_TRACE_CACHE_BYTES", "bogus")
    assert load_trace_cached(DATA / "kvtester_sample").ids.size > 0
