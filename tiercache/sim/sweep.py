"""Sweeps: a trace loaded once, replayed for every policy × capacity × semantics.

A sweep is defined by a ``SweepSpec`` (typed and validated when built; the CLI builds one
from its options) and run over a ``Trace`` by ``sweep``, which returns the
``ResultsDocument`` shared by ``tiercache replay``, ``tiercache compare`` and
``tiercache report``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import warnings
from collections import Counter
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Callable

import psutil
from tqdm import tqdm

import tiercache
from tiercache.config import CacheConfig, Codec, KVLayout, TierConfig, parse_tiers
from tiercache.core.holds import held_capacity
from tiercache.core.interrupts import counting_sigints, raise_on_sigterm
from tiercache.errors import UserError
from tiercache.policies import (
    ADMISSION, EVICTION, PLACEMENT, PREFETCH, canonical_name, get_admission, get_eviction, get_placement, get_prefetch,
)
from tiercache.results import LayoutInfo, ResultsDocument, RunRecord, Semantics, TraceKind, run_label
from tiercache.results.hwinfo import HardwareInfo

from .hardware import HardwareProfile
from .held import HeldPeaks
from .loader import Trace, load_trace
from .oracle import trace_layout
from .replay import ReplayData, RunSpec, check_placement, check_run, load_kernels, replay

__all__ = ["SweepSpec", "check_policy_names", "plan_runs", "sweep", "fitting_runs", "run_sweep", "check_memory", "SLOT_BYTES"]

#: Memory one slot of tier capacity costs before any block is stored: the slot directory's
#: table (8 B) and, once slots have been freed, its free stack (8 B); policies preallocate
#: nothing per slot (measured with tracemalloc for every registered policy at 1M slots).
SLOT_BYTES = 16


def check_policy_names(policies: tuple[str, ...], admission: str) -> None:
    """Checks that every eviction policy and the admission policy are registered.

    Raises:
        UserError: an empty list, or an unknown policy (the registry's message names it).
    """
    if not policies:
        raise UserError("--policy: no policy given")
    for name in policies:
        get_eviction(name)
    get_admission(admission)


@dataclass(frozen=True)
class SweepSpec:
    """What a sweep replays, besides the trace: policies × semantics × (capacities or one hierarchy).

    Invariants (checked when built, so a bad spec fails before any replay):

    * ``policies`` non-empty, each a registered eviction policy (or ``module:Class``);
      ``admission`` a registered admission policy (it runs the lower tiers of a hierarchy).
      Every policy name, ``placement`` and ``prefetch`` too, is stored as
      ``canonical_name`` gives it (``LRU`` -> ``lru``), so runs are labelled alike.
    * ``prefetch`` other than ``none`` only with online policies (an offline one needs
      next uses, which a prefetching step replay does not give).
    * ``semantics`` non-empty, of ``OBJECT``/``PREFIX`` (request traces; a step trace
      replays every run as ``DECODE``).
    * exactly one of ``capacities`` (single-tier sweep: each a positive block count) and
      ``cache`` (one hierarchy, each policy run on it once per semantics).
    * ``hardware`` only with a ``layout`` (modeled seconds need bytes per block).
    * ``placement`` a registered placement policy; other than ``top`` only with an exclusive
      hierarchy (``cache`` of two tiers or more, not write-through).
    * ``references`` (registered eviction policies, canonical names, possibly empty) replay
      plainly, with admission ``always`` and placement ``top``, beside ``policies`` in every
      cache: the LRU and Belady runs a gap closed is measured against, whatever ``admission``
      and ``placement`` the compared policies run with (``compare --split`` adds them). A
      reference that ``policies`` already replays plainly is one run.
    """

    policies: tuple[str, ...]
    semantics: tuple[Semantics, ...]
    capacities: tuple[int, ...] = ()
    cache: CacheConfig | None = None
    admission: str = "always"
    layout: KVLayout | None = None
    hardware: HardwareProfile | None = None
    prefetch: str = "none"
    placement: str = "top"
    references: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._canonicalise_names()
        check_policy_names(self.policies, self.admission)
        for name in self.references:
            get_eviction(name)
        get_prefetch(self.prefetch)
        get_placement(self.placement)
        offline = [p for p in dict.fromkeys(self.policies + self.references) if get_eviction(p).needs_future]
        if self.prefetch != "none" and offline:
            raise UserError(f"--policy {offline[0]}: an offline policy needs the future (next uses), which a replay "
                            f"with --prefetch {self.prefetch} does not give; drop one of them")
        if self.placement != "top":  # the default: an explicit top is refused by the caller that knows (the CLI)
            check_placement(self.placement, self.cache)
        if not self.semantics or any(s not in (Semantics.OBJECT, Semantics.PREFIX) for s in self.semantics):
            raise UserError(f"--semantics: object and/or prefix, got {[getattr(s, 'value', s) for s in self.semantics]}")
        if self.cache is not None and self.capacities:
            raise UserError("--capacity and --tiers are exclusive; give one")
        if self.cache is None and not self.capacities:
            raise UserError("--capacity: no capacity given (or give --tiers)")
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.capacities):
            raise UserError(f"--capacity: block counts must be positive integers, got {list(self.capacities)}")
        if self.hardware is not None and self.layout is None:
            raise UserError("--hardware needs --model or --layout (bytes per block) to model seconds")

    def _canonicalise_names(self) -> None:
        """Stores every policy name as registered (see ``canonical_name``); frozen, hence setattr."""
        for field, table in (("admission", ADMISSION), ("placement", PLACEMENT), ("prefetch", PREFETCH)):
            object.__setattr__(self, field, canonical_name(getattr(self, field), table))
        for field in ("policies", "references"):
            object.__setattr__(self, field, tuple(canonical_name(p, EVICTION) for p in getattr(self, field)))

    def hierarchies(self) -> list[tuple[tuple[TierConfig, ...], bool]]:
        """Each hierarchy the sweep runs on: (tiers, write_through), in sweep order."""
        if self.cache is not None:
            return [(self.cache.tiers, self.cache.write_through)]
        return [((TierConfig("hbm", c),), False) for c in self.capacities]


def plan_runs(spec: SweepSpec, kind: TraceKind) -> list[RunSpec]:
    """Every run of the sweep on a trace of ``kind``: semantics, then hierarchy, then policy
    (``policies``, then the plain ``references`` not among them), each run once.

    A step trace replays in ``DECODE`` semantics only, so its runs are those of one semantics.
    """
    semantics = spec.semantics if kind is TraceKind.REQUESTS else (Semantics.DECODE,)
    runs = (
        run
        for s in semantics
        for tiers, write_through in spec.hierarchies()
        for run in (*(RunSpec(policy, s, tiers, spec.admission, write_through, spec.prefetch, spec.placement)
                      for policy in spec.policies),
                    *(RunSpec(policy, s, tiers, "always", write_through, spec.prefetch, "top")
                      for policy in spec.references))
    )
    return list(dict.fromkeys(runs))


def sweep(trace: Trace, spec: SweepSpec, workers: int = 1, progress: bool = False, command: str = "",
          note: Callable[[str], None] | None = None) -> ResultsDocument:
    """Replays ``trace`` for every run of ``spec``; ``command`` is recorded as given.

    ``workers`` > 1 runs replays in forked worker processes (the trace is shared, not copied).
    A recorded decode's runs on tiers that cannot hold what its live sequences hold at once
    are left out (``fitting_runs``), each such cache told in one line to ``note`` (default: a
    ``warning:`` line on stderr).

    Raises:
        UserError: a run ``check_run`` refuses, or no run fits (the first cache's line).
    """
    if workers < 1:
        raise ValueError(f"sweep: workers must be >= 1, got {workers}")
    runs = plan_runs(spec, trace.kind)
    for run in runs:
        check_run(run, trace)
    runs = fitting_runs(runs, trace, note or _warn)
    check_memory(runs, workers)
    layout = trace_layout(trace, spec.layout)  # a step trace's block is one layer's KV
    data = ReplayData.prepare(trace, layout, spec.hardware)
    return ResultsDocument(
        tiercache_version=tiercache.__version__,
        command=command,
        trace=trace.info(),
        layout=None if layout is None else LayoutInfo.from_layout(layout),
        hardware=None if spec.hardware is None else spec.hardware.name,
        runs=tuple(_execute(runs, data, workers, progress)),
        hardware_profile=None if spec.hardware is None else HardwareInfo.of(spec.hardware, layout=layout),
    )


def fitting_runs(runs: list[RunSpec], trace: Trace, note: Callable[[str], None]) -> list[RunSpec]:
    """The runs whose tiers hold the blocks ``trace``'s live sequences hold at once (``held``):
    the live cache refuses an append past that, so a replay would count a decode that cannot
    run. The others are left out, one line per cache to ``note``, naming the trace's file and
    line of the first write that does not fit and how many blocks are missing.

    Raises:
        UserError: no run fits (the line of the first cache; the others are not told).
    """
    peaks = HeldPeaks.of(trace)
    if not peaks.peaks:
        return runs
    why: dict[tuple, str | None] = {}
    for run in runs:
        if (run.tiers, run.write_through) not in why:
            capacity = held_capacity([t.capacity_blocks for t in run.tiers], run.write_through)
            why[(run.tiers, run.write_through)] = peaks.refusal(capacity, _where(run))
    left = Counter((run.tiers, run.write_through) for run in runs if why[(run.tiers, run.write_through)] is not None)
    kept = [run for run in runs if (run.tiers, run.write_through) not in left]
    if not kept:
        others = {1: "", 2: " (nor does the other cache asked for)"}.get(len(left), f" (nor do the other {len(left) - 1} "
                                                                                     "caches asked for)")
        raise UserError(f"{why[next(iter(left))]}{others}; no replay of it is made")
    for cache, count in left.items():
        note(f"{why[cache]}; its {count} run{'s are' if count > 1 else ' is'} left out")
    return kept


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)


def check_memory(runs: list[RunSpec], workers: int, available: int | None = None) -> None:
    """Refuses capacities whose slot directories would not fit in memory.

    The runs that execute at once (one per worker) may need at most half of ``available``
    (default: the memory psutil reports available now): ``SLOT_BYTES`` per slot of capacity,
    summed over a run's tiers, for the largest runs. Stored blocks cost more on top, but
    never more blocks than the trace holds.

    Raises:
        UserError: the need, the limit and the largest capacity that fits.
    """
    available = psutil.virtual_memory().available if available is None else available
    slots = sorted((sum(t.capacity_blocks for t in run.tiers) for run in runs), reverse=True)
    concurrent = max(1, min(workers, len(slots)))
    need = sum(slots[:concurrent]) * SLOT_BYTES
    if need > available // 2:
        fits = available // 2 // SLOT_BYTES // concurrent
        raise UserError(
            f"--capacity/--tiers: a run of {slots[0]:,} blocks: the slot directories of {concurrent} concurrent run(s) need about "
            f"{_gb(need)} (~{SLOT_BYTES} B per slot), over half of the {_gb(available)} available; "
            f"the most that fits is about {fits:,} blocks per run")


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:,.1f} GB"


def run_sweep(
    trace_path: str, policies: list[str], capacities: list[int], semantics: list[str],
    tiers: str | None = None, workers: int = 1, progress: bool = False,
) -> dict:
    """Convenience for scripts and tests: a sweep without layout or hardware, as results.json's object.

    ``semantics`` are names (``"object"``, ``"prefix"``); ``tiers`` a ``--tiers`` text in
    blocks (``"hbm=40,dram=120"``), exclusive with ``capacities``. Use ``SweepSpec`` and
    ``sweep`` for anything more.

    Raises:
        UserError: a bad policy, semantics, capacity or tier, or a malformed trace.
    """
    cache = CacheConfig(parse_tiers(tiers, None)) if tiers else None
    spec = SweepSpec(tuple(policies), tuple(Semantics.parse(s) for s in semantics), tuple(capacities), cache)
    return sweep(load_trace(trace_path), spec, workers, progress).to_json()


_WORKER_DATA: ReplayData | None = None  # set in the parent before forking workers
_STARTED = None  # set in the parent before forking workers: _STARTED[i] is the pid of the worker that began run i (0: none)


def _init_worker() -> None:
    """Leaves Ctrl-C to the parent, which stops every worker (an idle worker would otherwise
    die of it, printing a traceback of its own); SIGTERM kills a worker as by default (the
    parent's handler, inherited through fork, is the parent's)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run_in_worker(index: int, spec: RunSpec) -> RunRecord:
    """Replays run ``index`` in a forked worker, noting first which process replays it."""
    _STARTED[index] = os.getpid()
    try:
        return _replay(spec, _WORKER_DATA, in_worker=True)
    except UserError as exc:  # sent back as a plain UserError: a subclass need not unpickle (TraceError does not)
        raise UserError(str(exc)) from None


def _out_of_tree(spec: RunSpec) -> list[str]:
    """The ``module:Class`` policies of a run (none of them in the registry)."""
    named = ((spec.policy, EVICTION), (spec.admission, ADMISSION), (spec.placement, PLACEMENT), (spec.prefetch, PREFETCH))
    return [name for name, table in named if canonical_name(name, table) not in table]


def _culprits(outside: list[str], exc: BaseException) -> list[str]:
    """Which of a run's out-of-tree policies ``outside`` (``module:Class``) an exception is
    blamed on: those with a method in its traceback (the exception came from their code), else
    those whose module has a frame there, else those its message names (tiercache's contract
    checks name the policy whose answer broke them), else all of them (nothing tells them apart)."""
    classes, modules = _traceback_owners(exc)
    for found in ([name for name in outside if name in classes],
                  [name for name in outside if name.partition(":")[0] in modules],
                  [name for name in outside if name in str(exc)]):
        if found:
            return found
    return outside


def _traceback_owners(exc: BaseException) -> tuple[set[str], set[str]]:
    """The ``module:Class`` names of the objects whose methods are in ``exc``'s traceback (every
    class of each one's MRO), and the modules of all its frames."""
    classes, modules, tb = set(), set(), exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        modules.add(frame.f_globals.get("__name__"))
        owner = frame.f_locals.get("self")
        if owner is not None:
            classes.update(f"{cls.__module__}:{cls.__qualname__}" for cls in type(owner).__mro__)
        tb = tb.tb_next
    return classes, modules


def _run_name(spec: RunSpec) -> str:
    """A run as an error names it: ``arc+second_hit on --tiers hbm=2,dram=3 (object semantics)``,
    ``lru at capacity 1000 (prefix semantics)``."""
    label = run_label(spec.policy, spec.admission, spec.placement, spec.prefetch)
    return f"{label} {_where(spec)} ({spec.semantics.value} semantics)"


def _where(spec: RunSpec) -> str:
    """A run's cache as a message names it: ``at capacity 1000``, ``on --tiers hbm=2,dram=3``."""
    if len(spec.tiers) == 1 and spec.tiers[0].codec is Codec.NONE:
        return f"at capacity {spec.tiers[0].capacity_blocks}"
    codecs = ["" if t.codec is Codec.NONE else f":{t.codec.value}" for t in spec.tiers]
    where = "on --tiers " + ",".join(f"{t.name}={t.capacity_blocks}{c}" for t, c in zip(spec.tiers, codecs))
    return where + (" --write-through" if spec.write_through else "")


def _replay(spec: RunSpec, data: ReplayData, on_progress: Callable[[int], None] | None = None,
            in_worker: bool = False) -> RunRecord:
    """``replay``, where whatever an out-of-tree policy in the run raises is a ``UserError``
    naming it and the run (one line, no traceback): an exception, ``SystemExit``, a
    ``BaseException`` of its own, and a ``KeyboardInterrupt`` no Ctrl-C caused (in a worker,
    where Ctrl-C is ignored, every one; in the parent, one raised while no SIGINT arrived:
    ``counting_sigints``). A built-in policy's exception is a bug and propagates as it is, as
    does a real Ctrl-C.

    Raises:
        UserError: the run has a ``module:Class`` policy and the replay raised.
    """
    with counting_sigints() as ctrl_c:
        try:
            return replay(spec, data, on_progress)
        except UserError:
            raise
        except BaseException as exc:  # noqa: BLE001 - code outside tiercache failed: say whose, not where
            outside = _culprits(_out_of_tree(spec), exc)
            if not outside or (isinstance(exc, KeyboardInterrupt) and not in_worker and ctrl_c.pressed()):
                raise
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise UserError(f"out-of-tree policy {', '.join(outside)} failed in the replay of {_run_name(spec)}: {what}") from None


def _execute(runs: list[RunSpec], data: ReplayData, workers: int, progress: bool) -> list[RunRecord]:
    """Runs every replay, in worker processes when asked, with a progress bar over runs."""
    if len(runs) == 1:  # one long replay: show progress over its requests instead
        with tqdm(total=data.n_batches, desc="replay", unit="req", disable=not progress, delay=2) as bar:
            return [_replay(runs[0], data, on_progress=bar.update)]
    bar = tqdm(total=len(runs), desc="replays", unit="run", disable=not progress, delay=2)
    try:
        if workers > 1:
            try:
                return _in_workers(runs, data, min(workers, len(runs)), bar)
            except _NoWorkers as exc:  # nothing ran yet: the runs go on in this process
                warnings.warn(f"tiercache: worker processes could not start ({exc.__cause__}); the {len(runs)} "
                              "replays run one after another in this process", RuntimeWarning, stacklevel=2)
        return [_with_bar(bar, _replay(spec, data)) for spec in runs]
    finally:
        bar.close()


class _NoWorkers(Exception):
    """The worker pool could not be made (its shared memory, ``/dev/shm``, full or limited; no
    ``sem_open``; a fork or its manager thread refused); raised before any run started, from
    the refusal as its cause."""


#: What making the pool raises when the machine cannot give it workers (not a defect of ours).
_POOL_REFUSALS = (OSError, NotImplementedError, ImportError)


def _submit(executor: ProcessPoolExecutor, index: int, spec: RunSpec) -> Future:
    """``executor.submit`` of run ``index``. The first submit forks every worker and starts the
    pool's manager thread before any run is handed out, so where it cannot (``EAGAIN`` at the
    process limit, ``ENOMEM``, "can't start new thread") nothing ran: ``_NoWorkers``."""
    try:
        return executor.submit(_run_in_worker, index, spec)
    except (OSError, RuntimeError) as exc:
        if index:
            raise
        raise _NoWorkers() from exc


def _with_bar(bar: tqdm, record: RunRecord) -> RunRecord:
    bar.update(1)
    return record


def _in_workers(runs: list[RunSpec], data: ReplayData, workers: int, bar: tqdm) -> list[RunRecord]:
    """Replays ``runs`` in ``workers`` forked processes, which share ``data`` (its arrays are
    not copied); returns the records in run order, the bar counting runs as they end. The
    replay kernels are compiled (or loaded) here first, once (``load_kernels``): the forked
    workers inherit them, and none compiles them again.

    The first failure ends the sweep at once, with no worker left running: a run that raised
    raises here (an out-of-tree policy's failure is a ``UserError`` already), and Ctrl-C
    propagates, after the other workers are killed.

    Raises:
        UserError: a worker process died (the OOM killer's SIGKILL, say); names the run it was
            replaying and how it died.
        _NoWorkers: the pool could not be made (no shared memory); nothing ran.
    """
    global _WORKER_DATA, _STARTED
    load_kernels(runs, data)  # before the fork: the workers inherit the compiled kernels
    if data.profile is not None:
        data.mean_read_index  # noqa: B018 (cached, before the fork: one computation per trace)
    context = multiprocessing.get_context("fork")
    try:  # shared memory for the run counter and the pool's queues: a full /dev/shm refuses it
        _WORKER_DATA, _STARTED = data, context.RawArray("q", len(runs))
        executor = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker)
    except _POOL_REFUSALS as exc:  # no shared memory; no sem_open (NotImplementedError); no _multiprocessing
        _WORKER_DATA = _STARTED = None
        raise _NoWorkers() from exc
    futures: list[Future] = []  # futures[i] replays runs[i]
    previous_term = raise_on_sigterm()  # workers are killed on the way out instead of outliving it
    try:
        for index, spec in enumerate(runs):
            futures.append(_submit(executor, index, spec))
        for future in as_completed(futures):
            future.result()
            bar.update(1)
        return [future.result() for future in futures]
    except BrokenProcessPool:
        processes = _worker_processes(executor)
        executor.shutdown(wait=True)  # the workers are reaped: their exit codes are known
        raise UserError(_death(runs, futures, {p.pid: p.exitcode for p in processes})) from None
    except BaseException:
        for process in _worker_processes(executor):
            process.kill()
        raise
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
        _WORKER_DATA = _STARTED = None
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)


