"""Fleet replay against probe N (findings 2, 3 and 9 of its fleet part).

The shared tier is written as the live one is: a put skips the blocks the store holds
(``already``: nothing moves, nothing is charged) and a victim the instance's view holds
leaves with no put, so ``shared_writes`` is exactly the blocks charged into ``remote``. The
matched prefix is pinned while it is read, so every block counted as reused is a hit. A
fleet too large for the memory is refused up front, naming the figure.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tiercache.cli import main
from tiercache.config import TierConfig, layout_preset
from tiercache.errors import UserError
from tiercache.sim.fleet import INSTANCE_BYTES, FleetSpec, check_fleet_memory, replay_fleet
from tiercache.sim.loader import load_trace
from tiercache.sim.sweep import SLOT_BYTES

LAYOUT = layout_preset("llama-3-8b", 512)


def _trace(tmp_path: Path, requests: list[list[int]]):
    """A Mooncake trace (512-token blocks), each prompt exactly its blocks' tokens."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(r), "output_length": 1, "hash_ids": r}) + "\n"
                            for i, r in enumerate(requests)))
    return load_trace(path)


def _charged_into_remote(run) -> dict[str, int]:
    """Blocks charged on each link into the shared tier."""
    return {link: n // LAYOUT.block_bytes for link, n in run.bytes_moved.items() if link.endswith("->remote")}


# ----------------------------------------------------------------------------- finding 2


def test_a_demotion_of_a_block_the_store_holds_is_not_charged(tmp_path):
    """Request 3 promotes block 1 out of the view (the store keeps it); request 4 demotes it
    from HBM into the view again: a put the store skips, no bytes (it was charged: 4 blocks)."""
    run = replay_fleet(FleetSpec(1, (TierConfig("hbm", 1),), 2), _trace(tmp_path, [[1], [2], [1], [3]]), LAYOUT)
    assert run.shared_hits == 1
    assert run.shared_writes == 3 and _charged_into_remote(run) == {"hbm->remote": 3}  # 1, 2, 3 written once each


def test_a_victim_the_view_holds_is_not_put_back_into_the_store(tmp_path):
    """Instance 0's view still lists block 1 after instance 1's write evicted it from the store
    (capacity 1): its HBM victim 1 leaves with no put, as live, so the store does not get it
    back for free and instance 1's later request for it is a miss (it was a shared hit, and a
    write no link carried)."""
    run = replay_fleet(FleetSpec(2, (TierConfig("hbm", 1),), 1), _trace(tmp_path, [[1], [2], [3], [1]]), LAYOUT)
    assert run.shared_writes == 4 and _charged_into_remote(run) == {"hbm->remote": 4}
    assert run.shared_hits == 0 and run.hits == 0


def test_every_block_written_to_the_store_is_charged_once(tmp_path):
    """Several instances, small tiers, shared prefixes: the store's writes are the blocks
    charged into it, on every link (HBM publishes and DRAM demotions)."""
    rng = random.Random(7)
    documents = [[100 * d + b for b in range(rng.randint(2, 6))] for d in range(8)]
    requests = [rng.choice(documents)[: rng.randint(1, 6)] for _ in range(150)]
    run = replay_fleet(FleetSpec(3, (TierConfig("hbm", 3), TierConfig("dram", 4)), 10), _trace(tmp_path, requests), LAYOUT)
    charged = _charged_into_remote(run)
    assert set(charged) == {"hbm->remote", "dram->remote"} and run.shared_hits > 0
    assert run.shared_writes == sum(charged.values())


# ----------------------------------------------------------------------------- finding 3


def test_every_block_counted_as_reused_is_a_hit(tmp_path):
    """The last request's prefix 0, 1, 2 lies in the view and DRAM; promoting its first block
    pushed a later one out of the view (a miss, yet its tokens counted as saved). Pinned, as
    in the one-engine replay, all three are hits."""
    trace = _trace(tmp_path, [[10], [0, 1], [0, 1, 2], [0, 1], [10], [0, 1, 2, 3]])
    run = replay_fleet(FleetSpec(1, (TierConfig("hbm", 1), TierConfig("dram", 1)), 3), trace)
    # one request is found whole, and computes its last prompt token (probe q17): 1 token less
    assert run.hits == 7 and run.prefill_tokens_saved == 512 * run.hits - 1


# ----------------------------------------------------------------------------- finding 9


def test_a_fleet_over_half_the_available_memory_is_refused_with_the_most_that_fits():
    spec = FleetSpec(10, (TierConfig("hbm", 1000),), 1000)
    each = 2000 * SLOT_BYTES + INSTANCE_BYTES  # HBM and the view of the shared tier, per instance
    need = 10 * each + 1000 * SLOT_BYTES  # plus the shared store
    check_fleet_memory(spec, available=2 * need)
    with pytest.raises(UserError) as refused:
        check_fleet_memory(spec, available=2 * need - 2)
    message = str(refused.value)
    assert message.startswith("--instances/--tiers: a fleet of 10 instance(s) needs about 0.0 GB (2,000 slots per instance")
    assert "the most that fits is about 9 instances" in message
    with pytest.raises(UserError, match="not one instance fits: lower the capacities in --tiers"):
        check_fleet_memory(FleetSpec(1, (TierConfig("hbm", 1000),), 10**6), available=10**6)


def test_replay_refuses_more_instances_than_the_memory_holds_in_one_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}) + "\n")
    code = main(["replay", str(trace), "--instances", "1000000000", "--tiers", "hbm=1000,dram=4000,remote=16000",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "a fleet of 1,000,000,000 instance(s) needs about" in err and "over half of the" in err
