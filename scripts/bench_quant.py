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
* ``throughput_ratio``: quantise + dequantise of a block vs one ``copy_`` of its fp16 bytes,
  as a tier runs them: ``encode_into`` a preallocated slot buffer and ``decode_from`` it into
  a preallocated block. ``copy_`` and every codec operation alternate round by round (the
  one that goes first rotating), and each ratio is the median over ``--repeats`` rounds of
  ``copy_`` seconds / codec seconds in that round: torch's ``copy_`` on a shared machine
  switches between regimes ~50x apart, and only neighbouring measurements see the same one
  (``copy_gbps_range`` shows the spread). ``gbps`` is the codec's rate in fp16 bytes per
  second (median over rounds);
  ``encode_gbps``/``decode_gbps`` and ``encode_ratio``/``decode_ratio`` (vs ``copy_``) time
  each direction alone, and ``reference_encode_gbps``/``reference_decode_gbps`` the plain
  torch reference the compiled loops are checked against (same block, same rounds);
* the disk, per codec, on blocks of that codec's encoded size (rounded up to 4 KiB pages):
  ``decode_vs_disk_read`` is the median over ``--disk-rounds`` rounds of dequantise speed
  over the speed at which cold random O_DIRECT reads deliver encoded blocks, both in fp16
  bytes per second (the disk's raw rate over ``bytes_ratio``); ``encode_vs_disk_write`` is
  the same for quantise against durable writes (``pwrite`` + ``fdatasync`` per block) of
  encoded blocks, the demotion path; each disk run alternates with ``--disk-blocks`` codec
  calls, each of its own block in distinct memory as the disk side's (decodes: each its own
  encoded source and its own destination; encodes: each its own source block and its own
  slot buffer), so neither side runs from a CPU cache the other cannot use. The files lie in a
  temporary folder under ``--dir`` (default: the current directory), and every read is cold:
  before each read run the files are evicted from the page cache (``POSIX_FADV_DONTNEED``,
  our own files only) and ``mincore`` must find none of their bytes cached
  (``tiercache.bench.decode.make_cold``), or the script exits 1 with no figures (a memory
  filesystem such as ``/dev/shm`` would time RAM). Above 1 the codec keeps up (``decode_keeps_up_with_disk_read``,
  ``encode_keeps_up_with_disk_write``). ``disk_read_gbps``/``disk_write_gbps`` are the raw
  rates in bytes moved, ``*_fp16_gbps`` the same runs in fp16 bytes of the blocks moved
  (``tiercache.bench.rawio``; ``--no-disk`` skips all of it);
* every timed ``encode_into``/``decode_from`` (and reference) call writes into an output
  filled with a sentinel first (untimed), and what it wrote must equal, byte for byte, what
  the untimed ``encode``/``decode`` the errors are measured on give for the same block
  (``check_output``): otherwise the script stops with an error (exit 1) before any speed is
  reported, since a fast path that writes wrong bytes (or none) would time nothing real;
* ``transformers``: the error and bytes of ``transformers``' quantised KV cache layers on the
  same KV at 8 and 4 bits, where transformers (and a quantisation backend) is installed; a
  note saying why not otherwise (``tiercache.bench.hf_quant``).

Usage: ``python scripts/bench_quant.py [--json OUT] [--layers 4] [--blocks 16] [--repeats 25]
[--logit-std 1.0] [--no-disk] [--disk-rounds 5] [--disk-blocks 16] [--dir DIR] [--torch-threads N]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tiercache.bench import hf_quant
from tiercache.bench.decode import ColdReadError, make_cold
from tiercache.bench.rounds import alternate, paired_ratio, positive_int
from tiercache.bench.rawio import SOURCE, SYNC_POLICY, RawBlockFiles, host_copy, read_buffers, source_block
from tiercache.bench.script_args import ScriptParser, existing_folder, positive_float, refuse_bad_outputs
from tiercache.config import Codec
from tiercache.data.buffers import PAGE
from tiercache.data.codecs import codec_for

HEADS, TOKENS, DIM = 8, 256, 128
QUANTISED = (Codec.INT8, Codec.FP8, Codec.INT4)
DISK_THREADS = 4


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


