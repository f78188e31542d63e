"""Simulated transfer engine: the live manager's engine, with modeled time instead of bytes.

``SimEngine`` completes a job ``latency + bytes / bandwidth`` of simulated seconds after the
link it uses becomes free (one FIFO queue per link, so transfers on one link serialise and
different links overlap). It moves no data and never touches metadata: the manager applies
its results exactly as it applies a real engine's.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from tiercache.core.plans import JobResult, TransferPlan

__all__ = ["SimClock", "SimEngine", "LinkUsage"]


@dataclass
class SimClock:
    """Simulated time in seconds; injected so a replay and its engine share one clock."""

    now: float = 0.0

    def advance_to(self, when: float) -> None:
        """Moves time forward (never back)."""
        if when > self.now:
            self.now = when


@dataclass
class LinkUsage:
    """What one link carried: blocks, bytes, transfers and busy seconds."""

    blocks: int = 0
    bytes: int = 0
    transfers: int = 0
    seconds: float = 0.0


@dataclass
class SimEngine:
    """Completes plans after modeled link time.

    Args:
        tier_names: tier names fastest first; a plan between tiers ``i`` and ``j`` uses the link
            ``"<name i>-><name j>"``.
        block_bytes: bytes per block, or None to count blocks only (no modeled time).
        profile: a ``HardwareProfile`` (``links`` name -> ``Link``), or None for zero cost.
        clock: the shared simulated clock.
        tier_block_bytes: bytes of one block in each tier (its codec's, scales included), or
            None when every tier holds ``block_bytes``. A block crosses a link in the smaller
            form of its two ends: a quantised tier's encoded bytes are what is written to it
            (encoded before the copy) and read from it (decoded after), so the codec's
            compute time is taken to hide behind the link (``scripts/bench_quant.py``
            measures decode against the disk's cold read rate and encode against its durable
            write rate, of encoded blocks, in fp16-equivalent bytes).

    A link missing from the profile is modeled as staged through DRAM (``nvme->hbm`` =
    ``nvme->dram`` then ``dram->hbm``), which is how such copies run on real machines.
    """

    tier_names: tuple[str, ...]
    block_bytes: int | None = None
    profile: object | None = None
    clock: SimClock = field(default_factory=SimClock)
    usage: dict[str, LinkUsage] = field(default_factory=dict)
    _link_free: dict[str, float] = field(default_factory=dict)
    _pending: list[tuple[float, int]] = field(default_factory=list)
    tier_block_bytes: tuple[int, ...] | None = None

    def submit(self, plan: TransferPlan) -> None:
        """Queues ``plan`` on its link; returns at once."""
        done = self._occupy(plan.src_tier, plan.dst_tier, plan.n_blocks)
        heapq.heappush(self._pending, (done, plan.job_id))

    def read_through(self, src_tier: int, n_blocks: int) -> tuple[int, float]:
        """Charges a read of blocks where they lie (a hit not promoted) on the link from
        ``src_tier`` to the top tier, where attention reads them; returns (bytes, seconds).

        The read is complete when the call returns (the replay reads synchronously); it
        occupies the link like a copy of the same blocks, and no tier changes.
        """
        self._occupy(src_tier, 0, n_blocks)
        return self.cost(src_tier, 0, n_blocks)

    def cost(self, src_tier: int, dst_tier: int, n_blocks: int, n_transfers: int = 1) -> tuple[int, float]:
        """Bytes and modeled seconds of ``n_transfers`` transfers of ``n_blocks`` in all
        between two tiers (one transfer by default); a block takes the smaller of its two
        ends' forms on the link (``tier_block_bytes``: a quantised tier's encoded bytes)."""
        nbytes = n_blocks * self._bytes_per_block(src_tier, dst_tier)
        return nbytes, self._seconds(self._link(src_tier, dst_tier), nbytes, n_transfers)

    def charge(self, src_tier: int, dst_tier: int, n_blocks: int, n_transfers: int) -> None:
        """Books ``n_transfers`` completed transfers of ``n_blocks`` in all on a link, as many
        ``submit`` calls would (usage only: the compiled replay moves nothing and waits for
        nothing, so the link's queue and the clock are left alone)."""
        nbytes, seconds = self.cost(src_tier, dst_tier, n_blocks, n_transfers)
        usage = self.usage.setdefault(self._link(src_tier, dst_tier), LinkUsage())
        usage.blocks += n_blocks
        usage.bytes += nbytes
        usage.transfers += n_transfers
        usage.seconds += seconds

    def _bytes_per_block(self, src_tier: int, dst_tier: int) -> int:
        """Bytes one block takes on the link between two tiers (see ``tier_block_bytes``)."""
        if self.tier_block_bytes is None:
            return self.block_bytes or 0
        return min(self.tier_block_bytes[src_tier], self.tier_block_bytes[dst_tier])

    def _link(self, src_tier: int, dst_tier: int) -> str:
        return f"{self.tier_names[src_tier]}->{self.tier_names[dst_tier]}"

    def _occupy(self, src_tier: int, dst_tier: int, n_blocks: int) -> float:
        """Books one transfer on its link (usage and queue); returns when it completes."""
        link = self._link(src_tier, dst_tier)
        nbytes, seconds = self.cost(src_tier, dst_tier, n_blocks)
        done = max(self.clock.now, self._link_free.get(link, 0.0)) + seconds
        self._link_free[link] = done
        usage = self.usage.setdefault(link, LinkUsage())
        usage.blocks += n_blocks
        usage.bytes += nbytes
        usage.transfers += 1
        usage.seconds += seconds
        return done

    def poll(self) -> list[JobResult]:
        """Jobs whose modeled completion time has passed."""
        done = []
        while self._pending and self._pending[0][0] <= self.clock.now:
            _, job_id = heapq.heappop(self._pending)
            done.append(JobResult(job_id))
        return done

    def wait(self, job_id: int) -> JobResult:
        """Advances the clock to ``job_id``'s completion and returns its result."""
        for index, (when, pending_id) in enumerate(self._pending):
            if pending_id == job_id:
                self.clock.advance_to(when)
                self._pending[index] = self._pending[-1]
                self._pending.pop()
                heapq.heapify(self._pending)
                return JobResult(job_id)
        raise KeyError(f"job {job_id} was not submitted or was already returned")

    def fill(self, tier: int, ids, slots) -> None:
        """Computed blocks cost recompute time, accounted by the replay; one placed below the
        top tier (a placement policy's choice) is written down from the top tier, where it was
        computed, on that link."""
        if tier and ids:
            self._occupy(0, tier, len(ids))

    def discard(self, tier: int, ids, slots) -> None:
        """Nothing stored, nothing to forget."""

    def total_seconds(self) -> float:
        """Busy seconds summed over links (an upper bound on the makespan)."""
        return sum(u.seconds for u in self.usage.values())

    def _seconds(self, link: str, nbytes: int, n_transfers: int = 1) -> float:
        if self.profile is None or not nbytes:
            return 0.0
        links = self.profile.links
        if link in links:
            return links[link].seconds(nbytes, n_transfers)
        src, dst = link.split("->")
        staged = (f"{src}->dram", f"dram->{dst}")
        if all(part in links for part in staged):
            return sum(links[part].seconds(nbytes, n_transfers) for part in staged)
        raise KeyError(f"hardware profile {self.profile.name!r} has no link {link!r}")
