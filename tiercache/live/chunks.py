"""Where a streamed read's chunks come from: runs of consecutive blocks, wherever they lie.

``TierChunks`` is the ``ChunkSource`` (``tiercache.attention``) of a decode cache's read:
the blocks are cut, in the order given, into chunks of ``window_blocks``; a chunk's blocks
on NVMe are read by the store's I/O threads into the cache's host window, the ones in
memory tiers are read where they lie (a quantised memory tier's blocks are dequantised one
by one into the chunk's device buffer). The chunks, and so the order in which attention
merges their partials, do not depend on where the blocks lie: the same KV gives the same
bits whatever the tiers and the prefetch policy did. ``split_kv`` turns stored blocks into
the K and V that attention computes on.
"""

from __future__ import annotations

import threading
from concurrent import futures
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from tiercache.attention import compute_dtype
from tiercache.core.interrupts import deferred_interrupts, interruptible_wait
from tiercache.data.nvme_results import ReadIOError
from tiercache.data.pools import BlockPool
from tiercache.data.quantized import QuantizedPool

if TYPE_CHECKING:
    from .cache import TieredKVCache

__all__ = ["TierChunks", "Chunk", "Piece", "split_kv"]

#: A piece whose blocks form at most this many runs (consecutive in the chunk and in their
#: source) is copied run by run (``_copy_blocks``: 2 x kv-heads copies per run); one with more
#: is gathered and scattered with indexed copies (``_scatter_blocks``: 2 x kv-heads in all).
MAX_RUN_COPIES = 2


class Piece(NamedTuple):
    """The blocks of one chunk that one tier holds.

    Attributes:
        tier: the tier holding them.
        offsets: their rows in the chunk (ascending: the chunk's block order).
        base: the first of the ``len(offsets)`` rows of the window buffer (and of the device
            gather buffer) the piece is read or gathered into; pieces of a chunk use disjoint rows.
        ids, keys: the blocks' ids and keys, in ``offsets`` order.
    """

    tier: int
    offsets: list[int]
    base: int
    ids: list[int]
    keys: list[bytes]


class Chunk(NamedTuple):
    """``window_blocks`` (or fewer, at the end) consecutive blocks of a read, split into
    ``pieces`` by the tier holding them (keyed media first, so their reads start first)."""

    pieces: tuple[Piece, ...]
    ids: list[int]
    keys: list[bytes]


