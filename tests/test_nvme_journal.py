"""A damaged batch in the middle of the journal is not a torn tail (issue 8, item 5).

One flipped bit in an early batch used to end the replay there: the journal was cut, every
later valid batch discarded and their chunk files deleted as garbage (4 of 64 blocks left).
Now a batch with one flipped bit is repaired (crc32c locates a single-bit error), a batch
damaged beyond that is skipped and counted, and replay goes on with the batches after it.
"""

from __future__ import annotations

import os
import struct

import pytest
import torch

from tiercache.config import KVLayout
from tiercache.data import nvme_index
from tiercache.data.nvme import NVMeStore
from tiercache.errors import UserError

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16", per_layer=True)
HEADER = struct.Struct("<4sQII")  # magic, sequence, payload length, crc (nvme_index._JOURNAL_HEADER)
BATCHES, PER_BATCH = 8, 8


def blocks(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(-(2**15), 2**15, (n, *LAYOUT.block_shape), dtype=torch.int16, generator=g).view(torch.bfloat16)


def fill(path) -> tuple[list[bytes], torch.Tensor, list[int]]:
    """64 blocks in 8 flushes (8 journal batches); returns keys, data and batch offsets."""
    keys = [b"s0-l0-b%d" % i for i in range(BATCHES * PER_BATCH)]
    data = blocks(len(keys))
    with NVMeStore(path, LAYOUT, 80) as store:
        for b in range(BATCHES):
            part = slice(b * PER_BATCH, (b + 1) * PER_BATCH)
            store.put(keys[part], data[part])
            store.flush()
    raw = (path / nvme_index.JOURNAL_NAME).read_bytes()
    offsets, pos = [], 0
    while pos < len(raw):
        offsets.append(pos)
        pos += HEADER.size + HEADER.unpack_from(raw, pos)[2]
    assert len(offsets) == BATCHES
    return keys, data, offsets


def damage(journal, at: int, how: str) -> None:
    raw = bytearray(journal.read_bytes())
    if how == "smash":  # many bits in the body: beyond repair
        raw[at + HEADER.size + 40 : at + HEADER.size + 56] = os.urandom(16)
    else:
        byte, bit = {
            "key-bit": (HEADER.size + 27 + 7, 0),  # first key "s0-l0-b8" -> "s0-l0-b9": another real key
            "slot-bit": (HEADER.size + 1, 0),
            "length-bit": (12, 3),
            "seq-bit": (4, 0),
            "magic-bit": (1, 2),
            "crc-bit": (16, 5),
        }[how]
        raw[at + byte] ^= 1 << bit
    journal.write_bytes(bytes(raw))


def served(store: NVMeStore, keys: list[bytes], data: torch.Tensor) -> set[int]:
    """Indices of the blocks the store serves; fails on any wrong byte."""
    out = torch.empty((1, *LAYOUT.block_shape), dtype=torch.bfloat16)
    good = set()
    for i, key in enumerate(keys):
        if store.get([key], out)[0]:
            assert torch.equal(out.view(torch.int16), data[i : i + 1].view(torch.int16)), f"{key!r} served wrong bytes"
            good.add(i)
    assert store.stats["corrupt_reads"] == 0
    return good


@pytest.mark.parametrize("how", ["key-bit", "slot-bit", "length-bit", "seq-bit", "magic-bit", "crc-bit"])
def test_one_flipped_bit_in_an_early_batch_is_repaired(tmp_path, how):
    keys, data, offsets = fill(tmp_path / "s")
    damage(tmp_path / "s" / nvme_index.JOURNAL_NAME, offsets[1], how)
    with NVMeStore(tmp_path / "s", LAYOUT) as store:
        assert served(store, keys, data) == set(range(len(keys)))
        assert store.stats["journal_repaired"] == 1 and store.stats["journal_skipped"] == 0
        assert store.stats["garbage_removed"] == 0
    with NVMeStore(tmp_path / "s", LAYOUT) as store:  # the repair was made durable
        assert len(store) == len(keys) and store.stats["journal_repaired"] == 0


def test_a_smashed_early_batch_is_skipped_and_later_batches_kept(tmp_path):
    keys, data, offsets = fill(tmp_path / "s")
    damage(tmp_path / "s" / nvme_index.JOURNAL_NAME, offsets[1], "smash")
    with NVMeStore(tmp_path / "s", LAYOUT) as store:
        good = served(store, keys, data)
        lost = set(range(PER_BATCH, 2 * PER_BATCH))
        assert good == set(range(len(keys))) - lost, sorted(set(range(len(keys))) - good)
        assert store.stats["journal_skipped"] == 1
        assert store.stats["garbage_removed"] == PER_BATCH  # chunks no readable record names
        store.check_invariants()
        store.put([keys[PER_BATCH]], data[PER_BATCH : PER_BATCH + 1])
    with NVMeStore(tmp_path / "s", LAYOUT) as store:  # a clean index now: nothing skipped again
        assert len(store) == len(keys) - PER_BATCH + 1 and store.stats["journal_skipped"] == 0
        served(store, keys, data)


@pytest.mark.parametrize("clean", [True, False])
def test_damage_in_the_last_batch_is_a_torn_tail_only_after_a_crash(tmp_path, clean):
    """After a clean close its marker proves the last batch was acknowledged: its loss is
    counted. Without the marker it is indistinguishable from a crash mid-append."""
    from tiercache.data.nvme_open import CLEAN_NAME

    keys, data, offsets = fill(tmp_path / "s")
    if not clean:
        (tmp_path / "s" / CLEAN_NAME).unlink()
    damage(tmp_path / "s" / nvme_index.JOURNAL_NAME, offsets[-1], "smash")
    with NVMeStore(tmp_path / "s", LAYOUT) as store:
        good = served(store, keys, data)
        assert good == set(range((BATCHES - 1) * PER_BATCH))
        assert store.stats["journal_skipped"] == int(clean)


@pytest.mark.parametrize("batch", [2, 5, BATCHES - 1])
@pytest.mark.parametrize("how", ["slot-bit", "length-bit", "crc-bit"])
def test_one_flipped_bit_in_any_later_batch_is_repaired_and_the_scan_moves_on(tmp_path, batch, how):
    """A repaired batch's end is an offset in the journal, not in the batch: counted from the
    batch, the scan went back to the damaged batch and repaired it forever (reopen hung,
    memory growing). The scan runs in a thread so a regression fails instead of hanging."""
    import threading

    from tiercache.data import nvme_journal

    keys, data, offsets = fill(tmp_path / "s")
    journal = tmp_path / "s" / nvme_index.JOURNAL_NAME
    damage(journal, offsets[batch], how)
    result = {}
    scan = threading.Thread(target=lambda: result.update(scan=nvme_journal.scan_journal(journal.read_bytes(),
                                                                                         nvme_index._decodes)),
                            daemon=True)
    scan.start()
    scan.join(timeout=30)
    assert "scan" in result, "the journal scan did not finish"
    assert len(result["scan"].batches) == BATCHES and result["scan"].repaired == 1
    with NVMeStore(tmp_path / "s", LAYOUT) as store:
        assert served(store, keys, data) == set(range(len(keys)))
        assert store.stats["journal_repaired"] == 1 and store.stats["journal_skipped"] == 0


def _snapshotted(path) -> tuple[list[bytes], torch.Tensor]:
    """``fill``, then one flush that rewrites the snapshot with every entry (journal emptied)."""
    keys, data, _ = fill(path)
    with NVMeStore(path, LAYOUT) as store:
        store._files.need_snapshot = True
        store.put([b"extra"], blocks(1))
        store.flush()
    return keys, data


@pytest.mark.parametrize("where", ["seq", "count", "body", "crc"])
def test_one_flipped_bit_in_the_index_snapshot_is_repaired(tmp_path, where):
    """The snapshot had no repair: one flipped bit made the whole store refuse to open. Like a
    journal batch, it is now repaired (crc32c locates one bit) and rewritten at the next flush."""
    keys, data = _snapshotted(tmp_path / "s")
    snapshot = tmp_path / "s" / nvme_index.SNAPSHOT_NAME
    raw = bytearray(snapshot.read_bytes())
    assert len(raw) > 24 + 100  # entries live in the snapshot, not only in the journal
    byte = {"seq": 5, "count": 13, "body": 24 + 77, "crc": 21}[where]
    raw[byte] ^= 1 << 3
    snapshot.write_bytes(bytes(raw))
    with NVMeStore(tmp_path / "s", LAYOUT) as store:
        assert served(store, keys, data) == set(range(len(keys)))
        assert store.stats["snapshot_repaired"] == 1
    with NVMeStore(tmp_path / "s", LAYOUT) as store:  # the repair was made durable
        assert store.stats["snapshot_repaired"] == 0 and served(store, keys, data) == set(range(len(keys)))


def test_a_snapshot_damaged_beyond_one_bit_still_refuses_to_open(tmp_path):
    _snapshotted(tmp_path / "s")
    snapshot = tmp_path / "s" / nvme_index.SNAPSHOT_NAME
    raw = bytearray(snapshot.read_bytes())
    raw[40] ^= 0x11
    raw[90] ^= 0x80
    snapshot.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="index snapshot damaged"):
        NVMeStore(tmp_path / "s", LAYOUT)
