"""Probe b1: the figures the benchmark scripts and reports print are the figures of the work
they name.

1. ``step_timings``' I/O-only region times the reads and nothing else (no copies kept for the
   compute-only pass, no assembly of chunks spread over several tiers), and an overlap
   efficiency above 1 plus timing noise is flagged.
2. ``bench_replay.py`` warms libCacheSim up as it does tiercache, and gives each side and
   policy an untimed run first, so the ratios do not depend on ``--repeats`` or on which
   policy is timed first.
3. ``tiercache report``'s "does the hierarchy pay off" verdict judges the time on the request
   path (recompute and loads towards HBM): write-backs and demotions run beside it on their
   own links, and count only where one of those links is busy longer than the request path.
4. An output path that cannot be written is refused before any work (exit 2, one line).
5. ``disagg_demo.py`` refuses a speed-up when the fetched KV is not the prompt's, bit for
   bit, even where it decodes the same tokens (the prompt's blocks in another order).
6. The kernel and Python replay rates README quotes come from ``bench_replay.py --kernel-rates``,
   which refuses a comparison where a side took the other path or counted differently.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tiercache import TieredKVCache
from tiercache.bench import decode as bdecode
from tiercache.config import KVLayout, TierConfig
from tiercache.live.chunks import TierChunks
from tiercache.report.summary import hierarchy_payoffs

from test_report import build, make_document, make_run
from test_report_grouping import runs_of

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_b1_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----- 1. io_only times the reads only ----------------------------------------------------


def _spread_sequence(tmp_path):
    """12 blocks in chunks of 3 (depth 2): blocks 0-9 on NVMe, 10-11 in HBM, so the last chunk
    spans two tiers (one keyed piece, one in memory)."""
    layout = KVLayout(1, 2, 16, "float16", 16, per_layer=True, name="tiny")
    cache = TieredKVCache(layout, [TierConfig("hbm", 2), TierConfig("dram", 2), TierConfig("nvme", 32)],
                          path=tmp_path / "nvme", device="cpu", prefetch="none", window_blocks=3, depth=2, write_through=True)
    kv = bdecode.NeedleKV(12 * 16, 2, 16, 16, 2, 0)
    seq = cache.sequence()
    seq.append(0, *kv.chunk(0, kv.n_blocks * 16))
    return cache, seq, kv


def test_io_only_region_holds_the_reads_and_no_copies(tmp_path, monkeypatch):
    events: list[str] = []

    def stopwatch(device):
        def now() -> float:
            events.append("clock")
            return float(events.count("clock"))
        return now

    real_clone, real_raw, real_piece = torch.Tensor.clone, TierChunks.raw, TierChunks._piece_blocks
    monkeypatch.setattr(bdecode, "_stopwatch", stopwatch)
    monkeypatch.setattr(torch.Tensor, "clone", lambda self, *a, **k: events.append("clone") or real_clone(self, *a, **k))
    monkeypatch.setattr(TierChunks, "raw", lambda self, handle: events.append("raw") or real_raw(self, handle))

    def piece(self, handle, number):
        keyed = self.cache.store._media[self.chunks[handle[0]].pieces[number].tier].keyed
        events.append("keyed read" if keyed else "memory piece")
        return real_piece(self, handle, number)

    monkeypatch.setattr(TierChunks, "_piece_blocks", piece)
    cache, seq, kv = _spread_sequence(tmp_path)
    with cache:
        source = seq.stream_source(0)
        assert [[p.tier for p in c.pieces] for c in source.chunks] == [[2], [2], [2], [2, 0]]
        q, _ = kv.query(0, 4)
        bdecode.step_timings(seq, 0, q, repeats=2)
    clocks = [i for i, e in enumerate(events) if e == "clock"]
    assert len(clocks) == 2 * 6
    for repeat in range(2):
        start, end = clocks[6 * repeat], clocks[6 * repeat + 1]
        # every keyed piece (one per chunk) waited for, and nothing else done, inside the I/O clock
        assert events[start + 1 : end] == ["keyed read"] * 4


@pytest.mark.parametrize("io, compute, piped, plausible", [
    (1.2, 0.5, 1.0, False),  # 1.2: a pipelined step 20% faster than its own I/O cannot be
    (1.0, 0.5, 1.0, True),
    (bdecode.OVERLAP_LIMIT, 0.4, 1.0, True),  # at the limit itself
])
def test_overlap_above_one_plus_noise_is_flagged(tmp_path, monkeypatch, io, compute, piped, plausible):
    def stopwatch(device):
        reads = iter(range(10**6))

        def now() -> float:
            region, end = divmod(next(reads), 2)
            return sum((io, compute, piped)[r % 3] for r in range(region)) + end * (io, compute, piped)[region % 3]
        return now

    monkeypatch.setattr(bdecode, "_stopwatch", stopwatch)
    cache, seq, kv = _spread_sequence(tmp_path)
    with cache:
        q, _ = kv.query(0, 4)
        timing = bdecode.step_timings(seq, 0, q, repeats=1)
    assert timing["overlap_efficiency"] == pytest.approx(max(io, compute) / piped)
    assert timing["plausible"] is plausible
    assert (bdecode.overlap_problem(timing) is None) is plausible


# ----- 2. bench_replay warms both sides up -------------------------------------------------


class _FakeSides:
    """Stands in for both sides of ``bench_replay``'s comparison: every run costs 1 CPU
    second, except libCacheSim's first ``cold_runs`` runs in the process (its one-time start-up),
    which cost 10; records which side ran which policy on which trace, in order."""

    def __init__(self, br, cold_runs: int = 2) -> None:
        self.br, self.cold_runs, self.calls = br, cold_runs, []

    def tiercache(self, trace, policy, capacity, cache_dir):
        self.calls.append(("tiercache" if cache_dir is None else "cached", policy, Path(trace).name))
        return (1.0, 1.0), SimpleNamespace(accesses=1000, misses=100)

    def libcachesim(self, lcs, oracle, policy, capacity, hashpower):
        self.calls.append(("libcachesim", policy, Path(oracle).name))
        seconds = 10.0 if sum(c[0] == "libcachesim" for c in self.calls) <= self.cold_runs else 1.0
        return (seconds, seconds), self.br.Counts(1000, 100)


@pytest.fixture
def replay_script(monkeypatch):
    br = _script("bench_replay")
    fake = _FakeSides(br)
    monkeypatch.setitem(sys.modules, "libcachesim", SimpleNamespace())  # compare_policies imports it
    monkeypatch.setattr(br, "tiercache_run", fake.tiercache)
    monkeypatch.setattr(br, "libcachesim_run", fake.libcachesim)
    monkeypatch.setattr(br, "replay_kernels", lambda: None)  # tiercache's own warm-up (real replays) is not under test
    return br, fake


@pytest.mark.parametrize("repeats", [1, 3, 5])
def test_bench_replay_ratio_does_not_depend_on_repeats_or_order(replay_script, repeats):
    br, fake = replay_script
    br.warm_up()
    rows = br.compare_policies(str(ROOT / "tests" / "data" / "mooncake_head.jsonl"), 50, repeats)
    assert {policy: row["ratio"] for policy, row in rows.items()} == dict.fromkeys(br.LIBCACHESIM, 1.0)


def test_bench_replay_warms_each_side_and_policy_up_before_its_clock(replay_script):
    br, fake = replay_script
    br.warm_up()
    assert fake.calls == [("libcachesim", policy, "warmup.oracleGeneral") for policy in br.LIBCACHESIM]
    fake.calls.clear()
    br.compare_policies(str(ROOT / "tests" / "data" / "mooncake_head.jsonl"), 50, 2)
    lru = [c[0] for c in fake.calls if c[1] == "lru"]
    # the cache entry, one untimed run of each side, then two rounds, the first side rotating
    assert lru == ["cached", "tiercache", "cached", "libcachesim",
                   "tiercache", "cached", "libcachesim", "cached", "libcachesim", "tiercache"]


# ----- 3. the payoff verdict judges the request path ----------------------------------------

#: ``modeled_seconds`` of README's ``tiered.json`` (lru; HBM 2,000 + DRAM 8,000 + NVMe 32,000
#: blocks, llama-3-8b, h200-pcie5-nvme4) and of ``hbm.json`` (lru, HBM 2,000 alone).
README_TIERED = {"dram->hbm": 41.533633, "dram->nvme": 809.749801, "hbm->dram": 124.933153, "nvme->hbm": 285.276506,
                 "recompute": 803.181714}
README_HBM = {"recompute": 1907.858286}


def _readme_pair(**links: float) -> list[dict]:
    """README's lru pair (85.6% and 36.0% misses), the hierarchy's links changed by ``links``."""
    alone = make_run("lru", 2000, 0.856)
    tiered = make_run("lru", 42000, 0.36, tiers=[("hbm", 2000, 3000), ("dram", 8000, 2000), ("nvme", 32000, 1400)])
    for run, seconds in ((alone, README_HBM), (tiered, {**README_TIERED, **links})):
        run["modeled_seconds"] = {**seconds, "total": sum(seconds.values())}
    return [alone, tiered]


def test_payoff_of_readme_example_is_judged_on_the_request_path(tmp_path):
    payoff, = hierarchy_payoffs(runs_of(make_document(runs=_readme_pair())))
    assert payoff.measure == "time" and payoff.pays_off is True
    assert payoff.request_seconds == pytest.approx((1907.858286, 803.181714 + 41.533633 + 285.276506))
    assert payoff.background == {"dram->nvme": 809.749801, "hbm->dram": 124.933153}
    markdown = (build(tmp_path, make_document(runs=_readme_pair())) / "report.md").read_text()
    assert ("- lru: the hierarchy pays off: it cuts misses from 85.6% to 36.0% and modeled request time from 1,908 s "
            "to 1,130 s; its write-backs and demotions (935 s in all, the busiest link dram->nvme 810 s) run beside "
            "the requests, on their own links.") in markdown
    assert ("Judged by modeled request time: the recompute time of the misses plus the loads (every transfer from a "
            "slower tier towards HBM, counted in full)") in markdown
    assert "does not pay off" not in markdown


def test_payoff_counts_a_background_link_busier_than_the_request_path(tmp_path):
    runs = _readme_pair(**{"dram->nvme": 3000.0})
    payoff, = hierarchy_payoffs(runs_of(make_document(runs=runs)))
    assert payoff.request_seconds == pytest.approx((1907.858286, 3000.0)) and payoff.pays_off is False
    markdown = (build(tmp_path, make_document(runs=runs)) / "report.md").read_text()
    assert ("- lru: the hierarchy does not pay off: it cuts misses from 85.6% to 36.0%, but modeled request time rises "
            "from 1,908 s to 3,000 s; its write-backs and demotions (3,125 s in all) hold the requests up: link "
            "dram->nvme is busy 3,000 s, longer than the 1,130 s of recompute and loads.") in markdown


# ----- 4. output paths are checked before the run ------------------------------------------


def _work_recorder(monkeypatch, module, names):
    """Replaces each of ``module``'s functions ``names`` with one that records its call."""
    called = []
    for name in names:
        monkeypatch.setattr(module, name, lambda *a, _name=name, **k: called.append(_name))
    return called


