#!/usr/bin/env python3
"""End-to-end cold NVMe reads through the live store vs raw O_DIRECT reads of the same files.

Usage: python scripts/bench_store.py [--blocks 256] [--reps 5] [--dir DIR] [--json out.json]

``scripts/bench_tiers.py`` times the tiers themselves (pools, the NVMe store). This one times
the whole live path a serving engine uses: ``TieredKVStore.get`` of blocks resident on NVMe,
which runs the manager (lookup, room in HBM, a two-phase plan) and ``LocalEngine`` (the store's
I/O threads reading chunk files straight into the HBM pool's slots, checksums verified), and
compares it in the same run with raw ``O_DIRECT`` ``preadv`` of the very same chunk files into
page-aligned memory. Page cache is dropped on the store's own files before each timing.
Reported: GB/s of each (medians) and the median of the per-round ratios.
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

from tiercache.config import KVLayout, TierConfig
from tiercache.bench.rawio import read_files
from tiercache.bench.rounds import positive_int
from tiercache.live.store import TieredKVStore

LAYOUT = KVLayout(layers=1, kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=256, name="llama-3-8b/layer")


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def prepare(path: str, n: int, batch: int) -> tuple[TieredKVStore, list[bytes]]:
    """A store whose NVMe tier holds ``n`` blocks and whose HBM tier is empty, caches dropped."""
    store = TieredKVStore(LAYOUT, [TierConfig("hbm", n), TierConfig("nvme", 2 * n)], path=path)
    data = torch.randn((batch, *LAYOUT.block_shape)).to(torch.bfloat16)
    for start in range(0, 2 * n, batch):  # the first n are demoted to NVMe by the last n
        store.put([_key(i) for i in range(start, start + batch)], data)
    store.manager.evict([store.manager.dirs[0].slot_block[s] for s in store.manager.dirs[0].slot_of.values()])
    store.flush()
    nvme = store._media[1]
    nvme.drop_cache()
    keys = [_key(i) for i in range(n)]
    assert all(t == "nvme" for t in store.lookup(keys)[1])
    return store, keys


def time_store(store: TieredKVStore, keys: list[bytes], batch: int, prefetch: bool) -> float:
    """Seconds to get every block in batches; with ``prefetch`` all reads are started first
    (one background plan, as a serving engine prefetches a request's blocks) and each get
    then only waits for and gathers its batch."""
    out = torch.empty((batch, *LAYOUT.block_shape), dtype=torch.bfloat16)
    out.zero_()  # touched once, outside the timing, like a serving loop's reused buffer
    started = time.perf_counter()
    if prefetch:
        store.prefetch(keys)
    for start in range(0, len(keys), batch):
        store.get(keys[start : start + batch], out=out)
    return time.perf_counter() - started


def time_raw(store: TieredKVStore, keys: list[bytes], threads: int) -> float:
    nvme = store._media[1]
    paths = [nvme.chunk_path(nvme.slot_of(k)) for k in keys]
    nvme.drop_cache()
    block = LAYOUT.block_bytes
    dest = np.frombuffer(mmap.mmap(-1, len(keys) * block), dtype=np.uint8)
    dests = [dest[i * block : (i + 1) * block] for i in range(len(keys))]
    tails = [mmap.mmap(-1, mmap.PAGESIZE) for _ in range(threads)]
    seconds, _ = read_files(paths, dests, tails)
    return seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked before any work: counts are positive and ``--blocks`` is a whole
    number of ``--batch`` (every get fills its ``--batch``-row buffer)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=positive_int, default=256, help="blocks read per round (a multiple of --batch)")
    parser.add_argument("--batch", type=positive_int, default=32)
    parser.add_argument("--reps", type=positive_int, default=5)
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.blocks % args.batch:
        parser.error(f"--blocks: a multiple of --batch {args.batch}, got {args.blocks}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    nbytes = args.blocks * LAYOUT.block_bytes
    rows = []
    for _ in range(args.reps):
        row = []
        for prefetch in (False, True):
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                store, keys = prepare(f"{tmp}/nvme", args.blocks, args.batch)
                raw = time_raw(store, keys, threads=4)
                store._media[1].drop_cache()
                ours = time_store(store, keys, args.batch, prefetch)
                store.close(persist=False)
            row.append((nbytes / ours / 1e9, nbytes / raw / 1e9))
        rows.append(row)
    result = {"blocks": args.blocks, "block_bytes": LAYOUT.block_bytes, "batch": args.batch, "reps": args.reps}
    for index, name in enumerate(("get", "prefetch_then_get")):
        result[name] = {
            "store_gbps": statistics.median(r[index][0] for r in rows),
            "raw_direct_read_gbps": statistics.median(r[index][1] for r in rows),
            "ratio": statistics.median(r[index][0] / r[index][1] for r in rows),
        }
    print(f"{args.blocks} blocks of {LAYOUT.block_bytes} B, gets of {args.batch}, median of {args.reps} rounds; "
          "raw = O_DIRECT preadv of the same chunk files, 4 threads, measured next to each row")
    print(f"{'path (NVMe -> HBM pool, cold)':<46}{'store GB/s':>11}{'raw GB/s':>10}{'ratio':>7}")
    for name, label in (("get", "TieredKVStore.get, batches of --batch"), ("prefetch_then_get", "prefetch(all), then get in batches")):
        row = result[name]
        print(f"{label:<46}{row['store_gbps']:>11.2f}{row['raw_direct_read_gbps']:>10.2f}{row['ratio']:>7.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
