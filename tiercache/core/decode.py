"""The decode step protocol, shared by the live decode cache and the step-trace replay.

A decode step is recorded as records (``tiercache.sim.steptrace``): a read record (what one
layer's attention read) or a write record (blocks a layer filled, which the sequence then
holds), plus the holds and releases of live sequences. ``StepDriver`` turns one record into
manager calls. The live cache (``tiercache.live.cache``) and ``tiercache replay`` both call
it, so a recorded run replays to exactly the same decisions and per-tier counts:

1. Every record first waits for the moves earlier records started (prefetches), so the
   placement a record sees never depends on how fast the copies ran.
2. A read references its blocks (they cannot be victims while read), reads them (promoted
   to the top tier, or in place for a streaming reader), then asks the prefetch policy what
   to bring up next and starts those moves, still holding the references: the caller
   computes attention while the prefetches run, then ends the read (``end_read``).
3. A write holds the listed blocks already resident, then stores its blocks in list order:
   a block not resident is stored (held as it lands if listed), a resident one stores
   nothing (the same block), and one resident when the write began that the write's
   earlier blocks pushed out is stored again at its turn. A sequence's blocks may move
   down, never out (``TierManager.hold``), not even to make room for the same write's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Sequence

from tiercache.policies.base import PrefetchPolicy, PrefetchView

from .answers import plan_asker
from .manager import TierManager
from .plans import TransferPlan

__all__ = ["StepDriver", "ReadTicket", "WriteRun", "write_runs"]


@dataclass
class ReadTicket:
    """A read in progress: the references it holds and what it found where.

    Invariants: ``found[t]`` counts the distinct read ids found in tier ``t`` before the
    read (so ``sum(found) + absent`` is the number of distinct ids read); ``refs`` are the
    ids referenced until ``end_read``; ``accessed`` is True once the read's blocks were
    read (``TierManager.access`` started: its hits and moves count, so the read is
    recorded even if it fails afterwards); ``prefetched`` is the number of blocks whose
    moves the read started.
    """

    refs: list[int]
    found: list[int]
    absent: int
    prefetched: int = 0
    plans: list[TransferPlan] = field(default_factory=list)
    accessed: bool = False


class StepDriver:
    """Runs decode records against a manager with one prefetch policy.

    Args:
        manager: the hierarchy.
        prefetch: the policy asked after every read (``NoPrefetch`` plans nothing).
        store_misses: whether a read of an absent block stores it (a replay of a synthetic
            trace, which has no bytes to lose) or only counts it (a live reader: an absent
            block is a lost one, and there are no bytes to store).
    """

    def __init__(self, manager: TierManager, prefetch: PrefetchPolicy, store_misses: bool = False) -> None:
        self.manager = manager
        self.prefetch = prefetch
        self._plan = plan_asker(prefetch)  # checked answers unless the policy is tiercache's own
        self.store_misses = store_misses

    def settle(self) -> None:
        """Completes every move in flight (the start of each record)."""
        self.manager.wait_all()

    def begin_read(self, step: int, layer: int, reads: Sequence[int], in_place: bool,
                   candidates: Sequence[int] = (), ahead: Sequence[int] = ()) -> ReadTicket:
        """Reads ``reads`` (promoting them, or in place) and starts the policy's prefetches:
        ``open_read`` then ``run_read``, the references taken back if the read raises.

        The read ids stay referenced until ``end_read``: nothing the prefetches displace
        can be one of them, and their bytes stay where the caller found them.
        """
        ticket = self.open_read(reads)
        try:  # whatever raises once the refs are taken (an interrupt too) takes them back
            self.run_read(ticket, step, layer, reads, in_place, candidates, ahead)
        except BaseException:
            self.end_read(ticket)
            raise
        return ticket

    def open_read(self, reads: Sequence[int]) -> ReadTicket:
        """Completes the moves in flight and references the resident ids of ``reads`` (all
        or nothing: one that raises references nothing); reads nothing yet (``run_read``).
        The ticket holds the references until ``end_read``."""
        manager = self.manager
        self.settle()
        found = [0] * manager.n_tiers
        refs: list[int] = []
        absent = 0
        for block_id in dict.fromkeys(reads):
            tier = manager.locate(block_id)
            if tier is None:
                absent += 1
            else:
                found[tier] += 1
                refs.append(block_id)
        manager.ref(refs)  # all or nothing (``increment``)
        return ReadTicket(refs, found, absent)

    def run_read(self, ticket: ReadTicket, step: int, layer: int, reads: Sequence[int], in_place: bool,
                 candidates: Sequence[int] = (), ahead: Sequence[int] = ()) -> None:
        """Reads ``reads`` (promoting them, or in place) for an opened ``ticket``, then asks the
        prefetch policy and starts its moves. ``ticket.accessed`` is set before the first
        block is read, so a caller whose read raised knows whether it happened (a policy
        that raises does so after the reads and their promotions); the references stay
        with the ticket either way (``end_read``)."""
        manager = self.manager
        ticket.accessed = True
        manager.access(list(reads), store_misses=self.store_misses, promote=not in_place)
        top = manager.dirs[0].slot_of
        view = PrefetchView(step, layer, reads, candidates, ahead, top.__contains__)
        wanted = self._plan(view)
        ticket.plans = manager.prefetch(wanted) if wanted else []
        ticket.prefetched = sum(p.n_blocks for p in ticket.plans)

    def end_read(self, ticket: ReadTicket) -> None:
        """Releases the read's references (blocks lost meanwhile release as orphans); once
        only: the ticket forgets them first, so an end that raised is never repeated."""
        refs, ticket.refs = ticket.refs, []
        self.manager.unref(refs)

    def write(self, ids: Sequence[int], hold: Sequence[int] = ()) -> list[int]:
        """Stores the blocks of ``ids`` in list order (the engine has their bytes staged) and
        holds the ids of ``hold`` that are resident. Returns the ids it stored, still resident.

        An id resident when the write began stores nothing if it still is at its turn (the
        same block); if the write's earlier blocks pushed it out, it is stored again there,
        so every listed id is written after the ids before it (as the oracleGeneral export
        orders them; ``write_runs``).

        The resident ids of ``hold`` are held before anything is inserted, and the new ones
        as each chunk lands, so the write's own inserts can push a held block down but never
        out of the hierarchy: a write whose held blocks fit never loses one of them. The
        holds are taken first, so a write that raises part-way leaves some behind: its
        caller releases the holds the write added (``Sequence._store_blocks``).
        """
        manager = self.manager
        self.settle()
        fresh = {block_id for block_id in ids if manager.locate(block_id) is None}
        self.hold([block_id for block_id in hold if block_id not in fresh], settle=False)
        held = set(hold)
        stored: list[int] = []
        for run in write_runs(ids, fresh, held, manager.locate):
            if run.store:
                manager.insert(run.ids, hold=run.hold)
                stored.extend(run.ids)
        return [block_id for block_id in stored if manager.locate(block_id) is not None]

    def hold(self, ids: Sequence[int], settle: bool = True) -> None:
        """Holds ``ids`` for a live sequence that lists them (``TierManager.hold_listed``): a
        resident id is held; an absent one (lost before: a fork of a sequence that lost a
        block lists it as well) counts as an orphan hold, so its ``release`` never takes
        the hold of a sequence that stores the block again."""
        if settle:
            self.settle()
        self.manager.hold_listed(ids)

    def release(self, ids: Sequence[int]) -> None:
        """Ends a sequence's hold on ``ids``, once per listing (``TierManager.release_listed``):
        an id's orphan holds (left by a loss) are spent before its holds, so a sequence that
        lost a block never releases another live sequence's hold on the block stored anew."""
        self.settle()
        self.manager.release_listed(ids)



