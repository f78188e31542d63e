"""``TieredKVStore``: the live KV store over real HBM, DRAM and NVMe tiers.

A composition root: it wires a ``KeyMap`` (content keys), the ``TierManager`` (every
decision), a ``LocalEngine`` (bytes, through one copy handler per medium pair) and the media.
The same manager that ``tiercache replay`` drives with ``SimEngine`` runs here: identical
policies, identical decisions, real bytes. The manager sees each key's stable 63-bit id; the
full 16-byte key is compared on every lookup, so two keys sharing an id are never confused.

Asynchrony: ``prefetch`` and ``access(wait=False)`` return a ``Pending`` handle with the moves
still in flight; ``wait(pending)``, ``poll`` or any later read completes them, always through
the manager (there is no plan lifecycle outside it). A block is visible in a tier only once
its bytes landed there.

A ``remote`` tier (Mooncake Store, ``remote.RemoteLink``) completes lookups the local tiers
miss. Thread safety: one lock serialises every public method; I/O threads touch only bytes.
Durability: ``flush``/``close`` make the NVMe index durable; reopening adopts every complete block
but scratch ones (``keymap.is_scratch``), which it deletes."""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
from typing import Sequence

import numpy as np
import torch

from tiercache.config import Codec, KVLayout, TierConfig
from tiercache.core.guards import parent_map, request_hints
from tiercache.core.manager import TierManager
from tiercache.core.plans import EventLog, TransferPlan
from tiercache.data.buffers import check_blocks, shares_memory
from tiercache.data.engine import LocalEngine
from tiercache.errors import UserError
from tiercache.keys import prefix_keys

from .arguments import check_flag, prompt_tokens
from .keymap import KeyMap
from .lookups import LookupCounts
from .lifecycle import (PersistError, Persisted, PersistWarning, Rank, adopt_stored_blocks, check_release, check_store,
                        drop_scratch, flush_and_close, keep_retained, persist_to_nvme, run_every_step, save_order)
from .pending import Pending
from .reading import StoreReads
from .ownership import NoCopies, OwnerGuard
from .media import (check_host_memory, check_layout, check_online, check_remote_write, check_tiers, close_quietly, make_policies,
                    manager_readers, open_media, resolve_device, value_limit)
from .remote import RemoteLink
from .traffic import Traffic

__all__ = ["TieredKVStore", "Pending", "PersistError", "PersistWarning"]


