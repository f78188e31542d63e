"""Export to libCacheSim's ``oracleGeneral`` binary trace format.

Each access is one packed little-endian 24-byte record (struct ``<IQIq``)::

    uint32 clock_time         request time (ms for Mooncake traces, the step for step traces;
                              a time past 2**32 - 1 is refused, never renumbered)
    uint64 obj_id             block id
    uint32 obj_size           1 (count objects) or the block's bytes under a KV layout
    int64  next_access_vtime  index of the next access to the same id, -1 if none

``next_access_vtime`` is the 1-based position (in file order) of the next access to the
same id, as libCacheSim's own ``traceConv`` writes it ("reference count starts with 1"),
so tiercache's 0-based ``next_use`` index ``i`` is written as ``i + 1``. ``-1`` is
libCacheSim's "never again" (its reader maps it to an infinite reuse distance); tiercache's
``NO_NEXT_USE`` is translated to it on the way out. A step trace's records are its reads and
writes, and each one's next access is the one ``tiercache replay`` gives an offline policy
there (``prep.step_next_use``): the next *read* of the id before any later write of it, else
``-1``. The read before a write of its id is thus that copy's last use (the write supplies the
block again), and the write's own record carries the next read after it: libCacheSim, which
takes the write's record as a request, then holds exactly the next use the replay sets for a
cached id at a write (``DecodeReplay._write`` refreshes it, counting no access; an id evicted
before the write is stored anew with it), so a Belady run over the export plans with the
replay's future. (libCacheSim counts the write records as requests too; the replay counts
reads only.) Records are built as numpy structured arrays and written in chunks, so exporting
millions of accesses needs no Python per-record work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np

from tiercache.config import KVLayout
from tiercache.errors import UserError
from tiercache.policies.base import NO_NEXT_USE
from tiercache.results.outfile import replace_file_with
from tiercache.sim.loader import Trace, distinct_count, load_trace
from tiercache.sim.prep import step_next_use
from tiercache.sim.tracelines import record_line
from tiercache.sim.tracestats import request_source
from tiercache.sim.traces import next_use

__all__ = ["ORACLE_GENERAL_DTYPE", "write_oracle_general", "read_oracle_general", "export_oracle_general", "export_trace",
           "trace_layout", "ExportResult", "LIBCACHESIM_MIN_CAPACITY", "libcachesim_runs_at"]

#: The smallest cache each libCacheSim policy with fixed shares of the cache is run at by the
#: scripts that compare with it (``policy_zoo.py``, ``bench_replay.py``): below it a share rounds
#: to fewer blocks than the policy works with (S3-FIFO's and Clock2Q+'s 10% small queue under 2
#: blocks, W-TinyLFU's 1% window under 1) and it missed every access of the bundled traces
#: (measured; S3-FIFO aborts the process below 10 blocks).
LIBCACHESIM_MIN_CAPACITY = {"S3FIFO": 20, "Clock2QPlus": 20, "WTinyLFU": 100}


def libcachesim_runs_at(name: str, capacity: int) -> bool:
    """Whether libCacheSim's policy ``name`` (its class name: ``"S3FIFO"``) is run at a cache of
    ``capacity`` objects (``LIBCACHESIM_MIN_CAPACITY``)."""
    return capacity >= LIBCACHESIM_MIN_CAPACITY.get(name, 1)

#: One oracleGeneral record; numpy packs structured dtypes without padding (24 bytes).
ORACLE_GENERAL_DTYPE = np.dtype(
    [("clock_time", "<u4"), ("obj_id", "<u8"), ("obj_size", "<u4"), ("next_access_vtime", "<i8")]
)
_UINT32_MAX = (1 << 32) - 1
_CHUNK_RECORDS = 1 << 20  # 24 MiB per write: bounded memory, few syscalls


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote: record count, distinct blocks, the size field used."""

    records: int
    unique_blocks: int
    obj_size: int


