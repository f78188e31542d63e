"""A live store's durable state: adopting stored blocks on reopen, persisting what the
volatile tiers hold into NVMe on close, and checking that the media hold what the
manager says."""

from __future__ import annotations

from typing import Sequence

from tiercache.core.counts import CountError
from tiercache.core.manager import TierManager
from tiercache.core.plans import EventLog
from tiercache.keys import key_to_int

from .keymap import KeyMap

__all__ = ["adopt_stored_blocks", "persist_to_nvme", "check_store", "check_release"]


def adopt_stored_blocks(manager: TierManager, media: Sequence[object], keymap: KeyMap, events: EventLog) -> None:
    """Reopening: the complete blocks of a durable medium join its tier, as many as the
    tier holds (oldest slots first); the rest, blocks that had left the tier before a
    crash made their deletion durable, or a tier reopened smaller, are deleted."""
    for tier, medium in enumerate(media):
        entries = sorted(medium.durable_items(), key=lambda entry: entry[1])
        keep, extra = entries[: manager.dirs[tier].capacity], entries[manager.dirs[tier].capacity :]
        if extra:
            medium.forget([key for key, _ in extra])
        ids = [key_to_int(key) for key, _ in keep]
        keymap.adopt(ids, [key for key, _ in keep])
        if ids:
            manager.restore(tier, ids)
    events.drain()  # adoption is not traffic


def persist_to_nvme(manager: TierManager, events: EventLog) -> int:
    """Moves unpinned DRAM, then HBM, blocks into free NVMe slots; returns how many."""
    names = [d.name for d in manager.dirs]
    if "nvme" not in names or manager.write_through:
        return 0
    nvme, moved = names.index("nvme"), 0
    for tier in reversed(range(nvme)):
        directory = manager.dirs[tier]
        ids = [i for i in directory.slot_of if i not in directory.pins][: manager.dirs[nvme].n_free]
        if ids and manager.move(ids, tier, nvme):
            moved += len(ids)
    events.drain()  # shutting down is not traffic
    return moved


def check_store(manager: TierManager, keymap: KeyMap, media: Sequence[object]) -> None:
    """Asserts the manager, the key map and the keyed media agree (a shared medium, the
    remote store, is not checked by key: others may evict what this process's view lists)."""
    manager.check_invariants()
    keymap.check({b for d in manager.dirs for b in d.slot_of})
    for tier, medium in enumerate(media):
        if medium.keyed and not getattr(medium, "shared", False):  # places bytes itself: check by key
            for block_id in manager.dirs[tier].slot_of:
                assert medium.contains(keymap.keys[block_id]), f"{medium}: resident block {block_id} is not stored"


def check_release(manager: TierManager, keys: Sequence[bytes], ids: Sequence[int]) -> None:
    """Checks a ``release`` before it changes anything, naming the caller's key (the manager
    names its internal id): each key released at most as often as it is pinned (pins on
    blocks lost while pinned count too: ``TierManager.unref``).

    Raises:
        CountError: the first key released more often than it is pinned.
    """
    asked: dict[int, int] = {}
    for key, block_id in zip(keys, ids):
        asked[block_id] = asked.get(block_id, 0) + 1
        counts = manager.orphan_refs if block_id in manager.orphan_refs else manager.refs
        if asked[block_id] > counts.get(block_id, 0):
            raise CountError(f"TieredKVStore.release: key {key.hex()} is released more often than it is pinned")
