"""probeC's findings on the shared remote tier: the layout tag (F3), damaged values and puts
of names already there (F4), the publish counter (F5), and a master that stops answering
(F1 close, F2 open, F6 write-back). Fake clients need no Mooncake; the live tests start a
master on loopback (stopped by its pid) and skip without Mooncake."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
import torch

from store_helpers import LAYOUT, blocks
from tiercache.config import KVLayout, RemoteConfig, RemoteWrite
from tiercache.data import remote as remote_module
from tiercache.data.remote import ALREADY_THERE, RemoteStore, layout_tag, value_name
from tiercache.data.remote_guard import Breaker, abandoned_count
from tiercache.data.remote_master import free_port, servers_answer
from tiercache.keys import prefix_keys

BT = LAYOUT.block_tokens


# -- F3: the layout tag ---------------------------------------------------------------------
def test_the_layout_tag_covers_layers_per_layer_and_the_model():
    base = KVLayout(layers=4, kv_heads=2, head_dim=64, dtype="float16", block_tokens=64, per_layer=True, name="a")
    others = [KVLayout(2, 2, 64, "float16", 64, True, "a"),  # the same block shape: only the layer count differs
              KVLayout(4, 2, 64, "float16", 64, False, "a"), KVLayout(4, 2, 64, "float16", 64, True, "b"),
              KVLayout(4, 2, 64, "bfloat16", 64, True, "a"), KVLayout(4, 2, 64, "float16", 32, True, "a"),
              KVLayout(4, 1, 64, "float16", 64, True, "a"), KVLayout(4, 2, 32, "float16", 64, True, "a")]
    assert others[0].block_shape == base.block_shape
    tags = {layout_tag(layout) for layout in others}
    assert len(tags) == len(others) and layout_tag(base) not in tags
    assert layout_tag(KVLayout(4, 2, 64, "float16", 64, True, "a")) == layout_tag(base)


# -- fakes ------------------------------------------------------------------------------------
class _Client:
    """A client whose master holds ``names``; with ``hang`` set, every lookup and put waits
    until ``release`` (a master that stopped answering)."""

    def __init__(self, names=(), hang: bool = False) -> None:
        self.names, self.hang = set(names), hang
        self.release, self.calls, self.put_names, self.removed, self.closed = threading.Event(), 0, [], [], False

    def setup(self, *args) -> int:
        return 0

    def register_buffer(self, pointer: int, size: int) -> int:
        return 0

    def _wait(self) -> None:
        self.calls += 1
        if self.hang:
            self.release.wait(30)

    def batch_is_exist(self, names):
        self._wait()
        return [int(n in self.names) for n in names]

    def batch_put_from_multi_buffers(self, names, pointers, sizes):
        self._wait()
        self.put_names += names
        self.names.update(names)  # what a put wrote is there afterwards (RemoteStore checks)
        return [0] * len(names)

    def batch_get_into_multi_buffers(self, names, pointers, sizes):  # values of the right size, zero headers
        return [sum(s) for s in sizes]

    def batch_remove(self, names, force=False):
        self.removed += names
        return [0] * len(names)

    def close(self) -> int:
        self.closed = True
        return 0


@pytest.fixture
def answering(monkeypatch):
    """The fake clients' master answers the setup probe."""
    monkeypatch.setattr(remote_module, "servers_answer", lambda config: True)


def _store(client, timeout_s: float = 0.3, retry_s: float = 60) -> RemoteStore:
    config = RemoteConfig("127.0.0.1:1", "http://127.0.0.1:1/metadata", timeout_s=timeout_s, retry_s=retry_s)
    return RemoteStore(config, LAYOUT, client=client)


def _payloads(n: int) -> list[np.ndarray]:
    return [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in range(n)]


# -- F4: puts of names already there; damaged values ---------------------------------------------
def test_a_put_of_a_name_already_there_is_not_counted_as_written(answering):
    keys = prefix_keys(list(range(2 * BT)), BT, "p")
    client = _Client()
    remote = _store(client)
    client.names.add(value_name(remote.tag, keys[0]))
    try:
        answers = remote.submit_put(keys, _payloads(2)).result(timeout=5)
        assert answers == [ALREADY_THERE, True] and all(answers)  # both are in the store, the first was there
        assert client.put_names == [value_name(remote.tag, keys[1])]  # only the missing one was written
        assert (remote.stats["puts"], remote.stats["already"], remote.stats["put_failed"]) == (1, 1, 0)
    finally:
        remote.close()


def test_a_value_that_fails_verification_is_removed(answering):
    keys = prefix_keys(list(range(2 * BT)), BT, "c")
    client = _Client()
    remote = _store(client)
    client.names.update(value_name(remote.tag, k) for k in keys)  # there, so read (and found damaged)
    try:
        assert remote.submit_get(keys, _payloads(2)).result(timeout=5) == [False, False]
        assert client.removed == [value_name(remote.tag, k) for k in keys]
        assert remote.stats["corrupt"] == 2 and remote.stats["removed"] == 2
    finally:
        remote.close()


