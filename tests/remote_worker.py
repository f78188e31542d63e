"""One process of the two-process acceptance test: its own HBM (CPU device), DRAM and NVMe
tiers plus the shared remote tier. ``put`` stores a prompt's KV and waits for a line on
stdin before closing (its Mooncake segment holds the values); ``get`` finds a prompt by
prefix and checks every block bit for bit. Prints one JSON line."""

from __future__ import annotations

import json
import sys
import tempfile

import torch

from tiercache.config import KVLayout, RemoteConfig, TierConfig
from tiercache.keys import prefix_keys
from tiercache.live.store import TieredKVStore

LAYOUT = KVLayout(layers=4, kv_heads=4, head_dim=64, dtype="bfloat16", block_tokens=16)  # 64 KiB blocks


def expected(n_blocks: int, seed: int) -> tuple[list[int], torch.Tensor]:
    """The prompt and its KV, the same in both processes (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (n_blocks * LAYOUT.block_tokens,), generator=gen).tolist()
    return tokens, torch.randn((n_blocks, *LAYOUT.block_shape), generator=gen).to(torch.bfloat16)


def main(mode: str, master: str, metadata: str, namespace: str, seed: int, n_blocks: int) -> None:
    remote = RemoteConfig(master, metadata, segment_bytes=64 << 20, buffer_bytes=16 << 20)
    tiers = [TierConfig("hbm", 4), TierConfig("dram", 8), TierConfig("nvme", 16), TierConfig("remote", 1024, remote=remote)]
    tokens, kv = expected(n_blocks, seed)
    with TieredKVStore(LAYOUT, tiers, path=tempfile.mkdtemp(prefix="tiercache-worker-"), device="cpu") as store:
        if mode == "put":
            stored = store.put_tokens(tokens, kv, namespace=namespace)
            store.wait()
            print(json.dumps({"stored": stored, "published": store.stats()["remote"]["puts"]}), flush=True)
            sys.stdin.readline()
            return
        found = store.match_prefix(tokens, namespace=namespace) // LAYOUT.block_tokens
        other = store.match_prefix(tokens, namespace=namespace + "-other")
        got = store.get_prefix(prefix_keys(tokens, LAYOUT.block_tokens, namespace))
        print(json.dumps({"found": found, "other_namespace": other, "read": len(got),
                          "identical": bool(torch.equal(got, kv[: len(got)])), "remote": store.stats()["remote"]}), flush=True)


if __name__ == "__main__":
    mode, master, metadata, namespace, seed, n_blocks = sys.argv[1:7]
    main(mode, master, metadata, namespace, int(seed), int(n_blocks))
