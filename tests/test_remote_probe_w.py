"""probeW's findings on the shared remote tier: lossy blocks published as exact (W1), a prefix
longer than the view (W2), a read started after the master froze (W4), a lookup that got no
answer (W5), a put Mooncake answered but did not store (W6). Fake clients need no Mooncake;
the live tests start a master on loopback (stopped by its pid) and skip without Mooncake."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from remote_helpers import freeze, open_store, remote_config, require_mooncake
from store_helpers import LAYOUT, blocks
from tiercache.config import Codec, RemoteConfig, TierConfig
from tiercache.data import remote as remote_module
from tiercache.data.remote import RemoteStore, layout_tag
from tiercache.data.remote_master import start_master
from tiercache.keys import prefix_keys
from tiercache.live.remote import lossy_codec

BT = LAYOUT.block_tokens


class _Store:
    """A fake client's master: the names it holds (shared by every client of it)."""

    def __init__(self) -> None:
        self.names: set[str] = set()


class _Client:
    """A client of ``master``; with ``lost_puts`` its puts answer 0 (written) but store
    nothing, as Mooncake answers for a name a killed writer's unfinished put still holds."""

    def __init__(self, master: _Store, lost_puts: bool = False) -> None:
        self.master, self.lost_puts = master, lost_puts

    def setup(self, *args) -> int:
        return 0

    def register_buffer(self, pointer: int, size: int) -> int:
        return 0

    def batch_is_exist(self, names):
        return [int(n in self.master.names) for n in names]

    def batch_put_from_multi_buffers(self, names, pointers, sizes):
        if not self.lost_puts:
            self.master.names.update(names)
        return [0] * len(names)

    def close(self) -> int:
        return 0


@pytest.fixture
def answering(monkeypatch):
    """The fake clients' master answers the setup probe."""
    monkeypatch.setattr(remote_module, "servers_answer", lambda config: True)


def _fake_store(client, codec: Codec = Codec.NONE) -> RemoteStore:
    config = RemoteConfig("127.0.0.1:1", "http://127.0.0.1:1/metadata", timeout_s=0.3, retry_s=60)
    return RemoteStore(config, LAYOUT, client=client, codec=codec)


def _payloads(n: int) -> list[np.ndarray]:
    return [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in range(n)]


# -- W1: values of a store with a quantised tier -------------------------------------------------
def test_the_values_of_a_store_with_a_quantised_tier_carry_its_codec():
    remote = TierConfig("remote", 64, remote=RemoteConfig("127.0.0.1:1", "http://127.0.0.1:1/metadata"))
    assert lossy_codec([TierConfig("hbm", 2), TierConfig("nvme", 4, codec=Codec.INT8), remote]) is Codec.INT8
    assert lossy_codec([TierConfig("hbm", 2), TierConfig("nvme", 4), remote]) is Codec.NONE
    assert len({layout_tag(LAYOUT, codec) for codec in Codec}) == len(Codec)
    assert layout_tag(LAYOUT, Codec.NONE) == layout_tag(LAYOUT)  # plain values keep their names


def test_a_plain_store_never_finds_a_quantised_stores_values(answering):
    keys = prefix_keys(list(range(2 * BT)), BT, "q")
    master = _Store()
    lossy, plain, same = (_fake_store(_Client(master), codec) for codec in (Codec.INT8, Codec.NONE, Codec.INT8))
    try:
        assert lossy.submit_put(keys, _payloads(2)).result(timeout=5) == [True, True]
        assert not plain.exists(keys).any()  # never served as exact KV
        assert same.exists(keys).all()  # shared by the stores that accept INT8's error
    finally:
        for store in (lossy, plain, same):
            store.close()


# -- W6: a put Mooncake answered but did not store -------------------------------------------------
def test_a_put_answered_but_not_stored_is_not_counted_as_written(answering):
    keys = prefix_keys(list(range(3 * BT)), BT, "k")
    remote = _fake_store(_Client(_Store(), lost_puts=True))
    try:
        assert remote.submit_put(keys, _payloads(3)).result(timeout=5) == [False] * 3
        assert (remote.stats["puts"], remote.stats["put_failed"]) == (0, 3)
    finally:
        remote.close()


# -- live: a master on loopback ----------------------------------------------------------------------
@pytest.fixture
def master():
    require_mooncake()
    started = start_master()
    yield started
    os.kill(started.pid, signal.SIGCONT)  # a test that froze it
    started.stop(kill=True)


def _prompt(n_blocks: int, seed: int) -> list[int]:
    return [seed * 100_000 + t for t in range(n_blocks * BT)]


def test_a_prefix_longer_than_the_view_keeps_its_head_in_the_view(master):
    tokens, kv = _prompt(10, 2), blocks(10, 2)
    keys = prefix_keys(tokens, BT, "v")
    config = remote_config(master)
    with open_store(config, hbm=16, dram=4, nvme=0) as a, open_store(config, hbm=16, dram=4, nvme=0, remote=9) as b:
        a.put_tokens(tokens, kv, namespace="v")
        a.wait()
        assert b.match_prefix(tokens, namespace="v") == 9 * BT
        assert b.match_prefix(tokens, namespace="v") == 9 * BT  # its tail does not push its head out
        ids = b._map.ids(keys, register=False)
        b._remote.adopt_present(keys[9:], protect=ids)  # what get_prefix asks (live/reading.py _reachable_ids)
        assert b.match_prefix(tokens, namespace="v") == 9 * BT


def test_a_lookup_without_an_answer_leaves_the_view_alone(master):
    tokens, kv = _prompt(8, 1), blocks(8, 1)
    config = remote_config(master, timeout_s=0.5, retry_s=0.2)
    with open_store(config, hbm=8, dram=4, nvme=0) as a, open_store(config, hbm=2, dram=2, nvme=0) as b:
        a.put_tokens(tokens, kv, namespace="s")
        a.wait()
        assert b.match_prefix(tokens, namespace="s") == len(tokens)
        freeze(master.pid)
        b.match_prefix(tokens, namespace="s")  # its existence check times out
        os.kill(master.pid, signal.SIGCONT)
        stats = b.stats()["remote"]
        assert stats["errors"] >= 1 and stats["stale"] == 0 and stats["adopted"] == 8
        time.sleep(0.3)  # retry_s
        assert b.match_prefix(tokens, namespace="s") == len(tokens)
        assert b.stats()["remote"]["adopted"] == 8  # nothing was dropped, nothing re-adopted


def test_a_read_started_after_the_master_froze_waits_at_most_timeout_s(master):
    tokens, kv = _prompt(8, 1), blocks(8, 1)
    keys = prefix_keys(tokens, BT, "g")
    config = remote_config(master, timeout_s=1.0, retry_s=0.5)
    with open_store(config, hbm=16, dram=4, nvme=0) as a, open_store(config, hbm=4, dram=4, nvme=0) as b:
        a.put_tokens(_prompt(1, 9), blocks(1, 9), namespace="g")
        a.put_tokens(tokens, kv, namespace="g")
        a.wait()
        assert len(b.get_prefix(prefix_keys(_prompt(1, 9), BT, "g"))) == 1  # its pools are registered
        assert b.match_prefix(tokens, namespace="g") == len(tokens)  # the view lists them: no check before the read
        freeze(master.pid)
        started = time.monotonic()
        got = b.get_prefix(keys[:2])
        waited = time.monotonic() - started
        os.kill(master.pid, signal.SIGCONT)
        assert len(got) == 0 and waited < config.timeout_s + 1.0
