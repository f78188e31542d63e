"""Step traces: which KV blocks each decode step reads and writes, per layer.

A step trace records the block traffic of one long sequence being decoded (recorded from a
live run, or synthesized by ``tiercache.sim.synth``). It is JSONL, one record per line::

    {"step": 0, "layer": 0, "read": [], "write": [0, 1, 2, 3]}
    {"step": 1, "layer": 0, "read": [0, 1, 2, 3], "write": []}
    {"step": 1, "layer": 1, "read": [0, 1, 2, 3], "write": []}

A step trace names its block size in a first header record, ``{"block_tokens": 16}``
(tokens per block; written by the generators and by recording). Files written before the
header existed have none: a replay that turns blocks into bytes then needs the size given
(``tiercache replay --block-tokens``).

Fields of a step record (all required; other fields are ignored, for forward compatibility,
except the header's ``block_tokens``: a header is allowed only once, alone on the first line):

* ``step``: decode step, a non-negative integer. Steps are non-decreasing through the file;
  one step may span several records (one per layer, or several per layer).
* ``layer``: layer index, a non-negative integer. Records of one step need not be sorted
  by layer; the file order is the order the accesses happened.
* ``read``: ids of the blocks the step's attention reads at this layer, in read order.
* ``write``: ids of the blocks the step stores at this layer (a block that just filled,
  or a prefill's blocks), in write order. Writes happen after the record's reads.

Optional fields, written by the live decode cache (``tiercache.TieredKVCache(record=...)``)
so that a replay makes exactly its decisions (``tiercache.core.decode.StepDriver``); absent
fields take the defaults shown, and a trace without them replays as before:

* ``in_place`` (false): the reads are served where the blocks lie (exact attention streams
  the whole sequence through a window) instead of being promoted to the top tier.
* ``candidates`` ([]): ids ranked right after a sparse selection (for prefetch policies).
* ``ahead`` ([]): ids the next layer reads first (for prefetch policies).
* ``hold`` ([]): ids a live sequence holds from now on (after this record's writes): they
  may move down the hierarchy but never leave it.
* ``release`` ([]): ids a sequence stops holding (it was freed), before this record's reads.
* ``resident`` ({}): blocks already stored when the run began, by tier name (``{"nvme": [3,
  4]}``): those a cache reopened on a closed cache's path adopted. Allowed only in the
  trace's leading records, each listing nothing else (no read, write or other field), an id
  in one tier of one of them at most; a replay places them before the first step without
  counting or charging anything (``decode_replay.place_resident``).

With any optional field present, the record's reads and writes go through the decode step
protocol: wait for earlier moves, reference and read, plan and start prefetches (with
``tiercache replay --prefetch``), then write and hold.

Block ids are integers in ``[0, 2**63)`` naming stored blocks. Ids are not interpreted:
when blocks are per layer, every layer's copy of a block must have its own id (the
synthesizers use ``block * layers + layer``). Within one list ids are distinct (the
reader rejects repeats, since policies take each id at most once per batch).

As a flat object stream (for ``inspect``, libCacheSim export and object-semantics replay)
each record contributes its reads then its writes, in list order.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np

from tiercache.config import TIER_NAMES
from tiercache.errors import TraceError
from tiercache.sim.tracelines import _shown as shown_value
from tiercache.sim.traces import id_list_field, int_field, iter_json_objects, write_jsonl

__all__ = ["StepRecord", "DecodeFields", "DECODE_FIELDS", "RESIDENT_FIELD", "Resident", "FlatSteps", "iter_steps", "steps_from_objects", "load_flat_steps", "flat_steps", "write_steps",
           "step_json", "is_header", "header_block_tokens", "HEADER_FIELD", "MAX_BLOCK_TOKENS"]

#: The field of a step trace's header record.
HEADER_FIELD = "block_tokens"
#: The largest block size (tokens) a trace may name: a step header's ``block_tokens`` or a
#: kv-cache-tester ``block_size``. Below 2**31, so tokens = blocks x block size stays far
#: inside int64 for any trace (replay multiplies them) and a block's bytes fit int64.
MAX_BLOCK_TOKENS = (1 << 31) - 1
#: The optional field of a leading record that lists blocks stored before the run, by tier.
RESIDENT_FIELD = "resident"
#: A ``resident`` field as read: (tier name, ids) pairs, in the file's order.
Resident = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One (step, layer) record.

    Invariants: ``step``, ``layer`` non-negative; ids in ``[0, 2**63)``, distinct within
    ``read`` and within ``write``; ``line`` is the 1-based line read from (0 if synthesized);
    a record with ``resident`` has nothing else (its read and write empty or left out, no
    other decode field).
    """

    step: int
    layer: int
    read: tuple[int, ...]
    write: tuple[int, ...]
    line: int = 0
    in_place: bool = False
    candidates: tuple[int, ...] = ()
    ahead: tuple[int, ...] = ()
    hold: tuple[int, ...] = ()
    release: tuple[int, ...] = ()
    resident: Resident = ()

    @property
    def decode_fields(self) -> "DecodeFields | None":
        """The record's optional decode fields, or None when it has none."""
        if not (self.in_place or self.candidates or self.ahead or self.hold or self.release or self.resident):
            return None
        return DecodeFields(self.in_place, self.candidates, self.ahead, self.hold, self.release, self.resident)


