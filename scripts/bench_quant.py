"""Block codecs (issue 10): bytes, error and speed of INT8, FP8 and INT4 on synthetic KV.

One run, side by side, on fp16 blocks of 256 tokens and head dim 128 whose keys have a few
outlier channels (x10-x50 per head), as real keys do:

* ``bytes_ratio``: encoded bytes per block, scales included, over fp16 bytes;
* ``k_rel_err`` / ``v_rel_err``: Frobenius error of the round trip, relative;
* ``attn_rel_err``: exact single-query decode attention (float64) over the dequantised
  sequence vs over the fp16 one, relative Frobenius over every (layer, head) output; the
  query is unit normal, rescaled so that its logits ``q.k / sqrt(d)`` over the fp16 keys have
  standard deviation ``--logit-std`` (1.0) per (layer, head). The error grows with how sharp
  the softmax is (about ``k_rel_err`` times the logit std, plus ``v_rel_err``), so
  ``attn_rel_err_sharp`` also reports it for the unit-normal query as drawn, whose logits
  the outlier channels make much sharper (``logit_std_sharp``, about 5);
* ``throughput_ratio``: quantise + dequantise of a block vs one ``copy_`` of its fp16 bytes
  (medians, same run), as a tier runs them: ``encode_into`` a preallocated slot buffer and
  ``decode_from`` it into a preallocated block; ``gbps`` is the codec's rate in fp16 bytes
  per second;
  ``encode_gbps``/``decode_gbps`` and ``encode_ratio``/``decode_ratio`` (vs ``copy_``) time
  each direction alone, and ``reference_encode_gbps``/``reference_decode_gbps`` the plain
  torch reference the compiled loops are checked against (same block, same run);
* ``faster_than_nvme_read``: quantise and dequantise each faster than raw cold O_DIRECT
  random block reads measured in this run (``tiercache.bench.rawio``; ``--no-disk`` skips it);
* ``transformers``: the error and bytes of ``transformers``' quantised KV cache layers on the
  same KV at 8 and 4 bits, where transformers (and a quantisation backend) is installed; a
  note saying why not otherwise (``tiercache.bench.hf_quant``).

Usage: ``python scripts/bench_quant.py [--json OUT] [--layers 4] [--blocks 16] [--repeats 25]
[--logit-std 1.0] [--no-disk] [--torch-threads N]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tiercache.bench import hf_quant
from tiercache.bench.rawio import direct_read, pwrite_loop
from tiercache.config import Codec
from tiercache.data.codecs import codec_for

HEADS, TOKENS, DIM = 8, 256, 128
QUANTISED = (Codec.INT8, Codec.FP8, Codec.INT4)


def synthetic_kv(layers: int, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 ``(K, V)`` of shape ``[layers, HEADS, tokens, DIM]``; per (layer, head), 4 key
    channels are scaled by x10-x50 (outlier channels); values are plain normal."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, HEADS, tokens, DIM, generator=gen)
    v = torch.randn(layers, HEADS, tokens, DIM, generator=gen)
    gain = torch.ones(layers, HEADS, 1, DIM)
    channels = torch.rand(layers, HEADS, DIM, generator=gen).argsort(dim=-1)[..., :4]
    gain.scatter_(-1, channels.unsqueeze(2), 10 + 40 * torch.rand(layers, HEADS, 1, 4, generator=gen))
    return (k * gain).half(), v.half()


def round_trip(codec: Codec, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V after encoding and decoding, block by block (``TOKENS`` tokens each)."""
    impl = codec_for(codec)
    blocks = torch.stack((k, v), dim=1).split(TOKENS, dim=-2)  # [layers, 2, HEADS, TOKENS, DIM] each
    decoded = torch.cat([impl.decode(impl.encode(b.contiguous()), torch.empty_like(b)) for b in blocks], dim=-2)
    return decoded[:, 0], decoded[:, 1]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact decode attention in float64: ``softmax(q K^T / sqrt(d)) V`` per (layer, head)."""
    return torch.einsum("lht,lhtd->lhd", torch.softmax(logits(q, k), dim=-1), v.double())


def query(k: torch.Tensor, logit_std: float | None, seed: int) -> torch.Tensor:
    """A unit-normal query ``[layers, HEADS, DIM]``, rescaled per (layer, head) so that its
    logits over ``k`` have standard deviation ``logit_std`` (None: as drawn)."""
    q = torch.randn(k.shape[0], HEADS, DIM, generator=torch.Generator().manual_seed(seed))
    if logit_std is None:
        return q
    return q * (logit_std / logits(q, k).std(dim=-1, keepdim=True)).float()


def logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q K^T / sqrt(d)`` in float64, ``[layers, HEADS, tokens]``."""
    return torch.einsum("lhd,lhtd->lht", q.double(), k.double()) / DIM**0.5


