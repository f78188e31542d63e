"""Policy contracts: eviction, admission, prefetch.

Policies are metadata only: they see integer block ids (in access order), logical time and
optional hints, never tensors or storage objects. The same instance type runs unchanged in
the simulator (``tiercache replay``) and in the live store.

Eviction contract (checked for every registered policy by ``tests/test_policy_contract.py``):

* ``on_insert(ids)`` starts tracking ids that are not tracked; ``on_access(ids)`` records
  hits on tracked ids; ``on_remove(ids)`` stops tracking tracked ids. Ids within one call
  are distinct and in access order.
* ``victims(n, protected)`` returns exactly ``n`` distinct tracked ids, none in
  ``protected``, in the order the policy would evict them, or ``None`` when fewer than ``n``
  unprotected ids are tracked. It never changes the set of tracked ids (the caller removes
  victims with ``on_remove``), and when it returns ``None`` it changes nothing at all. It may
  reorganise internal order while choosing (S3-FIFO promotions, SIEVE bit clearing), as the
  algorithms do.
* Misuse (inserting a tracked id, touching or removing an untracked id) raises ``KeyError``.
* What a policy is given (ids, hints, ``protected``, a prefetch view) is read-only: the
  caller may go on using it after the call. tiercache's own policies never change it
  (``tests/test_policy_probe_q13.py``, over the registry); one defined elsewhere is handed
  tuples (``tiercache.core.answers.handed``), so changing them could not reach the manager.

The manager trusts tiercache's own policies and checks every ``victims`` and ``admit`` answer
of one defined elsewhere (a ``module:Class``) where it asks: an answer that breaks its
contract is a ``ValueError`` naming the policy, the method and what was wrong
(``tiercache.core.answers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Collection, Iterable, Sequence

__all__ = ["Hints", "EvictionPolicy", "AdmissionPolicy", "PlacementPolicy", "PrefetchPolicy", "PrefetchView", "NO_NEXT_USE", "in_tree",
           "enough_unprotected"]

#: ``next_use`` value for a block that is never accessed again (sorts after every time).
NO_NEXT_USE = 1 << 62


@dataclass(frozen=True)
class Hints:
    """Optional per-batch information, each sequence aligned with the batch's ids.

    Attributes:
        time: logical time (index of the batch's first access in the trace).
        next_use: logical time of each id's next access (``NO_NEXT_USE`` if none); given
            only to offline policies such as Belady, computed from the trace.
        parents: each id's parent block id in the prefix tree (``-1`` never appears: roots
            carry ``None``), for prefix-aware policies.
    """

    time: int = 0
    next_use: Sequence[int] | None = None
    parents: Sequence[int | None] | None = None


class EvictionPolicy:
    """Base of eviction policies; see the module docstring for the contract.

    Class attributes:
        name: registry name.
        needs_future: True for offline policies that need ``Hints.next_use``.
        needs_parents: True for policies that read ``Hints.parents`` (callers may skip
            building them otherwise).
        batch_insert_safe: True when evicting ``k`` victims before inserting a run of new ids
            leaves the same state as interleaving one eviction per insert (true for policies
            whose newest entries are always evicted last, such as LRU and FIFO). The manager
            batches a run of misses only for such policies and interleaves otherwise.
    """

    name: ClassVar[str] = "base"
    needs_future: ClassVar[bool] = False
    needs_parents: ClassVar[bool] = False
    batch_insert_safe: ClassVar[bool] = False

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"{type(self).__name__}: capacity must be >= 1, got {capacity}")
        self.capacity = capacity

    @classmethod
    def for_tier(cls, capacity: int, tier: int) -> "EvictionPolicy":
        """The policy of tier ``tier`` of a hierarchy (0: the top), with default parameters.

        Requests arrive at the top tier; below it a policy sees blocks demoted from above and
        read or promoted back, never a request. A policy whose mechanism models the request
        stream (``session``'s shadow caches) configures itself for that here; the default is
        ``cls(capacity)`` at every tier.
        """
        return cls(capacity)

    def on_insert(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        raise NotImplementedError

    def on_access(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        raise NotImplementedError

    def on_remove(self, ids: Sequence[int]) -> None:
        raise NotImplementedError

    def victims(self, n: int, protected: Collection[int] = ()) -> list[int] | None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, block_id: int) -> bool:
        raise NotImplementedError

    def check_invariants(self) -> None:
        """Raises AssertionError when internal structures disagree."""


class AdmissionPolicy:
    """Decides whether a block may be placed in a tier.

    ``admit(ids)`` returns one bool per id, in order, and records the sighting. A refused block
    is not stored in that tier (a demotion that is refused drops the block, counted).
    """

    name: ClassVar[str] = "base"

    def admit(self, ids: Sequence[int]) -> list[bool]:
        raise NotImplementedError

    def check_invariants(self) -> None:
        """Raises AssertionError when internal structures disagree (stateless: nothing)."""


class PlacementPolicy:
    """Decides which tier of an exclusive hierarchy a block goes to (``--placement``).

    ``insert_tier(ids, hints)`` returns the tier (0 = the top) that a run of newly computed
    ids is stored in; below the top the block is written down from where it was computed
    (a simulated replay charges that write on the link from the top tier). ``promote_tier(ids,
    tier, hints)`` is asked about a run of hits found in ``tier`` (> 0) and returns 0 to
    promote them to the top tier or ``tier`` to read them where they lie (charged on the link
    to the top tier, every time). Both see each id once, in access order, and may keep
    state; the manager checks every answer (an index out of range is a ``ValueError``).
    """

    name: ClassVar[str] = "base"

    def __init__(self, n_tiers: int) -> None:
        if n_tiers < 1:
            raise ValueError(f"{type(self).__name__}: at least one tier, got {n_tiers}")
        self.n_tiers = n_tiers

    def insert_tier(self, ids: Sequence[int], hints: Hints | None = None) -> int:
        raise NotImplementedError

    def promote_tier(self, ids: Sequence[int], tier: int, hints: Hints | None = None) -> int:
        raise NotImplementedError

    def check_invariants(self) -> None:
        """Raises AssertionError when internal structures disagree (stateless: nothing)."""


@dataclass(frozen=True)
class PrefetchView:
    """What a decode step read, as a prefetch policy sees it (all ids, no tensors).

    The same view is built by the live decode cache and, from the recorded step trace, by
    ``tiercache replay``, so a replay with the same prefetch policy makes the same moves.

    Attributes:
        step: decode step of the record.
        layer: layer the step read.
        reads: ids the step read at this layer, in read order.
        candidates: ids ranked right after the sparse selection, best first (empty in exact
            mode): the likeliest newcomers to the next step's selection.
        ahead: ids the next layer will read first that are not in the top tier (its first
            chunks in exact mode; its sink and recent blocks in sparse mode).
        in_top: tells whether an id is already in the top tier (read-only).
    """

    step: int
    layer: int
    reads: Sequence[int]
    candidates: Sequence[int] = ()
    ahead: Sequence[int] = ()
    in_top: Callable[[int], bool] = lambda block_id: False


class PrefetchPolicy:
    """Proposes blocks to bring up to the top tier before they are needed.

    Contract (``tests/test_prefetch_policies.py``, over the registry): ``plan(view)`` returns
    distinct ids, each one the view names (in ``reads``, ``candidates`` or ``ahead``) and not
    already in the top tier, at most ``limit`` of them; it has no side effects (the same view
    gives the same plan, and nothing the policy or the caller holds changes). The caller
    starts the moves through the manager's ``prefetch`` and waits for them before the next
    record's reads.
    """

    name: ClassVar[str] = "base"

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit

    def plan(self, view: PrefetchView) -> list[int]:
        raise NotImplementedError

    def _cap(self, ids: Sequence[int], view: PrefetchView) -> list[int]:
        """Distinct ids of ``ids`` not in the top tier, in order, at most ``limit``."""
        chosen: list[int] = []
        seen: set[int] = set()
        for block_id in ids:
            if block_id not in seen and not view.in_top(block_id):
                seen.add(block_id)
                chosen.append(block_id)
                if self.limit is not None and len(chosen) >= self.limit:
                    break
        return chosen


def in_tree(policy: object) -> bool:
    """Whether ``policy`` is an instance of a class defined in tiercache itself (a registered
    policy, or one of tiercache's own such as the live store's remote admission).

    Their answers are trusted (the contract tests run over the registry), so the manager
    calls them directly; a policy defined anywhere else (a ``module:Class``, a subclass of a
    registered one included) has every answer checked (``tiercache.core.answers``).
    """
    module = type(policy).__module__
    return module == "tiercache" or module.startswith("tiercache.")


def enough_unprotected(tracked: Iterable[int], protected: Collection[int], n: int) -> bool:
    """Whether at least ``n`` tracked ids are not in ``protected``.

    Walks the tracked ids and stops at the ``n``-th unprotected one, so it costs ``n`` plus
    the protected ids met on the way, never a pass over ``protected`` (which the manager
    builds from pins and references of every tier).
    """
    if n <= 0:
        return True
    found = 0
    for block_id in tracked:
        if block_id not in protected:
            found += 1
            if found == n:
                return True
    return False
