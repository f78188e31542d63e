"""The decode replay of a step trace: one protocol for every prefetch policy, and what prefetch did.

Every record of a step trace runs through ``StepDriver`` (``tiercache.core.decode``), the
protocol of the live decode cache, whatever ``--prefetch`` names, ``none`` included: a
record's reads are one step of attention over those blocks, so the blocks it reads that are
cached when it starts are referenced while it reads them, and its own misses and promotions
never push one of those out (a miss that finds every slot of the top tier referenced is
counted in that tier's ``refused``, not stored). The blocks its own misses store are not
referenced: a later miss of the same record may push them out (the live cache stores no miss:
it has no bytes for an absent block, so there the question never arises).
A prefetch policy that plans nothing therefore replays to exactly the counts of ``--prefetch
none``; any difference between the two is the prefetch's own moves.

A write stores its blocks in list order (``StepDriver.write``): a block not cached is stored,
a write of an id still cached at its turn stores nothing (keys name content: it is the same
block), and an id cached when the record began that the write's earlier blocks pushed out is
stored again at its turn, as libCacheSim stores the oracleGeneral export's write record of
an absent id (libCacheSim takes a write of a cached id as an access too; the replay counts no
access there, so an online policy's recency can differ from libCacheSim's on such traces).

An offline policy (``needs_future``, Belady) runs the same protocol with next-use hints: it
reads through ``TierManager.access`` with hints between the driver's ``open_read`` and
``end_read`` (the driver asks no policy for hints), and stores writes with hints. A step
trace's next use of an access is the next read of its id before any later write of it
(``prep.step_next_use``): the read before a write of its id is the last use of that copy,
since the write supplies the block again. A write of an id still cached therefore refreshes
the policy's next use of it to the write's own (the next read after that write), without
counting an access, as the write's record in the oracleGeneral export does for libCacheSim
(``sim.oracle``). It runs only without prefetch and without a recorded run's decode fields
(``replay.check_run`` refuses those: neither gives the future).

A recorded run's leading ``resident`` records (the blocks a reopened cache adopted) are placed
before the first record (``place_resident``): where they lay, uncounted and uncharged, as the
live cache adopted them, so their reads are hits there, not misses.

``PrefetchTally`` counts, per run, the blocks the prefetch policy moved up, those a later
read found where the prefetch put them (used), and those pushed back down or out before any
read (wasted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from tiercache.core.decode import StepDriver, write_runs
from tiercache.core.manager import TierManager
from tiercache.core.plans import TransferPlan
from tiercache.policies import Hints, get_eviction, make_prefetch

from .steptrace import DecodeFields

if TYPE_CHECKING:  # replay imports this module
    from .replay import ReplayData

__all__ = ["PrefetchTally", "DecodeReplay", "place_resident"]


@dataclass
class PrefetchTally:
    """What a run's prefetches did, block by block.

    A block counts once per prefetch of it: ``used`` when the first read of it after the
    prefetch finds it in the tier the prefetch brought it to (or a faster one), ``wasted``
    when it left that tier before any read of it (that read, a later prefetch of it or a
    write of its id finds it below or gone; or the run ends with it below or gone). A block
    still in place, unread at the end of the run, is neither. A pending block leaves its
    tier only by being pushed down or out, and comes back only by a read, a prefetch or a
    write of its id (a block evicted, then stored anew), each of which settles it (a write
    whose own earlier blocks pushed it out settles it once it stored it again): so a read
    never credits a prefetch with a block stored after the prefetched one left.

    Invariants: ``used + wasted + len(pending) == prefetched``; ``pending`` maps each
    prefetched block not yet settled to the tier its prefetch brought it to.
    """

    prefetched: int = 0
    used: int = 0
    wasted: int = 0
    pending: dict[int, int] = field(default_factory=dict)

    def started(self, plans: Sequence[TransferPlan]) -> None:
        """Counts the blocks of ``plans`` (moves a read's prefetch started). A block already
        pending was below its earlier prefetch's tier again (a prefetch only moves blocks up
        from below), so that earlier prefetch is wasted."""
        for plan in plans:
            for block_id in plan.ids:
                if self.pending.pop(block_id, None) is not None:
                    self.wasted += 1
                self.pending[block_id] = plan.dst_tier
                self.prefetched += 1

    def reading(self, manager: TierManager, reads: Sequence[int]) -> None:
        """Settles the pending blocks among ``reads`` against where they lie now, before the
        read moves anything (moves in flight completed: ``StepDriver.settle``)."""
        if not self.pending:
            return
        for block_id in reads:
            tier = self.pending.pop(block_id, None)
            if tier is not None:
                self._settle(manager, block_id, tier)

    def writing(self, manager: TierManager, writes: Sequence[int]) -> None:
        """Settles the pending blocks among ``writes`` (a record's writes, moves in flight
        completed) that left their tier: wasted, before the write stores a new block under the
        id. One still in place stays pending: the write of a cached id stores nothing (it is
        the same block), so a later read of it reads what the prefetch brought up."""
        pending = self.pending
        for block_id in writes:
            tier = pending.get(block_id)
            if tier is not None:
                where = manager.locate(block_id)
                if where is None or where > tier:
                    del pending[block_id]
                    self.wasted += 1

    def stored_again(self, stored: Sequence[int]) -> None:
        """Settles the pending blocks among ``stored`` (what a write stored, ``StepDriver.write``):
        still pending after ``writing``, they were in place when the write began, then its own
        earlier blocks pushed them out and it stored them again, so the prefetched copy is
        gone: wasted."""
        pending = self.pending
        for block_id in stored:
            if pending.pop(block_id, None) is not None:
                self.wasted += 1

    def finish(self, manager: TierManager) -> None:
        """Settles what the run's end leaves: pending blocks below their tier are wasted."""
        for block_id, tier in list(self.pending.items()):
            where = manager.locate(block_id)
            if where is None or where > tier:
                del self.pending[block_id]
                self.wasted += 1

    def _settle(self, manager: TierManager, block_id: int, tier: int) -> None:
        where = manager.locate(block_id)
        if where is not None and where <= tier:
            self.used += 1
        else:
            self.wasted += 1

    def counts(self) -> dict[str, int]:
        """The run record's fields: ``prefetched``, ``prefetch_used``, ``prefetch_wasted``."""
        return {"prefetched": self.prefetched, "prefetch_used": self.used, "prefetch_wasted": self.wasted}


