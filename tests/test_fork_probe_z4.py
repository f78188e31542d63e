"""Process boundaries of the live API (probe Z4): a forked child and a copy of a store.

A child forked while a store is open inherits the objects but none of the threads serving
them: it is refused the parent's store at once (never left waiting for an I/O thread that does
not exist), its ``close`` does nothing, and it can open and use a store of its own. A store, a
cache and a sequence refuse to be copied or pickled. An interrupted ``put`` leaves the store's
invariants whole.

Every fork runs in a process of its own, forked from a fresh interpreter that imported
tiercache once (``_run``), under a timeout: a hang fails the test, and the at-fork hooks a
store registers stay out of the test process.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from store_helpers import LAYOUT, blocks, key, tiers
from tiercache.live.cache import TieredKVCache
from tiercache.live.store import TieredKVStore

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

#: Opens ``STORE`` (three tiers, blocks on NVMe) at argv[1] with 20 blocks; ``in_child(work)``
#: runs ``work`` in a forked child and returns what it returned, or "EXC <type>: <message>",
#: or "HANG" (killed after 8 s).
PRELUDE = '''
import gc, os, signal, sys, threading, time
import torch
from tiercache.config import KVLayout, TierConfig
from tiercache.live.cache import TieredKVCache
from tiercache.live.store import TieredKVStore
torch.set_num_threads(2)  # an OpenMP team the parent's parallel ops start (dead in a forked child)
LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
TIERS = [TierConfig("hbm", 4), TierConfig("dram", 4), TierConfig("nvme", 64)]
KEYS = [i.to_bytes(16, "little") for i in range(20)]
BLOCKS = torch.randn(20, *LAYOUT.block_shape, generator=torch.Generator().manual_seed(0)).half()
ROOT = sys.argv[1]
STORE = TieredKVStore(LAYOUT, TIERS, path=os.path.join(ROOT, "parent"), device="cpu")
STORE.put(KEYS, BLOCKS)

def in_child(work, seconds=8.0):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            answer = repr(work())
        except BaseException as exc:
            answer = f"EXC {type(exc).__name__}: {exc}"
        os.write(write, answer.encode()[:4000])
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            answer = os.read(read, 4000).decode()
            os.close(read)
            return answer
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(read)
    return "HANG"
'''


#: A fork server: imports what ``PRELUDE`` imports once, then runs each script it is sent (one
#: JSON line: the code and its argv[1]) in a process of its own forked from it, with nothing
#: open and no thread started (as a fresh interpreter has), its exit handlers run as at a
#: normal exit; it answers one JSON line per script: exit status, stdout, stderr. A script
#: past 60 s is killed (a hang fails its test).
_SERVER = """
import atexit, json, os, signal, sys, tempfile, time, traceback
import torch, tiercache.config, tiercache.live.cache, tiercache.live.store
for request in sys.stdin:
    code, root = json.loads(request)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            status = 0
            try:
                sys.argv = ["-c", root]
                exec(compile(code, "<script>", "exec"), {"__name__": "__main__"})
                atexit._run_exitfuncs()
            except SystemExit as done:
                status = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
            except BaseException:
                traceback.print_exc()
                status = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        deadline = time.monotonic() + 60
        while not (ended := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        if not ended[0]:
            os.kill(pid, signal.SIGKILL)
            ended = os.waitpid(pid, 0)
        status = os.waitstatus_to_exitcode(ended[1])
        out.seek(0)
        err.seek(0)
        print(json.dumps([status, out.read().decode(), err.read().decode()]), flush=True)
"""
_server: list[subprocess.Popen] = []  # the module's fork server, started by the first _run


@pytest.fixture(scope="module", autouse=True)
def _fork_server():
    """Stops the fork server after the module's tests (by closing its stdin)."""
    yield
    for server in _server:
        server.stdin.close()
        server.wait(timeout=30)


def _run(script: str, tmp_path) -> list[str]:
    """Runs ``PRELUDE + script`` in a process of its own, forked from a fresh interpreter that
    imported tiercache once (``_SERVER``: not the test process, whose threads and at-fork
    hooks a fork would share); its stdout lines (it must exit 0)."""
    if not _server:
        _server.append(subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True))
    server = _server[0]
    server.stdin.write(json.dumps([PRELUDE + textwrap.dedent(script), str(tmp_path)]) + "\n")
    server.stdin.flush()
    status, out, err = json.loads(server.stdout.readline())
    assert status == 0, err[-3000:]
    return out.splitlines()


