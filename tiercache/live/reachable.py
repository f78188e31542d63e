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
    Otherwise every key the store holds is adopted, in order, as room allows. A prefix read
    counts hits on its head only (``_head_length``).

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
    read = ids[: _head_length(manager, ids)] if prefix else ids
    remote.read([i for i in read if i is not None])
    return ids


def _head_length(manager: TierManager, ids: Sequence[int | None]) -> int:
    """Leading ids held by some tier (a local one or the view): what a ``get_prefix`` reads
    (it ends at the first block no tier holds), so that only they are counted as hits (under
    ``selective`` a count may publish a block, and never one past the prefix's end)."""
    return next((n for n, block_id in enumerate(ids) if block_id is None or manager.locate(block_id) is None), len(ids))
