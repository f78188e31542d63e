"""The measurements behind ``tiercache bench`` (see ``tiercache.bench.tiers`` for what and why).

Every timed region covers the work only: buffers, pools, key lists and view lists are
built before the clock starts; deleting the previous repetition's blocks and dropping the
page cache happen outside it.

Every "cold" read starts after ``decode.evict_from_page_cache`` (fsync, then
``POSIX_FADV_DONTNEED``: dirty pages survive the drop) and a ``mincore`` check that the
files left the cache; what that check found is reported (``machine``), and no cold-read
figure is given when any of the files stayed cached (``cold_refusal``; the zarr API does not
even time its read then).

Every timed transfer is checked after its clock stops (``tiercache.bench.verify``): its
destination blocks are poisoned first, and afterwards each must hold exactly its source's
bytes; a raw write is read back into poisoned memory, every block it wrote; the store's
writes are checked by reading every block back. A mismatch raises ``BenchError`` and no
figure is reported.
"""

from __future__ import annotations

import mmap
import os
import time
from typing import Callable

import numpy as np
import torch

from ..data import chunkio
from ..data.buffers import byte_array
from ..data.nvme import NVMeStore
from ..data.pools import BlockPool, dram_pool, hbm_pool
from ..errors import UserError
from . import rawio
from .decode import evict_from_page_cache
from .host import filesystem, host_copy_kind, host_facts
from .rounds import Tally
from .tiers import COMPARISONS
from .verify import BenchError, Side, block_digests, pool_rows, reference_digests, transfer_side, unchecked_side, written_side

__all__ = ["Bench", "COMPARISONS", "MIN_BLOCKS", "check_blocks"]

# Disk comparisons alternate tiercache and raw slice by slice: the virtio disk's speed
# swings several-fold within seconds, and fine interleaving makes both sides see the same
# swings. Copies are short, so each repetition alternates a few whole rounds instead.
_SLICES = 8
_COPY_ROUNDS = 4
_READ_SIDES = ("tiercache", "raw", "raw_file")
#: Fewest blocks per slice, and so per run: a cold-read slice is split between tiercache
#: and the raw reads, and each side must get at least one block (an empty read is never timed).
MIN_BLOCKS = 2


def check_blocks(blocks: int) -> None:
    """Raises UserError (naming ``--blocks``) when a run of ``blocks`` cannot give every
    side of every compared round at least one block."""
    if blocks < MIN_BLOCKS:
        raise UserError(f"bench: --blocks must be at least {MIN_BLOCKS} (each cold-read round splits its blocks "
                        f"between tiercache and the raw reads), got {blocks}")


