"""Review r26 of the read accounting: a read counts a hit, in the tier that served it, for each
block it served and a miss for each it did not, also with a key repeated in one call."""

from __future__ import annotations

import pytest

from store_helpers import LAYOUT, blocks, key, tiers
from tiercache.live.store import TieredKVStore


def _counts(store):
    stats = store.stats()
    return [t["hits"] for t in stats["tiers"]], [t["hits_in_place"] for t in stats["tiers"]], stats["misses"]


def _store_with_a_corrupt_nvme_block(path):
    store = TieredKVStore(LAYOUT, tiers(hbm=1, dram=1), path=path, device="cpu")
    store.put([key(i) for i in range(8)], blocks(8, 5))
    store.flush()
    on_nvme = [i for i, t in enumerate(store.lookup([key(i) for i in range(8)])[1]) if t == "nvme"]
    medium = store._media[2]
    chunk = medium.chunk_path(medium.slot_of(key(on_nvme[1])))
    raw = bytearray(open(chunk, "rb").read())
    raw[50] ^= 0xFF
    open(chunk, "wb").write(bytes(raw))
    return store, key(on_nvme[0]), key(on_nvme[1])


@pytest.mark.parametrize("read", ["get a a c", "get_prefix a c a", "get_prefix a c"])
def test_a_read_counts_what_it_served_even_with_a_key_repeated(tmp_path, read):
    store, a, c = _store_with_a_corrupt_nvme_block(tmp_path / "nvme")
    with store:
        before = _counts(store)
        method, *names = read.split()
        asked = [{"a": a, "c": c}[n] for n in names]
        if method == "get":
            with pytest.raises(KeyError):
                store.get(asked)
            served = 0
        else:
            served = store.get_prefix(asked).shape[0]
            assert served == 1
        hits, in_place, misses = _counts(store)
        assert sum(hits) - sum(before[0]) == served
        # a get that raises counts its unreadable block a miss; a prefix read, each block it did not serve
        assert misses - before[2] == (1 if method == "get" else len(asked) - served)
        assert all(p - q <= h - g for p, q, h, g in zip(in_place, before[1], hits, before[0]))
        store.check_invariants()