# -- F6, F1: a master that stops answering ---------------------------------------------------------
def test_the_breaker_stays_open_while_a_failed_call_still_hangs():
    now = [0.0]
    breaker = Breaker(1.0, clock=lambda: now[0])
    breaker.enter()  # a call starts and hangs
    breaker.failed()  # its waiter gave up
    now[0] = 5.0
    assert not breaker.allow() and breaker.down  # retry_s passed, but the call still hangs
    breaker.leave()
    assert breaker.allow()  # now the next call is the probe
    breaker.enter()
    assert not breaker.allow()  # one probe at a time
    breaker.succeeded()
    assert breaker.allow() and not breaker.down  # a closed breaker never limits concurrency
    breaker.leave()


def test_puts_to_a_master_that_hangs_return_within_timeout_and_then_are_skipped(answering):
    client = _Client(hang=True)
    remote = _store(client, timeout_s=0.3, retry_s=0.05)
    keys = prefix_keys(list(range(4 * BT)), BT, "h")
    try:
        start = time.monotonic()
        assert remote.submit_put(keys[:2], _payloads(2)).result(timeout=5) == [False, False]
        assert time.monotonic() - start < 2  # the existence check timed out: nothing was put
        time.sleep(0.2)  # past retry_s, while the first call still hangs
        start = time.monotonic()
        assert remote.submit_put(keys[2:], _payloads(2)).result(timeout=5) == [False, False]
        assert time.monotonic() - start < 0.2 and client.calls == 1  # skipped, not hung again
        assert remote.stats["put_failed"] == 4 and remote.stats["puts"] == 0 and remote.breaker.down
    finally:
        client.release.set()
        remote.close()


def test_close_never_waits_on_a_master_that_hangs(answering):
    client = _Client(hang=True)
    remote = _store(client, timeout_s=0.3)
    before = abandoned_count()
    start = time.monotonic()
    remote.close()
    assert time.monotonic() - start < 2
    assert not client.closed and remote.stats["abandoned"] == 1  # Mooncake's close would freeze the process
    assert abandoned_count() == before + 1  # what a caller checks to skip Mooncake's exit teardown
    client.release.set()


def test_close_closes_the_client_of_a_master_that_answers(answering):
    client = _Client()
    remote, before = _store(client), abandoned_count()
    remote.close()
    assert abandoned_count() == before
    deadline = time.monotonic() + 5
    while not client.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.closed and remote.stats["abandoned"] == 0


# -- F2: a server that accepts but never answers -----------------------------------------------
def _close_each_connection(listener: socket.socket) -> None:
    while True:
        try:
            listener.accept()[0].close()
        except OSError:
            return