class Bench:
    """Pools, a store and a raw file in the benchmark directory, and the timed operations.

    Invariants: the DRAM pool holds ``_reference`` (distinct random blocks, digests
    ``_ref_digests``) whenever a comparison starts (``_restore_dram`` puts it back after one
    that overwrites DRAM); after ``_disk_writes`` the store holds exactly ``self._keys``,
    key ``i`` the block of DRAM slot ``i``, which ``_disk_reads`` reads back; ``_written``
    has a slot per block of the largest slice (raw writes are read back into it).
    """

    def __init__(self, cfg) -> None:
        check_blocks(cfg.blocks)
        self.cfg = cfg
        self.cuda = torch.cuda.is_available()
        n = cfg.blocks
        self.dram = dram_pool(cfg.layout, n)
        self.hbm = hbm_pool(cfg.layout, n)
        self._written = dram_pool(cfg.layout, -(-n // self._slice_count()))
        self.dram.tensor.view(torch.int16).random_(generator=torch.Generator().manual_seed(cfg.seed))
        self._reference = pool_rows(self.dram).clone()
        self._ref_digests = reference_digests(self._reference)
        self.store = NVMeStore(os.path.join(cfg.directory, "store"), cfg.layout, n, io_threads=cfg.threads)
        per_file = -(-n // cfg.threads)
        self.raw = rawio.RawBlockFiles(os.path.join(cfg.directory, "raw"), cfg.layout.block_bytes, cfg.threads, per_file, cfg.seed)
        # room for every block in each fresh file: however the writers share the blocks, the first fill never overwrites
        self.raw_fresh = rawio.RawBlockFiles(os.path.join(cfg.directory, "fresh"), cfg.layout.block_bytes, cfg.threads, n, cfg.seed)
        self._src_digest = int(block_digests(torch.frombuffer(self.raw.source, dtype=torch.uint8)[: cfg.layout.block_bytes].view(1, -1))[0])
        self._tails = rawio.read_buffers(rawio.PAGE, cfg.threads)
        self._readers = rawio.RawPool(cfg.threads)  # the chunk-file reads' threads, like the store's I/O pool
        self._copiers = rawio.RawPool(torch.get_num_threads())  # as many as BlockPool.copy_to's host copies use
        self.raw.lay_out()  # as fio lays out its files: steady-state writes overwrite
        self.rng = np.random.default_rng(cfg.seed)
        self._keys: list[bytes] = []
        self._rep = 0
        self._cold_residue: int | None = 0  # most bytes still cached when a cold read started; None: unknown
        self._warm_up()

    def close(self) -> None:
        """Closes the store and stops the raw baselines' threads (files are removed by the
        caller with the directory)."""
        self.store.close()
        for closable in (self.raw, self.raw_fresh, self._readers, self._copiers):
            closable.close()

    # ----- timing helpers -------------------------------------------------------------

    def _timed(self, work: Callable[[], object], device_work: bool) -> float:
        """Seconds ``work`` takes; CUDA events time device copies, perf_counter the rest."""
        if device_work and self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        start_s = time.perf_counter()
        work()
        return time.perf_counter() - start_s

    def _gbps(self, seconds: float, rounds: int = 1) -> float:
        return rounds * self.cfg.total_bytes / seconds / 1e9

    # ----- checking what a timed transfer delivered -----------------------------------

    def _restore_dram(self) -> None:
        """Puts the reference blocks back into DRAM (off the clock)."""
        pool_rows(self.dram).copy_(self._reference)

    # ----- the compared operations ----------------------------------------------------

    def _round(self, tally: Tally, ops: dict[str, list[Side]], i: int, device: bool) -> None:
        """Runs one round: every side once, in an order that rotates with ``i`` and the
        repetition, and adds each side's time and bytes to ``tally``. A side given several
        variants (equal bytes) counts its fastest. A side with no bytes is refused before
        anything is timed (its ratio would be 0 or a division by zero)."""
        sides = list(ops)
        empty = [side for side in sides if ops[side][0].nbytes <= 0]
        if empty:
            raise RuntimeError(f"bench: round {i} gives {', '.join(empty)} no blocks to move")
        rotation = (i + self._rep) % len(sides)
        seconds = {side: self._fastest(ops[side], device) for side in sides[rotation:] + sides[:rotation]}
        tally.add(seconds, {side: ops[side][0].nbytes for side in sides})

    def _fastest(self, variants: list[Side], device: bool) -> float:
        """Seconds of the fastest variant; each is prepared, timed, then checked."""
        times = []
        for variant in variants:
            variant.prepare()
            times.append(self._timed(variant.work, device))
            variant.check()
        return min(times)

    def _copies(self, src: BlockPool, dst: BlockPool) -> Tally:
        """(a): random slots to random slots through ``BlockPool.copy_to`` vs the raw copy
        limit of the same bytes (``_raw_copies``), over ``_COPY_ROUNDS`` rounds."""
        n, tally = self.cfg.blocks, Tally(("tiercache", "raw"))
        every, src_digests = np.arange(n), block_digests(pool_rows(src))
        what = "DRAM->HBM copies" if dst is self.hbm else "HBM->DRAM copies"
        for i in range(_COPY_ROUNDS):
            src_slots, dst_slots = self.rng.permutation(n), self.rng.permutation(n)
            moved = np.empty_like(src_digests)
            moved[dst_slots] = src_digests[src_slots]
            mine = transfer_side(lambda: src.copy_to(dst, src_slots, dst_slots, non_blocking=True), dst, every, moved, f"{what} (tiercache)")
            raw = [transfer_side(work, dst, every, src_digests, f"{what} (raw)") for work in self._raw_copies(src, dst)]
            self._round(tally, {"tiercache": [mine], "raw": raw}, i, True)
        if dst is self.dram:
            self._restore_dram()
        return tally

    def _raw_copies(self, src: BlockPool, dst: BlockPool) -> list[Callable[[], object]]:
        """The raw copies of the whole pool, of which a round counts the fastest: with CUDA
        one ``copy_``; on the host one memmove and one memmove split over the copy threads."""
        if src.device.type == "cuda" or dst.device.type == "cuda":
            return [lambda: dst.tensor.copy_(src.tensor, non_blocking=True)]
        to, frm, size = dst.tensor.data_ptr(), src.tensor.data_ptr(), self.cfg.total_bytes
        works = [lambda: rawio.memmove_copy(to, frm, size)]
        if self._copiers.threads > 1:
            works.append(lambda: rawio.memmove_copy(to, frm, size, self._copiers))
        return works

    def _slice_count(self) -> int:
        """How many slices ``_slices`` cuts the blocks into."""
        return max(1, min(_SLICES, self.cfg.blocks // MIN_BLOCKS))

    def _slices(self) -> list[np.ndarray]:
        """A random order of all blocks cut into at most ``_SLICES`` slices that the sides
        alternate on, each of at least ``MIN_BLOCKS`` blocks (``cfg.blocks >= MIN_BLOCKS``)."""
        return np.array_split(self.rng.permutation(self.cfg.blocks), self._slice_count())

    def _disk_writes(self, raw: rawio.RawBlockFiles, tag: bytes, what: str) -> Tally:
        """(b): store put + flush vs raw durable pwrite of the same DRAM slots, slice by slice.

        Both sides' blocks are durable when their clock stops: the store syncs every block
        (``rawio.SYNC_POLICY``), the raw writer syncs each file once (``RAW_SYNC_POLICY``,
        the raw limit for that durability). In steady state both sides overwrite space
        written before: the store reuses the slots the previous repetition's blocks held,
        the raw files were laid out. Every raw write is read back and checked after its
        clock (``_raw_write_side``; ``what`` names it); the store's writes are checked by
        reading every block back (``_disk_reads``, or ``first_fill``).
        """
        if self._keys:
            self.store.delete(self._keys)
            self.store.flush()  # frees the previous repetition's slots
        keys = [b"%s-%d-%d" % (tag, self._rep, i) for i in range(self.cfg.blocks)]
        views = [self.dram.view(i) for i in range(self.cfg.blocks)]
        sources = [byte_array(view) for view in views]
        tally, size = Tally(("tiercache", "raw")), self.cfg.layout.block_bytes
        for i, part in enumerate(self._slices()):
            self._round(tally, {"tiercache": [unchecked_side(lambda: self._put([keys[b] for b in part], [views[b] for b in part]), part.size * size)],
                                "raw": [self._raw_write_side(raw, part, [sources[b] for b in part], what)]}, i, False)
        self._keys = keys
        return tally

    def _raw_write_side(self, raw: rawio.RawBlockFiles, part: np.ndarray, sources: list, what: str) -> Side:
        """The raw write of DRAM slots ``part`` (``sources``: their memory), one fdatasync
        per file; afterwards every file slot it wrote is read back into ``_written`` and
        checked against the reference digest of the DRAM slot written there."""
        dests = [byte_array(self._written.view(j)) for j in range(part.size)]
        labels = part.tolist()
        return written_side(lambda: raw.write(sources, labels, sync_each_block=False), part.size * self.cfg.layout.block_bytes,
                            lambda: self._written_by(raw, part.size, what), lambda slots: raw.read(slots, dests[: slots.size], self.cfg.threads),
                            self._written, what)

    def _written_by(self, raw: rawio.RawBlockFiles, count: int, what: str) -> tuple[np.ndarray, np.ndarray]:
        """The file slots the latest ``raw.write`` (of ``count`` blocks) left blocks in, and
        the digests of the blocks ``raw.holds`` says they hold. A writer that wrapped round
        its file within the write left only its later block in a slot.

        Raises:
            BenchError: a block of the write went to no slot.
        """
        if raw.last_slots.size != count or (raw.last_slots < 0).any():
            raise BenchError(f"bench: {what}: {count} blocks given, {int((raw.last_slots >= 0).sum())} written; no figure is reported")
        slots = np.unique(raw.last_slots)
        return slots, self._raw_file_digests(raw, slots)

    def first_fill(self) -> dict[str, float]:
        """Writes into never-used space on both sides (store: new chunk files, temp +
        rename, but for the ``min(blocks, threads)`` slots ``_warm_up`` wrote, whose temp
        files rename over the warm-up's chunk files: 1% of the blocks at the defaults, 12.5%
        under ``--quick``; raw: new files), once; afterwards the store's slots all have chunk files,
        as in steady state. Both sides' blocks are read back and checked (off the clock):
        the raw ones after each raw write, the store's at the end."""
        self.raw_fresh.reset()
        tally = self._disk_writes(self.raw_fresh, b"fill", "NVMe first-fill writes (raw)")
        self.raw_fresh.reset()
        every = np.arange(self.cfg.blocks)
        outs = [self.dram.view(i) for i in every]
        read_back = transfer_side(lambda: self._get(every, outs), self.dram, every, self._ref_digests, "NVMe first-fill writes read back (tiercache)")
        read_back.prepare()
        read_back.work()
        read_back.check()
        return {"tiercache": tally.gbps("tiercache"), "raw": tally.gbps("raw"), "ratio": tally.median_ratio("raw")}

    def _put(self, keys: list[bytes], blocks: list[torch.Tensor]) -> None:
        results = self.store.put(keys, blocks)
        self.store.flush()
        failed = [r for r in results if not r.ok]
        if failed:
            raise BenchError(f"bench: {len(failed)} store writes failed, first: {failed[0].error}")

    def _disk_reads(self) -> Tally:
        """(c): cold reads, slice by slice, rotating which side goes first: ``tiercache``
        (store get) and ``raw`` (O_DIRECT preadv of the store's chunk files, bypassing the
        store) split each slice's blocks, so both read bytes of the same age and layout;
        ``raw_file`` reads as many blocks from the raw files (one big file per thread). All
        three deliver each block into its own DRAM pool slot, as the tier must, and each
        slot is checked against the block written there.
        """
        outs = [self.dram.view(i) for i in range(self.cfg.blocks)]
        dests = [byte_array(view) for view in outs]
        chunk_paths = [self.store.chunk_path(self.store.slot_of(k)) for k in self._keys]
        self._make_cold(chunk_paths + self.raw.paths)  # the store's live chunks: every file the rounds read
        file_slots = self.rng.permutation(self.raw.capacity)
        tally, digests = Tally(_READ_SIDES), self._ref_digests
        for i, part in enumerate(self._slices()):
            mine, theirs = (part[0::2], part[1::2]) if (i + self._rep) % 2 == 0 else (part[1::2], part[0::2])
            self._round(tally, {
                "tiercache": [transfer_side(lambda: self._get(mine, outs), self.dram, mine, digests[mine], "NVMe cold reads (tiercache)")],
                "raw": [transfer_side(lambda: self._read_chunks([chunk_paths[b] for b in theirs], [dests[b] for b in theirs]),
                                   self.dram, theirs, digests[theirs], "NVMe cold reads (raw chunk files)")],
                "raw_file": [transfer_side(lambda: self.raw.read(file_slots[theirs], [dests[b] for b in theirs], self.cfg.threads),
                                        self.dram, theirs, self._raw_file_digests(self.raw, file_slots[theirs]), "NVMe cold reads (raw big files)")],
            }, i, False)
        self._restore_dram()
        return tally

    def _raw_file_digests(self, raw: rawio.RawBlockFiles, slots: np.ndarray) -> np.ndarray:
        """Digests of what ``raw``'s file ``slots`` hold (``RawBlockFiles.holds``)."""
        holds = [raw.holds[int(g)] for g in slots]
        if any(label is None for label in holds):
            raise BenchError("bench: a raw file slot holds unknown bytes (written outside this benchmark)")
        return np.array([self._src_digest if label == rawio.SOURCE else self._ref_digests[label] for label in holds], dtype=np.uint64)

    def _make_cold(self, paths: list[str]) -> int | None:
        """Evicts ``paths`` from the page cache (``evict_from_page_cache``) and records what
        stayed cached in ``_cold_residue`` (reported by ``machine``); returns those bytes
        (None: unknown)."""
        residue = evict_from_page_cache(paths)
        if residue is None or self._cold_residue is None:
            self._cold_residue = None
        else:
            self._cold_residue = max(self._cold_residue, residue)
        return residue

    def cold_refusal(self) -> str | None:
        """None when every cold read so far (compared reads, read latency) started with its
        files verified out of the page cache (``_make_cold``); else why no cold-read figure
        may be reported, in one line naming the folder and what the check found."""
        if self._cold_residue == 0:
            return None
        where = self.cfg.directory  # the CLI's working folder, removed by now: name the --dir it was made in
        if os.path.basename(os.path.normpath(where)).startswith(".tiercache-bench-"):
            where = os.path.dirname(os.path.abspath(where))
        return f"cold-read check on {where} ({filesystem(where)}): {_cold_check(self._cold_residue)}; no cold-read figure is reported or saved"

    def _read_chunks(self, paths: list[str], dests: list) -> None:
        _, direct = rawio.read_files(paths, dests, self._tails, self._readers)
        self.raw.direct = self.raw.direct and direct

    def _get(self, part: np.ndarray, outs: list[torch.Tensor]) -> None:
        """Reads the blocks ``part`` into their DRAM slots.

        Raises:
            BenchError: the store missed some.
        """
        hits = self.store.get([self._keys[b] for b in part], [outs[b] for b in part])
        if not hits.all():
            raise BenchError(f"bench: {int((~hits).sum())} stored blocks missed on read")

    def repeat(self) -> dict[str, dict[str, list[float]]]:
        """Runs every comparison ``reps`` times.

        Returns:
            ``{"tiercache"|"raw"|"raw_file": {comparison: [GB/s per repetition]},
            "paired"|"paired_file": {comparison: [tiercache/raw ratio per round]}}``.
        """
        samples: dict = {key: {} for key in ("tiercache", "raw", "raw_file", "paired", "paired_file")}
        for rep in range(self.cfg.reps):
            self._rep = rep
            tallies = {
                "host_to_device": self._copies(self.dram, self.hbm),
                "device_to_host": self._copies(self.hbm, self.dram),
                "disk_write": self._disk_writes(self.raw, b"bench", "NVMe writes (raw)"),
                "disk_read_cold": self._disk_reads(),  # reads what _disk_writes just wrote
            }
            for name, tally in tallies.items():
                for side in tally.sides:
                    samples[side].setdefault(name, []).append(tally.gbps(side))
                samples["paired"].setdefault(name, []).extend(tally.ratios["raw"])
                if "raw_file" in tally.ratios:
                    samples["paired_file"].setdefault(name, []).extend(tally.ratios["raw_file"])
        return samples

    def _warm_up(self) -> None:
        """One small pass of every path: thread pools, staging buffers and first-touch costs
        must not land in the first timed repetition. DRAM gets its reference blocks back."""
        k = min(self.cfg.blocks, self.cfg.threads)
        keys = [b"warm-%d" % i for i in range(k)]
        dests = [byte_array(self.dram.view(i)) for i in range(k)]
        self.store.put(keys, [self.dram.view(i) for i in range(k)])
        self.store.get(keys, [self.hbm.view(i) for i in range(k)])
        self._read_chunks([self.store.chunk_path(self.store.slot_of(key)) for key in keys], dests)
        self.store.delete(keys)
        self.store.flush()
        self.raw_fresh.write(k, sync_each_block=False)
        self.raw_fresh.reset()
        self.raw.read(np.arange(k), dests, self.cfg.threads)
        every = np.arange(self.cfg.blocks)  # whole pools: copy_to starts its copy threads for large copies only
        self.dram.copy_to(self.hbm, every, every)
        self.hbm.copy_to(self.dram, every, every)
        for work in self._raw_copies(self.dram, self.hbm):
            work()
        if self.cuda:
            torch.cuda.synchronize()
        self._restore_dram()

    # ----- latencies, zarr reference, machine ------------------------------------------

    def _copy_latency(self, src: BlockPool, dst: BlockPool) -> float:
        """Median time of the smallest transfer on the path (one element), each copy into
        a destination first set to the source's complement and checked afterwards.

        Raises:
            BenchError: a copy left the destination different from the source.
        """
        a, b = src.tensor.view(-1)[:1].view(torch.uint8), dst.tensor.view(-1)[:1].view(torch.uint8)
        expected = a.cpu()
        complement = (~expected).to(b.device)
        times = []
        for _ in range(32):
            b.copy_(complement)
            times.append(self._timed(lambda: b.copy_(a, non_blocking=True), True))
            if not torch.equal(b.cpu(), expected):
                raise BenchError("bench: a one-element copy for the latency left its destination unchanged")
        return float(np.median(times))

    def latencies(self) -> dict[str, float]:
        """Per-transfer latency of each link: tiny copies, raw 4 KiB disk I/O."""
        cfg = self.cfg
        self._make_cold(self.raw.paths)
        latency = {
            "host_to_device": self._copy_latency(self.dram, self.hbm),
            "device_to_host": self._copy_latency(self.hbm, self.dram),
            "disk_read_cold": rawio.read_latency(self.raw),
            "disk_write": rawio.write_latency(os.path.join(cfg.directory, "latency.bin")),
        }
        self._restore_dram()
        return latency

    def zarr_api(self) -> dict:
        """zarr's own API on the same blocks: per-chunk assignment (timed without fsync, as
        zarr writes), then cold per-chunk reads.

        The read is timed only once ``evict_from_page_cache`` left none of the array's files
        in the page cache; otherwise ``read_cold`` is None (no figure) and ``cold_check`` says why.
        Either way every block read must equal the block written (else BenchError).
        """
        import zarr

        cfg = self.cfg
        path = os.path.join(cfg.directory, "zarr_api")
        chunkio.create_array(path, cfg.layout, cfg.blocks, None)
        array = zarr.open_array(path, mode="r+")
        dtype = np.dtype(chunkio.STORAGE_DTYPES[cfg.layout.dtype])
        shape = (1, *cfg.layout.block_shape)
        blocks = [byte_array(self.dram.view(i)).view(dtype).reshape(shape) for i in range(cfg.blocks)]

        def write() -> None:
            for i, block in enumerate(blocks):
                array[i : i + 1] = block

        write_s = self._timed(write, False)
        files = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
        residue = evict_from_page_cache(files)  # not _make_cold: that check belongs to the compared reads
        check = _cold_check(residue, files) + ("" if residue == 0 else "; read not timed")
        result = {"write": self._gbps(write_s), "read_cold": None, "cold_check": check,
                  "method": "per-chunk assignment and reads, zarr " + zarr.__version__}
        order, got = self.rng.permutation(cfg.blocks), []
        read_s = self._timed(lambda: got.extend(array[int(i) : int(i) + 1] for i in order), False)
        wrong = [int(i) for i, block in zip(order, got) if not np.array_equal(block.view(np.uint8), blocks[i].view(np.uint8))]
        if wrong:
            raise BenchError(f"bench: zarr API: {len(wrong)} of {cfg.blocks} blocks read back differ from the blocks written "
                             f"(first: block {wrong[0]}); no figure is reported")
        if residue == 0:
            result["read_cold"] = self._gbps(read_s)
        return result

    def machine(self) -> dict:
        """Where this ran: host, device, filesystem, and what each raw baseline is."""
        smallest = self.cfg.blocks // self._slice_count()  # blocks of the smallest slice: a write's; a read side has half
        write_workers, read_workers = rawio.workers_in_words(self.cfg.threads, smallest), rawio.workers_in_words(self.cfg.threads, smallest // 2)
        read_kind = "O_DIRECT preadv" if self.raw.direct else "buffered preadv (filesystem refused O_DIRECT)"
        copy_kind = "one pinned->device copy_(non_blocking) of the same bytes, CUDA events" if self.cuda else host_copy_kind(self._copiers.threads)
        return {
            **host_facts(self.cfg.directory),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if self.cuda else "cpu (no CUDA)",
            "dram_pinned": self.dram.pinned,
            "store_direct_io": self.store.direct_io,
            "raw_direct_io": self.raw.direct,
            "cold_read_check": _cold_check(self._cold_residue),
            "sync_policy": f"store: {rawio.SYNC_POLICY} (chunk files), and each store flush (one per slice of blocks) adds one journal append + "
                           f"fdatasync, and a directory fsync after renames; raw pwrite: {rawio.RAW_SYNC_POLICY} (the raw limit for "
                           "the same durability: every block on disk when the timed write returns)",
            "baselines": {
                "host_to_device": copy_kind,
                "device_to_host": copy_kind,
                "disk_write": f"pwrite loop over laid-out files from the same DRAM slots, {rawio.RAW_SYNC_POLICY}, {write_workers}",
                "disk_read_cold": f"{read_kind} of the store's own chunk files into the same DRAM slots, {read_workers}"
                                  + ("" if self._cold_residue == 0 else f"; WARNING: {_cold_check(self._cold_residue)}"),
            },
        }


def _cold_check(residue: int | None, files: list[str] | None = None) -> str:
    """What the page-cache check before a cold read found, in words (``residue``: bytes
    still cached after fsync + POSIX_FADV_DONTNEED, None when mincore is unavailable).

    ``residue`` counts whole pages (mincore), so the files' total is page-rounded too:
    the residue never exceeds it."""
    if residue is None:
        return "not verified cold: mincore unavailable, the files may still have been in the page cache"
    of = f" of {sum(_page_rounded(p) for p in files)} page-rounded" if files is not None else ""
    if residue == 0:
        return f"verified cold: 0{of} bytes in the page cache after fsync + POSIX_FADV_DONTNEED (mincore)"
    return f"NOT cold: {residue}{of} bytes stayed in the page cache after fsync + POSIX_FADV_DONTNEED (mincore)"


def _page_rounded(path: str) -> int:
    """The size of ``path`` rounded up to whole pages (0 if it vanished)."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return 0
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
