"""What ``TieredKVCache.close()`` costs with a decode's scratch blocks on NVMe (README, "The decode loop").

Usage: python scripts/bench_close.py [--scratch 1500,16000] [--reps 3] [--dir DIR] [--json out.json]

A decode without token ids (a generation's private keys: scratch, ``tiercache.live.keymap``)
appends ``--scratch`` per-layer blocks over 2 layers of a small layout (2 KV heads of dim 8,
float32, 4-token blocks) into tiers of HBM 16, DRAM 16 and NVMe with room for all of them, and
is freed, so nearly all of them are on NVMe; then ``close(persist=...)`` is timed, both ways, a
fresh cache per round, rounds alternating which way goes first. Honest by construction:

* before each timed close the NVMe store must hold at least one scratch block and every
  scratch block but the 32 that HBM and DRAM hold, or the run ends with exit 1 (a close with
  nothing to delete from NVMe would time nothing): ``--scratch`` must exceed 16 a layer;
* after each timed close the NVMe store is reopened from its files alone (a bare
  ``NVMeStore``, which keeps whatever its flushed index lists; ``TieredKVCache`` would drop
  tagged scratch itself on reopen) and must list no block at all (close deletes scratch, it
  is never persisted), or the run ends with exit 1.

Reported per scratch count and way: ``close_ms`` (median close time), ``nvme_blocks`` (the
scratch blocks the NVMe store held before the close, all of which the close deleted; the
fewest over rounds),
``us_per_nvme_block`` (median over rounds of close time / ``nvme_blocks``: the whole close,
the at most 32 memory-tier blocks it also drops included, per block deleted from NVMe) and
``us_per_block`` (median close time / every scratch block of the decode, any tier).
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
from tiercache.bench.script_args import ScriptParser, run_script, existing_folder, positive_ints, refuse_bad_outputs
from tiercache.config import KVLayout, TierConfig
from tiercache.data.nvme import NVMeStore
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


def one_close(folder: Path, scratch: int, persist: bool) -> tuple[float, int]:
    """Times one ``close(persist=persist)`` of a cache holding ``scratch`` freed blocks a
    layer; checks the scratch was on NVMe before and that the NVMe store's flushed index,
    reopened from disk, lists nothing after.

    Returns:
        ``(seconds of the close, scratch blocks it deleted from NVMe)``.

    Raises:
        CloseBenchError: no scratch (or too little) on NVMe before the close, or blocks left after it.
    """
    path = Path(tempfile.mkdtemp(dir=folder)) / "cache"
    cache = _cache(path, scratch)
    generation = cache.sequence()
    total = scratch * LAYOUT.block_tokens
    for start in range(0, total, _CHUNK_TOKENS):
        tokens = min(_CHUNK_TOKENS, total - start)  # exactly ``scratch`` blocks a layer
        for layer in range(LAYOUT.layers):
            generation.append(layer, torch.randn(2, tokens, 8), torch.randn(2, tokens, 8))
    generation.free()
    held, blocks = _nvme_scratch(cache), LAYOUT.layers * scratch
    if held == 0 or held < blocks - _ABOVE_NVME:
        cache.close()
        raise CloseBenchError(f"--scratch {scratch}: only {held} of {blocks} scratch blocks reached NVMe (HBM and DRAM "
                              f"hold {_ABOVE_NVME}; give more than {_ABOVE_NVME // LAYOUT.layers} a layer): nothing to time")
    nvme = cache.store._media[-1]
    start = time.perf_counter()
    cache.close(persist=persist)
    seconds = time.perf_counter() - start
    left = _flushed_blocks(nvme)
    if left:
        raise CloseBenchError(f"close(persist={persist}) left {left} blocks of a decode without ids on NVMe")
    return seconds, held


def _flushed_blocks(closed: NVMeStore) -> int:
    """Blocks the closed NVMe store lists once reopened from its files (its flushed index),
    as a new bare ``NVMeStore`` of the same path, layout and codec, which keeps every entry,
    scratch included (only the closed store's settings are read from it)."""
    with NVMeStore(closed.path, closed.layout, create=False, codec=closed.codec) as reopened:
        return len(reopened.items())


def measure(args: argparse.Namespace) -> dict:
    """Per scratch count (key: every scratch block of the decode) and persist: the median
    close ms, the NVMe blocks it deleted, and the median microseconds per NVMe block deleted
    and per scratch block (see the module docstring)."""
    result = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for scratch in args.scratch:
            times, deleted = {False: [], True: []}, {False: [], True: []}
            for round_ in range(args.reps):
                for persist in ((False, True) if round_ % 2 == 0 else (True, False)):
                    seconds, held = one_close(Path(folder), scratch, persist)
                    times[persist].append(seconds)
                    deleted[persist].append(held)
            blocks = LAYOUT.layers * scratch
            result[str(blocks)] = {f"persist_{str(p).lower()}": {
                "close_ms": 1e3 * statistics.median(t), "nvme_blocks": min(deleted[p]),
                "us_per_nvme_block": 1e6 * statistics.median(s / n for s, n in zip(t, deleted[p])),
                "us_per_block": 1e6 * statistics.median(t) / blocks} for p, t in times.items()}
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked before any work."""
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scratch", type=positive_ints, default=[1500, 16000],
                        help="per-layer scratch blocks of each case, a comma list (2 layers: twice as many blocks; "
                             "more than 16, or none reaches NVMe and the run exits 1)")
    parser.add_argument("--reps", type=positive_int, default=3)
    parser.add_argument("--dir", type=existing_folder, default=None, help="folder on the disk to use (default: a temp dir)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    few = [s for s in args.scratch if s <= _ABOVE_NVME // LAYOUT.layers]
    if few:
        parser.error(f"--scratch {few[0]}: HBM and DRAM hold {_ABOVE_NVME // LAYOUT.layers} blocks a layer, so none "
                     f"would reach NVMe; give more than {_ABOVE_NVME // LAYOUT.layers}")
    refuse_bad_outputs(parser, {"--json": args.json})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = measure(args)
    except (CloseBenchError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{'scratch blocks':>14}  {'on NVMe':>7}  {'persist':>7}  {'close ms':>9}  {'us/NVMe block':>13}  {'us/block':>8}")
    for blocks, row in result.items():
        for persist, figures in row.items():
            print(f"{blocks:>14}  {figures['nvme_blocks']:>7}  {persist[8:]:>7}  {figures['close_ms']:>9.1f}  "
                  f"{figures['us_per_nvme_block']:>13.2f}  {figures['us_per_block']:>8.2f}")
    print(f"medians of {args.reps} closes each; us/NVMe block: the whole close over the scratch blocks it deleted "
          "from NVMe; us/block: over every scratch block of the decode (any tier)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
