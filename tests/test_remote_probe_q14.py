"""Probe Q14's findings on the shared remote tier: a segment below Mooncake's 16 MiB minimum
(and how often a failed setup is retried), a view full of a prompt's tail that never adopted
its head again, THROUGH publications lost in an outage, a read without an answer counted as
``stale``, and ``remote-serve`` stopped during its startup wait. Fake clients and a fake master
need no Mooncake; the live tests start a master on loopback (stopped by its pid) and skip
without Mooncake."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from remote_helpers import freeze, open_store, remote_config, require_mooncake
from store_helpers import LAYOUT, blocks
from tiercache.config import RemoteConfig
from tiercache.data import remote as remote_module
from tiercache.data.nvme_results import ReadIOError
from tiercache.data.remote import RemoteStore, value_name
from tiercache.errors import ConfigError
from tiercache.keys import prefix_keys

BT = LAYOUT.block_tokens
_DEAD = ("127.0.0.1:1", "http://127.0.0.1:1/metadata")


def _prompt(n_blocks: int, seed: int) -> list[int]:
    return [seed * 100_000 + t for t in range(n_blocks * BT)]


# -- 1: segment_bytes below Mooncake's minimum; pacing of failed setups ----------------------------
def test_a_segment_below_mooncakes_16_mib_minimum_is_refused_naming_the_field():
    for size in (1, 8 << 20, (16 << 20) - 1):
        with pytest.raises(ConfigError) as refused:
            RemoteConfig(*_DEAD, segment_bytes=size)
        message = str(refused.value)
        assert "RemoteConfig.segment_bytes" in message and "16 MiB" in message and repr(size) in message
    assert RemoteConfig(*_DEAD, segment_bytes=0).segment_bytes == 0  # no segment: reads and writes others' memory
    assert RemoteConfig(*_DEAD, segment_bytes=16 << 20).segment_bytes == 16 << 20


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _RefusingClient:
    """A client whose setup always fails, as Mooncake's does for a config it refuses; tearing
    a failed client down takes ``teardown_s`` of the clock (Mooncake's destructor holds the
    GIL for about 1 s: the whole process waits)."""

    setups = 0

    def __init__(self, clock: _Clock, teardown_s: float) -> None:
        self.clock, self.teardown_s, self.set_up = clock, teardown_s, False

    def setup(self, *args) -> int:
        type(self).setups += 1
        self.set_up = True
        return -600

    def __del__(self) -> None:
        if self.set_up:
            self.clock.now += self.teardown_s


def test_a_failed_setup_is_retried_once_per_retry_s_after_its_teardown(monkeypatch):
    """retry_s counts from the end of a failed setup's teardown (which freezes the process),
    so every retry_s the process runs retry_s unfrozen, whatever a teardown costs."""
    clock = _Clock()
    monkeypatch.setattr(remote_module, "servers_answer", lambda config: True)
    monkeypatch.setattr(remote_module, "load_client", lambda: _RefusingClient(clock, teardown_s=5.0))
    monkeypatch.setattr(_RefusingClient, "setups", 0)
    config = RemoteConfig(*_DEAD, timeout_s=0.3, retry_s=2.0)
    remote = RemoteStore(config, LAYOUT, clock=clock)
    keys = prefix_keys(_prompt(2, 1), BT, "s")
    try:
        assert _RefusingClient.setups == 1 and clock.now == 5.0
        for _ in range(5):  # remote calls while no retry_s passed since the teardown: no setup
            assert remote.present(keys) is None
            remote._connecting.result(timeout=5)
        assert _RefusingClient.setups == 1 and remote.stats["errors"] == 1
        clock.now += config.retry_s
        assert remote.present(keys) is None  # this one starts the retry (in the background)
        remote._connecting.result(timeout=5)
        assert _RefusingClient.setups == 2 and remote.stats["errors"] == 2 and remote.breaker.down
    finally:
        remote.close()


# -- live: a master on loopback ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def master():
    require_mooncake()
    from tiercache.data.remote_master import start_master

    started = start_master()
    yield started
    os.kill(started.pid, signal.SIGCONT)  # a test that froze it
    started.stop(kill=True)


def _thaw(master, *stores) -> None:
    """Lets a frozen master run again and waits until the calls it left hanging returned and
    ``retry_s`` passed: the stores' next remote call is then tried."""
    os.kill(master.pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    for store in stores:
        breaker = store._media[-1].breaker
        while breaker.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert breaker.in_flight == 0, "a call to the thawed master never returned"
    time.sleep(max(s._media[-1].config.retry_s for s in stores))


def _remove_value(store, key: bytes) -> None:
    """Removes ``key``'s value from the shared store, as Mooncake's eviction does."""
    remote = store._media[-1]
    assert remote.client.remove(value_name(remote.tag, key), True) == 0


def _put_value(store, key: bytes, block: torch.Tensor) -> None:
    """Writes ``key``'s value into the shared store (another prefill node publishing it)."""
    remote = store._media[-1]
    row = remote.take_rows(1)[0]
    try:
        remote.row_block(row, block.dtype).copy_(block)
        assert remote.submit_put([key], [remote.staging[row]]).result(timeout=10) == [True]
    finally:
        remote.give_rows([row])


def test_a_view_full_of_a_prompts_tail_adopts_its_head_again(master):
    """A prompt longer than the view: once the store lost its head block, reads never fill
    the view with its tail, and a lookup adopts the head again once it is back, letting go
    of the prompt's own tail entries to make room."""
    n, view = 12, 8
    tokens, kv = _prompt(n, 3), blocks(n, 3)
    keys = prefix_keys(tokens, BT, "tail")
    config = remote_config(master)
    with open_store(config, hbm=2, dram=2, nvme=0) as prefill, open_store(config, hbm=2, dram=2, nvme=0, remote=view) as decode:
        prefill.put_tokens(tokens, kv, namespace="tail")
        prefill.wait()
        assert decode.match_prefix(tokens, namespace="tail") == view * BT
        _remove_value(prefill, keys[0])
        for _ in range(2):
            assert len(decode.get_prefix(keys)) == 0  # the head is gone: nothing to serve
        assert decode.stats()["remote"]["adopted"] == view  # no tail block adopted past the missing head
        assert decode.lookup(keys[1:])[0] == view  # the view is full of the prompt's tail now (blocks 1..8)
        _put_value(prefill, keys[0], kv[0])  # a prefill node publishes the head again
        assert decode.match_prefix(tokens, namespace="tail") == view * BT
        assert torch.equal(decode.get_prefix(keys), kv[:view])
        assert [t is not None for t in decode.lookup(keys)[1]] == [True] * view + [False] * (n - view)
        decode.check_invariants()


def test_publications_that_failed_in_an_outage_are_published_once_the_master_answers(master):
    """THROUGH: blocks stored while the master was frozen are published at the next put (or
    get, or flush) after retry_s, counted in ``republished``."""
    config = remote_config(master, timeout_s=0.5, retry_s=0.2)
    a_tokens, a_kv = _prompt(6, 4), blocks(6, 4)
    with open_store(config, hbm=4, dram=4, nvme=0) as prefill, open_store(config, hbm=2, dram=2, nvme=0) as decode:
        freeze(master.pid)
        try:
            assert prefill.put_tokens(a_tokens, a_kv, namespace="out") == 6  # local placement goes on
            prefill.wait()
        finally:
            _thaw(master, prefill)
        assert (prefill.stats()["remote"]["puts"], prefill.stats()["remote"]["put_failed"]) == (0, 6)
        assert prefill.put_tokens(a_tokens, a_kv, namespace="out") == 0  # nothing new: the retry runs here
        prefill.wait()
        assert decode.match_prefix(a_tokens, namespace="out") == len(a_tokens)
        assert torch.equal(decode.get_prefix(prefix_keys(a_tokens, BT, "out")), a_kv)
        stats = prefill.stats()["remote"]
        assert (stats["republished"], stats["puts"], stats["unpublished"]) == (6, 6, 0)


def test_a_block_that_left_the_local_tiers_in_an_outage_is_never_published(master):
    """The retry (here at a flush) publishes only what the local tiers still hold: a block
    pushed out meanwhile (its write-back failed too) is gone, never published."""
    config = remote_config(master, timeout_s=0.5, retry_s=0.2)
    b_tokens, b_kv, c_tokens, c_kv = _prompt(4, 5), blocks(4, 5), _prompt(2, 6), blocks(2, 6)
    keys = prefix_keys(b_tokens, BT, "out") + prefix_keys(c_tokens, BT, "out")
    with open_store(config, hbm=2, dram=2, nvme=0) as prefill, open_store(config, hbm=2, dram=2, nvme=0) as decode:
        freeze(master.pid)
        try:
            prefill.put_tokens(b_tokens, b_kv, namespace="out")
            prefill.put_tokens(c_tokens, c_kv, namespace="out")  # pushes some of b out (their write-back fails)
            prefill.wait()
        finally:
            _thaw(master, prefill)
        local = [k for k, tier in zip(keys, prefill.lookup(keys)[1]) if tier in ("hbm", "dram")]
        assert 0 < len(local) < len(keys)
        prefill.flush()  # the retry runs here
        prefill.wait()
        found = [k for k, there in zip(keys, decode._media[-1].exists(keys).tolist()) if there]
        assert found == local  # what left prefill's local tiers was never published
        assert torch.equal(decode.get(found), torch.cat([b_kv, c_kv])[[keys.index(k) for k in found]])
        assert prefill.stats()["remote"]["republished"] == len(local)


class _OutageClient:
    """A client whose master, while ``down``, answers every call with Mooncake's RPC error
    (the store learns nothing); puts land in ``names``."""

    def __init__(self) -> None:
        self.down, self.names = False, set()

    def setup(self, *args) -> int:
        return 0

    def register_buffer(self, pointer: int, size: int) -> int:
        return 0

    def batch_is_exist(self, names):
        return [-900] * len(names) if self.down else [int(n in self.names) for n in names]

    def batch_put_from(self, names, pointers, sizes):
        if self.down:
            return [-900] * len(names)
        self.names.update(names)
        return [0] * len(names)

    def close(self) -> int:
        return 0


def test_a_selective_publication_the_store_did_not_answer_is_published_at_the_next_read(monkeypatch):
    from tiercache.config import RemoteWrite, TierConfig
    from tiercache.live.store import TieredKVStore

    client = _OutageClient()
    monkeypatch.setattr(remote_module, "servers_answer", lambda config: True)
    monkeypatch.setattr(remote_module, "load_client", lambda: client)
    config = RemoteConfig(*_DEAD, write=RemoteWrite.SELECTIVE, write_hits=2, timeout_s=0.5, retry_s=0)
    tiers = [TierConfig("hbm", 4), TierConfig("dram", 4), TierConfig("remote", 16, remote=config)]
    keys = prefix_keys(_prompt(3, 8), BT, "sel")
    with TieredKVStore(LAYOUT, tiers, device="cpu") as store:
        assert store.put(keys, blocks(3, 8)) == 3
        client.down = True
        for _ in range(2):  # the second hit publishes them: the store does not answer
            store.get(keys)
            store.wait()
        before = store.stats()["remote"]
        assert (before["puts"], before["put_failed"], client.names) == (0, 3, set())
        client.down = False
        assert torch.equal(store.get(keys), blocks(3, 8))  # the retry runs here
        store.wait()
        assert client.names == {value_name(store._media[-1].tag, k) for k in keys}
        after = store.stats()["remote"]
        assert (before["unpublished"], after["unpublished"], after["republished"], after["puts"]) == (3, 0, 3, 3)


def test_a_read_the_master_does_not_answer_is_an_error_and_keeps_the_view_entry(master):
    """A get of a view entry while the master is frozen raises ReadIOError (a KeyError)
    naming the block and saying the remote store did not answer; nothing is dropped or
    counted ``stale``, and the block is served once the master answers."""
    config = remote_config(master, timeout_s=0.5, retry_s=0.2)
    tokens, kv = _prompt(4, 7), blocks(4, 7)
    keys = prefix_keys(tokens, BT, "na")
    with open_store(config, hbm=4, dram=4, nvme=0) as prefill, open_store(config, hbm=2, dram=2, nvme=0) as decode:
        prefill.put_tokens(tokens, kv, namespace="na")
        prefill.wait()
        assert decode.match_prefix(tokens, namespace="na") == len(tokens)
        freeze(master.pid)
        try:
            with pytest.raises(ReadIOError) as failed:
                decode.get([keys[2]])
            assert isinstance(failed.value, KeyError)
            assert keys[2].hex() in str(failed.value) and "did not answer" in str(failed.value)
            assert len(decode.get_prefix(keys)) == 0
            stats = decode.stats()["remote"]
            assert stats["stale"] == 0 and stats["errors"] >= 1
        finally:
            _thaw(master, decode)
        assert torch.equal(decode.get_prefix(keys), kv)
        stats = decode.stats()["remote"]
        assert (stats["stale"], stats["adopted"]) == (0, len(keys))  # nothing was dropped, nothing adopted again
        decode.check_invariants()


# -- 5: remote-serve stopped during its startup wait -------------------------------------------------
_FAKE_MASTER = textwrap.dedent("""\
    #!{python}
    # Listens on its RPC port only, so the launcher's readiness wait never ends; once the launcher's
    # first probe connected (it is past starting this process), writes its pid to {pidfile}.
    import os, socket, sys, time
    options = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    server = socket.create_server((options["rpc_address"], int(options["rpc_port"])))
    server.accept()
    with open({pidfile!r} + ".tmp", "w") as out:
        out.write(str(os.getpid()))
    os.rename({pidfile!r} + ".tmp", {pidfile!r})
    time.sleep(120)
""")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_remote_serve_stopped_during_its_startup_wait_stops_the_master(tmp_path, sig, code):
    pidfile = tmp_path / "master.pid"
    fake = tmp_path / "mooncake_master"
    fake.write_text(_FAKE_MASTER.format(python=sys.executable, pidfile=str(pidfile)))
    fake.chmod(0o755)
    command = ("import sys; import tiercache.data.remote_master as m; m.find_master = lambda: sys.argv[1]; "
               "from tiercache.cli import main; sys.exit(main(['remote-serve', '--json']))")
    serve = subprocess.Popen([sys.executable, "-c", command, str(fake)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = None
    try:
        deadline = time.monotonic() + 30
        while not pidfile.exists() and serve.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        pid = int(pidfile.read_text())
        serve.send_signal(sig)
        out, err = serve.communicate(timeout=30)
        assert out == ""  # stopped before it announced anything
        assert serve.returncode == code, err
        assert not _running(pid), f"the master (pid {pid}) outlived remote-serve"
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        if pid is not None and _running(pid):
            os.kill(pid, signal.SIGKILL)
