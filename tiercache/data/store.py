"""``TieredKVStore``: the live KV store over real HBM, DRAM and NVMe tiers.

The same ``TierManager`` that ``tiercache replay`` drives with ``SimEngine`` runs here with
``LocalEngine``: identical policies, identical decisions, real bytes. Blocks are named by
content keys (``tiercache.keys``: chained hashes of token blocks with a namespace); the
manager sees the key's stable 63-bit id, and the full 16-byte key is compared on every lookup,
so two keys sharing an id are never confused (the second is refused, counted).

Thread safety: one lock serialises every public method; the NVMe store's I/O threads touch
only bytes. Durability: the NVMe tier is an ``NVMeStore``; ``flush``/``close`` make its index
durable, and reopening the same path adopts every complete block into the NVMe tier.
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

import numpy as np
import torch

from tiercache.config import KVLayout, TierConfig
from tiercache.core.manager import TierManager
from tiercache.core.plans import EventLog
from tiercache.core.stats import HierarchyStats
from tiercache.errors import UserError
from tiercache.keys import key_to_int, prefix_keys
from tiercache.policies import make_admission, make_eviction

from .buffers import check_blocks
from .engine import LocalEngine
from .nvme import NVMeStore
from .pools import BlockPool, dram_pool, hbm_pool

__all__ = ["TieredKVStore"]


class TieredKVStore:
    """Put, find and get KV blocks across HBM, DRAM and NVMe.

    Args:
        layout: the KV layout (block shape and dtype).
        tiers: ``TierConfig`` per tier, fastest first (``hbm``, optional ``dram``, optional
            ``nvme``); capacities in blocks.
        eviction: eviction policy name for every tier (overrides the TierConfigs' own).
        admission: admission policy of the lower tiers (overrides the TierConfigs' own).
        path: directory of the NVMe store (required with an ``nvme`` tier).
        device: device of the HBM tier (default: CUDA when available, else the CPU).
        write_through: inclusive hierarchy instead of the default exclusive one.

    Invariants: every resident block's key is in ``_keys``; the NVMe tier's directory slots
    equal the store's slots; ``check_invariants`` verifies both plus the manager's.
    """

    def __init__(self, layout: KVLayout, tiers: Sequence[TierConfig], eviction: str | None = None, admission: str | None = None,
                 path: str | os.PathLike | None = None, device: str | None = None, write_through: bool = False) -> None:
        _check_tiers(tiers, path)
        _check_online(eviction, tiers)
        self.layout = layout
        self._lock = threading.RLock()
        self._keys: dict[int, bytes] = {}
        self._media = [_open_medium(t, layout, path, device) for t in tiers]
        self.engine = LocalEngine(self._media, self._keys.__getitem__, on_discard=self._forget_absent)
        self.events = EventLog()
        self.manager = TierManager(
            [(t.name, t.capacity_blocks) for t in tiers],
            [make_eviction(eviction or t.eviction, t.capacity_blocks) for t in tiers],
            [make_admission("always")] + [make_admission(admission or t.admission) for t in tiers[1:]],
            engine=self.engine, events=self.events, write_through=write_through,
        )
        self._stats = HierarchyStats.for_tiers((t.name, t.capacity_blocks) for t in tiers)
        self.collisions = 0
        self.token_mismatches = 0
        self._tokens: dict[int, np.ndarray] = {}  # token ids of blocks put with put_tokens
        self._prefetching: set[int] = set()
        self._closed = False
        self._adopt_stored_blocks()

    # -- identity ------------------------------------------------------------------------
    def _ids(self, keys: Sequence[bytes], register: bool) -> list[int | None]:
        """Manager ids of ``keys``; None for a key whose id belongs to another key."""
        ids: list[int | None] = []
        for key in keys:
            if not isinstance(key, bytes):
                raise UserError(f"TieredKVStore: keys must be bytes, got {type(key).__name__}")
            block_id = key_to_int(key)
            known = self._keys.get(block_id)
            if known is None and register:
                self._keys[block_id] = key
            elif known is not None and known != key:
                self.collisions += 1
                block_id = None
            ids.append(block_id)
        return ids

    # -- the API -------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], kv_blocks: torch.Tensor) -> int:
        """Stores blocks ``kv_blocks[i]`` under ``keys[i]``; returns how many were new.

        Keys already stored are refreshed (touched), not rewritten: a key names its content.

        Raises:
            UserError: keys not bytes or repeated; blocks of the wrong dtype or shape.
        """
        check_blocks(kv_blocks, self.layout, len(keys), "TieredKVStore.put kv_blocks")
        if len(set(keys)) != len(keys):
            raise UserError("TieredKVStore.put: a key appears twice in one call")
        with self._lock:
            self._check_open()
            ids = self._ids(keys, register=True)
            fresh = [i for i, block_id in enumerate(ids) if block_id is not None and self.manager.locate(block_id) is None]
            new_ids = [ids[i] for i in fresh]
            placed = set(new_ids)
            old = [block_id for block_id in ids if block_id is not None and block_id not in placed]
            self.engine.stage(new_ids, kv_blocks[fresh] if fresh else kv_blocks[:0])
            self.manager.insert(new_ids)
            self.engine.unstage(new_ids)  # refused by admission: nothing was placed
            self.manager.access(old)
            self._forget_absent(new_ids)
            self._consume()
            return len(new_ids)

    def access(self, keys: Sequence[bytes], kv_blocks: torch.Tensor) -> None:
        """Reads ``keys`` in order exactly as ``tiercache replay`` does (object semantics).

        Hits are touched and promoted; misses are stored from ``kv_blocks`` (aligned with
        ``keys``; a replay knows every block's bytes). This is what makes a trace replayed
        through the live store give the same per-tier hits as the simulator.
        """
        check_blocks(kv_blocks, self.layout, len(keys), "TieredKVStore.access kv_blocks")
        with self._lock:
            self._check_open()
            ids = self._ids(keys, register=True)
            if any(i is None for i in ids):
                raise UserError("TieredKVStore.access: a key collides with another key's id")
            self.engine.stage(ids, kv_blocks)
            self.manager.access(ids)
            self.engine.unstage(ids)
            self._forget_absent(ids)
            self._consume()

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[str | None]]:
        """Length of the stored prefix of ``keys``, and the tier holding each key (or None)."""
        with self._lock:
            self._check_open()
            ids = self._ids(keys, register=False)
            tiers = [None if i is None else self.manager.locate(i) for i in ids]
            names = [None if t is None else self.manager.dirs[t].name for t in tiers]
            prefix = next((n for n, name in enumerate(names) if name is None), len(names))
            return prefix, names

    def put_tokens(self, token_ids: Sequence[int], kv_blocks: torch.Tensor, namespace: bytes | str = b"") -> int:
        """Stores the KV of a prompt's full blocks under their chained keys; returns how many
        were new. The blocks' token ids are kept, so ``match_prefix`` confirms hits by
        comparing tokens, not by trusting the hash alone."""
        block_tokens = self.layout.block_tokens
        keys = prefix_keys(token_ids, block_tokens, namespace)
        tokens = np.asarray(token_ids, dtype=np.int64)
        with self._lock:
            new = self.put(keys, kv_blocks)
            for index, block_id in enumerate(self._ids(keys, register=False)):
                if block_id is not None and self.manager.locate(block_id) is not None:
                    self._tokens[block_id] = tokens[index * block_tokens : (index + 1) * block_tokens].copy()
            return new

    def match_prefix(self, token_ids: Sequence[int], namespace: bytes | str = b"") -> int:
        """How many leading tokens of this prompt are stored (whole blocks only).

        A block put with ``put_tokens`` counts only if its stored token ids equal the
        prompt's (a mismatch under an equal key is counted in ``stats()["token_mismatches"]``);
        blocks put by key alone, or adopted from NVMe on reopen, are confirmed by their full
        16-byte key.
        """
        block_tokens = self.layout.block_tokens
        keys = prefix_keys(token_ids, block_tokens, namespace)
        tokens = np.asarray(token_ids, dtype=np.int64)
        with self._lock:
            found, _ = self.lookup(keys)
            for index, block_id in enumerate(self._ids(keys[:found], register=False)):
                stored = self._tokens.get(block_id)
                if stored is not None and not np.array_equal(stored, tokens[index * block_tokens : (index + 1) * block_tokens]):
                    self.token_mismatches += 1
                    return index * block_tokens
            return found * block_tokens

    def get(self, keys: Sequence[bytes], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks of ``keys`` as one tensor on the HBM tier's device, promoting them.

        ``out`` (``[len(keys), *block_shape]`` on the HBM device), when given, receives the
        blocks: a serving loop reuses one buffer instead of allocating (and first-touching)
        a new tensor per call. ``get_slots`` gives the zero-copy alternative.

        Raises:
            UserError: ``out`` of the wrong dtype or shape.
            KeyError: a key is not stored, or its stored copy proved unreadable (corrupt
                NVMe chunk: dropped and counted, never returned as data).
        """
        with self._lock:
            self._check_open()
            ids = self._ids(keys, register=False)
            missing = [k for k, i in zip(keys, ids) if i is None or self.manager.locate(i) is None]
            if missing:
                raise KeyError(f"{len(missing)} of {len(keys)} keys are not stored (first: {missing[0].hex()})")
            if out is not None:
                check_blocks(out, self.layout, len(keys), "TieredKVStore.get out")
            self._settle_prefetches()
            self.manager.access(ids, store_misses=False)  # no bytes here for a lost block
            self._consume()
            return self._gather(keys, ids, out)

    def get_slots(self, keys: Sequence[bytes]) -> list[int]:
        """Promotes the blocks of ``keys`` and returns their HBM slots (zero copy).

        The slots index ``hbm_tensor``; pin the keys first if the blocks must stay there
        while a kernel reads them. A block that could not be promoted raises KeyError.
        """
        with self._lock:
            self._check_open()
            ids = self._present_ids(keys)
            self._settle_prefetches()
            self.manager.access(ids, store_misses=False)
            self._consume()
            top = self.manager.dirs[0].slot_of
            if any(i not in top for i in ids):
                raise KeyError("a block could not be brought to HBM (no room, or unreadable)")
            return [top[i] for i in ids]

    @property
    def hbm_tensor(self) -> torch.Tensor:
        """The HBM pool: ``[slots, *block_shape]`` (read it at slots from ``get_slots``)."""
        return self._media[0].tensor

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Starts bringing stored blocks up to HBM without waiting; returns blocks in flight.

        Room in HBM is made at once (victims demoted as usual); the copies run in the
        background (NVMe I/O threads, or the CUDA copy stream) and are published by ``poll``
        or by the next ``get``. Until then lookups still find the blocks where they were.
        """
        with self._lock:
            self._check_open()
            ids = [i for i in self._ids(keys, register=False) if i is not None]
            started = 0
            for tier in range(1, self.manager.n_tiers):
                below = [i for i in ids if self.manager.locate(i) == tier and i not in self.manager.dirs[tier].pins]
                if below and self.manager.make_room(0, len(below), frozenset(below)):
                    plan = self.manager.prepare_move(below, tier, 0, keep_source=self.manager.write_through)
                    if plan is not None:
                        self.engine.submit(plan)
                        self._prefetching.add(plan.job_id)
                        started += plan.n_blocks
            return started

    def poll(self) -> int:
        """Publishes finished background copies; returns how many jobs finished."""
        with self._lock:
            finished = self.manager.poll()
            self._prefetching.difference_update(p.job_id for p in finished)
            self._stats.consume(self.events.drain())
            return len(finished)

    def _settle_prefetches(self) -> None:
        """Waits for every background copy, so the manager's view is final before a read."""
        for job_id in sorted(self._prefetching):
            self.manager.complete(self.engine.wait(job_id))
        self._prefetching.clear()

    def pin(self, keys: Sequence[bytes]) -> None:
        """Marks blocks as read by a live sequence: never evicted until ``release``."""
        with self._lock:
            self.manager.ref(self._present_ids(keys))

    def release(self, keys: Sequence[bytes]) -> None:
        """Undoes ``pin``; releasing more than was pinned raises (counts never go negative)."""
        with self._lock:
            self.manager.unref(self._present_ids(keys))

    def stats(self) -> dict:
        """Per-tier hits, inserts, evictions, demotions, promotions, bytes; queue depth; NVMe stats."""
        with self._lock:
            self._consume()
            block_bytes = self.layout.block_bytes
            moved = {f"{self._stats.tiers[s].name}->{self._stats.tiers[d].name}": n * block_bytes
                     for (s, d), n in self._stats.blocks_moved().items()}
            nvme = next((m.stats.copy() for m in self._media if isinstance(m, NVMeStore)), None)
            return {"tiers": [t.as_dict() for t in self._stats.tiers], "hits": self._stats.hits, "misses": self._stats.misses,
                    "bytes_moved": moved, "queue_depth": self.engine.inflight, "key_collisions": self.collisions,
                    "token_mismatches": self.token_mismatches, "nvme": nvme}

    def flush(self) -> None:
        """Makes every NVMe block written so far durable."""
        with self._lock:
            for medium in self._media:
                if isinstance(medium, NVMeStore):
                    medium.flush()

    def close(self, persist: bool = True) -> int:
        """Finishes in-flight work, makes the NVMe tier durable and closes it; idempotent.

        With ``persist`` (default), blocks held only in DRAM and HBM are first moved to free
        NVMe slots (DRAM first, then HBM; nothing already on NVMe is evicted for them), so a
        reopened store holds as much as fits. Returns the number of blocks persisted.
        """
        with self._lock:
            if self._closed:
                return 0
            self._settle_prefetches()
            self.manager.poll()
            persisted = self._persist_upper_tiers() if persist else 0
            self.flush()
            for medium in self._media:
                if isinstance(medium, NVMeStore):
                    medium.close()
            self._closed = True
            return persisted

    def _persist_upper_tiers(self) -> int:
        """Moves unpinned DRAM, then HBM, blocks into free NVMe slots; returns how many."""
        names = [d.name for d in self.manager.dirs]
        if "nvme" not in names or self.manager.write_through:
            return 0
        nvme, moved = names.index("nvme"), 0
        for tier in reversed(range(nvme)):
            directory = self.manager.dirs[tier]
            ids = [i for i in directory.slot_of if i not in directory.pins][: self.manager.dirs[nvme].n_free]
            if ids and self.manager.move(ids, tier, nvme):
                moved += len(ids)
        self.events.drain()  # shutting down is not traffic
        return moved

    def __enter__(self) -> "TieredKVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_invariants(self) -> None:
        """Asserts the manager, the key map and the NVMe tier agree."""
        with self._lock:
            self.manager.check_invariants()
            for tier, medium in enumerate(self._media):
                directory = self.manager.dirs[tier]
                assert all(i in self._keys for i in directory.slot_of), f"{directory.name}: block without a key"
                if isinstance(medium, NVMeStore):
                    for block_id, slot in directory.slot_of.items():
                        assert medium.slot_of(self._keys[block_id]) == slot, f"nvme: block {block_id} not at slot {slot}"

    # -- internals -----------------------------------------------------------------------
    def _present_ids(self, keys: Sequence[bytes]) -> list[int]:
        ids = self._ids(keys, register=False)
        if any(i is None for i in ids):
            raise KeyError("a key is not stored")
        return ids

    def _gather(self, keys: Sequence[bytes], ids: list[int], out: torch.Tensor | None) -> torch.Tensor:
        """Reads blocks from wherever they now are into one tensor on the HBM device."""
        top = self._media[0]
        if out is None:
            out = torch.empty((len(ids), *self.layout.block_shape), dtype=top.dtype, device=top.device)
        slot_of = self.manager.dirs[0].slot_of
        if all(i in slot_of for i in ids):  # the common case: one gather from the HBM pool
            index = torch.tensor([slot_of[i] for i in ids], dtype=torch.long, device=top.device)
            return torch.index_select(top.tensor, 0, index, out=out)
        for index, block_id in enumerate(ids):
            tier = self.manager.locate(block_id)
            if tier is None:
                raise KeyError(f"key {keys[index].hex()} proved unreadable and was dropped")
            slot = self.manager.dirs[tier].slot_of[block_id]
            self._read_one(tier, slot, keys[index], out[index])
        return out

    def _read_one(self, tier: int, slot: int, key: bytes, dest: torch.Tensor) -> None:
        medium = self._media[tier]
        if isinstance(medium, BlockPool):
            dest.copy_(medium.view(slot))
            return
        host = dest if dest.device.type == "cpu" else torch.empty_like(dest, device="cpu")
        if not medium.get([key], [host])[0]:
            raise KeyError(f"key {key.hex()} is stored but unreadable (corrupt chunk)")
        if host is not dest:
            dest.copy_(host)

    def _forget_absent(self, ids: Sequence[int]) -> None:
        """Drops key-map entries of blocks no tier holds (refused, or left the hierarchy),
        so the map holds exactly the resident blocks."""
        for block_id in ids:
            if self.manager.locate(block_id) is None:
                self._keys.pop(block_id, None)
                self._tokens.pop(block_id, None)

    def _consume(self) -> None:
        self.manager.poll()
        self._stats.consume(self.events.drain())

    def _adopt_stored_blocks(self) -> None:
        """Reopening: every complete block of the NVMe store joins the NVMe tier."""
        for tier, medium in enumerate(self._media):
            if isinstance(medium, NVMeStore):
                entries = medium.items()
                ids = [key_to_int(key) for key, _ in entries]
                self._keys.update(zip(ids, (key for key, _ in entries)))
                if ids:
                    self.manager.restore(tier, ids, [slot for _, slot in entries])
                self.events.drain()  # adoption is not traffic

    def _check_open(self) -> None:
        if self._closed:
            raise UserError("TieredKVStore: the store is closed")


def _check_tiers(tiers: Sequence[TierConfig], path) -> None:
    names = [t.name for t in tiers]
    if not tiers or names[0] != "hbm" or names != sorted(names, key=("hbm", "dram", "nvme").index) or len(set(names)) != len(names):
        raise UserError(f"TieredKVStore: tiers must be hbm[, dram][, nvme] in that order, got {names}")
    if "nvme" in names and path is None:
        raise UserError("TieredKVStore: an nvme tier needs path= (the store directory)")
    if path is not None and os.path.isfile(path):
        raise UserError(f"TieredKVStore: store path {os.fspath(path)!r} is a file")


def _check_online(eviction: str | None, tiers: Sequence[TierConfig]) -> None:
    """A live store cannot know the future: offline policies (Belady) are refused."""
    from tiercache.policies import get_eviction

    for name in {eviction} if eviction else {t.eviction for t in tiers}:
        if get_eviction(name).needs_future:
            raise UserError(f"TieredKVStore: eviction policy {name!r} needs the future (offline only); use it in tiercache replay")


def _open_medium(tier: TierConfig, layout: KVLayout, path, device) -> BlockPool | NVMeStore:
    if tier.name == "hbm":
        return hbm_pool(layout, tier.capacity_blocks, device)
    if tier.name == "dram":
        return dram_pool(layout, tier.capacity_blocks)
    return NVMeStore(path, layout, tier.capacity_blocks)
