"""The remote tier against raw Mooncake Store batch calls (``scripts/bench_remote.py``).

One run, same bytes, same registered buffers, same client, side by side:

* ``put``: tiercache publishes N blocks from the HBM pool (the CPU device here, with the
  header room a live pool keeps above a remote tier) into the remote tier through the
  manager's move API (plan, ``PoolToRemote`` handler: header written before each block,
  xxh3 checksum, one ``batch_put_from`` of ``[header | block]`` per 16 blocks, job settled
  and completed by the manager) vs one raw ``batch_put_from`` of the same pool slots;
* ``get``: tiercache prefetches the N blocks from the remote tier into the pool (plan,
  ``RemoteToPool``: ``batch_get_into`` of ``[header | block]`` straight into the slots,
  checksum verified, completion) vs one raw ``batch_get_into`` into the same slots.

A third side, ``raw_mb``, is the raw two-buffer call (a 64-byte header buffer plus the
slot, no checksum, no manager) tiercache makes for memory without header room: what a
two-part value costs in Mooncake itself. The ratios are against the plain raw calls.

By default the values live in another process's segment (a holder client started here,
the bench's own client contributing none), so every byte crosses TCP loopback, as it
would from another machine; ``local_segment`` keeps them in the bench's own segment.
Each repetition uses fresh keys (a put of an existing key is a no-op in Mooncake) and
removes the previous ones outside the clock; the three sides rotate their order every
repetition (each runs first, second and last in turn); there is no untimed warm-up (the
first repetition counts; the figures are medians over ``--reps``); every side's reads are
checked bit for bit against the source, and tiercache's put must have written each value
(its ``puts`` grew by the blocks put, none found there already), outside the clock.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..config import KVLayout, RemoteConfig
from ..core.manager import TierManager
from ..data.engine import LocalEngine
from ..data.pools import HEADER_ROOM, BlockPool
from ..data.remote import RemoteStore, value_name
from ..data.remote_master import MasterProcess, start_master
from ..policies import make_admission, make_eviction

__all__ = ["RemoteBenchConfig", "run_remote_bench"]

_HOLDER = """
import sys
from mooncake.store import MooncakeDistributedStore
client = MooncakeDistributedStore()
assert client.setup("127.0.0.1", sys.argv[2], int(sys.argv[3]), 16 << 20, "tcp", "", sys.argv[1]) == 0
print("ready", flush=True)
sys.stdin.read()
"""


#: The sides' order in each repetition, in turn: each runs first, second and last once per three.
_ORDERS = (("raw", "tc", "raw_mb"), ("tc", "raw_mb", "raw"), ("raw_mb", "raw", "tc"))


@dataclass(frozen=True)
class RemoteBenchConfig:
    """What to measure: ``blocks`` blocks of ``layout`` per batch, ``reps`` repetitions.

    Invariant: ``blocks`` and ``reps`` are at least 1 (checked here, before a master starts).
    """

    layout: KVLayout
    blocks: int = 64
    reps: int = 15
    local_segment: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("blocks", "reps"):
            if getattr(self, name) < 1:
                raise ValueError(f"RemoteBenchConfig: {name} must be at least 1, got {getattr(self, name)}")


class _Sides:
    """The bench's client, pool, manager and engine (tiercache side) over one master."""

    def __init__(self, config: RemoteBenchConfig, master: MasterProcess) -> None:
        n, layout = config.blocks, config.layout
        segment = 0 if not config.local_segment else 6 * n * (layout.block_bytes + 64) + (64 << 20)
        remote_config = RemoteConfig(master.master, master.metadata, segment_bytes=segment, buffer_bytes=64 << 20, timeout_s=30)
        self.remote = RemoteStore(remote_config, layout)
        self.pool = BlockPool(layout, n, "cpu", header_room=HEADER_ROOM)  # as a live tier above a remote tier
        self.client = self.remote.client
        self.remote.register(self.pool.host_buffer)
        self.keys: dict[int, bytes] = {}
        self.engine = LocalEngine([self.pool, self.remote], self.keys.__getitem__)
        self.manager = TierManager([("hbm", n), ("remote", n)], [make_eviction("lru", n), make_eviction("lru", n)],
                                   [make_admission("always"), make_admission("always")], engine=self.engine, shared_last=True)
        gen = torch.Generator().manual_seed(config.seed)
        self.source = torch.randn((n, *layout.block_shape), generator=gen).to(self.pool.dtype)
        self.n, self.nbytes = n, n * layout.block_bytes
        self.pointers = [self.pool.view(i).data_ptr() for i in range(n)]  # each slot's block
        self.headers = np.zeros((n, 64), np.uint8)
        self.remote.register(self.headers)
        self.two_part = [[self.headers[i].ctypes.data, p] for i, p in enumerate(self.pointers)]

    def fill(self) -> None:
        self.pool.tensor.copy_(self.source)

    def clear(self) -> None:
        self.pool.tensor.zero_()

    # -- raw --------------------------------------------------------------------------------
    def raw_put(self, names: list[str]) -> float:
        start = time.perf_counter()
        codes = self.client.batch_put_from(names, self.pointers, [self.pool.block_bytes] * self.n)
        seconds = time.perf_counter() - start
        assert all(c == 0 for c in codes), f"raw put failed: {sorted(set(codes))}"
        return seconds

    def raw_get(self, names: list[str]) -> float:
        start = time.perf_counter()
        codes = self.client.batch_get_into(names, self.pointers, [self.pool.block_bytes] * self.n)
        seconds = time.perf_counter() - start
        assert all(c == self.pool.block_bytes for c in codes), f"raw get failed: {sorted(set(codes))}"
        return seconds

    def raw_mb_put(self, names: list[str]) -> float:
        start = time.perf_counter()
        codes = self.client.batch_put_from_multi_buffers(names, self.two_part, [[64, self.pool.block_bytes]] * self.n)
        seconds = time.perf_counter() - start
        assert all(c == 0 for c in codes), f"raw two-part put failed: {sorted(set(codes))}"
        return seconds

    def raw_mb_get(self, names: list[str]) -> float:
        start = time.perf_counter()
        codes = self.client.batch_get_into_multi_buffers(names, self.two_part, [[64, self.pool.block_bytes]] * self.n)
        seconds = time.perf_counter() - start
        assert all(c == 64 + self.pool.block_bytes for c in codes), f"raw two-part get failed: {sorted(set(codes))}"
        return seconds

    # -- tiercache (the manager's move API) ------------------------------------------------
    def tc_put(self, keys: list[bytes]) -> float:
        ids = list(range(len(self.keys), len(self.keys) + self.n))
        self.keys.update(zip(ids, keys))
        self.manager.restore(0, ids, list(range(self.n)))  # the blocks are in the pool's slots
        written = self.remote.stats["puts"]
        start = time.perf_counter()
        plans = self.manager.publish(ids)
        self.manager.wait_all()
        seconds = time.perf_counter() - start
        assert plans and set(ids) <= set(self.manager.dirs[1].slot_of), "tiercache put failed"
        assert self.remote.stats["puts"] - written == self.n, "tiercache put wrote fewer values than it was given"
        self.manager.evict(ids)  # leaves both directories (values stay in the store)
        self._ids = ids
        return seconds

    def tc_get(self) -> float:
        ids = self._ids
        self.manager.restore(1, ids)  # what a lookup adopts
        start = time.perf_counter()
        self.manager.prefetch(ids)
        self.manager.wait_all()
        seconds = time.perf_counter() - start
        assert set(ids) <= set(self.manager.dirs[0].slot_of), "tiercache get failed"
        order = [self.manager.dirs[0].slot_of[i] for i in ids]
        assert torch.equal(self.pool.tensor[order], self.source), "tiercache get is not bit-identical"
        self.manager.evict(ids)
        return seconds

    def check_raw(self) -> None:
        assert torch.equal(self.pool.tensor, self.source), "raw get is not bit-identical"

    def remove(self, names: list[str]) -> None:
        self.client.batch_remove(names, True)

    def close(self) -> None:
        self.remote.close()