#: The ``--logit-std`` taken: a query scaled past these in float32 underflows to 0 or overflows
#: (NaN attention errors).
LOGIT_STD_RANGE = (1e-3, 1e3)


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


def seconds_of(work: Callable[[], object]) -> float:
    """Wall seconds of one ``work()`` (CPU tensors: nothing runs after it returns)."""
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def median_gbps(nbytes: int, seconds: list[float]) -> float:
    """Median over rounds of ``nbytes / seconds`` in GB/s."""
    return statistics.median(nbytes / s / 1e9 for s in seconds)


class OutputMismatch(RuntimeError):
    """A timed codec call wrote other bytes than the untimed ``encode``/``decode`` the errors
    are measured on: its speed would not be the speed of what the errors describe."""


#: Byte written over every timed call's output before the call (untimed): a call that writes
#: nothing leaves it there, and no encoded block or fp16 decode of these blocks is all 0xA5.
SENTINEL = 0xA5


def expected_outputs(codec: Codec, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(encoded bytes, decoded block)`` of ``block`` through the untimed ``encode`` and
    ``decode`` (the path ``round_trip``, hence every error figure, goes through)."""
    impl = codec_for(codec)
    q = impl.encode(block)
    return impl.to_bytes(q), impl.decode(q, torch.empty_like(block))


def check_output(what: str, output: torch.Tensor, expected: torch.Tensor) -> None:
    """Raises ``OutputMismatch`` unless ``output`` holds exactly ``expected``'s bytes."""
    if not torch.equal(output.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)):
        raise OutputMismatch(f"{what}: the timed call wrote other bytes than the untimed encode/decode the errors are "
                             "measured on; its speed would mean nothing")


def checked(what: str, work: Callable[[], object], output: torch.Tensor, expected: torch.Tensor) -> Callable[[int], float]:
    """An ``alternate`` op: fills ``output`` with ``SENTINEL`` (untimed), times ``work()``
    (``seconds_of``), then ``check_output``s what it left in ``output``."""
    return checked_all(what, work, [output], expected)


def checked_all(what: str, work: Callable[[], object], outputs: list[torch.Tensor],
                expected: torch.Tensor) -> Callable[[int], float]:
    """``checked`` for a ``work()`` that writes several outputs (one per block): every one is
    filled with ``SENTINEL`` before the clock and must hold ``expected``'s bytes after it."""
    def op(_: int) -> float:
        for output in outputs:
            output.view(torch.uint8).fill_(SENTINEL)
        seconds = seconds_of(work)
        for output in outputs:
            check_output(what, output, expected)
        return seconds
    return op


def reference_encode_op(codec: Codec, block: torch.Tensor, want_bytes: torch.Tensor) -> Callable[[int], float]:
    """An ``alternate`` op timing ``encode_reference(block)`` (it allocates its result), whose
    result's bytes are then checked against ``want_bytes`` (untimed)."""
    impl, what = codec_for(codec), f"{codec.value} encode_reference"

    def op(_: int) -> float:
        results = []
        seconds = seconds_of(lambda: results.append(impl.encode_reference(block)))
        if not results:
            raise OutputMismatch(f"{what}: the timed call returned nothing")
        check_output(what, impl.to_bytes(results[0]), want_bytes)
        return seconds
    return op


