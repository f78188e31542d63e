"""Prefill-to-decode hand-off through the shared remote tier (issue 11): disaggregation.

Starts a Mooncake master, then two processes, each with its own local tiers (HBM on the
CPU device here, DRAM, NVMe) and its own Mooncake client:

* **prefill** runs a tiny random-weight Llama (``transformers``' ``LlamaConfig``, seeded:
  no weights are downloaded) over a long prompt, stores the prompt's KV blocks with
  ``put_tokens`` (published to the remote tier at once: ``remote_write=through``) and waits;
* **decode** builds the same model (same seed, same weights), finds the prompt's KV by prefix
  (``match_prefix``: one batched existence check), reads it (``get_prefix``: remote -> HBM),
  rebuilds the model's KV cache from the blocks, runs only the uncached tail and decodes.
  It also recomputes the whole prefill, and checks that both paths give the same tokens.

Prints time to first token with the hand-off against recomputing the prefill, and the bytes
moved. Needs the ``remote`` and ``hf`` extras.

Usage: ``python scripts/disagg_demo.py [--tokens 2048] [--new-tokens 8] [--json OUT]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings

import torch

from tiercache.config import KVLayout, RemoteConfig, TierConfig
from tiercache.data.remote_master import start_master
from tiercache.keys import prefix_keys
from tiercache.live.store import TieredKVStore

BLOCK_TOKENS, NAMESPACE = 64, "disagg-demo"
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers renames past_key_values in 5.x


def build_model(seed: int):
    """A tiny Llama with random weights (the same in both processes: seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=16384)
    return LlamaForCausalLM(config).eval()


def layout_of(model) -> KVLayout:
    c = model.config
    return KVLayout(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads, "float32", BLOCK_TOKENS)


def open_store(model, master: str, metadata: str) -> TieredKVStore:
    """Local tiers (HBM on the CPU device here, DRAM, NVMe) plus the shared remote tier."""
    remote = RemoteConfig(master, metadata, segment_bytes=256 << 20, buffer_bytes=64 << 20)
    tiers = [TierConfig("hbm", 64), TierConfig("dram", 64), TierConfig("nvme", 256), TierConfig("remote", 4096, remote=remote)]
    return TieredKVStore(layout_of(model), tiers, path=tempfile.mkdtemp(prefix="tiercache-disagg-"), device="cpu")


def prompt_ids(tokens: int, seed: int) -> list[int]:
    return torch.randint(0, 2000, (tokens,), generator=torch.Generator().manual_seed(seed + 1)).tolist()


def kv_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(keys, values)`` per layer, each ``[1, kv_heads, tokens, head_dim]``."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def to_blocks(cache, n_blocks: int) -> torch.Tensor:
    """The first ``n_blocks`` blocks of a model cache as ``[n, layers, 2, kv_heads, bt, hd]``."""
    layers = [torch.stack((k[0], v[0])) for k, v in kv_layers(cache)]  # [2, kv_heads, T, hd] each
    kv = torch.stack(layers)[:, :, :, : n_blocks * BLOCK_TOKENS]  # [layers, 2, kv_heads, T', hd]
    kv = kv.unflatten(3, (n_blocks, BLOCK_TOKENS))  # [layers, 2, kv_heads, n, bt, hd]
    return kv.permute(3, 0, 1, 2, 4, 5).contiguous()


