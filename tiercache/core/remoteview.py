"""The shared remote tier's view, one set of rules for the live store and the fleet replay.

A hierarchy with a shared remote tier keeps a *view* of it: a tier of the manager whose
entries are blocks the remote store holds. Before a request reads its prefix, the live store
(``tiercache.live.remote.RemoteLink``) and the fleet replay (``tiercache.sim.fleet``) bring
the view in step with the store the same way: entries the store no longer holds leave
(``drop_stale``), and the prefix's head (``view_head``) that no tier holds is adopted
(``adopt``); under selective writes a local victim enters the view only once it was hot
(``HotOnly``). Both sides call these, so a fix reaches both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Collection, Sequence

from tiercache.policies.base import AdmissionPolicy

if TYPE_CHECKING:
    from .manager import TierManager

__all__ = ["HotOnly", "adopt", "drop_stale", "view_head"]


class HotOnly(AdmissionPolicy):
    """Selective writes: the view admits a local victim only once it was hit ``threshold``
    times locally (it was published; a colder one just leaves)."""

    name = "remote_selective"

    def __init__(self, hits: dict[int, int], threshold: int) -> None:
        self._hits, self._threshold = hits, threshold

    def admit(self, ids: Sequence[int]) -> list[bool]:
        return [self._hits.get(b, 0) >= self._threshold for b in ids]


def view_head(manager: "TierManager", tier: int, prefix: list[int]) -> list[int]:
    """The longest leading part of ``prefix`` whose blocks in the view (tier ``tier``), or
    held by no tier (to adopt), number at most the view's capacity."""
    view, used = manager.dirs[tier], 0
    for n, block_id in enumerate(prefix):
        used += block_id in view.slot_of or manager.locate(block_id) is None
        if used > view.capacity:
            return prefix[:n]
    return prefix


def adopt(manager: "TierManager", tier: int, fresh: list[int], kept: Collection[int]) -> list[int]:
    """Adds ``fresh`` (blocks the store holds, no tier here) to the view, the first ones
    first; room is made from view entries outside ``kept`` (which holds ``fresh``). Returns
    the ids adopted (a leading part of ``fresh``: those beyond the room are left out)."""
    view = manager.dirs[tier]
    room = view.capacity - sum(1 for b in kept if b in view.slot_of)
    manager.make_room(tier, min(len(fresh), room), kept)
    taken = fresh[: view.n_free]
    if taken:
        manager.restore(tier, taken)
    return taken


def drop_stale(manager: "TierManager", tier: int, ids: Sequence[int]) -> list[int]:
    """Drops the view entries among ``ids`` the store no longer holds (the caller found them
    gone), but for those pinned or referenced (a read in progress uses them); returns them."""
    view = manager.dirs[tier]
    stale = [b for b in dict.fromkeys(ids) if b in view.slot_of and b not in view.pins and b not in manager.refs]
    if stale:
        manager.evict(stale)
    return stale
