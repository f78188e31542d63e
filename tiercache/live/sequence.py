"""A decoding sequence of a ``TieredKVCache``: its blocks per layer, appends and attention.

See ``tiercache.live.cache`` for the whole picture. A sequence keeps, per layer, the ids of
its full blocks in order, their key summaries (on the HBM tier's device) and a partial
tail block that is not stored yet; every tier operation goes through the cache's
``StepDriver``, and every record it makes is written to the cache's step trace.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Sequence as Seq

import numpy as np
import torch

from tiercache.attention import Partial, block_summaries, compute_dtype, stream_partial
from tiercache.config import AttentionMode
from tiercache.errors import UserError
from tiercache.keys import block_key, layer_key

from .arguments import attend_blocks, check_kv, check_query, flat_token_ids, integer_or_none
from .chunks import TierChunks
from .cropping import crop
from .forking import fork
from .holding import hold_recorded, release_holds
from .keymap import scratch_key
from .layerstate import LayerState
from .ownership import NoCopies
from .selection import ahead_ids, sparse_positions
from .steps import StepReport, StepReports, step_report
from .summaries import CorruptBlock, keep_summaries, summaries_of
from .writeback import failed_writes, refused_blocks

if TYPE_CHECKING:
    from .cache import TieredKVCache

__all__ = ["Sequence", "StepReport"]

_PRIVATE_NAMESPACE = b"tiercache.private-sequence"


class Sequence(NoCopies):
    """One decoding sequence of a ``TieredKVCache`` (made by ``cache.sequence``).

    Invariants: every full block of every layer is stored in the hierarchy and held once (it
    may move between tiers, never leave) until ``free``, unless lost (unreadable: an orphan hold,
    ``tiercache.core.holds``, released once all the same); each layer's tail holds fewer than
    ``block_tokens`` tokens; ``length(layer)`` tokens of KV were appended (or reused) per layer.
    It cannot be copied or pickled (TypeError): ``fork`` makes a second sequence with its KV.
    """

    copy_refusal = ("a sequence cannot be copied or pickled (it holds blocks of its TieredKVCache); "
                    "to go on from its KV in a second sequence, use seq.fork()")

    def __init__(self, cache: TieredKVCache, tokens, namespace: bytes | str) -> None:
        layout = cache.layout
        self.cache = cache
        self.namespace = namespace
        self._layers = [LayerState(layout.kv_heads, layout.block_tokens, layout.head_dim, cache.dtype, cache.device)
                        for _ in range(layout.layers)]
        self._tokens = np.zeros(0, dtype=np.int64) if tokens is None else flat_token_ids(tokens, "tokens")
        self._content_keys: list[bytes] = []
        self._keyed_end: int | None = None  # content keys only for blocks ending by it (forget_tokens)
        self._private = os.urandom(16)
        self.freed = False
        self._unreleased: list[int] | None = None  # holds a free that raised part-way left to release
        self.reports = StepReports(cache.keep_reports)  # the latest reads' reports (``steps.StepReports``)
        self.cached_tokens = 0
        #: Block positions the last ``attend`` read (every full block in exact mode).
        self.last_positions = np.zeros(0, dtype=np.int64)
        if len(self._tokens):
            with cache.store._lock:
                cache._check_open()  # again, under the lock: a close may have come since sequence()'s check
                self._reuse_prefix(namespace)

    # -- public API ---------------------------------------------------------------------
    def length(self, layer: int = 0) -> int:
        """Tokens of KV the sequence holds at ``layer``."""
        layer = self._check_layer(layer, "Sequence.length")
        state = self._layers[layer]
        return state.n * self.cache.layout.block_tokens + state.tail_len

    def blocks(self, layer: int = 0) -> int:
        """Full (stored) blocks at ``layer``."""
        layer = self._check_layer(layer, "Sequence.blocks")
        return self._layers[layer].n

    @property
    def token_ids(self) -> np.ndarray:
        """The ids of the tokens the sequence knows, by position (the prompt, then what
        ``add_tokens`` added); a read-only view."""
        view = self._tokens.view()
        view.flags.writeable = False
        return view

    def fork(self) -> "Sequence":
        """A second sequence with this one's KV so far: blocks shared, tail copied (``forking``)."""
        return fork(self, Sequence)

    def crop(self, keep: int) -> None:
        """Keeps the first ``keep`` tokens at every layer: later blocks are released (they stay
        stored), the rest of the cut block becomes the tail, later ids are forgotten (``cropping``)."""
        crop(self, keep)

    def forget_tokens(self, keep: int, private: bool = True) -> None:
        """Forgets the ids of the tokens from position ``keep`` on. ``private``: the KV from
        there on depends on more than the ids (an image, embeddings; later tokens attend over
        it), so every block reaching past ``keep`` gets a private key for good, whatever ids
        ``add_tokens`` tells later. ``private=False`` only takes back ids told ahead of their KV.

        Raises:
            UserError: ``keep`` is not an integer, or is below the tokens of KV some layer holds.
        """
        held = max(self.length(layer) for layer in range(len(self._layers)))
        index = integer_or_none(keep)
        if index is None or index < held:
            raise UserError(f"Sequence.forget_tokens: keep must be an integer >= {held} (tokens of KV held), got {keep!r}")
        self._tokens = self._tokens[:index]
        del self._content_keys[index // self.cache.layout.block_tokens :]
        if private:
            self._keyed_end = index if self._keyed_end is None else min(self._keyed_end, index)

    def add_tokens(self, token_ids: Seq[int]) -> None:
        """Tells the sequence the ids of tokens it generated, so the blocks they fill get
        content keys a later request's ``match_prefix`` can find (none past a private
        ``forget_tokens``). ``[n]`` or ``[1, n]`` ids; a batch, or a freed sequence, raises
        UserError (``flat_token_ids``)."""
        self._check_live("add_tokens")
        self._tokens = np.concatenate([self._tokens, flat_token_ids(token_ids, "token_ids")])

    @torch.no_grad()  # KV caching is not differentiable: never keep an autograd graph alive
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Adds ``t >= 1`` tokens of KV at ``layer`` (``k``, ``v``: ``[kv_heads, t, head_dim]``).

        Blocks that fill are stored in the hierarchy (HBM first; the policies demote what
        makes room) and held by the sequence.

        Raises:
            UserError: wrong shape, dtype or device; a layer out of range; a freed sequence;
                more blocks than the tiers hold (nothing is stored or evicted then).
            WriteBackError: a write into NVMe making room failed (a full disk): an OSError (and
                RuntimeError) naming the OS error and its file; nothing was appended.
        """
        cache = self.cache
        with cache.store._lock:
            cache._check_open()
            self._check_live("append")
            layer = self._check_layer(layer, "Sequence.append")
            check_kv(self.cache, k, "k")
            check_kv(self.cache, v, "v")
            if k.shape != v.shape:
                raise UserError(f"Sequence.append: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
            state = self._layers[layer]
            block_tokens = cache.layout.block_tokens
            total = state.tail_len + k.shape[1]
            full = total // block_tokens
            self._check_room(layer, state.n, full)
            if full == 0:
                state.tail[0, :, state.tail_len : total] = k
                state.tail[1, :, state.tail_len : total] = v
                state.tail_len = total
                return
            self._store_blocks(layer, state, *self._full_blocks(state, k, v, full))

    @torch.no_grad()  # KV caching is not differentiable: never keep an autograd graph alive
    def attend(self, layer: int, q: torch.Tensor, mode: AttentionMode = AttentionMode.EXACT,
               budget: float | int | None = None) -> torch.Tensor:
        """Decode attention of ``q`` (``[q_heads, 1, head_dim]``) over the layer's KV.

        Args:
            mode: ``AttentionMode.EXACT`` (every block) or ``AttentionMode.SPARSE``.
            budget: sparse only: blocks to read, as a share of the layer's blocks (a float
                in ``(0, 1]``) or a count (an int >= 1); the sink and recent blocks count and
                are always read (a smaller budget is raised to them: ``selection.read_budget``).

        Returns:
            ``[q_heads, 1, head_dim]`` in the compute dtype: float32 (float64 for float64
            KV), whatever the storage dtype, so 16-bit KV loses no precision in the output;
            the caller casts it back for the next matmul.

        Raises:
            UserError: wrong shape, dtype or device of ``q``; a layer out of range; a freed
                sequence; an empty layer; a mode that is not an ``AttentionMode``; a missing,
                zero or negative budget in sparse mode, or a budget in exact mode.
            RuntimeError: a block of the sequence proved unreadable (a corrupt NVMe chunk:
                it is dropped and counted; attention over the rest would be wrong).
        """
        with self.cache.store._lock:
            check_query(self.cache, q, "Sequence.attend", one_token=True)
            part = self._attend(layer, q, mode, budget, "Sequence.attend")
            return part.out.reshape(q.shape).to(compute_dtype(self.cache.dtype))

    @torch.no_grad()
    def attend_partial(self, layer: int, q: torch.Tensor, mode: AttentionMode = AttentionMode.EXACT,
                       budget: float | int | None = None) -> Partial:
        """Attention of ``t`` query tokens (``q``: ``[q_heads, t, head_dim]``) over every
        token the layer holds, as a ``Partial`` to merge with attention over keys held
        elsewhere (a prefill chunk's own causal keys, which no held token may see yet).

        Every query sees every held token (they all come before the queries). One read of
        the layer serves all ``t`` queries, as in ``attend`` (one step of the step trace).

        Returns:
            A ``Partial`` in the grouped layout: ``out`` ``[kv_heads, group * t, head_dim]``
            (row ``g * t + i``: query head ``kv * group + g``, token ``i``), ``peak`` and
            ``total`` ``[kv_heads, group * t]``; float32 (float64 for float64 KV, or after an
            overflow).

        Raises:
            UserError, RuntimeError: as ``attend``.
        """
        with self.cache.store._lock:
            check_query(self.cache, q, "Sequence.attend_partial", one_token=False)
            return self._attend(layer, q.reshape(-1, 1, q.shape[-1]), mode, budget, "Sequence.attend_partial")

    def _attend(self, layer: int, q: torch.Tensor, mode: AttentionMode, budget, what: str) -> Partial:
        """``attend``'s work for a checked query ``[rows, 1, head_dim]`` (rows a multiple of
        kv_heads), under the store's lock: the merged partial over the layer's blocks and tail.
        Every argument is checked (errors naming ``what``, the public call) before the step
        takes its step number: a refused call changes nothing."""
        cache = self.cache
        cache._check_open()
        self._check_live(what.removeprefix("Sequence."))
        layer = self._check_layer(layer, what)
        state = self._layers[layer]
        count = attend_blocks(mode, budget, state.n, what)
        if state.n == 0 and state.tail_len == 0:
            raise UserError(f"{what}: layer {layer} has no KV yet (append first)")
        step = state.attends
        state.attends += 1
        if count is None:
            positions, candidates = np.arange(state.n), []
        else:
            positions, candidates = self._select(state, q, count)
        self.last_positions = positions
        return self._attend_blocks(layer, step, state, q, mode, positions, candidates)

    def free(self) -> None:
        """Releases the sequence's blocks: they stay cached (a later ``match_prefix`` finds
        the ones with content keys) until the policies evict them. Idempotent."""
        cache = self.cache
        with cache.store._lock:
            if self.freed:
                return
            if cache._closed:
                self.freed = True
                return
            pending = self._held_ids() if self._unreleased is None else self._unreleased
            self._unreleased = self._release(pending)  # one that raised part-way leaves the next free the rest
            self.freed = True
            held = self._held_ids()
            cache._emit(0, cache._last_step, release=tuple(dict.fromkeys(held)))
            for state in self._layers:
                keep_summaries(cache, state)
            self._prune_summaries()
            cache._settle_events()

    def _held_ids(self) -> list[int]:
        """The ids of every full block of every layer (a block held twice appears twice)."""
        return [int(i) for state in self._layers for i in state.ids[: state.n]]

    def _release(self, ids: list[int]) -> list[int]:
        """Releases the sequence's holds on ``ids``, once per listing (orphan holds included:
        ``StepDriver.release``); returns those left to release ([] once done). On an error the
        ones it did release are counted out (and unlisted, ``_list``) and the error re-raised,
        so whatever retries releases only the rest (never another sequence's hold)."""
        owed: list[int] = []
        try:
            release_holds(self.cache, ids, owed.extend)
        except BaseException:
            self._unreleased = owed
            raise
        finally:
            self.cache._list(ids, listed=False)
            self.cache._list(owed)  # still owed: the next free releases them
        return []

    # -- storing --------------------------------------------------------------------------
    def _full_blocks(self, state: LayerState, k: torch.Tensor, v: torch.Tensor, full: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``full`` blocks the tail and the new tokens fill, as ``[full, 1, 2, kv, T, D]``,
        and the leftover tokens (``[2, kv, rest, D]``, the next tail); changes nothing."""
        block_tokens = self.cache.layout.block_tokens
        kv = torch.stack([k, v])  # [2, kv, t, D]
        if state.tail_len:
            kv = torch.cat([state.tail[:, :, : state.tail_len], kv], dim=2)
        used = full * block_tokens
        blocks = kv[:, :, :used].reshape(2, kv.shape[1], full, block_tokens, kv.shape[3]).permute(2, 0, 1, 3, 4)
        return blocks.unsqueeze(1).contiguous(), kv[:, :, used:].clone()

    def _store_blocks(self, layer: int, state: LayerState, blocks: torch.Tensor, rest: torch.Tensor) -> None:
        """Stores full blocks of ``layer`` under their keys, holds them and makes ``rest`` the
        tail, all or nothing (then one write record): a store that raises, an interrupt too,
        leaves the sequence as it was, releases the holds it took and keeps no key it
        registered for a block it did not store.

        A failed call may leave blocks it stored under the sequence's private keys (unheld:
        the policies evict them). A retry must never take one for its own block (a write
        never rewrites a stored key), so a failure gives the sequence new private keys.
        """
        cache = self.cache
        first = state.n
        keys = [self._block_key(first + i, layer) for i in range(blocks.shape[0])]
        kmin, kmax = block_summaries(blocks[:, 0, 0])
        held = cache.manager.held
        ids = cache.store._map.ids(keys, register=True)
        before = {i: held.get(i, 0) for i in ids if i is not None}
        writes = failed_writes(cache.store._media)
        try:
            if any(i is None for i in ids):
                raise UserError("Sequence.append: a block key collides with another key's 63-bit id; the block cannot be stored")
            cache.store._store_new(ids, blocks, lambda: cache.driver.write(ids, hold=ids))
            missing = [i for i in ids if cache.manager.locate(i) is None]
            if missing:  # the OS error of a write-back that failed (a full disk), if one did
                raise refused_blocks(f"Sequence.append: {len(missing)} block(s) of layer {layer} could not be stored",
                                     "nothing was appended", cache.store._media, writes)
            self._keep_tokens(first, layer, ids)
            cache._emit(layer, state.attends, write=tuple(ids), hold=tuple(ids))
            cache._settle_events()
            state.add(ids, keys, kmin, kmax)  # the commit (``n`` is set last): nothing below raises
        except BaseException:  # an interrupt too: no hold without a sequence that releases it
            self._private = os.urandom(16)
            cache.store._map.forget_absent(before, cache.manager.locate)
            cache.driver.release([i for i in before if held.get(i, 0) > before[i]])
            raise
        cache._list(ids)
        state.tail[:, :, : rest.shape[2]] = rest
        state.tail_len = rest.shape[2]

    def _block_key(self, index: int, layer: int) -> bytes:
        """Layer key of block ``index``: content-chained when its tokens are known."""
        block_tokens = self.cache.layout.block_tokens
        known = len(self._tokens) if self._keyed_end is None else min(len(self._tokens), self._keyed_end)
        while len(self._content_keys) <= index and known >= (len(self._content_keys) + 1) * block_tokens:
            n = len(self._content_keys)
            parent = self._content_keys[-1] if n else None
            self._content_keys.append(block_key(parent, self._tokens[n * block_tokens : (n + 1) * block_tokens], self.namespace))
        if index < len(self._content_keys):
            return layer_key(self._content_keys[index], layer)
        return scratch_key(self._private + _PRIVATE_NAMESPACE, index, layer)  # scratch: never persisted

    def _keep_tokens(self, first: int, layer: int, ids: list[int]) -> None:
        """Keeps layer 0's token ids of content-keyed blocks (confirms later prefix hits)."""
        if layer != 0:
            return
        block_tokens = self.cache.layout.block_tokens
        tokens = self.cache.store._map.tokens
        for offset, block_id in enumerate(ids):
            index = first + offset
            if index < len(self._content_keys):
                tokens[block_id] = self._tokens[index * block_tokens : (index + 1) * block_tokens].copy()

    def _check_room(self, layer: int, first: int, count: int) -> None:
        """Refuses blocks the hierarchy cannot hold next to every live sequence's blocks (a
        block another sequence holds already, under the same content key, needs no room)."""
        cache = self.cache
        ids = cache.store._map.ids([self._block_key(first + i, layer) for i in range(count)], register=False)
        new_blocks = sum(1 for block_id in ids if block_id not in cache.manager.held)
        held, capacity = len(cache.manager.held), cache.capacity_blocks
        if new_blocks and held + new_blocks > capacity:
            missing = held + new_blocks - capacity
            raise UserError(f"Sequence.append: {new_blocks} new block(s) do not fit: live sequences hold {held} of the "
                            f"tiers' {capacity} blocks; {missing} more block(s) ({missing * cache.layout.block_bytes} bytes) "
                            "are needed (grow a tier, or free sequences)")

    def _reuse_prefix(self, namespace: bytes | str) -> None:
        """Starts from the stored prefix of the prompt: holds its blocks (one record). A block
        whose chunk proves corrupt while its summary is read is reported lost, and the prefix
        is looked up again (it ends before that block)."""
        cache = self.cache
        usable = (len(self._tokens) - 1) // cache.layout.block_tokens  # leave a token to compute
        rows = None
        while rows is None:
            found, keys = cache._stored_blocks(self._tokens, namespace)
            found = min(found, usable)
            rows = self._prefix_rows(keys, found)
        self._content_keys = keys[:]
        if found == 0:
            return
        held = [i for ids, _, _, _ in rows for i in ids]
        for state, row in zip(self._layers, rows):
            state.add(*row)
        hold_recorded(cache, held)
        self.cached_tokens = found * cache.layout.block_tokens

    def _prefix_rows(self, keys: list[bytes], found: int) -> list | None:
        """Per layer, the ids, keys and summaries of the first ``found`` stored blocks; None
        if a block proved corrupt (it is reported lost: look the prefix up again)."""
        rows = []
        for layer in range(len(self._layers)):
            lkeys = [layer_key(keys[b], layer) for b in range(found)]
            ids = self.cache.store._map.ids(lkeys, register=False)
            try:
                rows.append((ids, lkeys, *summaries_of(self.cache, ids, lkeys)))
            except CorruptBlock as lost:
                self.cache.manager.report_lost(lost.tier, [lost.block_id])
                self.cache._settle_events()
                return None
        return rows

    def _prune_summaries(self) -> None:
        """Forgets kept summaries of blocks that left the hierarchy (bounded by what it holds)."""
        cache = self.cache
        if len(cache._summaries) > 2 * cache.capacity_blocks:
            for block_id in [b for b in cache._summaries if cache.manager.locate(b) is None]:
                del cache._summaries[block_id]

    # -- reading --------------------------------------------------------------------------
    def _select(self, state: LayerState, q: torch.Tensor, count: int) -> tuple[np.ndarray, list[int]]:
        """Block positions a sparse step reads (ascending) and the next-ranked candidates (``selection``)."""
        return sparse_positions(self.cache, state, q, count)

    def _ahead(self, layer: int, mode: AttentionMode) -> list[int]:
        """Ids the next layer reads first that are not in HBM (for prefetch policies; ``selection``)."""
        return ahead_ids(self.cache, self._layers, layer, mode)

    def _attend_blocks(self, layer: int, step: int, state: LayerState, q: torch.Tensor, mode: AttentionMode,
                       positions: np.ndarray, candidates: list[int]) -> Partial:
        """Reads the blocks at ``positions`` through the driver and attends over them and the tail."""
        cache = self.cache
        exact = mode is AttentionMode.EXACT
        ids = state.ids[positions].tolist()  # block order: attention merges in it, wherever the blocks lie
        keys = state.keys if exact else [state.keys[p] for p in positions.tolist()]  # exact: every block, in order
        # a sparse read is made (and recorded) by tier, fastest first: one promotion per tier
        read = ids if exact else state.ids[self._by_tier(state, positions)].tolist()
        ahead = self._ahead(layer, mode)
        ticket = cache.driver.open_read(read) if read else None
        try:
            if ticket is not None:
                cache.driver.run_read(ticket, step, layer, read, exact, candidates, ahead)
            extra = [(state.tail[0, :, : state.tail_len], state.tail[1, :, : state.tail_len])] if state.tail_len else []
            out = self._stream(q, ids, keys, extra)
        finally:
            if ticket is not None:  # the reads (and moves) happened even if the policy or attention failed: record them
                cache.driver.end_read(ticket)
                if ticket.accessed:
                    cache._emit(layer, step, read=tuple(read), in_place=exact, candidates=tuple(candidates), ahead=tuple(ahead))
        self.reports.append(step_report(cache, layer, step, mode, ticket, len(ids), state.tail_len))
        cache._settle_events()
        return out

    def stream_source(self, layer: int) -> "TierChunks":
        """The chunk source an exact read of ``layer`` streams from (for benchmarks that
        time its fetches and its compute apart); valid until the next call that moves
        blocks.

        Raises:
            UserError: a closed cache, a freed sequence or a layer out of range.
        """
        with self.cache.store._lock:
            self.cache._check_open()
            self._check_live("stream_source")
            layer = self._check_layer(layer, "Sequence.stream_source")
            state = self._layers[layer]
            return TierChunks(self.cache, state.ids[: state.n].tolist(), state.keys)

    def _by_tier(self, state: LayerState, positions: np.ndarray) -> np.ndarray:
        """``positions`` reordered by the tier holding them, fastest first (stable): the
        order a sparse step reads and records its blocks in, so promotions batch per tier
        (attention still merges them in block order)."""
        located = [self.cache.manager.locate(int(b)) for b in state.ids[positions]]
        if None in located:
            raise RuntimeError(f"block {int(state.ids[positions][located.index(None)])} of this sequence is no longer "
                               "stored (lost: unreadable)")
        tiers = np.asarray(located, dtype=np.int64)
        return positions[np.argsort(tiers, kind="stable")]

    def _stream(self, q: torch.Tensor, ids: list[int], keys: list[bytes], extra) -> Partial:
        """Exact attention over the blocks ``ids`` wherever they lie, plus ``extra`` chunks."""
        cache = self.cache
        source = TierChunks(cache, ids, keys)
        dtype = compute_dtype(cache.dtype)
        return stream_partial(q, cache.layout.kv_heads, source, source.n_chunks, cache.depth, extra, dtype)

    # -- checks ---------------------------------------------------------------------------
    def _check_live(self, what: str) -> None:
        if self.freed:
            raise UserError(f"Sequence.{what}: the sequence was freed")

    def _check_layer(self, layer: int, what: str) -> int:
        """``layer`` as an int in ``[0, layers)``: any integer (a numpy one, a 0-d integer
        tensor), never a bool. Raises UserError naming ``what`` otherwise."""
        layers = self.cache.layout.layers
        index = integer_or_none(layer)
        if index is None or not 0 <= index < layers:
            raise UserError(f"{what}: layer must be an integer in [0, {layers}), got {layer!r}")
        return index

