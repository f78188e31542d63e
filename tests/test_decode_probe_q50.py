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
