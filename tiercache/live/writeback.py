"""Why an append stored none of its blocks: ``WriteBackError`` when a write into NVMe
failed (a full disk: the OS error, with the file it was writing, from the NVMe store's
``last_failed_write``), else the placement was refused (every HBM slot pinned)."""

from __future__ import annotations

import errno as errnos
from typing import Sequence

__all__ = ["WriteBackError", "failed_writes", "refused_blocks"]


class WriteBackError(OSError, RuntimeError):
    """Blocks could not be stored because a write into the NVMe tier failed (a demotion
    making room for them: a full disk, an I/O error); nothing of the call was kept.

    ``errno`` and ``filename`` are the failed write's (``ENOSPC``, the chunk or journal
    file), its OSError is ``__cause__``, and the message names both. Also a RuntimeError,
    the type an append raised for it before. Pickles with its attributes (``__reduce__``).
    """

    def __init__(self, message: str, code: int | None, path: str | None) -> None:
        super().__init__(message)
        self.errno, self.filename = code, path

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self) -> tuple:
        """Rebuilds from the message, errno and path (``args`` holds only the message)."""
        return type(self), (self.args[0], self.errno, self.filename)


def failed_writes(media: Sequence[object]) -> list[object]:
    """Each medium's latest failed write (None for a medium that records none), to compare
    after a call (``refused_blocks``)."""
    return [getattr(medium, "last_failed_write", None) for medium in media]


def refused_blocks(what: str, outcome: str, media: Sequence[object], before: list[object]) -> Exception:
    """The error for blocks a call could not store, ``f"{what} ({why}); {outcome}"``:
    ``WriteBackError`` chained to the OSError of a write that failed since ``before``
    (``failed_writes``), naming it and its file, else a RuntimeError (every HBM slot pinned,
    or a move making room failed otherwise)."""
    for medium, seen in zip(media, before):
        failure = getattr(medium, "last_failed_write", None)
        if failure is not None and failure is not seen:
            cause = failure.error
            name = errnos.errorcode.get(cause.errno, f"errno {cause.errno}") if cause.errno else "no errno"
            why = f"a write into the NVMe tier to make room failed: {name}, {cause.strerror or cause}, {failure.path!r}"
            error = WriteBackError(f"{what} ({why}); {outcome}", cause.errno, failure.path)
            error.__cause__ = cause
            return error
    return RuntimeError(f"{what} (every HBM slot pinned, or a move making room failed); {outcome}")