def from_blocks(blocks: torch.Tensor, model):
    """A ``DynamicCache`` holding the tokens of ``blocks`` (inverse of ``to_blocks``)."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers before the per-layer caches
        cache = DynamicCache()
    kv = blocks.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)  # [layers, 2, kv_heads, T, hd]
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0].unsqueeze(0).contiguous(), kv[layer, 1].unsqueeze(0).contiguous(), layer)
    return cache


@torch.no_grad()
def greedy(model, ids: list[int], cache, new_tokens: int) -> tuple[list[int], float]:
    """Runs ``ids`` after ``cache`` (None: from scratch) and decodes greedily; returns the
    tokens and the seconds to the first one."""
    start = time.perf_counter()
    out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    first = time.perf_counter() - start
    cache = out.past_key_values
    for _ in range(new_tokens - 1):
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
        cache = out.past_key_values
    return tokens, first


@torch.no_grad()
def prefill(args) -> None:
    model = build_model(args.seed)
    ids = prompt_ids(args.tokens, args.seed)
    start = time.perf_counter()
    out = model(torch.tensor([ids]), use_cache=True)
    seconds = time.perf_counter() - start
    n_blocks = len(ids) // BLOCK_TOKENS
    with open_store(model, args.master, args.metadata) as store:
        start = time.perf_counter()
        stored = store.put_tokens(ids[: n_blocks * BLOCK_TOKENS], to_blocks(out.past_key_values, n_blocks), namespace=NAMESPACE)
        store.wait()  # the remote puts run in the background
        store_seconds = time.perf_counter() - start
        remote = store.stats()["remote"]
        print(json.dumps({"prefill_s": seconds, "store_s": store_seconds, "blocks": stored, "published": remote["puts"],
                          "bytes_put": remote["puts"] * store.layout.block_bytes}), flush=True)
        sys.stdin.readline()  # this client's segment holds the values: stay until decode is done


def decode(args) -> None:
    model = build_model(args.seed)
    ids = prompt_ids(args.tokens, args.seed)
    with open_store(model, args.master, args.metadata) as store:
        start = time.perf_counter()
        found = store.match_prefix(ids, namespace=NAMESPACE)
        cached = min(found, len(ids) - 1)  # the last prompt token always runs: it yields the first logits
        blocks = store.get_prefix(prefix_keys(ids, BLOCK_TOKENS, NAMESPACE)[: cached // BLOCK_TOKENS])
        cached = len(blocks) * BLOCK_TOKENS
        fetch = time.perf_counter() - start
        handoff, first = greedy(model, ids[cached:], from_blocks(blocks, model) if cached else None, args.new_tokens)
        stats = store.stats()
    recomputed, recompute_first = greedy(model, ids, None, args.new_tokens)
    print(json.dumps({"found_tokens": found, "cached_tokens": cached, "fetch_s": fetch, "tail_s": first,
                      "ttft_handoff_s": fetch + first, "ttft_recompute_s": recompute_first, "same_tokens": handoff == recomputed,
                      "tokens": handoff, "bytes_fetched": stats["bytes_moved"].get("remote->hbm", 0),
                      "remote_gets": stats["remote"]["gets"], "exists_calls": stats["remote"]["exists_calls"]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length (default 2048)")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens to decode (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write both processes' results here")
    parser.add_argument("--role", choices=("prefill", "decode"), help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--metadata", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "prefill":
        return prefill(args)
    if args.role == "decode":
        return decode(args)
    run_demo(args)


def run_demo(args) -> None:
    """The parent: a master, the prefill process, then the decode process."""
    master = start_master()
    common = ["--tokens", str(args.tokens), "--new-tokens", str(args.new_tokens), "--seed", str(args.seed),
              "--master", master.master, "--metadata", master.metadata]
    prefill_process = subprocess.Popen([sys.executable, __file__, "--role", "prefill", *common], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        produced = json.loads(prefill_process.stdout.readline())
        done = subprocess.run([sys.executable, __file__, "--role", "decode", *common], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"decode failed:\n{done.stderr[-3000:]}")
        consumed = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        prefill_process.communicate("done\n", timeout=60)
        master.stop()
    report(produced, consumed, args)


def report(produced: dict, consumed: dict, args) -> None:
    print(f"prompt {args.tokens} tokens, {BLOCK_TOKENS}-token blocks; tiny random Llama (4 layers, 4 KV heads, fp32 KV)")
    print(f"prefill process: prefill {produced['prefill_s'] * 1e3:.1f} ms, stored {produced['blocks']} blocks, "
          f"published {produced['published']} ({produced['bytes_put'] / 2**20:.1f} MiB) in {produced['store_s'] * 1e3:.1f} ms")
    print(f"decode process:  found {consumed['found_tokens']} tokens by prefix ({consumed['exists_calls']} exists call), "
          f"fetched {consumed['remote_gets']} blocks ({consumed['bytes_fetched'] / 2**20:.1f} MiB) in {consumed['fetch_s'] * 1e3:.1f} ms")
    speedup = consumed["ttft_recompute_s"] / consumed["ttft_handoff_s"]
    print(f"TTFT with hand-off {consumed['ttft_handoff_s'] * 1e3:.1f} ms (fetch {consumed['fetch_s'] * 1e3:.1f} + tail "
          f"{consumed['tail_s'] * 1e3:.1f}) vs recompute {consumed['ttft_recompute_s'] * 1e3:.1f} ms: {speedup:.2f}x")
    print(f"same {args.new_tokens} tokens decoded either way: {consumed['same_tokens']} {consumed['tokens']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"prefill": produced, "decode": consumed}, handle, indent=2)


if __name__ == "__main__":
    main()
