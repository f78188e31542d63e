"""Holds of a block lost while live sequences held it (probe R7, finding 2).

A live sequence S holds block X; X's stored bytes prove unreadable and X leaves the hierarchy
(``TierManager.report_lost``, what a corrupt NVMe chunk's reader calls). Another sequence T
stores the same prompt again: the same key, so the same id X, held once by T. ``S.free()``
(or the free of a fork of S made after the loss) used to release T's hold: other traffic then
evicted X and ``T.attend`` failed. The holds a loss ends are now kept as orphan holds of the
id and spent first by the releases, so every listing releases exactly once and never
another live sequence's hold; ``TieredKVCache.check_invariants`` compares each block's holds
with the live sequences' listings of it. Each test failed before the fix.
"""

from __future__ import annotations

import collections
import glob
import os
import random

import pytest
import torch

from tiercache import TieredKVCache
from tiercache.attention import dense_reference
from tiercache.config import KVLayout, TierConfig
from tiercache.errors import UserError

LAYOUT = KVLayout(layers=1, kv_heads=1, head_dim=4, dtype="float32", block_tokens=4)
PROMPT = list(range(1, 14))  # 13 tokens: 3 content-keyed blocks, a token left to compute


def _cache(tmp_path, tiers=(2, 2, 6), **options) -> TieredKVCache:
    names = ("hbm", "dram", "nvme")
    return TieredKVCache(LAYOUT, [TierConfig(n, c) for n, c in zip(names, tiers)], path=tmp_path / "nvme",
                         device="cpu", **options)


def _kv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, tokens, 4, generator=gen), torch.randn(1, tokens, 4, generator=gen)


def _first_block(seq) -> int:
    return int(seq._layers[0].ids[0])


def _orphans(cache) -> dict[int, int]:
    return dict(getattr(cache.manager, "orphan_holds", {}))


def _pressure(cache, seed: int = 1000) -> None:
    """Other traffic: private blocks filling every slot the live sequences do not hold, so
    every block they do not hold goes out of the hierarchy."""
    filler = cache.sequence()
    room = cache.capacity_blocks - len(cache.manager.held)
    if room > 0:
        filler.append(0, *_kv(4 * room, seed))
    filler.free()


def _attends_as_stored(seq, k: torch.Tensor, v: torch.Tensor) -> bool:
    q = torch.randn(2, 1, 4, generator=torch.Generator().manual_seed(7))
    return float((seq.attend(0, q).double() - dense_reference(q, k, v)).abs().max()) < 1e-5


# -- the finding ------------------------------------------------------------------------------
@pytest.mark.parametrize("fork", [False, True])
def test_the_free_of_a_sequence_that_lost_a_block_keeps_the_hold_of_one_that_stored_it_again(tmp_path, fork):
    k, v = _kv(10, 0)
    with _cache(tmp_path) as cache:
        s = cache.sequence(tokens=PROMPT)
        s.append(0, k, v)  # blocks 0 and 1 under content keys, a 2-token tail
        x = _first_block(s)
        cache.manager.report_lost(cache.manager.locate(x), [x])
        cache._settle_events()
        f = s.fork() if fork else None  # lists x too, though x is gone
        assert _orphans(cache) == {x: 2 if fork else 1}
        t = cache.sequence(tokens=PROMPT)
        assert t.cached_tokens == 0  # the prefix starts with the lost block
        t.append(0, k, v)
        assert _first_block(t) == x and cache.manager.held[x] == 1
        cache.check_invariants()
        s.free()
        if f is not None:
            f.free()
        assert cache.manager.held.get(x) == 1 and not _orphans(cache)  # t's hold is t's
        cache.check_invariants()
        _pressure(cache)
        assert cache.manager.locate(x) is not None
        assert _attends_as_stored(t, k, v)
        t.free()
        assert not cache.manager.held and not _orphans(cache)
        cache.check_invariants()


def test_a_corrupt_nvme_chunk_then_a_fork_then_frees_leave_the_restored_blocks_hold(tmp_path):
    k, v = _kv(10, 1)
    with TieredKVCache(LAYOUT, [TierConfig("hbm", 1), TierConfig("nvme", 6)], path=tmp_path / "c", device="cpu",
                       prefetch="none") as cache:
        s = cache.sequence(tokens=PROMPT)
        s.append(0, k, v)  # block 0 goes down to NVMe, block 1 stays in HBM
        x = _first_block(s)
        assert cache.manager.locate(x) == 1
        for chunk in glob.glob(os.path.join(tmp_path / "c", "c.*")):
            with open(chunk, "r+b") as fh:
                fh.write(os.urandom(os.path.getsize(chunk)))
        with pytest.raises(RuntimeError, match="unreadable"):
            s.attend(0, torch.randn(2, 1, 4))
        assert cache.manager.locate(x) is None
        f = s.fork()
        t = cache.sequence(tokens=PROMPT)
        t.append(0, k, v)
        assert _first_block(t) == x
        s.free()
        f.free()
        assert cache.manager.held.get(x) == 1
        cache.check_invariants()
        for i in range(3):
            other = cache.sequence()
            other.append(0, *_kv(16, 100 + i))
            other.free()
        assert _attends_as_stored(t, k, v)
        t.free()
        assert not cache.manager.held and not _orphans(cache)


