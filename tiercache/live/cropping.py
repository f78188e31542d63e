"""Cropping a live sequence: dropping its last tokens, as speculative decoding does when the
model rejects drafted tokens (transformers' assisted decoding and prompt lookup call the
cache's ``crop``).

A sequence keeps, per layer, full blocks (stored and held) and a partial tail. Cropping to
``keep`` tokens keeps the blocks wholly below ``keep``, releases the rest (they stay stored:
a block's KV depends only on the ids before it, so a later prompt with the same ids may reuse
one that had a content key), and makes the kept part of the block ``keep`` falls in the new
tail, read back from the tier that holds it (decoded, for a quantised tier). The ids the
sequence knew from ``keep`` on are taken back (``forget_tokens(keep, private=False)``): the
next tokens may differ. Blocks stored from then on without known ids get new private keys (a
write never rewrites a stored key, so a refilled block under a dropped block's private key
would be answered with the dropped KV).

A helper module of ``Sequence`` (``Sequence.crop`` calls it): it reads and sets the
sequence's private fields, as a method would.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import TYPE_CHECKING

import torch

from tiercache.errors import UserError

from .arguments import integer_or_none
from .holding import release_holds
from .summaries import CorruptBlock, keep_summaries, read_where_stored

if TYPE_CHECKING:
    from .cache import TieredKVCache
    from .sequence import Sequence

__all__ = ["crop"]


def crop(seq: "Sequence", keep) -> None:
    """Keeps the first ``keep`` tokens of ``seq`` at every layer (see the module docstring).

    All or nothing: the kept part of a partial block is read before anything changes, and a
    record that fails gives the released holds back. One ``release`` record names the
    blocks dropped.

    Raises:
        UserError: ``keep`` is not an integer in ``[0, shortest layer's length]``; the
            sequence was freed or the cache closed; the block ``keep`` falls in proved
            unreadable (a corrupt chunk: it is reported lost, the sequence is unchanged).
        ReadIOError: an I/O error reading that block (nothing changed; the block stays).
    """
    cache = seq.cache
    with cache.store._lock:
        cache._check_open()
        seq._check_live("crop")
        shortest = min(seq.length(layer) for layer in range(len(seq._layers)))
        index = integer_or_none(keep)
        if index is None or not 0 <= index <= shortest:
            raise UserError(f"Sequence.crop: keep must be an integer in [0, {shortest}] (tokens every layer holds), "
                            f"got {keep!r}")
        cache.driver.settle()
        full, rest = divmod(index, cache.layout.block_tokens)
        tails = [_kept_part(cache, state, full, rest) for state in seq._layers]  # reads first: nothing changed yet
        dropped = [int(i) for state in seq._layers for i in state.ids[full : state.n]]
        if dropped:
            _release_recorded(cache, dropped)
        for state, tail in zip(seq._layers, tails):
            keep_summaries(cache, state, full)
            if full < state.n:
                state.n = full
                del state.keys[full:]
            if tail is not None:
                state.tail[:, :, :rest] = tail
            state.tail_len = rest
        seq._private = os.urandom(16)  # private keys anew: a dropped block keeps its key, never taken again
        seq.forget_tokens(index, private=False)
        seq.cached_tokens = min(seq.cached_tokens, index)
        cache._settle_events()


def _kept_part(cache: "TieredKVCache", state, full: int, rest: int) -> torch.Tensor | None:
    """The first ``rest`` tokens of block ``full`` (``[2, kv, rest, D]``) when the crop cuts a
    stored block; None when the cut falls in the tail (it only shortens) or on a boundary."""
    if full >= state.n or rest == 0:
        return None
    block_id, key = int(state.ids[full]), state.keys[full]
    try:
        scratch = read_where_stored(cache, block_id, key)
    except KeyError:
        raise UserError(f"Sequence.crop: block {block_id} of this sequence is no longer stored (lost: unreadable)") from None
    except CorruptBlock as lost:
        cache.manager.report_lost(lost.tier, [block_id])
        cache._settle_events()
        raise UserError(f"Sequence.crop: block {block_id} proved unreadable (a corrupt chunk; reported lost); "
                        "the sequence is unchanged") from None
    return scratch[0, :, :, :rest].to(cache.device)


def _release_recorded(cache: "TieredKVCache", dropped: list[int]) -> None:
    """Releases the sequence's holds on ``dropped`` (once per listing) and writes one
    ``release`` record. All or nothing: a release that stops part-way, or a record that
    fails, holds again what it had released, and re-raises (the sequence lists them still)."""
    def hold_again(unreleased: list[int]) -> None:
        cache.driver.hold(list((Counter(dropped) - Counter(unreleased)).elements()), settle=False)

    release_holds(cache, dropped, hold_again)
    cache._list(dropped, listed=False)
    try:
        cache._emit(0, cache._last_step, release=tuple(dict.fromkeys(dropped)))
    except BaseException:  # an interrupt too: the sequence still lists them
        cache.driver.hold(dropped, settle=False)
        cache._list(dropped)
        raise
