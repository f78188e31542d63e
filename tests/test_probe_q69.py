"""Probe Q69 findings (NVMe path on tmpfs, ramfs without O_DIRECT, ext2/ext4, overlayfs,
4K-sector disks, bind mounts, read-only and immutable folders: all worked or were refused at
open): a store whose folder was removed, or removed and made anew (a clean-up script), went
on writing by the old path. A second store opened in the new folder (its lock is there), the
two overwrote each other's chunks and the second lost blocks (checksums caught every one);
alone, the first's ``flush`` reported success with nothing durable anywhere."""

from __future__ import annotations

import errno
import shutil

import pytest
import torch

from tiercache.data.nvme import NVMeStore
from tiercache.errors import UserError

from store_helpers import LAYOUT, blocks, cache_with_a_replaced_folder, key


def test_a_replaced_folder_takes_no_write_of_the_old_store_and_its_flush_fails(tmp_path):
    path = tmp_path / "store"
    first = NVMeStore(path, LAYOUT, capacity_blocks=32)
    first.put([key(i) for i in range(4)], blocks(4, 1))
    first.flush()
    shutil.rmtree(path)
    path.mkdir()  # the same name, another folder
    second = NVMeStore(path, LAYOUT, capacity_blocks=32)  # its lock is in the new folder: it opens
    data = blocks(12, 2)
    assert all(r.ok for r in second.put([key(100 + i) for i in range(12)], data))
    with pytest.warns(RuntimeWarning, match="the store's folder was replaced since it was opened"):  # once
        results = first.put([key(10 + i) for i in range(12)], blocks(12, 3))
    assert not any(r.ok for r in results)  # refused: they would have landed on the second's slots
    assert results[0].error.errno == errno.ESTALE and "was replaced since it was opened" in str(results[0].error)
    with pytest.raises(OSError, match="was replaced since it was opened"):
        first.flush()
    assert first.stats["failed_flushes"] == 1
    second.flush()
    out = torch.empty_like(data)
    second.get([key(100 + i) for i in range(12)], out)
    assert torch.equal(out, data)  # every block of the second intact
    second.close()
    with pytest.raises(OSError):
        first.close()
    with NVMeStore(path, LAYOUT, capacity_blocks=32) as reopened:
        assert len(reopened) == 12


def test_a_removed_folder_makes_a_flush_fail_even_with_nothing_pending(tmp_path):
    path = tmp_path / "store"
    store = NVMeStore(path, LAYOUT, capacity_blocks=8)
    store.put([key(0)], blocks(1, 4))
    store.flush()
    shutil.rmtree(path)
    with pytest.warns(RuntimeWarning, match="the store's folder is gone"):
        assert not store.put([key(1)], blocks(1, 5))[0].ok
    with pytest.raises(OSError, match="the store's folder is gone"):
        store.flush()  # it said the blocks were durable
    with pytest.raises((OSError, UserError)):
        store.close()


def test_a_dangling_symlink_is_named_as_one(tmp_path):
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "missing")
    with pytest.raises(UserError, match=r"dangling: is a symbolic link to '.*missing', which does not exist"):
        NVMeStore(link, LAYOUT, capacity_blocks=8)


def test_a_symlink_loop_is_named_as_one(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(UserError, match=r"a: is a symbolic link to '.*b', a loop of symbolic links"):
        NVMeStore(tmp_path / "a", LAYOUT, capacity_blocks=8)


def test_a_tier_that_cannot_open_names_the_file_that_failed(tmp_path, monkeypatch):
    from store_helpers import tiers
    from tiercache.data import nvme
    from tiercache.live.store import TieredKVStore

    def too_long(*args, **kwargs):
        raise OSError(errno.ENAMETOOLONG, "File name too long", str(tmp_path / "nvme" / ("e" * 300) / "zarr.json"))

    monkeypatch.setattr(nvme.NVMeStore, "__init__", too_long)
    with pytest.raises(UserError, match=r"cannot open the nvme tier at .*: File name too long \(.*zarr\.json\)"):
        TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme", device="cpu")


@pytest.mark.filterwarnings("ignore:NVMeStore:RuntimeWarning")  # the first cache's persisting writes, refused
def test_a_cache_whose_folder_was_replaced_leaves_the_new_stores_order_file_alone(tmp_path):
    """Review R36: the order file was written by path at close, over the second cache's."""
    first, path, reopen = cache_with_a_replaced_folder(tmp_path)
    order = (path / "tiercache.order").read_bytes()
    with pytest.warns(UserWarning, match="the order a smaller reopen keeps blocks in is not written"):
        with pytest.raises(OSError, match="replaced since it was opened"):
            first.close()
    assert (path / "tiercache.order").read_bytes() == order
    with reopen() as reopened:
        assert reopened.match_prefix(list(range(500, 541)), namespace="ns") == 40
