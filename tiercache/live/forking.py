"""Forking a live sequence: a second sequence that starts with the first one's KV.

Parallel sampling, a chat branching at one turn, or a ``transformers`` cache deep-copied
after a shared prompt all need two sequences with the same KV so far that then go their own
ways. Stored blocks never change (a write never rewrites a stored key), so a fork shares
them: each of its full blocks is held once more, by the fork (``free`` of either releases its
own holds only; a block the source lost counts as an orphan hold, ``tiercache.core.holds``,
released once the same way), and only the partial tail block, which is not stored yet, is
copied. The fork gets its own private key prefix, so blocks either sequence stores later never
collide; blocks with content keys (token ids known) are found by either one's
``match_prefix`` as before. A fork takes no room in the tiers until it appends.

A helper module of ``Sequence`` (``Sequence.fork`` calls it): it reads and sets the new
sequence's private fields, as a method would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .holding import hold_recorded

if TYPE_CHECKING:
    from .sequence import Sequence

__all__ = ["fork"]


def fork(source: "Sequence", make: Callable[..., "Sequence"]) -> "Sequence":
    """A new sequence of ``source``'s cache holding the same KV at every layer.

    Args:
        source: a live sequence (not freed) of an open cache.
        make: the ``Sequence`` constructor (called as ``make(cache, None, namespace)``).

    Returns:
        The fork: the same length per layer, the same token ids, content keys, reused prompt
        tokens (``cached_tokens``) and last read positions as ``source``; an empty
        ``reports``. Its step record is one ``hold`` of the shared blocks.

    Raises:
        UserError: the cache is closed, ``source`` was freed, or the call comes from another
            process than the store's opener. Nothing is held then.
    """
    cache = source.cache
    with cache.store._lock:
        cache._check_open()
        source._check_live("fork")
        twin = make(cache, None, source.namespace)
        twin._tokens = source._tokens.copy()
        twin._content_keys, twin._keyed_end = list(source._content_keys), source._keyed_end
        twin.cached_tokens = source.cached_tokens
        twin.last_positions = source.last_positions.copy()
        twin._layers = [state.copy() for state in source._layers]
        hold_recorded(cache, twin._held_ids())
        return twin
