"""``TieredKVCache``: the decode-loop API over the live tiers.

One cache owns one ``TieredKVStore`` (the same tiers, manager, media and keys) and hands out
sequences. A sequence keeps, per layer, the ids of its full blocks in order, their key
summaries (per-channel min/max, in the HBM tier's device memory) and a partial tail block
that is not stored yet. Blocks are per layer (``KVLayout.per_layer``): layer ``l`` of block
``b`` is keyed by ``layer_key(block key, l)``, so each layer's blocks move on their own. A
block whose tokens are known (a prompt given to ``sequence(tokens=...)``, or tokens added
with ``add_tokens``) is keyed by its chained content key, so a later request's
``match_prefix`` finds it once the sequence is done; other blocks get private keys (scratch:
``keymap.scratch_key``), which ``close`` deletes from every tier instead of persisting.

Every tier operation goes through ``StepDriver`` (``tiercache.core.decode``), the protocol
``tiercache replay`` runs on a recorded step trace: records wait for earlier moves, reads
are referenced while read, prefetch policies plan from what the step read, writes are held
by their sequence. A live run recorded with ``record=`` therefore replays to the same
per-tier counts.

A decode step per layer is ``seq.append(layer, k, v)`` then ``seq.attend(layer, q, mode)``:

* ``EXACT`` reads every block in place (nothing is promoted by a streaming read): the
  blocks are cut, in sequence order, into chunks of ``window_blocks``; a chunk's blocks on
  NVMe are read by the store's I/O threads into ``depth`` window buffers while earlier
  chunks compute (``tiercache.attention.stream_attention``), its blocks in DRAM and HBM are
  read where they are. The result equals dense attention, and since the chunks do not
  depend on where the blocks lie, the same KV gives the same bits whatever the tiers and
  the prefetch policy did (``SPARSE`` too: it attends over its blocks in sequence order).
* ``SPARSE`` scores every block's summary, keeps the sink and recent blocks and the top of
  the rest up to ``budget`` (a share of the blocks, or a count), promotes them to HBM (the
  policies decide what makes room) and attends over them alone. The prefetch policy then
  brings up what the next step will likely read (``topk_speculative``: the blocks ranked
  right after the cut).

Thread safety: one lock (the store's) serialises every call; a Ctrl-C during a call is
raised when it has finished (``tiercache.live.guard``).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import replace
from typing import IO, Collection, Sequence as Seq

import numpy as np
import torch

from tiercache.attention import compute_dtype
from tiercache.config import AttentionMode, KVLayout, TierConfig
from tiercache.core.decode import StepDriver
from tiercache.core.holds import held_capacity
from tiercache.data.buffers import normal_tensors, torch_dtype
from tiercache.data.pools import BlockPool
from tiercache.errors import UserError
from tiercache.keys import layer_key, prefix_keys
from tiercache.policies import make_prefetch
from tiercache.sim.steptrace import HEADER_FIELD, StepRecord, step_json

#: Block ids per ``resident`` record a recording writes (a line of about 1.4 MB at most, far
#: below what trace readers take).
RESIDENT_CHUNK = 1 << 16

from .cachechecks import check_options, refuse_gated_copies, refuse_remote
from .chunks import split_kv
from .lifecycle import UNRANKED, ordered_ids
from .ownership import NoCopies
from .arguments import check_flag, flat_token_ids
from .sequence import Sequence, StepReport
from .store import PersistWarning, TieredKVStore

__all__ = ["TieredKVCache", "Sequence", "StepReport", "AttentionMode", "PersistWarning", "split_kv", "WriteRanks"]


class WriteRanks:
    """The order a cache's close persists its blocks in and a smaller reopen keeps them in
    (``lifecycle.persist_to_nvme``'s ``rank``, ``orderfile.save_order``): a log of writes.

    A block's rank is ``ordinal * layers + layer`` of its latest write, ``ordinal`` counting
    the blocks written at that layer before it (scratch ones too, though they are not
    logged). A sequence writes each layer's blocks in position order, so by rank its blocks
    come position by position, every layer of a position together, earlier positions first;
    those of different sequences in the order they were written. Whatever a cut keeps of
    them is then whole positions of each sequence's prefix: ``kept // layers`` positions.
    That pairing assumes each layer's writes come from the sequences in one order (a decode
    loop runs the batch's sequences in the same order at every layer, as the ``transformers``
    integration does). Where they do not, or an append stopped part-way through the layers
    (the layers' counts then differ), layers of different positions share ranks and a cut
    may keep torn positions: fewer tokens served, never wrong KV (a prefix hit needs every
    layer). Blocks adopted on opening that the order file names rank first, in its order
    (``seed``). Memory: 16 bytes a logged write (numpy arrays of ids and ranks), compacted to
    the blocks still stored once the log holds twice what the tiers hold and twice what it
    kept last time (``compact_if_due``); no object per block.
    """

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.written = [0] * layers  # per layer: blocks written at it so far (the next ordinal)
        self.ids = np.zeros(0, dtype=np.int64)
        self.ranks = np.zeros(0, dtype=np.int64)
        self.n = 0  # entries of ``ids``/``ranks`` in use
        self._kept = 0  # entries the last compaction kept (``compact_if_due``)

    def seed(self, ids: np.ndarray) -> None:
        """Ranks ``ids`` (adopted on opening, in the order file's order) ``0, 1, ...``; every
        later write ranks after them."""
        self._log(ids, np.arange(len(ids), dtype=np.int64))
        self.written = [-(-len(ids) // self.layers)] * self.layers

    def wrote(self, layer: int, ids: Seq[int], scratch: Collection[int]) -> None:
        """Logs a write of ``ids`` (consecutive positions) at ``layer``; scratch ids are
        counted, not logged (a close never persists them)."""
        first = self.written[layer]
        self.written[layer] += len(ids)
        logged = [n for n, block_id in enumerate(ids) if block_id not in scratch]
        if logged:
            ordinals = first + np.asarray(logged, dtype=np.int64)
            self._log(np.asarray(ids, dtype=np.int64)[logged], ordinals * self.layers + layer)

    def _log(self, ids: np.ndarray, ranks: np.ndarray) -> None:
        """Appends entries, growing the arrays by doubling."""
        need = self.n + len(ids)
        if need > len(self.ids):
            size = max(need, 2 * len(self.ids), 64)
            self.ids, self.ranks = np.resize(self.ids, size), np.resize(self.ranks, size)
        self.ids[self.n : need], self.ranks[self.n : need] = ids, ranks
        self.n = need

    def compact_if_due(self, stored: Collection[int], capacity: int) -> None:
        """Compacts (``compact``) once the log holds twice ``capacity`` (what the tiers hold)
        and twice what it kept at its last compaction: the blocks still stored can outnumber
        ``capacity`` (a write-through hierarchy's, whose upper tiers hold blocks the last one
        lost), and a threshold below them would compact at every write. So at least as many
        writes as the log keeps come between two compactions: amortised O(1) per write."""
        if self.n > 2 * max(capacity, self._kept):
            self.compact(stored)
            self._kept = self.n

    def compact(self, stored: Collection[int]) -> None:
        """Keeps one entry, the latest, of each block in ``stored`` (the ids a tier holds)."""
        ids, ranks = self._latest()
        keep = np.isin(ids, np.fromiter(stored, dtype=np.int64, count=len(stored)))
        self.ids, self.ranks, self.n = ids[keep], ranks[keep], int(keep.sum())

    def _latest(self) -> tuple[np.ndarray, np.ndarray]:
        """The logged ids, ascending, each once, with its latest write's rank (its largest:
        a layer's ordinals only grow, and seeded ranks lie below them all)."""
        order = np.lexsort((self.ranks[: self.n], self.ids[: self.n]))
        ids, ranks = self.ids[order], self.ranks[order]
        last = np.append(ids[1:] != ids[:-1], True) if len(ids) else np.zeros(0, dtype=bool)
        return ids[last], ranks[last]

    def of(self, block_ids: Seq[int]) -> np.ndarray:
        """Each of ``block_ids``' rank (``UNRANKED`` for a block never logged): a ``lifecycle.Rank``."""
        ids, ranks = self._latest()
        query = np.asarray(block_ids, dtype=np.int64)
        if not len(ids):
            return np.full(len(query), UNRANKED, dtype=np.int64)
        at = np.minimum(np.searchsorted(ids, query), len(ids) - 1)
        return np.where(ids[at] == query, ranks[at], UNRANKED)


def _open_record(record: str | os.PathLike, block_tokens: int, adopted: Seq[tuple[str, Seq[int]]]) -> IO[str]:
    """The step-trace file ``record`` opened for writing, its ``block_tokens`` header written,
    then the blocks the store ``adopted`` when it opened, where they lie (``resident`` records
    of at most ``RESIDENT_CHUNK`` ids, in the order adopted): a replay places them before the
    first step, so their reads replay as the hits they were.
    Line-buffered: every record line is in the file once written, so a forked child holds no
    unwritten lines of the parent's to write out again when it exits, and a killed process
    leaves whole lines.

    Raises:
        UserError: it is not a path (an int would be taken as a file descriptor the caller
            owns, and closed at close), or it cannot be opened (naming ``record=``, the path
            and the OS's reason).
    """
    if not isinstance(record, (str, bytes, os.PathLike)):
        raise UserError(f"TieredKVCache: record must be a path (str or os.PathLike), got {type(record).__name__} {record!r}")
    try:
        f = open(record, "w", encoding="utf-8", buffering=1)  # noqa: SIM115 - closed by TieredKVCache.close()
    except OSError as exc:
        raise UserError(f"TieredKVCache: record={os.fspath(record)!r} cannot be written: {exc.strerror or exc}") from None
    f.write(f'{{"{HEADER_FIELD}": {block_tokens}}}\n')
    for tier, ids in adopted:
        for start in range(0, len(ids), RESIDENT_CHUNK):
            placed = ((tier, tuple(ids[start : start + RESIDENT_CHUNK])),)
            f.write(step_json(StepRecord(0, 0, (), (), resident=placed)) + "\n")
    return f


class TieredKVCache(NoCopies):
    """KV of decoding sequences over HBM, DRAM and NVMe tiers.

    Args:
        layout: the model's KV layout; blocks are per layer whatever ``layout.per_layer``
            says (the cache uses ``replace(layout, per_layer=True)``).
        tiers: ``TierConfig`` per tier, fastest first, capacities in per-layer blocks.
        eviction, admission: policy names for every tier (default: the TierConfigs').
        prefetch: prefetch policy name (``none``, ``layer_ahead``, ``topk_speculative``); None is
            ``none``.
        path: directory of the NVMe store (required with an ``nvme`` tier).
        device: device of the HBM tier (default: CUDA when available, else the CPU).
        record: write the step trace of every tier operation here (JSONL, with a
            ``block_tokens`` header, then the blocks adopted on opening as ``resident``
            records); ``tiercache replay`` of it reproduces the counts.
        window_blocks: blocks per chunk of a streamed read.
        depth: chunk buffers in the window (chunk ``i+1..i+depth-1`` fetch while ``i``
            computes); the window holds ``depth * window_blocks`` blocks.
        sink_blocks, recent_blocks: blocks a sparse step always keeps at the start and end.
        speculate: how many blocks ranked right after a sparse selection become the prefetch
            candidates, as a share of the blocks the step reads, rounded up (``topk_speculative``
            brings them up); 0: none (the policy then brings up only the next layer's first reads).
        write_through: inclusive hierarchy: every block is written to every tier when
            stored, so a promotion copies up and an upper tier's victim is simply dropped
            (reads never write back); the last tier then bounds what live sequences hold.
        keep_reports: ``StepReport``s each sequence keeps in ``seq.reports``, its latest
            reads' (``steps.StepReports``; 0: none, ``sys.maxsize``: all), so a decode of
            any length keeps bounded memory.

    Only the process that opened it may use it: in a forked child every call raises UserError
    and ``close`` does nothing. It cannot be copied or pickled (TypeError).

    Raises:
        UserError: a bad layout, tier list, policy name or option (named).
    """

    copy_refusal = ("a cache cannot be copied or pickled (it owns its store's tiers and its sequences' blocks); "
                    "to use its blocks in another process, open a TieredKVCache on the same path there, once this one is "
                    "closed (close() keeps the content-keyed blocks, in NVMe's free slots)")

    def __init__(self, layout: KVLayout, tiers: Seq[TierConfig], eviction: str | None = None, admission: str | None = None,
                 prefetch: str | None = "topk_speculative", path: str | os.PathLike | None = None, device: str | None = None,
                 record: str | os.PathLike | None = None, window_blocks: int = 64, depth: int = 2,
                 sink_blocks: int = 1, recent_blocks: int = 1, write_through: bool = False, speculate: float = 0.5,
                 keep_reports: int = 1024) -> None:
        check_options(window_blocks, depth, sink_blocks, recent_blocks, speculate, keep_reports)
        refuse_remote(tiers)
        refuse_gated_copies(tiers, admission, write_through)
        self.layout = replace(layout, per_layer=True) if isinstance(layout, KVLayout) else layout
        self.prefetch_policy = make_prefetch(prefetch)
        self.window_blocks, self.depth = window_blocks, depth
        self.sink_blocks, self.recent_blocks = sink_blocks, recent_blocks
        self.speculate = float(speculate)
        self.keep_reports = keep_reports
        self._window: BlockPool | None = None
        self._scratches: list | None = None
        self._summaries: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._listed: dict[int, int] = {}  # per block: listings by sequences not freed (``_list``)
        self._last_step = 0
        self._record: IO[str] | None = None
        self._closed = False
        self.store = TieredKVStore(self.layout, tiers, eviction, admission, path, device, write_through)
        try:  # a constructor that raises returns no cache to close: nothing it opened may stay open
            self.manager = self.store.manager
            self.driver = StepDriver(self.manager, self.prefetch_policy)
            self.device = self.store.hbm_device
            self.dtype = torch_dtype(self.layout.dtype)
            self._ranks = WriteRanks(self.layout.layers)  # the persist order (``close``)
            self._ranks.seed(ordered_ids(self.store._media, self.store._map))
            if record is not None:
                self._record = _open_record(record, self.layout.block_tokens, self.store.adopted)
        except BaseException:
            with contextlib.suppress(Exception):  # the error to report is the one that stopped the constructor
                self.store.close(persist=False)
            raise

    # -- sequences ----------------------------------------------------------------------
    def sequence(self, tokens: Seq[int] | np.ndarray | None = None, namespace: bytes | str = b"") -> "Sequence":
        """A new sequence; with ``tokens`` (the prompt) it starts from the longest stored
        prefix of them: ``seq.cached_tokens`` tokens are already there, and the caller
        appends KV from that position on. At least one prompt token is always left to
        compute (the model needs its logits)."""
        self._check_open()
        return Sequence(self, tokens, namespace)

    def match_prefix(self, tokens: Seq[int] | np.ndarray, namespace: bytes | str = b"") -> int:
        """How many leading tokens of ``tokens`` are stored for every layer (whole blocks).

        ``tokens`` is checked as ``sequence(tokens=...)`` checks it: one sequence's ids, any
        integer array-like of shape ``[n]`` or ``[1, n]`` (an ``input_ids`` tensor of one row).

        Raises:
            TypeError: ``tokens`` are not integers (floats, bools); ValueError: an id does
                not fit in int64. Both name ``tokens``. UserError: a batch (``[b, n]``,
                ``b > 1``), which would otherwise be answered for its rows run together.
        """
        token_ids = flat_token_ids(tokens, "tokens")
        with self.store._lock:
            self._check_open()
            return self._stored_blocks(token_ids, namespace)[0] * self.layout.block_tokens

    def _stored_blocks(self, tokens: np.ndarray, namespace: bytes | str) -> tuple[int, list[bytes]]:
        """Number of leading full blocks of ``tokens`` stored in every layer (confirmed by
        token ids where they were kept), and the content keys of all full blocks."""
        block_tokens = self.layout.block_tokens
        keys = prefix_keys(tokens, block_tokens, namespace)
        keymap, manager = self.store._map, self.manager
        for index, key in enumerate(keys):
            ids = keymap.ids([layer_key(key, layer) for layer in range(self.layout.layers)], register=False)
            if any(i is None or manager.locate(i) is None for i in ids):
                return index, keys
            stored = keymap.tokens.get(ids[0])
            if stored is not None and not np.array_equal(stored, tokens[index * block_tokens : (index + 1) * block_tokens]):
                self.store.token_mismatches += 1
                return index, keys
        return len(keys), keys

    # -- reporting and lifetime ---------------------------------------------------------
    def stats(self) -> dict:
        """The store's per-tier counters (hits, promotions, bytes...), once every move in
        flight has landed (as at the end of a replay of the recorded trace)."""
        with self.store._lock:
            self._check_open()
            self.driver.settle()
            return self.store.stats()

    def flush(self) -> None:
        """Makes the NVMe blocks written so far durable, once every move in flight has landed.

        A decode writes to NVMe as the tiers spill (a prompt's blocks pushed down by later
        ones), but the NVMe index is durable only at a flush or ``close``: after a crash (a
        SIGKILL, a power loss) a cache reopened on the same path reuses the content-keyed
        blocks of the last flush, whole and checked, and nothing written after it. Call it
        after a prefill, or every few steps, where a crash must not cost the prompts.
        """
        with self.store._lock:
            self._check_open()
            self.driver.settle()
            self.store.flush()

    def close(self, persist: bool = True) -> int:
        """Finishes moves, closes the record file and the store; idempotent. Returns how many
        content-keyed blocks it persisted (0 with ``persist=False``, closed, or in a child).

        Blocks under private keys are scratch (``KeyMap.scratch``): no later request can name
        them, so close deletes them from every tier, their NVMe copies too (a decode's that
        spilled, every one under ``write_through``), never writes them, and a reopen never
        adopts one. With ``persist`` (default, and ``with``'s exit), the content-keyed blocks
        held only in DRAM and HBM (a prompt's, and those of ids told with ``add_tokens``: what
        a later ``match_prefix`` can find) then move into free NVMe slots, those the scratch
        held included (``TieredKVStore.close``), so a cache reopened on the same path, in this
        process or another, reuses them as far as they fit; those that do not fit (NVMe's
        blocks are not evicted for them) are counted in a ``PersistWarning``. A prefix hit
        needs every layer of a block, so they move in ``WriteRanks``' order, every layer of
        a block position together, earlier positions first: what fits is whole positions of
        each prefix (``saved // layers`` of them, more where a decode had spilled some of
        their layers to NVMe: the earliest positions are completed first; spilled blocks keep
        their slots). Then the NVMe tier's order file lists every block there in that order,
        spilled ones included (``orderfile.save_order``), and a reopen on a smaller NVMe
        tier keeps the first ones, so again whole positions. Not guaranteed: blocks the file
        does not name (stored since the last close when a crash ended the run, or by a
        ``TieredKVStore``) come after, by slot, and layers pair up by write order
        (``WriteRanks``: a loop whose layers run their sequences in different orders may
        keep torn positions, costing tokens served, never correctness).
        ``persist=False`` drops all that DRAM and HBM hold (a block read up out of NVMe keeps
        its NVMe copy). In a child forked while the cache
        was open it does nothing (the parent still owns the cache).

        Raises:
            PersistError: some blocks' writes failed (a full disk), as ``TieredKVStore.close``.
        """
        check_flag(persist, "TieredKVCache.close: persist")  # before anything is closed: a retry works
        if not self.store.guard.owned:
            return 0
        with self.store._lock.closing():  # whole, even under Ctrl-C (``guard.CallGuard``)
            if self._closed:
                return 0
            self._closed = True
            try:
                persisted = self.store._close(persist, self._ranks.of)
            finally:
                if self._record is not None:
                    self._record.close()
            saved = persisted.count()  # PersistError: its message counts those left out too
            if persisted.left_out:
                warnings.warn(PersistWarning(saved, persisted.left_out), stacklevel=2)
            return saved

    def __enter__(self) -> "TieredKVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_invariants(self) -> None:
        """The store's invariants, plus: every held block is resident, and each block's holds,
        orphan ones (lost while held) included, number the listings of it by sequences not
        freed yet (``_listed``): none was released for a sequence that still lists it.

        One call under the store's (reentrant) lock, as every other: both parts see the same
        state, never one that another thread's append or free is part-way through.

        Raises:
            UserError: the cache is closed (or used in a forked child).
            AssertionError: an invariant does not hold (naming the block).
        """
        with self.store._lock:
            self._check_open()
            self.store.check_invariants()
            manager = self.manager
            for block_id in manager.held:
                assert manager.locate(block_id) is not None, f"held block {block_id} is not resident"
            holds = {b: manager.hold_count(b) for b in set(manager.held).union(manager.orphan_holds)}
            for block_id in set(holds).union(self._listed):
                listed, counted = self._listed.get(block_id, 0), holds.get(block_id, 0)
                assert listed == counted, f"block {block_id}: live sequences list it {listed} times, {counted} holds"

    # -- internals shared by sequences -------------------------------------------------
    def _check_open(self) -> None:
        self.store.guard.check_owner()
        if self._closed:
            raise UserError("TieredKVCache: the cache is closed")

    @property
    def capacity_blocks(self) -> int:
        """Blocks the hierarchy holds in all: the sum of the tiers when exclusive, the last
        tier's capacity when write-through (every block has a copy there)."""
        return held_capacity([d.capacity for d in self.manager.dirs], self.manager.write_through)

    def _list(self, ids: Seq[int], listed: bool = True) -> None:
        """Counts one more (``listed``) or one fewer listing of each of ``ids`` by a sequence:
        a tally ``check_invariants`` compares with the holds, counted where a sequence takes
        a block into its lists (a write, a reused prefix, a fork) or releases it (``free``).
        It never raises: a count never goes below zero, and one at zero is forgotten."""
        for block_id in ids:
            count = self._listed.get(block_id, 0) + (1 if listed else -1)
            if count > 0:
                self._listed[block_id] = count
            else:
                self._listed.pop(block_id, None)

    def _emit(self, layer: int, step: int, **fields) -> None:
        """Writes one step record (steps never decrease through the file), and logs a
        record's ``write`` (a sequence's new blocks of ``layer``, in position order) in the
        persist order (``WriteRanks``, compacted when due: ``compact_if_due``)."""
        self._last_step = max(self._last_step, step)
        written = tuple(fields.pop("write", ()))
        if written:
            self._ranks.wrote(layer, written, self.store._map.scratch)
            self._ranks.compact_if_due(self.store._map.keys, self.capacity_blocks)
        if self._record is not None:
            record = StepRecord(self._last_step, layer, tuple(fields.pop("read", ())), written, **fields)
            self._record.write(step_json(record) + "\n")

    def _settle_events(self) -> None:
        """Feeds the manager's events to the store's counters and forgets departed keys
        (without polling: only ``StepDriver`` completes moves, at record boundaries). Ends a
        call as the store's own calls end (``RetainedCopies.end_call``): the blocks noted as
        having left NVMe during it are forgotten, or they grew by every block that ever left."""
        store = self.store
        store._stats.consume(store.events.drain())
        store._forget_departed()
        store.engine.end_call()

    def device_bytes(self) -> int:
        """Bytes of device memory the cache holds now: its HBM tier's pool (when the HBM tier
        is on the cache's device) and the read window's buffers, once a read allocated them."""
        hbm = self.store._media[0]
        pool = getattr(hbm, "tensor", getattr(hbm, "encoded", None))  # a plain or a quantised pool
        held = pool.numel() * pool.element_size() if isinstance(pool, torch.Tensor) and pool.device == self.device else 0
        scratch = sum(t.numel() * t.element_size() for buffers in self._scratches or () for t in buffers)
        return held + scratch

    def _window_pool(self) -> BlockPool:
        """Host buffers NVMe chunks are read into (page aligned for O_DIRECT; a normal tensor
        even when first needed under ``torch.inference_mode()``, as every pool is)."""
        if self._window is None:
            self._window = BlockPool(self.layout, self.window_blocks * self.depth, "cpu", pin_memory=self.device.type == "cuda")
        return self._window

    def _scratch(self, buffer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Window buffer ``buffer``'s device memory, allocated once: a block gather target
        ``[W, *block_shape]`` and K and V in the compute dtype, ``[kv, W*T, D]`` (fresh
        allocations per chunk would page-fault their way through every step). Normal tensors
        even when first needed under ``torch.inference_mode()``: every later step writes them
        in place, in inference mode or not."""
        if self._scratches is None:
            layout, width = self.layout, self.window_blocks
            dtype = compute_dtype(self.dtype)
            rows = (layout.kv_heads, width * layout.block_tokens, layout.head_dim)
            with normal_tensors():
                self._scratches = [
                    (torch.empty((width, *layout.block_shape), dtype=self.dtype, device=self.device),
                     torch.empty(rows, dtype=dtype, device=self.device), torch.empty(rows, dtype=dtype, device=self.device))
                    for _ in range(self.depth)]
        return self._scratches[buffer]
