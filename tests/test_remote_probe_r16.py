"""The live store's write-through against probe R16 (finding 2), on a real Mooncake Store.

A put published the head of its *new* blocks only: after a 6-block prompt whose head 1-4 the
remote tier (view of 4) took, a put of its 8-block extension published blocks 7 and 8,
whose parents 5 and 6 the store lacks, and pushed the head's entries 1 and 2 out of the view
to make room: two puts nobody can reach, and a store near capacity would lose the head.
Now a put publishes, from its first key, the blocks the view lacks up to what fits, never
pushing the call's own view entries out.
"""

from __future__ import annotations

import remote_helpers
from remote_helpers import open_store, remote_config, require_mooncake
from store_helpers import LAYOUT, blocks

from tiercache.keys import key_to_int, prefix_keys

require_mooncake()

master = remote_helpers.master  # the module's Mooncake master (a fixture, by this name)

BT = LAYOUT.block_tokens


def test_extending_a_put_keeps_the_reachable_head_and_publishes_no_unreachable_tail(master):
    tokens = list(range(8 * BT))
    ids = [key_to_int(k) for k in prefix_keys(tokens, BT, "r16")]
    with open_store(remote_config(master), hbm=8, dram=8, nvme=0, remote=4) as writer, \
            open_store(remote_config(master)) as reader:
        assert writer.put_tokens(tokens[: 6 * BT], blocks(6, seed=16), namespace="r16") == 6
        writer.wait()
        assert writer.stats()["remote"]["publish_queued"] == 4
        assert writer.put_tokens(tokens, blocks(8, seed=16), namespace="r16") == 2
        writer.wait()
        assert writer.stats()["remote"]["publish_queued"] == 4  # 5-8 would push the head out: none written
        view = writer.manager.dirs[-1].slot_of
        assert [n + 1 for n, b in enumerate(ids) if b in view] == [1, 2, 3, 4]
        assert reader.match_prefix(tokens, namespace="r16") == 4 * BT
        writer.check_invariants(), reader.check_invariants()
