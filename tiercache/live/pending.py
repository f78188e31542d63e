"""The handle of moves a live-store call left in flight."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Pending"]


@dataclass(frozen=True)
class Pending:
    """Moves a call left in flight; pass it to ``TieredKVStore.wait``.

    ``events`` holds, per job, the CUDA event a compute stream can ``wait_event`` on (None
    for a job that is not a CUDA copy, or already finished when the handle was made).
    """

    job_ids: tuple[int, ...] = ()
    blocks: int = 0
    events: tuple = ()

    def __bool__(self) -> bool:
        return bool(self.job_ids)
