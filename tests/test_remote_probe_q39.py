"""Probe Q39, finding 1: a ``put`` larger than the local tiers of blocks this store knew only
through its remote view, whose values the store had since lost (their publisher closed, taking
its segment), lost the first blocks of the call: inserting the call's blocks pushed its head out
of NVMe, and the way out to the shared tier trusted the unchecked view entries, dropping the
local copy without a write (put returned 7 of 12; ``get`` raised KeyError on them for good), and
``through`` then published the tail without its head. The view entries now leave the view before
the insert (``TierManager._store_fresh_run``): what cascades out is written like any new block."""

from __future__ import annotations

import pytest

import remote_helpers
from remote_helpers import open_store, remote_config, require_mooncake
from store_helpers import LAYOUT, blocks
from tiercache.config import RemoteWrite
from tiercache.data.remote import value_name
from tiercache.keys import prefix_keys

require_mooncake()

BT = LAYOUT.block_tokens
master = remote_helpers.master  # the module's Mooncake master (a fixture, by this name)


def _stored_remotely(store, keys) -> list[bool]:
    medium = store._media[-1]
    return [bool(medium.client.is_exist(value_name(medium.tag, k))) for k in keys]


@pytest.mark.parametrize("write", [RemoteWrite.THROUGH, RemoteWrite.BACK])
def test_a_put_larger_than_the_local_tiers_over_a_stale_view_keeps_every_block(master, write):
    n = 12
    kv, tokens = blocks(n, seed=39), list(range(390_000, 390_000 + n * BT))
    keys = prefix_keys(tokens, BT, f"q39-{write.value}")
    with open_store(remote_config(master), hbm=8, dram=8, nvme=0) as a, \
            open_store(remote_config(master, write), hbm=2, dram=2, nvme=3) as b:  # 7 local slots
        a.put_tokens(tokens, kv, namespace=f"q39-{write.value}")
        a.wait()
        assert b.lookup(keys) == (n, ["remote"] * n)  # b knows them only through its view
        client, tag = a._media[-1].client, a._media[-1].tag
        for k in keys:  # the store loses the values (the publisher closed, an eviction)
            client.remove(value_name(tag, k), True)
        assert b.put_tokens(tokens, kv, namespace=f"q39-{write.value}") == n
        b.wait()
        b.check_invariants()
        assert all(tier is not None for tier in b.lookup(keys)[1])
        for i, k in enumerate(keys):  # one at a time: each read is checked against its own bytes
            assert b.get([k])[0].equal(kv[i]), i
        assert all(_stored_remotely(b, keys[:5]))  # the head pushed out went to the store, written
        assert b.get_prefix(keys).equal(kv)
        b.check_invariants()


def test_a_refused_put_leaves_a_readers_pinned_view_entries_in_the_view(master):
    """Review R23 of that fix: the entries left the view before the insert even where a reader
    had pinned them; with HBM full of pinned blocks the insert was refused, so the pinned blocks
    were in no tier (``check_invariants`` failed, ``release`` raised KeyError)."""
    kv, tokens = blocks(4, seed=23), list(range(230_000, 230_000 + 4 * BT))
    keys = prefix_keys(tokens, BT, "r23")
    other_kv, other_tokens = blocks(2, seed=24), list(range(240_000, 240_000 + 2 * BT))
    other = prefix_keys(other_tokens, BT, "r23-other")
    with open_store(remote_config(master), hbm=8, dram=8, nvme=0) as a, \
            open_store(remote_config(master), hbm=2, dram=2, nvme=0) as b:
        a.put_tokens(tokens, kv, namespace="r23")
        a.wait()
        b.put_tokens(other_tokens, other_kv, namespace="r23-other")
        b.wait()
        b.pin(other)  # HBM full of pinned blocks: an insert there is refused
        assert b.lookup(keys) == (4, ["remote"] * 4)
        b.pin(keys[:2])  # a reader pins two view entries
        assert b.put_tokens(tokens, kv, namespace="r23") == 0
        b.wait()
        b.check_invariants()
        assert b.lookup(keys[:2])[1] == ["remote", "remote"]
        b.release(keys[:2])
        b.release(other)
        for i, k in enumerate(keys):
            assert b.get([k])[0].equal(kv[i]), i
        b.check_invariants()


def test_a_selective_prefix_read_counts_hits_on_its_head_only(master):
    """Review R23, finding 3: ``get_prefix`` counted hits on every locally held block of the
    keys, past the prefix's first missing block too, so under ``selective`` a read that returned
    nothing published blocks 5 and 7-11, whose parents the store lacked."""
    n = 12
    kv, tokens = blocks(n, seed=25), list(range(250_000, 250_000 + n * BT))
    keys = prefix_keys(tokens, BT, "r23-selective")
    with open_store(remote_config(master), hbm=8, dram=8, nvme=0) as a, \
            open_store(remote_config(master, RemoteWrite.SELECTIVE), hbm=2, dram=2, nvme=3) as b:
        a.put_tokens(tokens, kv, namespace="r23-selective")
        a.wait()
        assert b.lookup(keys) == (n, ["remote"] * n)
        client, tag = a._media[-1].client, a._media[-1].tag
        for k in keys:
            client.remove(value_name(tag, k), True)
        assert b.put_tokens(tokens, kv, namespace="r23-selective") == 7  # selective drops the cold head
        b.wait()
        for _ in range(3):  # each read would count a hit on the held tail (write_hits is 2)
            assert b.get_prefix(keys).shape[0] == 0
        b.wait()
        assert b.stats()["remote"]["puts"] == 0
        assert not any(_stored_remotely(b, keys))
        b.check_invariants()
