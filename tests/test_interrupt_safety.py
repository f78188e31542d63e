"""Interrupts and failures in the middle of a live call (probeF findings): a Ctrl-C is deferred
to the end of the call, so the call is whole (done, or undone if it failed) when the
``KeyboardInterrupt`` arrives; a failure part-way leaves nothing a retry could mistake for its
own (no stale private block, no hold released twice, no reference, pin or plan behind).

A real SIGINT is raised at an exact point (``signal.raise_signal`` from a patched function the
call runs), so each case is deterministic; each failed before its fix.
"""

from __future__ import annotations

import errno
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from store_helpers import LAYOUT, blocks, key, tiers
from test_sequence_atomicity import Appended, small_cache
from tiercache.core import interrupts
from tiercache.data.iojobs import run_batch
from tiercache.data.nvme import NVMeStore
from tiercache.errors import UserError
from tiercache.live.layerstate import LayerState
from tiercache.live.store import TieredKVStore

main_thread_only = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                      reason="SIGINT is deferred in the main thread only")



def ctrl_c_after(real):
    """``real`` followed by a Ctrl-C (once): the signal lands right after ``real`` returns."""
    fired = []

    def wrapper(*args, **kwargs):
        result = real(*args, **kwargs)
        if not fired:
            fired.append(True)
            signal.raise_signal(signal.SIGINT)
        return result

    return wrapper


def ctrl_c_before(real, signum: int = signal.SIGINT):
    """A Ctrl-C (or ``signum``, whose handler then runs inside the call), once, then ``real``."""
    fired = []

    def wrapper(*args, **kwargs):
        if not fired:
            fired.append(True)
            signal.raise_signal(signum)
        return real(*args, **kwargs)

    return wrapper


