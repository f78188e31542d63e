"""Probe q50 (resource growth in a long-running process): a decode cache's calls never ended
the store's call bookkeeping (``RetainedCopies.end_call``), so the blocks noted as having
left NVMe grew by 6 entries per short sequence, forever (1.3 MiB per 1000 sequences), and
every block coming back into NVMe after any earlier departure forced a synchronous flush."""

from __future__ import annotations

import torch

from decode_helpers import random_kv, small_cache


def test_a_decode_loop_keeps_no_record_of_blocks_that_left_nvme_past_its_call(tmp_path):
    with small_cache(tmp_path / "nvme") as cache:
        left = cache.store.engine.retained._left
        for cycle in range(60):  # private sequences of 3 blocks per layer: HBM 8 and DRAM 16 spill to NVMe
            seq = cache.sequence()
            for layer in range(2):
                seq.append(layer, *random_kv(12))
                assert not any(left.values()), cycle  # each call ends its own bookkeeping
            seq.attend(0, torch.randn(4, 1, 8))
            seq.free()
            assert not any(left.values()), cycle
        dram, nvme = cache.store.stats()["tiers"][1:]
        assert dram["demotions"] > 100 and nvme["evictions"] > 100  # blocks did come to NVMe and leave it


def test_a_call_keeps_the_departures_of_blocks_a_running_job_writes_back():
    """Review r30: a job into NVMe still running when a call ends settles in a later call; the
    departure it undoes must still force its flush there (``RetainedCopies.returned``)."""
    from tiercache.data.engine import RetainedCopies

    retained = RetainedCopies([], keys=lambda ids: [])
    retained._left = {2: {5: 1, 6: 1}, 1: {7: 0}}
    retained.end_call({2: {5, 9}, 1: set()})
    assert retained._left == {2: {5: 1}}  # only 5 is on its way back into tier 2
    retained.end_call()
    assert retained._left == {}
