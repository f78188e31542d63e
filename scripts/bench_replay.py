#!/usr/bin/env python3
"""Replay throughput: tiercache against libCacheSim, side by side in one run, loading included.

Usage: python scripts/bench_replay.py [--trace T] [--capacity 4000] [--repeats 5] [--json out.json] [--kernel-rates]

1. Every built-in policy libCacheSim also has (LRU, FIFO, LFU, ARC, S3-FIFO, SIEVE, Belady),
   object semantics, one tier of ``--capacity`` blocks. One timed run on each side is the
   whole job from the file on disk:
   * tiercache, cold: ``load_trace`` (parse the JSONL: orjson in bulk, fingerprint) +
     ``ReplayData.prepare`` (dense ids, next uses) + ``replay`` (the compiled kernels);
   * tiercache, cached: the same from the binary trace cache (``load_trace_cached``);
   * libCacheSim: open its reader on the trace in its own binary format (oracleGeneral,
     exported once before timing: libCacheSim cannot read Mooncake JSONL) + ``process_trace``.
   Per policy, every side first runs once untimed on the trace, then ``--repeats`` rounds run
   each side once, the side that goes first rotating (``tiercache.bench.rounds.alternate``);
   runs are timed in CPU seconds (``time.process_time``;
   the machine may be shared, and wall time counts time spent descheduled); rates are from
   median CPU seconds, ratios (tiercache cold or cached over libCacheSim) are medians of the
   per-repeat ratios; wall-clock medians are in the JSON too. Each side's rate is over the
   accesses it reports having processed (libCacheSim: its cache's request count; its miss
   count is its miss ratio x that count). The script refuses the comparison (exit 1, before
   the later parts) when the two sides processed different numbers of accesses, when a side's
   counts differ between its runs, or when the miss counts disagree beyond ``MISS_TOLERANCE``
   (equal for LRU, FIFO, Belady, SIEVE, S3-FIFO; ARC's miss ratio within 3e-4; LFU's, for
   which no agreement is claimed, are printed but not checked).
2. A 3-tier hierarchy (HBM 1,000 / DRAM 4,000 / NVMe 16,000 blocks, llama-3-8b, H200 profile)
   in prefix semantics: block accesses per second of ``replay`` on the prepared trace.
3. Time and peak RSS of load + prepare + replay (3-tier LRU, prefix, capacities scaled with
   the trace) at 1x, 10x and 100x the trace (copies with disjoint ids), each in three fresh
   interpreters (medians): the process's peak RSS and how much RSS grew during a first run
   (sampled), and the median time of three more runs without the sampling thread.
4. The sweep of 7 policies x 3 capacities, wall time with one worker per core.

``--kernel-rates`` instead times only the compiled kernels against the Python manager
(``TIERCACHE_NO_NUMBA=1``) on the prefix-tree policies (session, leaf_lru, cost) at 1,000 and
16,000 blocks, prefix semantics, one tier: CPU seconds of the replay alone on the prepared
trace, each way in its own fresh interpreter after an untimed replay of each policy, once per
round for ``--repeats`` rounds, the way that goes first alternating; rates from median CPU
seconds, ratios the medians of per-round ratios. Both ways must count the same hits and
misses, and each must have taken its own path, or it exits 1 (the Python way takes about
half a minute per round).

Warm-up, before any clock starts: numba compiles once per machine into ``__pycache__``
(``cache=True``), and every policy is replayed once on a small trace, so no timed region
compiles or loads compiled code; libCacheSim runs each of its policies once on the same small
trace, since its first runs in a process cost about ten steady ones. With the untimed run of
each side per policy above, neither side's one-time costs reach a median, whatever
``--repeats`` and whichever policy is timed first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tiercache.bench.rounds import alternate, positive_int
from tiercache.bench.replay_figures import (Counts, check_counts, kernel_rows, policy_row, print_kernel_rates,
                                            print_policies)
from tiercache.bench.script_args import ScriptParser, refuse_bad_outputs
from tiercache.errors import UserError
from tiercache.results.outfile import replace_file

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl"
WARMUP_TRACE = ROOT / "tests" / "data" / "mooncake_head.jsonl"
#: Our name -> libCacheSim's class.
LIBCACHESIM = {"lru": "LRU", "fifo": "FIFO", "lfu": "LFU", "arc": "ARC", "s3fifo": "S3FIFO", "sieve": "Sieve",
               "belady": "Belady"}
SWEEP_POLICIES = list(LIBCACHESIM)
SWEEP_CAPACITIES = [1000, 4000, 16000]
HIERARCHY = (("hbm", 1000), ("dram", 4000), ("nvme", 16000))


def tiercache_run(trace: str, policy: str, capacity: int, cache_dir: str | None):
    """One whole run from the file: load (cold, or from the cache) + prepare + replay."""
    from tiercache.config import TierConfig
    from tiercache.results import Semantics
    from tiercache.sim.loader import load_trace
    from tiercache.sim.replay import ReplayData, RunSpec, replay
    from tiercache.sim.tracecache import load_trace_cached

    started, cpu = time.perf_counter(), time.process_time()
    loaded = load_trace(trace) if cache_dir is None else load_trace_cached(trace, cache_dir)
    record = replay(RunSpec(policy, Semantics.OBJECT, (TierConfig("hbm", capacity),)), ReplayData.prepare(loaded, None, None))
    return (time.perf_counter() - started, time.process_time() - cpu), record


def table_power(oracle: str) -> int:
    """The hash-table size (``hashpower``, log2 of its buckets) libCacheSim's caches get for
    ``oracle``: the smallest power of two at least the trace's distinct objects (16 for the
    bundled sample's 44k), so its table never grows during a run and allocating it costs
    little. libCacheSim's default, 24 (16M buckets), and even 20 spend most of a short run
    allocating and touching the table: at 20 its S3-FIFO took 57 ms against 14 ms at 16 on
    the sample (4,000 blocks), which flattered us 4x. Counted once, before any clock."""
    import numpy as np

    from tiercache.sim.oracle import read_oracle_general

    distinct = len(np.unique(read_oracle_general(oracle)["obj_id"]))
    return max(10, math.ceil(math.log2(max(distinct, 2))))


def libcachesim_run(lcs, oracle: str, policy: str, capacity: int, hashpower: int) -> tuple[tuple[float, float], Counts]:
    """One run of libCacheSim's policy with a ``hashpower`` table (``table_power``): open the
    reader, process the trace; ((wall, CPU seconds), libCacheSim's own counts: its cache's
    request count, and its miss ratio times that count, the misses it counted)."""
    started, cpu = time.perf_counter(), time.process_time()
    reader = lcs.TraceReader(oracle, lcs.TraceType.ORACLE_GENERAL_TRACE)
    cache = getattr(lcs, LIBCACHESIM[policy])(cache_size=capacity, hashpower=hashpower)
    miss_ratio, _ = cache.process_trace(reader)
    seconds = (time.perf_counter() - started, time.process_time() - cpu)
    requests = int(cache._cache.n_req)  # the requests its cache processed (the Python wrapper has no public getter)
    return seconds, Counts(requests, round(float(miss_ratio) * requests))


def warm_up() -> None:
    """Both sides' one-time costs, paid before any clock starts: tiercache's kernels and
    loaders (``replay_kernels``), and libCacheSim's start-up (its first runs in a process cost
    about ten steady ones), each of its policies run once on ``WARMUP_TRACE``'s oracleGeneral
    export."""
    replay_kernels()
    try:
        import libcachesim as lcs
    except ImportError:
        return
    from tiercache.sim.oracle import export_oracle_general

    with tempfile.TemporaryDirectory() as tmp:
        oracle = os.path.join(tmp, "warmup.oracleGeneral")
        export_oracle_general(str(WARMUP_TRACE), oracle)
        for policy in LIBCACHESIM:
            libcachesim_run(lcs, oracle, policy, 50, table_power(oracle))


def replay_kernels() -> None:
    """Compiles (or loads) every kernel and the loaders: every policy replayed on
    ``WARMUP_TRACE`` in both semantics, on one tier and two."""
    from tiercache.config import TierConfig
    from tiercache.results import Semantics
    from tiercache.sim.loader import load_trace
    from tiercache.sim.replay import ReplayData, RunSpec, replay

    data = ReplayData.prepare(load_trace(WARMUP_TRACE), None, None)
    for policy in LIBCACHESIM:
        for semantics in (Semantics.OBJECT, Semantics.PREFIX):
            replay(RunSpec(policy, semantics, (TierConfig("hbm", 50), TierConfig("dram", 50))), data)
            replay(RunSpec(policy, semantics, (TierConfig("hbm", 50),)), data)


def compare_policies(trace: str, capacity: int, repeats: int) -> dict:
    """Per policy: medians of the three timed runs, rates, ratio, both sides' own counts, and
    ``problems`` (``check_counts``: empty when the comparison stands).

    Each policy's runs go through ``alternate``: one untimed run of every side first (so no
    side's first run of the policy on this trace is timed, whichever policy comes first), then
    ``repeats`` rounds, the side that goes first rotating (entry ``i`` of every side ran in the
    same round, so per-round ratios compare neighbours)."""
    try:
        import libcachesim as lcs
    except ImportError:
        lcs = None
    from tiercache.sim.oracle import LIBCACHESIM_MIN_CAPACITY, export_oracle_general, libcachesim_runs_at

    out = {}
    skipped = [policy for policy, name in LIBCACHESIM.items() if not libcachesim_runs_at(name, capacity)]
    if lcs is not None and skipped:
        print(f"not run on libCacheSim's side at {capacity} blocks: {', '.join(skipped)} (its sizing needs "
              f"{', '.join(f'{LIBCACHESIM[p]} {LIBCACHESIM_MIN_CAPACITY[LIBCACHESIM[p]]}' for p in skipped)} blocks or more; "
              "below that it misses every access or aborts); their rows are not compared")
    with tempfile.TemporaryDirectory() as tmp:
        oracle = os.path.join(tmp, "trace.oracleGeneral")
        export_oracle_general(trace, oracle)
        hashpower = table_power(oracle)
        cache_dir = os.path.join(tmp, "cache")
        tiercache_run(trace, "lru", capacity, cache_dir)  # writes the cache entry (not timed)
        for policy in LIBCACHESIM:
            runs = alternate(_sides(lcs, trace, oracle, cache_dir, policy, capacity, hashpower), repeats)
            cold, cached, theirs = ([seconds for seconds, _ in runs.get(side, [])] for side in ("cold", "cached", "libcachesim"))
            ours_counts = [Counts(r.accesses, r.misses) for side in ("cold", "cached") for _, r in runs[side]]
            their_counts = [counts for _, counts in runs.get("libcachesim", [])]
            row = policy_row(ours_counts[0], cold, cached, theirs, their_counts[0] if their_counts else None)
            row["problems"] = check_counts(policy, ours_counts, their_counts)
            out[policy] = row
    return out


def _sides(lcs, trace: str, oracle: str, cache_dir: str, policy: str, capacity: int, hashpower: int) -> dict:
    """One whole run of each side of ``policy`` as an op of ``alternate``: tiercache cold, tiercache
    from the trace cache, and libCacheSim where it is installed and runs at ``capacity``
    (``LIBCACHESIM_MIN_CAPACITY``: its S3-FIFO aborts the process below 10 blocks)."""
    from tiercache.sim.oracle import libcachesim_runs_at

    sides = {"cold": lambda _: tiercache_run(trace, policy, capacity, None),
             "cached": lambda _: tiercache_run(trace, policy, capacity, cache_dir)}
    if lcs is not None and libcachesim_runs_at(LIBCACHESIM[policy], capacity):
        sides["libcachesim"] = lambda _: libcachesim_run(lcs, oracle, policy, capacity, hashpower)
    return sides


def hierarchy_rates(trace: str, repeats: int) -> dict:
    """Block accesses per second of a prepared 3-tier prefix replay, per policy."""
    from tiercache.config import TierConfig, layout_preset
    from tiercache.results import Semantics
    from tiercache.sim.hardware import PRESETS
    from tiercache.sim.loader import load_trace
    from tiercache.sim.replay import ReplayData, RunSpec, replay

    data = ReplayData.prepare(load_trace(trace), layout_preset("llama-3-8b", 512), PRESETS["h200-pcie5-nvme4"])
    tiers = tuple(TierConfig(name, cap) for name, cap in HIERARCHY)
    out = {}
    for policy in LIBCACHESIM:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            record = replay(RunSpec(policy, Semantics.PREFIX, tiers), data)
            times.append(time.perf_counter() - started)
        out[policy] = {"accesses_per_s": record.accesses / statistics.median(times), "miss_ratio": record.miss_ratio,
                       "hbm_hits": record.tiers[0].hits}
    return out


#: Fresh interpreters per scale; the figures are their medians.
SCALE_REPEATS = 3
#: Unsampled runs timed in each interpreter after the sampled one (their median is its time).
TIMED_RUNS = 3
#: Trace copies timed for the scaling figures: 1x and 10x as the issue asks, and 100x so that a
#: ratio between two sizes whose replay state is far past the CPU's L2 is printed too (a ratio
#: near 10 per step is linear; one 1x run takes under 10 ms, so 10x/1x moves with the load).
SCALES = (1, 10, 100)


def scale_case(trace: str, copies: int) -> dict:
    """(In a fresh interpreter.) Load + prepare + 3-tier LRU prefix replay of ``copies``
    copies of the trace with disjoint ids: the process's peak RSS and the peak RSS growth
    over a first run (sampled every 0.5 ms from just before it starts), then the median seconds
    of ``TIMED_RUNS`` unsampled runs (the sampling thread competes for the GIL and made the time
    vary 2.5x between runs)."""
    from tiercache.config import TierConfig
    from tiercache.results import Semantics
    from tiercache.sim.loader import load_trace
    from tiercache.sim.replay import ReplayData, RunSpec, replay

    warm_up()
    spec = RunSpec("lru", Semantics.PREFIX, tuple(TierConfig(n, c * copies) for n, c in HIERARCHY))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "scaled.jsonl")
        _write_copies(trace, path, copies)
        with _RssSampler() as rss:  # the sampling thread takes the GIL every 0.5 ms: not timed
            data = ReplayData.prepare(load_trace(path), None, None)
            record = replay(spec, data)
        times = []
        for _ in range(TIMED_RUNS):
            del data
            started = time.perf_counter()
            data = ReplayData.prepare(load_trace(path), None, None)
            replay(spec, data)
            times.append(time.perf_counter() - started)
        seconds = statistics.median(times)
    held = int(data.ids.nbytes + data.next_use.nbytes + data.dense.nbytes + data.offsets.nbytes)
    return {"seconds": seconds, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_rss_growth_bytes": rss.growth, "accesses": record.accesses, "replay_array_bytes": held}


class _RssSampler:
    """Highest RSS seen by a thread sampling every 0.5 ms, minus the RSS at the start."""

    def __enter__(self) -> "_RssSampler":
        import threading

        import psutil

        self._process = psutil.Process()
        self._start = self._peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.0005):
            self._peak = max(self._peak, self._process.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._process.memory_info().rss)
        self.growth = self._peak - self._start


def _write_copies(trace: str, path: str, copies: int) -> None:
    """``copies`` copies of the trace, copy ``k``'s ids shifted by ``k * (max id + 1)``."""
    from tiercache.sim.traces import iter_requests, request_json

    requests = list(iter_requests(trace))
    shift = max((max(r.hash_ids, default=0) for r in requests), default=0) + 1
    span = requests[-1].timestamp + 1
    with open(path, "w", encoding="utf-8") as out:
        for k in range(copies):
            for r in requests:
                moved = r.__class__(r.timestamp + k * span, r.input_length, r.output_length,
                                    tuple(i + k * shift for i in r.hash_ids))
                out.write(request_json(moved) + "\n")


