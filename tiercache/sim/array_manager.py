"""The replay's manager over array state: a whole request per compiled call.

``ArrayTierManager`` is ``TierManager`` for a replay of an exclusive hierarchy whose tiers
admit everything and whose policy has a kernel (``tiercache.policies.KERNELS``): the same
``access`` / ``prefix_length`` / ``locate`` / ``check_invariants``, the same counts, but its
state lives in numpy arrays indexed by a dense id (``0 .. n_ids - 1``, as ``ReplayData``
numbers the trace's blocks) and ``access`` hands the request to ``tiercache.sim.chain``.
No plans or events are made: nothing moves bytes in a replay, and the counters are what
the Python manager's events would have summed to (``tests/test_kernels.py`` checks it).

``run`` replays many requests in one compiled call (each one ``access``, as ``replay``'s
step functions call it), which is how ``replay`` uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tiercache.core.stats import HierarchyStats, TierCounters
from tiercache.policies import get_eviction, get_kernel
from tiercache.policies.kernels import G_ROWS, HAVE_NUMBA, PROT, S_REQ, TIER_OF, leafprio, lfu

from . import chain
from .engine import GPU
from .hitcost import HitCost, in_place_cost, promoted_cost

__all__ = ["ArrayTierManager", "kernel_replay_possible", "state_bytes", "HAVE_NUMBA"]


def kernel_replay_possible(policy: str, admission: str, write_through: bool) -> bool:
    """Whether a replay of ``policy`` can run on kernels (numba present, a kernel for the
    policy, every lower tier admitting everything, exclusive tiers)."""
    return HAVE_NUMBA and admission == "always" and not write_through and get_kernel(policy) is not None


def state_bytes(policy: str, n_tiers: int, n_ids: int, max_count: int = 1) -> int:
    """Bytes of the arrays an ``ArrayTierManager`` of ``policy`` allocates (grows with the
    trace's distinct ids: per id, 64 B for LRU plus 24 per further tier, 664 for ``session``
    plus 96 per further tier)."""
    module = get_kernel(policy)
    width = max(max(1, n_ids), max_count + 2) + 1
    rows = n_tiers + getattr(module, "EXTRA_ROWS", 0)
    extra = getattr(module, "X_EXTRA", None)
    x_cells = n_tiers if extra is None else rows * (width + extra)
    cells = rows * width * (module.FIELDS + 1) + x_cells + getattr(module, "G_ROWS", G_ROWS) * width
    return 8 * cells


@dataclass
class ArrayTierManager:
    """Array state of a hierarchy (see ``tiercache.sim.chain`` for the layout).

    Invariants (``check_invariants``): ``tier_of`` names at most one tier per id; each tier's
    used count equals the ids it holds and the ids its policy tracks, and never exceeds its
    capacity. With the ``lfu`` kernel no id's count passes ``count_limit`` through the checked
    entry points (``access``, ``run`` unless ``trusted``): its counts index rows of ``P``.

    ``max_count`` is the most accesses any one id gets (``replay`` passes the trace's,
    ``ReplayData.max_count``); ``lfu``'s count buckets are sized by it (``count_limit``).
    """

    policy: str
    names: tuple[str, ...]
    capacities: tuple[int, ...]
    n_ids: int
    max_count: int = 1

    def __post_init__(self) -> None:
        module = get_kernel(self.policy)
        if module is None:
            raise ValueError(f"policy {self.policy!r} has no kernel")
        if any(c < 1 for c in self.capacities) or not self.capacities:
            raise ValueError(f"capacities must be >= 1, got {self.capacities}")
        n, tiers = max(1, self.n_ids), len(self.capacities)
        if tiers > chain.MAX_TIERS:
            raise ValueError(f"at most {chain.MAX_TIERS} tiers, got {tiers}")
        self.kind = module.CODE
        width = max(n, self.max_count + 2) + 1
        rows = tiers + getattr(module, "EXTRA_ROWS", 0)
        self.P = np.zeros((rows, width, module.FIELDS + 1), dtype=np.int64)
        self.M = np.zeros((tiers + 1, chain.WIDTH), dtype=np.int64)
        extra = getattr(module, "X_EXTRA", None)
        self.X = np.zeros((tiers, 1) if extra is None else (rows, width + extra), dtype=np.float64)
        self.G = np.zeros((getattr(module, "G_ROWS", G_ROWS), width), dtype=np.int64)
        self.G[TIER_OF] = -1
        if len(self.G) > leafprio.ORIG:
            self.G[leafprio.ORIG] = np.arange(width)  # ties by id: the dense id unless set_trace_ids
        self.M[:tiers, chain.CAP] = self.capacities
        self.M[tiers, chain.S_CHUNK] = min(self.capacities) if module.BATCH_INSERT_SAFE else 1
        self.M[tiers, chain.S_GROUP_CAP] = min(self.capacities)
        self.M[tiers, chain.S_NEEDS_FUTURE] = get_eviction(self.policy).needs_future
        self.M[tiers, chain.S_NEEDS_PARENTS] = get_eviction(self.policy).needs_parents
        chain.init_all(self.kind, self.P, self.M, self.X)

    def set_trace_ids(self, dense: np.ndarray, ids: np.ndarray) -> None:
        """Gives the kernels each dense id's id in the trace (``ids[k]`` is ``dense[k]``'s), so
        that ties of key break by trace id as the Python classes break them."""
        if len(self.G) > leafprio.ORIG and len(dense):
            self.G[leafprio.ORIG, dense] = ids

    @property
    def n_tiers(self) -> int:
        return len(self.capacities)

    @property
    def count_limit(self) -> int:
        """The largest LFU count the arrays hold: ``max(n_ids, max_count + 2)`` (a count indexes
        a row of ``P``; numba does not check it)."""
        return self.P.shape[1] - 1

    def _state(self) -> tuple:
        return self.kind, self.P, self.M, self.X, self.G

    @property
    def _totals(self) -> np.ndarray:
        return self.M[self.n_tiers]

    # -- the access path -----------------------------------------------------------------
    def _dense(self, ids, what: str) -> np.ndarray:
        """``ids`` as the int32 array the kernels take, after checking each is a dense id of
        this manager (the compiled code does not check bounds: a stray id would write outside
        the state arrays).

        Raises:
            ValueError: an id outside ``0 .. n_ids - 1``, naming it.
        """
        wide = np.asarray(ids, dtype=np.int64).reshape(-1)
        if wide.size and (wide.min() < 0 or wide.max() >= self.n_ids):
            bad = int(wide[(wide < 0) | (wide >= self.n_ids)][0])
            raise ValueError(f"{what}: block {bad} is not a dense id of this manager (0 .. {self.n_ids - 1})")
        return np.ascontiguousarray(wide, dtype=np.int32)  # one compiled signature: ReplayData.dense's

    def access(self, ids: np.ndarray, next_use: np.ndarray | None = None, count_hits: bool = True) -> None:
        """``TierManager.access(ids, Hints(next_use=...), count_hits)`` on dense ids.

        Raises:
            ValueError: an id that is not a dense id of this manager, ``next_use`` of another
                length, or none for a policy that needs it; with ``lfu``, an id whose count
                could pass ``count_limit`` (``_check_counts``). Nothing has changed then.
        """
        ids = self._dense(ids, "access")
        nus = np.zeros(len(ids), dtype=np.int64) if next_use is None else np.ascontiguousarray(next_use, dtype=np.int64).reshape(-1)
        if len(nus) != len(ids):
            raise ValueError(f"access: {len(ids)} ids but {len(nus)} next uses")
        if self._totals[chain.S_NEEDS_FUTURE] and next_use is None:
            raise ValueError(f"{self.policy}: needs next_use with every access")
        self._check_counts(ids, "access")
        self._totals[S_REQ] = 0  # the ids are one request: the first has no parent
        chain.access(*self._state(), ids, nus, 0, len(ids), count_hits)

    def run(self, ids: np.ndarray, next_use: np.ndarray, offsets: np.ndarray, first: int, last: int, prefix: bool,
            hit_len: np.ndarray, trusted: bool = False, caps: np.ndarray | None = None) -> None:
        # ids int32 (dense), next_use, offsets, hit_len and caps int64: one compiled signature.
        """Requests ``first .. last - 1`` of a trace (request ``r`` is ``ids[offsets[r]:offsets[r+1]]``):
        one ``access`` each, or in prefix semantics the prefix lookup (length into
        ``hit_len[r]``, at most ``caps[r]`` blocks: ``reuse.reusable_blocks``; no cap when
        ``caps`` is None), an access of the cached prefix and one of the rest without hits.

        The requests' bounds and ids are checked first (O(their accesses), in numpy): the
        compiled code does not check bounds. ``trusted`` skips that for arrays whose ids and
        bounds are known good and whose ids are accessed at most ``max_count`` times in all
        (``ReplayData.prepare``'s with its ``max_count``: replay calls this once per chunk).

        Raises:
            ValueError: request bounds outside the arrays or not increasing, arrays of other
                lengths, an id that is not a dense id of this manager, or with ``lfu`` an id
                whose count could pass ``count_limit`` (``_check_counts``). Nothing has run then.
        """
        if caps is None:
            caps = np.diff(offsets).astype(np.int64)  # every block of a request may be reused
        if not trusted:
            self._check_run(ids, next_use, offsets, first, last, hit_len, caps)
        chain.run_requests(*self._state(), ids, next_use, offsets, first, last, prefix, hit_len, caps)

    def _check_run(self, ids: np.ndarray, next_use: np.ndarray, offsets: np.ndarray, first: int, last: int,
                   hit_len: np.ndarray, caps: np.ndarray) -> None:
        """Raises ValueError unless requests ``first .. last - 1`` lie in the arrays and hold dense ids."""
        if not 0 <= first <= last < len(offsets) or min(len(hit_len), len(caps)) < last or len(next_use) != len(ids):
            raise ValueError(f"run: requests {first}..{last} with {len(offsets)} offsets, {len(hit_len)} hit lengths, "
                             f"{len(caps)} caps, {len(ids)} ids and {len(next_use)} next uses")
        if last > first and caps[first:last].min() < 0:
            raise ValueError(f"run: a negative cap among requests {first}..{last}")
        bounds = offsets[first : last + 1]
        if bounds[0] < 0 or bounds[-1] > len(ids) or np.any(np.diff(bounds) < 0):
            raise ValueError(f"run: offsets of requests {first}..{last} leave 0 .. {len(ids)} or decrease")
        chunk = ids[bounds[0] : bounds[-1]]
        if chunk.size and (chunk.min() < 0 or chunk.max() >= self.n_ids):
            self._dense(chunk, "run")  # raises, naming the id
        self._check_counts(chunk, "run", f" in requests {first}..{last}")

    def _check_counts(self, ids: np.ndarray, what: str, where: str = "") -> None:
        """Raises ValueError when, with the ``lfu`` kernel, accessing dense ``ids`` (in order)
        could take an id's count past ``count_limit``: its count now (0 where no tier holds
        it) plus its occurrences in ``ids`` is a bound, since each access adds at most one and
        a block entering a tier starts at 1. O(len(ids) log len(ids)), in numpy; other kernels
        keep no per-id count in an index.
        """
        if self.kind != lfu.CODE or not len(ids):
            return
        unique, times = np.unique(np.asarray(ids, dtype=np.int64), return_counts=True)
        tier = self.G[TIER_OF, unique]
        count = np.where(tier >= 0, self.P[np.maximum(tier, 0), unique, lfu.FREQ], 0) + times
        over = np.flatnonzero(count > self.count_limit)
        if len(over):
            k = over[0]
            raise ValueError(f"{what}: block {int(unique[k])} could reach LFU count {int(count[k])}{where}, past the "
                             f"{self.count_limit} this manager's arrays hold (max(n_ids, max_count + 2) with n_ids "
                             f"{self.n_ids}, max_count {self.max_count}: give max_count the most accesses of any one id)")

    def prefix_length(self, ids: Sequence[int]) -> int:
        """Leading ids resident in some tier."""
        ids = self._dense(ids, "prefix_length")
        return int(chain.prefix_length(self.G, ids, 0, len(ids)))

    def locate(self, block_id: int) -> int | None:
        """The tier holding a dense id, or None."""
        tier = int(self.G[TIER_OF, self._dense([block_id], "locate")[0]])
        return None if tier < 0 else tier

    # -- results -------------------------------------------------------------------------
    def stats(self) -> HierarchyStats:
        """The counters ``HierarchyStats.consume`` would have summed from the events."""
        M = self.M
        tiers = [
            TierCounters(name, cap, hits=int(M[t, chain.C_HITS]), inserts=int(M[t, chain.C_INSERTS]),
                         evictions=int(M[t, chain.C_EVICTIONS]), demotions=int(M[t, chain.C_DEMOTIONS]),
                         promotions=int(M[t, chain.C_PROMOTIONS]), refused=int(M[t, chain.C_REFUSED]),
                         promote_skipped=int(M[t, chain.C_PSKIP]))
            for t, (name, cap) in enumerate(zip(self.names, self.capacities))
        ]
        totals = self._totals
        stats = HierarchyStats(tiers, misses=int(totals[chain.S_MISSES]), recomputed=int(totals[chain.S_RECOMPUTED]))
        for (src, dst), blocks, _ in self._links():
            stats._moves[(src, dst)] = blocks
        return stats

    def _links(self) -> list[tuple[tuple[int, int], int, int]]:
        """((source, destination), blocks, transfers) of every link a move used."""
        out = []
        for src in range(self.n_tiers):
            for dst in range(self.n_tiers):
                transfers = int(self.M[src, chain.LINK_TRANSFERS + dst])
                if transfers:
                    out.append(((src, dst), int(self.M[src, chain.LINK_BLOCKS + dst]), transfers))
        return out

    def charge(self, engine) -> list[HitCost]:
        """Books every move, read in place and write of a computed block on ``engine``'s links
        (``SimEngine.charge``) and returns each tier's hit costs, as ``HitMeter`` and
        ``SimEngine.fill`` would have (a top tier that is not HBM: its hits and the promoted
        ones are read on to HBM, computed blocks written from HBM into it)."""
        M, first_read = self.M, 1 if engine.gpu_is_top else 0  # an HBM top tier's hits read nothing
        for (src, dst), blocks, transfers in self._links():
            engine.charge(src, dst, blocks, transfers)
        for t in range(first_read, self.n_tiers):
            if M[t, chain.C_READ_THROUGHS]:
                engine.charge(t, GPU, int(M[t, chain.C_IN_PLACE]), int(M[t, chain.C_READ_THROUGHS]))
        if not engine.gpu_is_top:
            self._charge_top_to_gpu(engine)
        costs = []
        for t in range(self.n_tiers):
            cost = HitCost()
            cost.add_in_place(int(M[t, chain.C_IN_PLACE]),
                              *in_place_cost(engine, t, int(M[t, chain.C_IN_PLACE]), int(M[t, chain.C_READ_THROUGHS])))
            cost.add_promoted(int(M[t, chain.C_HIT_PROMOTED]),
                              *promoted_cost(engine, t, int(M[t, chain.C_HIT_PROMOTED]), int(M[t, chain.C_HIT_PROMOTE_RUNS])))
            costs.append(cost)
        return costs

    def _charge_top_to_gpu(self, engine) -> None:
        """Books, for a top tier that is not HBM, the reads of promoted hits on from it to HBM
        (one per promotion) and the writes of computed blocks from HBM into it."""
        M, lower = self.M, slice(1, self.n_tiers)
        onward = int(M[lower, chain.C_HIT_PROMOTED].sum()), int(M[lower, chain.C_HIT_PROMOTE_RUNS].sum())
        written = int(M[0, chain.C_FILLED]), int(M[0, chain.C_FILLS])
        for src, dst, (blocks, transfers) in ((0, GPU, onward), (GPU, 0, written)):
            if transfers:
                engine.charge(src, dst, blocks, transfers)

    # -- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Asserts residency, used counts and policy sizes agree (a numpy pass over the ids)."""
        tier_of = self.G[TIER_OF, : self.n_ids]
        held = np.bincount(tier_of[tier_of >= 0], minlength=self.n_tiers)
        for t in range(self.n_tiers):
            used = int(self.M[t, chain.USED])
            assert used == held[t], f"{self.names[t]}: used {used}, holds {held[t]}"
            assert 0 <= used <= self.capacities[t], f"{self.names[t]}: used {used} over capacity"
            assert _tracked(self.kind, self.M, t) == used, f"{self.names[t]}: policy tracks {_tracked(self.kind, self.M, t)}, tier holds {used}"
            if self.kind == lfu.CODE:
                _check_lfu_counts(self.P, self.M, t, np.flatnonzero(tier_of == t))
        assert not self.G[PROT].any(), "a protection mark outlived its promotion"