#: The optional fields of a step record, in the order ``step_json`` writes them.
DECODE_FIELDS = ("in_place", "candidates", "ahead", "hold", "release")


@dataclass(frozen=True, slots=True)
class DecodeFields:
    """The optional decode fields of one record (see the module docstring)."""

    in_place: bool = False
    candidates: tuple[int, ...] = ()
    ahead: tuple[int, ...] = ()
    hold: tuple[int, ...] = ()
    release: tuple[int, ...] = ()
    resident: Resident = ()


@dataclass(frozen=True)
class FlatSteps:
    """A step trace as arrays, in the flat object order (reads, then writes, per record).

    Invariants: record ``r`` owns ``ids[offsets[r]:offsets[r + 1]]`` (the last one runs to
    ``len(ids)``); ``is_write`` is aligned with ``ids``; ``steps`` and ``layers`` hold one
    entry per record and ``steps`` is non-decreasing.
    """

    ids: np.ndarray
    is_write: np.ndarray
    offsets: np.ndarray
    steps: np.ndarray
    layers: np.ndarray
    decode: dict[int, DecodeFields] | None = None  # record index -> its optional fields

    @property
    def num_records(self) -> int:
        return len(self.offsets)


def is_header(obj: dict) -> bool:
    """True for a step trace's header record (a ``block_tokens`` field and no ``step``)."""
    return HEADER_FIELD in obj and "step" not in obj


def header_block_tokens(name: str, line: int, obj: dict) -> int:
    """The block size a header record names.

    Raises:
        TraceError: not an integer in ``[1, MAX_BLOCK_TOKENS]``.
    """
    if HEADER_FIELD not in obj:
        raise TraceError(name, line, f"missing field {HEADER_FIELD!r}")
    value = obj[HEADER_FIELD]
    if type(value) is not int or not 1 <= value <= MAX_BLOCK_TOKENS:  # bool is not a count
        shown = shown_value(name, line, value, (HEADER_FIELD,))  # the file's digits, not orjson's float
        shown = shown if len(shown) <= 40 else f"an integer of {len(shown)} digits"
        raise TraceError(name, line, f"header: {HEADER_FIELD} must be an integer in [1, 2**31), got {shown}")
    return value


def _distinct(name: str, line: int, field: str, ids: list[int]) -> list[int]:
    """Rejects a repeated id within one list (the message names it)."""
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        for value in ids:
            if value in seen:
                raise TraceError(name, line, f"{field} lists block {value} more than once")
            seen.add(value)
    return ids


def _refuse_header(name: str, line: int, obj: dict) -> None:
    """Refuses a header where a step record must be: a header line after the first, or a line
    with both a header's ``block_tokens`` and a record's ``step`` (the size would be ignored).

    Raises:
        TraceError: naming the line and saying the header is misplaced.
    """
    if "step" in obj:
        raise TraceError(name, line, f'a line with both "{HEADER_FIELD}" and "step": the {{"{HEADER_FIELD}": N}} header '
                         "is a line of its own, the first, and a step record has no block_tokens")
    raise TraceError(name, line, f'a {{"{HEADER_FIELD}": N}} header is allowed only once, on the first line')


