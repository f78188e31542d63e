"""A live store's durable state: adopting stored blocks on reopen (in the order file's order,
``orderfile``), persisting what the volatile tiers hold into NVMe on close (and the close
sequence itself), and checking that the media hold what the manager says."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable, Collection, Sequence

import numpy as np

from tiercache.core.counts import CountError
from tiercache.core.manager import TierManager
from tiercache.core.plans import EventLog
from tiercache.data.chunkio import open_file
from tiercache.data.engine import LocalEngine
from tiercache.keys import key_to_int

from .keymap import KeyMap, is_scratch
from .orderfile import ORDER_FILE, UNRANKED, Rank, ordered_ids, read_order, save_order  # noqa: F401 (re-exported)

__all__ = ["adopt_stored_blocks", "drop_scratch", "persist_to_nvme", "flush_and_close", "Persisted", "PersistError",
           "PersistWarning", "UntaggedStoreWarning", "keep_retained", "FORMAT_MARKER", "ORDER_FILE", "UNRANKED", "Rank", "save_order",
           "read_order", "ordered_ids", "run_every_step", "check_store", "check_release"]



class PersistError(OSError):
    """``close(persist=True)`` could not write every block it tried to persist into NVMe
    (a full disk, an I/O error): those blocks are not in the reopened store.

    Raised only once every close step ran without error, so the blocks counted as saved
    are durable. ``errno`` is None: the engine reports a failed write as text, which the
    message quotes (``reason``). Pickles and copies with its attributes (``__reduce__``).

    Attributes:
        saved: blocks written into NVMe by the persist (they reopen).
        failed: blocks the persist tried to write and could not (they do not reopen).
        left_out: blocks not tried, for want of a free NVMe slot (they do not reopen);
            ``saved + failed + left_out`` is every block held only in HBM/DRAM.
        reason: the first failure, as the engine reported it (the OS error's text).
    """

    def __init__(self, saved: int, failed: int, reason: str, left_out: int = 0) -> None:
        unfit = f" and {left_out} did not fit in NVMe's free slots" if left_out else ""
        super().__init__(f"TieredKVStore.close: {failed} of {saved + failed + left_out} blocks held only in HBM/DRAM "
                         f"could not be persisted to NVMe ({reason}); {saved} were saved{unfit}: the "
                         f"{failed + left_out} not saved are not in the reopened store")
        self.saved, self.failed, self.left_out, self.reason = saved, failed, left_out, reason

    def __reduce__(self) -> tuple:
        """Rebuilds from the counts (``args`` holds only the message)."""
        return type(self), (self.saved, self.failed, self.reason, self.left_out)


class PersistWarning(UserWarning):
    """``TieredKVCache.close`` persisted every content-keyed block it could write, but some
    did not fit in NVMe's free slots (those already on NVMe are never evicted for them):
    they are not in the reopened cache. Warned once per close; ``close`` returns ``saved``.

    Attributes:
        saved: content-keyed blocks held only in HBM/DRAM that were written into NVMe.
        left_out: those that did not fit.
    """

    def __init__(self, saved: int, left_out: int) -> None:
        super().__init__(f"TieredKVCache.close: {left_out} of {saved + left_out} content-keyed blocks held only in HBM/DRAM "
                         f"did not fit in NVMe's free slots and are not in the reopened cache ({saved} were saved); "
                         "a larger nvme tier keeps them")
        self.saved, self.left_out = saved, left_out

    def __reduce__(self) -> tuple:
        """Rebuilds from the counts (``args`` holds only the message)."""
        return type(self), (self.saved, self.left_out)


@dataclass(frozen=True)
class Persisted:
    """What ``persist_to_nvme`` did with the blocks held only in HBM/DRAM: ``saved`` into
    NVMe, ``failed`` (their write failed: they stayed where they were, or were lost),
    ``left_out`` (no free NVMe slot was left for them), and the first failure's ``reason``.
    Each such block is counted in exactly one of the three."""

    saved: int = 0
    failed: int = 0
    left_out: int = 0
    reason: str | None = None

    def count(self) -> int:
        """The blocks saved (blocks left out are no error: a reopened store holds what fits).

        Raises:
            PersistError: some blocks could not be written (``failed`` > 0).
        """
        if self.failed:
            raise PersistError(self.saved, self.failed, self.reason or "unknown failure", self.left_out)
        return self.saved


#: A file in an NVMe store's directory written by every version that tags scratch keys
#: (``keymap.SCRATCH_TAG``): a store without it was written before the tag.
FORMAT_MARKER = "tiercache-scratch-tag"


class UntaggedStoreWarning(UserWarning):
    """An NVMe store written before scratch keys were tagged (no ``FORMAT_MARKER``) was
    reopened with blocks in it: a decode's scratch blocks from then cannot be told from
    content blocks, so they are adopted as such and leave only by eviction. Warned once, at
    the reopen that finds the store so (the marker is written then)."""


def mark_tagged(medium: object, entries: int) -> None:
    """Writes ``FORMAT_MARKER`` into ``medium``'s directory (a medium without ``path`` has
    none); warns ``UntaggedStoreWarning`` naming it when it was missing and the store held
    ``entries`` > 0 blocks. A marker that cannot be written is left (the warning repeats)."""
    path = getattr(medium, "path", None)
    if not isinstance(path, str) or os.path.exists(marker := os.path.join(path, FORMAT_MARKER)):
        return
    if entries:
        warnings.warn(UntaggedStoreWarning(
            f"{path}: written before scratch keys were tagged; its {entries} blocks are adopted as content "
            "blocks, a decode's scratch blocks from then among them (they cannot be told apart) and leave "
            "only by eviction: clear the directory to start afresh"), stacklevel=4)
    dir_fd = getattr(medium, "folder_fd", None)  # the folder the store opened, whatever its path names now
    try:
        os.close(open_file(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd))
    except OSError:
        pass


def adopt_stored_blocks(manager: TierManager, media: Sequence[object], keymap: KeyMap,
                        events: EventLog) -> list[tuple[str, list[int]]]:
    """Reopening: the complete blocks of a durable medium join its tier, as many as the
    tier holds (``_kept``: when they do not all fit, those its ``ORDER_FILE`` names first,
    in its order, then the oldest slots); the rest, blocks that had left the tier before a
    crash made their deletion durable, or a tier reopened smaller, are deleted. Scratch
    blocks (``keymap.is_scratch``: a crash kept them; a close deletes them) are never
    adopted: they are deleted first, so they take no slot of a block a request can name.
    A store written before the tag is adopted whole, with a warning (``mark_tagged``).
    Returns the ids adopted, per tier that adopted any (its name), in the order its policy
    was told of them, by slot (a recording cache lists them: a step trace's ``resident``
    records)."""
    adopted = []
    for tier, medium in enumerate(media):
        entries = sorted(medium.durable_items(), key=lambda entry: entry[1])
        mark_tagged(medium, len(entries))
        scratch = [key for key, _ in entries if is_scratch(key)]
        entries = [entry for entry in entries if not is_scratch(entry[0])] if scratch else entries
        keep, extra = _kept(entries, manager.dirs[tier].capacity, medium)
        if extra or scratch:
            medium.forget(scratch + [key for key, _ in extra])
        ids = [key_to_int(key) for key, _ in keep]
        keymap.adopt(ids, [key for key, _ in keep])
        if ids:
            manager.restore(tier, ids)
            adopted.append((manager.dirs[tier].name, ids))
    events.drain()  # adoption is not traffic
    return adopted


def _kept(entries: list[tuple[bytes, int]], capacity: int, medium: object) -> tuple[list, list]:
    """Splits a durable tier's ``(key, slot)`` entries, by slot, into those a reopen
    adopts, by slot, and the rest. All fit: all. Else those ``medium``'s ``ORDER_FILE``
    names come first, in its order, then the others by slot, and the first ``capacity``
    are kept: a cache's close lists every layer of a block position together, earlier
    positions first (``cache.WriteRanks``), so a tier reopened smaller keeps whole
    positions of each prefix where slots alone would keep whichever layers got low slots
    (the store hands out freed slots first, in no such order)."""
    if len(entries) <= capacity:
        return entries, []
    listed = {key: n for n, key in enumerate(read_order(medium))}
    ranked = sorted(entries, key=lambda entry: listed.get(entry[0], len(listed)))  # stable: the others by slot
    return sorted(ranked[:capacity], key=lambda entry: entry[1]), ranked[capacity:]


def drop_scratch(manager: TierManager, media: Sequence[object], scratch: Collection[int]) -> int:
    """Closing: the scratch blocks (``KeyMap.scratch``) leave every tier, and the NVMe
    tier's deletions of their copies (resident, retained, or write-through ones) are
    flushed, so the slots they held are free for the content-keyed blocks persisted next
    (``persist_to_nvme``) and a reopen finds none of them. Holds and references on them end
    first (nothing uses the store after close); a block a move still reads (a close whose
    wait failed) stays. A failed flush is retried when the tier closes. Returns how many left.
    """
    pinned = {block_id for directory in manager.dirs for block_id in directory.pins}
    ids = [block_id for block_id in scratch if block_id not in pinned and manager.locate(block_id) is not None]
    if not ids:
        return 0
    manager.unhold([block_id for block_id in ids for _ in range(manager.held.get(block_id, 0))])
    manager.unref([block_id for block_id in ids for _ in range(manager.refs.get(block_id, 0))])
    manager.evict(ids)
    names = [d.name for d in manager.dirs]
    if "nvme" in names:
        try:
            media[names.index("nvme")].flush()  # frees the slots: a deletion frees its slot once durable
        except OSError:
            pass  # counted by the store (failed_flushes); flush_and_close tries again and raises
    return len(ids)


def persist_to_nvme(manager: TierManager, events: EventLog, skip: Collection[int] = (), rank: Rank | None = None) -> Persisted:
    """Moves unpinned DRAM and HBM blocks that have no NVMe copy into free NVMe slots
    (nothing on NVMe is evicted for them; blocks that do not fit are ``left_out``), after
    the blocks whose NVMe copies are retained (``_return_retained``: no write, counted with
    the others). Blocks in ``skip`` (scratch: ``KeyMap.scratch``) are neither moved nor
    counted.

    Order (``_persist_order``): DRAM's, then HBM's, each in its directory's order, then, with
    ``rank``, sorted by it (stable; ``UNRANKED`` last). When NVMe cannot take them all, the
    first in that order are the ones tried: a cache's rank lists every layer of a block
    position together, earlier positions first, so what fits is whole positions of each
    prefix, completing those whose other layers were on NVMe already. The slots they land in
    follow no order (the store hands out freed slots first): a smaller reopen's order is
    ``save_order``'s list.

    In an exclusive hierarchy that is every DRAM and HBM block. In write-through most of
    them have their NVMe copy already (never written again); the others, whose copy down
    failed (a full disk) or whose NVMe copy was evicted while they stayed above, are moved
    as in exclusive mode, each once (a block in DRAM and HBM moves from DRAM; HBM keeps its
    copy). Rounds, one per tier above NVMe at most: each takes the next blocks in order, as
    many as NVMe has free slots then, in one move per source tier (``_move_round``); a move
    one of whose writes fails is taken back whole and its blocks are tried again one per
    move, so a failed write costs at most its own block, and frees its slot for the next
    round. Every count is taken from where the blocks end up: ``saved`` are in NVMe
    afterwards, ``failed`` were tried and are not, ``left_out`` were never tried.
    """
    names = [d.name for d in manager.dirs]
    if "nvme" not in names:
        return Persisted()
    nvme, reason = names.index("nvme"), None
    on_nvme = manager.dirs[nvme].slot_of
    held = _return_retained(manager, nvme, skip)
    tried = len(held)
    waiting = _persist_order(manager, nvme, set(held).union(skip), rank)
    held += [block_id for _, block_id in waiting]
    for _ in range(nvme):
        batch, waiting = waiting[: manager.dirs[nvme].n_free], waiting[manager.dirs[nvme].n_free :]
        if not batch:
            break
        tried += len(batch)
        error = _move_round(manager, batch, nvme)
        reason = reason or error
    events.drain()  # shutting down is not traffic
    saved = sum(block_id in on_nvme for block_id in held)
    return Persisted(saved, tried - saved, len(held) - tried, reason)


def keep_retained(manager: TierManager, events: EventLog, skip: Collection[int] = ()) -> Persisted:
    """Closing without persisting: moves back onto NVMe the blocks whose NVMe copies are
    retained (``_return_retained``: a take-up, no write), so a durable block that was only
    read stays durable, as a killed process leaves it; the rest of DRAM and HBM is dropped.
    Returns ``Persisted()``: nothing was persisted (the blocks were NVMe's already)."""
    names = [d.name for d in manager.dirs]
    if "nvme" in names:
        _return_retained(manager, names.index("nvme"), skip)
        events.drain()  # shutting down is not traffic
    return Persisted()


def _persist_order(manager: TierManager, nvme: int, seen: set[int], rank: Rank | None) -> list[tuple[int, int]]:
    """``(tier, id)`` of the unpinned blocks above ``nvme`` that have no NVMe copy and are
    not in ``seen`` (which it extends), each once: DRAM's, then HBM's, in their directories'
    order, then sorted by ``rank`` when given (stable)."""
    on_nvme, order = manager.dirs[nvme].slot_of, []
    for tier in reversed(range(nvme)):
        directory = manager.dirs[tier]
        for block_id in directory.slot_of:
            if block_id not in directory.pins and block_id not in on_nvme and block_id not in seen:
                seen.add(block_id)
                order.append((tier, block_id))
    if rank is None or not order:
        return order
    keys = rank([block_id for _, block_id in order])
    return [order[n] for n in np.argsort(keys, kind="stable").tolist()]


def _move_round(manager: TierManager, batch: list[tuple[int, int]], nvme: int) -> str | None:
    """Moves ``batch``'s blocks (``(tier, id)``) into NVMe: one move per source tier, DRAM's
    first, in batch order; a move that fails is taken back and its blocks still where they
    were are tried one per move (``_move_one_by_one``). Returns the first failure's reason."""
    reason, on_nvme = None, manager.dirs[nvme].slot_of
    for tier in reversed(range(nvme)):
        directory = manager.dirs[tier]
        ids = [block_id for source, block_id in batch if source == tier and block_id in directory.slot_of]
        error = _move_error(manager, ids, tier, nvme) if ids else None
        if error is not None:
            reason = reason or error
            _move_one_by_one(manager, [i for i in ids if i in directory.slot_of and i not in on_nvme], tier, nvme)
    return reason


def _return_retained(manager: TierManager, nvme: int, skip: Collection[int] = ()) -> list[int]:
    """Moves back first the blocks whose NVMe copies are still retained (``RetainedCopies``)
    and returns them: they cost no write, so a full disk cannot fail them, and no other
    block's move can delete their copies to make room for itself. Blocks in ``skip`` stay
    (their copies are deleted at close, ``RetainedCopies.drop_all``)."""
    retained = getattr(manager.engine, "retained", None)
    if retained is None:
        return []
    copies, moved = set(retained.held_in(nvme)).difference(skip), []
    for tier in reversed(range(nvme)):
        directory = manager.dirs[tier]
        ids = [i for i in directory.slot_of if i in copies and i not in directory.pins]
        if ids:
            _move_error(manager, ids, tier, nvme)
            moved += ids
    return moved


def _move_error(manager: TierManager, ids: list[int], src: int, dst: int) -> str | None:
    """Moves ``ids`` from ``src`` to ``dst`` and waits (``TierManager.move``, keeping the
    engine's reason for a failure); None on success."""
    plan = manager.start_move(ids, src, dst)
    if plan is None:
        return "the move could not be started"
    return manager.wait(plan.job_id).error


def _move_one_by_one(manager: TierManager, ids: list[int], src: int, dst: int) -> None:
    """Moves each of ``ids`` from ``src`` to ``dst`` in a move of its own (all started,
    then waited for, so they run in parallel): a write that fails again fails one block."""
    plans = [manager.start_move([block_id], src, dst) for block_id in ids]
    for plan in plans:
        if plan is not None:
            manager.wait(plan.job_id)


def flush_and_close(media: Sequence[object]) -> None:
    """Flushes every medium, then closes every one (even after an error).

    A failed flush is not raised here: it keeps its batch pending (``NVMeStore.flush``),
    and closing a durable medium flushes it again (``NVMeStore.close``), which raises if
    that fails too. So a flush that fails once and then succeeds loses nothing and is no
    error, and an error raised means the medium's final flush failed.

    Raises:
        Exception: the first error a close raised (for the NVMe tier, an ``OSError``
            naming the store: what was written since its last successful flush is not
            durable).
    """
    for medium in media:
        try:
            medium.flush()
        except OSError:
            pass  # retried by medium.close() below, which raises if it fails again
    run_every_step([medium.close for medium in media])


def run_every_step(steps: Sequence[Callable[[], object]]) -> list[object]:
    """Runs every step even when an earlier one raised (closing releases what it can);
    returns their results (None for a step that raised).

    Raises:
        Exception: the first error a step raised, once every step has run.
    """
    errors: list[Exception] = []
    results: list[object] = []
    for step in steps:
        try:
            results.append(step())
        except Exception as exc:  # noqa: BLE001 - keep closing; the first error is raised below
            errors.append(exc)
            results.append(None)
    if errors:
        raise errors[0]
    return results


def check_store(manager: TierManager, keymap: KeyMap, media: Sequence[object], engine: LocalEngine | None = None) -> None:
    """Asserts the manager, the key map, the keyed media and the ``engine``'s retained copies
    agree (a shared medium, the remote store, is not checked by key: others may evict what
    this process's view lists).

    Like the retained copies' bound (checked only once every move settled), a keyed tier's
    blocks that moves in flight read (pinned) are exempt: a read that found its chunk
    corrupt deleted it already, and the manager drops the block when the move completes.
    """
    manager.check_invariants()
    if engine is not None:
        engine.retained.check(settled=not manager.inflight)
    keymap.check({b for d in manager.dirs for b in d.slot_of})
    for tier, medium in enumerate(media):
        if medium.keyed and not getattr(medium, "shared", False):  # places bytes itself: check by key
            reading = manager.dirs[tier].pins  # sources of moves in flight (see above)
            for block_id in manager.dirs[tier].slot_of:
                assert block_id in reading or medium.contains(keymap.keys[block_id]), \
                    f"{medium}: resident block {block_id} is not stored"


def check_release(manager: TierManager, keys: Sequence[bytes], ids: Sequence[int | None]) -> None:
    """Checks a ``release`` before it changes anything, naming the caller's key (the manager
    names its internal id): each key stored or pinned, and released at most as often as it
    is pinned, pins on a block lost while pinned and pins on it stored anew together (the
    orphan pins are spent first: ``TierManager.unref``). ``ids`` are the keys' ids (None:
    the id belongs to another key).

    Raises:
        KeyError: the first key neither stored nor pinned.
        CountError: the first key released more often than it is pinned.
    """
    asked: dict[int, int] = {}
    for key, block_id in zip(keys, ids):
        orphans = manager.orphan_refs.get(block_id, 0) if block_id is not None else 0
        if block_id is None or not (orphans or manager.locate(block_id) is not None):
            raise KeyError(f"TieredKVStore.release: key {key.hex()} is not stored")
        asked[block_id] = asked.get(block_id, 0) + 1
        if asked[block_id] > orphans + manager.refs.get(block_id, 0):
            raise CountError(f"TieredKVStore.release: key {key.hex()} is released more often than it is pinned")