def test_check_invariants_names_a_block_released_for_a_sequence_that_still_lists_it(tmp_path):
    with _cache(tmp_path) as cache:
        s = cache.sequence(tokens=PROMPT)
        s.append(0, *_kv(10, 2))
        x = _first_block(s)
        cache.manager.unhold([x])  # what the old release did to a live sequence's hold
        with pytest.raises(AssertionError, match=f"block {x}: live sequences list it 1 times, 0 holds"):
            cache.check_invariants()
        cache.manager.hold([x])
        cache.check_invariants()
        s.free()
        cache.check_invariants()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_free_that_fails_part_way_releases_each_listing_once_orphans_included(tmp_path, monkeypatch, error):
    k, v = _kv(10, 3)
    with _cache(tmp_path) as cache:
        s = cache.sequence(tokens=PROMPT)
        s.append(0, k, v)
        x, y = (int(i) for i in s._layers[0].ids[:2])
        cache.manager.report_lost(cache.manager.locate(x), [x])
        f = s.fork()  # x: orphan-held twice (s, f); y: held twice
        t = cache.sequence(tokens=PROMPT)  # stores x again (held once), reuses nothing
        t.append(0, k, v)
        assert cache.manager.held == {x: 1, y: 3} and _orphans(cache) == {x: 2}
        real = cache.driver.release

        def part_way(ids):
            real(ids[:1])  # x's release, then it fails
            raise error("injected")

        monkeypatch.setattr(cache.driver, "release", part_way)
        with pytest.raises(error, match="injected"):
            s.free()
        monkeypatch.undo()
        assert s._unreleased == [y] and _orphans(cache) == {x: 1}
        cache.check_invariants()  # s still lists y: its hold stays counted
        s.free()  # releases y only
        assert cache.manager.held == {x: 1, y: 2} and _orphans(cache) == {x: 1}
        cache.check_invariants()
        f.free()
        assert cache.manager.held == {x: 1, y: 1} and not _orphans(cache)
        _pressure(cache)
        assert _attends_as_stored(t, k, v)
        t.free()
        assert not cache.manager.held and not _orphans(cache) and not cache._listed
        cache.check_invariants()


def test_a_held_block_whose_lower_copy_is_lost_keeps_its_hold_in_write_through(tmp_path):
    k, v = _kv(8, 4)
    with _cache(tmp_path, tiers=(2, 2, 6), write_through=True) as cache:
        s = cache.sequence()
        s.append(0, k, v)
        x = _first_block(s)
        assert cache.manager.locate(x) == 0 and x in cache.manager.dirs[2].slot_of
        cache.manager.report_lost(2, [x])  # the NVMe copy is unreadable; HBM's is fine
        assert cache.manager.locate(x) == 0
        assert cache.manager.held.get(x) == 1 and not _orphans(cache)
        cache.check_invariants()
        _pressure(cache)
        assert _attends_as_stored(s, k, v)
        s.free()
        assert not cache.manager.held
        cache.check_invariants()


def test_a_referenced_block_whose_lower_copy_is_lost_keeps_its_references_in_write_through(tmp_path):
    k, v = _kv(8, 5)
    with _cache(tmp_path, tiers=(2, 2, 6), write_through=True) as cache:
        s = cache.sequence()
        s.append(0, k, v)
        x = _first_block(s)
        cache.manager.ref([x])  # a reader of x, in flight
        cache.manager.report_lost(2, [x])  # the NVMe copy is unreadable; HBM's is fine
        assert cache.manager.refs.get(x) == 1 and x not in cache.manager.orphan_refs
        cache.manager.unref([x])
        assert x not in cache.manager.refs
        s.free()
        cache.check_invariants()


# -- randomized --------------------------------------------------------------------------------
class _Live:
    """A live sequence with the KV it appended and, per listing, the loss count of its block
    when it was listed (None: listed while lost, an orphan hold)."""

    def __init__(self, seq, k: torch.Tensor, v: torch.Tensor, gens: list) -> None:
        self.seq, self.k, self.v, self.gens = seq, k, v, gens