def _record(name: str, line: int, obj: dict, last_step: int) -> StepRecord:
    if HEADER_FIELD in obj:  # the first line's header was taken off before (``_skip_header``)
        _refuse_header(name, line, obj)
    step = int_field(name, line, obj, "step")
    if step < last_step:
        raise TraceError(name, line, f"step {step} is before the previous record's step {last_step} (steps must not decrease)")
    layer = int_field(name, line, obj, "layer")
    if RESIDENT_FIELD in obj:  # its read and write may be left out: it lists nothing else
        accesses = [i for field in ("read", "write") if field in obj for i in id_list_field(name, line, obj, field)]
        return _resident_record(name, line, obj, step, layer, accesses)
    read = _distinct(name, line, "read", id_list_field(name, line, obj, "read"))
    write = _distinct(name, line, "write", id_list_field(name, line, obj, "write"))
    if not any(field in obj for field in DECODE_FIELDS):
        return StepRecord(step, layer, tuple(read), tuple(write), line)
    in_place = obj.get("in_place", False)
    if type(in_place) is not bool:
        raise TraceError(name, line, f"field 'in_place' must be true or false, got {in_place!r}")
    lists = {field: tuple(_distinct(name, line, field, id_list_field(name, line, obj, field))) if field in obj else ()
             for field in DECODE_FIELDS[1:]}
    return StepRecord(step, layer, tuple(read), tuple(write), line, in_place, **lists)


def _resident_record(name: str, line: int, obj: dict, step: int, layer: int, accesses: list[int]) -> StepRecord:
    """A record placing blocks stored before the run (``resident``), which lists nothing else.

    Raises:
        TraceError: the record also reads, writes or has another decode field; ``resident``
            is not an object of tier names to id lists; an id repeated in one list (one in two
            lists, or records, is ``_check_placed``'s).
    """
    if accesses or any(field in obj for field in DECODE_FIELDS):
        raise TraceError(name, line, f"a record with {RESIDENT_FIELD!r} lists nothing else: its read and write are "
                         "empty and it has no other decode field")
    value = obj[RESIDENT_FIELD]
    if type(value) is not dict:
        raise TraceError(name, line, f"field {RESIDENT_FIELD!r} must be an object of tier name -> block ids "
                         f'(e.g. {{"nvme": [3, 4]}}), got {type(value).__name__}')
    placed: list[tuple[str, tuple[int, ...]]] = []
    for tier, ids in value.items():
        if tier not in TIER_NAMES:
            raise TraceError(name, line, f"{RESIDENT_FIELD}: unknown tier {tier!r} (one of {', '.join(TIER_NAMES)})")
        field = f"{RESIDENT_FIELD}.{tier}"
        placed.append((tier, tuple(_distinct(name, line, field, id_list_field(name, line, {field: ids}, field)))))
    return StepRecord(step, layer, (), (), line, resident=tuple(placed))


def _check_placed(name: str, record: StepRecord, placing: bool, seen: set[int]) -> bool:
    """Checks a record's ``resident`` against the records before it: only leading records
    place blocks (``placing``: every record so far did), each block once (``seen``: the ids
    placed so far, which this record's are added to). Returns whether records still place.

    Raises:
        TraceError: ``resident`` after a record that does not place, or a block placed twice.
    """
    if not record.resident:
        return False
    if not placing:
        raise TraceError(name, record.line, f"{RESIDENT_FIELD!r} is allowed only in the trace's leading records, "
                         "before any record that reads, writes, holds or releases a block")
    for _, ids in record.resident:
        twice = seen.intersection(ids)
        if twice:
            raise TraceError(name, record.line, f"{RESIDENT_FIELD} places block {min(twice)} twice (a block lies in one tier)")
        seen.update(ids)
    return True


def iter_steps(path: str | os.PathLike) -> Iterator[StepRecord]:
    """Streams and validates the records of a step trace, in file order.

    Raises:
        TraceError: unreadable file, malformed line, missing or invalid field, a repeated
            id within a list, a decreasing step, or a file without any record.
    """
    name = os.fspath(path)
    return steps_from_objects(name, _skip_header(name, iter_json_objects(name)))


