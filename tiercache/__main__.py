"""``python -m tiercache`` and the ``tiercache`` console script (``run``): the command
(``tiercache.cli.main``), exiting with its status.

The one module outside ``tiercache/cli/`` that imports the CLI (README "Import rule"). It
imports it inside ``run``, so that running out of memory while the CLI's modules load (numba
and llvmlite among them) ends in the one line any later ``MemoryError`` ends in, not in a
traceback.
"""

from __future__ import annotations

import sys


def run() -> int:
    """Imports and runs ``tiercache.cli.main``; returns its exit code (1, with one line on
    stderr, when memory runs out while the CLI loads)."""
    from tiercache.errors import out_of_memory  # no numba, no numpy: the lowest level

    try:
        from tiercache.cli import main
    except (MemoryError, SystemError, OSError, ImportError) as exc:
        unmapped = _unmapped_library(exc)
        if not (out_of_memory(exc) or unmapped):
            raise
        why = f" ({unmapped})" if unmapped else ""
        print(f"tiercache: error: out of memory while loading{why}: this needs more than the machine or the "
              "process's memory limit allows", file=sys.stderr)
        return 1
    return main()


def _unmapped_library(exc: BaseException) -> str | None:
    """The loader's message when ``exc`` (or an error it was raised while handling) is a shared
    library that could not be mapped into memory (llvmlite's as an OSError, numpy's OpenBLAS
    as an ImportError, under ``ulimit -v``), else None."""
    while exc is not None:
        lines = [line for line in str(exc).splitlines() if "failed to map segment" in line]
        if isinstance(exc, (OSError, ImportError)) and lines:
            return lines[0].removeprefix("Original error was: ").strip()
        exc = exc.__context__
    return None


if __name__ == "__main__":
    sys.exit(run())