def codec_rounds(codec: Codec, block: torch.Tensor, rounds: int) -> dict[str, list[float]]:
    """Seconds per round of one ``copy_`` of ``block`` and of encode + decode, encode alone
    and decode alone as the tiers run them (``encode_into`` a slot's byte buffer,
    ``decode_from`` it into a block buffer, both preallocated), and of the plain torch
    reference the compiled loops are checked against, alternated (``alternate``). Every
    codec op writes into its own output, checked after each round against the untimed
    ``encode``/``decode`` (``checked``; raises ``OutputMismatch``)."""
    impl, dest = codec_for(codec), torch.empty_like(block)
    want_bytes, want_block = expected_outputs(codec, block)
    encoded = want_bytes.clone()  # the decodes' input: the bytes encode gives (decode_from must not write it)
    q = impl.from_bytes(encoded, tuple(block.shape), block.dtype)
    both_buf, enc_buf = torch.empty_like(want_bytes), torch.empty_like(want_bytes)
    outs = {name: torch.empty_like(block) for name in ("both", "decode", "reference_decode")}
    samples = alternate({
        "copy": lambda _: host_copy(dest, block).seconds,
        "both": checked(f"{codec.value} encode_into + decode_from",
                        lambda: impl.decode_from(impl.encode_into(block, both_buf), block.dtype, outs["both"]),
                        outs["both"], want_block),
        "encode": checked(f"{codec.value} encode_into", lambda: impl.encode_into(block, enc_buf), enc_buf, want_bytes),
        "decode": checked(f"{codec.value} decode_from", lambda: impl.decode_from(encoded, block.dtype, outs["decode"]),
                          outs["decode"], want_block),
        "reference_encode": reference_encode_op(codec, block, want_bytes),
        "reference_decode": checked(f"{codec.value} decode_reference", lambda: impl.decode_reference(q, outs["reference_decode"]),
                                    outs["reference_decode"], want_block),
    }, rounds)
    check_output(f"{codec.value} decode input", encoded, want_bytes)
    return samples


def codec_speed(t: dict[str, list[float]], nbytes: int) -> dict[str, float]:
    """The speed metrics of one codec from ``codec_rounds``' seconds (fp16 bytes ``nbytes``)."""
    return {
        "throughput_ratio": paired_ratio(t["copy"], t["both"]), "gbps": median_gbps(nbytes, t["both"]),
        "encode_gbps": median_gbps(nbytes, t["encode"]), "decode_gbps": median_gbps(nbytes, t["decode"]),
        "encode_ratio": paired_ratio(t["copy"], t["encode"]), "decode_ratio": paired_ratio(t["copy"], t["decode"]),
        "reference_encode_gbps": median_gbps(nbytes, t["reference_encode"]),
        "reference_decode_gbps": median_gbps(nbytes, t["reference_decode"]),
    }


