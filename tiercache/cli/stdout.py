"""Standard output of the ``tiercache`` command: a write it refuses is told apart from every
other ``OSError``, so that a full disk under ``> file`` ends in one line, not a traceback.

A results file (``replay --out``) or report folder is written before the tables are
printed, so a refused write never loses one.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

__all__ = ["StdoutRefused", "guarded_stdout", "silence_stdout", "print_unless_refused"]


class StdoutRefused(OSError):
    """Standard output refused a write or a flush (``ENOSPC``, ``EIO``, ...; a reader that went
    away stays a ``BrokenPipeError``)."""


class _Guarded:
    """``stream`` whose ``write`` and ``flush`` raise ``StdoutRefused`` for an ``OSError``
    other than a broken pipe; everything else is the stream's own."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return _refused_as_such(self._stream.write, text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        _refused_as_such(self._stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _refused_as_such(call, *args):
    """``call(*args)``, an OSError other than a broken pipe raised as ``StdoutRefused``."""
    try:
        return call(*args)
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise StdoutRefused(exc.errno, exc.strerror) from None


@contextmanager
def guarded_stdout():
    """``sys.stdout`` guarded (``_Guarded``) inside the block; as it was after. Nothing is
    guarded when standard output was closed at start (``sys.stdout`` None: print writes
    nothing)."""
    stream = sys.stdout
    if stream is None:
        yield
        return
    sys.stdout = _Guarded(stream)
    try:
        yield
    finally:
        if isinstance(sys.stdout, _Guarded):
            sys.stdout = stream


def print_unless_refused(show) -> None:
    """Calls ``show`` (which prints); a standard output that refuses it (a closed pipe, a
    full disk) is silenced instead of raising, so that the error the caller is about to
    raise (a results file not written) is the one reported."""
    try:
        show()
        sys.stdout.flush()
    except (StdoutRefused, BrokenPipeError):
        silence_stdout()


def silence_stdout() -> None:
    """Points file descriptor 1 at ``/dev/null``, so that the interpreter's last flush of
    what is still buffered does not fail again (after a refused write or a closed pipe)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