def _refusal(pid_line: str) -> str:
    return f"EXC UserError: TieredKVStore: this store was opened by process {pid_line}; a forked child must open a store of its own"


# -- 1: a forked child is refused the parent's store, at once -------------------------------
@needs_fork
def test_a_forked_child_is_refused_the_parents_store_even_while_a_parent_thread_holds_it(tmp_path):
    out = _run('''
        print(os.getpid())
        print(in_child(lambda: STORE.get(KEYS)))  # 12 blocks on NVMe: a job for the parent's I/O threads
        print(in_child(lambda: STORE.put([b"x" * 16], BLOCKS[:1])))
        inside, leave = threading.Event(), threading.Event()
        def busy():  # a parent thread inside a store call at the fork: the child's lock is never freed
            with STORE.guard:
                inside.set()
                leave.wait()
        thread = threading.Thread(target=busy)
        thread.start()
        inside.wait()
        print(in_child(lambda: STORE.lookup(KEYS)[0]))
        leave.set()
        thread.join()
        print(torch.equal(STORE.get(KEYS), BLOCKS))
        STORE.close()
    ''', tmp_path)
    refused = _refusal(out[0])
    assert out[1:] == [refused, refused, refused, "True"]


@needs_fork
def test_a_forked_childs_close_exit_and_collection_of_the_parents_store_leave_its_files_alone(tmp_path):
    out = _run('''
        go = os.path.join(ROOT, "go")
        def leave():
            while not os.path.exists(go):  # the parent's journal grows meanwhile
                time.sleep(0.01)
            first = STORE.close()
            with STORE:  # __exit__ closes
                pass
            nvme = STORE._media[2]
            del globals()["STORE"]
            gc.collect()
            nvme.__del__()  # what collecting the store's NVMe tier runs
            return first
        threading.Timer(0.5, lambda: (STORE.put([b"y" * 16], BLOCKS[:1]), STORE.flush(), open(go, "w").close())).start()
        print(in_child(leave))
        STORE.close()
        with TieredKVStore(LAYOUT, TIERS, path=os.path.join(ROOT, "parent"), device="cpu") as again:
            print(again.lookup(KEYS + [b"y" * 16])[0], torch.equal(again.get(KEYS), BLOCKS))
    ''', tmp_path)
    assert out == ["0", "21 True"]


@needs_fork
def test_a_forked_child_is_refused_the_parents_cache_and_sequences_and_closing_does_nothing(tmp_path):
    out = _run('''
        STORE.close()
        cache = TieredKVCache(LAYOUT, TIERS, path=os.path.join(ROOT, "cache"), device="cpu")
        seq = cache.sequence()
        k = torch.randn(LAYOUT.kv_heads, 20, LAYOUT.head_dim).half()
        seq.append(0, k, k)
        print(cache.store.guard.pid)
        print(in_child(cache.sequence))
        print(in_child(lambda: seq.append(0, k, k)))
        print(in_child(seq.free))
        print(in_child(cache.close))
        seq.free()
        cache.close()
    ''', tmp_path)
    refused = _refusal(out[0])
    assert out[1:] == [refused, refused, refused, "0"]  # close returns the blocks it persisted: none


# -- 2: a forked child opens and uses a store of its own -------------------------------------
@needs_fork
def test_a_forked_child_opens_and_uses_a_store_of_its_own(tmp_path):
    out = _run('''
        def own():
            with TieredKVStore(LAYOUT, TIERS, path=os.path.join(ROOT, "child"), device="cpu") as mine:
                mine.put(KEYS, BLOCKS)
                return torch.equal(mine.get(KEYS), BLOCKS)
        print(in_child(own))
        print(in_child(lambda: TieredKVStore(LAYOUT, TIERS, path=os.path.join(ROOT, "parent"), device="cpu")))
        STORE.close()
    ''', tmp_path)
    assert out[0] == "True"
    assert out[1].startswith("EXC UserError: ") and "store in use by pid" in out[1]  # the lock's refusal, not a hang


