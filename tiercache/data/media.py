"""The medium interface: what every tier's storage offers the engine and the live store.

A medium is one class (``BlockPool`` for HBM and DRAM, ``NVMeStore`` for NVMe,
``RemoteStore`` for the shared remote tier; a quantised tier later). Bytes move between two media only through the copy handler
registered for that pair (``handlers.py``); everything else the engine and the store need of
a medium is this protocol, so neither ever dispatches on a medium's class.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

__all__ = ["Medium"]


class Medium(Protocol):
    """One tier's storage.

    Attributes:
        keyed: True when the medium names blocks by content key (``forget`` then receives
            the keys of the blocks that left); False when slots alone hold bytes.
        shared (optional, False when absent): True when other processes write and evict the
            medium too (the remote store): its tier is a view, and leaving it deletes nothing.
    """

    keyed: bool

    def write(self, slots: Sequence[int], blocks: torch.Tensor) -> None:
        """Writes new blocks into slots (asked only of the top tier, where blocks are born)."""

    def forget(self, keys: Sequence[bytes]) -> None:
        """Drops the stored bytes of blocks that left this tier."""

    def read_block(self, slot: int, key: bytes, dest: torch.Tensor) -> None:
        """Copies one block into ``dest``; raises KeyError if it proves unreadable."""

    def durable_items(self) -> list[tuple[bytes, int]]:
        """``(key, slot)`` of blocks that survived a restart (empty for volatile media)."""

    def flush(self) -> None:
        """Makes what was written durable (no-op for volatile media)."""

    def close(self) -> None:
        """Finishes I/O and releases the medium."""
