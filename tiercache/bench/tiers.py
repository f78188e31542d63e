"""The data plane against the raw hardware, side by side in one run (``tiercache bench``).

Three comparisons, each over several repetitions (DESIGN.md section 8):

(a) DRAM -> HBM block copies through ``BlockPool.copy_to`` (random slots) vs the raw
    copy of the same bytes: with CUDA one pinned -> device ``copy_`` timed with CUDA
    events; without, the host's copy limit, the faster of one ``memmove`` of the whole
    pool and the pool split over as many threads as ``copy_to`` uses;
(b) NVMe block writes through ``NVMeStore.put`` + ``flush`` vs a raw pwrite loop of the
    same blocks (from the same DRAM slots), block size, concurrency and durability (every
    block on disk when the call returns), at the raw limit for it: the store syncs every
    block, the raw writer each file once (DESIGN.md section 8), so the ratio includes what
    per-block sync costs;
(c) cold NVMe block reads through ``NVMeStore.get`` (after dropping the store's own files
    from the page cache) vs a raw O_DIRECT preadv loop over the same chunk files into the
    same DRAM slots (and, for context, over one big laid-out file per thread). When the
    page-cache check finds any of the files still cached (as on tmpfs), no cold-read
    figure is reported or saved: ``cold_reads_refused`` says why.

Tiercache and raw alternate round by round (disk: slice by slice of the blocks), the side
that goes first rotating. GB/s figures are medians over repetitions; each ratio is the
median over all rounds of the ratio of two neighbouring measurements, which cancels the
disk's regime switches. zarr's own Python API is measured once on the same blocks for
reference. Every timed transfer, tiercache's and the raw ones (every block a raw write
wrote is read back), is checked afterwards against its source (``tiercache.bench.verify``): one that did not deliver its bytes ends
the run with ``BenchError`` and no figure. The raw baselines' threads are started once,
before anything is timed, as the store's are. Torch is imported only when the command runs.
"""

from __future__ import annotations

import socket
import statistics
from dataclasses import dataclass

from ..config import KVLayout
from ..errors import UserError

__all__ = ["BenchConfig", "COMPARISONS", "run_bench", "save_measured_profile", "TARGET_RATIOS", "QUICK_LAYOUT"]

#: The compared paths (each has a tiercache and a raw figure).
COMPARISONS = ("host_to_device", "device_to_host", "disk_write", "disk_read_cold")

#: The layout of ``--quick`` runs: tiny blocks, for smoke tests.
QUICK_LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=32, per_layer=True, name="quick")


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


def run_bench(cfg: BenchConfig) -> dict:
    """Measures every comparison ``cfg.reps`` times; returns the result document."""
    from . import measure as m  # torch lives there

    bench = m.Bench(cfg)
    try:
        first_fill = bench.first_fill()
        samples = bench.repeat()
        latency = bench.latencies()
        zarr_api = bench.zarr_api() if cfg.zarr_api else None
        machine = bench.machine()
        cold_refused = bench.cold_refusal()
    finally:
        bench.close()
    if cold_refused is not None:
        samples, latency = _without_cold_reads(samples), {**latency, "disk_read_cold": None}
    return _document(cfg, samples, first_fill, latency, zarr_api, machine, cold_refused)


# The ratios the data plane is held to; the others are reported for context.
TARGET_RATIOS = ("host_to_device", "disk_write", "disk_read_cold")


def _without_cold_reads(samples: dict) -> dict:
    """``samples`` less every cold-read measurement (refused: the reads were not cold)."""
    return {kind: {name: v for name, v in by_name.items() if name != "disk_read_cold"} for kind, by_name in samples.items()}


def _medians(by_name: dict[str, list[float]]) -> dict[str, float | None]:
    """The median of each comparison's values; None for a comparison without any."""
    return {name: statistics.median(by_name[name]) if by_name.get(name) else None for name in COMPARISONS}


