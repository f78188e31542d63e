#!/usr/bin/env python3
"""Memory at scale (issue 8 item 12): bytes per slot of capacity, reopen time, bytes per access.

Usage: python scripts/bench_memory.py [--sizes 1000000,10000000] [--speed] [--json out.json]

Each figure is measured in a fresh child process (``--case``), so one case's garbage never
counts in another's, and each case runs twice, in two children: ``traced`` is what
``tracemalloc`` sees allocated by the case (numpy arrays included, untouched pages too);
``rss`` is the resident-set growth (psutil) of the other child, which runs the case with
``tracemalloc`` off (its own bookkeeping, a few hundred bytes per live allocation, would
otherwise count as the structure's: 836 against 373 B/slot for a full ``SlotTable``); rss
misses zero pages numpy never touched.

* ``directory``: a ``TierDirectory`` of N slots, empty, and full (N blocks published, ids
  created before measuring: they belong to the caller, e.g. the replay's trace list).
* ``slottable``: the NVMe store's in-memory ``SlotTable`` of N slots after ``finish_load``,
  empty, and full (N 16-byte keys published; the keys count: the table owns them).
* ``reopen``: seconds to reopen (untraced, then closed) an ``NVMeStore`` of
  ``--store-slots`` slots holding ``--store-blocks`` tiny blocks after a clean close, and
  the bytes a second reopened store holds (traced).
* ``replay``: peak traced bytes of loading, preparing and replaying the bundled trace (LRU,
  4,000 blocks), per block access, after a replay of another trace has loaded the modules
  and the kernel (a one-time cost).
* ``--speed``: CPU seconds (``time.process_time``) per replay of sieve, arc and lru at 4,000
  blocks, median of ``--repeats``; each policy is replayed once untimed first (warm-up), so
  loading or compiling its kernel is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import psutil

from tiercache.bench.rounds import positive_int
from tiercache.bench.script_args import ScriptParser, positive_ints, refuse_bad_outputs

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl"
#: Another trace replayed before the measured replay: the modules, numba's kernel and their
#: caches are loaded once per process, not a cost per access (57 of 61 MB when measured cold).
WARM_UP_TRACE = ROOT / "tests" / "data" / "mooncake_head.jsonl"
SPEED_POLICIES = ("sieve", "arc", "lru")


#: The two passes of a case, each in its own child: what ``Meter`` measures in it.
PASSES = ("traced", "rss")


class Meter:
    """One pass's memory growth between ``start`` and ``stop`` (one per child).

    Invariant: a ``"traced"`` meter reads only ``tracemalloc`` (``traced``, ``peak``); an
    ``"rss"`` meter reads only the resident set (``rss``) and never runs ``tracemalloc``,
    so the profiler's own memory is never counted as the case's.
    """

    def __init__(self, mode: str) -> None:
        if mode not in PASSES:
            raise ValueError(f"Meter: mode must be one of {PASSES}, got {mode!r}")
        self.mode = mode

    def start(self) -> None:
        if self.mode == "traced":
            tracemalloc.start()
        else:
            self.rss0 = psutil.Process().memory_info().rss

    def stop(self) -> dict:
        if self.mode == "rss":
            return {"rss": psutil.Process().memory_info().rss - self.rss0}
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return {"traced": current, "peak": peak}


def case_directory(meter: Meter, n: int, full: bool) -> dict:
    """A ``TierDirectory`` of ``n`` slots, optionally filled with ``n`` blocks."""
    from tiercache.core.directory import TierDirectory

    ids = list(range(n)) if full else []
    meter.start()
    directory = TierDirectory("t", n)
    for a in range(0, len(ids), 65536):
        directory.insert(ids[a : a + 65536])
    out = meter.stop()
    assert len(directory) == len(ids)
    return out


def case_slottable(meter: Meter, n: int, full: bool) -> dict:
    """An NVMe ``SlotTable`` of ``n`` slots as ``finish_load`` leaves it, optionally full."""
    from tiercache.data.nvme_index import SlotTable

    meter.start()
    table = SlotTable(n)
    table.finish_load()
    if full:
        for slot, gen in table.reserve(n):
            table.publish(slot.to_bytes(16, "little"), slot, gen, 4096, 0)
        table.take_pending()
    out = meter.stop()
    assert len(table) == (n if full else 0)
    return out


def case_reopen(meter: Meter, slots: int, blocks: int) -> dict:
    """Seconds and memory to reopen a cleanly closed store of ``slots`` slots."""
    import torch

    from tiercache.config import KVLayout
    from tiercache.data.nvme import NVMeStore

    layout = KVLayout(layers=1, kv_heads=1, head_dim=4, dtype="float16", block_tokens=2)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        path = os.path.join(tmp, "store")
        started = time.perf_counter()
        store = NVMeStore(path, layout, capacity_blocks=slots, direct_io=False)
        created = time.perf_counter() - started
        data = torch.zeros((min(blocks, 1024), *layout.block_shape), dtype=torch.float16)
        for a in range(0, blocks, len(data)):
            keys = [i.to_bytes(16, "little") for i in range(a, min(a + len(data), blocks))]
            store.put(keys, data[: len(keys)])
        store.close()
        started = time.perf_counter()  # untraced: tracemalloc slows allocation-heavy code
        NVMeStore(path, layout, direct_io=False).close()
        reopen = time.perf_counter() - started
        meter.start()
        store = NVMeStore(path, layout, direct_io=False)
        out = meter.stop()
        assert len(store) == blocks
        store.close()
    return {**out, "create_s": created, "reopen_s": reopen}


def case_replay(meter: Meter) -> dict:
    """Memory of load + prepare + replay of the bundled trace (peak traced, rss growth)."""
    from tiercache.config import TierConfig
    from tiercache.results import Semantics
    from tiercache.sim.loader import load_trace
    from tiercache.sim.replay import ReplayData, RunSpec, replay

    spec = RunSpec("lru", Semantics.OBJECT, (TierConfig("hbm", 4000),))
    replay(spec, ReplayData.prepare(load_trace(str(WARM_UP_TRACE)), None, None))  # loads modules and the kernel: once per process
    meter.start()
    data = ReplayData.prepare(load_trace(str(TRACE)), None, None)
    record = replay(spec, data)
    out = meter.stop()
    return {**out, "accesses": record.accesses}


def case_speed(repeats: int) -> dict:
    """Median CPU seconds per replay of each of ``SPEED_POLICIES`` at 4,000 blocks, over
    ``repeats`` timed replays that follow one untimed replay of the same policy (the first
    loads, or compiles, its kernel: not a replay's cost)."""
    from tiercache.config import TierConfig
    from tiercache.results import Semantics
    from tiercache.sim.loader import load_trace
    from tiercache.sim.replay import ReplayData, RunSpec, replay

    data = ReplayData.prepare(load_trace(str(TRACE)), None, None)
    out = {}
    for policy in SPEED_POLICIES:
        spec = RunSpec(policy, Semantics.OBJECT, (TierConfig("hbm", 4000),))
        replay(spec, data)  # warm-up, untimed: loads (or compiles) the policy's kernel
        times = []
        for _ in range(repeats):
            started = time.process_time()
            record = replay(spec, data)
            times.append(time.process_time() - started)
        out[policy] = {"cpu_s": statistics.median(times), "accesses_per_cpu_s": record.accesses / statistics.median(times),
                       "warm_up": "one untimed replay first"}
    return out


def run_child(*args: str) -> dict:
    """Runs ``--case ARGS`` in a fresh interpreter and returns its JSON (``{"error": ...}``
    with the child's last line of stderr when it failed)."""
    cmd = [sys.executable, __file__, "--case", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}"}
    return json.loads(done.stdout)


def run_case(kind: str, *args: str) -> dict:
    """One memory case measured in both ``PASSES``, each in its own child: ``traced`` and
    ``peak`` from the traced pass, ``rss`` (and any timings) from the untraced one."""
    untraced = run_child("rss", kind, *args)
    if "error" in untraced:
        return untraced
    traced = run_child("traced", kind, *args)
    if "error" in traced:
        return traced
    return {**untraced, "traced": traced["traced"], "peak": traced["peak"]}


def child(args: list[str]) -> int:
    """The ``--case`` entry point: ``--case PASS KIND N...`` (``PASS`` one of ``PASSES``)
    prints one pass of a memory case as JSON; ``--case speed REPEATS`` the CPU times."""
    if args[0] == "speed":
        print(json.dumps(case_speed(int(args[1]))))
        return 0
    meter, kind, rest = Meter(args[0]), args[1], [int(a) for a in args[2:]]
    cases = {"directory": lambda: case_directory(meter, rest[0], bool(rest[1])),
             "slottable": lambda: case_slottable(meter, rest[0], bool(rest[1])),
             "reopen": lambda: case_reopen(meter, rest[0], rest[1]), "replay": lambda: case_replay(meter)}
    print(json.dumps(cases[kind]()))
    return 0


def measure(sizes: list[int], store_slots: int, store_blocks: int, speed: bool, repeats: int, full_max: int) -> dict:
    """Every case of the module docstring, each in its own child (a full ``SlotTable`` only
    up to ``full_max`` slots: before issue 8 item 12 it took ~750 B/slot resident while traced).
    ``sizes`` are positive (figures are per slot)."""
    result: dict = {"sizes": sizes, "directory": {}, "slottable": {}}
    for kind in ("directory", "slottable"):
        for n in sizes:
            states = ("empty", "full") if kind == "directory" or n <= full_max else ("empty",)
            result[kind][str(n)] = {state: run_case(kind, str(n), str(int(state == "full"))) for state in states}
    result["reopen"] = {"slots": store_slots, "blocks": store_blocks, **run_case("reopen", str(store_slots), str(store_blocks))}
    result["replay"] = run_case("replay")
    if speed:
        result["speed"] = run_child("speed", str(repeats))
        result["speed_repeats"] = repeats
    return result


def print_table(result: dict) -> None:
    """The figures as a plain table."""
    print(f"{'structure':<12} {'slots':>11} {'state':<6} {'traced B/slot':>14} {'rss B/slot':>11}")
    for kind in ("directory", "slottable"):
        for n, states in result[kind].items():
            for state, row in states.items():
                if "error" in row:
                    print(f"{kind:<12} {int(n):>11,} {state:<6} error: {row['error']}")
                    continue
                print(f"{kind:<12} {int(n):>11,} {state:<6} {row['traced'] / int(n):>14.1f} {row['rss'] / int(n):>11.1f}")
    reopen = result["reopen"]
    if "error" in reopen:
        print(f"NVMeStore reopen: error: {reopen['error']}")
    else:
        print(f"NVMeStore {reopen['slots']:,} slots, {reopen['blocks']:,} blocks: create {reopen['create_s']:.2f} s, "
              f"reopen {reopen['reopen_s']:.2f} s (one run, files in the page cache), "
              f"{reopen['traced'] / reopen['slots']:.1f} B/slot traced after reopen")
    rep = result["replay"]
    if "error" in rep:
        print(f"replay: error: {rep['error']}")
    else:
        print(f"replay (bundled trace, lru 4000): {rep['accesses']:,} accesses, {rep['peak'] / rep['accesses']:.1f} B/access "
              f"traced at its peak, {rep['rss'] / rep['accesses']:.1f} B/access rss growth at its end")
    print("traced: tracemalloc's count; rss: resident-set growth in a separate run of the same case without tracemalloc")
    speed = result.get("speed", {})
    if "error" in speed:
        print(f"replay cpu: error: {speed['error']}")
        speed = {}
    for policy, row in speed.items():
        print(f"replay cpu {policy:<6} {row['cpu_s']:.3f} s  {row['accesses_per_cpu_s']:,.0f} accesses/cpu-s "
              f"(median of {result['speed_repeats']}, after one untimed warm-up replay: kernel load/compile excluded)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked before any work (one line and exit 2 otherwise): sizes and
    counts positive, ``--store-blocks`` at most ``--store-slots``, ``--json`` writable."""
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=positive_ints, default=[1_000_000, 10_000_000],
                        help="slot counts, comma separated (default 1000000,10000000)")
    parser.add_argument("--store-slots", type=positive_int, default=1_000_000)
    parser.add_argument("--store-blocks", type=positive_int, default=4000)
    parser.add_argument("--speed", action="store_true",
                        help="also time sieve/arc/lru replays (CPU seconds; one untimed warm-up replay per policy "
                             "first, so kernel load/compile is excluded)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed replays per policy with --speed (median)")
    parser.add_argument("--full-max", type=positive_int, default=2_000_000, help="largest full SlotTable measured")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.store_blocks > args.store_slots:
        parser.error(f"--store-blocks: at most --store-slots {args.store_slots}, got {args.store_blocks}")
    refuse_bad_outputs(parser, {"--json": args.json})
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--case":
        return child(argv[1:])
    args = parse_args(argv)
    result = measure(args.sizes, args.store_slots, args.store_blocks, args.speed, args.repeats, args.full_max)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    failed = failed_cases(result)
    for name in failed:
        print(f"error: {name} failed (its error is above or in the JSON)", file=sys.stderr)
    return 1 if failed else 0


def failed_cases(result: dict) -> list[str]:
    """The cases of ``result`` that ended in an error (each a row with an ``error``)."""
    failed = [f"{kind} {n} {state}" for kind in ("directory", "slottable") for n, states in result[kind].items()
              for state, row in states.items() if "error" in row]
    return failed + [name for name in ("reopen", "replay", "speed") if "error" in result.get(name, {})]


if __name__ == "__main__":
    sys.exit(main())
