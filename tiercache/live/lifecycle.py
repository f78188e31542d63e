"""Opening and closing a live store's durable state: adopting stored blocks on reopen,
and persisting what the volatile tiers hold into NVMe on close."""

from __future__ import annotations

from typing import Sequence

from tiercache.core.manager import TierManager
from tiercache.core.plans import EventLog
from tiercache.keys import key_to_int

from .keymap import KeyMap

__all__ = ["adopt_stored_blocks", "persist_to_nvme"]


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
