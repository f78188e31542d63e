"""The handle of moves a live-store call left in flight."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Pending"]


@dataclass(frozen=True)
class Pending:
    """Moves a call left in flight; pass it to ``TieredKVStore.wait``.

    ``events`` holds, per job, the CUDA event a compute stream can ``wait_event`` on (None
    for a job that is not a CUDA copy, or already finished when the handle was made).
    ``owner`` is the random token of the store that made it (job ids are numbered per store:
    another store's ``wait`` refuses the handle); None for a handle made by hand. A plain
    int, so a handle copies and pickles as before.
    """

    job_ids: tuple[int, ...] = ()
    blocks: int = 0
    events: tuple = ()
    owner: int | None = field(default=None, repr=False, compare=False)

    def __bool__(self) -> bool:
        return bool(self.job_ids)
