"""Holding and releasing a live sequence's blocks with the bookkeeping every path shares:
the step record, the listings (``TieredKVCache._list``) and what a call that stops part-way
leaves behind. ``Sequence`` (a new sequence's reused prefix, ``free``), ``forking`` and
``cropping`` use these."""

from __future__ import annotations

from typing import Callable

from tiercache.core.counts import not_decremented

__all__ = ["hold_recorded", "release_holds"]


def hold_recorded(cache, held: list[int]) -> None:
    """Holds ``held`` (blocks a new sequence starts with: a reused prefix, a fork's shared
    blocks, among them any its source lost, held as orphans: ``StepDriver.hold``), writes one
    ``hold`` record and counts the listings (``TieredKVCache._list``). All or nothing: a record
    that fails releases the holds (no sequence is returned, so nothing else would), then re-raises."""
    cache.driver.hold(held)
    try:
        cache._emit(0, cache._last_step, hold=tuple(held))
        cache._settle_events()
    except BaseException:  # an interrupt too
        cache.driver.release(held)
        raise
    cache._list(held)


def release_holds(cache, ids: list[int], on_error: Callable[[list[int]], None]) -> None:
    """Releases one hold on each listing of ``ids`` (orphan holds first: ``StepDriver.release``).

    If the release stops part-way (an error, or an interrupt), ``on_error`` is called with
    the listings still held (``not_decremented``), before the error is re-raised: the caller
    then holds them again, or remembers them for a retry. No other sequence's hold is ever
    taken, since only the holds this call took off are counted out.
    """
    count = cache.manager.hold_count
    before = {block_id: count(block_id) for block_id in ids}
    try:
        cache.driver.release(ids)
    except BaseException:
        on_error(not_decremented(ids, before, {block_id: count(block_id) for block_id in before}))
        raise
