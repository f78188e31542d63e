"""Probe Q81 on the live store (330k random operations against a plain model, 80 SIGKILLs and
30k concurrent calls held; these did not):

- Q81-1: an NVMe folder whose creation did not finish (only ``zarr.json``: a creation killed,
  or one out of memory for its index) was finished at its recorded capacity whatever the tier
  asked for, so a failed huge creation left a folder no capacity could open.
- Q81-2: out of memory for the NVMe tier's index was named as its blocks' disk bytes.
- Q81-3: ``close(persist=None)`` or ``persist="no"`` was read as a choice.
- Q81-4: a numpy integer capacity was refused.
- Q81-5: a bad namespace's TypeError did not name the call.
"""

from __future__ import annotations

import numpy as np
import pytest

from tiercache import TieredKVStore
from tiercache.config import TierConfig
from tiercache.data import nvme_open
from tiercache.data.nvme import NVMeStore
from tiercache.errors import UserError

from store_helpers import LAYOUT, blocks, key


def test_an_unfinished_creation_is_created_anew_at_the_tiers_capacity(tmp_path):
    NVMeStore(tmp_path / "done", LAYOUT, capacity_blocks=100).close()
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "zarr.json").write_bytes((tmp_path / "done" / "zarr.json").read_bytes())  # a killed creation's
    with TieredKVStore(LAYOUT, [TierConfig("hbm", 2), TierConfig("nvme", 1000)], path=tmp_path / "s", device="cpu") as store:
        assert store.put([key(0)], blocks(1, 1)) == 1
    with NVMeStore(tmp_path / "s", LAYOUT) as nvme:
        assert nvme.capacity == 1125  # the tier's 1000 and its spare slots, not the 100 recorded


def test_a_creation_out_of_memory_for_its_index_leaves_no_array_and_says_so(tmp_path, monkeypatch):
    def no_memory(capacity):
        raise MemoryError

    monkeypatch.setattr(nvme_open, "SlotTable", no_memory)
    tiers = [TierConfig("hbm", 2), TierConfig("nvme", 1000)]
    with pytest.raises(UserError, match=r"cannot allocate the nvme tier's index of 1,125 slots \(0\.0 GiB of memory\): "
                                        r"MemoryError$"):
        TieredKVStore(LAYOUT, tiers, path=tmp_path / "s", device="cpu")
    assert not (tmp_path / "s" / "zarr.json").exists()
    monkeypatch.undo()
    with TieredKVStore(LAYOUT, [TierConfig("hbm", 2), TierConfig("nvme", 10)], path=tmp_path / "s", device="cpu"):
        pass  # opens at any capacity afterwards


@pytest.mark.parametrize("flag", [None, "no", [], 0.0])
def test_close_refuses_a_persist_flag_that_is_no_bool(tmp_path, flag):
    store = TieredKVStore(LAYOUT, [TierConfig("hbm", 2), TierConfig("nvme", 8)], path=tmp_path / "s", device="cpu")
    store.put([key(0)], blocks(1, 1))
    with pytest.raises(UserError, match=r"^TieredKVStore\.close: persist must be True or False, got "):
        store.close(persist=flag)
    assert store.close() == 1  # still open: the refused call changed nothing


def test_a_numpy_integer_capacity_is_taken():
    tier = TierConfig("dram", np.int64(64))
    assert tier.capacity_blocks == 64 and type(tier.capacity_blocks) is int


@pytest.mark.parametrize("call", ["put_tokens", "match_prefix"])
def test_a_bad_namespace_names_the_call(tmp_path, call):
    with TieredKVStore(LAYOUT, [TierConfig("hbm", 4)], device="cpu") as store:
        args = ([1] * LAYOUT.block_tokens, blocks(1, 1)) if call == "put_tokens" else ([1] * LAYOUT.block_tokens,)
        with pytest.raises(TypeError, match=rf"^TieredKVStore\.{call}: namespace must be bytes or str, got int$"):
            getattr(store, call)(*args, namespace=5)
