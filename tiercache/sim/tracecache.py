"""A binary cache of parsed request traces, keyed by the trace's fingerprint.

``load_trace_cached(path)`` hashes the file (xxh3-128, ``trace_fingerprint``), and when
``<cache>/<fingerprint>-v2/`` holds the parsed arrays it loads them (``.npy`` files, no JSON
parsing at all); otherwise it parses the trace (``load_trace``), computes the replay's dense
ids and next uses once, and writes them there (to a temporary folder renamed into place, so
a reader never sees half a cache entry). A changed file has another fingerprint, so a stale
entry is never used. The arrays are what a replay holds anyway: ids (8 B per access), next
use (8 B), dense id (4 B), plus four 8-byte numbers per request and the block size.

The cache folder is ``$TIERCACHE_TRACE_CACHE``, or ``~/.cache/tiercache/traces``. Step traces
are not cached (they are read as before).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from tiercache.results import TraceKind

from .loader import Trace, load_trace
from .prep import dense_and_next_use
from .traces import FlatTrace, trace_fingerprint

__all__ = ["load_trace_cached", "default_cache_dir", "VERSION"]

VERSION = 2  # 2: the trace's block size is kept (version 1 entries are ignored: the loader wrote 512 back)
_ARRAYS = ("ids", "offsets", "timestamps", "input_lengths", "output_lengths", "dense", "next_use", "block_tokens")


def default_cache_dir() -> Path:
    """``$TIERCACHE_TRACE_CACHE`` or ``~/.cache/tiercache/traces``."""
    env = os.environ.get("TIERCACHE_TRACE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tiercache" / "traces"


def load_trace_cached(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Trace:
    """``load_trace(path)`` through the binary cache (see the module docstring).

    The returned trace carries ``dense`` and ``next_use``, so ``ReplayData.prepare`` computes
    nothing. A cache that cannot be written (read-only disk) is skipped, not an error.

    Raises:
        TraceError: as ``load_trace`` (unreadable or invalid trace).
    """
    name = os.fspath(path)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    entry = folder / f"{trace_fingerprint(name)}-v{VERSION}"
    if (entry / "ids.npy").exists():
        cached = _read(name, entry)
        if cached is not None:
            return cached
    trace = load_trace(name)
    if trace.kind is not TraceKind.REQUESTS:
        return trace
    dense, next_use, _ = dense_and_next_use(trace.ids)
    trace = Trace(trace.path, trace.kind, trace.fingerprint, trace.ids, trace.offsets, requests=trace.requests,
                  block_tokens=trace.block_tokens, dense=dense, next_use=next_use)
    _write(trace, folder, entry)
    return trace


def _read(name: str, entry: Path) -> Trace | None:
    """The cached trace, or None when the entry is incomplete or unreadable."""
    try:
        arrays = {key: np.load(entry / f"{key}.npy", allow_pickle=False) for key in _ARRAYS}
    except (OSError, ValueError):
        return None
    requests = FlatTrace(arrays["ids"], arrays["offsets"][:-1], arrays["timestamps"], arrays["input_lengths"],
                         arrays["output_lengths"])
    return Trace(name, TraceKind.REQUESTS, entry.name.rsplit("-v", 1)[0], arrays["ids"], arrays["offsets"],
                 requests=requests, block_tokens=int(arrays["block_tokens"][0]), dense=arrays["dense"], next_use=arrays["next_use"])


def _write(trace: Trace, folder: Path, entry: Path) -> None:
    """Writes the entry into a temporary folder and renames it into place (atomic)."""
    req = trace.requests
    arrays = {"ids": trace.ids, "offsets": trace.offsets, "timestamps": req.timestamps,
              "input_lengths": req.input_lengths, "output_lengths": req.output_lengths, "dense": trace.dense,
              "next_use": trace.next_use, "block_tokens": np.array([trace.block_tokens], dtype=np.int64)}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".partial-"))
        for key, value in arrays.items():
            np.save(tmp / f"{key}.npy", np.ascontiguousarray(value), allow_pickle=False)
        try:
            os.replace(tmp, entry)
        except OSError:  # another process wrote the entry first: theirs is the same
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        return
