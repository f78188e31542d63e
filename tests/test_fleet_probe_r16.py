"""Fleet replay against probe R16 (finding 2).

Head-first publication (d5a4974) took the head of a request's *new* blocks only: a request
whose hit prefix the shared tier held wrote its new blocks after it, evicting that prefix to
make room, so the store was left holding a tail no lookup reaches (3 instances, round robin,
hbm=8, remote=4, one 6-block prompt three times: the third instance read 0 remote blocks).
Now ``publish`` takes the request's blocks from its start (``prefix=True``): it writes the
blocks the store lacks from the first one on, never evicts the request's own blocks for them,
and writes nothing past what fits.
"""

from __future__ import annotations

from tiercache.config import Route, TierConfig, layout_preset
from tiercache.sim.fleet import FleetSpec, replay_fleet
from test_fleet_probe_n import _trace  # a Mooncake trace of the given requests

LAYOUT = layout_preset("llama-3-8b", 512)


def test_a_request_never_evicts_its_own_prefix_from_the_shared_tier_to_write_an_unreachable_tail(tmp_path):
    trace = _trace(tmp_path, [[1, 2, 3, 4, 5, 6]] * 3)
    spec = FleetSpec(3, (TierConfig("hbm", 8),), 4, Route.ROUND_ROBIN, "lru")
    run = replay_fleet(spec, trace, LAYOUT)
    hits = [inst.tier_hits["remote"] for inst in run.instances]
    assert hits == [0, 4, 4]  # the head 1-4 stays in the store for every later request
    assert run.shared_writes == 4 and run.bytes_moved["hbm->remote"] == 4 * LAYOUT.block_bytes
