"""The live store's side of a shared remote tier (Mooncake Store).

The manager's last tier is its *view* of the shared store: the blocks this process knows
the store holds and does not hold locally (plus published copies of local ones). Other
processes add blocks the view does not know, and Mooncake's eviction drops blocks the view
still lists, so the store asks before it trusts: ``refresh`` checks (one batched existence
call) the part of a prefix the local tiers miss, adopts what the store holds into the view
and drops what it no longer holds. Reads of adopted blocks are ordinary promotions through
the manager's move API (the remote -> pool copy handler verifies every value).

Writes follow ``RemoteConfig.write`` (``RemoteWrite``): ``through`` publishes every new
block once it is stored locally, ``back`` lets the manager demote the last local tier's
victims into the remote tier, ``selective`` publishes a block once it has been hit
``write_hits`` times locally (and the remote tier admits only such blocks as victims). A
publication the store did not answer is tried again once it does (``retry_unpublished``).
"""

from __future__ import annotations

import time
from typing import Sequence

from tiercache.config import Codec, RemoteConfig, RemoteWrite, TierConfig
from tiercache.core.manager import TierManager
from tiercache.core.remoteview import HotOnly, adopt, drop_stale, view_head
from tiercache.data.remote import RemoteStore
from tiercache.keys import key_to_int
from tiercache.policies.base import AdmissionPolicy

from .keymap import KeyMap

__all__ = ["RemoteLink", "remote_admission", "lossy_codec"]

_UNPUBLISHED_LIMIT = 1 << 16  # local blocks kept for a retry of their publication
#: Seconds a local block's view copy, found in the store by a put's check, is trusted before
#: the next put of it asks again (``RemoteLink._check_published``).
VERIFY_EVERY_S = 1.0


class _Always(AdmissionPolicy):
    name = "always"

    def admit(self, ids: Sequence[int]) -> list[bool]:
        return [True] * len(ids)


def remote_admission(config: RemoteConfig, hits: dict[int, int]) -> AdmissionPolicy:
    """The remote tier's admission of local victims, as the write policy says."""
    if config.write is RemoteWrite.SELECTIVE:
        return HotOnly(hits, config.write_hits)
    return _Always()


def lossy_codec(tiers: Sequence[TierConfig]) -> Codec:
    """The codec whose error a store's remote values may carry: that of its quantised local
    tier (only NVMe may be, ``media.check_remote_write``), else ``Codec.NONE``.

    Under every write mode a block can reach the remote tier from that tier, decoded (``back``
    and ``selective`` write its victims back; ``through`` writes back a victim whose view
    entry was dropped meanwhile), so all of the store's values are tagged with it
    (``RemoteStore(codec=...)``): only stores with the same codec share them, and none is
    ever served as exact KV to a store with plain tiers."""
    return next((t.codec for t in tiers if t.remote is None and t.codec is not Codec.NONE), Codec.NONE)