@pytest.mark.parametrize("script, option, work, argv", [
    ("bench_hf_cache", "--out", ["build_model", "alternate"], []),
    ("bench_replay", "--json", ["warm_up", "compare_policies"], ["--trace", str(ROOT / "tests" / "data" / "mooncake_head.jsonl")]),
    ("disagg_demo", "--json", ["run_demo", "start_master"], []),
])
@pytest.mark.parametrize("bad, why", [("missing-folder/out.json", "does not exist"), (".", "is a folder")])
def test_a_bad_output_path_is_refused_before_any_work(tmp_path, monkeypatch, capsys, script, option, work, argv, bad, why):
    if script in ("bench_hf_cache", "disagg_demo"):
        pytest.importorskip("transformers")
    module = _script(script)
    called = _work_recorder(monkeypatch, module, work)
    path = str(tmp_path / bad)
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv + [option, path])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and called == []
    assert len(err.strip().splitlines()) == 1 and f"error: {option} {path}" in err and why in err


# ----- 5. disagg_demo compares the fetched KV with the prompt's -----------------------------


class _BlockStore:
    """A store that finds the whole prompt and hands back ``blocks`` for it."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks, self.gets = blocks, 0

    def stats(self) -> dict:
        return {"bytes_moved": {"remote->hbm": self.gets}, "remote": {"gets": self.gets, "exists_calls": 1}}

    def match_prefix(self, ids, namespace):
        return len(ids)

    def get_prefix(self, keys):
        self.gets += len(keys)
        return self.blocks[: len(keys)]


def test_disagg_demo_refuses_a_hand_off_of_the_right_blocks_in_the_wrong_order(tmp_path, capsys):
    pytest.importorskip("transformers")
    demo = _script("disagg_demo")
    model = demo.build_model(0)
    ids = demo.prompt_ids(4 * demo.BLOCK_TOKENS + 8, 0)
    with torch.no_grad():
        reference = demo.to_blocks(model(torch.tensor([ids]), use_cache=True).past_key_values, 4)
    assert torch.equal(demo.prompt_kv(model, ids), reference)
    shuffled = reference[torch.tensor([2, 0, 3, 1])]
    recomputed = demo.recompute(model, ids, 4)
    wrong = demo.handoff(_BlockStore(shuffled), model, ids, "ns-1", 4, reference)
    right = demo.handoff(_BlockStore(reference.clone()), model, ids, "ns-2", 4, reference)
    assert wrong["tokens"] == right["tokens"] == recomputed["tokens"]  # the tokens alone cannot tell
    assert wrong["kv_max_abs_diff"] == float((shuffled - reference).abs().max()) > 0.1
    assert right["kv_max_abs_diff"] == 0.0

    consumed = demo.summarise([right, wrong], [recomputed, recomputed], demo.handed_off_blocks(len(ids)))
    assert consumed["same_tokens"] is True and consumed["same_kv"] is False and consumed["ttft_speedup"] is None
    produced = {"prefill_s": 0.1, "store_s": 0.01, "blocks": 4, "published": 4, "bytes_put": 8, "copies": 3}
    out = tmp_path / "demo.json"
    args = SimpleNamespace(tokens=len(ids), new_tokens=4, json=str(out))
    assert demo.report(produced, consumed, args) == 1
    captured = capsys.readouterr()
    assert "speed-up" not in captured.out and not out.exists()
    assert "the KV a hand-off fetched differs from the prompt's KV recomputed" in captured.err
    assert f"max |difference| {wrong['kv_max_abs_diff']:.3g}" in captured.err

    honest = demo.summarise([right], [recomputed], demo.handed_off_blocks(len(ids)))
    assert honest["same_kv"] is True and honest["kv_max_abs_diff"] == 0.0 and honest["ttft_speedup"] is not None
    assert demo.report(produced, honest, args) == 0 and out.exists()
    assert "bit for bit the prompt's KV" in capsys.readouterr().out


# ----- 6. bench_replay --kernel-rates -------------------------------------------------------


def _case(cpu_s: float, kernel: bool, misses: int = 40) -> dict:
    return {"session@1000": {"cpu_s": cpu_s, "accesses": 100, "misses": misses, "kernel": kernel}}


def test_kernel_rates_are_medians_of_per_round_ratios():
    from tiercache.bench.replay_figures import kernel_rows

    runs = {"kernel": [_case(1.0, True), _case(1.0, True), _case(4.0, True)],
            "python": [_case(30.0, False), _case(40.0, False), _case(40.0, False)]}
    row = kernel_rows(runs)["session@1000"]
    assert row["ratio"] == 30.0  # per round 30, 40, 10 (a ratio of medians would say 40)
    assert row["kernel_accesses_per_s"] == 100.0 and row["python_accesses_per_s"] == 2.5 and row["problems"] == []


def test_kernel_rates_refuse_a_side_on_the_wrong_path_or_other_counts():
    from tiercache.bench.replay_figures import kernel_rows

    wrong_path = kernel_rows({"kernel": [_case(1.0, False)], "python": [_case(30.0, False)]})["session@1000"]
    assert wrong_path["problems"] == ["session@1000: the kernel side took the Python path"]
    other_counts = kernel_rows({"kernel": [_case(1.0, True)], "python": [_case(30.0, False, misses=41)]})["session@1000"]
    assert other_counts["problems"] == ["session@1000: the runs counted different (accesses, misses) [(100, 40), (100, 41)]: "
                                        "not the same records"]
    with pytest.raises(ValueError, match="2 kernel rounds against 1 Python rounds"):
        kernel_rows({"kernel": [_case(1.0, True)] * 2, "python": [_case(30.0, False)]})


def test_kernel_case_replays_every_policy_and_capacity_on_the_kernels():
    from tiercache.policies.kernels import HAVE_NUMBA

    br = _script("bench_replay")
    out = br.kernel_case(str(ROOT / "tests" / "data" / "mooncake_head.jsonl"))
    assert list(out) == [f"{p}@{c}" for p in br.KERNEL_POLICIES for c in br.KERNEL_CAPACITIES]
    assert {run["kernel"] for run in out.values()} == {HAVE_NUMBA}
    assert {run["accesses"] for run in out.values()} == {7721}  # the head trace's block accesses, every case