def _document(cfg: BenchConfig, samples: dict, first_fill: dict, latency: dict, zarr_api: dict | None, machine: dict,
              cold_refused: str | None) -> dict:
    """Assembles the JSON document.

    ``raw``/``tiercache`` are medians over repetitions (GB/s). A ratio is the median over
    every round of the tiercache/raw throughput ratio of the two measurements made right
    next to each other: the disk here switches between speed regimes within seconds, and
    pairing neighbours cancels that where a ratio of medians would not.
    ``ratio_of_medians`` is given as well. A figure is None where ``samples`` has none:
    the cold-read ones when ``cold_refused`` (why, in one line) is set.
    """
    tc, raw, paired = _medians(samples["tiercache"]), _medians(samples["raw"]), _medians(samples["paired"])
    return {
        "ratios": {name: paired[name] for name in TARGET_RATIOS},
        "raw": raw,
        "tiercache": tc,
        "other_ratios": {
            "device_to_host": paired["device_to_host"],
            "disk_read_cold_vs_one_big_file": _medians(samples["paired_file"])["disk_read_cold"],
            "disk_write_first_fill": first_fill["ratio"],
        },
        "ratio_of_medians": {name: None if tc[name] is None else tc[name] / raw[name] for name in tc},
        "disk_read_cold_one_big_file": {"raw": _medians(samples["raw_file"])["disk_read_cold"],
                                        "note": "raw O_DIRECT preadv from one laid-out file per thread instead of the chunk files"},
        "cold_reads_refused": cold_refused,
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


def save_measured_profile(result: dict, path: str) -> None:
    """Writes the measured links (tiercache throughput, raw small-transfer latency) as a
    hardware profile that ``tiercache.sim.hardware.load_profile`` reads.

    The bench measures links, not prefill: the profile's ``prefill_tokens_per_s`` is null, and
    a replay that models recompute time or TTFT with it asks for one (measure llama-3-8b's
    prefill tokens/s on short prompts, ~512 tokens, on your GPU and write it into the file: it
    defines the FLOP rate, ``HardwareProfile.prefill_flops_per_s``). Timing a toy model here would be a
    number for a different model on a different device, so none is invented.

    Raises:
        ValueError: the run has no cold-read figure for ``nvme->dram`` (``cold_reads_refused``);
            the CLI refuses ``--save-profile`` before calling this. Or a measured link is
            outside what a profile may hold (``unloadable_links``), so nothing is written.
    """
    from ..sim.hardware import HardwareProfile, Link, safe_profile_name, save_profile

    if result["cold_reads_refused"] is not None:
        raise ValueError(f"no nvme->dram link to save: {result['cold_reads_refused']}")
    tc, lat = result["tiercache"], result["latency_s"]
    links = {
        "dram->hbm": Link(tc["host_to_device"] * 1e9, lat["host_to_device"]),
        "hbm->dram": Link(tc["device_to_host"] * 1e9, lat["device_to_host"]),
        "nvme->dram": Link(tc["disk_read_cold"] * 1e9, lat["disk_read_cold"]),
        "dram->nvme": Link(tc["disk_write"] * 1e9, lat["disk_write"]),
    }
    bad = unloadable_links(links)
    if bad:
        raise ValueError(f"a replay could not load it: {bad}")
    save_profile(HardwareProfile(f"measured-{safe_profile_name(socket.gethostname())}", links, None), path)


def unloadable_links(links: dict) -> str:
    """Why ``load_profile`` would refuse these measured links ('' when it would not): a
    bandwidth or latency outside ``BANDWIDTH_RANGE``/``LATENCY_RANGE`` (a disk syncing each
    small chunk can write below 1 MB/s)."""
    from ..errors import UserError
    from ..sim.hardware import link_from_json

    for name, link in links.items():
        try:
            link_from_json(name, {"bandwidth_Bps": link.bandwidth_Bps, "latency_s": link.latency_s})
        except UserError as exc:
            return f"measured {exc}"
    return ""
