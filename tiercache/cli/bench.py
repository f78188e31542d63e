"""``tiercache bench``: measure the data plane against raw copies and raw disk I/O.

Parses the options into a ``BenchConfig`` and prints the table; the measurements are
``tiercache.bench.tiers`` (see its docstring for what is compared and how).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from ..bench.tiers import QUICK_LAYOUT, BenchConfig, run_bench, save_measured_profile
from ..config import KVLayout, layout_preset
from ..errors import UserError
from .stdout import print_unless_refused
from ..results.outfile import replace_file
from .replay import check_output_file

__all__ = ["add_parser", "main", "format_table", "MAX_THREADS"]

#: Most ``--threads``: each is a thread of the store's I/O pool and of each raw loop, and a file.
MAX_THREADS = 256
#: Peak memory of a run per byte of its blocks (pools, read-back buffers; the zarr API
#: reference adds its own): the growth of peak RSS from 64 to 256 blocks of 1 MiB, measured
#: 3.1x without the zarr reference and 4.1x with it (the interpreter's own ~0.5 GiB aside).
MEMORY_PER_BYTE, MEMORY_PER_BYTE_ZARR = 3.2, 4.2


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``tiercache bench``."""
    p = subparsers.add_parser("bench", help="measure the HBM/DRAM/NVMe data plane against raw copies and raw disk I/O",
                              description="Measure the data plane against the raw hardware, side by side in one run.")
    p.add_argument("--model", default="llama-3-8b", help="layout preset (default llama-3-8b)")
    p.add_argument("--block-tokens", type=int, default=256, help="tokens per block (default 256)")
    p.add_argument("--all-layers", action="store_true", help="blocks hold every layer (default: one layer per block, 1 MiB for llama-3-8b)")
    p.add_argument("--blocks", type=int, default=384, help="blocks per repetition (default 384)")
    p.add_argument("--threads", type=int, default=4, help=f"I/O threads for the store and the raw loops, 1 to {MAX_THREADS} (default 4)")
    p.add_argument("--reps", type=int, default=5, help="repetitions; medians are reported (default 5)")
    p.add_argument("--dir", default=".", help="directory on the disk to measure (a temporary folder is made inside)")
    p.add_argument("--json", default="bench_tiers.json", help="where to write the results (default bench_tiers.json)")
    p.add_argument("--save-profile", metavar="PATH", help="also write the measured links as a hardware profile JSON")
    p.add_argument("--no-zarr-api", action="store_true", help="skip the zarr Python API reference measurement")
    p.add_argument("--quick", action="store_true", help="tiny run for smoke tests: 16 small blocks, 2 threads, 2 repetitions "
                   "(overrides --model, --block-tokens, --all-layers, --blocks, --threads and --reps, which are still checked)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random block contents, 0 to 2**64-1 (default 0)")
    p.set_defaults(func=main)


def _config(args: argparse.Namespace, directory: str) -> BenchConfig:
    """Turns parsed options into a config; ``--quick`` overrides sizes.

    Every option is checked first, with ``--quick`` too (which would otherwise ignore a
    bad value silently).

    Raises:
        UserError: a bad option, named.
    """
    full = _full_config(args, directory)
    if args.quick:
        return BenchConfig(QUICK_LAYOUT, 16, 2, 2, directory, not args.no_zarr_api, args.seed)
    return full


