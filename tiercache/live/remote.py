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
``write_hits`` times locally (and the remote tier admits only such blocks as victims).
"""

from __future__ import annotations

from typing import Sequence

from tiercache.config import Codec, RemoteConfig, RemoteWrite, TierConfig
from tiercache.core.manager import TierManager
from tiercache.data.remote import RemoteStore
from tiercache.policies.base import AdmissionPolicy

from .keymap import KeyMap

__all__ = ["RemoteLink", "remote_admission", "lossy_codec"]


class _PublishedOnly(AdmissionPolicy):
    """Selective writes: the remote tier admits a local victim only once it was hot enough
    to be published (a cold victim just leaves; a hot one is already there, or retried)."""

    name = "remote_selective"

    def __init__(self, hits: dict[int, int], threshold: int) -> None:
        self._hits, self._threshold = hits, threshold

    def admit(self, ids: Sequence[int]) -> list[bool]:
        return [self._hits.get(b, 0) >= self._threshold for b in ids]


class _Always(AdmissionPolicy):
    name = "always"

    def admit(self, ids: Sequence[int]) -> list[bool]:
        return [True] * len(ids)


def remote_admission(config: RemoteConfig, hits: dict[int, int]) -> AdmissionPolicy:
    """The remote tier's admission of local victims, as the write policy says."""
    if config.write is RemoteWrite.SELECTIVE:
        return _PublishedOnly(hits, config.write_hits)
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
    blocks leave); nothing here raises for a remote failure (the medium counts it and
    answers "not there").
    """

    def __init__(self, manager: TierManager, keymap: KeyMap, medium: RemoteStore, config: RemoteConfig,
                 hits: dict[int, int]) -> None:
        self.manager, self.keymap, self.medium, self.config = manager, keymap, medium, config
        self.tier = manager.n_tiers - 1
        self.hits = hits  # shared with the remote tier's admission (``remote_admission``)
        # publish_queued: blocks whose publication (through / selective) was started; what
        # landed in the store is the medium's ``puts`` (``already``: found there, not written).
        self.stats = {"adopted": 0, "stale": 0, "publish_queued": 0, "write": config.write.value}

    # -- lookups -------------------------------------------------------------------------
    def refresh_prefix(self, keys: Sequence[bytes], ids: Sequence[int | None]) -> bool:
        """Brings the view in line with the store for the prefix of ``keys`` the local
        tiers miss: one existence check over the keys not held locally; the leading run
        the store holds is adopted (never pushing the prefix's own view entries out), view
        entries the store lost are dropped. A check that got no answer changes nothing and
        returns False: the view entries it asked about are then unconfirmed (a miss)."""
        where = [None if b is None else self.manager.locate(b) for b in ids]
        ask = [n for n, t in enumerate(where) if ids[n] is not None and (t is None or t == self.tier)]
        if not ask:
            return True
        found = self.medium.present([keys[n] for n in ask])
        if found is None:  # no answer: nothing is known lost, nothing new known there
            return False
        present = dict(zip(ask, found.tolist()))
        self._drop_stale([ids[n] for n in ask if where[n] == self.tier and not present[n]])
        run = []
        for n, tier in enumerate(where):
            if ids[n] is None or not present.get(n, True):
                break  # a collision, or the first block neither here nor in the store
            if tier is None:
                run.append(n)
        if run:  # the prefix's view entries up to the run's end stay; those past its break may go
            self._adopt([keys[n] for n in run], [b for b in ids[: run[-1] + 1] if b is not None])
        return True

    def adopt_present(self, keys: Sequence[bytes], protect: Sequence[int] = ()) -> None:
        """Adopts those of ``keys`` (held by no tier) that the store holds now, in order,
        never pushing the view entries of ``protect`` (the request's other blocks) out."""
        found = self.medium.present(list(keys)) if keys else None
        if found is not None:
            self._adopt([k for k, there in zip(keys, found.tolist()) if there], protect)

    def _adopt(self, keys: list[bytes], protect: Sequence[int] = ()) -> None:
        """Adds blocks the store holds to the view, the first ones first: room is made by
        dropping view entries other than ``protect`` and the adopted blocks themselves;
        those beyond the room are forgotten (a request longer than the view gets its head)."""
        ids = self.keymap.ids(keys, register=True)
        fresh = [b for b in ids if b is not None and self.manager.locate(b) is None]
        if not fresh:
            self.keymap.forget_absent([b for b in ids if b is not None], self.manager.locate)
            return
        directory = self.manager.dirs[self.tier]
        kept = frozenset(protect) | frozenset(fresh)
        room = directory.capacity - sum(1 for b in kept if b in directory.slot_of)
        self.manager.make_room(self.tier, min(len(fresh), room), kept)
        taken, rest = fresh[: directory.n_free], fresh[directory.n_free :]
        if taken:
            self.manager.restore(self.tier, taken)
            self.stats["adopted"] += len(taken)
        self.keymap.forget_absent(rest, self.manager.locate)

    def drop_unreadable(self, block_id: int) -> None:
        """A view entry whose value proved unreadable in place leaves the view."""
        self._drop_stale([block_id])

    def _drop_stale(self, ids: list[int]) -> None:
        """Drops view entries the store no longer holds (its eviction, a client that left)."""
        directory = self.manager.dirs[self.tier]
        stale = [b for b in dict.fromkeys(ids) if b in directory.slot_of and b not in directory.pins and b not in self.manager.refs]
        if stale:
            self.manager.evict(stale)
            self.stats["stale"] += len(stale)

    # -- writes --------------------------------------------------------------------------
    def stored(self, ids: Sequence[int]) -> list:
        """New blocks were stored locally: published now under ``through``."""
        if self.config.write is RemoteWrite.THROUGH:
            return self._publish(ids)
        return []

    def read(self, ids: Sequence[int]) -> list:
        """Counts local hits of a read; ``selective`` publishes blocks reaching the threshold."""
        local = [b for b in dict.fromkeys(ids) if (t := self.manager.locate(b)) is not None and t < self.tier]
        hot = []
        for block_id in local:
            count = self.hits.get(block_id, 0) + 1
            self.hits[block_id] = count
            if count == self.config.write_hits:
                hot.append(block_id)
        if self.config.write is RemoteWrite.SELECTIVE:
            return self._publish(hot)
        return []

    def _publish(self, ids: Sequence[int]) -> list:
        plans = self.manager.publish(ids)
        self.stats["publish_queued"] += sum(p.n_blocks for p in plans)
        return plans

    def departed(self, ids: Sequence[int]) -> None:
        """Forgets hit counts of blocks no tier holds any more."""
        for block_id in ids:
            if self.manager.locate(block_id) is None:
                self.hits.pop(block_id, None)

    def snapshot(self) -> dict:
        """The link's and the medium's counters, for ``stats()``."""
        return {**self.stats, **self.medium.stats, "down": self.medium.breaker.down}