def scaling(trace: str) -> dict:
    """``scale_case`` at each of ``SCALES``, each ``SCALE_REPEATS`` times in its own interpreter;
    every figure is the median over them."""
    out = {}
    for copies in SCALES:
        cmd = [sys.executable, __file__, "--trace", trace, "--scale-case", str(copies)]
        rows = [json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
                for _ in range(SCALE_REPEATS)]
        row = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        row["rss_growth_per_access_bytes"] = row["peak_rss_growth_bytes"] / row["accesses"]
        out[f"{copies}x"] = row
    for small, large in zip(SCALES, SCALES[1:]):
        a, b = out[f"{small}x"], out[f"{large}x"]
        out[f"time_ratio_{large}x_to_{small}x"] = b["seconds"] / a["seconds"]
        out[f"rss_growth_ratio_{large}x_to_{small}x"] = b["peak_rss_growth_bytes"] / max(a["peak_rss_growth_bytes"], 1)
    return out


#: ``--kernel-rates``: the prefix-tree policies whose kernel rates README quotes, and capacities.
KERNEL_POLICIES = ("session", "leaf_lru", "cost")
KERNEL_CAPACITIES = (1000, 16000)


def kernel_case(trace: str) -> dict:
    """(In a fresh interpreter; ``TIERCACHE_NO_NUMBA=1`` for the Python path.) CPU seconds of
    one replay per policy and capacity of ``KERNEL_POLICIES`` x ``KERNEL_CAPACITIES``, prefix
    semantics, one tier, on the prepared trace, after an untimed replay of each policy on
    ``WARMUP_TRACE`` (imports, kernel loading); with each run's counts and the path it took."""
    from tiercache.config import TierConfig
    from tiercache.results import Semantics
    from tiercache.sim.loader import load_trace
    from tiercache.sim.replay import ReplayData, RunSpec, kernel_state_fits, replay, use_kernels

    warm, data = (ReplayData.prepare(load_trace(path), None, None) for path in (WARMUP_TRACE, trace))
    out = {}
    for policy in KERNEL_POLICIES:
        replay(RunSpec(policy, Semantics.PREFIX, (TierConfig("hbm", 50),)), warm)
        for capacity in KERNEL_CAPACITIES:
            spec = RunSpec(policy, Semantics.PREFIX, (TierConfig("hbm", capacity),))
            cpu = time.process_time()
            record = replay(spec, data)
            out[f"{policy}@{capacity}"] = {"cpu_s": time.process_time() - cpu, "accesses": record.accesses,
                                           "misses": record.misses, "kernel": use_kernels(spec) and kernel_state_fits(spec, data)}
    return out


