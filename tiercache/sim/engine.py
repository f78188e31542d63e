"""Simulated transfer engine: the live manager's engine, with modeled time instead of bytes.

``SimEngine`` completes a job ``latency + bytes / bandwidth`` of simulated seconds after the
link it uses becomes free (one FIFO queue per link, so transfers on one link serialise and
different links overlap). It moves no data and never touches metadata: the manager applies
its results exactly as it applies a real engine's.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from tiercache.config import REMOTE_TIER
from tiercache.core.plans import JobResult, TransferPlan

__all__ = ["SimClock", "SimEngine", "LinkUsage", "STORAGE_TIERS", "hop_block_bytes"]

#: Tiers on media that store and carry bytes but compute nothing (a drive, the network's
#: shared store): the host encodes and decodes for them.
STORAGE_TIERS = ("nvme", REMOTE_TIER)


def hop_block_bytes(src: str, src_form: int, dst: str, dst_form: int, plain: int) -> int:
    """Bytes one block takes on a hop from tier ``src`` to tier ``dst``, as the live data
    plane (``tiercache/data/handlers.py``, ``quantized.py``) moves it.

    Args:
        src: source tier name; ``src_form`` the bytes of a block as it holds it.
        dst: destination tier name; ``dst_form`` the bytes of a block as it holds it.
        plain: bytes of an unquantised block (a form below it is a codec's).

    Invariants: a hop to or from a storage tier (``STORAGE_TIERS``) carries that tier's
    form, whatever the other end's (an INT4 DRAM block is decoded on the host and written
    to a plain NVMe tier whole; a plain NVMe block is read whole and encoded on the host).
    Between two memory tiers the converting side is the one that makes the encoded form
    cross: a quantised destination's form (encoded where the block lies, then copied), else
    the source's (an encoded block is copied, then decoded where it lands).
    """
    if dst in STORAGE_TIERS:
        return dst_form
    if src in STORAGE_TIERS:
        return src_form
    return dst_form if dst_form < plain else src_form


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
            None when every tier holds ``block_bytes``. A block crosses each hop in the form
            the live data plane moves (``hop_block_bytes``); the codec's compute time is
            taken to hide behind the link (``scripts/bench_quant.py`` measures decode against
            the disk's cold read rate and encode against its durable write rate, of encoded
            blocks, in fp16-equivalent bytes).

    A move between two tiers neither of which is DRAM (HBM and NVMe or remote, NVMe and
    remote) that the profile gives no direct link for is staged through DRAM
    (``nvme->hbm`` = ``nvme->dram`` then ``dram->hbm``), as the live data plane copies it;
    each hop is charged at the bytes it carries, and the move's bytes are those of its last
    hop (what arrives in the destination tier).
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
        between two tiers (one transfer by default): the seconds of every hop of the path
        (``_path``), each at the bytes it carries; the bytes of the last hop."""
        path = self._path(src_tier, dst_tier)
        seconds = sum(self._seconds(link, n_blocks * per_block, n_transfers) for link, per_block in path)
        return n_blocks * path[-1][1], seconds

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

    def _path(self, src_tier: int, dst_tier: int) -> tuple[tuple[str, int], ...]:
        """The hops of a move, each as (link name, bytes one block takes on it).

        One hop, unless neither end is DRAM and the profile gives no direct link for the move
        (GPUDirect): then two, through host memory, where the block is held in the memory
        end's form (the live handlers stage a plain HBM's blocks plain and a quantised HBM's
        encoded; between two storage tiers the destination's).
        """
        src, dst = self.tier_names[src_tier], self.tier_names[dst_tier]
        src_form, dst_form = self._form(src_tier), self._form(dst_tier)
        direct = f"{src}->{dst}"
        if "dram" in (src, dst) or (self.profile is not None and direct in self.profile.links):
            return ((direct, hop_block_bytes(src, src_form, dst, dst_form, self._plain())),)
        host = dst_form if src in STORAGE_TIERS else src_form
        return ((f"{src}->dram", hop_block_bytes(src, src_form, "dram", host, self._plain())),
                (f"dram->{dst}", hop_block_bytes("dram", host, dst, dst_form, self._plain())))

    def _plain(self) -> int:
        """Bytes of an unquantised block (0 without a layout)."""
        return self.block_bytes or 0

    def _form(self, tier: int) -> int:
        """Bytes of one block as ``tier`` stores it (see ``tier_block_bytes``)."""
        return self._plain() if self.tier_block_bytes is None else self.tier_block_bytes[tier]

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
        """Modeled seconds of one hop (0 without a profile or without bytes).

        Raises:
            KeyError: the profile has no such link.
        """
        if self.profile is None or not nbytes:
            return 0.0
        if link not in self.profile.links:
            raise KeyError(f"hardware profile {self.profile.name!r} has no link {link!r}")
        return self.profile.links[link].seconds(nbytes, n_transfers)
