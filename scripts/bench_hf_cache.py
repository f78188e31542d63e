#!/usr/bin/env python3
"""What the drop-in ``transformers`` cache costs: a tiny random-weight Llama runs the same
prompt and the same decode tokens with transformers' ``DynamicCache`` (SDPA) and with
tiercache's ``TieredCache`` twice: every block in HBM (the integration's own overhead) and
with HBM holding about an eighth of the KV (the rest in DRAM and NVMe, read back every step:
the cost of spilling).

Each side runs once untimed first, then once per round, the one that goes first rotating
(``tiercache.bench.rounds``);
a round is a prefill of ``--context`` tokens and ``--new`` decode steps fed fixed random
tokens (teacher forcing: every side computes the same positions, so the check below compares
like with like). Reported: medians of prefill seconds and of per-token decode seconds, the
median and the range over rounds of each side's ratio to ``DynamicCache`` in the same round,
and the device memory each side holds for KV (``DynamicCache``: its tensors; ``TieredCache``:
its HBM tier and read-window buffers, ``TieredKVCache.device_bytes``; on CUDA the peak
allocated memory is printed too). Every side's logits must agree with ``DynamicCache``'s
within ``--tolerance`` at the prefill's last position and at every decode step (checked; the
script exits 1 otherwise).

    python scripts/bench_hf_cache.py --context 2048 --new 16 --rounds 3 --torch-threads 1 --out hf_cache.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from tiercache import TieredKVCache
from tiercache.bench.rounds import alternate, paired_ratio, positive_int
from tiercache.bench.script_args import ScriptParser, refuse_bad_outputs
from tiercache.live.media import resolve_device
from tiercache.config import TierConfig
from tiercache.errors import UserError
from tiercache.results.outfile import replace_file

try:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from tiercache.integrations.transformers import TieredCache, kv_layout, use_tiercache
except ImportError:  # the hf extra is missing: say so instead of a traceback
    sys.exit("bench_hf_cache.py needs transformers: pip install -e '.[hf]'")

VOCAB = 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=positive_int, default=2048, help="prompt tokens")
    parser.add_argument("--new", type=positive_int, default=16, help="decode steps")
    parser.add_argument("--rounds", type=positive_int, default=3, help="alternated rounds (medians over them)")
    parser.add_argument("--block-tokens", type=positive_int, default=64)
    parser.add_argument("--window-blocks", type=positive_int, default=8, help="blocks per chunk of a streamed read")
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--hidden", type=positive_int, default=512)
    parser.add_argument("--heads", type=positive_int, default=8)
    parser.add_argument("--kv-heads", type=positive_int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--torch-threads", type=positive_int, help="torch intra-op threads (steadier on a shared machine)")
    parser.add_argument("--tolerance", type=float, help="largest |logits - DynamicCache's| allowed (default by dtype)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads or args.hidden % args.heads:
        parser.error("--heads must be a multiple of --kv-heads and divide --hidden")
    if (args.hidden // args.heads) % 2:
        parser.error(f"--hidden / --heads must be even (rotary embeddings rotate pairs of dimensions), got "
                     f"{args.hidden} / {args.heads} = {args.hidden // args.heads}")
    try:
        resolve_device(args.device)
    except UserError as exc:
        parser.error(f"--device: {exc}")
    if (args.context + args.new) // args.block_tokens < 4:
        parser.error("--context + --new must fill at least 4 blocks, or the spilled side would not spill")
    if args.tolerance is None:
        args.tolerance = 1e-4 if args.dtype == "float32" else 5e-2
    if not math.isfinite(args.tolerance) or args.tolerance < 0:
        parser.error(f"--tolerance must be a finite number >= 0, got {args.tolerance}")
    refuse_bad_outputs(parser, {"--out": args.out})  # before the run, not after it
    return args


def blocks_per_layer(tokens: int, block_tokens: int) -> int:
    """Blocks one layer's KV of ``tokens`` tokens fills (every fed token's KV is stored; the
    last block may be partly filled)."""
    return -(-tokens // block_tokens)


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.context + args.new + 8)
    return LlamaForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype)).eval()


def sync(device: str) -> None:
    """Waits for the device, so that a timer reads finished work."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode(model, prompt: torch.Tensor, steps: torch.Tensor, cache, device: str) -> dict:
    """Prefill then one pass per token of ``steps``: seconds of each, every step's logits
    (on the host, float64) and the peak device memory."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    logits = [model(prompt, cache=cache).logits[:, -1]]
    sync(device)
    prefill = time.perf_counter() - start
    seconds = []
    for i in range(steps.shape[1]):
        start = time.perf_counter()
        logits.append(model(steps[:, i : i + 1], cache=cache).logits[:, -1])
        sync(device)
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else None
    return {"prefill_s": prefill, "token_s": statistics.median(seconds), "peak_bytes": peak,
            "logits": torch.cat(logits).double().cpu()}


def dynamic_side(model, args: argparse.Namespace):
    """A round of ``DynamicCache``; its KV bytes are its tensors' after the run."""
    def run(prompt, steps):
        cache = DynamicCache(config=model.config)
        result = decode(model, prompt, steps, cache, args.device)
        result["kv_device_bytes"] = sum(t.numel() * t.element_size() for layer in cache.layers
                                        for t in (layer.keys, layer.values) if t is not None)
        return result
    return run


