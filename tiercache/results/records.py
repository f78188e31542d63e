"""The one ``results.json`` schema: frozen records, a schema version, a strict reader.

A results document is what a sweep produces (``tiercache replay --out``, ``tiercache
compare``) and what ``tiercache report`` reads: the trace's identity and size, the KV layout
and hardware preset (when given), and one record per replay run with every counter the
manager keeps. Metadata plane: no torch, no numpy.

Versions:

* **10** (written now): ``"schema_version": 10``, every key below present. New against version 9:
  a fleet run's ``route`` may be ``kv_aware`` (``tiercache.config.Route``). A version too: a
  reader that predates it would refuse the route field rather than say the file is newer.
  Files written as version 9 between the route's arrival and this version may carry it too,
  and read as they are.
* **9**: read with every field version 9 wrote required. New against version 8:
  each run's ``remote_write``, when a fleet run's instances wrote to the shared tier
  (``through``, ``back`` or ``selective``: ``tiercache.config.RemoteWrite``; null for a run
  without a shared tier), and ``write_hits``, the local hits after which ``selective`` writes a
  block (null for the other modes). A version too: a reader that predates them would take a
  write-back run for a write-through one (its only mode) and two such runs for one.
* **8**: read with every field version 8 wrote required; the upgrade reads a fleet run with a
  shared tier as written ``through`` (the only mode before version 9). New against version 7: each run's
  ``offline``, whether its eviction policy reads the future (its class's ``needs_future``:
  Belady, or an out-of-tree offline policy), so a report classifies it without importing the
  policy; ``null`` only where the maker of the record did not say. Optional in version 8 (added
  after its first files; a file without them reads them as ``None``, "not recorded", and a
  reader that predates them ignores them): each run's ``prefetched``, ``prefetch_used`` and
  ``prefetch_wasted``, a decode run's blocks moved up by its prefetch policy, those a later read
  found where the prefetch put them, and those pushed back down or out unread
  (``tiercache.sim.decode_replay.PrefetchTally``; all 0 with ``--prefetch none``); ``null``
  outside decode semantics. Also optional: ``hardware_profile``, the numbers of the hardware
  profile (``hwinfo.HardwareInfo``); ``tiercache report`` compares them, not ``hardware``'s name.
* **7**: read with every field version 7 wrote required; the upgrade sets ``offline`` to
  ``None`` ("not recorded": the report then knows offline policies by the registry, or by the
  names ``belady``/``min``/``opt``), as for every older version. New against version 6: each run's
  ``prefetch``, the prefetch policy of a decode replay (``"none"``; any other only in
  ``decode`` semantics, the one semantics a prefetch policy plans for).
* **6**: read with every field version 6 wrote required. New against version 5: each run's
  ``placement``, the placement policy of its hierarchy (``"top"``: new blocks and promoted hits
  go to the top tier, as every earlier version did). Versions 3 to 6 could replay with
  ``--prefetch`` but did not record it: the upgrade sets ``prefetch`` to ``None`` ("not
  recorded") for a ``decode`` run, and to ``"none"`` for any other (no prefetch policy plans
  object or prefix replays).
* **5**: read with every field version 5 wrote required; the upgrade sets ``placement`` to
  ``"top"``. New against version 4: each run's
  ``instances`` (null, or for a fleet replay over several engine instances one object per
  instance: ``instance``, ``requests``, ``accesses``, ``hits``, ``misses``, ``tier_hits``
  per tier, ``remote`` being the shared tier, ``bytes_moved`` and ``modeled_seconds`` per
  link, ``prefill_tokens_saved``, ``ttft_saved_s``), ``route`` (null or how requests were
  spread) and ``shared_writes`` (null or blocks written to the shared tier).
* **4**: read with every field version 4 wrote required; the upgrade sets ``instances``,
  ``route`` and ``shared_writes`` to ``None`` (version 4 replayed one engine). New against version 3: each tier's
  ``codec`` (how it stores blocks: ``"none"``, ``"int8"``, ``"fp8"``, ``"int4"``) and
  ``block_bytes`` (bytes one block takes in that tier, scales included; null without a
  layout). Transfers touching a quantised tier move its encoded bytes.
* **3**: read with every field version 3 wrote required; the upgrade sets each tier's
  ``codec`` to ``"none"`` (version 3 had no codecs) and ``block_bytes`` to ``None``.
  Every key below is present (a
  value that does not apply is ``null``, or ``{}`` for ``bytes_moved``/``modeled_seconds``
  of runs without a layout). New against version 2: each tier splits its hits into
  ``hits_in_place`` (read where they lie, charged on the link to the top tier) and
  ``hits_promoted``, with ``in_place_bytes``/``promoted_bytes`` (null without a layout) and
  ``in_place_seconds``/``promoted_seconds`` (null without hardware); ``bytes_moved`` and
  ``modeled_seconds`` include the reads in place (version 2 charged them nothing).
* **2**: read with every field version 2 wrote required; the upgrade sets the six fields
  above to ``None`` ("not recorded": version 2 cannot tell them apart) and ``prefetch`` to
  ``"none"`` (versions 1 and 2 came before prefetch policies). New against
  version 1: each run's ``recomputed``, each tier's ``failed_transfers``,
  ``promote_skipped`` and ``lost``; ``trace.kind`` is spelled ``"requests"``/``"steps"``.
* **1** (files without ``schema_version``, written before the schema was versioned): read
  with every field version 1 wrote required. The upgrade fills only what version 1 did not
  record: the four counters above become ``None`` ("not recorded", never 0); ``trace.kind``
  ``"request"``/``"step"`` map to the enum; keys version 1 wrote only when they applied
  (``bytes_moved``, ``modeled_seconds``, the prefill figures) read as absent: ``{}`` or
  ``None``, exactly as version 2 writes a run without them.

Reading is strict: an unknown version, a missing key, a value of the wrong type or out of
range (a count beyond 2**63, a capacity of 0, a non-finite number, a ratio that disagrees
with the counts, an unknown tier; see ``reader``) raises a ``UserError`` naming the file and,
for a run, its 1-based index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..config import Codec, KVLayout, Mode, RemoteWrite, Route, Semantics, TraceKind
from .hwinfo import HardwareInfo

__all__ = [
    "SCHEMA_VERSION", "READABLE_VERSIONS", "Semantics", "Mode", "Route", "RemoteWrite", "TraceKind", "TraceInfo", "LayoutInfo",
    "TierRecord", "InstanceRecord", "RunRecord", "ResultsDocument", "run_label", "FINGERPRINT_PREFIX", "legacy_fingerprint",
    "SPLIT_HALVES",
]

#: The halves of ``compare --split``, in trace order: a half's results record the trace's path
#: with ``#`` and its name appended (``sim.split`` makes them, ``report`` pairs them).
SPLIT_HALVES = ("first-half", "second-half")

_CODEC_NAMES = tuple(c.value for c in Codec)

#: The version ``ResultsDocument.to_json`` writes.
SCHEMA_VERSION = 10
#: Versions ``ResultsDocument.from_json`` reads (older ones upgraded on reading).
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)


#: Prefix of a trace fingerprint (xxh3-128 of the file's bytes); a fingerprint without it is
#: the blake2b-128 hex digest earlier versions recorded (``legacy_fingerprint``).
FINGERPRINT_PREFIX = "xxh3-128:"


def legacy_fingerprint(fingerprint: str) -> bool:
    """Whether ``fingerprint`` is an earlier version's blake2b one (no algorithm prefix)."""
    return not fingerprint.startswith(FINGERPRINT_PREFIX)


