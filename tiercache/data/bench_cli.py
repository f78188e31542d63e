"""``tiercache bench``: the data plane against the raw hardware, side by side in one run.

Three comparisons, each over several repetitions (DESIGN.md section 8):

(a) DRAM -> HBM block copies through ``BlockPool.copy_to`` (random slots) vs one raw
    ``copy_`` of the same bytes (host copies without CUDA; pinned -> device with CUDA,
    timed with CUDA events);
(b) NVMe block writes through ``NVMeStore.put`` + ``flush`` vs a raw pwrite loop of the
    same blocks (from the same DRAM slots), block size, concurrency and sync policy;
(c) cold NVMe block reads through ``NVMeStore.get`` (after dropping the store's own files
    from the page cache) vs a raw O_DIRECT preadv loop over the same chunk files into the
    same DRAM slots (and, for context, over one big laid-out file per thread).

Tiercache and raw alternate round by round (disk: slice by slice of the blocks), the side
that goes first rotating. GB/s figures are medians over repetitions; each ratio is the
median over all rounds of the ratio of two neighbouring measurements, which cancels the
disk's regime switches. zarr's own Python API is measured once on the same blocks for
reference. Torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
from dataclasses import dataclass

from ..config import KVLayout, layout_preset
from ..errors import UserError

__all__ = ["add_parser", "BenchConfig", "run_bench", "main"]

_QUICK_LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=32, per_layer=True, name="quick")


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run measures. Invariants: blocks, threads, reps >= 1."""

    layout: KVLayout
    blocks: int
    threads: int
    reps: int
    directory: str
    zarr_api: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("blocks", "threads", "reps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"bench: --{name} must be a positive integer, got {value!r}")

    @property
    def total_bytes(self) -> int:
        """Bytes moved by one repetition of one comparison."""
        return self.blocks * self.layout.block_bytes


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``tiercache bench``."""
    p = subparsers.add_parser("bench", help="measure the HBM/DRAM/NVMe data plane against raw copies and raw disk I/O",
                              description="Measure the data plane against the raw hardware, side by side in one run.")
    p.add_argument("--model", default="llama-3-8b", help="layout preset (default llama-3-8b)")
    p.add_argument("--block-tokens", type=int, default=256, help="tokens per block (default 256)")
    p.add_argument("--all-layers", action="store_true", help="blocks hold every layer (default: one layer per block, 1 MiB for llama-3-8b)")
    p.add_argument("--blocks", type=int, default=384, help="blocks per repetition (default 384)")
    p.add_argument("--threads", type=int, default=4, help="I/O threads for the store and the raw loops (default 4)")
    p.add_argument("--reps", type=int, default=5, help="repetitions; medians are reported (default 5)")
    p.add_argument("--dir", default=".", help="directory on the disk to measure (a temporary folder is made inside)")
    p.add_argument("--json", default="bench_tiers.json", help="where to write the results (default bench_tiers.json)")
    p.add_argument("--save-profile", metavar="PATH", help="also write the measured links as a hardware profile JSON")
    p.add_argument("--no-zarr-api", action="store_true", help="skip the zarr Python API reference measurement")
    p.add_argument("--quick", action="store_true", help="tiny run (16 small blocks, 2 repetitions) for smoke tests")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)


def _config(args: argparse.Namespace, directory: str) -> BenchConfig:
    """Turns parsed options into a config; ``--quick`` overrides sizes."""
    if args.quick:
        return BenchConfig(_QUICK_LAYOUT, 16, 2, 2, directory, not args.no_zarr_api, args.seed)
    layout = layout_preset(args.model, args.block_tokens)
    if not args.all_layers:
        layout = KVLayout(layout.layers, layout.kv_heads, layout.head_dim, layout.dtype, layout.block_tokens, True, layout.name)
    return BenchConfig(layout, args.blocks, args.threads, args.reps, directory, not args.no_zarr_api, args.seed)


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark, prints the table, writes the JSON (and the profile)."""
    if not os.path.isdir(args.dir):
        raise UserError(f"--dir {args.dir}: not a directory")
    workdir = tempfile.mkdtemp(prefix=".tiercache-bench-", dir=args.dir)
    try:
        result = run_bench(_config(args, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(format_table(result))
    _write_json(args.json, result)
    if args.save_profile:
        save_measured_profile(result, args.save_profile)
        print(f"hardware profile written to {args.save_profile}")
    return 0


def _write_json(path: str, data: dict) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    except OSError as exc:
        raise UserError(f"--json {path}: cannot write: {exc.strerror or exc}") from None
    print(f"results written to {path}")


# ----- measurement ---------------------------------------------------------------------


def run_bench(cfg: BenchConfig) -> dict:
    """Measures every comparison ``cfg.reps`` times; returns the result document."""
    from . import bench_measure as m  # torch lives there

    bench = m.Bench(cfg)
    try:
        first_fill = bench.first_fill()
        samples = bench.repeat()
        latency = bench.latencies()
        zarr_api = bench.zarr_api() if cfg.zarr_api else None
        machine = bench.machine()
    finally:
        bench.close()
    return _document(cfg, samples, first_fill, latency, zarr_api, machine)


# The ratios the data plane is held to; the others are reported for context.
TARGET_RATIOS = ("host_to_device", "disk_write", "disk_read_cold")


def _document(cfg: BenchConfig, samples: dict, first_fill: dict, latency: dict, zarr_api: dict | None, machine: dict) -> dict:
    """Assembles the JSON document.

    ``raw``/``tiercache`` are medians over repetitions (GB/s). A ratio is the median over
    every round of the tiercache/raw throughput ratio of the two measurements made right
    next to each other: the disk here switches between speed regimes within seconds, and
    pairing neighbours cancels that where a ratio of medians would not.
    ``ratio_of_medians`` is given as well.
    """
    tc = {name: statistics.median(v) for name, v in samples["tiercache"].items()}
    raw = {name: statistics.median(v) for name, v in samples["raw"].items()}
    paired = {name: statistics.median(v) for name, v in samples["paired"].items()}
    return {
        "ratios": {name: paired[name] for name in TARGET_RATIOS},
        "raw": raw,
        "tiercache": tc,
        "other_ratios": {
            "device_to_host": paired["device_to_host"],
            "disk_read_cold_vs_one_big_file": statistics.median(samples["paired_file"]["disk_read_cold"]),
            "disk_write_first_fill": first_fill["ratio"],
        },
        "ratio_of_medians": {name: tc[name] / raw[name] for name in tc},
        "disk_read_cold_one_big_file": {"raw": statistics.median(samples["raw_file"]["disk_read_cold"]),
                                        "note": "raw O_DIRECT preadv from one laid-out file per thread instead of the chunk files"},
        "first_fill_write": first_fill,
        "units": "GB/s (1e9 bytes per second); ratios are tiercache / raw",
        "zarr_api": zarr_api,
        "latency_s": latency,
        "samples": samples,
        "config": {
            "layout": cfg.layout.name, "block_shape": list(cfg.layout.block_shape), "dtype": cfg.layout.dtype,
            "block_bytes": cfg.layout.block_bytes, "blocks": cfg.blocks, "threads": cfg.threads, "reps": cfg.reps,
        },
        "machine": machine,
    }


def format_table(result: dict) -> str:
    """The human-readable summary: one row per comparison, then the zarr API reference."""
    labels = {
        "host_to_device": "DRAM->HBM block copies",
        "device_to_host": "HBM->DRAM block copies",
        "disk_write": "NVMe block writes",
        "disk_read_cold": "NVMe cold block reads",
    }
    m, cfg = result["machine"], result["config"]
    lines = [
        f"tiercache bench: {cfg['blocks']} blocks of {cfg['block_bytes']} B ({cfg['layout']}, {cfg['dtype']}),"
        f" {cfg['threads']} threads, {cfg['reps']} reps, device {m['device']}; GB/s: medians over reps; ratio: median over paired rounds",
        f"{'path':<26}{'tiercache GB/s':>16}{'raw GB/s':>10}{'ratio':>8}  raw baseline",
    ]
    ratios = {**result["ratios"], **result["other_ratios"]}
    for name, label in labels.items():
        lines.append(f"{label:<26}{result['tiercache'][name]:>16.2f}{result['raw'][name]:>10.2f}"
                     f"{ratios[name]:>8.2f}  {m['baselines'][name]}")
    big = result["disk_read_cold_one_big_file"]
    lines.append(f"{'NVMe cold reads, big file':<26}{result['tiercache']['disk_read_cold']:>16.2f}{big['raw']:>10.2f}"
                 f"{ratios['disk_read_cold_vs_one_big_file']:>8.2f}  O_DIRECT preadv from one laid-out file per thread (format cost included)")
    f = result.get("first_fill_write")
    if f:
        lines.append(f"{'NVMe writes, first fill':<26}{f['tiercache']:>16.2f}{f['raw']:>10.2f}{f['ratio']:>8.2f}"
                     "  new chunk files (temp+rename) vs new raw files; once, not a target")
    z = result["zarr_api"]
    if z:
        lines.append(f"zarr API (per-chunk assignment, no fsync): write {z['write']:.2f} GB/s, cold read {z['read_cold']:.2f} GB/s;"
                     f" direct chunk I/O: write {result['tiercache']['disk_write']:.2f} GB/s, cold read {result['tiercache']['disk_read_cold']:.2f} GB/s")
    return "\n".join(lines)


def save_measured_profile(result: dict, path: str) -> None:
    """Writes the measured links (tiercache throughput, raw small-transfer latency) as a
    hardware profile that ``tiercache.sim.hardware.load_profile`` reads."""
    from ..sim.hardware import HardwareProfile, Link, save_profile

    tc, lat = result["tiercache"], result["latency_s"]
    links = {
        "dram->hbm": Link(tc["host_to_device"] * 1e9, lat["host_to_device"]),
        "hbm->dram": Link(tc["device_to_host"] * 1e9, lat["device_to_host"]),
        "nvme->dram": Link(tc["disk_read_cold"] * 1e9, lat["disk_read_cold"]),
        "dram->nvme": Link(tc["disk_write"] * 1e9, lat["disk_write"]),
    }
    save_profile(HardwareProfile(f"measured-{socket.gethostname()}", links, 10000.0), path)

