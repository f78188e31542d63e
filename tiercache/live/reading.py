"""The reading half of ``TieredKVStore``: ``get``, ``get_slots``, ``get_prefix`` and the HBM
pool. A mixin of the store (it uses the store's lock, key map, manager, media and remote link);
it exists to keep the store's module short, and is not used on its own.

Every read settles the moves in flight first (``_settle``): a block a prefetch found
unreadable is then reported as a missing key, never served and never left in the key map.
Every block a read asks for is counted: a hit in the tier that serves it, or a miss
(``stats()["misses"]``), counted before a read raises for it. An ``out=`` is checked before
anything is looked up or read (``check_out``: nor may it lie in a pool of the store).
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from tiercache.core.guards import pick_hints, request_hints
from tiercache.core.plans import Ev
from tiercache.data.buffers import check_out
from tiercache.data.pools import BlockPool
from tiercache.data.quantized import QuantizedPool
from tiercache.errors import UserError

from .reachable import reachable_ids
from .reads import read_blocks

__all__ = ["StoreReads"]


class StoreReads:
    """``TieredKVStore``'s reads (see the module docstring)."""

    def get(self, keys: Sequence[bytes], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks of ``keys`` as one tensor on the HBM tier's device, promoting them.

        ``out`` (``[len(keys), *block_shape]`` on the HBM device), when given, receives the
        blocks: a serving loop reuses one buffer instead of allocating (and first-touching)
        a new tensor per call. ``get_slots`` gives the zero-copy alternative. Moves still in
        flight (prefetches) are completed first, so the read sees the final placement.

        Raises:
            UserError: ``out`` of the wrong dtype, shape or device, an inference tensor outside inference mode,
                one whose elements share memory (``expand``), or one lying in a pool of this store
                (a slice of ``hbm_tensor``): refused before anything is looked up or read.
            KeyError: a key is not stored (each such key counted as a miss, the others counted
                nothing: none is read), or its stored copy proved unreadable (corrupt
                NVMe chunk: dropped and counted, never returned as data). A read that failed
                with an I/O error, or got no answer from the remote store, raises
                ``ReadIOError`` (a KeyError and OSError) naming the block: the block stays.
        """
        keys = self._map.check_keys(keys, "TieredKVStore.get")
        with self._lock:
            self._check_open()
            self._check_out(out, len(keys), "TieredKVStore.get out")
            ids = self._reachable_ids(keys)
            missing = [k for k, i in zip(keys, ids) if i is None or self.manager.locate(i) is None]
            if missing:
                self._count_misses(len(missing))
                raise KeyError(f"{len(missing)} of {len(keys)} keys are not stored (first: {missing[0].hex()})")
            held, found_in = self._promote_for_read(ids, hold=True)
            try:
                blocks = self._gather(keys, ids, out)
            except BaseException as exc:  # the read serves nothing: a block unreadable (ReadIOError too) misses,
                # unless the promotion already counted its loss as one
                self._count_served(held, found_in, 0, misses=int(isinstance(exc, KeyError) and None not in found_in))
                raise
            self._count_served(held, found_in, len(ids))
            return blocks

    def get_slots(self, keys: Sequence[bytes]) -> list[int]:
        """Promotes the blocks of ``keys`` and returns their HBM slots (zero copy).

        The slots index ``hbm_tensor``; pin the keys first if the blocks must stay there
        while a kernel reads them. A key not stored, or whose block could not be brought to
        HBM (no room, or unreadable), raises KeyError naming it; keys not stored are counted
        as misses first, the stored keys of a call that raises nothing (none is read: their
        hits, and a declined promotion's read in place, are taken back; moves that ran stay counted).
        A quantised HBM tier raises UserError before anything is moved or counted: its slots hold
        encoded bytes, nothing a kernel can read in place (``hbm_tensor`` refuses it too).
        """
        keys = self._map.check_keys(keys, "TieredKVStore.get_slots")
        with self._lock:
            self._check_open()
            if isinstance(hbm := self._media[0], QuantizedPool):
                raise UserError(f"TieredKVStore.get_slots: the HBM tier is quantised ({hbm.codec.value}): its slots hold "
                                "encoded bytes, not blocks to read in place; use get, which decodes them")
            self._settle()  # as get: a block a move found unreadable is reported not stored
            ids = self._map.ids(keys, register=False)
            self._count_misses(sum(i is None or self.manager.locate(i) is None for i in ids))
            ids = self._map.stored_ids(keys, self.manager.locate, "TieredKVStore.get_slots")
            self._promote_for_read(ids, to_hbm=True)
            top = self.manager.dirs[0].slot_of
            absent = [k for k, i in zip(keys, ids) if i not in top]
            if absent:
                raise KeyError(f"TieredKVStore.get_slots: key {absent[0].hex()} could not be brought to HBM (no room, or unreadable)")
            return [top[i] for i in ids]

    def get_prefix(self, keys: Sequence[bytes], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks of the longest readable prefix of ``keys`` (``get`` of that prefix):
        a block missing or unreadable (a remote value corrupt or evicted, a master that does
        not answer: that block stays in the view) ends it instead of raising. ``out`` holds
        ``len(keys)`` blocks (checked as ``get`` checks it); a view of the filled part is returned.
        The blocks from the first not stored on are misses, as a replay's prefix semantics counts
        a request's blocks past its first miss."""
        keys = self._map.check_keys(keys, "TieredKVStore.get_prefix")
        with self._lock:
            self._check_open()
            self._check_out(out, len(keys), "TieredKVStore.get_prefix out")
            ids = self._reachable_ids(keys, prefix=True)
            n = next((p for p, i in enumerate(ids) if i is None or self.manager.locate(i) is None), len(ids))
            self._count_misses(len(ids) - n)
            held, found_in = self._promote_for_read(ids[:n], hold=True)
            present = next((p for p, i in enumerate(ids[:n]) if self.manager.locate(i) is None), n)
            if out is not None:
                out = out[:present]
            try:
                blocks = self._gather(keys[:present], ids[:present], out, partial=True)
            except BaseException:
                self._count_served(held, found_in, 0)
                raise
            self._count_served(held, found_in, len(blocks), misses=sum(t is not None for t in found_in[len(blocks):]))
            return blocks

    def _check_out(self, out: torch.Tensor | None, count: int, what: str) -> None:
        """``check_out`` of a caller's ``out`` (None: nothing to check) against this store's
        pools: no result may be written over the slots of stored blocks."""
        if out is not None:
            check_out(out, self.layout, count, what, self._pool_memory())
            if out.device != self.hbm_device:
                raise UserError(f"{what}: on {out.device}, but this store returns blocks on its hbm tier's device, "
                                f"{self.hbm_device}; pass a tensor on {self.hbm_device}")

    def _pool_memory(self) -> list[tuple[str, torch.Tensor]]:
        """The memory of every pool of this store (a plain pool's, header room included; a
        quantised one's encoded bytes), each named as ``check_out`` says it."""
        names = [directory.name for directory in self.manager.dirs]
        pools = []
        for index, (name, medium) in enumerate(zip(names, self._media)):
            if isinstance(medium, BlockPool):
                pools.append((f"the store's {name} pool" + (" (hbm_tensor)" if index == 0 else ""), medium.host_buffer))
            elif isinstance(medium, QuantizedPool):
                pools.append((f"the store's {name} pool", medium.encoded))
        return pools

    def _count_misses(self, count: int) -> None:
        """Counts ``count`` blocks a read asked for and could not serve as misses."""
        if count:
            self.events.emit(Ev.MISS, 0, count)

    def _reachable_ids(self, keys: list[bytes], settle: bool = True, prefix: bool = False) -> list[int | None]:
        """``reachable_ids`` of this store (``prefix``: of a prefix read); with ``settle`` (a read)
        the moves in flight are ``_settle``d first."""
        if settle:
            self._settle()
        return reachable_ids(self._map, self.manager, self._remote, keys, prefix)

    def _settle(self) -> None:
        """Completes and applies the moves in flight before a read looks its keys up: a block a move found
        unreadable is dropped and its key forgotten (the read reports it not stored; the key map stays exact)."""
        self.manager.wait_all()
        self._consume()

    def _promote_for_read(self, ids: list[int], to_hbm: bool = False,
                          hold: bool = False) -> tuple[list[tuple[int, int, int, int]], list[int]]:
        """Promotes the blocks a read asks for, as the policy says, never at their expense: each is
        referenced while the promotions run, so making room for one can never push another out of
        the hierarchy (what does not fit in HBM is read where it is). Moves in flight are ``_settle``d
        first; a block one of them lost is neither referenced nor counted (``read_blocks`` reports it).
        With ``to_hbm`` (``get_slots``, which serves blocks in HBM only) a call that leaves one of them
        below HBM reads nothing: the promotions' hits are not counted (``_uncount_hits``).

        Returns:
            With ``hold``, the promotions' events, in order and not yet counted, and for each
            block accessed (in access order) the tier it was found in, None for one the promotion
            found unreadable (counted a miss there): the read counts them with ``_count_served``
            once it knows how many blocks it served. Else ``([], [])``: counted.
        """
        self._settle()
        kept = [k for k, i in enumerate(ids) if self.manager.locate(i) is not None]
        accessed = [ids[k] for k in kept]
        hints = request_hints(self.manager.policies, ids)  # each id's parent in the request, as a replay's
        hints = None if hints is None else pick_hints(hints, kept)
        found_in = [self.manager.locate(i) for i in accessed] if hold else []
        distinct = list(dict.fromkeys(accessed))
        self.manager.ref(distinct)
        held: list[tuple[int, int, int, int]] = []
        accessed_all = False
        try:
            if to_hbm:  # served from HBM only: a run read in place would serve nothing
                with self.manager.passing_full_tiers():
                    self.manager.access(accessed, hints, store_misses=False)
            else:
                self.manager.access(accessed, hints, store_misses=False)
            accessed_all = True
        finally:
            self.manager.unref(distinct)
            if to_hbm and not all(i in self.manager.dirs[0].slot_of for i in ids):
                self._uncount_hits()
            if hold and accessed_all:  # an access that raised is counted as it went, now
                held = self.events.drain()
                found_in = _counted_tiers(held, len(accessed)) or found_in
            try:
                self._consume()
            except BaseException:  # interrupted: the held events are counted by the next call, as they are
                for event in held:
                    self.events.emit(*event)
                raise
        return held, found_in

    def _count_served(self, held: list[tuple[int, int, int, int]], found_in: list[int], served: int,
                      misses: int = 0) -> None:
        """Counts a read's held events (``_promote_for_read``) once it served the first ``served``
        blocks it accessed: the hits of the others (a remote value the store no longer had, a
        master that did not answer) are taken back, from the latest hits of the tier each was
        found in, so no hit, read in place or link charge is counted for bytes never read; moves
        that ran stay counted, and so do the misses of blocks the promotion found unreadable
        (``found_in`` None: no hit of theirs to take back). ``misses`` more are counted."""
        unserved = Counter(t for t in found_in[served:] if t is not None)
        kept = []
        for kind, tier, count, aux in reversed(held):
            if kind == Ev.HIT and unserved[tier]:
                taken = min(count, unserved[tier])
                unserved[tier] -= taken
                count -= taken
            kept.append((kind, tier, count, aux))
        for kind, tier, count, aux in reversed(kept):
            self.events.emit(kind, tier, count, aux)
        self._count_misses(misses)
        self._consume()

    def _uncount_hits(self) -> None:
        """Drops the ``HIT`` events not yet counted (a read that raises serves none): no hit is
        counted, nor read in place and charged on a link (``InPlaceHits`` counts hits only); the
        other events (moves that ran, promotions skipped, blocks lost) stay, in order."""
        for kind, tier, count, aux in self.events.drain():
            if kind != Ev.HIT:
                self.events.emit(kind, tier, count, aux)

    @property
    def hbm_tensor(self) -> torch.Tensor:
        """The HBM pool ``[slots, *block_shape]`` at ``get_slots``'s slots (a quantised HBM or a closed store raises UserError)."""
        with self._lock:
            self._check_open()
            return self._media[0].tensor

    hbm_device = property(lambda self: self._media[0].device, doc="The HBM tier's device (where ``get`` returns blocks).")

    def _gather(self, keys: Sequence[bytes], ids: list[int], out: torch.Tensor | None, partial: bool = False) -> torch.Tensor:
        """``read_blocks`` from this store's tiers (see there)."""
        return read_blocks(self.manager, self._media, self.layout, keys, ids, out, partial, self._drop_unreadable)

    def _drop_unreadable(self, tier: int, block_id: int) -> None:
        """A block that proved unreadable where it lies (read in place, so the manager did not see the read)
        leaves the hierarchy, counted as lost, as on a failed promotion: no lookup may report it stored afterwards."""
        if self._remote is not None and tier == self._remote.tier:
            self._remote.drop_unreadable(block_id)
        else:
            self.manager.report_lost(tier, [block_id])
        self._consume()


def _counted_tiers(events: list[tuple[int, int, int, int]], n: int) -> list[int | None] | None:
    """The tier each of an access's ``n`` blocks was counted a hit in (None: a miss, a block
    its promotion found unreadable), read off the access's own events: its ``HIT`` and
    ``MISS`` events cover its blocks in order, each run of one tier (within a run its misses
    follow its hits, a tier being all a run's blocks share). None when they do not add up
    to ``n`` (then the tiers the blocks lay in before the access stand in)."""
    tiers: list[int | None] = []
    for kind, tier, count, _ in events:
        if kind == Ev.HIT:
            tiers += [tier] * count
        elif kind == Ev.MISS:
            tiers += [None] * count
    return tiers if len(tiers) == n else None
