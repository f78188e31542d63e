"""A victim that leaves for a remote tier already holding it crosses no link: ``bytes_moved``
into the remote tier equals the blocks actually put there (a real Mooncake master on loopback)."""

from __future__ import annotations

import pytest

from remote_helpers import master, open_store, remote_config, require_mooncake  # noqa: F401 (master: a fixture)
from store_helpers import LAYOUT, blocks
from tiercache.config import RemoteWrite
from tiercache.keys import prefix_keys

require_mooncake()

BT = LAYOUT.block_tokens


def test_victims_the_remote_tier_already_holds_are_not_charged_again(master):
    with open_store(remote_config(master, write=RemoteWrite.THROUGH), hbm=2, dram=2, nvme=0) as store:
        store.put_tokens(list(range(4 * BT)), blocks(4, seed=1), namespace="x")  # written through: 4 puts
        store.wait()
        store.put(prefix_keys([10**6 + t for t in range(5 * BT)], BT, "y"), blocks(5, seed=2))  # pushes the 4 out
        store.wait()
        stats = store.stats()
        into_remote = sum(n for link, n in stats["bytes_moved"].items() if link.endswith("->remote"))
        assert into_remote == stats["remote"]["puts"] * LAYOUT.block_bytes
        held = stats["shared_already_held"]
        assert sum(held.values()) >= 4 and all(link.endswith("->remote") for link in held)
        demoted_to_remote = sum(t["demotions"] for t in stats["tiers"][:-1])
        assert demoted_to_remote >= sum(held.values())  # still counted as demotions


@pytest.mark.parametrize("write", [RemoteWrite.THROUGH, RemoteWrite.BACK])
def test_blocks_another_store_already_put_are_not_charged(master, write):
    tokens, kv = list(range(6 * BT)), blocks(6, seed=3)
    config = remote_config(master, write=write)
    with open_store(config, hbm=2, dram=2, nvme=0) as a, open_store(config, hbm=2, dram=2, nvme=0) as b:
        a.put_tokens(tokens, kv, namespace=f"both-{write.value}")
        a.wait()
        b.put_tokens(tokens, kv, namespace=f"both-{write.value}")  # b never looked them up: its puts find them there
        b.wait()
        stats = b.stats()
        into_remote = sum(n for link, n in stats["bytes_moved"].items() if link.endswith("->remote"))
        assert stats["remote"]["puts"] == 0 and stats["remote"]["already"] > 0
        assert into_remote == 0
        assert sum(stats["shared_already_held"].values()) == stats["remote"]["already"]
