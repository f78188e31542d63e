"""Review R45 findings on the NVMe open through the locked folder (6f500ae) and the fork
grace of the store lock (391f721):

- R45-1: a store file that is a folder (``zarr.json``, the index, the journal, the clean mark)
  leaked a descriptor per refused open (``open(fd)`` does not close a folder's descriptor).
- R45-2: Ctrl-C while an acquire waited for a forked child's copy leaked the folder's
  descriptor; an acquire made with ``_RELEASING`` already held (a signal handler) slept with it.
- R45-4: errors through the folder descriptor ended in "-> None"; a scan's named ".".
- R45-5: the O_DIRECT probe went by path after the open.
- R45-6: ``create_array`` replaced an array already there.
- R45-7 (older): a load failing after the journal was opened (EIO cutting its torn tail)
  leaked the journal's descriptor and raised a raw OSError.
"""

from __future__ import annotations

import errno
import os

import pytest

from tiercache.data import chunkio, nvme_lock
from tiercache.data.nvme import NVMeStore
from tiercache.errors import UserError

from store_helpers import LAYOUT, blocks, key


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _store(path, n: int = 3, clean: bool = True) -> None:
    store = NVMeStore(path, LAYOUT, capacity_blocks=8)
    store.put([key(i) for i in range(n)], blocks(n, 1))
    if clean:
        store.close()
    else:
        store.flush()
        with pytest.warns(ResourceWarning):
            store.__del__()


@pytest.mark.parametrize("name, clean", [("zarr.json", True), ("tiercache.index", True), ("tiercache.journal", True),
                                         ("tiercache.clean", False)])
def test_a_store_file_that_is_a_folder_is_refused_without_a_leak(tmp_path, name, clean):
    path = tmp_path / "s"
    _store(path, clean=clean)
    if (path / name).exists():
        (path / name).unlink()
    (path / name).mkdir()
    before = _descriptors()
    for _ in range(5):
        with pytest.raises(UserError, match=name.replace(".", r"\.")):
            NVMeStore(path, LAYOUT)
    assert _descriptors() == before


def test_a_failed_cut_of_the_journal_tail_is_a_user_error_and_keeps_the_journal(tmp_path, monkeypatch):
    path = tmp_path / "s"
    _store(path, n=4, clean=False)
    with open(path / "tiercache.journal", "ab") as journal:
        journal.write(b"torn tail")
    real = os.ftruncate

    def failing(fd, length):
        raise OSError(errno.EIO, "injected EIO")

    monkeypatch.setattr(os, "ftruncate", failing)
    before = _descriptors()
    with pytest.raises(UserError, match=r"tiercache\.journal: cannot cut the journal's torn tail \(injected EIO\)"):
        NVMeStore(path, LAYOUT)
    assert _descriptors() == before
    monkeypatch.setattr(os, "ftruncate", real)
    with NVMeStore(path, LAYOUT) as store:
        assert len(store) == 4  # the journal's batches were not cut away with its tail


def test_ctrl_c_while_an_acquire_waits_for_a_forked_copy_leaks_nothing(tmp_path, monkeypatch):
    def held_by_a_fork(root, dir_fd, patient=False):
        raise nvme_lock._ForkedCopy()

    def interrupted(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(nvme_lock, "_lock_file", held_by_a_fork)
    monkeypatch.setattr(nvme_lock.time, "sleep", interrupted)
    before = _descriptors()
    with pytest.raises(KeyboardInterrupt):
        nvme_lock.StoreLock.acquire(str(tmp_path))
    assert _descriptors() == before


def test_an_acquire_made_holding_the_module_lock_never_waits(tmp_path, monkeypatch):
    seen, real = [], nvme_lock._lock_file

    def recording(root, dir_fd, patient=False):
        seen.append(patient)
        return real(root, dir_fd, patient)

    monkeypatch.setattr(nvme_lock, "_lock_file", recording)
    with nvme_lock._RELEASING:  # as a signal handler that interrupted a release would
        nvme_lock.StoreLock.acquire(str(tmp_path)).release()
    nvme_lock.StoreLock.acquire(str(tmp_path)).release()
    assert seen == [False, True]


def test_errors_through_the_folder_descriptor_name_paths_only(tmp_path):
    path = tmp_path / "s"
    _store(path)
    with NVMeStore(path, LAYOUT) as store:
        with pytest.raises(OSError) as info:
            chunkio.unlink(str(path / "absent"), store.folder_fd)
        assert info.value.filename == str(path / "absent") and "-> None" not in str(info.value)


def test_create_array_never_replaces_an_array(tmp_path):
    chunkio.create_array(str(tmp_path / "a"), LAYOUT, 5, None)
    before = (tmp_path / "a" / "zarr.json").read_bytes()
    with pytest.raises(FileExistsError, match="an array is there already"):
        chunkio.create_array(str(tmp_path / "a"), LAYOUT, 3, None)
    assert (tmp_path / "a" / "zarr.json").read_bytes() == before


def test_the_direct_io_probe_goes_through_the_locked_folder(tmp_path, monkeypatch):
    path = tmp_path / "s"
    _store(path)
    probed, real = [], chunkio.supports_direct

    def probe(file, dir_fd=None):
        probed.append(dir_fd)
        return real(file, dir_fd)

    monkeypatch.setattr(chunkio, "supports_direct", probe)
    with NVMeStore(path, LAYOUT, direct_io=True) as store:
        assert probed == [store.folder_fd] and probed[0] is not None


def test_ctrl_c_right_after_the_lock_is_taken_releases_it(tmp_path, monkeypatch):
    class Interrupted(set):
        def add(self, lock):
            super().add(lock)
            raise KeyboardInterrupt  # as a signal landing just after the registration

    monkeypatch.setattr(nvme_lock, "_HELD", Interrupted())
    before = _descriptors()
    with pytest.raises(KeyboardInterrupt):
        nvme_lock.StoreLock.acquire(str(tmp_path))
    assert _descriptors() == before and not nvme_lock._HELD
    monkeypatch.undo()
    nvme_lock.StoreLock.acquire(str(tmp_path)).release()  # nothing kept it locked