def _as_uint32(values: np.ndarray | int, n: int, what: str) -> np.ndarray:
    """Broadcasts to ``n`` entries and checks the uint32 range (libCacheSim's field width)."""
    if isinstance(values, int) and n and not 0 <= values <= _UINT32_MAX:  # before numpy: any int size
        raise UserError(f"oracleGeneral: {what} must be in [0, 2**32), got {values}")
    arr = np.broadcast_to(np.asarray(values, dtype=np.int64), (n,))
    if n and (arr.min() < 0 or arr.max() > _UINT32_MAX):
        raise UserError(f"oracleGeneral: {what} must be in [0, 2**32), got range [{arr.min()}, {arr.max()}]")
    return arr


def write_oracle_general(
    path: str | os.PathLike, ids: np.ndarray, times: np.ndarray | int = 0, sizes: np.ndarray | int = 1,
    following: np.ndarray | None = None,
) -> int:
    """Writes accesses as an oracleGeneral trace; returns the number of records.

    Args:
        path: output file (replaced whole: a failed write leaves an earlier file as it was).
        ids: block ids in access order (non-negative int64).
        times: clock time of each access, or one value for all (uint32 range).
        sizes: object size of each access, or one value for all (1 to 2**32 - 1).
        following: each access's 0-based next use (``NO_NEXT_USE`` for none), aligned with
            ``ids``; default the next access of the same id (``traces.next_use``).

    Raises:
        UserError: a negative id, a time or size out of range, or an unwritable file.
    """
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) and ids.min() < 0:
        raise UserError("oracleGeneral: block ids must be non-negative")
    times_arr = _as_uint32(times, len(ids), "clock times")
    sizes_arr = _as_uint32(sizes, len(ids), "object sizes")
    if len(ids) and sizes_arr.min() < 1:
        raise UserError("oracleGeneral: object sizes must be >= 1 (libCacheSim skips size-0 requests)")
    nxt = next_use(ids) if following is None else np.array(following, dtype=np.int64)
    if len(nxt) != len(ids):
        raise ValueError(f"write_oracle_general: {len(nxt)} next uses for {len(ids)} ids")
    never = nxt == NO_NEXT_USE
    nxt += 1  # libCacheSim counts requests from 1
    nxt[never] = -1

    def write(name: str) -> None:
        with open(name, "wb") as handle:
            for start in range(0, len(ids), _CHUNK_RECORDS):
                stop = min(start + _CHUNK_RECORDS, len(ids))
                handle.write(_records(ids, times_arr, sizes_arr, nxt, start, stop).tobytes())

    replace_file_with(path, write, f"{os.fspath(path)} (oracleGeneral trace)")
    return len(ids)


def _records(ids, times, sizes, nxt, start: int, stop: int) -> np.ndarray:
    chunk = np.empty(stop - start, dtype=ORACLE_GENERAL_DTYPE)
    chunk["clock_time"] = times[start:stop]
    chunk["obj_id"] = ids[start:stop]
    chunk["obj_size"] = sizes[start:stop]
    chunk["next_access_vtime"] = nxt[start:stop]
    return chunk


def read_oracle_general(path: str | os.PathLike) -> np.ndarray:
    """Reads an oracleGeneral trace into a structured array (fields as ``ORACLE_GENERAL_DTYPE``).

    Raises:
        UserError: unreadable file or a size that is not a whole number of records.
    """
    name = os.fspath(path)
    try:
        size = os.path.getsize(name)
        if size % ORACLE_GENERAL_DTYPE.itemsize:
            raise UserError(f"{name}: {size} bytes is not a whole number of 24-byte oracleGeneral records")
        return np.fromfile(name, dtype=ORACLE_GENERAL_DTYPE)
    except OSError as exc:
        raise UserError(f"{name}: cannot read oracleGeneral trace: {exc.strerror or exc}") from None


def export_oracle_general(
    trace_path: str | os.PathLike, out_path: str | os.PathLike, layout: KVLayout | None = None
) -> ExportResult:
    """Exports a request trace (Mooncake, Bailian, kv-cache-tester) or a step trace to oracleGeneral.

    Request traces: one record per ``hash_ids`` entry, time = the request's timestamp in ms.
    Step traces: one record per read then per write of each record, time = the step, next
    access the next read before any write of the id (module docstring).
    With a ``layout`` every record's size is one block's bytes at the trace's block size,
    one layer's for a step trace (``trace_layout``); without, size is 1.

    Raises:
        TraceError: the input trace is malformed.
        UserError: the output cannot be written, a value overflows a field, or ``layout``
            does not fit the trace (``trace_layout``).
    """
    trace = load_trace(trace_path)
    return export_trace(trace, out_path, trace_layout(trace, layout))