def _skip_header(name: str, objects: Iterator[tuple[int, dict[str, Any]]]) -> Iterator[tuple[int, dict[str, Any]]]:
    """The records after a header (validated), or all of them without one."""
    first = next(objects, None)
    if first is None:
        return iter(())
    if is_header(first[1]):
        header_block_tokens(name, *first)
        return objects
    return itertools.chain([first], objects)


def steps_from_objects(name: str, objects: Iterable[tuple[int, dict[str, Any]]]) -> Iterator[StepRecord]:
    """Validated step records of ``objects`` (``(line, object)`` read from file ``name``).

    Raises:
        TraceError: as ``iter_steps``.
    """
    last_step = 0
    count = 0
    placing, placed = True, set()
    for line, obj in objects:
        record = _record(name, line, obj, last_step)
        if placing or record.resident:
            placing = _check_placed(name, record, placing, placed)
            placed = placed if placing else set()  # held only while records place blocks
        last_step = record.step
        count += 1
        yield record
    if count == 0:
        raise TraceError(name, None, "no step records: the trace is empty")


def load_flat_steps(path: str | os.PathLike) -> FlatSteps:
    """Reads a step trace once into flat arrays (reads then writes of each record).

    Raises:
        TraceError: as ``iter_steps``.
    """
    name = os.fspath(path)
    return flat_steps(name, _skip_header(name, iter_json_objects(name)))


def flat_steps(name: str, objects: Iterable[tuple[int, dict[str, Any]]]) -> FlatSteps:
    """Flat arrays of the step records ``objects`` (``(line, object)`` of file ``name``).

    Raises:
        TraceError: as ``iter_steps``.
    """
    chunks: list[tuple[int, ...]] = []
    meta: list[tuple[int, int, int, int]] = []
    decode: dict[int, DecodeFields] = {}
    for rec in steps_from_objects(name, objects):
        fields = rec.decode_fields
        if fields is not None:
            decode[len(meta)] = fields
        meta.append((rec.step, rec.layer, len(rec.read), len(rec.write)))
        chunks.extend((rec.read, rec.write))
    cols = np.array(meta, dtype=np.int64).reshape(len(meta), 4)
    counts = cols[:, 2:].ravel()  # read count, write count, read count, ... (chunk order)
    ids = np.fromiter(itertools.chain.from_iterable(chunks), dtype=np.int64, count=int(counts.sum()))
    is_write = np.repeat(np.tile(np.array([False, True]), len(meta)), counts)
    per_record = cols[:, 2] + cols[:, 3]
    offsets = np.zeros(len(meta), dtype=np.int64)
    np.cumsum(per_record[:-1], out=offsets[1:])
    return FlatSteps(ids, is_write, offsets, cols[:, 0].copy(), cols[:, 1].copy(), decode or None)


def step_json(record: StepRecord) -> str:
    """One step-trace JSONL line (without newline)."""
    read = ", ".join(map(str, record.read))
    write = ", ".join(map(str, record.write))
    extra = ""
    if record.in_place:
        extra += ', "in_place": true'
    for field in DECODE_FIELDS[1:]:
        values = getattr(record, field)
        if values:
            extra += f', "{field}": [{", ".join(map(str, values))}]'
    if record.resident:
        tiers = ", ".join(f'"{tier}": [{", ".join(map(str, ids))}]' for tier, ids in record.resident)
        extra += f', "{RESIDENT_FIELD}": {{{tiers}}}'
    return f'{{"step": {record.step}, "layer": {record.layer}, "read": [{read}], "write": [{write}]{extra}}}'


def write_steps(path: str | os.PathLike, records: Iterable[StepRecord], block_tokens: int | None = None) -> int:
    """Writes records as a step trace; returns the number of records written.

    ``block_tokens`` (tokens per block), when given, is written first as the header record
    ``{"block_tokens": N}``; always give it when the block size is known. The records are
    written as given; they should satisfy the reader's rules (steps non-decreasing, distinct
    ids per list), which ``iter_steps`` checks on the way back.

    Raises:
        UserError: the file cannot be written (the message names it).
    """
    header = [] if block_tokens is None else [json.dumps({HEADER_FIELD: block_tokens})]
    return write_jsonl(path, itertools.chain(header, map(step_json, records)), "step trace") - len(header)
