"""A binary cache of parsed request traces, keyed by the trace's fingerprint.

``load_trace_cached(path)`` hashes the file (xxh3-128, ``trace_fingerprint``), and when
``<cache>/<fingerprint>-v5-<parser>/`` holds the parsed arrays (``<parser>``: a digest of the
parser's source, so a changed parser never reads an older one's entries) it loads them (``.npy`` files, no JSON
parsing at all); otherwise it parses the trace (``load_trace``), computes the replay's dense
ids and next uses once, and writes them there (to a temporary folder renamed into place, so
a reader never sees half a cache entry). A changed file has another fingerprint, so a stale
entry is never used. The arrays are what a replay holds anyway: ids (8 B per access), next
use (8 B), dense id (4 B), plus four 8-byte numbers per request and the block size.

Invariant: an entry named ``F`` holds the parse of file bytes whose digest is ``F``, which is
the fingerprint ``load_trace`` gives those bytes, so a trace has one fingerprint whether it
came from the cache or not. An entry is named by the fingerprint ``load_trace`` computed in
the same pass as its parse, and written only when that equals the digest looked up before
the parse: a file rewritten in between is returned as parsed but not cached.

kv-cache-tester workloads (a folder of conversations, or one conversation file) are read by
``load_trace`` directly, never cached: their fingerprint also covers the files' names, the
arrival seed and the gap, so no digest of the path's bytes taken before the parse names them.

An entry is checked before use, since the replay kernels trust its arrays (an offset or a
dense id out of range would make them read out of bounds): every array has its dtype and
length, offsets run from 0 to ``len(ids)`` without decreasing, dense ids lie in
``[0, len(ids))``, next uses are ``NO_NEXT_USE`` or accesses, token counts and the block
size are in range, and the xxh3-128 digest of the fingerprint the entry is filed under, the
cache version and all arrays, written with them, matches (so an entry edited or damaged in
place, even to values that pass the range checks, is caught, and so is an entry copied, synced
or linked under another trace's name: its digest binds it to its own). An entry that fails any
check is a cache miss: the trace is parsed again and the entry replaced (so is an entry written
before the digest covered the fingerprint).

The cache folder is ``$TIERCACHE_TRACE_CACHE``, or ``~/.cache/tiercache/traces``. Step traces
are not cached (they are read as before). Each write tidies the folder: temporary folders a
killed writer left (no live writer holds the lock a writer keeps in its folder; a folder
without one: older than ``ABANDONED_S``) and the trace's entries of other versions or parsers
go, then the least recently used entries (a hit renews an entry) while the entries take more
than ``$TIERCACHE_TRACE_CACHE_BYTES`` (default 16 GiB); live writers' folders are not counted.
"""

from __future__ import annotations

import fcntl
import functools
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

import tiercache
from tiercache.errors import ConfigError, TraceError
from tiercache.policies.base import NO_NEXT_USE
from tiercache.results import TraceKind
from tiercache.sizes import parse_size

from .loader import Trace, first_line_has_hash_ids, is_kvtester_workload, load_trace
from .prep import dense_and_next_use
from .traces import MAX_TOKENS, FlatTrace, refuse_special_file, trace_fingerprint

__all__ = ["load_trace_cached", "default_cache_dir", "VERSION"]

# 2: the trace's block size is kept (version 1 entries are ignored: the loader wrote 512 back);
# 3: a digest of the arrays is kept and checked (version 2 entries are ignored);
# 4: named by the parse's own fingerprint (a version 3 entry may hold a kv-cache-tester parse
#    under its file's digest, or the parse of other bytes than those it is named by);
# 5: the name also carries a digest of the parser's source (``_parser_tag``).
VERSION = 5
#: The modules whose code decides what a request trace parses to: an entry's name carries a
#: digest of their source, so a parser changed in any way (a fix that refuses what it used to
#: accept, say) never reads an entry an older parser wrote, with or without a VERSION bump.
_PARSER_MODULES = ("traces", "tracelines", "bulkparse", "fastscan", "loader", "prep", "tracecache", "kvtester", "kvfolder", "steptrace")
#: Seconds after which a temporary folder (``.partial-*``, ``.stale-*``) without a writer's
#: lock (``_hold``) counts as abandoned (its writer was killed) and the next write removes it;
#: one with the lock goes as soon as no live writer holds it.
ABANDONED_S = 3600
#: Bytes the cache's entries may take before a write removes the least recently used ones
#: (``$TIERCACHE_TRACE_CACHE_BYTES`` overrides it; the entry just written always stays).
DEFAULT_BUDGET_BYTES = 16 << 30
#: Each array of an entry and its dtype.
_DTYPES = {"ids": np.int64, "offsets": np.int64, "timestamps": np.int64, "input_lengths": np.int64,
           "output_lengths": np.int64, "dense": np.int32, "next_use": np.int64, "block_tokens": np.int64}
