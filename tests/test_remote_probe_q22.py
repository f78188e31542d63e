"""The live store's write-through against probe Q22 (finding 2), on a real Mooncake Store.

``TieredKVStore.put`` publishes its new blocks with ``TierManager.publish``, which asked the
remote tier (the view) for room for all of them at once: a put of more new blocks than the
view holds published none (another store matched 0 tokens of it). Now the head is
published, as many blocks as the view can take, first blocks first.
"""

from __future__ import annotations

import remote_helpers
from remote_helpers import open_store, remote_config, require_mooncake
from store_helpers import LAYOUT, blocks

require_mooncake()

master = remote_helpers.master  # the module's Mooncake master (a fixture, by this name)

BT = LAYOUT.block_tokens


def test_a_put_of_more_new_blocks_than_the_remote_tier_holds_publishes_its_head(master):
    tokens = list(range(6 * BT))
    with open_store(remote_config(master), hbm=8, dram=8, nvme=0, remote=4) as writer, \
            open_store(remote_config(master)) as reader:
        assert writer.put_tokens(tokens, blocks(6, seed=22), namespace="q22") == 6  # all stored locally
        writer.wait()
        assert writer.stats()["remote"]["publish_queued"] == 4  # the view's capacity, first blocks first
        assert reader.match_prefix(tokens, namespace="q22") == 4 * BT
        writer.check_invariants(), reader.check_invariants()
