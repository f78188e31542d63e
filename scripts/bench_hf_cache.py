#!/usr/bin/env python3
"""What the drop-in ``transformers`` cache costs: a tiny random-weight Llama decodes the same
prompt with transformers' ``DynamicCache`` (SDPA) and with tiercache's ``TieredCache`` twice:
every block in HBM (the integration's own overhead) and with HBM holding an eighth of the KV
(the rest in DRAM and NVMe, read back every step: the cost of spilling).

Each side runs once per round, the one that goes first rotating (``tiercache.bench.rounds``);
a round is a prefill of ``--context`` tokens and ``--new`` greedy decode steps. Reported:
medians of prefill seconds and of per-token decode seconds, and the median over rounds of each
side's ratio to ``DynamicCache`` in the same round. Every side must produce the same greedy
tokens (checked; the script exits 1 otherwise). The KV each side keeps on the model's device
is stated: ``DynamicCache`` holds all of it, ``TieredCache`` at most its HBM tier (on CUDA the
peak allocated memory of each side is measured too).

    python scripts/bench_hf_cache.py --context 2048 --new 16 --rounds 3 --out hf_cache.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from tiercache import TieredKVCache
from tiercache.bench.rounds import alternate, paired_ratio, positive_int
from tiercache.config import TierConfig

try:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from tiercache.integrations.transformers import TieredCache, kv_layout, use_tiercache
except ImportError:  # the hf extra is missing: say so instead of a traceback
    sys.exit("bench_hf_cache.py needs transformers: pip install -e '.[hf]'")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=positive_int, default=2048, help="prompt tokens")
    parser.add_argument("--new", type=positive_int, default=16, help="greedy decode steps")
    parser.add_argument("--rounds", type=positive_int, default=3, help="alternated rounds (medians over them)")
    parser.add_argument("--block-tokens", type=positive_int, default=64)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--hidden", type=positive_int, default=512)
    parser.add_argument("--heads", type=positive_int, default=8)
    parser.add_argument("--kv-heads", type=positive_int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads or args.hidden % args.heads:
        parser.error("--heads must be a multiple of --kv-heads and divide --hidden")
    return args


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.context + args.new + 8)
    return LlamaForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype)).eval()


def sync(device: str) -> None:
    """Waits for the device, so that a timer reads finished work."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode(model, prompt: torch.Tensor, cache, new: int, device: str) -> dict:
    """Prefill then ``new`` greedy steps; seconds of each, the tokens and the peak device memory."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    logits = model(prompt, cache=cache).logits[:, -1]
    sync(device)
    prefill = time.perf_counter() - start
    tokens, steps = [], []
    for _ in range(new):
        token = logits.argmax(-1, keepdim=True)
        tokens.append(int(token))
        start = time.perf_counter()
        logits = model(token, cache=cache).logits[:, -1]
        sync(device)
        steps.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else None
    return {"prefill_s": prefill, "token_s": statistics.median(steps), "tokens": tokens, "peak_bytes": peak}


def tiered_side(model, args: argparse.Namespace, hbm_blocks: int, total_blocks: int):
    """A round of ``TieredCache`` over tiers whose HBM holds ``hbm_blocks`` blocks of each
    layer (a tier's capacity counts one layer's block as one block)."""
    layout = kv_layout(model.config, getattr(torch, args.dtype), args.block_tokens)
    layers = layout.layers
    tiers = [TierConfig("hbm", hbm_blocks * layers), TierConfig("dram", max(1, total_blocks // 4) * layers),
             TierConfig("nvme", (total_blocks + 8) * layers)]

    def run(prompt):
        with tempfile.TemporaryDirectory() as path, \
                TieredKVCache(layout, tiers, path=path, device=args.device) as kv:
            return decode(model, prompt, TieredCache(kv, model), args.new, args.device)
    return run


def main(argv: list[str] | None = None) -> int:
    warnings.simplefilter("ignore", FutureWarning)  # transformers' past_key_values -> cache rename
    args = parse_args(argv)
    model = build_model(args)
    prompt = torch.randint(1, 1024, (1, args.context), generator=torch.Generator().manual_seed(1)).to(args.device)
    total_blocks = (args.context + args.new) // args.block_tokens + 1
    spill_blocks = max(2, total_blocks // 8)
    sides = {"dynamic": lambda p: decode(model, p, DynamicCache(config=model.config), args.new, args.device)}
    sides["tiered_all_hbm"] = tiered_side(model, args, total_blocks + 1, total_blocks)
    sides["tiered_spilled"] = tiered_side(model, args, spill_blocks, total_blocks)
    implementation = {"dynamic": "sdpa", "tiered_all_hbm": "tiercache", "tiered_spilled": "tiercache"}

    def op(name):
        def run(_round: int) -> dict:
            if implementation[name] == "sdpa":
                model.set_attn_implementation("sdpa")
            else:
                use_tiercache(model)
            return sides[name](prompt)
        return run

    results = alternate({name: op(name) for name in sides}, args.rounds)
    report = summarise(results, args, spill_blocks, total_blocks, model)
    print_report(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if report["same_tokens"] else 1


def summarise(results: dict, args, spill_blocks: int, total_blocks: int, model) -> dict:
    layout = kv_layout(model.config, getattr(torch, args.dtype), args.block_tokens)
    block_bytes = 2 * layout.kv_heads * layout.head_dim * layout.block_tokens * layout.dtype_bytes
    kv_bytes = (args.context + args.new) * layout.bytes_per_token
    tokens = {name: rounds[0]["tokens"] for name, rounds in results.items()}
    sides = {}
    for name, rounds in results.items():
        sides[name] = {
            "prefill_s": statistics.median(r["prefill_s"] for r in rounds),
            "token_s": statistics.median(r["token_s"] for r in rounds),
            "token_ratio_vs_dynamic": paired_ratio([r["token_s"] for r in rounds],
                                                   [r["token_s"] for r in results["dynamic"]]),
            "prefill_ratio_vs_dynamic": paired_ratio([r["prefill_s"] for r in rounds],
                                                     [r["prefill_s"] for r in results["dynamic"]]),
            "peak_device_bytes": statistics.median(r["peak_bytes"] for r in rounds) if rounds[0]["peak_bytes"] else None,
        }
    sides["dynamic"]["kv_on_device_bytes"] = kv_bytes
    sides["tiered_all_hbm"]["kv_on_device_bytes"] = min(kv_bytes, (total_blocks + 1) * layout.layers * block_bytes)
    sides["tiered_spilled"]["kv_on_device_bytes"] = spill_blocks * layout.layers * block_bytes
    return {"device": args.device, "dtype": args.dtype, "context": args.context, "new": args.new,
            "rounds": args.rounds, "block_tokens": args.block_tokens, "hbm_blocks_spilled": spill_blocks,
            "blocks_per_layer": total_blocks, "same_tokens": len({tuple(t) for t in tokens.values()}) == 1,
            "sides": sides}


def print_report(report: dict) -> None:
    print(f"{report['context']}-token prompt, {report['new']} decode steps, {report['device']} {report['dtype']}, "
          f"medians of {report['rounds']} alternated rounds")
    print(f"{'side':<16}{'prefill s':>11}{'x dynamic':>11}{'ms/token':>10}{'x dynamic':>11}{'KV on device':>15}")
    for name, side in report["sides"].items():
        print(f"{name:<16}{side['prefill_s']:>11.3f}{side['prefill_ratio_vs_dynamic']:>11.2f}"
              f"{side['token_s'] * 1e3:>10.2f}{side['token_ratio_vs_dynamic']:>11.2f}"
              f"{side['kv_on_device_bytes'] / 2**20:>12.1f} MiB")
    print("same greedy tokens on every side" if report["same_tokens"] else "TOKENS DIFFER between sides")
    if report["device"] == "cpu":
        print("(on the CPU 'device' and DRAM are the same memory: the KV figures are what each side keeps in "
              "its device tier, not a measured saving)")


if __name__ == "__main__":
    sys.exit(main())