def _worker_processes(executor: ProcessPoolExecutor) -> list[multiprocessing.Process]:
    """The executor's worker processes while it runs, to kill them or read how they ended.

    ``concurrent.futures`` keeps them private (Python 3.14 adds ``kill_workers``; 3.15 names
    the exit code in ``BrokenProcessPool``, gh-139462); without them, none: a death is then
    reported without its cause, and a failed sweep waits for the runs in progress.
    """
    return list((getattr(executor, "_processes", None) or {}).values())


def _death(runs: list[RunSpec], futures: list[Future], exit_codes: dict[int, int | None]) -> str:
    """One line on a dead worker: the run it was replaying (the first such, when the executor's
    own SIGTERM to the other workers cannot be told apart) and how it ended."""
    unfinished = [i for i, f in enumerate(futures) if _STARTED[i] and f.done() and not f.cancelled()
                  and isinstance(f.exception(), BrokenProcessPool)]
    died = [i for i in unfinished if exit_codes.get(_STARTED[i]) not in (None, -signal.SIGTERM)] or unfinished
    if died:
        code = exit_codes.get(_STARTED[died[0]])
        who = f"the worker process replaying {_run_name(runs[died[0]])}"
    else:
        code = next((c for c in exit_codes.values() if c not in (None, -signal.SIGTERM)), None)
        who = "a replay worker process, between runs,"
    hint = ("; SIGKILL is what the out-of-memory killer sends: try fewer --workers or smaller capacities"
            if code == -signal.SIGKILL else "")
    return f"{who} {_how_ended(code)}; the sweep was stopped{hint}"


def _how_ended(exit_code: int | None) -> str:
    """``was killed by signal 9 (SIGKILL)``, ``exited with status 3``, ``ended (how is unknown)``."""
    if exit_code is None:
        return "ended (how is unknown)"
    if exit_code >= 0:
        return f"exited with status {exit_code}"
    try:
        return f"was killed by signal {-exit_code} ({signal.Signals(-exit_code).name})"
    except ValueError:
        return f"was killed by signal {-exit_code}"
