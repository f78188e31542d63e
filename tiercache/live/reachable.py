"""The ids a live-store read asks for, once the remote tier's blocks are adopted and its
local hits counted (a ``selective`` remote write publishes the blocks hit often enough)."""

from __future__ import annotations

from typing import Sequence

from tiercache.core.manager import TierManager

from .keymap import KeyMap
from .remote import RemoteLink

__all__ = ["reachable_ids"]


def reachable_ids(keymap: KeyMap, manager: TierManager, remote: RemoteLink | None,
                  keys: Sequence[bytes], prefix: bool = False) -> list[int | None]:
    """Ids of ``keys`` (None: the id belongs to another key) once the blocks of ``keys`` the
    remote store holds and no tier does are adopted into its view; counts the read's local
    hits (``RemoteLink.read``), which may publish hot blocks into the remote tier (and tries
    again publications that failed).

    With ``prefix`` (``get_prefix``) only the prefix's head is adopted: nothing past the
    first block neither held nor in the store (the read ends there), and the prefix's own
    tail entries may leave the view to make room for its head (``RemoteLink.adopt_prefix``).
    Otherwise every key the store holds is adopted, in order, as room allows.

    A read (``get``, ``get_prefix``) settles the moves in flight before it calls this, so a
    block a prefetch is moving is counted, and published, from where it lands: a publication
    never races the move (``TransferMixin.publish`` skips a block a move in flight takes out
    of its tier). A prefetch calls it unsettled: it never waits for moves.
    """
    ids = keymap.ids(keys, register=False)
    if remote is None:
        return ids
    if prefix:
        remote.adopt_prefix(keys, ids)
    else:
        remote.adopt_present([k for k, i in zip(keys, ids) if i is not None and manager.locate(i) is None],
                             protect=[i for i in ids if i is not None])
    ids = keymap.ids(keys, register=False)
    remote.read([i for i in ids if i is not None])
    return ids