@dataclass(frozen=True)
class TraceInfo:
    """Identity and size of the replayed trace.

    Invariants: ``fingerprint`` is ``xxh3-128:`` and the hex digest of the file's bytes (an earlier
    version's file: the blake2b-128 hex digest, no prefix); ``requests`` counts requests (request traces) or step records.
    """

    path: str
    name: str
    fingerprint: str
    kind: TraceKind
    requests: int
    accesses: int
    unique_blocks: int

    @property
    def compulsory_miss_ratio(self) -> float:
        """Misses no cache avoids (first accesses) over accesses, in object semantics."""
        return self.unique_blocks / self.accesses if self.accesses else 1.0

    def to_json(self) -> dict:
        """The ``trace`` object of results.json."""
        return {"path": self.path, "name": self.name, "fingerprint": self.fingerprint, "kind": self.kind.value,
                "requests": self.requests, "accesses": self.accesses, "unique_blocks": self.unique_blocks}


@dataclass(frozen=True)
class LayoutInfo:
    """The KV layout that turned blocks into bytes (``KVLayout`` as recorded)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    block_bytes: int

    @classmethod
    def from_layout(cls, layout: KVLayout) -> "LayoutInfo":
        """The record of ``layout``."""
        return cls(layout.name, layout.layers, layout.kv_heads, layout.head_dim, layout.dtype,
                   layout.block_tokens, layout.block_bytes)

    @property
    def one_layer(self) -> bool:
        """A block holds one layer's KV (a step trace's), read from the bytes recorded."""
        return self.block_bytes * self.layers == KVLayout(self.layers, self.kv_heads, self.head_dim, self.dtype,
                                                          self.block_tokens).block_bytes

    def to_json(self) -> dict:
        """The ``layout`` object of results.json."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class TierRecord:
    """The counters of one tier in one run (``tiercache.core.stats.TierCounters``).

    Invariants: every count non-negative; ``hits_in_place + hits_promoted == hits`` (the top
    tier's hits are all in place: free when it is HBM, else charged on their link to HBM,
    which files before version 8 did not do). ``failed_transfers``, ``promote_skipped`` and
    ``lost`` are None only in records upgraded from version 1; the hit split only in records
    upgraded from versions 1 and 2; its bytes also without a layout, its seconds without
    hardware. ``codec`` is a ``Codec`` value; ``block_bytes`` (with a layout) the bytes of one
    block in this tier, scales included.
    """

    name: str
    capacity_blocks: int
    hits: int
    inserts: int
    evictions: int
    demotions: int
    promotions: int
    copies: int
    refused: int
    failed_transfers: int | None
    promote_skipped: int | None
    lost: int | None
    hits_in_place: int | None = None
    hits_promoted: int | None = None
    in_place_bytes: int | None = None
    promoted_bytes: int | None = None
    in_place_seconds: float | None = None
    promoted_seconds: float | None = None
    codec: str = "none"
    block_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.codec not in _CODEC_NAMES:
            raise ValueError(f"tier {self.name}: codec {self.codec!r} is not one of {', '.join(_CODEC_NAMES)}")
        split = (self.hits_in_place, self.hits_promoted)
        if None not in split and sum(split) != self.hits:
            raise ValueError(f"tier {self.name}: hits in place {split[0]} + promoted {split[1]} != hits {self.hits}")

    def to_json(self) -> dict:
        """One entry of a run's ``tiers`` list."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class InstanceRecord:
    """One engine instance of a fleet replay: its requests, its hits per tier, its links.

    Invariants: ``accesses == hits + misses``; ``hits`` is the sum of ``tier_hits``, whose
    ``remote`` entry (present exactly when the fleet shares a remote tier) counts the hits the
    shared tier served this instance. ``bytes_moved`` (per link) is empty without a layout,
    ``modeled_seconds`` (busy seconds per link) and ``ttft_saved_s`` without hardware.
    """

    instance: int
    requests: int
    accesses: int
    hits: int
    misses: int
    tier_hits: Mapping[str, int]
    bytes_moved: Mapping[str, int]
    modeled_seconds: Mapping[str, float]
    prefill_tokens_saved: int
    ttft_saved_s: float | None = None

    def __post_init__(self) -> None:
        if self.hits + self.misses != self.accesses:
            raise ValueError(f"instance {self.instance}: hits {self.hits} + misses {self.misses} != accesses {self.accesses}")
        if sum(self.tier_hits.values()) != self.hits:
            raise ValueError(f"instance {self.instance}: the tiers' hits do not add up to hits {self.hits}")
        for name in ("tier_hits", "bytes_moved", "modeled_seconds"):
            object.__setattr__(self, name, dict(getattr(self, name)))

    @property
    def shared_hits(self) -> int:
        """Hits the shared remote tier served this instance (0 without one)."""
        return self.tier_hits.get("remote", 0)

    def to_json(self) -> dict:
        """One entry of a run's ``instances`` list."""
        return {k: dict(v) if isinstance(v, dict) else v for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class RunRecord:
    """One replay: a policy at a capacity under one semantics and hierarchy mode.

    Invariants: ``accesses == hits + misses``; ``hits`` is the sum of the tiers' hits;
    ``tiers`` non-empty, fastest first; ``prefetch`` is ``"none"`` outside ``decode`` semantics (None:
    not recorded, a decode run upgraded from versions 3 to 6); ``miss_ratio`` is ``misses / accesses`` and
    ``hit_ratio`` ``hits / accesses`` (both 0.0 without accesses), to float rounding. ``bytes_moved`` (per link) is empty without a layout and
    ``modeled_seconds`` (per link, ``recompute`` and ``total``) without a layout and hardware.
    The prefill figures are None outside prefix semantics (``ttft_saved_s`` also without a
    layout and hardware); ``recomputed`` is None only when upgraded from version 1.
    ``offline`` is whether the policy reads the future (an offline reference such as Belady,
    which never competes as online), None where not recorded (files before version 8).
    ``wall_seconds`` (>= 0) is the replay's own time, the compiled kernels loaded before its
    clock starts. ``prefetched``, ``prefetch_used`` and ``prefetch_wasted`` are all None (not
    recorded; always outside ``decode`` semantics) or all counts, with ``prefetch_used +
    prefetch_wasted <= prefetched`` (the rest were in place, unread, when the run ended). As every replay writes them (the reader checks): ``capacity_blocks`` is the
    sum of the tiers', ``mode`` is ``single`` exactly for one tier.

    A fleet replay (``instances`` set, one record per engine instance, ``route`` how requests
    were spread) sums its instances: ``accesses``, ``hits``, ``misses`` and each tier's
    counters are totals over the instances, a private tier's ``capacity_blocks`` is one
    instance's, and the ``remote`` tier is the one shared tier (its capacity the store's, its
    hits the shared hits); ``shared_writes`` counts blocks written to the shared tier (None
    without one). ``route`` and ``shared_writes`` are None outside fleet replays.
    ``remote_write`` (how the instances wrote to the shared tier) is set exactly on fleet runs
    with a ``remote`` tier (given None there, ``through``: the only mode before results version
    9); ``write_hits`` (at least 1) exactly when it is ``selective``.
    """

    policy: str
    admission: str
    semantics: Semantics
    mode: Mode
    capacity_blocks: int
    accesses: int
    hits: int
    misses: int
    recomputed: int | None
    miss_ratio: float
    hit_ratio: float
    tiers: tuple[TierRecord, ...]
    wall_seconds: float
    bytes_moved: Mapping[str, int] = field(default_factory=dict)
    modeled_seconds: Mapping[str, float] = field(default_factory=dict)
    prefill_tokens: int | None = None
    prefill_tokens_saved: int | None = None
    ttft_saved_s: float | None = None
    instances: tuple[InstanceRecord, ...] | None = None
    route: Route | None = None
    shared_writes: int | None = None
    placement: str = "top"
    prefetch: str | None = "none"
    offline: bool | None = None
    prefetched: int | None = None
    prefetch_used: int | None = None
    prefetch_wasted: int | None = None
    remote_write: RemoteWrite | None = None
    write_hits: int | None = None

    def __post_init__(self) -> None:
        if self.hits + self.misses != self.accesses:
            raise ValueError(f"hits {self.hits} + misses {self.misses} != accesses {self.accesses}")
        if self.prefetch != "none" and self.semantics is not Semantics.DECODE:
            raise ValueError(f"prefetch {self.prefetch!r} belongs to decode runs (a prefetch policy plans decode steps), "
                             f"not {self.semantics.value} semantics")
        self._check_prefetch_counts()
        if self.instances is not None:
            self._check_instances()
        elif self.route is not None or self.shared_writes is not None:
            raise ValueError("route and shared_writes belong to fleet runs (with instances)")
        if not self.tiers:
            raise ValueError("a run has at least one tier")
        self._check_remote_write()
        if sum(t.hits for t in self.tiers) != self.hits:
            raise ValueError(f"the tiers' hits do not add up to hits {self.hits}")
        self._check_ratios()
        object.__setattr__(self, "tiers", tuple(self.tiers))
        # Plain dict copies (not read-only proxies): records cross process boundaries by pickle.
        object.__setattr__(self, "bytes_moved", dict(self.bytes_moved))
        object.__setattr__(self, "modeled_seconds", dict(self.modeled_seconds))

    def _check_prefetch_counts(self) -> None:
        """The prefetch counts are all recorded or none, only in decode semantics, all 0 with
        prefetch ``none`` (it plans nothing), and the used and wasted blocks are among the prefetched."""
        counts = (self.prefetched, self.prefetch_used, self.prefetch_wasted)
        if counts == (None, None, None):
            return
        if None in counts:
            raise ValueError("prefetched, prefetch_used and prefetch_wasted are recorded together (all or none)")
        if self.semantics is not Semantics.DECODE:
            raise ValueError(f"prefetch counts belong to decode runs, not {self.semantics.value} semantics")
        if self.prefetch == "none" and any(counts):
            raise ValueError(f"prefetch 'none' moves no block ahead of a read, so its prefetch counts are 0; got prefetched "
                             f"{self.prefetched}, prefetch_used {self.prefetch_used}, prefetch_wasted {self.prefetch_wasted}")
        if self.prefetch_used + self.prefetch_wasted > self.prefetched:
            raise ValueError(f"prefetch_used {self.prefetch_used} + prefetch_wasted {self.prefetch_wasted} > "
                             f"prefetched {self.prefetched}")

    def _check_remote_write(self) -> None:
        """A write mode on fleet runs with a shared tier alone (``through`` where not given), and
        a selective threshold (at least 1) with ``selective`` alone."""
        shared = self.instances is not None and any(t.name == "remote" for t in self.tiers)
        if shared and self.remote_write is None:
            object.__setattr__(self, "remote_write", RemoteWrite.THROUGH)
        if self.remote_write is not None and not shared:
            raise ValueError(f"remote_write belongs to fleet runs with a shared remote tier, got {self.remote_write.value!r}")
        if (self.write_hits is not None) != (self.remote_write is RemoteWrite.SELECTIVE):
            raise ValueError(f"write_hits belongs to selective remote writes (and they need it), got write_hits "
                             f"{self.write_hits} with remote_write {self.remote_write.value if self.remote_write else None}")
        if self.write_hits is not None and self.write_hits < 1:
            raise ValueError(f"write_hits must be at least 1, got {self.write_hits}")

    def _check_ratios(self) -> None:
        """The ratios agree with the counts (as ``replay`` computes them: 0.0 without accesses)."""
        for name, count in (("miss_ratio", self.misses), ("hit_ratio", self.hits)):
            expected = count / self.accesses if self.accesses else 0.0
            if not math.isclose(getattr(self, name), expected, rel_tol=1e-9, abs_tol=1e-12):
                raise ValueError(f"{name} {getattr(self, name)!r} is not {count} / {self.accesses} accesses ({expected!r})")

    def _check_instances(self) -> None:
        object.__setattr__(self, "instances", tuple(self.instances))
        if not self.instances or self.route is None:
            raise ValueError("a fleet run has at least one instance and a route")
        if sum(i.hits for i in self.instances) != self.hits or sum(i.accesses for i in self.instances) != self.accesses:
            raise ValueError(f"the instances' hits and accesses do not add up to the run's ({self.hits}, {self.accesses})")

    @property
    def is_fleet(self) -> bool:
        """True for a fleet replay (runs over several engine instances' tiers)."""
        return self.instances is not None

    @property
    def shared_hits(self) -> int:
        """Hits served by the shared remote tier (0 without one)."""
        return sum(t.hits for t in self.tiers if t.name == "remote")

    @property
    def label(self) -> str:
        """The policy as named on the command line (with its admission, placement and prefetch
        policies if not the defaults)."""
        return run_label(self.policy, self.admission, self.placement, self.prefetch)

    @property
    def is_hierarchy(self) -> bool:
        """True for runs over more than one tier."""
        return len(self.tiers) > 1

    @property
    def tier_shape(self) -> tuple[tuple[str, int, str], ...]:
        """The tiers as (name, capacity in blocks, codec), fastest first: what names the cache."""
        return tuple((t.name, t.capacity_blocks, t.codec) for t in self.tiers)

    @property
    def key(self) -> tuple:
        """What identifies a run among others of one trace (two runs with one key are the same run)."""
        shape = self.tier_shape
        fleet = () if self.instances is None else (len(self.instances), self.route, self.remote_write, self.write_hits)
        return (self.policy, self.admission, self.placement, self.prefetch, self.semantics, self.mode, self.capacity_blocks,
                shape) + fleet

    def to_json(self) -> dict:
        """One entry of results.json's ``runs`` list (every key present)."""
        record = dict(self.__dict__)
        record |= {"semantics": self.semantics.value, "mode": self.mode.value, "tiers": [t.to_json() for t in self.tiers],
                   "bytes_moved": dict(self.bytes_moved), "modeled_seconds": dict(self.modeled_seconds),
                   "instances": None if self.instances is None else [i.to_json() for i in self.instances],
                   "route": None if self.route is None else self.route.value,
                   "remote_write": None if self.remote_write is None else self.remote_write.value}
        return record


def run_label(policy: str, admission: str | None, placement: str | None = None, prefetch: str | None = "none") -> str:
    """``lru``; ``lru+second_hit`` when an admission policy other than ``always`` ran;
    ``lru@reuse`` when a placement policy other than ``top`` did; ``lru (prefetch
    topk_speculative)`` when a prefetch policy other than ``none`` did, ``lru (prefetch not
    recorded)`` for a decode run of a file that did not record it (results versions 3 to 6)."""
    label = policy if admission in (None, "", "always") else f"{policy}+{admission}"
    label = label if placement in (None, "", "top") else f"{label}@{placement}"
    if prefetch == "none":
        return label
    return f"{label} (prefetch {'not recorded' if prefetch is None else prefetch})"


@dataclass(frozen=True)
class ResultsDocument:
    """A whole results.json: the trace, the presets, the runs, and how they were made.

    Invariants: at least one run. ``schema_version`` is ``SCHEMA_VERSION`` (documents read
    from older files are upgraded on reading, see the module docstring).
    """

    tiercache_version: str
    command: str
    trace: TraceInfo
    layout: LayoutInfo | None
    hardware: str | None
    runs: tuple[RunRecord, ...]
    schema_version: int = SCHEMA_VERSION
    hardware_profile: HardwareInfo | None = None  # None: no hardware, or a file that did not record it

    def __post_init__(self) -> None:
        object.__setattr__(self, "runs", tuple(self.runs))
        if not self.runs:
            raise ValueError("a results document holds at least one run")

    def to_json(self) -> dict:
        """The JSON object of results.json (version ``SCHEMA_VERSION``)."""
        return {
            "schema_version": SCHEMA_VERSION, "tiercache_version": self.tiercache_version, "command": self.command,
            "trace": self.trace.to_json(), "layout": None if self.layout is None else self.layout.to_json(),
            "hardware": self.hardware,
            "hardware_profile": None if self.hardware_profile is None else self.hardware_profile.to_json(),
            "runs": [run.to_json() for run in self.runs],
        }

    @classmethod
    def from_json(cls, data: Any, source: str) -> "ResultsDocument":
        """Reads a parsed results.json strictly (``source`` names the file in messages).

        Raises:
            UserError: not a results document, an unknown version, or a missing or mistyped
                field (the message names ``source`` and, for a run, its 1-based index).
        """
        from .reader import read_document  # the reader imports these records

        return read_document(data, source)