def kernel_rates(trace: str, repeats: int) -> dict:
    """``kernel_case`` with the kernels and with ``TIERCACHE_NO_NUMBA=1``, each in its own fresh
    interpreter, once per round for ``repeats`` rounds, the way that goes first alternating;
    ``kernel_rows`` of them."""
    plain = {k: v for k, v in os.environ.items() if k != "TIERCACHE_NO_NUMBA"}
    envs = {"kernel": plain, "python": {**plain, "TIERCACHE_NO_NUMBA": "1"}}
    runs: dict[str, list[dict]] = {side: [] for side in envs}
    for index in range(repeats):
        for side in (("kernel", "python") if index % 2 == 0 else ("python", "kernel")):
            done = subprocess.run([sys.executable, __file__, "--trace", trace, "--kernel-case"], capture_output=True,
                                  text=True, check=True, env=envs[side])
            runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return kernel_rows(runs)


def time_sweep(trace: str) -> tuple[float, int]:
    """Wall seconds of the 7 x 3 sweep with one worker per core."""
    from tiercache.results import Semantics
    from tiercache.sim.loader import load_trace
    from tiercache.sim.sweep import SweepSpec, sweep

    started = time.perf_counter()
    spec = SweepSpec(tuple(SWEEP_POLICIES), (Semantics.OBJECT,), tuple(SWEEP_CAPACITIES))
    doc = sweep(load_trace(trace), spec, workers=os.cpu_count() or 1)
    return time.perf_counter() - started, len(doc.runs)


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--capacity", type=positive_int, default=4000)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--kernel-rates", action="store_true",
                        help="only time the kernels against the Python manager (session, leaf_lru, cost; --repeats rounds)")
    parser.add_argument("--scale-case", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--kernel-case", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not os.path.isfile(args.trace):  # its copies and its oracleGeneral export need a request trace file
        parser.error(f"--trace {args.trace}: not a trace file (missing, a folder, a device or a FIFO)")
    refuse_bad_outputs(parser, {"--json": args.json}, inputs=[args.trace])  # before the run (minutes), not after it
    if args.scale_case is not None:
        print(json.dumps(scale_case(args.trace, args.scale_case)))
        return 0
    if args.kernel_case:
        print(json.dumps(kernel_case(args.trace)))
        return 0
    if args.kernel_rates:
        return report_kernel_rates(args)
    from tiercache.policies.kernels import HAVE_NUMBA

    warm_up()
    policies = compare_policies(args.trace, args.capacity, args.repeats)
    lru = policies["lru"]
    result = {"trace": args.trace, "accesses": lru["accesses_tiercache"],
              "capacity": args.capacity, "repeats": args.repeats, "numba": HAVE_NUMBA,
              "jit": "numba cache=True (compiled once per machine) and a warm-up replay of every policy before timing",
              "timed": "load from disk (cold JSONL parse; cached: binary trace cache) + prepare + replay; libCacheSim: reader on oracleGeneral + process_trace, its hash table sized to the trace's distinct objects (table_power)",
              "clock": "CPU seconds (time.process_time) per run, medians; ratios: medians of per-repeat ratios",
              "tiercache": {"median_s": lru["tiercache_cpu_s"], "accesses_per_s": lru["tiercache_accesses_per_s"],
                            "miss_ratio": lru["miss_ratio_tiercache"], "cached_accesses_per_s": lru["tiercache_cached_accesses_per_s"]}}
    if "ratio" in lru:
        result["libcachesim"] = {"median_s": lru["libcachesim_cpu_s"], "accesses_per_s": lru["libcachesim_accesses_per_s"],
                                 "miss_ratio": lru["miss_ratio_libcachesim"]}
        result["ratio_tiercache_to_libcachesim"] = lru["ratio"]
    result["policies"] = policies
    problems = [problem for row in policies.values() for problem in row["problems"]]
    if problems:  # the rates do not compare: stop before the later parts, write nothing
        print_policies(result)
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        print("error: the two sides did not do the same work; no figures written", file=sys.stderr)
        return 1
    result["hierarchy"] = {"tiers": [list(t) for t in HIERARCHY], "semantics": "prefix", "repeats": args.repeats,
                           "policies": hierarchy_rates(args.trace, args.repeats)}
    result["scaling"] = scaling(args.trace)
    sweep_s, runs = time_sweep(args.trace)
    result["sweep"] = {"policies": SWEEP_POLICIES, "capacities": SWEEP_CAPACITIES, "runs": runs, "wall_s": sweep_s,
                       "workers": os.cpu_count()}
    print_table(result)
    return write_json(args.json, result)


def report_kernel_rates(args: argparse.Namespace) -> int:
    """``--kernel-rates``: prints ``kernel_rates``' table and writes it to ``--json``; exit 1,
    nothing written, when a side took the other path or the two counted differently."""
    rows = kernel_rates(args.trace, args.repeats)
    result = {"trace": args.trace, "accesses": next(iter(rows.values()))["accesses"], "repeats": args.repeats,
              "semantics": "prefix", "clock": "CPU seconds of the replay alone; ratios: medians of per-round ratios",
              "kernel_rates": rows}
    print_kernel_rates(result)
    problems = [problem for row in rows.values() for problem in row["problems"]]
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        print("error: the two paths did not do the same work; no figures written", file=sys.stderr)
        return 1
    return write_json(args.json, result)


def write_json(path: str | None, result: dict) -> int:
    """Writes ``result`` to ``path`` (checked before the run) whole or not at all; the exit
    status: 1 with one line when the write fails now (a full disk)."""
    if path:
        try:
            replace_file(path, json.dumps(result, indent=1), f"--json {path}")
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    return 0


def print_table(result: dict) -> None:
    print_policies(result)
    h = result["hierarchy"]
    print(f"3 tiers {h['tiers']} prefix semantics, prepared trace (wall time, median of {h['repeats']}): " +
          ", ".join(f"{p} {r['accesses_per_s'] / 1e6:.1f}M/s" for p, r in h["policies"].items()))
    s = result["scaling"]
    for key in (f"{copies}x" for copies in SCALES):
        row = s[key]
        print(f"{key:>4}: {row['accesses']:>9,} accesses, load+prepare+replay {row['seconds']:.3f} s "
              f"({row['seconds'] / row['accesses'] * 1e9:.0f} ns/access), "
              f"peak RSS {row['peak_rss_bytes'] / 2**20:.0f} MiB, grew {row['peak_rss_growth_bytes'] / 2**20:.1f} MiB "
              f"during the run ({row['rss_growth_per_access_bytes']:.0f} B/access; replay arrays "
              f"{row['replay_array_bytes'] / row['accesses']:.0f} B/access)")
    for small, large in zip(SCALES, SCALES[1:]):
        print(f"{large}x / {small}x: time {s[f'time_ratio_{large}x_to_{small}x']:.1f}x, "
              f"peak RSS growth {s[f'rss_growth_ratio_{large}x_to_{small}x']:.1f}x")
    sweep = result["sweep"]
    print(f"sweep {len(sweep['policies'])} policies x {len(sweep['capacities'])} capacities = {sweep['runs']} runs: "
          f"{sweep['wall_s']:.2f} s wall with {sweep['workers']} workers (one run)")



if __name__ == "__main__":
    sys.exit(main())