def _check_lfu_counts(P: np.ndarray, M: np.ndarray, t: int, held: np.ndarray) -> None:
    """Asserts tier ``t``'s LFU count list is the ascending list of the counts its ``held``
    ids have, each bucket holding exactly the ids of its count, linked both ways."""
    counts, filed, f, before = [], 0, int(M[t, lfu.LOW]), lfu.NIL
    while f != lfu.NIL:
        assert int(P[t, f, lfu.CPREV]) == before, f"count {f}: back link {P[t, f, lfu.CPREV]}, not {before}"
        assert not counts or f > counts[-1], f"count list out of order: {counts[-1]} then {f}"
        members, x = [], int(P[t, f, lfu.BHEAD])
        while x != lfu.NIL:
            members.append(x)
            x = int(P[t, x, lfu.NXT])
        assert members and all(P[t, m, lfu.FREQ] == f for m in members), f"bucket {f} empty or holds other counts"
        counts.append(f)
        filed += len(members)
        before, f = f, int(P[t, f, lfu.CNEXT])
    assert filed == len(held), f"buckets hold {filed} ids, the tier {len(held)}"
    assert counts == sorted(set(P[t, held, lfu.FREQ].tolist())), f"count list {counts} is not the held ids' counts"


def _tracked(kind: int, M: np.ndarray, t: int) -> int:
    """Ids the tier's policy tracks, from its meta slots."""
    from tiercache.policies.kernels import arc, belady, cost, fifo, leaf_lru, lfu, lru, s3fifo, session, sieve

    if kind in (leaf_lru.CODE, cost.CODE, session.CODE):
        return int(M[t, leafprio.SIZE])
    if kind in (lru.CODE, fifo.CODE):
        return int(M[t, lru.SIZE])
    if kind == lfu.CODE:
        return int(M[t, lfu.SIZE])
    if kind == arc.CODE:
        return int(M[t, 2] + M[t, 5])
    if kind == s3fifo.CODE:
        return int(M[t, s3fifo.TRACKED])
    if kind == sieve.CODE:
        return int(M[t, sieve.SIZE])
    return int(M[t, belady.SIZE])
