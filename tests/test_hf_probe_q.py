"""The drop-in ``transformers`` cache against probe Q's findings: a length-dependent RoPE
("dynamic", "longrope") keeps its KV private, a cache dropped while another thread is inside a
store call is released when that call ends (and the collecting thread never waits for it),
options given through a ``GenerationConfig`` are refused before any pass, and fingerprinting
a non-contiguous weight copies a chunk at a time. Each test failed before its fix.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the transformers cache needs the hf extra")

import xxhash  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from test_hf_cache import VOCAB, generate, tiered, tiny_llama  # noqa: E402
from test_hf_cache_probe import ids_of  # noqa: E402

from tiercache.errors import UserError  # noqa: E402
from tiercache.integrations import inputs  # noqa: E402
from tiercache.integrations.inputs import length_dependent_rope, model_fingerprint  # noqa: E402
from tiercache.integrations.transformers import TieredCache, match_prefix, use_tiercache  # noqa: E402


def scaled_llama(seed: int, rope: dict) -> LlamaForCausalLM:
    """A 2-layer random-weight Llama whose RoPE is ``rope``, pretrained for 32 positions."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         rope_scaling=rope, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def held(kv) -> int:
    return sum(kv.manager.held.values())


def used_cache(model, kv, seed: int) -> TieredCache:
    """A cache holding a generated 20-token prompt's rows."""
    cache = TieredCache(kv, model)
    generate(model, ids_of(20, seed), cache, new=2)
    return cache


# -- finding 1: a RoPE that depends on the pass's length ------------------------------------------
def test_a_dynamic_rope_prompt_reuses_no_prefix_a_longer_prompt_stored(tmp_path):
    rope = {"rope_type": "dynamic", "factor": 8.0}
    model, reference = use_tiercache(scaled_llama(90, rope)), scaled_llama(90, rope)
    long = ids_of(120, 91)
    short = long[:, :30].clone()
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        generate(model, long, TieredCache(kv, model, prompt=long), new=2)  # its pass rescales the rope
        cache = TieredCache(kv, model, prompt=short)
        assert cache.cached_tokens == 0 and match_prefix(kv, model, short) == 0
        _, got = generate(model, short, cache, new=2)
    _, want = generate(reference, short, new=2)
    assert (got - want).abs().max().item() < 1e-5  # reused, the long pass's KV was 2e-3 off


def test_a_static_rope_scaling_still_shares_prefixes(tmp_path):
    model = use_tiercache(scaled_llama(92, {"rope_type": "linear", "factor": 4.0}))
    ids = ids_of(30, 93)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        generate(model, ids, TieredCache(kv, model, prompt=ids), new=2)
        assert TieredCache(kv, model, prompt=ids).cached_tokens == 24


@pytest.mark.parametrize("rope, want", [
    (None, []),
    ({"rope_type": "linear", "factor": 2.0}, []),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}, []),
    ({"type": "dynamic", "factor": 2.0}, ["dynamic"]),  # the older spelling
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": 16}, ["longrope"]),
    ({"rope_type": "someone_elses", "factor": 2.0}, ["someone_elses"]),  # unknown: taken as length-dependent
])
def test_length_dependent_rope_types(rope, want):
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=32)
    if rope is not None:
        config.rope_parameters = {**rope, "rope_theta": 10000.0}
    assert length_dependent_rope(config) == want


def test_rope_parameters_per_layer_type_are_each_read():
    config = transformers.Gemma3TextConfig(rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0},
                                                            "sliding_attention": {"rope_type": "default"}})
    assert length_dependent_rope(config) == ["dynamic"]
    assert length_dependent_rope(transformers.Gemma3TextConfig()) == []
    assert length_dependent_rope(transformers.GPT2Config()) == []  # no rotary embedding


# -- finding 2: a cache dropped while another thread is inside a store call -----------------------
def test_a_cache_dropped_during_another_threads_store_call_is_released_when_it_ends(tmp_path):
    model = use_tiercache(tiny_llama(seed=94))
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        cache = used_cache(model, kv, 95)
        inside, leave = threading.Event(), threading.Event()

        def store_call():  # any call of another thread in progress
            with kv.store._lock:
                inside.set()
                leave.wait(5)

        other = threading.Thread(target=store_call)
        other.start()
        inside.wait(5)
        del cache
        gc.collect()
        assert held(kv)  # not freed in the middle of the other thread's call
        leave.set()
        other.join(5)
        deadline = time.monotonic() + 5
        while held(kv) and time.monotonic() < deadline:  # no later TieredCache call
            time.sleep(0.01)
        assert held(kv) == 0
        kv.check_invariants()