def tiered_side(model, args: argparse.Namespace, hbm_blocks: int, total_blocks: int):
    """A round of ``TieredCache`` over tiers whose HBM holds ``hbm_blocks`` blocks of each
    layer (a tier's capacity counts one layer's block as one block)."""
    layout = kv_layout(model.config, getattr(torch, args.dtype), args.block_tokens)
    layers = layout.layers
    tiers = [TierConfig("hbm", hbm_blocks * layers), TierConfig("dram", max(1, total_blocks // 4) * layers),
             TierConfig("nvme", (total_blocks + 8) * layers)]

    def run(prompt, steps):
        with tempfile.TemporaryDirectory() as path, \
                TieredKVCache(layout, tiers, path=path, device=args.device, window_blocks=args.window_blocks) as kv:
            result = decode(model, prompt, steps, TieredCache(kv, model), args.device)
            result["kv_device_bytes"] = kv.device_bytes()
            return result
    return run


def main(argv: list[str] | None = None) -> int:
    warnings.simplefilter("ignore", FutureWarning)  # transformers' past_key_values -> cache rename
    args = parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    model = build_model(args)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, VOCAB, (1, args.context), generator=gen).to(args.device)
    steps = torch.randint(1, VOCAB, (1, args.new), generator=gen).to(args.device)
    total_blocks = blocks_per_layer(args.context + args.new, args.block_tokens)
    spill_blocks = max(2, total_blocks // 8)
    sides = {"dynamic": dynamic_side(model, args),
             "tiered_all_hbm": tiered_side(model, args, total_blocks + 1, total_blocks),
             "tiered_spilled": tiered_side(model, args, spill_blocks, total_blocks)}

    def op(name):
        def run(_round: int) -> dict:
            if name == "dynamic":
                model.set_attn_implementation("sdpa")
            else:
                use_tiercache(model)
            return sides[name](prompt, steps)
        return run

    results = alternate({name: op(name) for name in sides}, args.rounds)
    report = summarise(results, args, spill_blocks, total_blocks)
    print_report(report)
    if args.out:
        try:  # checked before the run; a disk that fills now leaves an earlier file as it was
            replace_file(args.out, json.dumps(report, indent=2) + "\n", f"--out {args.out}")
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    return 0 if report["logits_agree"] else 1


def summarise(results: dict, args, spill_blocks: int, total_blocks: int) -> dict:
    """The figures of every side (medians, ratio medians and ranges, logits errors)."""
    dynamic = results["dynamic"]
    sides = {}
    for name, rounds in results.items():
        token = [r["token_s"] / d["token_s"] for r, d in zip(rounds, dynamic)]
        sides[name] = {
            "prefill_s": statistics.median(r["prefill_s"] for r in rounds),
            "token_s": statistics.median(r["token_s"] for r in rounds),
            "token_ratio_vs_dynamic": paired_ratio([r["token_s"] for r in rounds], [d["token_s"] for d in dynamic]),
            "token_ratio_range": [min(token), max(token)],
            "prefill_ratio_vs_dynamic": paired_ratio([r["prefill_s"] for r in rounds], [d["prefill_s"] for d in dynamic]),
            "max_logits_error": max(float((r["logits"] - d["logits"]).abs().max()) for r, d in zip(rounds, dynamic)),
            "kv_device_bytes": max(r["kv_device_bytes"] for r in rounds),
            "peak_device_bytes": statistics.median(r["peak_bytes"] for r in rounds) if rounds[0]["peak_bytes"] else None,
        }
    agree = all(side["max_logits_error"] <= args.tolerance for side in sides.values())
    return {"device": args.device, "dtype": args.dtype, "torch_threads": torch.get_num_threads(),
            "context": args.context, "new": args.new, "rounds": args.rounds, "block_tokens": args.block_tokens,
            "window_blocks": args.window_blocks, "hbm_blocks_spilled": spill_blocks, "blocks_per_layer": total_blocks,
            "whole_blocks_per_layer": (args.context + args.new) // args.block_tokens,
            "tolerance": args.tolerance, "logits_agree": agree, "sides": sides}


def print_report(report: dict) -> None:
    print(f"{report['context']}-token prompt, {report['new']} decode steps, {report['device']} {report['dtype']}, "
          f"{report['torch_threads']} torch threads, medians of {report['rounds']} alternated rounds; spilled: HBM "
          f"holds {report['hbm_blocks_spilled']} of {report['whole_blocks_per_layer']} whole blocks per layer"
          + (" (the last, partly filled block, which the decode tokens fill, is no tier's)"
             if report["blocks_per_layer"] > report["whole_blocks_per_layer"] else ""))
    print(f"{'side':<16}{'prefill s':>10}{'x dyn':>7}{'ms/token':>10}{'x dyn':>7}{'(range)':>14}"
          f"{'KV device MiB':>15}{'peak MiB':>10}{'max |dlogit|':>14}")
    for name, side in report["sides"].items():
        low, high = side["token_ratio_range"]
        peak = "-" if side["peak_device_bytes"] is None else f"{side['peak_device_bytes'] / 2**20:.1f}"
        print(f"{name:<16}{side['prefill_s']:>10.3f}{side['prefill_ratio_vs_dynamic']:>7.2f}{side['token_s'] * 1e3:>10.2f}"
              f"{side['token_ratio_vs_dynamic']:>7.2f}{f'({low:.2f}-{high:.2f})':>14}"
              f"{side['kv_device_bytes'] / 2**20:>15.2f}{peak:>10}{side['max_logits_error']:>14.2e}")
    verdict = "within" if report["logits_agree"] else "BEYOND"
    print(f"logits of every side {verdict} {report['tolerance']:g} of DynamicCache's at every step")
    if report["device"] == "cpu":
        print("(on the CPU the 'device' is host memory: KV device MiB is what each side keeps in its device tier "
              "and read window, not a measured saving)")


if __name__ == "__main__":
    sys.exit(main())