def test_servers_answer_needs_an_answer_not_just_an_accepted_connection():
    silent, live = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_close_each_connection, args=(live,), daemon=True).start()
    s, a = silent.getsockname()[1], live.getsockname()[1]
    try:
        start = time.monotonic()
        assert not servers_answer(RemoteConfig(f"127.0.0.1:{s}", f"http://127.0.0.1:{a}/metadata", timeout_s=0.3))
        assert not servers_answer(RemoteConfig(f"127.0.0.1:{a}", f"http://127.0.0.1:{s}/metadata", timeout_s=0.3))
        assert time.monotonic() - start < 2
        assert servers_answer(RemoteConfig(f"127.0.0.1:{a}", f"http://127.0.0.1:{a}/metadata", timeout_s=0.3))
        assert not servers_answer(RemoteConfig(f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{a}/metadata", timeout_s=0.3))
    finally:
        silent.close(), live.close()


def test_a_store_is_never_set_up_against_a_silent_listener():
    client, silent = _Client(), socket.create_server(("127.0.0.1", 0))
    port = silent.getsockname()[1]
    config = RemoteConfig(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}/metadata", timeout_s=0.3, retry_s=60)
    setups = []
    client.setup = lambda *args: setups.append(args) or 0  # Mooncake's would hold the GIL for ~10 min
    try:
        start = time.monotonic()
        remote = RemoteStore(config, LAYOUT, client=client)
        time.sleep(0.5)  # the background probe has given up by now
        assert time.monotonic() - start < 2 and not setups and remote.client is None
        assert remote.stats["errors"] == 1 and remote.breaker.down
        remote.close()
    finally:
        silent.close()


# -- live: a Mooncake master on loopback ---------------------------------------------------------
@pytest.fixture(scope="module")
def master():
    from remote_helpers import require_mooncake
    from tiercache.data.remote_master import start_master

    require_mooncake()
    started = start_master()
    yield started
    started.stop()


def test_a_2_layer_model_never_reads_a_4_layer_models_blocks(master):
    from remote_helpers import open_store, remote_config

    four = KVLayout(layers=4, kv_heads=2, head_dim=32, dtype="float16", block_tokens=16, per_layer=True, name="four")
    two = KVLayout(layers=2, kv_heads=2, head_dim=32, dtype="float16", block_tokens=16, per_layer=True, name="two")
    tokens = list(range(4 * 16))
    with open_store(remote_config(master), layout=four, nvme=0) as a, open_store(remote_config(master), layout=two, nvme=0) as b:
        a.put_tokens(tokens, torch.randn(4, *four.block_shape).half(), namespace="shared")
        a.wait()
        assert a.stats()["remote"]["puts"] > 0 and a.match_prefix(tokens, namespace="shared") == len(tokens)
        assert b.match_prefix(tokens, namespace="shared") == 0


def test_a_damaged_value_is_removed_by_its_reader_and_written_again_by_the_next_publisher(master):
    from remote_helpers import open_store, remote_config

    kv, tokens = blocks(4, seed=31), list(range(500_000, 500_000 + 4 * BT))
    keys = prefix_keys(tokens, BT, "dmg")
    with open_store(remote_config(master), hbm=8, dram=8, nvme=0) as a, \
            open_store(remote_config(master), hbm=8, dram=8, nvme=0) as b:
        a.put_tokens(tokens, kv, namespace="dmg")
        a.wait()
        client, name = a._media[-1].client, value_name(a._media[-1].tag, keys[0])
        good = client.get(name)
        damaged = bytearray(good)
        damaged[-5] ^= 1
        client.remove(name, True)
        assert client.put(name, bytes(damaged)) == 0
        assert len(b.get_prefix(keys)) == 0  # the damaged first block ends the prefix
        assert b.stats()["remote"]["corrupt"] == 1 and b.stats()["remote"]["removed"] == 1
        b.put_tokens(tokens, kv, namespace="dmg")  # b computes the lost block itself and publishes it
        b.wait()
        stats = b.stats()["remote"]
        # the put publishes its prefix from the first block b's view does not list (r16): the
        # lost block is written; the other three, which only b's view listed, are stored locally
        # from the put's bytes and leave the view (review R18: an entry nobody checked), so they
        # are published again and found already held (nothing read up: probe q26)
        assert (stats["puts"], stats["already"], stats["publish_queued"]) == (1, 3, 4)
        assert "published" not in stats  # it counted publications started, not values written
        assert client.get(name) == good  # the store holds the good value again


@pytest.mark.parametrize("size", ["100 bytes", "1 short", "64 short", "64 long"])
def test_a_truncated_or_oversized_value_is_removed_by_its_reader(master, size):
    """Read through staging rows (header and block in two buffers, as for NVMe and GPU
    blocks), Mooncake fails a get of a value shorter or longer than the buffers with the
    codes of a holder that is gone; the reader asks its size, counts it corrupt and removes
    it, so the next publisher writes a good value (it stayed for good before)."""
    from remote_helpers import remote_config
    from tiercache.data.remote import RemoteStore

    a, b = RemoteStore(remote_config(master), LAYOUT), RemoteStore(remote_config(master), LAYOUT)
    try:
        key, row = os.urandom(16), a.take_rows(1)[0]
        a.staging[row][:] = np.arange(a.staging[row].size, dtype=np.uint8)
        assert a.submit_put([key], [a.staging[row]]).result() == [True]
        name = value_name(a.tag, key)
        good = a.client.get(name)
        a.client.remove(name, True)
        bad = {"100 bytes": good[:100], "1 short": good[:-1], "64 short": good[:-64], "64 long": good + bytes(64)}[size]
        assert a.client.put(name, bytes(bad)) == 0
        row_b = b.take_rows(1)[0]
        assert b.submit_get([key], [b.staging[row_b]]).result() == [False]
        assert (b.stats["corrupt"], b.stats["removed"]) == (1, 1)
        assert not a.client.is_exist(name)
        assert a.submit_put([key], [a.staging[row]]).result() == [True]
        assert a.client.get(name) == good
    finally:
        a.close()
        b.close()


def test_write_back_to_a_frozen_master_never_blocks_local_placement_or_close():
    from remote_helpers import freeze, open_store, remote_config, require_mooncake
    from tiercache.data.remote_master import start_master

    require_mooncake()
    own = start_master()
    layout = KVLayout(layers=2, kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)
    try:
        a = open_store(remote_config(own, write=RemoteWrite.BACK, timeout_s=0.5, retry_s=0.5), layout=layout,
                       hbm=2, dram=2, nvme=0)
        a.put_tokens(list(range(64)), torch.randn(4, *layout.block_shape).half(), namespace="w")
        a.wait()
        freeze(own.pid)  # a master host that hangs: it still accepts, never answers
        for i in range(3):
            tokens, kv = [10**6 * (i + 1) + t for t in range(64)], torch.randn(4, *layout.block_shape).half()
            start = time.monotonic()
            assert a.put_tokens(tokens, kv, namespace="w") == 4
            assert time.monotonic() - start < 3  # 72 s each before: a hung demotion blocked the placement
            assert torch.equal(a.get(prefix_keys(tokens, 16, "w")), kv)
            time.sleep(0.6)  # past retry_s: a hung call still keeps the breaker open
        assert a.stats()["remote"]["skipped"] > 0
        medium, start = a._media[-1], time.monotonic()
        a.close()
        assert time.monotonic() - start < 3 and medium.stats["abandoned"] == 1
    finally:
        os.kill(own.pid, signal.SIGCONT)
        own.stop(kill=True)
