"""TieredKVStore against probe R16 (finding 1): a store written before scratch keys were
tagged (50492af) holds a decode's old scratch blocks under plain keys; a reopen adopted them
as content blocks without a word. Such a store (no ``FORMAT_MARKER``) now warns once, naming
its path, and is marked, so later reopens are quiet."""

from __future__ import annotations

import os
import warnings

import pytest
from store_helpers import LAYOUT, blocks, tiers

from tiercache import TieredKVStore
from tiercache.live.lifecycle import FORMAT_MARKER, UntaggedStoreWarning


def test_reopening_a_store_written_before_the_scratch_tag_warns_once_naming_it(tmp_path):
    keys = [b"plain-key-%06d" % i for i in range(3)]
    with TieredKVStore(LAYOUT, tiers(), path=str(tmp_path), device="cpu") as store:
        store.put(keys, blocks(3, 1))
        nvme_path = store._media[-1].path
    marker = os.path.join(nvme_path, FORMAT_MARKER)
    assert os.path.exists(marker)  # written by a tag-aware version
    os.remove(marker)  # as a store written before the tag
    with pytest.warns(UntaggedStoreWarning, match=f"{nvme_path}: written before scratch keys were tagged; its 3 blocks"):
        with TieredKVStore(LAYOUT, tiers(), path=str(tmp_path), device="cpu") as store:
            assert store.lookup(keys)[0] == 3  # content kept
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntaggedStoreWarning)
        with TieredKVStore(LAYOUT, tiers(), path=str(tmp_path), device="cpu") as store:
            assert store.lookup(keys)[0] == 3
