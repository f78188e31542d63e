"""The remote tier on a real Mooncake Store (a master on loopback, started per module and
stopped by its pid): sharing across stores and namespaces, prefixes completed from the
remote tier, the write policies, and values corrupted, foreign or removed (a counted miss,
never served). The other fault cases are in ``test_remote_faults.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from remote_helpers import master, open_store, remote_config, require_mooncake  # noqa: F401 (master: a fixture)
from store_helpers import LAYOUT, blocks
from tiercache.config import RemoteWrite
from tiercache.data.remote import value_name
from tiercache.keys import prefix_keys

require_mooncake()

BT = LAYOUT.block_tokens


@pytest.fixture(scope="module")
def pair(master):
    """Two stores on one master, shared by the tests of this module (each its own
    namespace): closing a Mooncake client takes it 1-2 s."""
    with open_store(remote_config(master)) as a, open_store(remote_config(master)) as b:
        yield a, b


def prompt(n_blocks: int, seed: int = 0) -> list[int]:
    return [seed * 100_000 + t for t in range(n_blocks * BT)]


def test_blocks_put_by_one_store_are_found_and_read_bit_identical_by_another(pair):
    a, b = pair
    kv, tokens = blocks(12, seed=1), prompt(12)
    a.put_tokens(tokens, kv, namespace="tenant-a")
    a.wait()
    hits = b.stats()["tiers"][-1]["hits"]
    assert b.match_prefix(tokens, namespace="tenant-a") == len(tokens)
    assert b.match_prefix(tokens, namespace="tenant-b") == 0  # another namespace finds nothing
    assert b.match_prefix(tokens[: 5 * BT] + [-1] * BT, namespace="tenant-a") == 5 * BT
    assert torch.equal(b.get(prefix_keys(tokens, BT, "tenant-a")), kv)
    assert b.stats()["tiers"][-1]["hits"] == hits + 12  # every block came from the remote tier
    a.check_invariants(), b.check_invariants()


def test_a_prefix_partly_local_is_completed_from_the_remote_tier(pair):
    a, b = pair
    kv, tokens = blocks(6, seed=2), prompt(6, seed=2)
    keys = prefix_keys(tokens, BT, "ns")
    a.put_tokens(tokens, kv, namespace="ns")
    a.wait()
    b.put_tokens(tokens[: 2 * BT], kv[:2], namespace="ns")  # b holds the first two itself
    exists_before = b.stats()["remote"]["exists_calls"]
    assert b.match_prefix(tokens, namespace="ns") == len(tokens)
    assert b.stats()["remote"]["exists_calls"] == exists_before + 1  # one batched check
    assert torch.equal(b.get_prefix(keys), kv)
    b.check_invariants()


@pytest.mark.parametrize("write", list(RemoteWrite))
def test_write_policies_decide_when_others_see_a_block(master, pair, write):
    b = pair[1]
    kv, tokens = blocks(2, seed=3), prompt(2, seed=3 + len(write.value))
    keys = prefix_keys(tokens, BT, "w")
    with open_store(remote_config(master, write=write, write_hits=2), hbm=2, dram=2, nvme=0) as a:
        a.put_tokens(tokens, kv, namespace="w")
        a.wait()
        assert b.match_prefix(tokens, namespace="w") == (len(tokens) if write is RemoteWrite.THROUGH else 0)
        a.get(keys), a.get(keys)  # two local hits: selective publishes now
        a.wait()
        assert b.match_prefix(tokens, namespace="w") == (0 if write is RemoteWrite.BACK else len(tokens))
        a.put(prefix_keys(prompt(5, seed=99), BT, f"other-{write.value}"), blocks(5, seed=4))  # pushes both out of a
        a.wait()
        assert b.match_prefix(tokens, namespace="w") == len(tokens)  # every policy has written them now
        assert torch.equal(b.get(keys), kv)
        a.check_invariants()


def _overwrite(client, name: str, value: bytes) -> None:
    client.remove(name, True)
    assert client.put(name, value) == 0


@pytest.mark.parametrize("damage", ["garbage", "one_bit", "foreign_size", "removed"])
def test_a_corrupt_foreign_or_lost_value_is_a_counted_miss_never_served(pair, damage):
    a, b = pair
    kv, tokens = blocks(4, seed=5), prompt(4, seed=50 + sum(damage.encode()))  # a prompt of its own per case
    keys = prefix_keys(tokens, BT, "c")
    a.put_tokens(tokens, kv, namespace="c")
    a.wait()
    client, name = a._media[-1].client, value_name(a._media[-1].tag, keys[2])
    value = bytearray(client.get(name))
    if damage == "garbage":
        _overwrite(client, name, os.urandom(len(value)))
    elif damage == "one_bit":
        value[-7] ^= 0x10
        _overwrite(client, name, bytes(value))
    elif damage == "foreign_size":
        _overwrite(client, name, bytes(value[:100]))
    else:
        client.remove(name, True)
    before = dict(b.stats()["remote"])
    found = b.match_prefix(tokens, namespace="c")  # no exception; a damaged value still exists
    assert found == (2 * BT if damage == "removed" else 4 * BT)
    got = b.get_prefix(keys)
    assert len(got) == 2 and torch.equal(got, kv[:2])  # the prefix ends before the bad value
    with pytest.raises(KeyError):
        b.get(keys)  # get of a block that proved unreadable says so, as for a corrupt NVMe chunk
    after = b.stats()["remote"]
    if damage != "removed":  # a removed value is already a miss at the lookup (one exists check)
        assert after["corrupt"] > before["corrupt"]  # counted as what it was (another size: truncated)
    b.check_invariants()


def test_remote_serve_prints_the_addresses_and_stops_its_master_on_sigterm():
    command = "import sys; from tiercache.cli import main; sys.exit(main(['remote-serve', '--json']))"
    serve = subprocess.Popen([sys.executable, "-c", command], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        printed = json.loads(serve.stdout.readline())
        assert set(printed) == {"master", "metadata", "pid"}
        addresses = SimpleNamespace(master=printed["master"], metadata=printed["metadata"])
        with open_store(remote_config(addresses)) as a:
            a.put_tokens(prompt(2, seed=13), blocks(2, seed=13), namespace="serve")
            a.wait()
            assert a.stats()["remote"]["puts"] == 2  # a client reached the master it printed
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=20)
        with pytest.raises(ProcessLookupError):
            os.kill(printed["pid"], 0)  # stopped and reaped by remote-serve on its way out
    finally:
        if serve.poll() is None:
            serve.kill()



def test_one_buffer_and_two_buffer_values_are_the_same_bytes(pair):
    """A pool with header room sends ``[header | block]`` as one buffer; a store without it
    sends the header and the block as two: the value is the same either way, so each reads
    what the other wrote, bit for bit, and a damaged one-buffer value is still refused."""
    import numpy as np

    from tiercache.data.pools import HEADER_ROOM, BlockPool

    remote = pair[0]._media[-1]
    padded = BlockPool(LAYOUT, 4, "cpu", header_room=HEADER_ROOM)
    plain = np.zeros((2, LAYOUT.block_bytes), np.uint8)
    remote.register(padded.host_buffer)
    remote.register(plain)
    data = blocks(4, seed=9)
    padded.write(range(4), data)
    expected = [data[i].contiguous().view(torch.uint8).reshape(-1).numpy().copy() for i in range(4)]
    slot = lambda s: padded.view(s).view(torch.uint8).reshape(-1).numpy()  # noqa: E731
    heads = lambda *slots: [padded.header(s) for s in slots]  # noqa: E731
    one, two = [b"one-buffer-%05d" % i for i in range(2)], [b"two-buffer-%05d" % i for i in range(2)]
    assert remote.submit_put(one, [slot(0), slot(1)], headers=heads(0, 1)).result() == [True, True]
    assert remote.submit_put(two, [slot(2), slot(3)]).result() == [True, True]
    assert remote.submit_get(one, [plain[0], plain[1]]).result() == [True, True]  # a two-buffer reader
    assert np.array_equal(plain[0], expected[0]) and np.array_equal(plain[1], expected[1])
    assert remote.submit_get(two, [slot(0), slot(1)], headers=heads(0, 1)).result() == [True, True]  # a one-buffer reader
    assert np.array_equal(slot(0), expected[2]) and np.array_equal(slot(1), expected[3])
    name = value_name(remote.tag, one[1])
    value = bytearray(remote.client.get(name))
    value[-3] ^= 0x01
    _overwrite(remote.client, name, bytes(value))
    corrupt = remote.stats["corrupt"]
    assert remote.submit_get(one, [slot(2), slot(3)], headers=heads(2, 3)).result() == [True, False]
    assert remote.stats["corrupt"] == corrupt + 1
    remote.client.batch_remove([value_name(remote.tag, k) for k in one + two], True)


def test_a_header_right_before_its_block_makes_one_buffer_per_value():
    """Where every header lies right before its payload the call moves one buffer per value
    (header + block); anywhere else, two (a header row and the block)."""
    import numpy as np

    from tiercache.data.pools import HEADER_BYTES, HEADER_ROOM, BlockPool
    from tiercache.data.remote_values import header_rows as _header_rows, transfer_call as _transfer_call

    calls = []
    client = SimpleNamespace(batch_get_into=lambda n, p, z: calls.append(("one", z)),
                             batch_get_into_multi_buffers=lambda n, p, z: calls.append(("two", z)))
    padded = BlockPool(LAYOUT, 2, "cpu", header_room=HEADER_ROOM)
    payloads = [padded.view(s).view(torch.uint8).reshape(-1).numpy() for s in range(2)]
    rows = np.zeros((2, HEADER_BYTES), np.uint8)
    _transfer_call("get", ["a", "b"], _header_rows([padded.header(0), padded.header(1)], rows, payloads), payloads)(client)
    _transfer_call("get", ["a", "b"], _header_rows([padded.header(1), padded.header(0)], rows, payloads), payloads)(client)
    _transfer_call("get", ["a", "b"], _header_rows(None, rows, payloads), payloads)(client)
    size = HEADER_BYTES + LAYOUT.block_bytes
    assert calls == [("one", [size, size]), ("two", [[HEADER_BYTES, LAYOUT.block_bytes]] * 2),
                     ("two", [[HEADER_BYTES, LAYOUT.block_bytes]] * 2)]


def test_back_to_back_puts_publish_every_block_under_through(master, pair):
    """Local tiers of 2 + 2 blocks and puts of 24 blocks with no wait between them: the
    previous put's publishing copies pin DRAM, so HBM's victims found no room below and were
    dropped, neither local nor published (half the prompts lost 22 of 24 blocks, counted
    nowhere). Now the demotion waits for those copies to land first."""
    _, reader = pair
    with open_store(remote_config(master), hbm=2, dram=2, nvme=0) as writer:
        prompts = [prompt(24, seed=40 + s) for s in range(4)]
        for tokens in prompts:
            writer.put_tokens(tokens, blocks(24, seed=tokens[0] % 97), namespace="back-to-back")
        writer.wait()
        assert writer.stats()["tiers"][0]["evictions"] == 0  # every HBM victim went down, none dropped
        for tokens in prompts:
            assert reader.match_prefix(tokens, namespace="back-to-back") == len(tokens)
        writer.check_invariants()


def test_remote_serve_stops_its_master_on_sighup_and_refuses_a_taken_port():
    """A closed terminal (SIGHUP) left mooncake_master running; a port another server held
    printed the success line, then the master died on bind and the command exited 1 silently."""
    import socket

    command = "import sys; from tiercache.cli import main; sys.exit(main(sys.argv[1:]))"
    serve = subprocess.Popen([sys.executable, "-c", command, "remote-serve", "--json"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        printed = json.loads(serve.stdout.readline())
        serve.send_signal(signal.SIGHUP)
        serve.wait(timeout=20)
        with pytest.raises(ProcessLookupError):
            os.kill(printed["pid"], 0)
    finally:
        if serve.poll() is None:
            serve.kill()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused = subprocess.run([sys.executable, "-c", command, "remote-serve", "--rpc-port", str(port)],
                                 capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and f"--rpc-port {port}: cannot listen there" in refused.stderr


def test_a_store_dropped_without_close_ends_its_threads_and_client(master):
    """Probe Q53: a store with a remote tier dropped without ``close`` kept its four worker
    threads and its Mooncake client (about 25 native threads and 11 fds per store): an idle
    worker still referenced its last call, a bound method of the remote medium, so the
    medium was never collected. It is now, and its finalizer closes it (ResourceWarning)."""
    import gc
    import threading
    import time
    import warnings

    def ours() -> int:
        return sum(1 for t in threading.enumerate() if t.name.startswith("tiercache-remote"))

    before = ours()
    store = open_store(remote_config(master))
    store.put([bytes([7]) * 16], blocks(1, 3))
    store.wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del store
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) and "dropped without close" in str(w.message) for w in caught)
    deadline = time.monotonic() + 30
    while ours() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ours() == before


def test_a_process_exits_with_a_remote_store_still_open(master, tmp_path):
    """Review R32: a store still referenced at exit (a module global never closed) ran its
    finalizer during interpreter shutdown, whose thread start waits forever on Python 3.11:
    the process hung. The finalizer now leaves the client to Mooncake's exit handler then."""
    child = tmp_path / "child.py"
    child.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "from remote_helpers import open_store, remote_config\n"
        "from store_helpers import blocks\n"
        "from types import SimpleNamespace\n"
        "store = open_store(remote_config(SimpleNamespace(master=sys.argv[1], metadata=sys.argv[2])))\n"
        "store.put([bytes([7]) * 16], blocks(1, 3))\n"
        "store.wait()\n"
        "print('exiting', flush=True)\n", encoding="utf-8")
    done = subprocess.run([sys.executable, str(child), master.master, master.metadata], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "exiting" in done.stdout, done.stderr[-2000:]