class RemoteLink:
    """Lookups, adoption and the write policy of the remote tier (the manager's last tier).

    Invariants: ``hits`` holds counts only for ids some tier held when counted (pruned as
    blocks leave); the unpublished queue holds at most ``_UNPUBLISHED_LIMIT`` ids, and only
    local blocks outside the view are ever published from it; nothing here raises for a
    remote failure (the medium counts it and answers "not there", or gives no answer).
    """

    def __init__(self, manager: TierManager, keymap: KeyMap, medium: RemoteStore, config: RemoteConfig,
                 hits: dict[int, int]) -> None:
        self.manager, self.keymap, self.medium, self.config = manager, keymap, medium, config
        self.tier = manager.n_tiers - 1
        self.hits = hits  # shared with the remote tier's admission (``remote_admission``)
        # publish_queued: blocks whose publication (through / selective) was started; what
        # landed in the store is the medium's ``puts`` (``already``: found there, not written).
        # republished: blocks of them started again after their publication failed
        # (``retry_unpublished``); ``unpublished``: the local blocks still waiting for that.
        self.stats = {"adopted": 0, "stale": 0, "publish_queued": 0, "republished": 0, "write": config.write.value}
        self._verified: dict[int, float] = {}  # local blocks' view copies: when last found in the store
        self._unpublished: dict[int, None] = {}  # ids, oldest first (a dict keeps order, drops repeats)

    # -- lookups -------------------------------------------------------------------------
    def refresh_prefix(self, keys: Sequence[bytes], ids: Sequence[int | None]) -> bool:
        """Brings the view in line with the store for the prefix of ``keys`` the local
        tiers miss: one existence check over the keys not held locally; view entries the
        store lost are dropped and the prefix's head is adopted (``_adopt_head``). A check
        that got no answer changes nothing and returns False: the view entries it asked
        about are then unconfirmed (a miss)."""
        where = self._where(ids)
        ask = [n for n, t in enumerate(where) if ids[n] is not None and (t is None or t == self.tier)]
        if not ask:
            return True
        found = self.medium.present([keys[n] for n in ask])
        if found is None:  # no answer: nothing is known lost, nothing new known there
            return False
        present = dict(zip(ask, found.tolist()))
        self._drop_stale([ids[n] for n in ask if where[n] == self.tier and not present[n]])
        self._adopt_head(keys, ids, where, present)
        return True

    def adopt_prefix(self, keys: Sequence[bytes], ids: Sequence[int | None]) -> None:
        """A prefix read's adoption (``get_prefix``): one existence check over the keys no
        tier holds, then the prefix's head is adopted (``_adopt_head``); view entries are
        trusted (the read verifies them). No answer: nothing is adopted."""
        where = self._where(ids)
        ask = [n for n, t in enumerate(where) if ids[n] is not None and t is None]
        found = self.medium.present([keys[n] for n in ask])
        if found is not None:
            self._adopt_head(keys, ids, where, dict(zip(ask, found.tolist())))

    def adopt_present(self, keys: Sequence[bytes], protect: Sequence[int] = ()) -> None:
        """Adopts those of ``keys`` (held by no tier) that the store holds now, in order,
        never pushing the view entries of ``protect`` (the request's other blocks) out."""
        found = self.medium.present(list(keys)) if keys else None
        if found is not None:
            self._adopt([k for k, there in zip(keys, found.tolist()) if there], protect)

    def _where(self, ids: Sequence[int | None]) -> list[int | None]:
        return [None if b is None else self.manager.locate(b) for b in ids]

    def _adopt_head(self, keys: Sequence[bytes], ids: Sequence[int | None], where: list[int | None],
                    present: dict[int, bool]) -> None:
        """Adopts, in prefix order, the blocks no tier holds of the prefix's head: its
        leading run of blocks held here or in the store (``present``, by position: the
        positions asked) cut where its view entries and adoptions fill the view (``_head``).
        The head's own view entries stay; entries of the same prefix past the head (its
        tail) may go to make room, so a view full of a prompt's tail takes its head back."""
        run = []
        for n, block_id in enumerate(ids):
            if block_id is None or not present.get(n, True):
                break  # a collision, or the first block neither here nor in the store
            run.append(n)
        head = view_head(self.manager, self.tier, [ids[n] for n in run])
        fresh = [keys[n] for n in run[: len(head)] if where[n] is None]
        if fresh:
            self._adopt(fresh, head)

    def _adopt(self, keys: list[bytes], protect: Sequence[int] = ()) -> None:
        """Adds blocks the store holds to the view, the first ones first: room is made by
        dropping view entries other than ``protect`` and the adopted blocks themselves;
        those beyond the room are forgotten."""
        ids = self.keymap.ids(keys, register=True)
        fresh = [b for b in ids if b is not None and self.manager.locate(b) is None]
        if not fresh:
            self.keymap.forget_absent([b for b in ids if b is not None], self.manager.locate)
            return
        taken = adopt(self.manager, self.tier, fresh, frozenset(protect) | frozenset(fresh))
        self.stats["adopted"] += len(taken)
        self.keymap.forget_absent(fresh[len(taken):], self.manager.locate)

    def drop_unreadable(self, block_id: int) -> None:
        """A view entry whose value proved unreadable in place leaves the view."""
        self._drop_stale([block_id])

    def _drop_stale(self, ids: list[int]) -> None:
        """Drops view entries the store no longer holds (its eviction, a client that left)."""
        self.stats["stale"] += len(drop_stale(self.manager, self.tier, ids))

    # -- writes --------------------------------------------------------------------------
    def stored(self, ids: Sequence[int]) -> list:
        """A put's blocks ``ids`` (in the call's order, taken as one prefix from its start)
        were stored locally: under ``through`` the view's copies of them the store lost are
        dropped (``_check_published``), then the part that extends what the view holds is
        published now (``TierManager.publish`` with ``prefix``: blocks the view lacks, from
        the first one, up to the first the local tiers do not hold; the call's blocks in the
        view are never pushed out for them; those whose publication failed before count in
        ``republished`` too); publications that failed before are tried again
        (``retry_unpublished``). Returns the plans started."""
        if self.config.write is not RemoteWrite.THROUGH:
            return self.retry_unpublished()
        self._take_unanswered()
        self._check_published(ids)
        plans = self._publish(ids, prefix=True)
        again = [b for p in plans for b in p.ids if b in self._unpublished]
        for block_id in again:
            del self._unpublished[block_id]
        self.stats["republished"] += len(again)
        return plans + self.retry_unpublished()

    def _check_published(self, ids: Sequence[int]) -> None:
        """Asks the store (one existence check) about the view's copies of the call's blocks held
        locally that were not checked in the last ``VERIFY_EVERY_S``, and drops the view's copy
        (the view only: nothing is deleted) of those it no longer holds (a master restarted on the
        same ports, its eviction), counted ``stale``: the publication that follows writes them
        again, so putting a prompt again restores what other instances find. A hot prefix put
        by every request costs one check per ``VERIFY_EVERY_S``; a call of new blocks, none;
        no answer changes nothing (at most ``timeout_s``, as every put's check)."""
        now = time.monotonic()
        view = self.manager.dirs[self.tier].slot_of
        copies = [b for b in dict.fromkeys(ids) if b in view and (t := self.manager.locate(b)) is not None
                  and t < self.tier and now - self._verified.get(b, -VERIFY_EVERY_S) >= VERIFY_EVERY_S
                  and self.keymap.keys.get(b) is not None]
        if not copies:
            return
        found = self.medium.present([self.keymap.keys[b] for b in copies])
        if found is None:
            return
        self._verified.update(dict.fromkeys(copies, now))
        stale = self.manager.drop_copies(self.tier, [b for b, there in zip(copies, found.tolist()) if not there])
        for block_id in stale:
            del self._verified[block_id]
        self.stats["stale"] += len(stale)

    def read(self, ids: Sequence[int]) -> list:
        """Counts local hits of a read; ``selective`` publishes blocks reaching the threshold;
        publications that failed before are tried again (``retry_unpublished``)."""
        local = [b for b in dict.fromkeys(ids) if (t := self.manager.locate(b)) is not None and t < self.tier]
        hot = []
        for block_id in local:
            count = self.hits.get(block_id, 0) + 1
            self.hits[block_id] = count
            if count == self.config.write_hits:
                hot.append(block_id)
        plans = self._publish(hot) if self.config.write is RemoteWrite.SELECTIVE else []
        return plans + self.retry_unpublished()

    def retry_unpublished(self) -> list:
        """Publishes again (``through``, ``selective``) the local blocks whose publication
        failed because the store did not answer its put (``RemoteStore.unanswered_puts``).
        Tried once the store takes calls again (``retry_s`` after a failure; the put's
        existence check is the probe), counted in ``republished``; a retry that cannot start
        (no room in the view, a move in flight takes the block) is not kept, as any
        publication. A block that left the local tiers meanwhile is never published (its
        bytes are gone), nor one the view holds (published already). Returns the plans started."""
        self._take_unanswered()
        if not self._unpublished or not self.medium.usable():
            return []
        ids, self._unpublished = self._not_published(self._unpublished), {}
        plans = self._publish(ids)
        self.stats["republished"] += sum(p.n_blocks for p in plans)
        return plans

    def _publish(self, ids: Sequence[int], prefix: bool = False) -> list:
        plans = self.manager.publish(ids, prefix=prefix)
        self.stats["publish_queued"] += sum(p.n_blocks for p in plans)
        return plans

    def _take_unanswered(self) -> None:
        """Queues the local blocks whose put the store did not answer (under ``back`` no
        block is published ahead of its eviction: the medium's record is only emptied)."""
        keys = self.medium.unanswered_puts.take()
        if keys and self.config.write is not RemoteWrite.BACK:  # resident keys only (no collision counted)
            self._queue(self._not_published([b for k in keys if self.keymap.keys.get(b := key_to_int(k)) == k]))

    def _queue(self, ids: Sequence[int]) -> None:
        """Adds ``ids`` to the unpublished queue, oldest first; past ``_UNPUBLISHED_LIMIT``
        the oldest are let go (their next hit or eviction may still publish them)."""
        self._unpublished.update(dict.fromkeys(ids))
        while len(self._unpublished) > _UNPUBLISHED_LIMIT:
            del self._unpublished[next(iter(self._unpublished))]

    def _not_published(self, ids) -> list[int]:
        """Those of ``ids`` a local tier holds and the view does not (not published yet)."""
        view = self.manager.dirs[self.tier].slot_of
        return [b for b in ids if (t := self.manager.locate(b)) is not None and t < self.tier and b not in view]

    def departed(self, ids: Sequence[int]) -> None:
        """Forgets hit counts of blocks no tier holds any more."""
        for block_id in ids:
            if self.manager.locate(block_id) is None:
                self.hits.pop(block_id, None)
                self._verified.pop(block_id, None)

    def snapshot(self) -> dict:
        """The link's and the medium's counters, for ``stats()``."""
        self._take_unanswered()
        self._unpublished = dict.fromkeys(self._not_published(self._unpublished))
        return {**self.stats, "unpublished": len(self._unpublished), **self.medium.stats, "down": self.medium.breaker.down}
