"""Forking a live sequence (``Sequence.fork``) and deep-copying a ``TieredCache``.

Equivalence: a fork and its source, each appending KV of its own after the fork, attend exactly
as a float64 dense reference over their own histories, while the KV spills through HBM, DRAM
and NVMe, forks of forks included and whichever is freed first. Exact-id scenarios: the holds
a fork takes and gives back, the room it does (not) take, private keys that never collide,
content keys that do meet, and the record -> replay round trip. ``transformers``: the
documented prompt-reuse recipe (``copy.deepcopy`` of a prompt's cache per continuation) gives
the same greedy tokens as with a ``DynamicCache``. Bad input: a freed sequence, a closed cache,
a cache out of step; ``copy.copy`` and pickling stay refused.
"""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache import AttentionMode, TieredKVCache
from tiercache.attention import dense_reference
from tiercache.cli import main as cli_main
from tiercache.config import KVLayout, TierConfig
from tiercache.errors import UserError

LAYOUT = KVLayout(2, 2, 8, "float32", 4)


def _cache(path, hbm: int = 3, dram: int = 3, nvme: int = 80, **options) -> TieredKVCache:
    tiers = [TierConfig("hbm", hbm), TierConfig("dram", dram), TierConfig("nvme", nvme)]
    return TieredKVCache(LAYOUT, tiers, path=path / "nvme", device="cpu", window_blocks=2, **options)


class _History:
    """One sequence's KV as appended, per layer, for the dense reference."""

    def __init__(self, k=None, v=None) -> None:
        self.k = [list(x) for x in k] if k else [[] for _ in range(LAYOUT.layers)]
        self.v = [list(x) for x in v] if v else [[] for _ in range(LAYOUT.layers)]

    def twin(self) -> "_History":
        return _History(self.k, self.v)

    def append(self, seq, layer: int, t: int, g: torch.Generator) -> None:
        k = torch.randn(LAYOUT.kv_heads, t, LAYOUT.head_dim, generator=g)
        v = torch.randn(LAYOUT.kv_heads, t, LAYOUT.head_dim, generator=g)
        seq.append(layer, k, v)
        self.k[layer].append(k)
        self.v[layer].append(v)

    def check(self, seq, layer: int, g: torch.Generator) -> None:
        q = torch.randn(4, 1, LAYOUT.head_dim, generator=g)
        want = dense_reference(q, torch.cat(self.k[layer], 1), torch.cat(self.v[layer], 1))
        got = seq.attend(layer, q)
        assert float((got.double() - want).abs().max()) < 1e-5
        assert seq.length(layer) == sum(k.shape[1] for k in self.k[layer])


# -- equivalence ----------------------------------------------------------------------------
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.integers(1, 30), forks=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9)), min_size=1, max_size=4),
       free_first=st.booleans(), seed=st.integers(0, 2**31))
def test_forks_attend_as_dense_attention_over_their_own_histories(tmp_path_factory, prompt, forks, free_first, seed):
    g = torch.Generator().manual_seed(seed)
    with _cache(tmp_path_factory.mktemp("f")) as cache:
        live = [(cache.sequence(), _History())]
        for layer in range(LAYOUT.layers):
            live[0][1].append(live[0][0], layer, prompt, g)
        for source, tokens in forks:  # fork one of the live sequences, then every one appends its own KV
            seq, history = live[source % len(live)]
            live.append((seq.fork(), history.twin()))
            for seq, history in live:
                for layer in range(LAYOUT.layers):
                    history.append(seq, layer, tokens, g)
        if free_first:  # the source goes first: its forks keep the shared blocks
            live[0][0].free()
            live = live[1:]
        for seq, history in live:
            for layer in range(LAYOUT.layers):
                history.check(seq, layer, g)
        cache.check_invariants()
        for seq, _ in live:
            seq.free()
        assert not cache.manager.held
        cache.check_invariants()


# -- exact ids -------------------------------------------------------------------------------
def test_a_fork_holds_the_shared_blocks_once_more_and_free_gives_back_its_own(tmp_path):
    g = torch.Generator().manual_seed(1)
    with _cache(tmp_path) as cache:
        seq, history = cache.sequence(), _History()
        for layer in range(LAYOUT.layers):
            history.append(seq, layer, 10, g)  # 2 full blocks and a tail of 2 per layer
        shared = seq._held_ids()
        twin = seq.fork()
        assert twin._held_ids() == shared and len(shared) == 4
        assert [cache.manager.held[i] for i in shared] == [2] * 4
        assert twin.length(1) == 10 and twin.token_ids.tolist() == seq.token_ids.tolist()
        seq.free()
        assert [cache.manager.held[i] for i in shared] == [1] * 4
        twin_history = history.twin()
        for layer in range(LAYOUT.layers):
            twin_history.append(twin, layer, 3, g)  # fills the copied tail: a block of its own
            twin_history.check(twin, layer, g)
        twin.free()
        assert not cache.manager.held


