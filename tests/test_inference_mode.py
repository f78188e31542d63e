"""A store, a decode cache or a ``TieredCache`` works in and out of ``torch.inference_mode()``
in any order, as transformers' ``DynamicCache`` does, and its KV stays exact.

Every tensor the store keeps and updates in place (pool slots, quantised slots, the read
window and scratch buffers, a sequence's tail and summaries, the NVMe I/O threads' staging)
is a normal tensor even when it is made under ``torch.inference_mode()``: an inference tensor
cannot be written outside inference mode, nor by an I/O thread (which never runs in it). Each
scenario builds the store, uses it, and uses it again under a given order of grad modes
(inference mode, ``no_grad``, plain), and compares every block, attention output, token and
logit bit for bit with the same calls made outside inference mode throughout.
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from tiercache import TieredKVCache, TieredKVStore  # noqa: E402
from tiercache.config import AttentionMode, KVLayout, TierConfig  # noqa: E402
from tiercache.errors import UserError  # noqa: E402

MODES = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "plain": contextlib.nullcontext}
#: (built, first used, used afterwards): inference mode first then outside it, and the reverse;
#: each mode is built under once and each of inference -> plain, inference -> no_grad and
#: plain -> inference is a transition of one order (three orders keep the suite's time down).
ORDERS = [("inference", "inference", "plain"), ("plain", "inference", "no_grad"), ("no_grad", "plain", "inference")]
REFERENCE = ("plain", "plain", "plain")
_references: dict = {}


def reference(run, kind: str, path) -> list[torch.Tensor]:
    """``run(kind, REFERENCE, path)``, computed once per run and tier kind."""
    if (run, kind) not in _references:
        _references[run, kind] = run(kind, REFERENCE, path)
    return _references[run, kind]
LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)


def tiers(kind: str) -> list[TierConfig]:
    """Small tiers, so that blocks move through all of them (quantised ones re-encode)."""
    if kind == "plain":
        return [TierConfig("hbm", 2), TierConfig("dram", 2), TierConfig("nvme", 256)]
    if kind == "int8-dram-int4-nvme":
        return [TierConfig("hbm", 2), TierConfig("dram", 3, codec="int8"), TierConfig("nvme", 256, codec="int4")]
    return [TierConfig("hbm", 2, codec="int8"), TierConfig("dram", 2, codec="int8"), TierConfig("nvme", 256)]


TIER_KINDS = ["plain", "int8-dram-int4-nvme", "int8-hbm"]


def store_run(kind: str, order: tuple[str, str, str], path) -> list[torch.Tensor]:
    """Builds a store, puts/gets/prefetches, then puts, accesses and gets again, each phase
    under its mode of ``order``; returns every block read."""
    built, first, then = (MODES[m] for m in order)
    blocks = torch.randn(12, *LAYOUT.block_shape, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    keys = [i.to_bytes(16, "little") for i in range(12)]
    reads = []
    with built():
        store = TieredKVStore(LAYOUT, tiers(kind), path=path)
    try:
        with first():
            assert store.put(keys[:6], blocks[:6]) == 6
            reads.append(store.get(keys[:3]).clone())
            store.wait(store.prefetch(keys[3:6]))
            reads.append(store.get(keys[:6]).clone())
        with then():
            assert store.put(keys[6:], blocks[6:]) == 6
            reads.append(store.get(keys).clone())  # more than HBM holds: read where they lie
            store.wait(store.access(keys[:4], blocks[:4], wait=False))
            reads.append(store.get(keys[::-1]).clone())
            out = torch.empty(3, *LAYOUT.block_shape, dtype=torch.float16)
            reads.append(store.get(keys[:3], out=out).clone())
            assert all(tier["failed_transfers"] == tier["lost"] == 0 for tier in store.stats()["tiers"])
    finally:
        store.close()
    if kind == "plain":
        assert torch.equal(reads[2], blocks)
    return reads


@pytest.mark.parametrize("kind", TIER_KINDS)
@pytest.mark.parametrize("order", ORDERS, ids="-".join)
def test_store_in_and_out_of_inference_mode(kind, order, tmp_path):
    assert_same_as_outside(store_run, kind, order, tmp_path)


def assert_same_as_outside(run, kind: str, order: tuple[str, str, str], tmp_path) -> None:
    """``run`` under ``order`` gives bit for bit what it gives outside inference mode throughout."""
    want = reference(run, kind, tmp_path / "reference")
    got = run(kind, order, tmp_path / "nvme")
    assert len(got) == len(want)
    for number, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{run.__name__}: output {number} differs from the run outside inference mode"


def decode_run(kind: str, order: tuple[str, str, str], path) -> list[torch.Tensor]:
    """The raw per-layer decode API (``append``, exact and sparse ``attend``,
    ``attend_partial``), a sequence grown past 64 blocks per layer in the first phase (its
    summaries reallocate), prefix reuse after ``free``; returns every output."""
    built, first, then = (MODES[m] for m in order)
    gen = torch.Generator().manual_seed(1)
    outs: list[torch.Tensor] = []

    def steps(seq, count: int, tokens: int, every: bool = True) -> None:
        for _ in range(count):
            for layer in range(LAYOUT.layers):
                k, v = (torch.randn(2, tokens, 16, generator=gen).to(torch.float16) for _ in range(2))
                seq.append(layer, k, v)
                q = torch.randn(4, 1, 16, generator=gen).to(torch.float16)
                outs.append(seq.attend(layer, q).clone())
                if every:
                    outs.append(seq.attend(layer, q, AttentionMode.SPARSE, budget=2).clone())
                    outs.append(seq.attend_partial(layer, torch.randn(4, 3, 16, generator=gen).to(torch.float16)).out.clone())

    with built():
        kv = TieredKVCache(LAYOUT, tiers(kind), path=path, device="cpu", window_blocks=8)
    try:
        with first():
            seq = kv.sequence(tokens=list(range(300)))
            steps(seq, 1, 262, every=False)  # 65 blocks per layer: past LayerState's first 64 rows
            steps(seq, 1, 3)
        with then():
            steps(seq, 2, 3)
            assert [seq.length(layer) for layer in range(LAYOUT.layers)] == [271, 271]
            seq.free()
            again = kv.sequence(tokens=list(range(300)))
            outs.append(torch.tensor(float(again.cached_tokens)))
            steps(again, 1, 5)
            other = kv.sequence()
            steps(other, 2, 3)
            again.free()
            other.free()
    finally:
        kv.close()
    return outs


@pytest.mark.parametrize("kind", TIER_KINDS)
@pytest.mark.parametrize("order", ORDERS, ids="-".join)
def test_decode_api_in_and_out_of_inference_mode(kind, order, tmp_path):
    assert_same_as_outside(decode_run, kind, order, tmp_path)


def test_reading_quantised_nvme_in_place_into_inference_tensors(tmp_path):
    """More blocks than HBM holds are read where they lie (an INT4 NVMe tier's I/O threads
    dequantise them): into a new tensor or a caller's inference tensor under inference mode;
    a caller's inference tensor outside it is refused, naming ``out``."""
    blocks = torch.randn(12, *LAYOUT.block_shape, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    keys = [i.to_bytes(16, "little") for i in range(12)]
    kind = [TierConfig("hbm", 2), TierConfig("nvme", 64, codec="int4")]
    with TieredKVStore(LAYOUT, kind, path=tmp_path / "nvme") as store:
        store.put(keys, blocks)
        want = store.get(keys[:6])
        with torch.inference_mode():
            assert torch.equal(store.get(keys[:6]), want)
            out = torch.empty(6, *LAYOUT.block_shape, dtype=torch.float16)
            assert torch.equal(store.get(keys[:6], out=out), want)
        with pytest.raises(UserError, match="TieredKVStore.get out: an inference tensor"):
            store.get(keys[:6], out=out)
        assert torch.equal(store.get(keys[:6]), want)


def test_prefix_summaries_read_from_quantised_nvme_under_inference_mode(tmp_path):
    """A reopened store's prefix blocks have no kept summaries: a sequence started under
    inference mode reads them from the INT4 NVMe tier, and is used outside it afterwards."""
    gen = torch.Generator().manual_seed(3)
    kvs = [tuple(torch.randn(2, 24, 16, generator=gen).to(torch.float16) for _ in range(2)) for _ in range(2)]
    q = torch.randn(4, 1, 16, generator=gen).to(torch.float16)

    def run(path, opened) -> list[torch.Tensor]:
        with TieredKVCache(LAYOUT, tiers("int8-dram-int4-nvme"), path=path, device="cpu") as kv:
            seq = kv.sequence(tokens=list(range(25)))
            for layer in range(2):
                seq.append(layer, *kvs[layer])
            seq.free()
            kv.close(persist=True)
        with MODES[opened]():
            kv = TieredKVCache(LAYOUT, tiers("int8-dram-int4-nvme"), path=path, device="cpu")
            seq = kv.sequence(tokens=list(range(25)))
        outs = [torch.tensor(float(seq.cached_tokens))]
        with kv:
            for layer in range(2):
                seq.append(layer, torch.ones(2, 1, 16, dtype=torch.float16), torch.ones(2, 1, 16, dtype=torch.float16))
                outs += [seq.attend(layer, q, AttentionMode.SPARSE, budget=2), seq.attend(layer, q)]
        return outs

    want = run(tmp_path / "reference", "plain")
    assert want[0].item() == 24
    got = run(tmp_path / "nvme", "inference")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# -- the transformers drop-in cache --------------------------------------------------------
transformers = pytest.importorskip("transformers", reason="the transformers cache needs the hf extra")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiercache.integrations.transformers import TieredCache, kv_layout, use_tiercache  # noqa: E402

VOCAB = 128


def tiny_llama() -> LlamaForCausalLM:
    """A 2-layer random-weight Llama with grouped-query attention, readied for tiercache."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def generate(model, ids, cache, new: int):
    """Greedy generation of exactly ``new`` tokens; returns (tokens, logits per step)."""
    out = model.generate(ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def hf_run(model, kind: str, first: str, then: str, path) -> list[torch.Tensor]:
    """The store and a ``TieredCache`` built and generating under ``first``, the generation
    continued under ``then`` (``generate``'s own no_grad inside it), a fresh cache reusing the
    stored prefix, and a manual forward pass (grad mode on) over it; tokens and logits."""
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, VOCAB, (1, 21), generator=gen)
    step = torch.randint(1, VOCAB, (1, 3), generator=gen)
    layout = kv_layout(model.config, torch.float32, block_tokens=4)
    with MODES[first]():
        kv = TieredKVCache(layout, tiers(kind), path=path, device="cpu")
        cache = TieredCache(kv, model, prompt=prompt)
        tokens, logits = generate(model, prompt, cache, 6)
    outs = [tokens, logits]
    with kv:
        with MODES[then]():
            tokens, logits = generate(model, tokens, cache, 6)
            outs += [tokens, logits]
            cache.free()
            again = TieredCache(kv, model, prompt=prompt)
            outs.append(torch.tensor(float(again.cached_tokens)))
            outs += list(generate(model, prompt, again, 4))
        outs.append(model(step, cache=again).logits.detach())  # grad mode on
        assert again.seq_length(0) == again.seq_length(1) == prompt.shape[1] + 3 + 3
    return outs


@pytest.mark.parametrize("kind", ["plain", "int8-dram-int4-nvme"])
@pytest.mark.parametrize("first,then", [("inference", "plain"), ("inference", "no_grad"), ("plain", "inference")])
def test_tiered_cache_generate_in_and_out_of_inference_mode(kind, first, then, tmp_path):
    model = use_tiercache(tiny_llama())
    want = hf_run(model, kind, "plain", "plain", tmp_path / "reference")
    got = hf_run(model, kind, first, then, tmp_path / "nvme")
    for number, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {number} differs from the run outside inference mode"
    if kind == "plain":  # and both agree with transformers' own cache
        model.set_attn_implementation("sdpa")
        tokens, logits = generate(model, want[0], DynamicCache(), 6)
        assert torch.equal(tokens, got[2])
        assert (logits - got[3]).abs().max().item() < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", TIER_KINDS)
def test_cuda_store_built_under_inference_mode(kind, tmp_path):
    """On CUDA the pools are device and pinned tensors written with ``copy_``: a store built
    under inference mode must hold normal ones, or every later write outside it fails."""
    blocks = torch.randn(12, *LAYOUT.block_shape, generator=torch.Generator().manual_seed(6)).to(torch.float16)
    keys = [i.to_bytes(16, "little") for i in range(12)]
    with torch.inference_mode():
        store = TieredKVStore(LAYOUT, tiers(kind), path=tmp_path / "nvme", device="cuda")
    with store:
        assert store.put(keys, blocks) == 12
        got = store.get(keys).cpu()
        with torch.inference_mode():
            again = store.get(keys[::-1]).cpu()
    assert torch.equal(again, got.flip(0))
    if kind == "plain":
        assert torch.equal(got, blocks)
    else:
        assert ((got.float() - blocks.float()).norm() / blocks.float().norm()).item() < 0.12


# ----- a remote tier below a quantised NVMe tier ------------------------------------------
from remote_helpers import master, remote_config  # noqa: E402,F401 (master: a fixture)


def test_demotions_from_quantised_nvme_to_the_remote_tier_under_inference_mode(master, tmp_path):
    """NVMe I/O threads decode a demoted block into the remote tier's staging row: a row made
    under the caller's inference mode could not be written by them (before: 5 demotions failed
    and their blocks were lost: ``KeyError``)."""
    pytest.importorskip("mooncake.store")
    from tiercache.config import Codec, RemoteWrite

    config = remote_config(master, write=RemoteWrite.BACK)
    tiers = [TierConfig("hbm", 2), TierConfig("dram", 2), TierConfig("nvme", 3, codec=Codec.INT8),
             TierConfig("remote", 64, remote=config)]
    blocks = torch.randn(12, *LAYOUT.block_shape, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    keys = [i.to_bytes(16, "little") for i in range(12)]
    with torch.inference_mode():
        store = TieredKVStore(LAYOUT, tiers, path=tmp_path / "nvme", device="cpu")
        try:
            for n, key in enumerate(keys):
                assert store.put([key], blocks[n:n + 1]) == 1
            assert all(tier["failed_transfers"] == tier["lost"] == 0 for tier in store.stats()["tiers"])
            got = store.get(keys[:4])  # the oldest: demoted through NVMe into the remote tier
            assert store.stats()["remote"]["puts"] >= 4
        finally:
            store.close()
    assert (got.float() - blocks[:4].float()).abs().max() < 0.05  # INT8's error, nothing lost
