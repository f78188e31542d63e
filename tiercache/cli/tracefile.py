"""Reading the trace a command works on: through the binary trace cache, saying so when it is large.

Every command that reads a whole trace (``replay``, ``compare``, ``trace inspect``, ``trace
export``, a fleet replay) reads it with ``read_trace``: a request trace file goes through the
binary cache (``tiercache.sim.tracecache``: its parsed arrays, dense ids and next uses, filed
under the digest of its bytes), so a second command on the same file skips the JSON parse and
the replay's preparation. ``--no-trace-cache`` (each of those commands) reads it without the
cache, writing nothing; step traces and kv-cache-tester workloads are never
cached. The cache's folder is ``$TIERCACHE_TRACE_CACHE`` (default
``~/.cache/tiercache/traces``) and it keeps within ``$TIERCACHE_TRACE_CACHE_BYTES``
(default 16 GiB), least recently used entries going first.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..sim.loader import Trace, load_trace
from ..sim.tracecache import default_cache_dir, load_trace_cached

__all__ = ["read_trace", "LARGE_TRACE_BYTES"]

#: A trace file at least this large is announced on stderr while it is read (with progress on,
#: on a terminal): parsing it takes seconds, during which no bar moves.
LARGE_TRACE_BYTES = 256 << 20
#: Back to the start of the line, and erase it (ANSI), as tqdm clears its bars.
_CLEAR_LINE = "\r\x1b[K"


def read_trace(path: str, cached: bool = True, progress: bool = False) -> Trace:
    """The trace at ``path``, as ``load_trace`` gives it (fingerprint included).

    Args:
        path: a trace file, or a kv-cache-tester folder.
        cached: read through the binary trace cache (``load_trace_cached``); False, or no
            cache folder (``_cache_folder``), reads the file alone and writes nothing.
        progress: on a terminal, show a status line on stderr while a trace of
            ``LARGE_TRACE_BYTES`` or more is read (cleared when the read ends, so an error
            stays one line), then how long it took.

    Raises:
        TraceError: as ``load_trace`` (unreadable or invalid trace; file and line named).
    """
    size = _file_size(path)
    announce = progress and size >= LARGE_TRACE_BYTES and sys.stderr.isatty()
    if announce:  # a status line, cleared when the read ends (an error stays one line)
        print(f"tiercache: reading {path} ({size / 2**30:.2f} GiB)...", end="", file=sys.stderr, flush=True)
    started = time.perf_counter()
    folder = _cache_folder() if cached else None
    try:
        trace = load_trace_cached(path, folder) if folder is not None else load_trace(path)
    finally:
        if announce:
            print(_CLEAR_LINE, end="", file=sys.stderr, flush=True)
    if announce:
        print(f"tiercache: read {len(trace.ids):,} block accesses in {time.perf_counter() - started:.1f} s",
              file=sys.stderr, flush=True)
    return trace


def _cache_folder() -> Path | None:
    """``$TIERCACHE_TRACE_CACHE`` as given, else ``~/.cache/tiercache/traces`` where the home
    directory is known (an absolute path, ``$HOME`` not set empty); None where it is not,
    rather than a folder ``~`` made in the working directory, ``/.cache``, or an error."""
    if os.environ.get("TIERCACHE_TRACE_CACHE"):
        return default_cache_dir()
    if os.environ.get("HOME") == "":  # Path.home() would be "/": not a home directory
        return None
    try:
        folder = default_cache_dir()
    except RuntimeError:  # Path.home(): "Could not determine home directory"
        return None
    return folder if folder.is_absolute() else None


def _file_size(path: str) -> int:
    """The size of a regular file at ``path``; 0 for anything else (``load_trace`` reports it)."""
    try:
        return os.path.getsize(path) if os.path.isfile(path) else 0
    except OSError:
        return 0