def trace_layout(trace: Trace, layout: KVLayout | None) -> KVLayout | None:
    """``layout`` as one block of ``trace`` holds it, or None when ``layout`` is None.

    The one place that decides what a trace's block costs; every replay, compare and export
    of a trace with a layout goes through it, so that bytes, modeled seconds and capacities
    given as sizes count the same block:

    * a step trace's block is one layer's KV (``per_layer``): its ids are per-layer blocks
      (the live cache records ``layer_key(block, layer)``, the generators ``block * layers +
      layer``), so ``block_bytes`` is the whole model's divided by ``layers``;
    * a request trace's block (Mooncake, Bailian, kv-cache-tester) holds every layer.

    The block size is the trace's where it names one (every request trace: 512 tokens for
    Mooncake, 16 for Bailian, a kv-cache-tester ``block_size``; a step trace with a header);
    a step trace without a header keeps ``layout.block_tokens``.

    Raises:
        UserError: a per-layer layout for a request trace (its blocks hold every layer).
    """
    if layout is None:
        return None
    if trace.requests is not None and layout.per_layer:
        raise UserError(f"{trace.path}: a request trace's blocks hold every layer; a per-layer layout applies to "
                        "step traces with per-layer block ids")
    tokens = layout.block_tokens if trace.block_tokens is None else trace.block_tokens
    return replace(layout, block_tokens=tokens, per_layer=trace.requests is None)


def export_trace(trace: Trace, out_path: str | os.PathLike, layout: KVLayout | None = None) -> ExportResult:
    """Writes a loaded trace as oracleGeneral (records as ``export_oracle_general``).

    ``layout``, when given, sizes every record as one block of it, as given: the caller
    sets its block size (``trace_layout``).

    Raises:
        UserError: the output cannot be written, a value overflows a field, or a record's
            time does not fit the 32-bit clock time (``_check_times``: the message names the
            file and the record's line).
    """
    per_record = np.diff(trace.offsets)
    stamps = trace.requests.timestamps if trace.requests is not None else trace.steps.steps
    _check_times(trace, stamps, per_record)
    times = np.repeat(stamps, per_record)
    size = layout.block_bytes if layout else 1
    if trace.is_write is not None:
        following = step_next_use(next_use(trace.ids), trace.is_write)
    else:  # a request trace: from the trace cache, the next uses it already holds
        following = trace.next_use
    records = write_oracle_general(out_path, trace.ids, times, size, following)
    distinct = int(trace.dense.max()) + 1 if trace.dense is not None and len(trace.dense) else distinct_count(trace.ids)
    return ExportResult(records, distinct, size)


def _check_times(trace: Trace, stamps: np.ndarray, per_record: np.ndarray) -> None:
    """Refuses a trace with a record whose time does not fit oracleGeneral's uint32 clock
    time, before anything is written: a step trace's step (which its reader takes up to
    2**63 - 1), or a request trace's timestamp in ms. Times are written as given, never
    renumbered. Records without accesses write nothing and are not checked.

    Raises:
        UserError: naming the file and the 1-based line of the first such record (``file
            requests[i]`` in a kv-cache-tester workload), its value and why.
    """
    stamps = np.asarray(stamps, dtype=np.int64)
    over = np.flatnonzero(((stamps < 0) | (stamps > _UINT32_MAX)) & (per_record > 0))
    if not len(over):
        return
    index = int(over[0])
    if trace.steps is not None:
        header = 1 if trace.block_tokens is not None else 0  # a step trace's header is its first line
        where, what = f"{trace.path}:{record_line(trace.path, index + header)}", f"step {stamps[index]}"
    else:
        where, what = request_source(trace.path, index) or trace.path, f"timestamp {stamps[index]} ms"
    raise UserError(f"{where}: {what} does not fit oracleGeneral's 32-bit clock time, which must be in "
                    "[0, 2**32); the trace cannot be exported")