# -- plain failures -------------------------------------------------------------------------
def test_a_retry_after_a_failed_append_stores_its_own_kv_not_the_failed_calls(tmp_path, monkeypatch):
    kv = Appended(10)
    with small_cache(tmp_path) as cache:
        seq = cache.sequence()
        seq.append(0, *kv.kv(0, 4))
        k_old, v_old = kv.kv(0, 4, keep=False)

        def failing(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(cache, "_emit", failing)  # after the block is stored
        with pytest.raises(KeyboardInterrupt):
            seq.append(0, k_old, v_old)
        monkeypatch.undo()
        assert seq.length(0) == 4
        seq.append(0, *kv.kv(0, 4))  # other KV at the same position
        assert kv.error(seq, 0) < 1e-5
        seq.free()
        cache.check_invariants()


def test_a_free_that_failed_part_way_releases_only_the_rest_next_time(tmp_path, monkeypatch):
    kv = Appended(11)
    tokens = list(range(17))
    with small_cache(tmp_path, hbm=4) as cache:
        a = cache.sequence(tokens=tokens)
        a.append(0, *kv.kv(0, 24))  # 4 content-keyed blocks, then 2 private ones
        b = cache.sequence(tokens=tokens)  # shares the 4 prompt blocks
        shared = [int(i) for i in b._layers[0].ids[: b.blocks(0)]]
        assert len(shared) == 4 and all(cache.manager.held[i] == 2 for i in shared)
        real = cache.driver.release

        def part_way(ids):
            real(ids[:4])  # the shared blocks are released, then it fails
            raise RuntimeError("injected")

        monkeypatch.setattr(cache.driver, "release", part_way)
        with pytest.raises(RuntimeError, match="injected"):
            a.free()
        monkeypatch.undo()
        a.free()
        assert all(cache.manager.held.get(i) == 1 for i in shared)  # b's holds stay
        assert len(cache.manager.held) == 4
        b.free()
        cache.check_invariants()


def test_an_engine_that_raises_keyboardinterrupt_on_submit_leaves_no_plan_in_flight(tmp_path, monkeypatch):
    data = blocks(3, 12)
    keys = [key(i) for i in range(3)]
    with TieredKVStore(LAYOUT, tiers(hbm=2), path=tmp_path / "nvme", device="cpu") as store:
        store.put(keys[:2], data[:2])

        def interrupted(plan):
            raise KeyboardInterrupt

        monkeypatch.setattr(store.engine, "submit", interrupted)
        with pytest.raises(KeyboardInterrupt):
            store.put(keys[2:], data[2:])  # demotes an HBM block first
        monkeypatch.undo()
        manager = store.manager
        assert not manager.inflight and not any(d.pins for d in manager.dirs)
        store.check_invariants()
        assert store.close() == 2
    with TieredKVStore(LAYOUT, tiers(hbm=2), path=tmp_path / "nvme", device="cpu") as store:
        assert store.lookup(keys[:2])[0] == 2


# -- Ctrl-C at an exact point -------------------------------------------------------------
@main_thread_only
def test_ctrl_c_right_after_an_appends_commit_leaves_the_append_whole(tmp_path, monkeypatch):
    kv = Appended(13)
    with small_cache(tmp_path) as cache:
        seq = cache.sequence()
        seq.append(0, *kv.kv(0, 6))
        monkeypatch.setattr(LayerState, "add", ctrl_c_after(LayerState.add))
        with pytest.raises(KeyboardInterrupt):
            seq.append(0, *kv.kv(0, 3))  # fills a block: the commit, then the tail
        monkeypatch.undo()
        assert seq.length(0) == 9 and kv.error(seq, 0) < 1e-5  # done whole, then interrupted
        seq.free()
        cache.check_invariants()


@main_thread_only
def test_ctrl_c_after_a_frees_release_never_releases_twice(tmp_path, monkeypatch):
    kv = Appended(14)
    tokens = list(range(17))
    with small_cache(tmp_path, hbm=4) as cache:
        a = cache.sequence(tokens=tokens)
        a.append(0, *kv.kv(0, 16))
        b = cache.sequence(tokens=tokens)
        shared = [int(i) for i in b._layers[0].ids[: b.blocks(0)]]
        monkeypatch.setattr(cache.driver, "release", ctrl_c_after(cache.driver.release))
        with pytest.raises(KeyboardInterrupt):
            a.free()
        monkeypatch.undo()
        a.free()  # the caller finishes it
        assert all(cache.manager.held.get(i) == 1 for i in shared)
        b.free()
        cache.check_invariants()


@main_thread_only
def test_ctrl_c_while_an_attend_ends_its_read_leaves_no_reference(tmp_path, monkeypatch):
    kv = Appended(15)
    with small_cache(tmp_path) as cache:
        seq = cache.sequence()
        seq.append(0, *kv.kv(0, 16))
        monkeypatch.setattr(cache.manager, "unref", ctrl_c_before(cache.manager.unref))
        with pytest.raises(KeyboardInterrupt):
            seq.attend(0, torch.randn(2, 1, 8))
        monkeypatch.undo()
        seq.free()
        assert not cache.manager.refs and not cache.manager.orphan_refs
        cache.check_invariants()


@main_thread_only
def test_ctrl_c_while_a_put_starts_a_move_leaves_no_pin_and_close_saves_every_block(tmp_path, monkeypatch):
    data = blocks(3, 16)
    keys = [key(i) for i in range(3)]
    store = TieredKVStore(LAYOUT, tiers(hbm=2), path=tmp_path / "nvme", device="cpu")
    store.put(keys[:2], data[:2])
    monkeypatch.setattr(store.engine, "submit", ctrl_c_before(store.engine.submit))
    with pytest.raises(KeyboardInterrupt):
        store.put(keys[2:], data[2:])
    monkeypatch.undo()
    assert not any(d.pins for d in store.manager.dirs)
    store.check_invariants()
    assert store.close() == 3
    with TieredKVStore(LAYOUT, tiers(hbm=2), path=tmp_path / "nvme", device="cpu") as store:
        assert store.lookup(keys)[0] == 3
        assert torch.equal(store.get(keys), data)


@main_thread_only
def test_a_close_from_a_signal_handler_fails_the_interrupted_call_clearly(tmp_path, monkeypatch):
    data = blocks(3, 17)
    keys = [key(i) for i in range(3)]
    store = TieredKVStore(LAYOUT, tiers(hbm=2), path=tmp_path / "nvme", device="cpu")
    store.put(keys[:2], data[:2])
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: store.close())
    try:
        monkeypatch.setattr(store.engine, "wait", ctrl_c_before(store.engine.wait, signal.SIGUSR1))
        with pytest.raises(UserError, match="closed during this call"):
            store.put(keys[2:], data[2:])  # waits for a demotion; the handler closes the store
    finally:
        signal.signal(signal.SIGUSR1, old)
        monkeypatch.undo()
    with TieredKVStore(LAYOUT, tiers(hbm=2), path=tmp_path / "nvme", device="cpu") as store:
        assert store.lookup(keys[:2])[0] == 2  # the completed puts were persisted by that close