class DecodeReplay:
    """The per-record handler of a decode replay (``replay``'s step function for a step
    trace): ``handler(batch, needs_future)`` runs record ``batch`` and returns 0 (decode
    semantics saves no prefill tokens).

    Args:
        policy: the eviction policy's name (an offline one reads with next-use hints).
        prefetch: the ``--prefetch`` policy's name (``none`` plans nothing).
        data: the ``ReplayData`` of a step trace (``ids``, ``is_write``, ``next_use``).
        manager: the hierarchy it drives (built for ``policy``).

    Raises:
        ValueError: an offline policy with a prefetch policy or a recorded run's decode
            fields (neither gives the future; ``check_run`` refuses both first).
    """

    def __init__(self, policy: str, prefetch: str, data: "ReplayData", manager: TierManager) -> None:
        decode = data.trace.steps.decode if data.trace.steps is not None else None
        self.offline = bool(get_eviction(policy).needs_future)
        if self.offline and (decode or prefetch != "none"):
            raise ValueError(f"replay: {policy} needs the future, which a recorded decode run or --prefetch does not give")
        self.data, self.manager, self.decode = data, manager, decode or {}
        place_resident(manager, self.decode)
        self.driver = StepDriver(manager, make_prefetch(prefetch), store_misses=True)
        self.plans = prefetch != "none"  # NoPrefetch plans nothing: read without asking it (_read)
        self.tally = PrefetchTally()
        self._ids, self._steps, self._layers = data.id_list, data.trace.steps.steps, data.trace.steps.layers
        self._n_reads = _reads_per_record(data)
        self._plain = DecodeFields()

    def __call__(self, batch: int, needs_future: bool) -> int:
        a, b = self.data.bounds(batch)
        fields = self.decode.get(batch, self._plain) if self.decode else self._plain
        if fields.release:
            self.driver.release(fields.release)
        n_reads = self._n_reads[batch]  # a record lists its reads, then its writes (steptrace)
        if n_reads:
            self._read(batch, a, a + n_reads, fields)
        if n_reads < b - a or fields.hold:
            self._write(a + n_reads, b, fields.hold)
        return 0

    def finish(self) -> dict[str, int]:
        """The run's prefetch counts, once every move has landed (``TierManager.wait_all``)."""
        self.manager.wait_all()
        self.tally.finish(self.manager)
        return self.tally.counts()

    def _read(self, batch: int, a: int, b: int, fields: DecodeFields) -> None:
        """Reads the blocks ``ids[a:b]`` with their references held (``StepDriver.begin_read``;
        without a prefetch policy, or offline with next-use hints, its ``open_read``, the
        manager's access and ``end_read``: the same calls, no plan asked for)."""
        ids = self._ids[a:b]
        if self.tally.pending:  # where the prefetched blocks lie once the moves in flight land
            self.driver.settle()
            self.tally.reading(self.manager, ids)
        if self.plans:
            ticket = self.driver.begin_read(int(self._steps[batch]), int(self._layers[batch]), ids, fields.in_place,
                                            fields.candidates, fields.ahead)
            if ticket.plans:
                self.tally.started(ticket.plans)
            self.driver.end_read(ticket)
            return
        ticket = self.driver.open_read(ids)
        try:
            if self.offline:
                self.manager.access(ids, Hints(a, self.data.next_use_list[a:b], None), store_misses=True)
            else:
                self.manager.access(ids, store_misses=True, promote=not fields.in_place)
        finally:
            self.driver.end_read(ticket)

    def _write(self, a: int, b: int, hold: Sequence[int]) -> None:
        """Stores the blocks ``ids[a:b]`` in list order (``StepDriver.write``); a prefetched
        block that left its tier is settled first (``PrefetchTally.writing``), one the write
        pushed out and stored again after (``PrefetchTally.stored_again``). Offline, the same
        runs (``write_runs``): new blocks are stored with their next uses, and a cached id's
        next use is refreshed to the write's at its turn (``_refresh``)."""
        ids = self._ids[a:b]
        if not self.offline:
            if self.tally.pending:
                self.driver.settle()
                self.tally.writing(self.manager, ids)
            stored = self.driver.write(ids, hold)
            if self.tally.pending:
                self.tally.stored_again(stored)
            return
        self.driver.settle()
        manager, next_use = self.manager, self.data.next_use_list
        position = {block_id: k for k, block_id in enumerate(ids, start=a)}
        fresh = {block_id for block_id in ids if manager.locate(block_id) is None}
        for run in write_runs(ids, fresh, set(), manager.locate):
            accesses = [position[block_id] for block_id in run.ids]
            if not run.store:
                self._refresh(accesses)
                continue
            uses = [next_use[k] for k in accesses]
            manager.note_next_uses(run.ids, uses)
            manager.insert(run.ids, Hints(accesses[0], uses, None))

    def _refresh(self, accesses: Sequence[int]) -> None:
        """Sets the next use of the cached ids written at ``accesses`` (indices into ``ids``) to
        the write's own, in every tier that holds one, counting no access (the write stores
        nothing: it is the same block). The read before the write told the policy that copy
        was dead (``prep.step_next_use``); left so, Belady would evict a block that the reads
        after the write hit."""
        manager, next_use = self.manager, self.data.next_use_list
        ids = [self._ids[k] for k in accesses]
        uses = [next_use[k] for k in accesses]
        manager.note_next_uses(ids, uses)
        for tier, directory in enumerate(manager.dirs):
            here = [p for p, block_id in enumerate(ids) if block_id in directory.slot_of]
            if here:
                manager.policies[tier].on_access([ids[p] for p in here],
                                                 Hints(accesses[here[0]], [uses[p] for p in here], None))


