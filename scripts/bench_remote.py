"""The remote tier (Mooncake Store) vs raw ``MooncakeDistributedStore`` batch calls.

In one run, on the same bytes and registered buffers: batched puts and gets of blocks
through tiercache's remote tier (the manager's move API, the copy handlers, header and
checksum) against raw ``batch_put_from`` / ``batch_get_into``. Starts and stops its own
master (and, unless ``--local-segment``, a second client process whose segment holds the
values, so every byte crosses TCP loopback). Prints GB/s medians and the median per-rep
ratio of tiercache to raw; ``--json OUT`` writes ``{"ratios": {"get": r, "put": r}, ...}``.
See ``tiercache.bench.remote`` for what each side times.

Usage: ``python scripts/bench_remote.py [--json OUT] [--blocks 64] [--reps 15]
[--model llama-3-8b] [--block-tokens 256] [--local-segment]``
"""

from __future__ import annotations

import argparse
import json
import sys

from tiercache.bench.remote import RemoteBenchConfig, run_remote_bench
from tiercache.bench.rounds import positive_int
from tiercache.bench.script_args import ScriptParser, refuse_bad_outputs
from tiercache.config import KVLayout, layout_preset
from tiercache.errors import UserError


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, KVLayout]:
    """The options and the per-layer block layout, checked before the master and the holder
    start (one line and exit 2 otherwise): counts positive, a known ``--model`` preset,
    ``--json`` writable."""
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--blocks", type=positive_int, default=64, help="blocks per batch (default 64)")
    parser.add_argument("--reps", type=positive_int, default=15, help="repetitions; medians are reported (default 15)")
    parser.add_argument("--model", default="llama-3-8b", help="layout preset (default llama-3-8b)")
    parser.add_argument("--block-tokens", type=positive_int, default=256, help="tokens per block (default 256)")
    parser.add_argument("--local-segment", action="store_true", help="keep the values in the bench client's own segment")
    args = parser.parse_args(argv)
    try:
        preset = layout_preset(args.model, block_tokens=args.block_tokens)
    except UserError as error:
        parser.error(f"--model: {error}")
    refuse_bad_outputs(parser, {"--json": args.json})
    layout = KVLayout(preset.layers, preset.kv_heads, preset.head_dim, preset.dtype, preset.block_tokens, per_layer=True)  # 1 MiB (llama-3-8b)
    return args, layout


def main(argv: list[str] | None = None) -> int:
    args, layout = parse_args(argv)
    result = run_remote_bench(RemoteBenchConfig(layout, args.blocks, args.reps, args.local_segment))
    print(f"{result['blocks']} blocks of {result['block_bytes'] / 2**20:.2f} MiB, {result['reps']} reps, values in {result['values_in']}")
    print(f"{'op':<5}{'raw GB/s':>10}{'tiercache GB/s':>16}{'ratio':>8}{'raw two-part GB/s':>19}")
    for op in ("put", "get"):
        gbps = result["gbps"]
        print(f"{op:<5}{gbps[f'raw_{op}']:>10.2f}{gbps[f'tc_{op}']:>16.2f}{result['ratios'][op]:>8.2f}{gbps[f'raw_mb_{op}']:>19.2f}")
    print("ratio: median over repetitions of tiercache / raw, measured side by side (the machine may be shared)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
