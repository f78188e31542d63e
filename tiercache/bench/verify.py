"""Checking that every timed transfer of ``tiercache bench`` delivered its bytes.

A timed transfer is a ``Side``: ``prepare`` poisons its destination blocks (every byte
``POISON``) before the clock starts, ``check`` runs after it stops and raises
``BenchError`` unless each destination block has its source block's digest
(``block_digests``: xxh3-64, about 10 GB/s on one core). The benchmark's blocks are
distinct random bytes (``reference_digests`` checks it), so a block left untouched, copied
from the wrong slot or half written fails the check: no figure is reported for work that
was not done. A write to disk (``written_side``) is checked by reading what it wrote back
into poisoned memory.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import xxhash

from ..data.pools import BlockPool

__all__ = ["POISON", "BenchError", "Side", "block_digests", "pool_rows", "reference_digests", "transfer_side", "unchecked_side",
           "written_side"]

#: The byte every destination block is filled with before a timed transfer.
POISON = 0xA5


class BenchError(RuntimeError):
    """A timed transfer did not deliver its bytes (or the store lost blocks): the run has
    no honest figure to report."""


@dataclass(frozen=True)
class Side:
    """One timed transfer of ``nbytes``: ``prepare`` and ``check`` run off the clock."""

    work: Callable[[], object]
    nbytes: int
    prepare: Callable[[], object]
    check: Callable[[], object]


def block_digests(rows: torch.Tensor, slots: np.ndarray | None = None) -> np.ndarray:
    """The xxh3-64 digest of each row ``slots`` (default all) of a ``[blocks, bytes]`` uint8
    tensor, as uint64 (the rows of a CUDA tensor are copied to the host first)."""
    picked = np.arange(rows.shape[0]) if slots is None else np.asarray(slots)
    if rows.device.type != "cpu":
        rows, picked = rows[torch.as_tensor(picked, device=rows.device)].cpu(), np.arange(picked.size)
    host = rows.numpy()
    return np.fromiter((xxhash.xxh3_64_intdigest(host[i]) for i in picked.tolist()), dtype=np.uint64, count=picked.size)


def pool_rows(pool: BlockPool) -> torch.Tensor:
    """The pool's slots as a ``[capacity, block_bytes]`` uint8 view (a pool without header room)."""
    return pool.host_buffer


def reference_digests(blocks: torch.Tensor) -> np.ndarray:
    """``block_digests`` of the benchmark's blocks, checked distinct from each other and from
    a poisoned block's (so a block from the wrong slot, or none, never passes a check).

    Raises:
        BenchError: two digests collide (practically never with random blocks).
    """
    digests = block_digests(blocks)
    poisoned = block_digests(torch.full((1, blocks.shape[1]), POISON, dtype=torch.uint8))[0]
    if np.unique(digests).size != digests.size or (digests == poisoned).any():
        raise BenchError("bench: the random blocks' digests collide; try another --seed")
    return digests


def transfer_side(work: Callable[[], object], pool: BlockPool, slots: np.ndarray, expected: np.ndarray, what: str) -> Side:
    """A transfer into ``slots`` of ``pool`` whose blocks must then have the digests
    ``expected`` (one per slot); ``what`` names it in the error."""
    slots = np.asarray(slots, dtype=np.int64)
    return Side(work, slots.size * pool.layout.block_bytes, lambda: _poison(pool, slots),
                lambda: _check_delivered(pool, slots, expected, what))


def written_side(work: Callable[[], object], nbytes: int, written: Callable[[], tuple[np.ndarray, np.ndarray]],
                 read_back: Callable[[np.ndarray], object], pool: BlockPool, what: str) -> Side:
    """A write to disk checked after the clock by reading it back: ``written()`` gives the
    disk slots the write left blocks in and the digests those blocks must have;
    ``read_back(disk_slots)`` reads them into slots ``0 .. len(disk_slots) - 1`` of
    ``pool``, poisoned first, which must then have those digests; ``what`` names the write
    in the error. A read-back that fails (a short read: the block was never written)
    raises BenchError too.

    The disk slots are not poisoned before the write (that would be a second write of every
    block), so a slot that already held the very block it is given passes whether or not
    it was rewritten: its bytes are right either way.
    """

    def check() -> None:
        disk_slots, expected = written()
        slots = np.arange(disk_slots.size)
        _poison(pool, slots)
        try:
            read_back(disk_slots)
        except OSError as exc:
            raise BenchError(f"bench: {what}: reading the written blocks back failed ({exc}); no figure is reported") from exc
        _check_delivered(pool, slots, expected, what)

    return Side(work, nbytes, _nothing, check)


def unchecked_side(work: Callable[[], object], nbytes: int) -> Side:
    """A transfer checked elsewhere (the store's writes: by the reads of what they wrote)."""
    return Side(work, nbytes, _nothing, _nothing)


def _nothing() -> None:
    """Neither prepares nor checks."""


def _poison(pool: BlockPool, slots: np.ndarray) -> None:
    """Fills the blocks in ``slots`` with ``POISON`` bytes (a memset per block on the host)."""
    rows = pool_rows(pool)
    if rows.device.type != "cpu":
        rows.index_fill_(0, torch.as_tensor(slots, device=rows.device), POISON)
        return
    base, pitch, size = rows.data_ptr(), rows.stride(0), rows.shape[1]
    for slot in slots.tolist():
        ctypes.memset(base + slot * pitch, POISON, size)


def _check_delivered(pool: BlockPool, slots: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Raises BenchError unless the blocks in ``slots`` have the digests ``expected``."""
    wrong = np.flatnonzero(block_digests(pool_rows(pool), slots) != expected)
    if wrong.size:
        raise BenchError(f"bench: {what}: {wrong.size} of {slots.size} blocks do not hold their source's bytes after the "
                         f"transfer (first: slot {int(slots[wrong[0]])}); no figure is reported")