_ARRAYS = tuple(_DTYPES)
_DIGEST = "digest"
#: The largest block size an entry may record (tokens per block).
_MAX_BLOCK_TOKENS = (1 << 31) - 1


def default_cache_dir() -> Path:
    """``$TIERCACHE_TRACE_CACHE`` or ``~/.cache/tiercache/traces``."""
    env = os.environ.get("TIERCACHE_TRACE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tiercache" / "traces"


def load_trace_cached(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Trace:
    """``load_trace(path)`` through the binary cache (see the module docstring).

    The returned trace is the one ``load_trace(path)`` gives, fingerprint included, from the
    cache or not; a cached one carries ``dense`` and ``next_use``, so ``ReplayData.prepare``
    computes nothing. A kv-cache-tester workload (a folder) and a step trace bypass the cache.
    A cache that cannot be written (read-only disk) is skipped, not an error; an entry that
    fails its checks (module docstring) is parsed again and replaced.

    Raises:
        TraceError: as ``load_trace`` (unreadable or invalid trace).
        ConfigError: ``$TIERCACHE_TRACE_CACHE_BYTES`` is no byte size (a trace the cache
            would hold only).
    """
    name = os.fspath(path)
    refuse_special_file(name)
    # kv-cache-tester: fingerprinted with names, seed and gap; a step trace (a first line without
    # hash_ids) is never cached, so not hashed for a lookup either
    if is_kvtester_workload(name) or first_line_has_hash_ids(name) is False:
        return load_trace(name)
    _budget()  # a bad $TIERCACHE_TRACE_CACHE_BYTES is refused first, hit or miss, before the parse
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    looked_up = _file_fingerprint(name)
    if looked_up is not None:
        cached = _read(name, _entry(folder, looked_up), looked_up)
        if cached is not None:
            return cached
    trace = load_trace(name)
    if trace.kind is not TraceKind.REQUESTS:
        return trace
    dense, next_use, _ = dense_and_next_use(trace.ids)
    trace = Trace(trace.path, trace.kind, trace.fingerprint, trace.ids, trace.offsets, requests=trace.requests,
                  block_tokens=trace.block_tokens, dense=dense, next_use=next_use)
    if trace.fingerprint == looked_up:  # else the file changed during the parse: not cached (module docstring)
        _write(trace, folder, _entry(folder, trace.fingerprint))
    return trace


def _file_fingerprint(name: str) -> str | None:
    """The digest of the file's bytes, or None when it cannot be read (``load_trace`` then
    reports the error in its own words)."""
    try:
        return trace_fingerprint(name)
    except TraceError:
        return None


def _entry(folder: Path, fingerprint: str) -> Path:
    """The entry folder of the trace whose fingerprint is ``fingerprint``, for this parser."""
    return folder / _entry_name(fingerprint)


def _entry_name(fingerprint: str) -> str:
    return f"{fingerprint}-v{VERSION}-{_parser_tag()}"


@functools.cache
def _parser_tag() -> str:
    """A digest of the parser modules' source (``_PARSER_MODULES``): 16 hex digits."""
    digest = xxhash.xxh3_64()
    package = Path(__file__).parent
    for module in _PARSER_MODULES:
        try:
            digest.update((package / f"{module}.py").read_bytes())
        except OSError:  # installed without sources: the version alone
            digest.update(f"{module}: no source, tiercache {tiercache.__version__}".encode())
    return digest.hexdigest()


def _read(name: str, entry: Path, fingerprint: str) -> Trace | None:
    """The cached trace (fingerprint ``fingerprint``, the entry's), or None when the entry is
    absent, incomplete, unreadable or fails a check.

    Any ``Exception`` while loading counts as damage: numpy's ``.npy`` header parser alone
    can raise ``ValueError``, ``MemoryError`` (a huge claimed shape), ``tokenize.TokenError``
    or ``SyntaxError``. ``KeyboardInterrupt`` and ``SystemExit`` are not ``Exception`` s, so
    they still stop the load.
    """
    if not entry.exists():
        return None
    try:
        arrays = {key: np.load(entry / f"{key}.npy", allow_pickle=False) for key in (*_ARRAYS, _DIGEST)}
    except Exception:  # noqa: BLE001 - any damage is a miss (a bad header alone raises MemoryError, TokenError, ...)
        return None
    if not _consistent(arrays) or arrays[_DIGEST].tobytes() != _digest(fingerprint, arrays):
        return None
    try:
        os.utime(entry)  # used now: the last the budget removes (``_tidy``)
    except OSError:
        pass
    requests = FlatTrace(arrays["ids"], arrays["offsets"][:-1], arrays["timestamps"], arrays["input_lengths"],
                         arrays["output_lengths"])
    return Trace(name, TraceKind.REQUESTS, fingerprint, arrays["ids"], arrays["offsets"], requests=requests,
                 block_tokens=int(arrays["block_tokens"][0]), dense=arrays["dense"], next_use=arrays["next_use"])


def _consistent(arrays: dict[str, np.ndarray]) -> bool:
    """Whether an entry's arrays have the shapes, dtypes and ranges ``Trace`` and the replay
    kernels rely on (see the module docstring); cheap vectorised checks, no digest."""
    if any(arrays[key].dtype != dtype or arrays[key].ndim != 1 for key, dtype in _DTYPES.items()):
        return False
    ids, offsets, dense, nu = arrays["ids"], arrays["offsets"], arrays["dense"], arrays["next_use"]
    n, requests = len(ids), len(offsets) - 1
    if n == 0 or requests < 1 or len(dense) != n or len(nu) != n or len(arrays["block_tokens"]) != 1:
        return False
    if any(len(arrays[key]) != requests for key in ("timestamps", "input_lengths", "output_lengths")):
        return False
    if offsets[0] != 0 or offsets[-1] != n or not np.all(offsets[1:] >= offsets[:-1]):
        return False
    tokens = np.concatenate((arrays["input_lengths"], arrays["output_lengths"]))
    return bool(ids.min() >= 0 and arrays["timestamps"].min() >= 0 and tokens.min() >= 0 and tokens.max() <= MAX_TOKENS
                and 1 <= arrays["block_tokens"][0] <= _MAX_BLOCK_TOKENS and dense.min() >= 0 and dense.max() < n
                and np.all((nu == NO_NEXT_USE) | ((nu > 0) & (nu < n))))


def _digest(fingerprint: str, arrays: dict[str, np.ndarray]) -> bytes:
    """The xxh3-128 digest of an entry: the name it is filed under (fingerprint, ``VERSION``
    and parser tag: binding the entry to its name) first, then each array's name, dtype,
    length and bytes."""
    digest = xxhash.xxh3_128()
    digest.update(f"{_entry_name(fingerprint)}\0".encode())
    for key in _ARRAYS:
        value = np.ascontiguousarray(arrays[key])
        digest.update(f"{key}:{value.dtype.str}:{value.shape}".encode())
        digest.update(memoryview(value).cast("B"))
    return digest.digest()


def _write(trace: Trace, folder: Path, entry: Path) -> None:
    """Writes the entry into a temporary folder and renames it into place (atomic); an entry
    already there (one that failed its checks) is moved aside and removed first.

    An OSError (a read-only or full disk) skips the cache. The temporary folder is the
    entry after the rename, and removed on any failure; while it is written its writer holds
    a lock in it (``_hold``), so one a killed writer left behind is removed by the next write
    (``_tidy``), which also keeps the cache within its budget.
    """
    req = trace.requests
    arrays = {"ids": trace.ids, "offsets": trace.offsets, "timestamps": req.timestamps,
              "input_lengths": req.input_lengths, "output_lengths": req.output_lengths, "dense": trace.dense,
              "next_use": trace.next_use, "block_tokens": np.array([trace.block_tokens], dtype=np.int64)}
    arrays = {key: np.ascontiguousarray(value, dtype=_DTYPES[key]) for key, value in arrays.items()}
    arrays[_DIGEST] = np.frombuffer(_digest(trace.fingerprint, arrays), dtype=np.uint8)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".partial-"))
    except OSError:
        return
    renamed, lock = False, _hold(tmp)
    try:
        for key, value in arrays.items():
            np.save(tmp / f"{key}.npy", value, allow_pickle=False)
        _discard(entry, folder)
        _release(tmp, lock)
        lock = None
        os.replace(tmp, entry)
        renamed = True
    except OSError:  # a full disk; or another process wrote the entry first: theirs is the same
        pass
    finally:
        _release(tmp, lock)
        if not renamed:
            shutil.rmtree(tmp, ignore_errors=True)
    if renamed:
        _tidy(folder, entry, trace.fingerprint)