def _full_config(args: argparse.Namespace, directory: str) -> BenchConfig:
    """The config of the options as given (``--quick`` aside), validated.

    Raises:
        UserError: a bad ``--block-tokens``, ``--seed``, ``--model``, ``--blocks`` (below
            ``MIN_BLOCKS``, 2), ``--threads`` (above ``MAX_THREADS`` too) or ``--reps``; the
            message names the option.
    """
    if args.block_tokens < 1:
        raise UserError(f"--block-tokens: must be a positive integer, got {args.block_tokens}")
    if not 0 <= args.seed < 2**64:
        raise UserError(f"--seed: must be an integer from 0 to 2**64-1, got {args.seed}")
    if not 1 <= args.threads <= MAX_THREADS:
        raise UserError(f"--threads: must be an integer from 1 to {MAX_THREADS}, got {args.threads}")
    try:
        layout = layout_preset(args.model, args.block_tokens)
    except UserError as exc:
        raise UserError(f"--model: {exc}") from None
    if not args.all_layers:
        layout = KVLayout(layout.layers, layout.kv_heads, layout.head_dim, layout.dtype, layout.block_tokens, True, layout.name)
    config = BenchConfig(layout, args.blocks, args.threads, args.reps, directory, not args.no_zarr_api, args.seed)
    from ..bench.measure import check_blocks  # loads torch: only once the command runs

    check_blocks(config.blocks)
    return config


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark, prints the table, writes the JSON (and the profile); the options,
    the output paths included, are checked before the temporary folder is made.

    Returns 1, with a one-line error and no table, when the benchmark could not measure
    honestly (a timed transfer did not deliver its bytes, or the disk failed); and 1, after
    the table and the JSON, with a one-line error and no profile, when ``--save-profile``
    was asked for but the cold reads were refused (not cold: no ``nvme->dram`` figure).
    """
    if not os.path.isdir(args.dir):
        raise UserError(f"--dir {args.dir}: not a directory")
    if not os.access(args.dir, os.W_OK | os.X_OK):
        raise UserError(f"--dir {args.dir}: not writable (the benchmark makes its working folder there)")
    _check_room(_config(args, args.dir), args.dir)
    check_output_file(args.json, "--json")
    if args.save_profile is not None:
        check_output_file(args.save_profile, "--save-profile")
        if os.path.realpath(args.save_profile) == os.path.realpath(args.json):
            raise UserError(f"--save-profile {args.save_profile}: the same file as --json; the profile would replace the results")
    from ..bench.verify import BenchError  # loads torch: only once the command runs

    try:
        workdir = tempfile.mkdtemp(prefix=".tiercache-bench-", dir=args.dir)
    except OSError as exc:
        raise UserError(f"--dir {args.dir}: cannot make the working folder there ({exc.strerror or exc})") from None
    try:
        result = run_bench(_config(args, workdir))
    except (BenchError, OSError) as exc:
        print(f"tiercache bench: error: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    try:  # the files first: a reader gone from standard output cannot lose them
        _write_json(args.json, result)
    except UserError:  # it cannot be written: the figures are printed still, then the error
        print_unless_refused(lambda: print(format_table(result)))
        raise
    code = _save_profile(result, args.save_profile) if args.save_profile else 0
    print(format_table(result))
    print(f"results written to {args.json}")
    if args.save_profile and code == 0:
        print(f"hardware profile written to {args.save_profile} (links only: set its prefill_tokens_per_s to "
              "llama-3-8b's prefill tokens/s on short prompts (~512 tokens) on your GPU before modeling recompute "
              "time or TTFT with it)")
    return code


def disk_needed(config: BenchConfig) -> int:
    """Peak bytes a run writes under its folder: the store's chunks and the fresh raw files
    (one block each per block of ``--blocks``, the zarr reference's reusing that room), and
    the laid-out raw files (``threads`` files of ``ceil(blocks / threads)`` blocks: more
    than ``--blocks`` when ``--threads`` does not divide it). Measured 3.0x the blocks' bytes
    at 64 blocks and 4 threads, as this gives."""
    laid_out = config.threads * -(-config.blocks // config.threads)
    return (2 * config.blocks + laid_out) * config.layout.block_bytes


def _check_room(config: BenchConfig, directory: str) -> None:
    """Refuses, before anything is made, a run needing more disk under ``directory``
    (``disk_needed``) or more memory (``MEMORY_PER_BYTE``) than there is free: it would
    otherwise fill the disk, or fail mid-run with an error naming no option. The memory of
    a CUDA device's HBM pool is the device's, not checked here.

    Raises:
        UserError: naming the sizes to lower and what is free.
    """
    import psutil

    sizes = "lower --blocks, --threads or --block-tokens (or drop --all-layers)"
    disk, free_disk = disk_needed(config), shutil.disk_usage(directory).free
    if disk > free_disk:
        raise UserError(f"--dir {directory}: a run of {config.blocks} blocks of {config.layout.block_bytes} B on "
                        f"{config.threads} threads needs about {_size(disk)} of disk, {_size(free_disk)} are free; {sizes}")
    factor = MEMORY_PER_BYTE_ZARR if config.zarr_api else MEMORY_PER_BYTE
    memory, free_memory = int(factor * config.blocks * config.layout.block_bytes), psutil.virtual_memory().available
    if memory > free_memory:
        raise UserError(f"--blocks {config.blocks}: blocks of {config.layout.block_bytes} B need about "
                        f"{_size(memory)} of memory, {_size(free_memory)} are available; {sizes}")


def _size(nbytes: int) -> str:
    """Bytes in GiB, or in MiB below one GiB."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _save_profile(result: dict, path: str) -> int:
    """Writes ``--save-profile`` and returns 0; or, when the run refused its cold-read
    figures (the profile's ``nvme->dram`` link), writes nothing, says why in one line and
    returns 1."""
    if result["cold_reads_refused"] is not None:
        print(f"tiercache bench: error: --save-profile {path}: not written (its nvme->dram link needs a cold-read figure): "
              f"{result['cold_reads_refused']}", file=sys.stderr)
        return 1
    try:
        save_measured_profile(result, path)
    except ValueError as exc:
        print(f"tiercache bench: error: --save-profile {path}: not written: {exc}", file=sys.stderr)
        return 1
    if result["machine"]["device"] == "cpu (no CUDA)":
        print(f"note: {path}: no CUDA here, so its dram->hbm and hbm->dram links are host-memory copies, not a GPU's link",
              file=sys.stderr)
    return 0


def _write_json(path: str, data: dict) -> None:
    """Writes ``--json`` whole or not at all (an earlier file stays as it was on an error)."""
    replace_file(path, json.dumps(data, indent=2) + "\n", f"--json {path}")


def format_table(result: dict) -> str:
    """The human-readable summary: one row per comparison, then the zarr API reference.

    When the cold reads were refused (``cold_reads_refused``), one line says why in place
    of the cold-read rows, and the zarr line gives no direct cold-read figure.
    """
    m, cfg = result["machine"], result["config"]
    lines = [
        f"tiercache bench: {cfg['blocks']} blocks of {cfg['block_bytes']} B ({cfg['layout']}, {cfg['dtype']}),"
        f" {cfg['threads']} threads, {cfg['reps']} reps, device {m['device']}; GB/s: {_over_reps(cfg['reps'])}; ratio: median over paired rounds",
        f"{'path':<26}{'tiercache GB/s':>16}{'raw GB/s':>10}{'ratio':>8}  raw baseline",
        *_comparison_rows(result),
    ]
    f = result.get("first_fill_write")
    if f:
        lines.append(f"{'NVMe writes, first fill':<26}{_fig(f['tiercache']):>16}{_fig(f['raw']):>10}{_fig(f['ratio']):>8}"
                     "  new chunk files (temp+rename) vs new raw files; once, not a target")
    if result["zarr_api"]:
        lines.append(_zarr_line(result))
    return "\n".join(lines)


_LABELS = {
    "host_to_device": "DRAM->HBM block copies",
    "device_to_host": "HBM->DRAM block copies",
    "disk_write": "NVMe block writes",
    "disk_read_cold": "NVMe cold block reads",
}


def _comparison_rows(result: dict) -> list[str]:
    """One row per comparison and the big-file cold reads; a refused cold read is one
    ``refused:`` line saying why instead of both cold-read rows."""
    ratios, refused, baselines = {**result["ratios"], **result["other_ratios"]}, result["cold_reads_refused"], result["machine"]["baselines"]
    rows = []
    for name, label in _LABELS.items():
        if name == "disk_read_cold" and refused is not None:
            rows.append(f"{label:<26}  refused: {refused}")
            continue
        rows.append(f"{label:<26}{_fig(result['tiercache'][name]):>16}{_fig(result['raw'][name]):>10}{_fig(ratios[name]):>8}  {baselines[name]}")
    if refused is None:
        big = result["disk_read_cold_one_big_file"]
        rows.append(f"{'NVMe cold reads, big file':<26}{_fig(result['tiercache']['disk_read_cold']):>16}{_fig(big['raw']):>10}"
                    f"{_fig(ratios['disk_read_cold_vs_one_big_file']):>8}  O_DIRECT preadv from one laid-out file per thread (format cost included)")
    return rows


def _zarr_line(result: dict) -> str:
    """The zarr API reference next to tiercache's direct chunk I/O (no cold-read figure
    where either side's cold read was refused)."""
    z, tc = result["zarr_api"], result["tiercache"]
    cold = f"cold read {_fig(z['read_cold'])} GB/s" if z["read_cold"] is not None else f"cold read not timed ({z['cold_check']})"
    direct = f"{_fig(tc['disk_read_cold'])} GB/s" if result["cold_reads_refused"] is None else "refused (not cold, above)"
    return (f"zarr API (per-chunk assignment, no fsync): write {_fig(z['write'])} GB/s, {cold};"
            f" direct chunk I/O: write {_fig(tc['disk_write'])} GB/s, cold read {direct}")


def _fig(value: float) -> str:
    """A figure with two decimals, or three significant digits below 0.1 (a slow figure
    never prints as 0.00)."""
    return f"{value:.2f}" if abs(value) >= 0.1 or value == 0 else f"{value:.3g}"


def _over_reps(reps: int) -> str:
    """What the table's GB/s figures are, for ``reps`` repetitions."""
    if reps == 1:
        return "one repetition (no median)"
    return "medians over reps (of 2: their mean)" if reps == 2 else "medians over reps"
