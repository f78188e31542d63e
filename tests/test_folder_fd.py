"""The NVMe store writes every file relative to the folder its lock holds open, so a folder
replaced between ``check_folder`` and a write (a clean-up script racing a put or a flush)
never takes the old store's files: review carry-over of Q69, where ``check_folder`` checked by
stat on the path and the writes then went by that path."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tiercache.data.nvme import NVMeStore

from store_helpers import LAYOUT, blocks, cache_with_a_replaced_folder, key


def _race_past_the_check(monkeypatch) -> None:
    """The replacement happens right after every ``check_folder``: the check passes."""
    monkeypatch.setattr(NVMeStore, "check_folder", lambda self: None)


def _files(path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


def test_a_put_and_flush_racing_a_replaced_folder_leave_the_new_stores_files_alone(tmp_path, monkeypatch):
    path = tmp_path / "store"
    first = NVMeStore(path, LAYOUT, capacity_blocks=16, overwrite_in_place=False)
    first.put([key(i) for i in range(4)], blocks(4, 1))
    first.flush()
    shutil.rmtree(path)
    path.mkdir()  # the same name, another folder
    second = NVMeStore(path, LAYOUT, capacity_blocks=16)
    data = blocks(8, 2)
    assert all(r.ok for r in second.put([key(100 + i) for i in range(8)], data))
    second.flush()
    before = _files(path)
    _race_past_the_check(monkeypatch)
    results = first.put([key(10 + i) for i in range(8)], blocks(8, 3))
    assert not any(r.ok for r in results)  # the old folder is gone: nothing to write in
    assert all(r.error.filename.startswith(str(path)) for r in results)  # named by path, as before
    first.delete([key(0), key(1)])
    first.flush()  # its journal is the old folder's (held open); a snapshot would be too
    first.close()  # and so would its clean mark
    assert _files(path) == before  # no chunk, snapshot, journal or clean mark of the first
    out = torch.empty_like(data)
    assert all(second.get([key(100 + i) for i in range(8)], out))
    assert torch.equal(out, data)
    second.close()


def test_a_store_whose_folder_was_moved_away_keeps_writing_and_reading_its_own_folder(tmp_path, monkeypatch):
    path, moved = tmp_path / "store", tmp_path / "moved"
    store = NVMeStore(path, LAYOUT, capacity_blocks=16, overwrite_in_place=False)
    old, new = blocks(4, 4), blocks(4, 5)
    store.put([key(i) for i in range(4)], old)
    store.flush()
    os.rename(path, moved)
    path.mkdir()  # an empty folder under the old name
    _race_past_the_check(monkeypatch)
    assert all(r.ok for r in store.put([key(10 + i) for i in range(4)], new))
    out = torch.empty_like(old)
    assert all(store.get([key(i) for i in range(4)], out)) and torch.equal(out, old)
    store.close()
    assert os.listdir(path) == []  # nothing written by the old name
    with NVMeStore(moved, LAYOUT) as reopened:  # every block, durable, where the store was
        assert len(reopened) == 8
        out = torch.empty_like(new)
        assert all(reopened.get([key(10 + i) for i in range(4)], out)) and torch.equal(out, new)


def test_a_cache_racing_a_replaced_folder_at_close_leaves_the_new_stores_order_file_alone(tmp_path, monkeypatch):
    first, path, reopen = cache_with_a_replaced_folder(tmp_path)
    before = _files(path)
    _race_past_the_check(monkeypatch)
    with pytest.warns(UserWarning, match="could not be written"):  # its order list: the old folder is gone
        try:
            first.close()
        except OSError:
            pass  # its persist found its folder gone: what it says is another test's
    assert _files(path) == before
    with reopen() as reopened:
        assert reopened.match_prefix(list(range(500, 541)), namespace="ns") == 40