def _tidy(folder: Path, kept: Path, fingerprint: str) -> None:
    """After a write: removes temporary folders abandoned by killed writers (``_abandoned``:
    no live writer holds their lock, or older than ``ABANDONED_S``), the trace's entries of other versions or parsers (never read again),
    entries of the first version (``_FIRST_ENTRY``: no reader reads them), then the least
    recently used entries while the cache is over its budget (``_budget``), never ``kept``;
    nothing else is touched (``_TEMPORARY``, ``_ENTRY``: the cache folder may hold unrelated
    files). Best effort: an entry another process removes or uses meanwhile is
    skipped (a reader that loses its entry parses the trace again)."""
    now, entries = time.time(), []
    for path in _listing(folder):  # only what this module names: the folder may hold other things
        if not any(pattern.fullmatch(path.name) for pattern in (_TEMPORARY, _ENTRY, _FIRST_ENTRY)):
            continue
        if _TEMPORARY.fullmatch(path.name):
            if _abandoned(path, now - _mtime(path)):
                shutil.rmtree(path, ignore_errors=True)
        elif _FIRST_ENTRY.fullmatch(path.name) or (path != kept and path.name.startswith(f"{fingerprint}-v")):
            _discard(path, folder)
        elif path != kept and path.is_dir() and not path.is_symlink():
            entries.append((_mtime(path), path))
    total, budget = _size(kept) + sum(_size(path) for _, path in entries), _budget()
    for _, path in sorted(entries):
        if total <= budget:
            break
        total -= _size(path)
        _discard(path, folder)


