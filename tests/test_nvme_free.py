"""The NVMe slot table's free slots: same handing-out order as the insertion-ordered dict
they replace, stale entries compacted, and the memory per slot of capacity (issue 8 item 12)."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest

from tiercache.data.nvme_free import FreeSlots
from tiercache.data.nvme_index import SlotTable


@pytest.mark.parametrize("seed", range(4))
def test_free_slots_hand_out_like_an_ordered_dict(seed):
    rng = random.Random(seed)
    capacity = 24
    free = FreeSlots(capacity, np.arange(capacity - 1, -1, -1))
    reference = dict.fromkeys(range(capacity - 1, -1, -1))
    for _ in range(3000):
        taken = [s for s in range(capacity) if s not in reference]
        action = rng.random()
        if reference and action < 0.3:  # a put naming a free slot (reserve_at)
            slot = rng.choice(list(reference))
            free.discard(slot)
            del reference[slot]
        elif taken and action < 0.65:  # abandon / release
            slot = rng.choice(taken)
            free.add(slot)
            reference[slot] = None
        elif reference:
            n = rng.randint(1, min(3, len(reference)))
            assert free.pop(n) == [reference.popitem()[0] for _ in range(n)]
        free.check()
        assert free.count == len(reference) and all((s in free) == (s in reference) for s in range(capacity))


def test_finish_load_hands_out_the_lowest_free_slots_first():
    table = SlotTable(8)
    table.apply((1, b"k", 2, 5, 10, 0))
    table.finish_load()
    assert [slot for slot, _ in table.reserve(3)] == [0, 1, 3]
    assert table.free_count == 4
    table.check_invariants()


def test_empty_slot_table_costs_at_most_30_bytes_per_slot():
    n = 1_000_000
    tracemalloc.start()
    try:
        table = SlotTable(n)
        table.finish_load()
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert table.free_count == n
    assert current / n <= 30, f"{current / n:.1f} B per slot"


def test_a_store_whose_index_cannot_fit_is_refused_before_anything_is_written(tmp_path):
    from tiercache.config import KVLayout
    from tiercache.data.nvme import NVMeStore
    from tiercache.errors import UserError

    layout = KVLayout(layers=1, kv_heads=1, head_dim=4, dtype="float16", block_tokens=2)
    with pytest.raises(UserError, match=f"needs {10**12 * 29:,} bytes of memory"):
        NVMeStore(tmp_path / "s", layout, capacity_blocks=10**12)
    assert not (tmp_path / "s").exists()