def test_a_thread_the_store_call_waits_for_does_not_wait_for_it_to_release(tmp_path):
    """The collecting thread may be one the lock's holder waits for (an I/O pool thread): it
    must not wait for the lock, or both wait forever."""
    model = use_tiercache(tiny_llama(seed=96))
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        caches = [used_cache(model, kv, 97)]
        finished, outlived = [], []

        def drop():
            caches.clear()  # the last reference: the finalizer runs in this thread
            gc.collect()
            finished.append(True)

        dropper = threading.Thread(target=drop)

        def store_call():  # holds the store's lock while it waits for the dropping thread
            with kv.store._lock:
                dropper.start()
                dropper.join(3)
                outlived.append(dropper.is_alive())

        holder = threading.Thread(target=store_call)
        holder.start()
        holder.join(10)
        assert outlived == [False] and finished  # the dropper ended while the lock was still held
        deadline = time.monotonic() + 5
        while held(kv) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held(kv) == 0


# -- finding 3: options given through a GenerationConfig ----------------------------------------
@pytest.mark.parametrize("options, named", [
    ({"guidance_scale": 1.5}, "guidance_scale"),
    ({"penalty_alpha": 0.6, "top_k": 4}, "contrastive search"),
])
def test_options_of_a_generation_config_are_refused_before_any_pass(tmp_path, options, named):
    model = use_tiercache(tiny_llama(seed=98))
    ids = ids_of(20, 99)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        cache = TieredCache(kv, model, prompt=ids)
        config = GenerationConfig(max_new_tokens=3, pad_token_id=0, **options)
        with pytest.raises(UserError, match=named):
            model.generate(ids, cache=cache, generation_config=config)
        assert cache.seq_length(0) == 0  # nothing ran: the cache is still usable
        generate(model, ids, cache, new=2)


def test_a_generation_config_given_by_position_is_read(tmp_path):
    model = use_tiercache(tiny_llama(seed=100))
    ids = ids_of(20, 101)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        cache = TieredCache(kv, model, prompt=ids)
        with pytest.raises(UserError, match="contrastive search"):
            config = GenerationConfig(penalty_alpha=0.6, top_k=4, max_new_tokens=3, pad_token_id=0)
            model.generate(ids, config, cache=cache)
        assert cache.seq_length(0) == 0


# -- finding 4: fingerprinting a non-contiguous weight -------------------------------------------
class _CopySpy(torch.Tensor):
    """Records the largest storage, other than its own, that any torch call on it makes."""

    own: int = 0
    largest: int = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        with torch._C.DisableTorchFunctionSubclass():
            for out in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() != cls.own:
                    cls.largest = max(cls.largest, out.untyped_storage().nbytes())
        return result


@pytest.mark.parametrize("make", [
    lambda: torch.randn(64, 48).t(),  # a transposed weight
    lambda: torch.randn(6, 40, 8).permute(2, 0, 1),  # rows larger than a chunk
    lambda: torch.randn(30, 90)[:, ::3],  # a strided column slice (a view when flattened: no copy)
], ids=["transposed", "rows-past-a-chunk", "strided-slice"])
def test_a_non_contiguous_weight_is_hashed_a_chunk_at_a_time(monkeypatch, make):
    monkeypatch.setattr(inputs, "_CHUNK_BYTES", 256)
    weight = make()
    want = xxhash.xxh3_128(weight.contiguous().view(torch.uint8).numpy()).digest()
    spy = weight.as_subclass(_CopySpy)
    _CopySpy.own, _CopySpy.largest = weight.untyped_storage().data_ptr(), 0
    digest = xxhash.xxh3_128()
    inputs._hash_values(digest, "weight", spy)
    assert digest.digest() == want  # the bytes of the same values stored contiguously
    assert 0 < _CopySpy.largest <= 256  # was the whole tensor's size


def test_a_non_contiguous_weight_fingerprints_as_its_contiguous_copy(monkeypatch):
    monkeypatch.setattr(inputs, "_CHUNK_BYTES", 1024)
    model = tiny_llama(seed=102)
    weight = model.model.layers[0].mlp.up_proj.weight
    before = model_fingerprint(model)
    model.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(weight.detach().t().contiguous().t())
    assert not model.model.layers[0].mlp.up_proj.weight.is_contiguous()
    assert model_fingerprint(model) == before