def place_resident(manager: TierManager, decode: dict[int, DecodeFields]) -> None:
    """Places the blocks of the trace's leading ``resident`` records (``decode``: record index
    -> fields, in file order), before anything else runs: each in the tier of its name, or
    the last tier where the hierarchy has none of that name or is write-through (the tier that
    holds every block), as many as the tier has free slots, in list order (a cache reopened on
    a smaller tier adopts as many as fit, oldest first: ``lifecycle.adopt_stored_blocks``).
    Nothing is counted or charged: the events of the placement are dropped, as the live
    cache drops those of its adoption. A manager that has run nothing yet is assumed.
    """
    names = [directory.name for directory in manager.dirs]
    for fields in decode.values():
        if not fields.resident:
            break  # the reader keeps resident records first (``steptrace``), each with its field
        for name, ids in fields.resident:
            tier = len(names) - 1 if manager.write_through or name not in names else names.index(name)
            room = manager.dirs[tier].n_free
            if room and ids:
                manager.restore(tier, list(ids[:room]))
    manager.events.drain()


def _reads_per_record(data: "ReplayData") -> list[int]:
    """How many of each record's accesses are reads (a record lists its reads first)."""
    reads = np.concatenate(([0], np.cumsum(~np.asarray(data.is_write, dtype=bool))))
    offsets = np.asarray(data.offsets)
    return (reads[offsets[1:]] - reads[offsets[:-1]]).tolist()