class WriteRun(NamedTuple):
    """Consecutive ids of a write handled alike (``write_runs``): ``store`` True, new blocks
    to store with one ``insert`` (each held as it lands when ``hold``); False, one id still
    resident at its turn, which stores nothing (the same block)."""

    ids: list[int]
    store: bool
    hold: bool = False


def write_runs(ids: Sequence[int], fresh: set[int], held: set[int],
               locate: Callable[[int], int | None]) -> Iterator[WriteRun]:
    """A write of ``ids`` (distinct) in list order, as ``WriteRun``s; the caller stores each
    run with ``store`` before the generator goes on.

    ``fresh`` holds the ids absent when the write began. A run to store ends before each id
    that was resident then and is not in ``held``, so that id's ``locate`` is asked once
    every id before it is stored: still resident, it comes as a run of its own that stores
    nothing; pushed out by them, it is stored again, first of the next run. A resident id of
    ``held`` (held: it cannot be pushed out) stores nothing and ends no run. A run also
    ends where the hold changes, so the ids are stored in list order.
    """
    run: list[int] = []
    run_held = False
    for block_id in ids:
        if block_id in fresh:
            holding = block_id in held
        elif block_id in held:
            continue
        else:
            if run:
                yield WriteRun(run, True, run_held)
                run = []
            if locate(block_id) is not None:
                yield WriteRun([block_id], False)
                continue
            holding = False
        if run and holding != run_held:
            yield WriteRun(run, True, run_held)
            run = []
        run.append(block_id)
        run_held = holding
    if run:
        yield WriteRun(run, True, run_held)
