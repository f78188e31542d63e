"""What NVMe store operations hand back: per-block write results, the store-full error, the
error of a read that failed with an I/O error, and the latest write that failed."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError

__all__ = ["FailedWrite", "PutResult", "ReadIOError", "StoreFullError"]


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


@dataclass(frozen=True)
class FailedWrite:
    """A block write that failed (``NVMeStore.last_failed_write``): its OSError and the file
    it was writing (the chunk file, or the index journal whose room it reserves first)."""

    error: OSError
    path: str


class ReadIOError(OSError, KeyError):
    """Reading stored chunks failed with an I/O error (EIO, ...) on this attempt.

    It says nothing about the stored bytes: those chunks stay stored (counted in
    ``stats["read_errors"]``, not ``corrupt_reads``), so a later read or a reopen may still
    serve them. Chunks of the same batch that proved corrupt (length or crc32c mismatch)
    or absent were forgotten as usual; ``lost_keys`` names them, so a mover can report
    them lost. Also a KeyError: a reader that treats an unreadable block as a miss goes on
    doing so.

    Attributes:
        failed: the keys whose read failed, each with its OSError.
        lost_keys: keys of the batch that are absent or were proven corrupt.
    """

    def __init__(self, failed: dict[bytes, OSError], lost_keys: frozenset[bytes] = frozenset()) -> None:
        key, cause = next(iter(failed.items()))
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        reason = cause.strerror or str(cause)
        super().__init__(cause.errno, f"reading stored block {key.hex()}{more} failed: {reason}; the block stays stored")
        self.failed = dict(failed)
        self.lost_keys = frozenset(lost_keys)
