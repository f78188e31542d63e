"""When a fleet instance writes to the shared store: the live store's write modes
(``RemoteWrite``, ``tiercache.live.remote.RemoteLink``), for ``tiercache.sim.fleet``.

* ``through`` (the live default): once a request is served its blocks are published,
  ``TierManager.publish(run, prefix=True)`` (``RemoteLink.stored`` after a put): those its
  view does not list, from the request's start, as many as the view can take.
* ``back``: nothing is published; a block reaches the store only as a victim of the last
  private tier, demoted into the view (a put), unless the view lists it already (it then
  leaves with no put, as every mode's victims do).
* ``selective``: each block of a request's hit prefix held in a private tier when the request
  reads it counts one local hit (``RemoteLink.read``); a block reaching ``write_hits`` is
  published (``TierManager.publish(hot)``), once, and the view admits a victim only once it
  has that many (``core.remoteview.HotOnly``, as the live store: a colder one just leaves). A
  block's count is forgotten once no tier of the instance holds it after the request's read or
  its writes (``RemoteLink.departed``, which the live store calls after each read and each put).
  The live store starts that publication at the read, before the promotion; here it runs
  once the request is served, with the others' writes, so it never pushes out of the view an
  entry the request is about to read.

Invariant: only ``selective`` keeps per-block state (``hits``: blocks some tier of the
instance holds, pruned after every request), and only it records departures, so
``through``, the default, costs what it did before the modes existed.
"""

from __future__ import annotations


from tiercache.config import RemoteWrite
from tiercache.core.manager import TierManager
from tiercache.core.plans import EventLog
from tiercache.core.remoteview import HotOnly
from tiercache.policies import make_admission
from tiercache.policies.base import AdmissionPolicy

__all__ = ["Writer"]


class Writer:
    """One instance's write mode: what its view admits, what it counts when a request reads,
    what it publishes once the request is served."""

    def __init__(self, write: RemoteWrite, write_hits: int) -> None:
        self.write, self.threshold = write, write_hits
        self.hits: dict[int, int] = {}  # selective: local hits per block some tier holds

    @property
    def counts(self) -> bool:
        """Whether local hits are counted (``selective``)."""
        return self.write is RemoteWrite.SELECTIVE

    def events(self) -> EventLog:
        """The instance manager's event log: recording departures where counts are kept."""
        return EventLog(record_departures=self.counts)

    def admission(self) -> AdmissionPolicy:
        """The view's admission of the private tiers' victims."""
        return HotOnly(self.hits, self.threshold) if self.counts else make_admission("always")

    def read(self, m: TierManager, remote: int, prefix: list[int]) -> list[int]:
        """Counts the local hits of a request's hit ``prefix`` (before it is read: the blocks
        a private tier holds); returns those reaching the threshold now (selective only)."""
        if not self.counts:
            return []
        hot = []
        for block_id in dict.fromkeys(prefix):
            tier = m.locate(block_id)
            if tier is not None and tier < remote:
                count = self.hits[block_id] = self.hits.get(block_id, 0) + 1
                if count == self.threshold:
                    hot.append(block_id)
        return hot

    def served(self, m: TierManager, run: list[int], hot: list[int]) -> None:
        """The writes once request ``run`` is served (``hot``: from ``read``); waits for them."""
        if self.write is RemoteWrite.THROUGH:
            m.publish(run, prefix=True)  # the blocks the view lacks, from the start, are put into the store
        elif hot:
            m.publish(hot)
        m.wait_all()
        self.forget_departed(m)

    def forget_departed(self, m: TierManager) -> None:
        """Forgets the counts of blocks that left every tier since the last call and are still
        out, as the live store does after each read and each put (``RemoteLink.departed``)."""
        if self.counts:
            for block_id in m.events.drain_departed():
                if m.locate(block_id) is None:
                    self.hits.pop(block_id, None)
