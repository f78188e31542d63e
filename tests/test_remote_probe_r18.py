"""Review R18 finding 1: a ``put`` of blocks only the remote tier's view listed (published by
another store) treated them as stored and only touched the view entries, so when the store
had lost the values the caller's bytes were thrown away: put returned 0 new, published
nothing, and the next read dropped the stale entries and lost the blocks. The put holds the
bytes: such blocks are stored locally from them, and ``through`` publishes them again."""

from __future__ import annotations

import remote_helpers
from remote_helpers import open_store, remote_config, require_mooncake
from store_helpers import LAYOUT, blocks
from tiercache.data.remote import value_name
from tiercache.keys import prefix_keys

require_mooncake()

BT = LAYOUT.block_tokens
master = remote_helpers.master  # the module's Mooncake master (a fixture, by this name)


def test_a_put_of_blocks_only_a_stale_remote_view_lists_stores_them_from_its_bytes_and_publishes_them_again(master):
    kv, tokens = blocks(4, seed=7), list(range(700_000, 700_000 + 4 * BT))
    keys = prefix_keys(tokens, BT, "stale")
    with open_store(remote_config(master), hbm=8, dram=8, nvme=0) as a, \
            open_store(remote_config(master), hbm=8, dram=8, nvme=0) as b:
        a.put_tokens(tokens, kv, namespace="stale")
        a.wait()
        assert b.lookup(keys) == (4, ["remote"] * 4)  # b's view adopts the 4 published blocks
        client = a._media[-1].client
        for k in keys:  # the store loses the values (its eviction, a reader removing a damaged one)
            client.remove(value_name(a._media[-1].tag, k), True)
        assert b.put_tokens(tokens, kv, namespace="stale") == 4  # new here: no local copy held them
        b.wait()
        assert b.lookup(keys) == (4, ["hbm"] * 4)
        assert b.match_prefix(tokens, namespace="stale") == len(tokens)
        assert b.get(keys).equal(kv)
        stats = b.stats()
        assert (stats["refreshes"], stats["hits"], stats["misses"]) == (0, 4, 0)  # a put is no read
        assert (stats["remote"]["puts"], stats["remote"]["stale"]) == (4, 0)  # published again
        assert all(client.get(value_name(a._media[-1].tag, k)) for k in keys)  # the store holds them again
        b.check_invariants()
