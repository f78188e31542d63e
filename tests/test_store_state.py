"""A hypothesis state machine over the live store: every public call, in any order.

Puts, gets, prefetches, accesses left in flight, waits, polls, pins, releases, flushes,
stats, and close-then-reopen, drawn at random against a tiny three-tier store. After every
step the store's invariants hold, and every key it reports stored reads back bit-identical;
after a reopen, every block it held on NVMe at close is still there.
"""

from __future__ import annotations

import shutil
import tempfile

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from store_helpers import LAYOUT, blocks, key, tiers
from tiercache.core.counts import CountError
from tiercache.live.store import Pending, TieredKVStore

KEYS = st.integers(0, 11)
DATA = blocks(12, 99)


class StoreMachine(RuleBasedStateMachine):
    """Drives a ``TieredKVStore`` with random calls; a model keeps the pins it expects."""

    def __init__(self) -> None:
        super().__init__()
        self.path = tempfile.mkdtemp(prefix="tiercache-state-")
        self.store = TieredKVStore(LAYOUT, tiers(hbm=2, dram=2, nvme=5), path=self.path)
        self.pins: dict[int, int] = {}
        self.handles: list[Pending] = []

    def _stored(self) -> list[int]:
        return [i for i, where in zip(range(12), self.store.lookup([key(i) for i in range(12)])[1]) if where]

    @rule(ids=st.lists(KEYS, min_size=1, max_size=4, unique=True))
    def put(self, ids):
        self.store.put([key(i) for i in ids], DATA[ids])

    @rule(ids=st.lists(KEYS, min_size=1, max_size=4))
    def access_in_flight(self, ids):
        self.handles.append(self.store.access([key(i) for i in ids], DATA[ids], wait=False))

    @rule(ids=st.lists(KEYS, min_size=1, max_size=4, unique=True))
    def prefetch(self, ids):
        self.handles.append(self.store.prefetch([key(i) for i in ids]))

    @rule(data=st.data())
    def get(self, data):
        stored = self._stored()
        if stored:
            ids = data.draw(st.lists(st.sampled_from(stored), min_size=1, max_size=4))
            got = self.store.get([key(i) for i in ids])
            for row, i in enumerate(ids):
                assert torch.equal(got[row], DATA[i]), i

    @precondition(lambda self: self.handles)
    @rule(index=st.integers(0, 20))
    def wait(self, index):
        self.store.wait(self.handles.pop(index % len(self.handles)))

    @rule()
    def poll_and_stats(self):
        self.store.poll()
        self.store.stats()

    @rule(i=KEYS)
    def pin(self, i):
        if i in self._stored():
            self.store.pin([key(i)])
            self.pins[i] = self.pins.get(i, 0) + 1

    @rule(i=KEYS)
    def release(self, i):
        if self.pins.get(i):
            self.store.release([key(i)])
            self.pins[i] -= 1
        elif i in self._stored():
            with pytest.raises(CountError):
                self.store.release([key(i)])

    @rule()
    def flush(self):
        self.store.flush()

    @precondition(lambda self: not any(self.pins.values()))
    @rule()
    def close_and_reopen(self):
        self.store.wait()
        on_nvme = {i for i, where in zip(range(12), self.store.lookup([key(i) for i in range(12)])[1]) if where == "nvme"}
        self.store.close()
        self.store = TieredKVStore(LAYOUT, tiers(hbm=2, dram=2, nvme=5), path=self.path)
        self.handles.clear()
        assert on_nvme <= set(self._stored()), "a block on NVMe at close is gone after reopen"

    @invariant()
    def consistent(self):
        self.store.check_invariants()
        assert {self.store._map.ids([key(i)], False)[0]: n for i, n in self.pins.items() if n} == self.store.manager.refs

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.path, ignore_errors=True)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