#: Names this module gives: temporary folders (``tempfile.mkdtemp``'s 8 characters after the
#: prefix; a pid before them in some written in December 2026) and entries (``_entry_name``;
#: older versions without the parser tag too).
_TEMPORARY = re.compile(r"\.(partial|stale)-(?:[0-9]{1,7}-)?[a-z0-9_]{8}")
_ENTRY = re.compile(r"xxh3-128:[0-9a-f]{32}-v[0-9]+(-[0-9a-f]{16})?")
#: Entries of the first version (blake2b fingerprints, with no scheme prefix): never read again.
_FIRST_ENTRY = re.compile(r"[0-9a-f]{32}-v1")


#: The file in a temporary folder its writer holds an ``flock`` on while it writes there.
_WRITER = ".writer"


def _hold(tmp: Path) -> int | None:
    """Marks ``tmp`` as being written: an ``flock`` held on ``tmp/.writer`` (the kernel drops
    it when the writer dies, whatever pid namespace or host it ran in); the open descriptor,
    or None where no lock can be taken (the folder then keeps the hour, ``_abandoned``). The
    file is locked under another name first, so ``.writer`` is never there unlocked."""
    fresh = tmp / f"{_WRITER}-new"
    try:
        fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(fresh, tmp / _WRITER)
    except OSError:
        os.close(fd)
        fresh.unlink(missing_ok=True)
        return None
    return fd


def _release(tmp: Path, fd: int | None) -> None:
    """Takes the writer's lock file out of ``tmp`` (before it becomes an entry) and closes it."""
    if fd is None:
        return
    try:
        os.unlink(tmp / _WRITER)
    except OSError:
        pass
    os.close(fd)


def _abandoned(path: Path, age: float) -> bool:
    """Whether the temporary folder ``path``, ``age`` seconds old, was left by a killed writer:
    its ``.writer`` can be locked (no live writer holds it: ``_hold``), or, without one (an
    older version's folder, a writer between its last write and the rename, a ``.stale-*``
    folder), it is older than ``ABANDONED_S``."""
    try:
        fd = os.open(path / _WRITER, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return age > ABANDONED_S
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: a live writer holds it
        return False
    finally:
        os.close(fd)
    return True


def _listing(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return time.time()


def _size(entry: Path) -> int:
    """Bytes of an entry's files (0 for what cannot be read)."""
    total = 0
    for file in _listing(entry):
        try:
            total += file.lstat().st_size
        except OSError:
            pass
    return total


_ZERO_BYTES = re.compile(r"0+(\.0*)?\s*([kmgtp]i?)?b?", re.IGNORECASE)


def _budget() -> int:
    """``$TIERCACHE_TRACE_CACHE_BYTES`` (a byte size as ``--capacity`` spells one: ``1GiB``,
    ``500000000``; ``0`` keeps only the entry just written), ``DEFAULT_BUDGET_BYTES`` when
    unset or empty.

    Raises:
        ConfigError: any other value, naming the variable (never read as the default).
    """
    value = os.environ.get("TIERCACHE_TRACE_CACHE_BYTES", "").strip()
    if not value:
        return DEFAULT_BUDGET_BYTES
    if _ZERO_BYTES.fullmatch(value):
        return 0
    try:
        return parse_size(value, "$TIERCACHE_TRACE_CACHE_BYTES")
    except ConfigError:
        raise ConfigError(f"$TIERCACHE_TRACE_CACHE_BYTES: {value!r} is not a byte size (write a number of bytes, or "
                          "one with a unit: 500MB, 16GiB)") from None


def _discard(entry: Path, folder: Path) -> None:
    """Removes a bad entry: renamed aside first (one atomic step, so no reader sees it half
    deleted), then deleted. ``os.replace`` cannot replace a folder that holds files."""
    if not entry.exists() and not entry.is_symlink():
        return
    stale = Path(tempfile.mkdtemp(dir=folder, prefix=".stale-"))
    try:
        os.replace(entry, stale / "entry")
    except OSError:
        pass  # another process moved it first
    shutil.rmtree(stale, ignore_errors=True)