class TieredKVStore(StoreReads, NoCopies):
    """Put, find and get KV blocks across HBM, DRAM and NVMe.

    Args:
        layout: the KV layout (block shape and dtype).
        tiers: ``TierConfig`` per tier, fastest first (``hbm``, optional ``dram``, optional
            ``nvme``, optional ``remote`` with its ``RemoteConfig``); capacities in blocks.
        eviction: eviction policy name for every tier (overrides the TierConfigs' own).
        admission: admission policy of the lower tiers (overrides the TierConfigs' own).
        path: directory of the NVMe store (required with an ``nvme`` tier).
        device: device of the HBM tier (default: CUDA when available, else the CPU).
        write_through: inclusive hierarchy instead of the default exclusive one.

    Invariants (``check_invariants``): the key map holds exactly the resident blocks; every
    block the NVMe tier's directory holds is stored in the NVMe store (which chooses its
    physical slots itself, and keeps the copies of blocks read up out of it as long as the
    tier has free slots: ``engine.RetainedCopies``); the manager's own invariants. A
    constructor that raises leaves nothing open (every name is checked before the media open).
    ``adopted`` lists the blocks a reopen adopted, ``(tier name, ids)`` per tier, in the
    order its policy was told of them (``lifecycle.adopt_stored_blocks``).
    """

    def __init__(self, layout: KVLayout, tiers: Sequence[TierConfig], eviction: str | None = None, admission: str | None = None,
                 path: str | os.PathLike | None = None, device: str | None = None, write_through: bool = False) -> None:
        check_layout(layout)
        check_flag(write_through, "TieredKVStore: write_through")
        write_through = bool(write_through)  # numpy's bool too
        check_tiers(tiers, path, layout)
        check_remote_write(tiers, write_through)
        check_online(eviction, tiers)
        device = resolve_device(device)
        check_host_memory(layout, tiers, device)
        remote, hits = tiers[-1].remote, {}
        evictions, admissions = make_policies(tiers, eviction, admission, hits)  # names checked before anything opens
        self.layout = layout
        self.tier_block_bytes = [t.codec.block_bytes(layout) for t in tiers]  # per tier: its codec's, scales included
        self.tier_quantised = [t.codec is not Codec.NONE for t in tiers]  # per tier: stores blocks with a codec
        self.value_limit = value_limit(tiers)  # what a quantised tier can hold (None: no quantised tier)
        self._lock = OwnerGuard()  # one call at a time, by this process only; Ctrl-C deferred to its end
        self._token = secrets.randbits(63)  # marks this store's Pending handles (their job ids are its own)
        self._map = KeyMap()
        self._media = open_media(tiers, layout, path, device)
        try:  # a constructor that raises returns no store to close: nothing it opened may stay open
            self.engine = LocalEngine(self._media, self._map.key_of)
            self.events = EventLog(record_departures=True)
            self.manager = TierManager([(t.name, t.capacity_blocks) for t in tiers], evictions, admissions, engine=self.engine,
                                       events=self.events, write_through=write_through, shared_last=remote is not None)
            if not write_through:  # a block read up out of NVMe keeps its durable copy there (LocalEngine)
                self.engine.retain_moved_up(*manager_readers(self.manager))
            self._remote = None if remote is None else RemoteLink(self.manager, self._map, self._media[-1], remote, hits)
            self._stats = Traffic.for_store(tiers, self.tier_block_bytes, self.engine, self.manager)
            self.token_mismatches, self.refreshes, self._closed = 0, 0, False
            self._lookups = LookupCounts()  # what lookup and match_prefix answered (the prefix-cache hit ratio)
            self.adopted = adopt_stored_blocks(self.manager, self._media, self._map, self.events)  # (tier, ids) at open
        except BaseException:
            close_quietly(self._media)
            raise

    @property
    def guard(self) -> OwnerGuard:
        """The store's call guard (one call at a time; ``guard.if_free`` for finalizers)."""
        return self._lock

    @property
    def collisions(self) -> int:
        """Keys refused because their 63-bit id belongs to another stored key."""
        return self._map.collisions

    # -- storing -------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], kv_blocks: torch.Tensor) -> int:
        """Stores blocks ``kv_blocks[i]`` under ``keys[i]``; returns how many of the call's new
        keys are stored when it returns. A new block that could not be placed (every HBM slot
        pinned, a write-back that failed on a full disk, a key whose id another key holds), or
        that the call's own later placements pushed out again (a batch larger than the room left), is
        not counted: a caller sees a refused put in the return value, and the reason in ``stats()``.

        The caller holds every block's bytes (it just computed them), so none is ever read from a tier
        (``TierManager.store_fresh``). A key already stored in HBM is refreshed there (touched in its
        eviction policy, as a hit there is; nothing rewritten: a key names its content). One held in a lower
        local tier is stored in HBM from these bytes, no load charged, its stale copy released (kept in
        write-through), as a recomputed block moves up in a replay's prefix semantics; where no room can be
        made in HBM it stays, touched, where it lies. Neither is counted as a hit or a read
        (``stats()["refreshes"]`` counts them). A key only the remote tier's view lists (an entry nobody
        checked: the store may have lost the value) is a new key here: stored locally from these bytes, its
        entry then leaving the view, so ``through`` publishes it again (a no-op where the store holds it);
        it counts in the return value once so stored, never on the strength of the entry. An old block the
        call's own new blocks pushed out of the hierarchy is stored again from these bytes. A stored key's
        bytes must be the ones stored under it (not compared): with other bytes, which copy a later ``get``
        returns is not defined. If the copy of new bytes fails, nothing of the failed blocks is kept and the
        error propagates; blocks placed before it stay stored.
        With a remote tier under ``through`` the call's keys are published as one prefix, from the first
        (``RemoteLink.stored``): never a block whose parent key the store lacks.

        Raises:
            UserError: keys not bytes or repeated; blocks of the wrong dtype or shape.
        """
        keys = self._map.check_keys(keys, "TieredKVStore.put")
        check_blocks(kv_blocks, self.layout, len(keys), "TieredKVStore.put kv_blocks", limit=self.value_limit)
        if len(set(keys)) != len(keys):
            raise UserError("TieredKVStore.put: a key appears twice in one call")
        with self._lock:
            self._check_open()
            ids = self._map.ids(keys, register=True)
            valid = [n for n, block_id in enumerate(ids) if block_id is not None]
            new_ids = [ids[n] for n in valid if not self._held_locally(ids[n])]  # a view entry alone is new here
            placed = set(new_ids)
            old = [ids[n] for n in valid if ids[n] not in placed]
            unchecked = {block_id for block_id in new_ids if self.manager.locate(block_id) is not None}  # view entries
            checked: list[int] = []
            parents = parent_map(self.manager.policies, ids)  # the call's keys as one request, as a read gives them

            def insert_then_refresh() -> None:
                checked.extend(self.manager.store_fresh(new_ids, parents))  # view entries replaced by local copies
                # Then the old ones: refreshed in HBM, or stored there from these staged bytes, one the new ones
                # pushed out too; that may push out some of the new ones again (counted only if they stay).
                self.manager.store_fresh(old, parents)
                self.refreshes += len(old)

            try:
                self._store_new([ids[n] for n in valid], self._staged(kv_blocks, valid, len(ids)), insert_then_refresh)
                # stored anywhere (a block the call's inserts pushed down into the remote tier was
                # written there), but never on the strength of a view entry nobody checked
                unchecked.difference_update(checked)
                stored = [b for b in new_ids if self.manager.locate(b) is not None and b not in unchecked]
                if self._remote is not None:  # the call's blocks from its start, up to a collision
                    self._remote.stored(ids[: ids.index(None)] if None in ids else ids)
                return len(stored)
            finally:  # interrupted too: the keys of blocks evicted to make room are forgotten
                self._consume()

    def _staged(self, kv_blocks: torch.Tensor, valid: list[int], n: int) -> torch.Tensor:
        """The rows ``valid`` of a put's ``n`` blocks (no copy when all are), copied where they lie
        in one of the store's pools: the call's own fills may land in the slots they lie in."""
        staged = kv_blocks if len(valid) == n else kv_blocks[valid]
        return staged.clone() if any(shares_memory(staged, pool) for _, pool in self._pool_memory()) else staged

    def _held_locally(self, block_id: int) -> bool:
        """Whether a local tier (not the remote tier's view) holds ``block_id``."""
        tier = self.manager.locate(block_id)
        return tier is not None and tier != self.manager.shared

    def access(self, keys: Sequence[bytes], kv_blocks: torch.Tensor, wait: bool = True) -> Pending:
        """Reads ``keys`` in order exactly as ``tiercache replay`` does (object semantics).

        Hits are touched and promoted; misses are stored from ``kv_blocks`` (aligned with
        ``keys``; a replay knows every block's bytes). This is what makes a trace replayed
        through the live store give the same per-tier hits as the simulator. With ``wait``
        False promotions are left in flight and returned as a handle (``wait`` not a bool: UserError).
        """
        keys = self._map.check_keys(keys, "TieredKVStore.access")
        check_flag(wait, "TieredKVStore.access: wait")
        check_blocks(kv_blocks, self.layout, len(keys), "TieredKVStore.access kv_blocks", limit=self.value_limit)
        with self._lock:
            self._check_open()
            ids = self._map.ids(keys, register=True)
            if any(i is None for i in ids):
                raise UserError("TieredKVStore.access: a key collides with another key's id")
            plans: list[TransferPlan] = []
            try:
                hints = request_hints(self.manager.policies, ids)  # each id's parent, as a replay gives it
                self._store_new(ids, kv_blocks, lambda: plans.extend(self.manager.access(ids, hints, wait=wait)))
            finally:  # interrupted too: the keys of blocks evicted to make room are forgotten
                self._consume()
            return self._pending(plans)

    def _store_new(self, ids: list[int], kv_blocks: torch.Tensor, run) -> None:
        """Runs a manager call that may place ``ids`` with their bytes staged; whatever it
        did not place (refused, failed, interrupted) leaves no key behind."""
        self.engine.stage(ids, kv_blocks)
        try:
            run()
        finally:
            self.engine.unstage(ids)
            self._map.forget_absent(ids, self.manager.locate)

    def put_tokens(self, token_ids: Sequence[int], kv_blocks: torch.Tensor, namespace: bytes | str = b"") -> int:
        """Stores the KV of a prompt's full blocks under their chained keys; returns how many
        were new. The blocks' token ids are kept, so ``match_prefix`` confirms hits by
        comparing tokens, not by trusting the hash alone. ``token_ids`` as the decode cache
        takes them (``arguments.flat_token_ids``): ``[n]``, or an ``input_ids`` tensor of one
        row ``[1, n]``; a batch is refused (``UserError``)."""
        tokens = prompt_tokens(token_ids, namespace, "TieredKVStore.put_tokens")
        keys = prefix_keys(tokens, block_tokens := self.layout.block_tokens, namespace)
        with self._lock:
            new = self.put(keys, kv_blocks)
            for index, block_id in enumerate(self._map.ids(keys, register=False)):
                if block_id is not None and self.manager.locate(block_id) is not None:
                    self._map.tokens[block_id] = tokens[index * block_tokens : (index + 1) * block_tokens].copy()
            return new

    # -- finding -------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[str | None]]:
        """Length of the stored prefix of ``keys``, and the tier holding each key (or None).

        Counted in ``stats()["lookups"]``: the prefix's blocks as hits, the rest as misses."""
        keys = self._map.check_keys(keys, "TieredKVStore.lookup")
        with self._lock:
            found, names = self._find(keys)
            self._lookups.count(len(keys), found)
            return found, names

    def _find(self, keys: list[bytes]) -> tuple[int, list[str | None]]:
        """``lookup``'s answer, counted nowhere (the caller holds the lock and counts)."""
        self._check_open()
        ids = self._map.ids(keys, register=False)
        confirmed = self._remote is None or self._remote.refresh_prefix(keys, ids)  # ask the store what we miss
        if self._remote is not None:
            self._consume()
        tiers = [None if i is None else self.manager.locate(i) for i in ids]
        tiers = tiers if confirmed else [None if t == self._remote.tier else t for t in tiers]  # no answer: misses
        names = [None if t is None else self.manager.dirs[t].name for t in tiers]
        prefix = next((n for n, name in enumerate(names) if name is None), len(names))
        return prefix, names

    def match_prefix(self, token_ids: Sequence[int], namespace: bytes | str = b"") -> int:
        """How many leading tokens of this prompt are stored (whole blocks only).

        A block put with ``put_tokens`` counts only if its stored token ids equal the
        prompt's (a mismatch under an equal key is counted in ``stats()["token_mismatches"]``);
        blocks put by key alone, or adopted from NVMe on reopen, are confirmed by their full
        16-byte key. Counted in ``stats()["lookups"]`` once, in blocks: the prompt's full blocks
        asked about, the confirmed ones as hits (a serving engine's prefix-cache hit ratio).
        """
        tokens = prompt_tokens(token_ids, namespace, "TieredKVStore.match_prefix")
        keys = prefix_keys(tokens, block_tokens := self.layout.block_tokens, namespace)
        with self._lock:
            found, _ = self._find(keys)
            for index, block_id in enumerate(self._map.ids(keys[:found], register=False)):
                stored = self._map.tokens.get(block_id)
                if stored is not None and not np.array_equal(stored, tokens[index * block_tokens : (index + 1) * block_tokens]):
                    self.token_mismatches += 1
                    found = index
                    break
            self._lookups.count(len(keys), found)
            return found * block_tokens

    # -- asynchronous moves --------------------------------------------------------------
    def prefetch(self, keys: Sequence[bytes]) -> Pending:
        """Starts bringing stored blocks up to HBM without waiting; returns the handle.

        Room in HBM is made at once (victims demoted as usual); the copies run in the
        background (NVMe I/O threads, or the CUDA copy stream) and are published by
        ``wait``, ``poll`` or the next read. Until then lookups find the blocks where they
        were. Unknown keys and blocks already in HBM are skipped.
        """
        keys = self._map.check_keys(keys, "TieredKVStore.prefetch")
        with self._lock:
            self._check_open()
            found = self._reachable_ids(keys, settle=False)
            parents = parent_map(self.manager.policies, found)  # a key not found breaks the chain, as in put
            ids = [i for i in found if i is not None]
            with self.manager.passing_full_tiers():  # the blocks are wanted in HBM: no read in place
                plans = self.manager.prefetch(ids, parents=parents)
            self._stats.consume(self.events.drain())
            self._forget_departed()
            return self._pending(plans)

    def wait(self, pending: Pending | None = None) -> None:
        """Completes the moves of ``pending`` (every move in flight when None).

        Moves already completed (by ``poll`` or a read) are skipped: a handle never dangles.
        A handle another store returned is refused (UserError): its job ids are that store's.
        """
        if pending is not None and not isinstance(pending, Pending):
            raise TypeError(f"TieredKVStore.wait: pending must be a Pending (from put or prefetch) or None, "
                            f"got {type(pending).__name__}")
        if pending is not None and pending.job_ids and pending.owner != self._token:
            raise UserError("TieredKVStore.wait: pending was not made by this store (another store's, or one "
                            "made by hand: job ids are numbered per store); pass it to the wait of the store "
                            "whose put or prefetch returned it")
        with self._lock:
            self._check_open()
            if pending is None:
                self.manager.wait_all()
            else:
                for job_id in pending.job_ids:
                    self.manager.wait(job_id)
            self._consume()

    def poll(self) -> int:
        """Publishes finished background copies; returns how many jobs finished."""
        with self._lock:
            self._check_open()
            finished = self.manager.poll()
            self._consume()
            return len(finished)

    def _pending(self, plans: list[TransferPlan]) -> Pending:
        return Pending(tuple(p.job_id for p in plans), sum(p.n_blocks for p in plans),
                       tuple(self.engine.event_of(p.job_id) for p in plans), owner=self._token)

    # -- readers -------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> None:
        """Marks blocks as read by a live sequence until ``release``: never evicted, nor moved
        down the hierarchy (no tier picks them as victims; a read may still promote them)."""
        keys = self._map.check_keys(keys, "TieredKVStore.pin")
        with self._lock:
            self._check_open()
            self.manager.ref(self._map.stored_ids(keys, self.manager.locate, "TieredKVStore.pin"))

    def release(self, keys: Sequence[bytes]) -> None:
        """Undoes ``pin``.

        Raises:
            CountError: releasing more than was pinned (counts never go negative); the
                whole call then changes nothing.
            KeyError: a key is neither stored nor pinned (a pinned block that was lost
                since is still released).
        """
        keys = self._map.check_keys(keys, "TieredKVStore.release")
        with self._lock:
            self._check_open()
            ids = self._map.ids(keys, register=False)
            check_release(self.manager, keys, ids)
            self.manager.unref(ids)

    # -- reporting and lifetime ----------------------------------------------------------
    def stats(self) -> dict:
        """Per-tier hits (``hits_in_place`` of them read where they lie), inserts, evictions,
        moves; bytes that crossed each link, moves and reads in place (``traffic.Traffic``), and
        moves that wrote nothing (``retained_takeups``, ``shared_already_held``); queue depth; NVMe stats.

        ``hits`` and ``misses`` count the blocks reads asked for (``access``, ``get``,
        ``get_prefix``, ``get_slots``): served from a tier (a hit there) or not (a miss, counted
        before a read raises for it). ``lookups`` counts what ``lookup`` and ``match_prefix``
        answered (``LookupCounts``: the prefix-cache hit ratio); ``refreshes`` the blocks ``put``
        found already stored in a local tier (neither a read nor a hit)."""
        with self._lock:
            self._check_open()
            self._consume()
            names = self._stats.names
            nvme = self._media[names.index("nvme")].stats.copy() if "nvme" in names else None
            return {**self._stats.summary(), "queue_depth": self.engine.inflight, "key_collisions": self.collisions,
                    "token_mismatches": self.token_mismatches, "lookups": self._lookups.as_dict(),
                    "refreshes": self.refreshes, "nvme": nvme,
                    "remote": None if self._remote is None else self._remote.snapshot()}

    def flush(self) -> None:
        """Makes every NVMe block written so far durable; with a remote tier, starts again the
        publications that failed (``RemoteLink.retry_unpublished``: once the store answers)."""
        with self._lock:
            self._check_open()
            for medium in self._media:
                medium.flush()
            if self._remote is not None:
                self._remote.retry_unpublished()
                self._consume()

    def close(self, persist: bool = True) -> int:
        """Finishes in-flight work, makes the NVMe tier durable and closes it; idempotent. In a
        child forked while the store was open: nothing, returns 0 (the parent still owns the store).

        Scratch blocks (``KeyMap.scratch``: a decode sequence's private keys, which nothing
        can name after close) are first deleted from every tier, NVMe included, the deletion
        flushed (``drop_scratch``), so their NVMe slots are free. With ``persist`` (default),
        the other blocks held only in DRAM and HBM are then moved to free NVMe slots (DRAM
        first, then HBM; nothing already on NVMe is evicted for them), so a reopened store
        holds as much as fits; without it they are dropped, but blocks read up out of NVMe
        keep their NVMe copies (``keep_retained``). Every step runs even if an earlier one failed
        (what can be flushed is flushed). A flush that fails is tried again when the NVMe
        tier closes; if that succeeds, nothing was lost and no error is raised
        (``flush_and_close``). Returns how many blocks were persisted.

        Raises:
            Exception: the first error a step raised, once every step has run. Closing the
                NVMe tier is the last step: its ``OSError`` (naming the store) means the flush
                failed twice, so nothing written since the last successful flush, blocks
                persisted here included, is durable; the store reopens with what that made durable.
            PersistError: every step ran, but some blocks could not be written to NVMe (a
                full disk); an ``OSError`` whose ``saved``, ``failed`` and ``left_out``
                count the blocks held only in HBM/DRAM that reopen, those whose write
                failed and those that did not fit, its message quoting the OS error."""
        return self._close(persist).count()

    def _close(self, persist: bool, rank: Rank | None = None) -> Persisted:
        """``close``, returning what the persist did (``Persisted()``: nothing, or not
        persisting) instead of its count; raises as ``close`` but for ``PersistError``.

        ``rank`` (a ``TieredKVCache``'s: ``cache.WriteRanks.of``) orders the persist
        (``persist_to_nvme``), and after it the NVMe tier's order file is written
        (``save_order``, with ``persist`` or not), before the final flush; without it the
        persist goes by directory order and the order file, if any, is left as it is."""
        check_flag(persist, "TieredKVStore.close: persist")  # None or "no" would read as a choice
        if not self._lock.owned:
            return Persisted()
        with self._lock.closing():
            if self._closed:
                return Persisted()
            self._closed = True
            persisting = self._persist if rank is None else functools.partial(self._persist, rank)
            steps = [self.manager.wait_all, self._consume, self._drop_scratch, persisting if persist else self._keep_retained,
                     self.engine.retained.drop_all, lambda: flush_and_close(self._media)]
            if rank is not None:
                steps.insert(4, lambda: save_order(self.manager, self._media, self._map, rank))
            return run_every_step(steps)[3]

    def _drop_scratch(self) -> None:
        """Deletes the scratch blocks from every tier and flushes NVMe (``drop_scratch``)."""
        drop_scratch(self.manager, self._media, list(self._map.scratch))
        self.events.drain()  # shutting down is not traffic
        self._forget_departed()

    def _persist(self, rank: Rank | None = None) -> Persisted:
        """Moves unpinned DRAM and HBM blocks but scratch ones into free NVMe slots, in
        ``rank``'s order when given (``persist_to_nvme``); a failure's reason names the
        NVMe store's directory."""
        done = persist_to_nvme(self.manager, self.events, self._map.scratch, rank)
        if done.reason is None:
            return done
        nvme = [d.name for d in self.manager.dirs].index("nvme")  # a reason means a write into it failed
        return dataclasses.replace(done, reason=f"{self._media[nvme].path}: {done.reason}")

    def _keep_retained(self) -> Persisted:
        """Closing without persisting: the blocks read up out of NVMe keep their NVMe copies
        (``keep_retained``)."""
        return keep_retained(self.manager, self.events, self._map.scratch)

    def __enter__(self) -> "TieredKVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_invariants(self) -> None:
        """Asserts the manager, the key map and the NVMe tier agree (UserError once closed)."""
        with self._lock:
            self._check_open()
            check_store(self.manager, self._map, self._media, self.engine)

    # -- internals -----------------------------------------------------------------------
    def _consume(self) -> None:
        """Applies finished moves, counts the events, forgets blocks that left."""
        self.manager.poll()
        self._stats.consume(self.events.drain())
        self._forget_departed()
        self.engine.end_call()

    def _forget_departed(self) -> None:
        departed = self.events.drain_departed()
        self._map.forget_absent(departed, self.manager.locate)
        if self._remote is not None:
            self._remote.departed(departed)

    def _check_open(self) -> None:
        if self._closed:
            raise UserError("TieredKVStore: the store is closed")
