"""Simulated transfer engine: the live manager's engine, with modeled time instead of bytes.

``SimEngine`` completes a job ``latency + bytes / bandwidth`` of simulated seconds after the
link it uses becomes free (one FIFO queue per link, so transfers on one link serialise and
different links overlap). It moves no data and never touches metadata: the manager applies
its results exactly as it applies a real engine's.
"""

from __future__ import annotations

import heapq
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from tiercache.core.plans import JobResult, TransferPlan
from tiercache.sizes import STORAGE_TIERS, hop_block_bytes, move_hops

__all__ = ["SimClock", "SimEngine", "LinkUsage", "STORAGE_TIERS", "hop_block_bytes", "GPU", "GPU_TIER"]

#: The GPU's memory, where attention reads every hit and prefill writes every computed block.
GPU_TIER = "hbm"
#: ``SimEngine``'s index for the GPU's memory as one end of a move: tier 0 when the hierarchy's
#: top tier is HBM, else an HBM outside the hierarchy holding plain KV (not a cache tier: a
#: block must cross to it to be used, and a computed block crosses from it to be stored).
GPU = -1


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
        tier_quantised: per tier, whether it stores blocks with a codec (a hop into a
            quantised memory tier carries its form: ``hop_block_bytes``), from the tiers'
            codecs; None: a tier whose ``tier_block_bytes`` differ from ``block_bytes`` (the
            stores refuse a codec whose blocks are not smaller: ``Codec.check_layout``).

    A move between two tiers neither of which is DRAM (HBM and NVMe or remote, NVMe and
    remote) that the profile gives no direct link for is staged through DRAM
    (``nvme->hbm`` = ``nvme->dram`` then ``dram->hbm``), as the live data plane copies it;
    each hop is charged at the bytes it carries, and the move's bytes are those of its last
    hop (what arrives in the destination tier).

    Tier indices name the hierarchy's tiers, and ``GPU`` the GPU's memory (see ``GPU``): in a
    hierarchy without HBM (``dram``, ``nvme``) a hit is read from its tier to HBM and a
    computed block written from HBM to the tier storing it, each on its link
    (``gpu_is_top`` False).
    """

    tier_names: tuple[str, ...]
    block_bytes: int | None = None
    profile: object | None = None
    clock: SimClock = field(default_factory=SimClock)
    usage: dict[str, LinkUsage] = field(default_factory=dict)
    _link_free: dict[str, float] = field(default_factory=dict)
    _pending: list[tuple[float, int]] = field(default_factory=list)
    tier_block_bytes: tuple[int, ...] | None = None
    tier_quantised: tuple[bool, ...] | None = None
    _paths: dict[tuple[int, int], tuple[str, tuple[tuple[str, int], ...]]] = field(default_factory=dict, repr=False)
    _charged: set[str] | None = field(default=None, repr=False)  # links charged within ``coalesce``; None outside

    @property
    def gpu_is_top(self) -> bool:
        """Whether the top tier is HBM (the GPU's memory): hits there cross no link."""
        return self.tier_names[0] == GPU_TIER

    def submit(self, plan: TransferPlan) -> None:
        """Queues ``plan`` on its link; returns at once."""
        done = self._occupy(plan.src_tier, plan.dst_tier, plan.n_blocks)
        heapq.heappush(self._pending, (done, plan.job_id))

    @contextmanager
    def coalesce(self) -> Iterator[None]:
        """Within it, the transfers submitted and the blocks filled are charged as one transfer
        per link: the first on a link pays its latency, later ones only their bytes (counted
        in ``usage`` blocks, bytes and seconds, not in its transfers), so that they cost what
        one transfer of all their blocks would.

        The manager places each chunk of new blocks this way for a policy that inserts one id
        at a time (not ``batch_insert_safe``), whose interleaved victims move one by one: a
        batch-safe policy moves the same blocks in one transfer per link, and the same moves
        cost the same modeled time (``TierManager._place_chunks``). Nested: one group.
        """
        if self._charged is not None:
            yield
            return
        self._charged = set()
        try:
            yield
        finally:
            self._charged = None

    def read_through(self, src_tier: int, n_blocks: int) -> tuple[int, float]:
        """Charges a read of blocks where they lie (a hit not promoted, or any hit of a top
        tier that is not HBM) on the link from ``src_tier`` to the GPU's memory (``GPU``),
        where attention reads them; returns (bytes, seconds).

        The read is complete when the call returns (the replay reads synchronously); it
        occupies the link like a copy of the same blocks, and no tier changes.
        """
        self._occupy(src_tier, GPU, n_blocks)
        return self.cost(src_tier, GPU, n_blocks)

    def cost(self, src_tier: int, dst_tier: int, n_blocks: int, n_transfers: int = 1) -> tuple[int, float]:
        """Bytes and modeled seconds of ``n_transfers`` transfers of ``n_blocks`` in all
        between two tiers or a tier and ``GPU`` (one transfer by default; 0: the time of the
        bytes alone, no latency): the seconds of
        every hop of the path (``_path``), each at the bytes it carries; the bytes of the
        last hop."""
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
        """The hops of a move (``sizes.move_hops``): one, unless neither end is DRAM and the
        profile gives no direct link for the move (GPUDirect)."""
        return self._route(src_tier, dst_tier)[1]

    def _route(self, src_tier: int, dst_tier: int) -> tuple[str, tuple[tuple[str, int], ...]]:
        """(link name, hops) of a move between two tiers, worked out once per pair (tiers,
        forms and profile are fixed for an engine's life)."""
        route = self._paths.get((src_tier, dst_tier))
        if route is None:
            (src, src_form), (dst, dst_form) = self._end(src_tier), self._end(dst_tier)
            direct = self.profile is not None and f"{src}->{dst}" in self.profile.links
            route = f"{src}->{dst}", move_hops(src, src_form, dst, dst_form, self._quantised(dst_tier), direct)
            self._paths[(src_tier, dst_tier)] = route
        return route

    def _plain(self) -> int:
        """Bytes of an unquantised block (0 without a layout)."""
        return self.block_bytes or 0

    def _form(self, tier: int) -> int:
        """Bytes of one block as ``tier`` stores it (see ``tier_block_bytes``)."""
        return self._plain() if self.tier_block_bytes is None else self.tier_block_bytes[tier]

    def _quantised(self, tier: int) -> bool:
        """Whether ``tier`` stores blocks with a codec (``tier_quantised``); ``GPU`` is the top
        tier when that is HBM, else an HBM holding plain KV."""
        if tier == GPU:
            return self.gpu_is_top and self._quantised(0)
        if self.tier_quantised is None:
            return self._form(tier) != self._plain()
        return self.tier_quantised[tier]

    def _end(self, tier: int) -> tuple[str, int]:
        """(name, bytes of one block there) of one end of a move: a tier of the hierarchy, or
        ``GPU``: the top tier when it is HBM, else an HBM holding plain KV."""
        if tier == GPU:
            return (GPU_TIER, self._plain()) if not self.gpu_is_top else self._end(0)
        return self.tier_names[tier], self._form(tier)

    def _link(self, src_tier: int, dst_tier: int) -> str:
        return self._route(src_tier, dst_tier)[0]

    def _occupy(self, src_tier: int, dst_tier: int, n_blocks: int) -> float:
        """Books one transfer on its link (usage and queue), or only its bytes when one was
        booked there within ``coalesce``; returns when it completes."""
        link = self._link(src_tier, dst_tier)
        transfers = 1
        if self._charged is not None:
            transfers = 0 if link in self._charged else 1
            self._charged.add(link)
        nbytes, seconds = self.cost(src_tier, dst_tier, n_blocks, transfers)
        done = max(self.clock.now, self._link_free.get(link, 0.0)) + seconds
        self._link_free[link] = done
        usage = self.usage.setdefault(link, LinkUsage())
        usage.blocks += n_blocks
        usage.bytes += nbytes
        usage.transfers += transfers
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
        """Computed blocks cost recompute time, accounted by the replay; one stored in a tier
        other than HBM (below the top by a placement policy's choice, or in the top tier of a
        hierarchy without HBM) is written down from HBM (``GPU``), where it was computed, on
        that link."""
        if ids and (tier or not self.gpu_is_top):
            self._occupy(GPU, tier, len(ids))

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
