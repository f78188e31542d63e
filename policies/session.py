"""session: request/session-aware eviction for prefix caches (leaves first, cold sessions first)."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Collection, Sequence, Union

from ._checks import hint_values
from ._leafprio import LeafPriorityPolicy
from .base import Hints

#: Default head start of a reused block, in capacities of logical time (see ``Session``).
DEFAULT_HOT_BONUS = 2.0
#: Default ghost size, in capacities: evicted ids whose use counts are remembered.
DEFAULT_GHOST = 8.0
#: An ordering: (head start of a reused block, frequency scale), both in capacities of logical
#: time (see ``Session``); a plain number is a head start with frequency scale 0.
Ordering = tuple[float, float]
#: Default alternative orderings simulated beside the default one (see ``Session``).
DEFAULT_EXPERTS: tuple[Union[float, Ordering], ...] = (0.0, 8.0, (0.0, 2.0), (4.0, 2.0))
#: Half-life of the shadows' miss counts, in capacities of logical time.
SCORE_HALF_LIFE = 32.0
#: Leaves the leader also holds that one victim search passes over before taking key order.
FOLLOW_BUDGET = 64
#: The one ordering below the top tier of a hierarchy (``Session.for_tier``): no head start,
#: frequency scale 1 (there a block's use count counts its demotions into the tier).
LOWER_TIER_ORDERING: Ordering = (0.0, 1.0)


class Session(LeafPriorityPolicy):
    """Evicts the coldest prefix-tree leaf; reused blocks get a head start; follows the best of
    a few orderings simulated online.

    A serving trace is a forest of sessions: every request starts at a root block (a system
    prompt, a document, a conversation's first turn) and extends a path of the tree. Most new
    paths are never reused (in the bundled Mooncake sample 58% of blocks are seen once; of
    sessions seen once only 18% return, of sessions seen twice 80% do), while a path that was
    reused once is reused again with high probability. So:

    * A block's key is its last-use tick (one tick per id touched, as LRU), plus a head start of
      ``hot_bonus x capacity`` ticks once the block has been used at least twice ("hot"), plus
      ``freq_scale x capacity x log2(uses)`` ticks (0 by default: a frequency term, so a block
      used 2^k times outlives one used once by k x freq_scale capacities).
    * Only leaves are victims (:class:`LeafPriorityPolicy`): a cold request is evicted tail
      first, and a session's shared prefix outlives the one-off tails hanging under it.
    * Ghost scores: use counts outlive eviction in a FIFO ghost of ``ghost x capacity`` ids, so
      a session whose prefix was evicted and comes back is recognised as hot on recompute.
    * Experts: how long a hot path deserves to stay depends on the workload (where reused
      paths die young, as finished multi-turn chats do, a long head start keeps dead paths;
      where shared documents and system prompts are read by many conversations over several
      capacities of time, as in kv-cache-tester workloads, use counts should weigh more). So
      the policy also replays the access stream it is shown through full-size shadow caches
      (prefix semantics, requests starting at a block without parent), one per ordering in
      ``((hot_bonus, freq_scale), *experts)`` (an expert is a head start, or a pair (head
      start, frequency scale); the defaults are head starts 0 and 8, the frequency ordering
      (0, 2) and the mixed (4, 2), which on Mooncake's conversation trace is the best single
      ordering at 4k blocks), counts their misses with a half-life of 32 capacities, and takes the
      ordering of the shadow with the fewest (the leader, re-picked at each request start);
      its victims are its coldest leaves that the leader does not hold (up to 64 passed over,
      then plain key order), so its contents move toward the leader's. When the leader changes,
      every tracked block is re-keyed under the new ordering (``_rekey``): otherwise blocks
      touched under a long head start keep it for capacities of time after the workload
      showed it no longer pays (on Mooncake's public conversation trace that left the policy
      15% of the gap *behind* LRU at 32k and 64k blocks, where the no-head-start ordering
      leads). ``experts=()`` turns this off (one ordering, a fifth of the work).

    Sessions are not named in Mooncake traces; here they are the prefix tree itself (a block's
    session is its root path), which is what ``Hints.parents`` gives.

    Sources and departures: the request/session-aware idea follows vLLM's session-aware
    eviction proposal and "KVCache Cache in the Wild" (Wang et al., 2025: reuse probability
    differs sharply between single-turn and multi-turn requests, and a request-level view
    beats block LRU); leaf-first order follows SGLang's radix cache; the reuse-count split is
    the LRU-2 / 2Q observation (a block seen twice is far more likely to be seen again) with
    ARC-style ghosts; following the best simulated expert is ACME's / LeCaR's idea (caching
    with online expert selection) with full shadows instead of sampled ones; the frequency
    ordering is LRFU's middle ground between recency and frequency (Lee et al., 2001) in
    additive form, as GDSF adds frequency to an aging clock. Departures: no explicit session
    ids (derived from the tree); one ordering with a head start measured in capacities of
    logical time (it scales with the cache; no trace-specific constant) instead of two
    queues; experts are whole shadow caches, not weights on one cache.

    Limits (measured with ``scripts/gap_closed.py``): the shadows cost five more caches' worth
    of policy work and memory (about 150 B per remembered id, ``ghost x capacity`` of them per
    cache). Below the top tier of a hierarchy (``for_tier``) the policy runs without experts:
    there it sees demotions and promotions, not requests, and shadows fed that stream chose
    badly (on Mooncake's conversation trace, tiers 4000/16000/64000, 2407 s of modeled TTFT
    saved with experts in every tier against LRU's 2484 s; 2540 s without them below the
    top). Its one ordering there is ``LOWER_TIER_ORDERING``, no head start and frequency
    scale 1 (a block's uses there are its demotions into the tier, so blocks the hierarchy
    keeps reusing stay longer): it beats LRU in each of eight 3-tier runs of four workloads;
    with the default head start instead it saved 7.5% less modeled TTFT than LRU on the
    kv-cache-tester sample (tiers 250/1000/4000, 34.3 s against 37.1 s), though it did better
    than this ordering in two of the eight (README, "Traces", gives the figures and how they
    were measured).

    Invariants: those of :class:`LeafPriorityPolicy`; ``_uses`` holds a count for every tracked
    id and for at most ``ghost x capacity`` untracked ids, which are exactly ``_ghost``'s keys;
    ``_tick`` holds the tick of every tracked id's last use, and each key is ``_key_of`` it;
    ``_leader`` indexes ``_shadows`` (or is 0 without them) and the head start and frequency
    scale in use are the leader's.
    """

    name = "session"

    def __init__(self, capacity: int, hot_bonus: float = DEFAULT_HOT_BONUS, ghost: float = DEFAULT_GHOST,
                 experts: Sequence[Union[float, Ordering]] = DEFAULT_EXPERTS, freq_scale: float = 0.0) -> None:
        super().__init__(capacity)
        orderings = [(hot_bonus, freq_scale), *(as_ordering(e) for e in experts)]
        if ghost < 0 or any(v < 0 for o in orderings for v in o):
            raise ValueError(f"session: hot_bonus, freq_scale, ghost and experts must be >= 0, got {hot_bonus}, "
                             f"{freq_scale}, {ghost}, {experts}")
        self._orderings = tuple(orderings)
        self._bonus = hot_bonus * capacity
        self._scale = freq_scale * capacity
        self._ghost_size = int(ghost * capacity)
        self._uses: dict[int, int] = {}
        self._tick: dict[int, int] = {}
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._shadows = [_Shadow(capacity, o, ghost) for o in self._orderings] if experts else []
        self._leader = 0
        self._decay = 0.5 ** (1.0 / (SCORE_HALF_LIFE * capacity))

    @classmethod
    def for_tier(cls, capacity: int, tier: int) -> "Session":
        """Defaults at the top tier; below it, no experts and the ordering
        ``LOWER_TIER_ORDERING``: the shadows replay the stream they are shown as requests, and a
        lower tier is shown demotions and promotions instead."""
        if tier == 0:
            return cls(capacity)
        hot_bonus, freq_scale = LOWER_TIER_ORDERING
        return cls(capacity, hot_bonus=hot_bonus, freq_scale=freq_scale, experts=())

    # -- hooks: the main ordering, then the shadows see the same ids ---------------------------
    def on_insert(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        super().on_insert(ids, hints)
        self._feed_shadows(ids, hints)

    def on_access(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        parents = hint_values(self.name, hints, "parents", len(ids), required=False)  # checked before any change
        super().on_access(ids, hints)
        self._feed_shadows(ids, None if parents is None else Hints(parents=parents))

    def victims(self, n: int, protected: Collection[int] = ()) -> list[int] | None:
        if n <= 0 or not self._shadows:
            return super().victims(n, protected)
        leader = self._shadows[self._leader].policy
        chosen = self._leaf_victims(n, protected, avoid=leader, budget=FOLLOW_BUDGET)
        if len(chosen) < n:
            picked = set(chosen)
            rest = super().victims(n - len(chosen), _Either(protected, picked))
            if rest is None:
                return None
            chosen.extend(rest)
        return chosen

    def _key_after(self, block_id: int, parent: int | None, inserted: bool) -> float:
        if inserted:
            self._ghost.pop(block_id, None)
        uses = self._uses.get(block_id, 0) + 1
        self._uses[block_id] = uses
        self._tick[block_id] = self._clock
        return self._key_of(self._clock, uses)

    def _key_of(self, tick: int, uses: int) -> float:
        """The key of a block last used at ``tick``, used ``uses`` times, under the ordering in use."""
        if uses < 2:
            return tick
        key = tick + self._bonus
        return key + self._scale * math.log2(uses) if self._scale else key

    def _rekey(self) -> None:
        """Every tracked id's key under the ordering now in use (the leader changed).

        The leaves' heap entries are replaced with seqs in order of last use (ticks are unique),
        above every earlier seq, so ties of key break the same way in the compiled kernel
        (``kernels/leafprio.rekey``). O(tracked ids); leaders change a handful of times per trace.
        """
        for block_id, tick in self._tick.items():
            self._key[block_id] = self._key_of(tick, self._uses[block_id])
        base = self._leaves.last_seq
        self._leaves.rebuild({b: (self._key[b], base + self._tick[b]) for b in self._leaves.ids()}, base + self._clock + 1)

    def _forget(self, block_id: int) -> None:
        del self._tick[block_id]
        if self._ghost_size == 0:
            del self._uses[block_id]
            return
        self._ghost[block_id] = None
        if len(self._ghost) > self._ghost_size:
            oldest, _ = self._ghost.popitem(last=False)
            del self._uses[oldest]

    def _feed_shadows(self, ids: Sequence[int], hints: Hints | None) -> None:
        """Replays ``ids`` through every shadow; re-picks the leader at each request start."""
        if not self._shadows:
            return
        parents = hints.parents if hints is not None and hints.parents is not None else [None] * len(ids)
        clock = self._clock - len(ids)
        for block_id, parent in zip(ids, parents):
            clock += 1
            if parent is None:
                self._pick_leader(clock)
            for shadow in self._shadows:
                shadow.step(block_id, None if parent == block_id else parent, clock, self._decay)

    def _pick_leader(self, clock: int) -> None:
        scores = [s.score(clock, self._decay) for s in self._shadows]
        leader = min(range(len(scores)), key=scores.__getitem__)  # ties: the default ordering
        changed = leader != self._leader
        self._leader = leader
        bonus, scale = self._orderings[self._leader]
        self._bonus, self._scale = bonus * self.capacity, scale * self.capacity
        if changed:
            self._rekey()

    def check_invariants(self) -> None:
        super().check_invariants()
        assert len(self._ghost) <= self._ghost_size, "ghost over its size"
        assert self._ghost.keys().isdisjoint(self._parent), "a tracked id is a ghost"
        assert self._uses.keys() == self._parent.keys() | self._ghost.keys(), "use counts != tracked + ghosts"
        assert self._tick.keys() == self._parent.keys(), "last-use ticks != tracked ids"
        assert all(self._key[b] == self._key_of(t, self._uses[b]) for b, t in self._tick.items()), "a key not under the ordering in use"
        assert 0 <= self._leader < max(1, len(self._shadows)), "leader out of range"
        bonus, scale = self._orderings[self._leader]
        assert (self._bonus, self._scale) == (bonus * self.capacity, scale * self.capacity), "ordering is not the leader's"
        for shadow in self._shadows:
            shadow.policy.check_invariants()
            assert len(shadow.policy) <= self.capacity, "a shadow over capacity"


def as_ordering(expert: Union[float, Ordering]) -> Ordering:
    """An expert as (head start, frequency scale): a plain number is a head start.

    Raises:
        ValueError: a sequence that is not a pair.
    """
    if isinstance(expert, (tuple, list)):
        if len(expert) != 2:
            raise ValueError(f"session: an expert is a head start or a (head start, frequency scale) pair, got {expert!r}")
        bonus, scale = expert
        return float(bonus), float(scale)
    return float(expert), 0.0


class _Either:
    """Membership in either of two containers (protected ids, or ids already picked)."""

    __slots__ = ("first", "second")

    def __init__(self, first: Collection[int], second: Collection[int]) -> None:
        self.first, self.second = first, second

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.first or block_id in self.second

    def __iter__(self):
        return iter(set(self.first) | set(self.second))

    def __len__(self) -> int:
        return len(set(self.first) | set(self.second))


class _Shadow:
    """A full-size cache run by a ``Session`` with one fixed ordering, in prefix semantics.

    ``step`` handles one access: a request starts at an id without parent; its ids hit while
    every earlier id of the request hit and the id is cached; a miss is stored (evicting one
    victim when full). ``misses`` decays with ``decay`` per tick since ``last``.
    """

    __slots__ = ("policy", "hitting", "misses", "last")

    def __init__(self, capacity: int, ordering: Union[float, Ordering], ghost: float) -> None:
        bonus, scale = as_ordering(ordering)
        self.policy = Session(capacity, hot_bonus=bonus, ghost=ghost, experts=(), freq_scale=scale)
        self.hitting = False
        self.misses = 0.0
        self.last = 0

    def step(self, block_id: int, parent: int | None, clock: int, decay: float) -> None:
        policy = self.policy
        if parent is None:
            self.hitting = True
        tracked = block_id in policy
        if not (self.hitting and tracked):
            self.hitting = False
            self.misses = self.score(clock, decay) + 1.0
            self.last = clock
        hints = Hints(parents=(parent,))
        if tracked:
            policy.on_access((block_id,), hints)
            return
        if len(policy) >= policy.capacity:
            policy.on_remove(policy.victims(1))
        policy.on_insert((block_id,), hints)

    def score(self, clock: int, decay: float) -> float:
        """Misses, each weighed by ``decay`` per tick since it happened."""
        return self.misses * decay ** (clock - self.last)
