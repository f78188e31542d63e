"""Probe q45 of the remote tier under faults: a read of view entries that serves nothing
(a frozen master, a value lost) counts misses, never remote hits or bytes read in place; a
publisher whose published copies the store lost (a master restarted on the same ports)
writes them again when it puts them again."""

from __future__ import annotations

import os
import signal
import time

from remote_helpers import freeze, open_store, remote_config, require_mooncake
from store_helpers import LAYOUT, blocks
from tiercache.config import RemoteWrite
from tiercache.keys import prefix_keys

require_mooncake()

from tiercache.data.remote_master import start_master  # noqa: E402

BT = LAYOUT.block_tokens


def test_unserved_reads_count_misses_and_a_restarted_masters_values_are_put_again():
    tokens, kv = list(range(4 * BT)), blocks(4, 1)
    keys = prefix_keys(tokens, BT, "ns")
    master, restarted = start_master(), None
    try:
        config = remote_config(master, RemoteWrite.THROUGH, retry_s=0.3, timeout_s=1.0)
        publisher, reader = open_store(config, hbm=8, dram=8, nvme=0), open_store(config, hbm=8, dram=8, nvme=0)
        publisher.put_tokens(tokens, kv, namespace="ns")
        publisher.wait()
        reader.lookup(keys)  # known through the view only
        before = reader.stats()
        freeze(master.pid)
        assert reader.get_prefix(keys).shape[0] == 0
        after = reader.stats()
        assert after["tiers"][-1]["hits"] == before["tiers"][-1]["hits"] and after["hits"] == before["hits"]
        assert after["tiers"][-1]["in_place_bytes"] == before["tiers"][-1]["in_place_bytes"]
        assert after["misses"] == before["misses"] + 4
        os.kill(master.pid, signal.SIGCONT)
        master.stop(kill=True)
        restarted = start_master(ports=(master.rpc_port, master.metadata_port, master.metrics_port))
        puts = publisher.stats()["remote"]["puts"]
        for _ in range(40):  # until the clients mounted their segments with the new master again
            publisher.put_tokens(tokens, kv, namespace="ns")
            publisher.wait()
            if publisher.stats()["remote"]["puts"] > puts:
                break
            time.sleep(0.25)
        assert publisher.stats()["remote"]["puts"] == puts + 4  # its published copies were gone: written again
        with open_store(remote_config(restarted, RemoteWrite.THROUGH), hbm=8, dram=8, nvme=0) as other:
            assert other.match_prefix(tokens, namespace="ns") == len(tokens)
        for store in (publisher, reader):
            store.close()
    finally:
        if master.process.poll() is None:
            os.kill(master.pid, signal.SIGCONT)
        master.stop(kill=True)
        if restarted is not None:
            restarted.stop()