def test_a_fork_takes_no_room_until_it_appends(tmp_path):
    g = torch.Generator().manual_seed(2)
    with _cache(tmp_path, hbm=2, dram=2, nvme=4) as cache:  # 8 blocks in all
        seq, history = cache.sequence(), _History()
        for layer in range(LAYOUT.layers):
            history.append(seq, layer, 12, g)  # 3 blocks per layer: 6 held
        twins = [seq.fork() for _ in range(5)]  # shares, no new block
        assert len(cache.manager.held) == 6
        for layer in range(LAYOUT.layers):
            history.twin().append(twins[0], layer, 4, g)  # one new block per layer: 8 held, the tiers are full
        with pytest.raises(UserError, match="do not fit"):
            twins[1].append(0, *[torch.randn(LAYOUT.kv_heads, 4, LAYOUT.head_dim)] * 2)
        for twin in [seq, *twins]:
            twin.free()
        assert not cache.manager.held


def test_blocks_stored_after_a_fork_get_keys_of_their_own_unless_their_ids_are_known(tmp_path):
    g = torch.Generator().manual_seed(3)
    with _cache(tmp_path) as cache:
        seq = cache.sequence(tokens=list(range(8)))
        for layer in range(LAYOUT.layers):
            _History().append(seq, layer, 8, g)
        twin = seq.fork()
        for s in (seq, twin):  # private KV (ids unknown): the same position, other blocks
            _History().append(s, 0, 4, g)
        assert seq._layers[0].ids[2] != twin._layers[0].ids[2]
        known = cache.sequence(tokens=list(range(12)), namespace="n")  # ids known: one content key, one block
        assert known.cached_tokens == 0
        for layer in range(LAYOUT.layers):
            _History().append(known, layer, 12, g)
        other = known.fork()
        other.add_tokens(list(range(12, 16)))
        known.add_tokens(list(range(12, 16)))
        for layer in range(LAYOUT.layers):
            kv = [torch.randn(LAYOUT.kv_heads, 4, LAYOUT.head_dim, generator=g) for _ in range(2)]
            known.append(layer, *kv)
            other.append(layer, *kv)
            assert known._layers[layer].ids[3] == other._layers[layer].ids[3]
        assert cache.match_prefix(list(range(17)), namespace="n") == 16
        for s in (seq, twin, known, other):
            s.free()
        assert not cache.manager.held


def test_a_recorded_run_with_forks_replays_to_the_same_per_tier_counts(tmp_path):
    record = tmp_path / "steps.jsonl"
    g = torch.Generator().manual_seed(4)
    with _cache(tmp_path, hbm=5, dram=6, nvme=60, record=record) as cache:
        a, history = cache.sequence(), _History()
        for layer in range(LAYOUT.layers):
            history.append(a, layer, 30, g)
        b = a.fork()
        for step in range(8):
            for layer in range(LAYOUT.layers):
                for seq in (a, b):
                    history.append(seq, layer, 1, g)
                    seq.attend(layer, torch.randn(4, 1, 8, generator=g), AttentionMode.SPARSE, 3)
            if step == 3:
                a.free()
                a = b.fork()
        live = _hits_and_promotions(cache.stats()["tiers"])
    assert_replays_to(record, "hbm=5,dram=6,nvme=60", live)


def _hits_and_promotions(tiers: list[dict]) -> list[int]:
    return [t["hits"] for t in tiers] + [t["promotions"] for t in tiers]


def assert_replays_to(record, tiers: str, live: list[int]) -> None:
    """``tiercache replay`` of a live run's step record (the cache's default prefetch policy)
    gives the live per-tier hits and promotions, and some hits."""
    out = record.parent / "replay.json"
    command = ["replay", str(record), "--tiers", tiers, "--prefetch", "topk_speculative"]
    assert cli_main([*command, "--out", str(out), "--no-progress"]) == 0
    assert _hits_and_promotions(json.loads(out.read_text())["runs"][0]["tiers"]) == live
    assert sum(live[:3]) > 0


def test_a_fork_made_in_inference_mode_appends_outside_it(tmp_path):
    g = torch.Generator().manual_seed(5)
    with _cache(tmp_path) as cache:
        seq, history = cache.sequence(), _History()
        for layer in range(LAYOUT.layers):
            history.append(seq, layer, 6, g)
        with torch.inference_mode():
            twin = seq.fork()
        twin_history = history.twin()
        for layer in range(LAYOUT.layers):
            twin_history.append(twin, layer, 5, g)
            twin_history.check(twin, layer, g)
        seq.free()
        twin.free()


# -- bad input -------------------------------------------------------------------------------
def test_a_freed_sequence_or_a_closed_cache_cannot_fork(tmp_path):
    with _cache(tmp_path) as cache:
        seq = cache.sequence()
        seq.append(0, torch.randn(2, 5, 8), torch.randn(2, 5, 8))
        seq.free()
        with pytest.raises(UserError, match="Sequence.fork: the sequence was freed"):
            seq.fork()
        live = cache.sequence()
    with pytest.raises(UserError, match="closed"):
        live.fork()