def disk_rounds(codec: Codec, block: torch.Tensor, directory: str, rounds: int, blocks: int) -> tuple[dict, int, bool]:
    """Durable writes and cold random O_DIRECT reads of ``blocks`` blocks of the codec's
    encoded size (rounded up to a page, as O_DIRECT needs), ``DISK_THREADS`` threads, each
    alternated round by round with as many encodes (writes) or decodes (reads), each block's
    from and into its own memory as each disk block's is (``codec_ops``), whose outputs are
    checked after each round (``checked_all``; raises ``OutputMismatch``), as is every block
    each read run read, off the clock, against what the writes left in its slot
    (``check_raw_reads``). Before each read run the files are evicted and checked out of
    the page cache (``make_cold``).

    Returns:
        ``({"disk_write"|"encode"|"disk_read"|"decode": [seconds per round]}, bytes per
        disk block, whether every read was O_DIRECT)``.

    Raises:
        ColdReadError: the files stayed in the page cache (a memory filesystem): reads not cold.
    """
    encodes, decodes, encoded, want_bytes = codec_ops(codec, block, blocks)
    size = -(-want_bytes.numel() // PAGE) * PAGE
    files = RawBlockFiles(str(Path(directory) / codec.value), size, DISK_THREADS, -(-blocks // DISK_THREADS))
    try:
        files.lay_out()  # as fio does: the timed writes overwrite allocated space
        sources = [source_block(size, seed) for seed in range(blocks)]  # distinct memory, as a tier writes from
        dests = read_buffers(size, blocks)  # one page-aligned destination per block read
        order = np.random.default_rng(0).permutation(files.capacity)[:blocks]

        def cold_read(_: int) -> float:
            make_cold(files.paths, f"bench_quant: {codec.value} cold reads", f"raw block files in {directory}")
            seconds = files.read(order, dests, DISK_THREADS)
            check_raw_reads(files, order, dests, sources, f"{codec.value} disk reads")  # after the clock stopped
            return seconds

        writes = alternate({"disk_write": lambda _: files.write(sources, list(range(blocks))), "encode": encodes}, rounds)
        reads = alternate({"disk_read": cold_read, "decode": decodes}, rounds)
    finally:
        files.close()
        files.reset()
    for source in encoded:
        check_output(f"{codec.value} decode input", source, want_bytes)
    return writes | reads, size, files.direct


def check_raw_reads(files: RawBlockFiles, slots: np.ndarray, dests: list, sources: list, what: str) -> None:
    """Raises ``OutputMismatch`` unless each ``dests[i]`` holds the bytes slot ``slots[i]``
    was last written with: ``sources[label]`` where ``files.holds`` gives a source's index,
    the files' own block where it gives ``SOURCE`` (laid out, never overwritten)."""
    for slot, dest in zip(slots.tolist(), dests):
        label = files.holds[slot]
        want = sources[label] if isinstance(label, int) else files.source if label == SOURCE else None
        if want is None or memoryview(dest) != memoryview(want):
            raise OutputMismatch(f"{what}: slot {slot} read back other bytes than were written there "
                                 "(the raw disk baseline measured something else); no figure is reported")


def codec_ops(codec: Codec, block: torch.Tensor, blocks: int) -> tuple[Callable, Callable, list[torch.Tensor], torch.Tensor]:
    """The codec side of ``disk_rounds``: ``alternate`` ops running ``blocks`` encodes and
    ``blocks`` decodes, each of its own block in its own memory, as the disk side reads into
    and writes from a distinct buffer per block (one buffer reused would stay in a CPU cache
    and flatter the codec): encode ``i`` reads source ``i`` (a copy of ``block``) into slot
    buffer ``i``; decode ``i`` reads encoded copy ``i`` into block ``i``. Every output is
    checked against the untimed ``encode``/``decode`` (``checked_all``).

    Returns:
        ``(encodes op, decodes op, the decodes' encoded inputs, the expected encoded bytes)``.
    """
    impl = codec_for(codec)
    want_bytes, want_block = expected_outputs(codec, block)
    sources = [block.clone() for _ in range(blocks)]
    bufs = [torch.empty_like(want_bytes) for _ in range(blocks)]
    encoded = [want_bytes.clone() for _ in range(blocks)]  # decode_from must not write them
    outs = [torch.empty_like(block) for _ in range(blocks)]
    encodes = checked_all(f"{codec.value} encode_into", lambda: [impl.encode_into(s, b) for s, b in zip(sources, bufs)],
                          bufs, want_bytes)
    decodes = checked_all(f"{codec.value} decode_from",
                          lambda: [impl.decode_from(e, block.dtype, o) for e, o in zip(encoded, outs)], outs, want_block)
    return encodes, decodes, encoded, want_bytes


def disk_speed(t: dict[str, list[float]], nbytes: int, size: int, blocks: int) -> dict:
    """The disk metrics of one codec from ``disk_rounds``' seconds: raw rates in bytes moved
    (``size`` per block), the same runs in fp16 bytes (``nbytes`` per block), and the
    codec's speed over the disk's, both in fp16 bytes (median of per-round ratios)."""
    decode_vs_read, encode_vs_write = paired_ratio(t["disk_read"], t["decode"]), paired_ratio(t["disk_write"], t["encode"])
    return {
        "disk_block_bytes": size,
        "disk_read_gbps": median_gbps(blocks * size, t["disk_read"]),
        "disk_read_fp16_gbps": median_gbps(blocks * nbytes, t["disk_read"]),
        "decode_vs_disk_read": decode_vs_read, "decode_keeps_up_with_disk_read": decode_vs_read > 1,
        "disk_write_gbps": median_gbps(blocks * size, t["disk_write"]),
        "disk_write_fp16_gbps": median_gbps(blocks * nbytes, t["disk_write"]),
        "encode_vs_disk_write": encode_vs_write, "encode_keeps_up_with_disk_write": encode_vs_write > 1,
    }


def measure(args: argparse.Namespace) -> dict:
    """Every metric of every quantised codec, plus the baselines, in one run."""
    k, v = synthetic_kv(args.layers, TOKENS * args.blocks, args.seed)
    q, sharp = query(k, args.logit_std, args.seed + 1), query(k, None, args.seed + 1)
    reference, reference_sharp = attention(q, k, v), attention(sharp, k, v)
    block = torch.stack((k, v), dim=1)[..., :TOKENS, :].contiguous()
    nbytes = block.numel() * block.element_size()
    codecs, copies, direct = {}, [], True
    with tempfile.TemporaryDirectory(prefix="tiercache-bench-quant-", dir=args.dir or Path.cwd()) as directory:
        for codec in QUANTISED:
            k_hat, v_hat = round_trip(codec, k, v)
            t = codec_rounds(codec, block, args.repeats)
            copies += [nbytes / s / 1e9 for s in t["copy"]]
            codecs[codec.value] = {
                "bytes_ratio": codec_for(codec).nbytes_of(tuple(block.shape), block.dtype) / nbytes,
                "k_rel_err": rel_err(k_hat, k), "v_rel_err": rel_err(v_hat, v),
                "attn_rel_err": rel_err(attention(q, k_hat, v_hat), reference),
                "attn_rel_err_sharp": rel_err(attention(sharp, k_hat, v_hat), reference_sharp),
                **codec_speed(t, nbytes),
            }
            if not args.no_disk:
                samples, size, read_direct = disk_rounds(codec, block, directory, args.disk_rounds, args.disk_blocks)
                codecs[codec.value].update(disk_speed(samples, nbytes, size, args.disk_blocks))
                direct = direct and read_direct
    disk = None if args.no_disk else {"blocks": args.disk_blocks, "rounds": args.disk_rounds, "threads": DISK_THREADS,
                                      "o_direct": direct, "write_sync": SYNC_POLICY, "dir": str(args.dir or Path.cwd()),
                                      "cold_check": "page cache dropped before each read run, mincore found none cached"}
    return {"block_shape": list(block.shape), "dtype": "float16", "copy_gbps": statistics.median(copies),
            "copy_gbps_range": [min(copies), max(copies)], "rounds": args.repeats, "disk": disk, "logit_std": args.logit_std,
            "logit_std_sharp": float(logits(sharp, k).std(dim=-1).mean()), "threads": torch.get_num_threads(), "codecs": codecs,
            "transformers": compare_transformers(k, v, q, reference)}


def compare_transformers(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, reference: torch.Tensor) -> dict:
    """transformers' quantised KV cache layers on the same KV (see ``tiercache.bench.hf_quant``)."""
    results = hf_quant.compare(k, v)
    for entry in results.get("layers", []):
        entry["attn_rel_err"] = rel_err(attention(q, entry.pop("k_hat"), entry.pop("v_hat")), reference)
    return results


def table(result: dict) -> str:
    """The result as fixed-width tables: the codecs, the disk per codec, then the baselines."""
    head = (f"{'codec':<6} {'bytes':>6} {'k_err':>8} {'v_err':>8} {'attn_err':>9} {'sharp':>7} {'enc GB/s':>9} "
            f"{'dec GB/s':>9} {'enc+dec/copy_':>14} {'ref enc':>8} {'ref dec':>8}")
    rows = [head]
    for name, m in result["codecs"].items():
        rows.append(f"{name:<6} {m['bytes_ratio']:>6.3f} {m['k_rel_err']:>8.4f} {m['v_rel_err']:>8.4f} "
                    f"{m['attn_rel_err']:>9.4f} {m['attn_rel_err_sharp']:>7.4f} {m['encode_gbps']:>9.2f} {m['decode_gbps']:>9.2f} "
                    f"{m['throughput_ratio']:>14.4f} {m['reference_encode_gbps']:>8.2f} {m['reference_decode_gbps']:>8.2f}")
    if result["disk"] is not None:
        rows += disk_table(result)
    hf = result["transformers"]
    for entry in hf.get("layers", []):
        nominal = "-" if entry["bytes_ratio"] is None else f"{entry['bytes_ratio']:.3f} (nominal, not measured)"
        rows.append(f"hf {entry['name']:<24} bytes {nominal} "
                    f"k_err {entry['k_rel_err']:.4f} v_err {entry['v_rel_err']:.4f} attn_err {entry['attn_rel_err']:.4f}")
    if hf.get("note"):
        rows.append(f"transformers: {hf['note']}")
    low, high = result["copy_gbps_range"]
    rows.append("GB/s in fp16 bytes, medians over rounds; ref: the plain torch reference of the same codec\n"
                f"enc+dec/copy_: (quantise+dequantise GB/s) / (copy_ GB/s), median of the ratios of {result['rounds']} "
                "rounds that alternate them\n"
                f"block {result['block_shape']} fp16; copy_ {result['copy_gbps']:.2f} GB/s (rounds: {low:.2f} to {high:.2f}); "
                f"torch threads {result['threads']}" + ("; disk skipped" if result["disk"] is None else "") + "\n"
                f"attn_err: query logits of std {result['logit_std']}; sharp: as drawn "
                f"(logit std {result['logit_std_sharp']:.1f})")
    return "\n".join(rows)


def disk_table(result: dict) -> list[str]:
    """The disk rows: each codec's encoded blocks read and written, and whether the codec keeps up."""
    disk = result["disk"]
    rows = [f"disk, {disk['blocks']} encoded blocks per run, {disk['rounds']} rounds, {disk['threads']} threads: cold random "
            + ("O_DIRECT" if disk["o_direct"] else "BUFFERED (O_DIRECT refused)")
            + " reads (page cache dropped, mincore-checked), "
            + f"writes with {disk['write_sync']}, in {disk['dir']}",
            f"{'codec':<6} {'block KiB':>9} {'read GB/s':>10} {'= fp16':>8} {'dec/read':>9} "
            f"{'write GB/s':>11} {'= fp16':>8} {'enc/write':>10}"]
    for name, m in result["codecs"].items():
        rows.append(f"{name:<6} {m['disk_block_bytes'] / 1024:>9.0f} {m['disk_read_gbps']:>10.2f} {m['disk_read_fp16_gbps']:>8.2f} "
                    f"{m['decode_vs_disk_read']:>9.2f} {m['disk_write_gbps']:>11.2f} {m['disk_write_fp16_gbps']:>8.2f} "
                    f"{m['encode_vs_disk_write']:>10.2f}")
    rows.append("read/write GB/s: bytes moved; = fp16: the same runs in fp16 bytes of the blocks moved; dec/read, enc/write: "
                "codec speed over disk speed, both in fp16 bytes, median of per-round ratios (above 1: the codec keeps up)")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--layers", type=positive_int, default=4, help="layers per block (default 4)")
    parser.add_argument("--blocks", type=positive_int, default=16, help="blocks in the attention sequence (default 16)")
    parser.add_argument("--repeats", type=positive_int, default=25,
                        help="rounds alternating copy_ and every codec operation (medians; default 25)")
    parser.add_argument("--logit-std", type=positive_float, default=1.0, help="std of the query's logits (default 1.0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-disk", action="store_true", help="skip the disk comparisons")
    parser.add_argument("--disk-rounds", type=positive_int, default=5,
                        help="rounds alternating a disk run and the codec, per codec and direction (default 5)")
    parser.add_argument("--disk-blocks", type=positive_int, default=16, help="encoded blocks per disk run (default 16)")
    parser.add_argument("--dir", type=existing_folder, default=None,
                        help="folder on the disk to time; the disk files go in a temporary folder under it (default: the "
                             "current directory); a memory filesystem such as /dev/shm is refused (exit 1)")
    parser.add_argument("--torch-threads", type=positive_int, help="torch's intra-op threads (default: torch's own); 1 keeps "
                                                                   "torch's ops steady on a machine shared with other work")
    args = parser.parse_args(argv)
    if not LOGIT_STD_RANGE[0] <= args.logit_std <= LOGIT_STD_RANGE[1]:  # float32 logits: past these, 0 or inf
        parser.error(f"--logit-std: expected a number from {LOGIT_STD_RANGE[0]:g} to {LOGIT_STD_RANGE[1]:g}, "
                     f"got {args.logit_std!r}")
    refuse_bad_outputs(parser, {"--json": args.json})  # before the run, not after it
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    try:
        result = measure(args)
    except (OutputMismatch, ColdReadError) as error:
        print(f"error: {error}; no figures reported", file=sys.stderr)
        return 1
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
