"""What ``TieredKVCache.close()`` costs with a decode's scratch blocks on NVMe (README, "The decode loop").

Usage: python scripts/bench_close.py [--scratch 1500,16000] [--reps 3] [--dir DIR] [--json out.json]

A decode without token ids (a generation's private keys: scratch, ``tiercache.live.keymap``)
appends ``--scratch`` per-layer blocks over 2 layers of a small layout (2 KV heads of dim 8,
float32, 4-token blocks) into tiers of HBM 16, DRAM 16 and NVMe with room for all of them, and
is freed, so nearly all of them are on NVMe; then ``close(persist=...)`` is timed, both ways, a
fresh cache per round, rounds alternating which way goes first. Honest by construction: after
each timed close the NVMe store's flushed index must list no block of the decode (close
deletes scratch, it is never persisted; it is read from the closed store, since a reopen
drops tagged scratch itself), or the run ends with exit 1; a round whose NVMe store did not
hold every scratch block but the 32 HBM and DRAM hold before close ends it too (nothing to
delete would time nothing). Reported: the median close time and the median per scratch block.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tiercache import TieredKVCache
from tiercache.bench.rounds import positive_int
from tiercache.bench.script_args import ScriptParser, existing_folder, positive_ints, refuse_bad_outputs
from tiercache.config import KVLayout, TierConfig
from tiercache.live.keymap import is_scratch

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float32", block_tokens=4)
_CHUNK_TOKENS = 256  # tokens appended per call
_ABOVE_NVME = 32  # blocks HBM and DRAM hold: every other scratch block must be on NVMe


class CloseBenchError(RuntimeError):
    """A round that would time nothing real (no scratch on NVMe) or left scratch behind."""


def _cache(path: Path, scratch: int) -> TieredKVCache:
    tiers = [TierConfig("hbm", _ABOVE_NVME // 2), TierConfig("dram", _ABOVE_NVME // 2),
             TierConfig("nvme", LAYOUT.layers * scratch + 64)]
    return TieredKVCache(LAYOUT, tiers, path=path, device="cpu")


def _nvme_scratch(cache: TieredKVCache) -> int:
    """Scratch blocks the cache's NVMe store holds."""
    return sum(is_scratch(key) for key, _ in cache.store._media[-1].items())


def one_close(folder: Path, scratch: int, persist: bool) -> float:
    """Seconds of one ``close(persist=persist)`` of a cache holding ``scratch`` freed blocks a
    layer; checks the scratch was on NVMe before and is gone after a reopen."""
    path = Path(tempfile.mkdtemp(dir=folder)) / "cache"
    cache = _cache(path, scratch)
    generation = cache.sequence()
    total = scratch * LAYOUT.block_tokens
    for start in range(0, total, _CHUNK_TOKENS):
        tokens = min(_CHUNK_TOKENS, total - start)  # exactly ``scratch`` blocks a layer
        for layer in range(LAYOUT.layers):
            generation.append(layer, torch.randn(2, tokens, 8), torch.randn(2, tokens, 8))
    generation.free()
    held = _nvme_scratch(cache)
    if held < LAYOUT.layers * scratch - _ABOVE_NVME:
        raise CloseBenchError(f"only {held} of {LAYOUT.layers * scratch} scratch blocks reached NVMe: nothing to time")
    nvme = cache.store._media[-1]
    start = time.perf_counter()
    cache.close(persist=persist)
    seconds = time.perf_counter() - start
    left = sum(1 for _ in nvme.items())  # the closed store's index, as flushed (a reopen would drop scratch itself)
    if left:
        raise CloseBenchError(f"close(persist={persist}) left {left} blocks of a decode without ids on NVMe")
    return seconds


def measure(args: argparse.Namespace) -> dict:
    """Median close seconds and microseconds per scratch block, per scratch count and persist."""
    result = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for scratch in args.scratch:
            times = {False: [], True: []}
            for round_ in range(args.reps):
                for persist in ((False, True) if round_ % 2 == 0 else (True, False)):
                    times[persist].append(one_close(Path(folder), scratch, persist))
            blocks = LAYOUT.layers * scratch
            result[str(blocks)] = {f"persist_{str(p).lower()}": {
                "close_ms": 1e3 * statistics.median(t), "us_per_block": 1e6 * statistics.median(t) / blocks}
                for p, t in times.items()}
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked before any work."""
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scratch", type=positive_ints, default=[1500, 16000],
                        help="per-layer scratch blocks of each case, a comma list (2 layers: twice as many blocks)")
    parser.add_argument("--reps", type=positive_int, default=3)
    parser.add_argument("--dir", type=existing_folder, default=None, help="folder on the disk to use (default: a temp dir)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    refuse_bad_outputs(parser, {"--json": args.json})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = measure(args)
    except (CloseBenchError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{'scratch blocks':>14}  {'persist':>7}  {'close ms':>9}  {'us/block':>8}")
    for blocks, row in result.items():
        for persist, figures in row.items():
            print(f"{blocks:>14}  {persist[8:]:>7}  {figures['close_ms']:>9.1f}  {figures['us_per_block']:>8.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
