"""User-facing errors. The CLI prints their message (no traceback) and exits non-zero."""

from __future__ import annotations

__all__ = ["UserError", "TraceError", "ConfigError", "out_of_memory"]


class UserError(ValueError):
    """Bad input from the user: an option, a file, a value. The message says what and where."""


class ConfigError(UserError):
    """A configuration value is invalid; the message names the field and the value."""


class TraceError(UserError):
    """A trace file is malformed; the message names the file and the 1-based line."""

    def __init__(self, path: str, line: int | None, message: str) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")
        self.path = path
        self.line = line


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a MemoryError, or a SystemError raised while one was handled (numba,
    out of memory while it loads a cached kernel, can end that way)."""
    return isinstance(exc, MemoryError) or (isinstance(exc, SystemError) and isinstance(exc.__context__, MemoryError))
