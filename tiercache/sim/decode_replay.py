"""The decode replay of a step trace: one protocol for every prefetch policy, and what prefetch did.

Every record of a step trace runs through ``StepDriver`` (``tiercache.core.decode``), the
protocol of the live decode cache, whatever ``--prefetch`` names, ``none`` included: a
record's reads are one step of attention over those blocks, so they are referenced while the
record reads them and its own misses and promotions never push out a block the same record
reads a moment later (a serving engine does not evict what the kernel it is running still
needs). A prefetch policy that plans nothing therefore replays to exactly the counts of
``--prefetch none``; any difference between the two is the prefetch's own moves.

An offline policy (``needs_future``, Belady) runs the same protocol with next-use hints: it
reads through ``TierManager.access`` with hints between the driver's ``open_read`` and
``end_read`` (the driver asks no policy for hints), and stores writes with hints. It runs only
without prefetch and without a recorded run's decode fields (``replay.check_run`` refuses
those: neither gives the future).

``PrefetchTally`` counts, per run, the blocks the prefetch policy moved up, those a later
read found where the prefetch put them (used), and those pushed back down or out before any
read (wasted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from tiercache.core.decode import StepDriver
from tiercache.core.manager import TierManager
from tiercache.core.plans import TransferPlan
from tiercache.policies import Hints, get_eviction, make_prefetch

from .steptrace import DecodeFields

if TYPE_CHECKING:  # replay imports this module
    from .replay import ReplayData

__all__ = ["PrefetchTally", "DecodeReplay"]


@dataclass
class PrefetchTally:
    """What a run's prefetches did, block by block.

    A block counts once per prefetch of it: ``used`` when the first read of it after the
    prefetch finds it in the tier the prefetch brought it to (or a faster one), ``wasted``
    when it left that tier before any read of it (that read, or a later prefetch of it,
    finds it below; or the run ends with it below or gone). A block still in place, unread
    at the end of the run, is neither.

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
        self.driver = StepDriver(manager, make_prefetch(prefetch), store_misses=True)
        self.tally = PrefetchTally()
        self._ids, self._steps, self._layers = data.id_list, data.trace.steps.steps, data.trace.steps.layers
        self._plain = DecodeFields()

    def __call__(self, batch: int, needs_future: bool) -> int:
        a, b = self.data.bounds(batch)
        writes = self.data.is_write[a:b].tolist()
        fields = self.decode.get(batch, self._plain)
        if fields.release:
            self.driver.release(fields.release)
        n_reads = writes.count(False)  # a record lists its reads, then its writes (steptrace)
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
        """Reads the blocks ``ids[a:b]`` with their references held."""
        ids = self._ids[a:b]
        if self.tally.pending:  # where the prefetched blocks lie once the moves in flight land
            self.driver.settle()
            self.tally.reading(self.manager, ids)
        if not self.offline:
            ticket = self.driver.begin_read(int(self._steps[batch]), int(self._layers[batch]), ids, fields.in_place,
                                            fields.candidates, fields.ahead)
            if ticket.plans:
                self.tally.started(ticket.plans)
            self.driver.end_read(ticket)
            return
        ticket = self.driver.open_read(ids)
        try:
            self.manager.access(ids, self._hints(a, b), store_misses=True)
        finally:
            self.driver.end_read(ticket)

    def _write(self, a: int, b: int, hold: Sequence[int]) -> None:
        """Stores the blocks ``ids[a:b]`` not resident yet (``StepDriver.write``; an offline
        policy's with their next uses)."""
        ids = self._ids[a:b]
        if not self.offline:
            self.driver.write(ids, hold)
            return
        self.driver.settle()
        fresh = [k for k in range(a, b) if self.manager.locate(self._ids[k]) is None]
        if fresh:
            next_use = self.data.next_use_list
            self.manager.insert([self._ids[k] for k in fresh], Hints(fresh[0], [next_use[k] for k in fresh], None))

    def _hints(self, a: int, b: int) -> Hints:
        """Next uses of the accesses ``a .. b - 1`` (``ReplayData.next_use``: reads only)."""
        return Hints(a, self.data.next_use_list[a:b], None)