# -- transformers ----------------------------------------------------------------------------
def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).eval()


def _continue(model, prompt_cache, ids, new: int = 6) -> torch.Tensor:
    """transformers' prompt-reuse recipe: a deep copy of the prompt's cache per continuation."""
    return model.generate(ids, cache=copy.deepcopy(prompt_cache), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)


def test_deepcopy_of_a_prompt_cache_generates_as_a_dynamic_cache_does(tmp_path):
    pytest.importorskip("transformers")
    from transformers import DynamicCache

    from tiercache.integrations.transformers import TieredCache, kv_layout, use_tiercache

    model = _tiny_llama()
    g = torch.Generator().manual_seed(8)
    prefix = torch.randint(1, 128, (1, 21), generator=g)
    tails = [torch.cat([prefix, torch.randint(1, 128, (1, n), generator=g)], 1) for n in (3, 9)]
    dense = DynamicCache()
    with torch.no_grad():
        model(prefix, cache=dense)
    want = [_continue(model, dense, ids) for ids in tails]
    use_tiercache(model)
    tiers = [TierConfig("hbm", 3), TierConfig("dram", 3), TierConfig("nvme", 80)]
    with TieredKVCache(kv_layout(model.config, torch.float32, 4), tiers, path=tmp_path / "nvme", device="cpu") as kv:
        prompt_cache = TieredCache(kv, model)
        with torch.no_grad():
            model(prefix, cache=prompt_cache)
        held = dict(kv.manager.held)
        got = [_continue(model, prompt_cache, ids) for ids in tails]
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
        assert prompt_cache.get_seq_length() == 21  # the original is untouched by its copies' passes
        again = _continue(model, prompt_cache, tails[0])
        assert again.tolist() == want[0].tolist()
        import gc
        gc.collect()  # the copies were dropped: their rows are released
        assert dict(kv.manager.held) == held
        prompt_cache.free()
        assert not kv.manager.held
        made = TieredCache(kv, model, prompt=tails[1])  # copied before its first pass
        assert made.cached_tokens == 28  # stored by the copies above (whole blocks, one token left)
        twin = copy.deepcopy(made)
        for cache in (twin, made):
            out = model.generate(tails[1], cache=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 pad_token_id=0)
            assert out.tolist() == want[1].tolist()


def test_a_tiered_cache_still_refuses_shallow_copies_pickles_and_copies_out_of_step(tmp_path):
    pytest.importorskip("transformers")
    from tiercache.integrations.transformers import TieredCache, kv_layout, use_tiercache

    model = use_tiercache(_tiny_llama())
    tiers = [TierConfig("hbm", 3), TierConfig("dram", 3), TierConfig("nvme", 80)]
    with TieredKVCache(kv_layout(model.config, torch.float32, 4), tiers, path=tmp_path / "nvme", device="cpu") as kv:
        cache = TieredCache(kv, model)
        with torch.no_grad():
            model(torch.randint(1, 128, (1, 9)), cache=cache)
        for duplicate in (copy.copy, pickle.dumps):
            with pytest.raises(UserError, match=r"shallow-copied or pickled.*copy\.deepcopy"):
                duplicate(cache)
        cache._broken = "its layers hold different lengths (a pass failed after storing some layers)"
        with pytest.raises(UserError, match="cannot be copied"):
            copy.deepcopy(cache)
        cache._broken = None
        cache._open_pass = [9]
        with pytest.raises(UserError, match="between passes only"):
            copy.deepcopy(cache)
        cache._open_pass = None
        twin = copy.deepcopy(cache)
        assert twin.get_seq_length() == 9
        twin.free()
        cache.free()
    with pytest.raises(UserError, match="closed"):
        copy.deepcopy(cache)


def test_a_free_keeps_each_blocks_summaries_once(tmp_path):
    """A free keeps the exact key summaries of every block it lists, fork or not (probe R8: a
    fork freed first kept none of the shared blocks', so a later prefix reuse rebuilt them from
    an INT4 copy and SPARSE chose other blocks); one already kept is not copied again (a beam
    search frees rows every step: copying every shared block's made a free of 4k blocks take
    25 ms instead of 3)."""
    g = torch.Generator().manual_seed(9)
    with _cache(tmp_path) as cache:
        seq, history = cache.sequence(), _History()
        for layer in range(LAYOUT.layers):
            history.append(seq, layer, 12, g)
        twin = seq.fork()
        _History().append(twin, 0, 4, g)  # one block of its own
        cache._summaries.clear()
        twin.free()
        assert set(cache._summaries) == set(twin._held_ids())
        kept = dict(cache._summaries)
        for row, block_id in enumerate(seq._layers[1].ids[: seq._layers[1].n].tolist()):
            assert torch.equal(kept[block_id][0], seq._layers[1].kmin[row])
        seq.free()
        assert all(cache._summaries[block_id] is kept[block_id] for block_id in kept)  # not copied again
        assert set(cache._summaries) == set(kept) | set(seq._held_ids())
