"""What NVMe store operations hand back: per-block write results and the store-full error."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError

__all__ = ["PutResult", "StoreFullError"]


class StoreFullError(UserError):
    """A put asked for more free slots than the store has; the manager evicts first."""


@dataclass(frozen=True)
class PutResult:
    """Outcome of writing one block: its slot, or the OSError that kept it out of the store."""

    key: bytes
    slot: int | None
    error: OSError | None = None

    @property
    def ok(self) -> bool:
        """True when the block was written and published."""
        return self.error is None
