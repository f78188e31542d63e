"""What a live store counts: the per-tier counters of the manager's event stream, and the
bytes each link carried, defined as ``tiercache replay`` defines them.

A block crosses a link when it moves (a demotion, a promotion, a write-through copy) and
when it is read where it lies below HBM (a streaming read, or a promotion that found no
room): attention and ``get`` use it in HBM, so it crosses its tier's link to HBM all the
same. A replay charges both (``tiercache.sim.hitcost``); so does ``Traffic``. A demotion
into NVMe that takes up the copy the tier retained when the block moved up
(``data.engine.RetainedCopies``) writes nothing, so it crosses nothing: a replay, which keeps
no such copies, charges it; ``Traffic`` counts it apart (``retained_takeups``), so adding
those back gives the replay's figure.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from tiercache.config import Codec, TierConfig
from tiercache.core.stats import HierarchyStats, InPlaceHits
from tiercache.sizes import move_hops

__all__ = ["Traffic", "as_replay_charges", "link_block_bytes"]


def link_block_bytes(names: Sequence[str], sizes: Sequence[int], quantised: Sequence[bool], src: int, dst: int) -> int:
    """Bytes one block brings from tier ``src`` into tier ``dst``, in the form the data plane
    moves it: the last hop of ``sizes.move_hops``. A move between two tiers neither of which is
    DRAM (NVMe or remote to HBM) is staged through host memory, where the block is held in the
    memory end's form when the source is a storage tier, else in the source's; it counts what
    arrives, its last hop, as ``tiercache.sim.engine.SimEngine`` charges a staged move.

    Args:
        names: the tiers' names, fastest first; ``sizes`` the bytes of one block as each
            stores it (its codec's); ``quantised`` whether each stores blocks with a codec.
        src, dst: indices of the link's ends in ``names``.

    Invariants: the one rule a live store's bytes per link (``Traffic``) and a decode step's
    ``bytes_moved`` (``tiercache.live.steps``) charge a block by.
    """
    return move_hops(names[src], sizes[src], names[dst], sizes[dst], quantised[dst])[-1][1]


class Traffic:
    """A store's counters and bytes per link, fed by ``consume(events)``.

    Args:
        tiers: the store's tiers (their names, capacities and codecs), fastest first; the
            first is HBM (the live store's tiers always start there).
        tier_block_bytes: bytes of one block as each tier stores it (its codec's).
        taken_up: per (source, destination) tier, the moves that took up a retained copy
            with no write (``LocalEngine.taken_up``, read live; None: none are taken up).
        already_held: mappings per (tier, shared tier) of blocks that left for a shared tier
            which already held them, with no copy: in this process's view
            (``TierManager.left_for_shared``) or put there by another process
            (``LocalEngine.already_there``); read live.

    Invariants: a link's bytes are the blocks moved over it, less those taken up from a
    retained copy, plus, for a link into HBM, the blocks read in place in its source tier,
    each at what one block brings into the destination (``link_block_bytes``); top-tier hits
    are in place and cross no link. Moves and take-ups are counted once a move settles, so
    at every ``summary`` a link's take-ups are among its moves.
    """

    def __init__(self, tiers: Iterable[TierConfig], tier_block_bytes: Sequence[int],
                 taken_up: Mapping[tuple[int, int], int] | None = None,
                 already_held: Sequence[Mapping[tuple[int, int], int]] = ()) -> None:
        tiers = list(tiers)
        self.counters = HierarchyStats.for_tiers((t.name, t.capacity_blocks) for t in tiers)
        self.names = [t.name for t in self.counters.tiers]
        self.in_place = InPlaceHits.for_tiers(len(self.names))
        self._sizes = list(tier_block_bytes)
        self._quantised = [t.codec is not Codec.NONE for t in tiers]
        self._taken_up = {} if taken_up is None else taken_up
        self._already_held = tuple(already_held)

    @classmethod
    def for_store(cls, tiers: Iterable[TierConfig], tier_block_bytes: Sequence[int], engine, manager) -> "Traffic":
        """The ``Traffic`` of a live store: its engine's take-ups and shared-tier blocks
        already there, and its manager's victims its view already held, read live."""
        return cls(tiers, tier_block_bytes, engine.taken_up, (manager.left_for_shared, engine.already_there))

    def consume(self, events: Sequence[tuple[int, int, int, int]]) -> None:
        """Counts one drained batch of the manager's events (a list: it is read twice)."""
        self.counters.consume(events)
        self.in_place.consume(events)

    def link_block_bytes(self, src: int, dst: int) -> int:
        """Bytes one block brings from tier ``src`` into tier ``dst`` (``link_block_bytes``)."""
        return link_block_bytes(self.names, self._sizes, self._quantised, src, dst)

    def link_bytes(self) -> dict[str, int]:
        """Bytes per link (``"src->dst"``): what crossed it, moves (less those taken up from a
        retained copy, and victims a shared tier already held) and reads in place on their
        link to HBM."""
        blocks = self.counters.blocks_moved()
        for not_copied in (self._taken_up, *self._already_held):
            for link, count in not_copied.items():
                blocks[link] = blocks.get(link, 0) - count
        for tier, count in enumerate(self.in_place.counts[1:], start=1):
            if count:
                blocks[(tier, 0)] = blocks.get((tier, 0), 0) + count
        return {self._link_name(s, d): n * self.link_block_bytes(s, d) for (s, d), n in blocks.items()}

    def retained_takeups(self) -> dict[str, dict[str, int]]:
        """Per link (``"src->dst"``), the demotions that took up the copy their destination
        retained: ``demotions`` and ``bytes_not_written`` (what they would have moved, as a
        replay charges them: ``link_bytes`` plus these is the replay's figure)."""
        return {self._link_name(s, d): {"demotions": n, "bytes_not_written": n * self.link_block_bytes(s, d)}
                for (s, d), n in self._taken_up.items() if n}

    def shared_already_held(self) -> dict[str, int]:
        """Per link into the shared tier (``"src->dst"``), the victims that left for it while
        it already held them: demoted, nothing copied (a replay charges none either)."""
        held: dict[tuple[int, int], int] = {}
        for counts in self._already_held:
            for link, n in counts.items():
                held[link] = held.get(link, 0) + n
        return {self._link_name(s, d): n for (s, d), n in held.items() if n}

    def _link_name(self, src: int, dst: int) -> str:
        return f"{self.names[src]}->{self.names[dst]}"

    def tier_dicts(self) -> list[dict]:
        """Per tier its counters (``TierCounters``), ``hits_in_place`` and their
        ``in_place_bytes`` (what they carried to HBM: none for the top tier's), as a replay
        records them."""
        tiers = []
        for tier, (counters, count) in enumerate(zip(self.counters.tiers, self.in_place.counts)):
            nbytes = count * self.link_block_bytes(tier, 0) if tier else 0
            tiers.append({**counters.as_dict(), "hits_in_place": count, "in_place_bytes": nbytes})
        return tiers

    def summary(self) -> dict:
        """``tiers`` (``tier_dicts``), ``hits``, ``misses``, ``bytes_moved`` (``link_bytes``),
        ``retained_takeups`` and ``shared_already_held``."""
        return {"tiers": self.tier_dicts(), "hits": self.counters.hits, "misses": self.counters.misses,
                "bytes_moved": self.link_bytes(), "retained_takeups": self.retained_takeups(),
                "shared_already_held": self.shared_already_held()}


def as_replay_charges(stats: dict) -> dict[str, int]:
    """A store's ``stats()["bytes_moved"]`` with its ``retained_takeups`` added back: bytes per
    link as a replay of the same accesses charges them (``SimEngine`` keeps no retained copies,
    so it charges every demotion)."""
    charged = dict(stats["bytes_moved"])
    for link, taken in stats["retained_takeups"].items():
        charged[link] = charged.get(link, 0) + taken["bytes_not_written"]
    return charged