class _Run:
    """Random sequences, forks, losses, re-stores, appends, pressure and frees, checked after
    every step against an oracle of listings and losses."""

    def __init__(self, cache, seed: int) -> None:
        self.cache, self.rnd = cache, random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.prompts = [[p * 100 + i for i in range(13)] for p in range(3)]
        self.prompt_kv = [_kv(12, 50 + p) for p in range(3)]  # the same content has the same KV
        self.live: list[_Live] = []
        self.losses: collections.Counter = collections.Counter()

    def _listing(self, block_id: int):
        return self.losses[block_id] if self.cache.manager.locate(block_id) is not None else None

    def _ids(self, live: _Live) -> list[int]:
        return [int(i) for i in live.seq._layers[0].ids[: live.seq.blocks(0)]]

    def new(self) -> None:
        p = self.rnd.randrange(3)
        seq = self.cache.sequence(tokens=self.prompts[p])
        k, v = self.prompt_kv[p]
        live = _Live(seq, k[:, : seq.cached_tokens], v[:, : seq.cached_tokens], [])
        live.gens = [self._listing(b) for b in self._ids(live)]
        self.live.append(live)
        if seq.cached_tokens < 12:
            self.append(live, k[:, seq.cached_tokens :], v[:, seq.cached_tokens :])

    def append(self, live: _Live, k=None, v=None) -> None:
        if k is None:  # private KV (no token ids told): private keys
            k = torch.randn(1, self.rnd.randint(1, 6), 4, generator=self.gen)
            v = torch.randn(k.shape, generator=self.gen)
        before = live.seq.blocks(0)
        try:
            live.seq.append(0, k, v)
        except UserError as exc:  # more than the tiers hold next to the live sequences
            assert "do not fit" in str(exc)
            return
        live.k, live.v = torch.cat([live.k, k], 1), torch.cat([live.v, v], 1)
        live.gens += [self._listing(b) for b in self._ids(live)[before:]]

    def fork(self) -> None:
        source = self.rnd.choice(self.live)
        twin = _Live(source.seq.fork(), source.k, source.v, [])
        twin.gens = [self._listing(b) for b in self._ids(twin)]
        self.live.append(twin)

    def lose(self) -> None:
        live = self.rnd.choice(self.live)
        manager = self.cache.manager
        resident = [b for b in self._ids(live) if manager.locate(b) is not None]
        if resident:
            block_id = self.rnd.choice(resident)
            manager.report_lost(manager.locate(block_id), [block_id])
            self.cache._settle_events()
            if manager.locate(block_id) is None:  # a block pinned by a move in flight stays
                self.losses[block_id] += 1

    def free(self) -> None:
        self.live.pop(self.rnd.randrange(len(self.live))).seq.free()

    def pressure(self) -> None:
        _pressure(self.cache, self.rnd.randrange(10**6))

    def check(self) -> None:
        cache, manager = self.cache, self.cache.manager
        cache.check_invariants()
        listed: collections.Counter = collections.Counter()
        current: collections.Counter = collections.Counter()
        for live in self.live:
            ids = self._ids(live)
            assert len(ids) == len(live.gens)
            listed.update(ids)
            current.update(b for b, g in zip(ids, live.gens) if g is not None and g == self.losses[b])
        orphans = _orphans(cache)
        for block_id in set(listed) | set(manager.held) | set(orphans):
            assert manager.held.get(block_id, 0) + orphans.get(block_id, 0) == listed[block_id], block_id
        for block_id, count in current.items():  # listed since its last loss: held, so still stored
            assert manager.held.get(block_id, 0) >= count and manager.locate(block_id) is not None, block_id

    def attend_all(self) -> None:
        """Every live sequence whose blocks are all stored attends as the dense reference over
        what it appended; one missing a block is told so."""
        for live in self.live:
            if not live.seq.blocks(0) and not live.k.shape[1]:
                continue
            if all(self.cache.manager.locate(b) is not None for b in self._ids(live)):
                assert _attends_as_stored(live.seq, live.k, live.v)
            else:
                with pytest.raises(RuntimeError, match="no longer stored|unreadable"):
                    live.seq.attend(0, torch.randn(2, 1, 4))

    def step(self) -> None:
        ops = [self.new] * 3 + [self.pressure] * 2
        if self.live:
            ops += [self.fork] * 2 + [self.lose] * 3 + [self.free] * 2 + [lambda: self.append(self.rnd.choice(self.live))]
        self.rnd.choice(ops)()


@pytest.mark.parametrize("seed", range(6))
def test_random_losses_forks_restores_and_frees_keep_every_listing_held_once(tmp_path, seed):
    with _cache(tmp_path, tiers=(2, 2, 20), prefetch="none" if seed % 2 else "topk_speculative") as cache:
        run = _Run(cache, seed)
        for _ in range(70):
            run.step()
            run.check()
            if run.rnd.random() < 0.2:
                run.pressure()
                run.check()
                run.attend_all()
        run.rnd.shuffle(run.live)
        while run.live:
            run.free()
            run.check()
        assert not cache.manager.held and not _orphans(cache) and not cache._listed
        cache.check_invariants()