def _start_holder(master: MasterProcess, segment: int) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, master.master, master.metadata, str(segment)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if holder.stdout.readline().strip() != "ready":
        holder.kill()
        raise RuntimeError("the holder client did not start")
    return holder


def run_remote_bench(config: RemoteBenchConfig) -> dict:
    """Runs the comparison; returns GB/s medians per side and the median per-rep ratios."""
    master = start_master()
    holder = None
    try:
        if not config.local_segment:
            holder = _start_holder(master, 6 * config.blocks * (config.layout.block_bytes + 64) + (64 << 20))
        sides = _Sides(config, master)
        try:
            return _measure(sides, config)
        finally:
            sides.close()
    finally:
        if holder is not None:
            holder.communicate("", timeout=30)
        master.stop()


def _measure(sides: _Sides, config: RemoteBenchConfig) -> dict:
    rate = {k: [] for k in ("raw_put", "tc_put", "raw_mb_put", "raw_get", "tc_get", "raw_mb_get")}
    ratios = {"put": [], "get": []}
    for rep in range(config.reps):
        keys = [bytes([rep % 256]) + i.to_bytes(15, "little") for i in range(sides.n)]
        raw_names = [f"bench-raw/{rep}/{i}" for i in range(sides.n)]
        mb_names = [f"bench-raw-mb/{rep}/{i}" for i in range(sides.n)]
        tc_names = [value_name(sides.remote.tag, k) for k in keys]
        put = {"raw": lambda: sides.raw_put(raw_names), "tc": lambda: sides.tc_put(keys), "raw_mb": lambda: sides.raw_mb_put(mb_names)}
        get = {"raw": lambda: sides.raw_get(raw_names), "tc": sides.tc_get, "raw_mb": lambda: sides.raw_mb_get(mb_names)}
        seconds = {}
        for side in _ORDERS[rep % len(_ORDERS)]:
            sides.fill()
            seconds[f"{side}_put"] = put[side]()
            sides.clear()
            seconds[f"{side}_get"] = get[side]()
            if side != "tc":
                sides.check_raw()
        sides.remove(raw_names + mb_names + tc_names)
        for name, value in seconds.items():
            rate[name].append(sides.nbytes / value / 1e9)
        ratios["put"].append(seconds["raw_put"] / seconds["tc_put"])
        ratios["get"].append(seconds["raw_get"] / seconds["tc_get"])
    return {"blocks": sides.n, "block_bytes": config.layout.block_bytes, "reps": config.reps,
            "values_in": "this client's segment" if config.local_segment else "another process's segment (TCP loopback)",
            "gbps": {k: statistics.median(v) for k, v in rate.items()},
            "ratios": {k: statistics.median(v) for k, v in ratios.items()},
            "ratio_samples": ratios}
