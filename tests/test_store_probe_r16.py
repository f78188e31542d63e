"""TieredKVStore against probe R16 (finding 3): a user's key ending in ``SCRATCH_TAG`` was
taken by ``put`` and then deleted without a word by close (and by any reopen), as a decode's
scratch block. Every public call taking keys now refuses such a key with a UserError."""

from __future__ import annotations

import pytest
from store_helpers import LAYOUT, blocks, tiers

from tiercache import TieredKVStore
from tiercache.errors import UserError
from tiercache.live.keymap import SCRATCH_TAG


def test_a_user_key_ending_in_the_scratch_tag_is_refused_naming_the_key(tmp_path):
    keys = [b"user-%03d" % i + SCRATCH_TAG for i in range(2)]
    with TieredKVStore(LAYOUT, tiers(), path=str(tmp_path), device="cpu") as store:
        with pytest.raises(UserError, match=r"TieredKVStore.put: keys\[0\] \(" + keys[0].hex() + r"\) ends in SCRATCH_TAG"):
            store.put(keys, blocks(2, 1))
        with pytest.raises(UserError, match=r"TieredKVStore.lookup: keys\[1\]"):
            store.lookup([b"plain-key-000000", keys[1]])
        assert store.put([b"plain-key-000000"], blocks(1, 1)) == 1  # nothing else changed
        store.check_invariants()