@main_thread_only
def test_ctrl_c_while_io_tasks_are_handed_to_the_pool_is_raised_once_all_are(monkeypatch):
    done = []
    with ThreadPoolExecutor(2) as pool:
        monkeypatch.setattr(pool, "submit", ctrl_c_before(pool.submit))
        with pytest.raises(KeyboardInterrupt):
            run_batch(pool, 2, 4, done.append, list)
    assert sorted(done) == [0, 1, 2, 3]  # every task was handed over (the pool's locks intact)


# -- the helper itself --------------------------------------------------------------------
@main_thread_only
def test_deferred_interrupts_nest_and_raise_once_at_the_outermost_end():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred_interrupts():
            with interrupts.deferred_interrupts():
                signal.raise_signal(signal.SIGINT)
                reached.append("inner")
            reached.append("outer")
    assert reached == ["inner", "outer"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_deferred_interrupts_do_nothing_outside_the_main_thread():
    seen = []

    def worker():
        with interrupts.deferred_interrupts():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [signal.getsignal(signal.SIGINT)]


@main_thread_only
def test_a_custom_sigint_handler_is_left_alone():
    calls = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with interrupts.deferred_interrupts():
            signal.raise_signal(signal.SIGINT)
            time.sleep(0)  # the handler runs at once
            assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, old)


# -- a hung pool ----------------------------------------------------------------------------
def test_nvme_close_gives_up_on_hung_io_threads_instead_of_hanging(tmp_path, monkeypatch):
    gate = threading.Event()
    store = NVMeStore(tmp_path / "nvme", LAYOUT, capacity_blocks=4, io_threads=1)
    real = store._write_one

    def hung(*args, **kwargs):
        gate.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "_write_one", hung)
    store.close_timeout_s = 0.2
    store.submit_put([key(0)], blocks(1, 18))
    errors = []
    closer = threading.Thread(target=lambda: _close_into(store, errors))
    closer.start()
    closer.join(3)
    gate.set()
    closer.join(10)
    assert errors and isinstance(errors[0], OSError) and errors[0].errno == errno.ETIMEDOUT


def _close_into(store: NVMeStore, errors: list) -> None:
    try:
        store.close()
    except OSError as exc:
        errors.append(exc)


def _holder(guard):
    """A thread that holds ``guard`` until released: (thread, held event, release event)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with guard:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(5)
    return thread, release


def test_ctrl_c_interrupts_a_wait_for_a_store_busy_in_another_thread():
    """The guard takes its lock before deferring Ctrl-C: a main thread blocked waiting for
    another thread's call is interrupted at once, as with a plain lock."""
    from tiercache.live.guard import CallGuard

    guard = CallGuard()
    thread, release = _holder(guard)
    timer = threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            with guard:
                pass
        assert time.monotonic() - start < 2.0
    finally:
        release.set()
        thread.join()
        timer.cancel()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_raising_handler_during_a_blocked_call_leaves_ctrl_c_working():
    """A SIGALRM handler that raises while the main thread waits for the guard: nothing of
    the deferral is left installed (Ctrl-C raises at once afterwards)."""
    from tiercache.core import interrupts
    from tiercache.live.guard import CallGuard

    guard = CallGuard()
    thread, release = _holder(guard)

    def timeout(signum, frame):
        raise TimeoutError("alarm")

    previous = signal.signal(signal.SIGALRM, timeout)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(TimeoutError):
            with guard:
                pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        release.set()
        thread.join()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and interrupts._depth == 0


def test_a_deferring_handler_left_behind_is_adopted_by_the_next_section():
    """A section cut short between its handler swap and its depth update leaves ``_record``
    installed at depth 0; the next section adopts it and restores Python's handler."""
    from tiercache.core import interrupts

    signal.signal(signal.SIGINT, interrupts._record)
    try:
        with interrupts.deferred_interrupts():
            pass
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
