"""End-to-end cold NVMe reads through the live store vs raw O_DIRECT reads of the same files.

Usage: python scripts/bench_store.py [--blocks 256] [--batch 32] [--reps 6] [--dir DIR] [--json out.json]

``scripts/bench_tiers.py`` times the tiers themselves (pools, the NVMe store). This one times
the whole live path a serving engine uses: ``TieredKVStore.get`` of blocks resident on NVMe,
which runs the manager (lookup, room in HBM, a two-phase plan) and ``LocalEngine`` (the store's
I/O threads reading chunk files straight into the HBM pool's slots, checksums verified), and
compares it in the same round with raw ``O_DIRECT`` ``preadv`` of the very same chunk files
into page-aligned memory (4 threads, started before the clock). Honest by construction:

* every block is distinct random data (a block served from the wrong key, or not at all,
  cannot pass), and every read of both sides lands in its own block of a destination
  poisoned before the clock, checked against its source block's digest after the clock
  (``tiercache.bench.verify``); a read that did not deliver ends the run with exit 1;
* every read is cold: before each side the chunk files are evicted from the page cache
  (``POSIX_FADV_DONTNEED``, the store's own files only) and ``mincore`` must find none of
  their bytes cached, or the run ends with exit 1 (no figure of a read served from RAM);
* in each round (a fresh store per round and mode) the side that goes first alternates;
* reported: GB/s of each (medians over rounds) and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from tiercache.bench.decode import evict_from_page_cache
from tiercache.bench.rawio import read_files
from tiercache.bench.rounds import positive_int
from tiercache.bench.script_args import ScriptParser, run_script, existing_folder, refuse_bad_outputs
from tiercache.bench.verify import POISON, BenchError, block_digests, reference_digests
from tiercache.config import KVLayout, TierConfig
from tiercache.live.store import TieredKVStore

LAYOUT = KVLayout(layers=1, kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=256, name="llama-3-8b/layer")


READ_THREADS = 4
MODES = {"get": "TieredKVStore.get, batches of --batch", "prefetch_then_get": "prefetch(all), then get in batches"}


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _rows(blocks: torch.Tensor) -> torch.Tensor:
    """``[blocks, bytes]`` uint8 view of a block tensor (what the digests cover)."""
    return blocks.contiguous().view(torch.uint8).reshape(blocks.shape[0], -1)


def source_blocks(start: int, count: int) -> torch.Tensor:
    """The blocks of keys ``start .. start + count``: random, seeded by ``start`` (every
    block of a run distinct)."""
    gen = torch.Generator().manual_seed(start)
    return torch.randn((count, *LAYOUT.block_shape), generator=gen).to(torch.bfloat16)


def prepare(path: str, n: int, batch: int) -> tuple[TieredKVStore, list[bytes], np.ndarray]:
    """A store whose NVMe tier holds ``n`` distinct blocks and whose HBM tier is empty.

    Returns:
        The store, the ``n`` keys on NVMe and their blocks' digests (``block_digests``, distinct).
    """
    store = TieredKVStore(LAYOUT, [TierConfig("hbm", n), TierConfig("nvme", 2 * n)], path=path)
    digests = []
    for start in range(0, 2 * n, batch):  # the first n are demoted to NVMe by the last n
        data = source_blocks(start, batch)
        if start < n:
            digests.append(reference_digests(_rows(data)))
        store.put([_key(i) for i in range(start, start + batch)], data)
    store.manager.evict([store.manager.dirs[0].slot_block[s] for s in store.manager.dirs[0].slot_of.values()])
    store.flush()
    keys = [_key(i) for i in range(n)]
    if not all(t == "nvme" for t in store.lookup(keys)[1]):
        raise BenchError("bench_store: the blocks to read are not all on NVMe after preparing the store")
    digests = np.concatenate(digests)
    if np.unique(digests).size != digests.size:
        raise BenchError("bench_store: two source blocks have the same digest; a misplaced read could pass its check")
    return store, keys, digests


def chunk_paths(store: TieredKVStore, keys: list[bytes]) -> list[str]:
    """The NVMe chunk file of each key (what both sides read)."""
    nvme = store._media[1]
    return [nvme.chunk_path(nvme.slot_of(k)) for k in keys]


def make_cold(paths: list[str], side: str) -> None:
    """Evicts ``paths`` from the page cache and checks with ``mincore`` that none stayed.

    Raises:
        BenchError: bytes stayed cached (or residency cannot be checked): the read would not be cold.
    """
    left = evict_from_page_cache(paths)
    if left is None:
        raise BenchError(f"bench_store: {side}: the page cache cannot be checked here (no mincore), so no read is "
                         "known to be cold; no figure is reported")
    if left:
        raise BenchError(f"bench_store: {side}: {left} bytes of the chunk files stayed in the page cache after "
                         "POSIX_FADV_DONTNEED: the read would not be cold; no figure is reported")


def check_delivered(rows: torch.Tensor, digests: np.ndarray, side: str) -> None:
    """Raises BenchError unless row ``i`` of ``rows`` has the digest ``digests[i]``."""
    wrong = np.flatnonzero(block_digests(rows) != digests)
    if wrong.size:
        raise BenchError(f"bench_store: {side}: {wrong.size} of {digests.size} blocks read do not hold their source's "
                         f"bytes (first: block {int(wrong[0])}); no figure is reported")


def time_store(store: TieredKVStore, keys: list[bytes], batch: int, prefetch: bool, out: torch.Tensor,
               digests: np.ndarray) -> float:
    """Seconds to get every block in batches, each batch into its own rows of ``out``
    (poisoned before the clock, checked after it); with ``prefetch`` all reads are started
    first (one background plan, as a serving engine prefetches a request's blocks) and each
    get then only waits for and gathers its batch."""
    _rows(out).fill_(POISON)
    started = time.perf_counter()
    if prefetch:
        store.prefetch(keys)
    for start in range(0, len(keys), batch):
        store.get(keys[start : start + batch], out=out[start : start + batch])
    seconds = time.perf_counter() - started
    check_delivered(_rows(out), digests, "TieredKVStore.get")
    return seconds


def time_raw(paths: list[str], dest: np.ndarray, digests: np.ndarray) -> tuple[float, bool]:
    """Seconds of raw O_DIRECT reads of ``paths``, file ``i`` into row ``i`` of ``dest``
    (page-aligned, poisoned before the clock, checked after it), ``READ_THREADS`` readers.

    Returns:
        ``(seconds, whether O_DIRECT was in effect for every file)``.
    """
    dest.fill(POISON)
    tails = [mmap.mmap(-1, mmap.PAGESIZE) for _ in range(READ_THREADS)]
    seconds, direct = read_files(paths, list(dest), tails)
    check_delivered(torch.from_numpy(dest), digests, "raw O_DIRECT preadv")
    return seconds, direct


def one_round(args: argparse.Namespace, prefetch: bool, raw_first: bool, out: torch.Tensor, dest: np.ndarray) -> dict:
    """Both sides once on a fresh store (cold, checked), in the order ``raw_first`` says:
    ``{"store": seconds, "raw": seconds, "raw_direct": bool}``."""
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        store, keys, digests = prepare(f"{tmp}/nvme", args.blocks, args.batch)
        try:
            paths, result = chunk_paths(store, keys), {}
            for side in (("raw", "store") if raw_first else ("store", "raw")):
                make_cold(paths, side)
                if side == "raw":
                    result["raw"], result["raw_direct"] = time_raw(paths, dest, digests)
                else:
                    result["store"] = time_store(store, keys, args.batch, prefetch, out, digests)
        finally:
            store.close(persist=False)
    return result


def measure(args: argparse.Namespace) -> dict:
    """``--reps`` rounds of both modes (``MODES``); the side that goes first alternates from
    one measurement to the next. Raises BenchError when a read is not cold or not delivered."""
    nbytes = args.blocks * LAYOUT.block_bytes
    out = torch.empty((args.blocks, *LAYOUT.block_shape), dtype=torch.bfloat16)
    dest = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8).reshape(args.blocks, LAYOUT.block_bytes)
    rounds = {mode: [] for mode in MODES}
    for rep in range(args.reps):
        for index, mode in enumerate(MODES):
            rounds[mode].append(one_round(args, mode == "prefetch_then_get", (rep + index) % 2 == 0, out, dest))
    result = {"blocks": args.blocks, "block_bytes": LAYOUT.block_bytes, "batch": args.batch, "reps": args.reps,
              "raw_threads": READ_THREADS, "raw_o_direct": all(r["raw_direct"] for rs in rounds.values() for r in rs),
              "reads_checked": True, "cold_verified": True}
    for mode, rs in rounds.items():
        result[mode] = {
            "store_gbps": statistics.median(nbytes / r["store"] / 1e9 for r in rs),
            "raw_direct_read_gbps": statistics.median(nbytes / r["raw"] / 1e9 for r in rs),
            "ratio": statistics.median(r["raw"] / r["store"] for r in rs),
        }
    return result


def print_table(result: dict) -> None:
    """The figures as a plain table, with what was checked."""
    raw = "O_DIRECT" if result["raw_o_direct"] else "BUFFERED (O_DIRECT refused)"
    print(f"{result['blocks']} blocks of {result['block_bytes']} B, gets of {result['batch']}, median of {result['reps']} "
          f"rounds; raw = {raw} preadv of the same chunk files, {result['raw_threads']} threads, in the same round "
          "(which side goes first alternates)")
    print("every read cold (page cache dropped, mincore-checked) and checked against its source block")
    print(f"{'path (NVMe -> HBM pool, cold)':<46}{'store GB/s':>11}{'raw GB/s':>10}{'ratio':>7}")
    for mode, label in MODES.items():
        row = result[mode]
        print(f"{label:<46}{row['store_gbps']:>11.2f}{row['raw_direct_read_gbps']:>10.2f}{row['ratio']:>7.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked before any work: counts are positive, ``--blocks`` is a whole
    number of ``--batch`` (every get fills ``--batch`` rows), ``--dir`` an existing
    writable folder and ``--json`` a writable file."""
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=positive_int, default=256, help="blocks read per round (a multiple of --batch)")
    parser.add_argument("--batch", type=positive_int, default=32)
    parser.add_argument("--reps", type=positive_int, default=6)  # even: each side goes first equally often
    parser.add_argument("--dir", type=existing_folder, default=None,
                        help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.blocks % args.batch:
        parser.error(f"--blocks: a multiple of --batch {args.batch}, got {args.blocks}")
    refuse_bad_outputs(parser, {"--json": args.json})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = measure(args)
    except (BenchError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print_table(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