# -- 3: a dropped cache handed to the releaser in a forked child is released -----------------
@needs_fork
def test_rows_handed_to_the_releaser_in_a_forked_child_are_released(tmp_path):
    out = _run('''
        from tiercache.integrations.release import release_when_dropped
        class Dropped:  # stands for a TieredCache: what its finalizer releases is its rows
            pass
        def scenario():
            cache = TieredKVCache(LAYOUT, TIERS, path=os.path.join(ROOT, f"cache{os.getpid()}"), device="cpu")
            seq = cache.sequence()
            k = torch.randn(LAYOUT.kv_heads, 40, LAYOUT.head_dim).half()
            seq.append(0, k, k)
            owner = Dropped()
            release_when_dropped(owner, [seq])
            inside, leave = threading.Event(), threading.Event()
            def busy():  # another thread inside a store call: the rows go to the daemon releaser
                with cache.store.guard:
                    inside.set()
                    leave.wait()
            thread = threading.Thread(target=busy)
            thread.start()
            inside.wait()
            held = len(cache.manager.held)
            del owner
            gc.collect()
            leave.set()
            thread.join()
            deadline = time.monotonic() + 3
            while cache.manager.held and time.monotonic() < deadline:
                time.sleep(0.01)
            left = len(cache.manager.held)
            cache.close()
            return held, left
        STORE.close()
        print(scenario())  # makes the parent's releaser
        print(in_child(scenario))
    ''', tmp_path)
    assert out == ["(2, 0)", "(2, 0)"]


# -- 4: an interrupted put ------------------------------------------------------------------
@pytest.mark.parametrize("call", ["put", "access"])
def test_a_store_interrupted_in_its_write_back_leaves_the_invariants_whole(tmp_path, monkeypatch, call):
    with TieredKVStore(LAYOUT, tiers(2, 2, 4), path=tmp_path, device="cpu") as store:
        store.put([key(i) for i in range(8)], blocks(8, 0))  # every tier full: the next put evicts from NVMe
        real, fired = store.engine._outcome, []

        def ctrl_c_in_the_wait(*args):  # what a Ctrl-C in the manager's interruptible wait raises
            if not fired:
                fired.append(True)
                raise KeyboardInterrupt
            return real(*args)

        monkeypatch.setattr(store.engine, "_outcome", ctrl_c_in_the_wait)
        with pytest.raises(KeyboardInterrupt):
            getattr(store, call)([key(8), key(9)], blocks(2, 1))
        store.check_invariants()
        assert store.lookup([key(8), key(9)])[1] == [None, None]  # undone


# -- 5: copies and pickles are refused --------------------------------------------------------
@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, pickle.dumps], ids=["copy", "deepcopy", "pickle"])
def test_a_store_a_cache_and_a_sequence_refuse_copies_and_pickles(tmp_path, how):
    with TieredKVStore(LAYOUT, tiers(), path=tmp_path / "store", device="cpu") as store:
        store.put([key(1)], blocks(1, 0))
        with pytest.raises(TypeError, match=r"^TieredKVStore: a store cannot be copied or pickled .*open a TieredKVStore "
                                            r"on the same path there, once this one is closed$"):
            how(store)
        assert torch.equal(store.get([key(1)]), blocks(1, 0))  # untouched
    with TieredKVCache(LAYOUT, tiers(), path=tmp_path / "cache", device="cpu") as cache:
        with pytest.raises(TypeError, match=r"^TieredKVCache: a cache cannot be copied or pickled .*open a TieredKVCache"):
            how(cache)
        seq = cache.sequence()
        with pytest.raises(TypeError, match=r"^Sequence: a sequence cannot be copied or pickled .*seq\.fork\(\)"):
            how(seq)
        seq.free()


@needs_fork
def test_a_forked_child_that_exits_writes_none_of_the_parents_record_lines(tmp_path):
    """The step record is line-buffered: a child leaving normally (``sys.exit``, which flushes
    inherited buffers) has no lines of the parent's left to write a second time."""
    record = tmp_path / "steps.jsonl"
    script = textwrap.dedent(f'''
        import os, sys, torch
        from tiercache.config import KVLayout, TierConfig
        from tiercache.live.cache import TieredKVCache
        layout = KVLayout(layers=2, kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
        tiers = [TierConfig("hbm", 4), TierConfig("dram", 4), TierConfig("nvme", 64)]
        cache = TieredKVCache(layout, tiers, path={str(tmp_path / "c")!r}, device="cpu", record={str(record)!r})
        seq = cache.sequence(tokens=list(range(64)))
        for layer in range(2):
            seq.append(layer, torch.randn(2, 64, 64).half(), torch.randn(2, 64, 64).half())
        for layer in range(2):
            seq.attend(layer, torch.randn(2, 1, 64).half())
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        os.waitpid(pid, 0)
        cache.close()
    ''')
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    lines = record.read_text().splitlines()
    assert len(lines) == len(set(lines)) and len(lines) > 1