class TierChunks:
    """The ``ChunkSource`` of a read: the blocks, in the order given, in chunks of
    ``window_blocks``.

    Invariant: chunk ``i`` holds blocks ``i * window_blocks ..`` of the read whatever tiers
    hold them, and its K and V rows are in block order, so the computed partials, and the
    merged output, are bit for bit the same for the same KV in any placement (lossless
    tiers). A chunk's blocks on a keyed medium (NVMe) are read by the store's I/O threads
    into a window buffer; blocks in memory tiers are read where they lie (a contiguous run
    of slots is a view, otherwise one gather). The read's references
    (``StepDriver.begin_read``) keep every block where it was found.

    A handle is ``(index, buffer, pending)``: ``pending`` is None when the chunk has no
    block on a keyed medium, else ``(future, reads)``: a future done once every read of the
    chunk has landed, and ``(piece number, future, window rows)`` per keyed piece. A read
    is never left running unknown to the caller: ``start`` returns the handle of every read
    it started or, failing, waits for them; ``settle`` waits for all of a handle's reads,
    NVMe and remote alike, even those of a chunk whose ``finish`` failed part-way.

    ``stored_dtype`` is the cache's storage dtype: ``finish`` converts K and V to the compute
    dtype, and the overflow check of ``stream_partial`` judges the dtype they are stored in
    (fp16 KV needs none).
    """

    def __init__(self, cache: TieredKVCache, ids: list[int], keys: list[bytes]) -> None:
        self.cache = cache
        self.stored_dtype: torch.dtype = cache.dtype
        width = cache.window_blocks
        self.chunks: list[Chunk] = [self._chunk(ids[a : a + width], keys[a : a + width]) for a in range(0, len(ids), width)]
        self.n_chunks = len(self.chunks)

    def _chunk(self, ids: list[int], keys: list[bytes]) -> Chunk:
        """The chunk of these consecutive blocks, split by tier (raises if one is gone)."""
        manager, media = self.cache.manager, self.cache.store._media
        groups: dict[int, list[int]] = {}
        for offset, block_id in enumerate(ids):
            tier = manager.locate(block_id)
            if tier is None:
                raise RuntimeError(f"block {block_id} of this sequence is no longer stored (lost: unreadable)")
            groups.setdefault(tier, []).append(offset)
        pieces, base = [], 0
        for tier in sorted(groups, key=lambda t: (not media[t].keyed, -t)):
            offsets = groups[tier]
            pieces.append(Piece(tier, offsets, base, [ids[o] for o in offsets], [keys[o] for o in offsets]))
            base += len(offsets)
        return Chunk(tuple(pieces), ids, keys)

    def start(self, index: int, buffer: int):
        """Starts the reads of chunk ``index``'s keyed pieces into window buffer ``buffer``
        and returns its handle. A submission that fails (or a Ctrl-C, raised once the
        submissions are whole) waits for the reads already started before it propagates."""
        reads: list = []
        try:
            with deferred_interrupts():  # no Ctrl-C between a read's submission and its record
                for number, piece in enumerate(self.chunks[index].pieces):
                    medium = self.cache.store._media[piece.tier]
                    if medium.keyed:
                        window = self._window_rows(buffer, piece)
                        reads.append((number, medium.submit_get(piece.keys, window), window))
                return (index, buffer, (_joined([future for _, future, _ in reads]), reads) if reads else None)
        except BaseException:
            self.settle((index, buffer, (None, reads)))
            raise

    def settle(self, handle) -> None:
        """Waits for every read of a started chunk to land, taking nothing from them (a read
        abandoned by a failed step, or left by a ``finish`` that failed on another piece of
        the chunk, must not write its window buffer under the next one)."""
        pending = handle[2]
        if pending is not None and pending[1]:
            with interruptible_wait():  # a hung disk must not make the call deaf to Ctrl-C
                futures.wait([future for _, future, _ in pending[1]])

    def finish(self, handle) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's K and V, ``[kv, n*T, D]`` in the compute dtype, rows in block order,
        in the window buffer's device scratch: each piece converted straight into its rows
        (a memory-tier pool on the compute device with no gather copy first)."""
        index, buffer, _ = handle
        _, k_out, v_out = self.cache._scratch(buffer)
        chunk = self.chunks[index]
        k, v = _block_views(k_out, v_out, len(chunk.ids), self.cache.layout.block_tokens)
        for number, piece in enumerate(chunk.pieces):
            medium = self.cache.store._media[piece.tier]
            if isinstance(medium, BlockPool) and medium.tensor.device == k.device:
                blocks, rows = medium.tensor, [self.cache.manager.dirs[piece.tier].slot_of[b] for b in piece.ids]
            else:
                blocks, rows = self._piece_blocks(handle, number), range(len(piece.ids))
            runs = _runs(piece.offsets, rows)
            if len(runs) <= MAX_RUN_COPIES:
                for offset, row, count in runs:
                    _copy_blocks(blocks[row : row + count], k, v, offset)
            else:  # scattered: one gather and one indexed copy per head, whatever the runs
                _scatter_blocks(_rows_of(blocks, rows), k, v, piece.offsets)
        return _flat(k), _flat(v)

    def raw(self, handle) -> torch.Tensor:
        """Waits for a chunk and returns its blocks as stored, ``[n, 1, 2, kv, T, D]``, in
        block order (a chunk that spans tiers is assembled into a new tensor)."""
        chunk = self.chunks[handle[0]]
        if len(chunk.pieces) == 1:
            return self._piece_blocks(handle, 0)
        layout = self.cache.layout
        blocks = torch.empty((len(chunk.ids), *layout.block_shape), dtype=self.cache.dtype, device=self.cache.device)
        for number, piece in enumerate(chunk.pieces):
            blocks[piece.offsets] = self._piece_blocks(handle, number)
        return blocks

    def _window_rows(self, buffer: int, piece: Piece) -> torch.Tensor:
        """The host window rows of ``piece`` in window buffer ``buffer``."""
        first = buffer * self.cache.window_blocks + piece.base
        return self.cache._window_pool().tensor[first : first + len(piece.ids)]

    def _piece_blocks(self, handle, number: int) -> torch.Tensor:
        """Waits for piece ``number`` of a chunk and returns its blocks as stored, on the
        compute device, ``[len(piece.ids), 1, 2, kv, T, D]``."""
        index, buffer, pending = handle
        piece = self.chunks[index].pieces[number]
        cache = self.cache
        medium = cache.store._media[piece.tier]
        if not medium.keyed:
            slots = [cache.manager.dirs[piece.tier].slot_of[b] for b in piece.ids]
            gathered = cache._scratch(buffer)[0][piece.base : piece.base + len(slots)]
            if isinstance(medium, QuantizedPool):  # dequantised block by block, on the compute device
                for row, slot in enumerate(slots):
                    medium.decode_into(slot, gathered[row])
                return gathered
            if medium.tensor.device == cache.device:
                return _gather(medium.tensor, slots, gathered)
            blocks = _gather(medium.tensor, slots, self._window_rows(buffer, piece))  # a host tier under a GPU
        else:
            blocks = self._landed(piece, next(read for read in pending[1] if read[0] == number))
        # Synchronous on purpose: the host window buffer is refilled by the next fetch into
        # it, which must not overwrite bytes an asynchronous copy has not read yet.
        return blocks.to(cache.device)

    def _landed(self, piece: Piece, read) -> torch.Tensor:
        """The window rows of a keyed piece's read once it has landed; a block that proved
        unreadable is reported lost (dropped and counted) and the read raises."""
        cache = self.cache
        _, future, window = read
        try:
            with interruptible_wait():  # a hung disk must not make the call deaf to Ctrl-C
                good = future.result()
        except ReadIOError as error:  # the batch's corrupt chunks are gone all the same: say so
            lost = [b for b, key in zip(piece.ids, piece.keys) if key in error.lost_keys]
            if lost:
                cache.manager.report_lost(piece.tier, lost)
                cache._settle_events()
            raise
        if not bool(np.all(good)):
            lost = [b for b, ok in zip(piece.ids, good) if not ok]
            cache.manager.report_lost(piece.tier, lost)
            cache._settle_events()
            raise RuntimeError(f"{len(lost)} KV block(s) of this sequence proved unreadable on "
                               f"{cache.manager.dirs[piece.tier].name} (corrupt or missing chunk): dropped and counted; "
                               "attention over the rest would be wrong")
        return window


def _runs(offsets: list[int], rows) -> list[tuple[int, int, int]]:
    """``(offset, row, count)`` per maximal run in which both the chunk offsets and the
    source rows go up by one: what one copy per run moves."""
    runs: list[tuple[int, int, int]] = []
    for offset, row in zip(offsets, rows):
        if runs and runs[-1][0] + runs[-1][2] == offset and runs[-1][1] + runs[-1][2] == row:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((offset, row, 1))
    return runs


def _rows_of(blocks: torch.Tensor, rows) -> torch.Tensor:
    """``blocks[rows]`` (a view when ``rows`` is ``range(len(blocks))``, else one gather)."""
    if isinstance(rows, range) and rows == range(blocks.shape[0]):
        return blocks
    return blocks.index_select(0, torch.tensor(list(rows), dtype=torch.long, device=blocks.device))


def _scatter_blocks(blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: list[int]) -> None:
    """Copies ``[m, 1, 2, kv, T, D]`` blocks into blocks ``offsets`` (ascending) of ``[kv, n, T, D]``
    K and V views, converting to their dtype: one ``index_copy_`` per head and K/V, so the
    copies a chunk issues do not grow with how its blocks interleave across tiers."""
    index = torch.tensor(offsets, dtype=torch.long, device=k.device)
    for head in range(k.shape[0]):
        k[head].index_copy_(0, index, blocks[:, 0, 0, head].to(k.dtype))
        v[head].index_copy_(0, index, blocks[:, 0, 1, head].to(v.dtype))


def _joined(reads: list[futures.Future]) -> futures.Future:
    """One future done once every one of ``reads`` is (the read itself when it is alone);
    its result is None: each read's own future holds its outcome."""
    if len(reads) == 1:
        return reads[0]
    joined: futures.Future = futures.Future()
    left = [len(reads)]
    lock = threading.Lock()

    def landed(_: futures.Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            joined.set_result(None)

    for read in reads:
        read.add_done_callback(landed)
    return joined


def _gather(tensor: torch.Tensor, slots: list[int], out: torch.Tensor) -> torch.Tensor:
    """Blocks at ``slots`` of a pool tensor: a view for a contiguous ascending run, else one
    row gather over the flat blocks (a memcpy per block) into ``out``'s first rows."""
    first = slots[0]
    if slots[-1] - first == len(slots) - 1 and slots == list(range(first, first + len(slots))):
        return tensor[first : first + len(slots)]
    index = torch.tensor(slots, dtype=torch.long, device=tensor.device)
    rows = out[: len(slots)]
    torch.index_select(tensor.view(tensor.shape[0], -1), 0, index, out=rows.view(len(slots), -1))
    return rows


def split_kv(blocks: torch.Tensor, k_out: torch.Tensor | None = None,
              v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, 1, 2, kv, T, D]`` blocks -> K and V as ``[kv, n*T, D]`` in the compute dtype
    (one copy that converts and reorders at once), into the leading part of ``k_out`` and
    ``v_out`` (``[kv, >= n*T, D]``) when given."""
    n, _, _, kv_heads, tokens, head_dim = blocks.shape
    if k_out is None:
        k_out = torch.empty((kv_heads, n * tokens, head_dim), dtype=compute_dtype(blocks.dtype), device=blocks.device)
        v_out = torch.empty_like(k_out)
    k, v = _block_views(k_out, v_out, n, tokens)
    _copy_blocks(blocks, k, v, 0)
    return _flat(k), _flat(v)


def _block_views(k_out: torch.Tensor, v_out: torch.Tensor, n: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The leading ``n`` blocks of ``[kv, >= n*T, D]`` K and V buffers as ``[kv, n, T, D]`` views."""
    kv_heads, _, head_dim = k_out.shape
    return (k_out[:, : n * tokens].view(kv_heads, n, tokens, head_dim),
            v_out[:, : n * tokens].view(kv_heads, n, tokens, head_dim))


def _copy_blocks(blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int) -> None:
    """Copies ``[m, 1, 2, kv, T, D]`` blocks into blocks ``first .. first + m`` of ``[kv, n, T, D]``
    K and V views, converting to their dtype: per head, rows of T*D contiguous elements (a
    4-D permuted copy is slow)."""
    end = first + blocks.shape[0]
    for head in range(k.shape[0]):
        k[head, first:end].copy_(blocks[:, 0, 0, head])
        v[head, first:end].copy_(blocks[:, 0, 1, head])


def _flat(blocks: torch.Tensor) -> torch.Tensor:
    """A ``[kv, n, T, D]`` view as ``[kv, n*T, D]``."""
    kv_heads, n, tokens, head_dim = blocks.shape
    return blocks.view(kv_heads, n * tokens, head_dim)