def rel_err(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact||_F / ||exact||_F`` in float64."""
    exact = exact.double()
    return float((approx.double() - exact).norm() / exact.norm())


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timings(codec: Codec, block: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds of encode + decode, encode alone and decode alone of ``block`` as the
    tiers run them (``encode_into`` a slot's byte buffer, ``decode_from`` it into a block
    buffer, both preallocated), and of the plain torch reference the compiled loops are
    checked against (``encode_reference``/``decode_reference``)."""
    impl, out = codec_for(codec), torch.empty_like(block)
    buf = torch.empty(impl.nbytes_of(tuple(block.shape), block.dtype), dtype=torch.uint8)
    encoded = impl.from_bytes(impl.encode_into(block, buf), tuple(block.shape), block.dtype)
    return {
        "both": median_seconds(lambda: impl.decode_from(impl.encode_into(block, buf), block.dtype, out), repeats),
        "encode": median_seconds(lambda: impl.encode_into(block, buf), repeats),
        "decode": median_seconds(lambda: impl.decode_from(buf, block.dtype, out), repeats),
        "reference_encode": median_seconds(lambda: impl.encode_reference(block), repeats),
        "reference_decode": median_seconds(lambda: impl.decode_reference(encoded, out), repeats),
    }


def nvme_read_gbps(block_bytes: int, blocks: int = 64, threads: int = 4) -> float:
    """Raw cold O_DIRECT random reads of whole blocks, GB/s (files in a temporary dir)."""
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        prefix = str(Path(tmp) / "raw")
        pwrite_loop(prefix, blocks, block_bytes, threads)
        return direct_read(prefix, blocks, block_bytes, threads).gbps


def measure(args: argparse.Namespace) -> dict:
    """Every metric of every quantised codec, plus the baselines, in one run."""
    k, v = synthetic_kv(args.layers, TOKENS * args.blocks, args.seed)
    q, sharp = query(k, args.logit_std, args.seed + 1), query(k, None, args.seed + 1)
    reference, reference_sharp = attention(q, k, v), attention(sharp, k, v)
    block = torch.stack((k, v), dim=1)[..., :TOKENS, :].contiguous()
    nbytes = block.numel() * block.element_size()
    dest = torch.empty_like(block)
    copy_s = median_seconds(lambda: dest.copy_(block), args.repeats)
    disk = None if args.no_disk else nvme_read_gbps(nbytes)
    codecs = {}
    for codec in QUANTISED:
        k_hat, v_hat = round_trip(codec, k, v)
        t = timings(codec, block, args.repeats)
        gbps = {name: nbytes / seconds / 1e9 for name, seconds in t.items()}
        codecs[codec.value] = {
            "bytes_ratio": codec_for(codec).nbytes_of(tuple(block.shape), block.dtype) / nbytes,
            "k_rel_err": rel_err(k_hat, k), "v_rel_err": rel_err(v_hat, v),
            "attn_rel_err": rel_err(attention(q, k_hat, v_hat), reference),
            "attn_rel_err_sharp": rel_err(attention(sharp, k_hat, v_hat), reference_sharp),
            "throughput_ratio": copy_s / t["both"], "gbps": gbps["both"],
            "encode_gbps": gbps["encode"], "decode_gbps": gbps["decode"],
            "encode_ratio": copy_s / t["encode"], "decode_ratio": copy_s / t["decode"],
            "reference_encode_gbps": gbps["reference_encode"], "reference_decode_gbps": gbps["reference_decode"],
            "faster_than_nvme_read": None if disk is None else min(gbps["encode"], gbps["decode"]) > disk,
        }
    return {"block_shape": list(block.shape), "dtype": "float16", "copy_gbps": nbytes / copy_s / 1e9,
            "nvme_read_gbps": disk, "logit_std": args.logit_std,
            "logit_std_sharp": float(logits(sharp, k).std(dim=-1).mean()), "threads": torch.get_num_threads(), "codecs": codecs,
            "transformers": compare_transformers(k, v, q, reference)}


def compare_transformers(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, reference: torch.Tensor) -> dict:
    """transformers' quantised KV cache layers on the same KV (see ``tiercache.bench.hf_quant``)."""
    results = hf_quant.compare(k, v)
    for entry in results.get("layers", []):
        entry["attn_rel_err"] = rel_err(attention(q, entry.pop("k_hat"), entry.pop("v_hat")), reference)
    return results


def table(result: dict) -> str:
    """The result as a fixed-width table, baselines last."""
    head = (f"{'codec':<6} {'bytes':>6} {'k_err':>8} {'v_err':>8} {'attn_err':>9} {'sharp':>7} {'enc GB/s':>9} "
            f"{'dec GB/s':>9} {'enc+dec/copy_':>14} {'ref enc':>8} {'ref dec':>8} {'> nvme':>7}")
    rows = [head]
    for name, m in result["codecs"].items():
        faster = "-" if m["faster_than_nvme_read"] is None else ("yes" if m["faster_than_nvme_read"] else "NO")
        rows.append(f"{name:<6} {m['bytes_ratio']:>6.3f} {m['k_rel_err']:>8.4f} {m['v_rel_err']:>8.4f} "
                    f"{m['attn_rel_err']:>9.4f} {m['attn_rel_err_sharp']:>7.4f} {m['encode_gbps']:>9.2f} {m['decode_gbps']:>9.2f} "
                    f"{m['throughput_ratio']:>14.4f} {m['reference_encode_gbps']:>8.2f} {m['reference_decode_gbps']:>8.2f} {faster:>7}")
    hf = result["transformers"]
    for entry in hf.get("layers", []):
        rows.append(f"hf {entry['name']:<24} bytes {entry['bytes_ratio'] if entry['bytes_ratio'] is not None else '-'} "
                    f"k_err {entry['k_rel_err']:.4f} v_err {entry['v_rel_err']:.4f} attn_err {entry['attn_rel_err']:.4f}")
    if hf.get("note"):
        rows.append(f"transformers: {hf['note']}")
    disk = result["nvme_read_gbps"]
    rows.append("GB/s in fp16 bytes; ref: the plain torch reference of the same codec\n"
                f"block {result['block_shape']} fp16; copy_ {result['copy_gbps']:.2f} GB/s; raw O_DIRECT read "
                + ("skipped" if disk is None else f"{disk:.2f} GB/s") + f"; torch threads {result['threads']}\n"
                f"attn_err: query logits of std {result['logit_std']}; sharp: as drawn "
                f"(logit std {result['logit_std_sharp']:.1f})")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--layers", type=int, default=4, help="layers per block (default 4)")
    parser.add_argument("--blocks", type=int, default=16, help="blocks in the attention sequence (default 16)")
    parser.add_argument("--repeats", type=int, default=25, help="timed runs per measurement (median; default 25)")
    parser.add_argument("--logit-std", type=float, default=1.0, help="std of the query's logits (default 1.0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-disk", action="store_true", help="skip the raw NVMe read baseline")
    parser.add_argument("--torch-threads", type=int, help="torch's intra-op threads (default: torch's own); 1 keeps "
                                                           "torch's ops steady on a machine shared with other work")
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    result = measure(args)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
