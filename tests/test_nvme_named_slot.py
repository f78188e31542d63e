"""A put naming a slot whose release is not durable yet (probeA finding 2).

When a key is replaced (or deleted) its old slot is retired: the durable index still names
that slot until the next flush. A put naming it used to rewrite it at once, so a kill -9
before the next flush lost the key entirely (neither its flushed old version nor the new
one reopened). Such a put is now refused, naming the slot and telling the caller to flush.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from tiercache.config import KVLayout
from tiercache.data.nvme import NVMeStore
from tiercache.data.nvme_index import OP_PUT, SlotTable
from tiercache.errors import UserError

LAYOUT = KVLayout(layers=1, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
SHAPE = repr((1, *LAYOUT.block_shape))  # a batch of one block, for the child script


def block(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(-(2**15), 2**15, (1, *LAYOUT.block_shape), dtype=torch.int16, generator=g).view(torch.float16)


def read(store: NVMeStore, key: bytes) -> torch.Tensor | None:
    out = torch.empty(1, *LAYOUT.block_shape, dtype=torch.float16)
    return out if store.get([key], out)[0] else None


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and torch.equal(a.view(torch.int16), b.view(torch.int16))


# ----- the kill -9 scenario ----------------------------------------------------------------

CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    from tiercache.config import KVLayout
    from tiercache.data.nvme import NVMeStore
    from tiercache.errors import UserError

    def block(i):
        g = torch.Generator().manual_seed(i)
        return torch.randint(-2**15, 2**15, SHAPE, dtype=torch.int16, generator=g).view(torch.float16)

    def named_put(store, slot):
        try:
            store.put([b"J"], block(3), slots=[slot])
            print("written", flush=True)
        except UserError as exc:
            print("refused:", exc, flush=True)

    layout = KVLayout(layers=1, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
    stores = []
    for path, flush_first in ((sys.argv[1], False), (sys.argv[2], True)):
        store = NVMeStore(path, layout, 8)
        stores.append(store)
        store.put([b"K"], block(1))
        store.flush()                      # K = v1 is durable
        old = store.slot_of(b"K")
        store.put([b"K"], block(2))        # K = v2, not flushed: the old slot is retired
        named_put(store, old)              # no live key holds it: it looks free
        if flush_first:
            store.flush()                  # the retirement is durable: the slot is free now
            named_put(store, old)
    os.kill(os.getpid(), signal.SIGKILL)   # before any further flush
""").replace("SHAPE", SHAPE)


def test_kill_after_naming_a_retired_slot_keeps_the_replaced_keys_durable_copy(tmp_path):
    """put K; flush; put K again; put J naming K's old slot; kill -9. K must reopen as
    the flushed v1 (the replacement was never durable), not vanish; after a flush the
    same named put is accepted and K reopens as v2."""
    unflushed, flushed = str(tmp_path / "unflushed"), str(tmp_path / "flushed")
    child = subprocess.run([sys.executable, "-c", CHILD, unflushed, flushed], capture_output=True, text=True,
                           timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    lines = child.stdout.splitlines()
    with NVMeStore(unflushed, LAYOUT) as store:
        assert same(read(store, b"K"), block(1)), "the acknowledged K = v1 was lost"
        assert not store.contains(b"J") and store.stats["recovered_dropped"] == 0
        store.check_invariants()
    with NVMeStore(flushed, LAYOUT) as store:
        assert same(read(store, b"K"), block(2))
        assert not store.contains(b"J") and store.stats["recovered_dropped"] == 0
        store.check_invariants()
    assert len(lines) == 3, child.stdout + child.stderr
    assert lines[0].startswith("refused: NVMeStore.put: slot 0 is retired") and "flush()" in lines[0]
    assert lines[1].startswith("refused: ") and lines[2] == "written"


# ----- the slot table directly ------------------------------------------------------------

def table_with_replaced_key() -> tuple[SlotTable, int]:
    """A table where key K moved from slot 0 (now retired) to slot 1; returns (table, 0)."""
    table = SlotTable(4)
    table.finish_load()
    for _ in range(2):
        ((slot, gen),) = table.reserve(1)
        table.publish(b"K", slot, gen, 10, 0)
    assert table.items() == [(b"K", 1)]
    return table, 0


def test_slot_table_refuses_a_retired_slot_and_changes_nothing():
    table, old = table_with_replaced_key()
    free_before = table.free_count
    with pytest.raises(UserError, match=r"slot 0 is retired: .*not durably yet.*Call flush\(\) first"):
        table.reserve_at([2, old])  # a free slot first: it must stay free
    assert table.free_count == free_before and table.retired_count == 1
    table.check_invariants()


def test_slot_table_refuses_a_slot_a_flush_is_still_releasing_then_accepts_it():
    table, old = table_with_replaced_key()
    ops, retired = table.take_pending()  # a flush in progress
    assert retired == [old] and [op[0] for op in ops] == [OP_PUT, OP_PUT]
    with pytest.raises(UserError, match="slot 0 is being released by a flush still in progress"):
        table.reserve_at([old])
    table.release(retired)  # that flush is durable: the slot is free
    assert [slot for slot, _ in table.reserve_at([old])] == [old]
    table.check_invariants()


def test_failed_flush_leaves_the_slot_retired_and_refused():
    table, old = table_with_replaced_key()
    ops, retired = table.take_pending()
    table.restore_pending(ops, retired)
    assert table.retired_count == 1
    with pytest.raises(UserError, match="slot 0 is retired"):
        table.reserve_at([old])
    table.check_invariants()


def test_live_and_free_slots_may_still_be_named(tmp_path):
    """A live slot's key is dropped (the caller asked for it); a deleted key put again
    leaves its old slot retired, so naming it is refused until a flush."""
    with NVMeStore(tmp_path / "s", LAYOUT, 4) as store:
        store.put([b"A"], block(1))
        store.flush()
        store.put([b"B"], block(2), slots=[store.slot_of(b"A")])  # live slot: A dropped
        assert not store.contains(b"A") and store.slot_of(b"B") == 0
        store.delete([b"B"])
        store.put([b"B"], block(3))  # B again, elsewhere; its deletion not durable
        with pytest.raises(UserError, match="slot 0 is retired"):
            store.put([b"C"], block(4), slots=[0])
        store.flush()
        store.put([b"C"], block(4), slots=[0])
        assert same(read(store, b"C"), block(4)) and same(read(store, b"B"), block(3))
        store.check_invariants()
