"""Opening and checking the media of a live store's tiers, and making their policies."""

from __future__ import annotations

import contextlib
import math
import os
import weakref
import warnings
from pathlib import Path
from typing import Sequence

import psutil
import torch

from tiercache.config import Codec, KVLayout, RemoteWrite, TierConfig
from tiercache.data.buffers import normal_tensors
from tiercache.data.codec_base import INT8_LIMIT, SCALED_LIMIT
from tiercache.data.nvme import NVMeStore
from tiercache.data.nvme_open import check_path, store_exists
from tiercache.data.nvme_table import TABLE_SLOT_BYTES
from tiercache.data.pools import HEADER_ROOM, BlockPool, cuda_available, dram_pool, hbm_pool
from tiercache.data.quantized import QuantizedPool  # registers its copy handlers
from tiercache.data.remote import RemoteStore
from tiercache.errors import UserError
from tiercache.policies import get_eviction, make_admission, make_eviction
from tiercache.policies.base import AdmissionPolicy, EvictionPolicy

from .remote import lossy_codec, remote_admission

__all__ = ["manager_readers", "check_layout", "check_tiers", "check_codec_mix", "check_remote_write", "check_online", "make_policies", "resolve_device",
           "check_host_memory", "open_medium", "open_media", "close_quietly", "value_limit"]

_ORDER = ("hbm", "dram", "nvme", "remote")
#: Codec pairs with no fixed point between them: a block moving between their tiers is
#: re-encoded by each from the other's decoded values (FP8's one scale per block half shifts
#: INT4's group ranges and back), and its error against the block put grows without bound once
#: the lower tier is full (no retained copy). Measured over 300 round trips, fp16 and bf16, 8
#: blocks each: FP8 and INT4 either way round reach 7.6-10.8x the worse codec's own error and are
#: still growing; INT8 with FP8 or INT4, either way round, settles at 1.00-1.04x from the first.
UNSETTLED_CODECS = (frozenset({Codec.FP8, Codec.INT4}),)


def check_layout(layout: object) -> None:
    """Raises UserError unless ``layout`` is a ``KVLayout``."""
    if not isinstance(layout, KVLayout):
        raise UserError(f"TieredKVStore: layout must be a KVLayout (see tiercache.config.layout_preset), got {type(layout).__name__}")


def check_tiers(tiers: Sequence[TierConfig], path, layout: KVLayout) -> None:
    """Tiers must be ``hbm[, dram][, nvme][, remote]`` in that order; NVMe needs a directory
    (``path``: a str or PathLike of one, without a NUL byte: ``check_path``); a
    quantised tier needs a layout dtype its codec takes (``Codec.check_layout``) and codecs
    whose re-encodes of each other settle (``check_codec_mix``).

    Raises:
        UserError: naming what is wrong.
    """
    if not isinstance(tiers, (list, tuple)) or not all(isinstance(t, TierConfig) for t in tiers):
        raise UserError("TieredKVStore: tiers must be a list of TierConfig, fastest first")
    names = [t.name for t in tiers]
    if not tiers or names[0] != "hbm" or any(n not in _ORDER for n in names) \
            or names != sorted(names, key=_ORDER.index) or len(set(names)) != len(names):
        raise UserError(f"TieredKVStore: tiers must be hbm[, dram][, nvme][, remote] in that order, got {names}")
    if "nvme" in names and path is None:
        raise UserError("TieredKVStore: an nvme tier needs path= (the store directory)")
    if path is not None:
        _check_store_path(Path(check_path(path, "TieredKVStore")))
    for tier in tiers:
        tier.codec.check_layout(layout, f"TieredKVStore: tier {tier.name}")
    check_codec_mix(tiers)
    if path is not None and "nvme" not in names:  # once the hierarchy is known good
        warnings.warn(f"TieredKVStore: path={str(path)!r} is given but no tier is nvme: nothing is stored there "
                      "(blocks live in memory only and are gone at close)", UserWarning, stacklevel=3)


def check_codec_mix(tiers: Sequence[TierConfig]) -> None:
    """Refuses a hierarchy holding both codecs of an ``UNSETTLED_CODECS`` pair, at any
    distance (a plain tier between them passes the decoded values on as they are).

    Raises:
        UserError: naming the tiers of each codec.
    """
    codecs = [t.codec for t in tiers]
    for pair in UNSETTLED_CODECS:
        if pair <= set(codecs):
            upper, lower = sorted(pair, key=codecs.index)  # in tier order
            named = {c: f"{', '.join(t.name for t in tiers if t.codec is c)} ({c.value})" for c in pair}
            raise UserError(f"TieredKVStore: tiers {named[upper]} and {named[lower]}: a block moving between them is "
                            "re-encoded by each codec from the other's decoded values, and its error grows without bound; "
                            "keep one codec family (int8 mixes with either), or store one side plain")


def check_remote_write(tiers: Sequence[TierConfig], write_through: bool) -> None:
    """``remote_write=back`` needs an exclusive hierarchy: write-through drops victims
    instead of demoting them, so nothing would ever be written back. The remote tier's
    values are plain blocks, shared with other processes, and it exchanges blocks with the
    memory tiers directly: those must be plain (an NVMe tier may be quantised)."""
    remote = tiers[-1].remote if tiers else None
    quantised = [t.name for t in tiers if t.name in ("hbm", "dram") and t.codec is not Codec.NONE]
    if remote is not None and quantised:
        raise UserError(f"TieredKVStore: with a remote tier the memory tiers must be plain (its values are plain blocks "
                        f"shared with other processes); {' and '.join(quantised)} is quantised: quantise the nvme tier instead")
    if remote is not None and write_through and remote.write is RemoteWrite.BACK:
        raise UserError("TieredKVStore: remote write 'back' needs the exclusive hierarchy (write_through=False); "
                        "use RemoteWrite.THROUGH or SELECTIVE with write_through=True")


def _check_store_path(path: Path) -> None:
    """The store directory (or the first existing folder above it) must be a directory."""
    if path.is_file():
        raise UserError(f"TieredKVStore: store path {os.fspath(path)!r} is a file")
    blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UserError(f"TieredKVStore: store path {os.fspath(path)!r} lies under {os.fspath(blocking)!r}, which is a file")


def resolve_device(device: object) -> torch.device:
    """The HBM tier's device: CUDA when available by default, else the CPU; CUDA always with
    its index (``cuda`` is the current device), as the tensors on it report their device.

    Raises:
        UserError: an unparsable device, a device other than ``cpu``/``cuda`` (``meta``
            tensors hold no data), or CUDA asked for where there is none.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UserError(f"TieredKVStore: device {device!r} is not a device ({str(exc).splitlines()[0]})") from None
    if parsed.type not in ("cpu", "cuda"):
        raise UserError(f"TieredKVStore: device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"TieredKVStore: device {device!r} asked for, but CUDA is not available here")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise UserError(f"TieredKVStore: device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
    if parsed.type == "cuda" and parsed.index is None:  # as a tensor reports it: cuda != cuda:0
        parsed = torch.device("cuda", torch.cuda.current_device())
    return parsed


def check_host_memory(layout: KVLayout, tiers: Sequence[TierConfig], device: torch.device) -> None:
    """Refuses host pools (DRAM, and HBM on the CPU) larger than the memory available now,
    instead of failing deep in the allocator or being killed later for overcommitting."""
    host = [t for t in tiers if t.name == "dram" or (t.name == "hbm" and device.type == "cpu")]
    wanted = sum(t.capacity_blocks * t.codec.block_bytes(layout) for t in host)  # a quantised tier's real bytes
    available = psutil.virtual_memory().available
    if wanted > available:
        names = "+".join(t.name for t in host)
        raise UserError(f"TieredKVStore: {names} need {wanted / 2**30:.1f} GiB of host memory, "
                        f"{available / 2**30:.1f} GiB available; lower their capacity")


def check_online(eviction: str | None, tiers: Sequence[TierConfig]) -> None:
    """A live store cannot know the future: offline policies (Belady) are refused."""
    for name in {eviction} if eviction else {t.eviction for t in tiers}:
        if get_eviction(name).needs_future:
            raise UserError(f"TieredKVStore: eviction policy {name!r} needs the future (offline only); use it in tiercache replay")


def make_policies(tiers: Sequence[TierConfig], eviction: str | None, admission: str | None,
                  hits: dict[int, int]) -> tuple[list[EvictionPolicy], list[AdmissionPolicy]]:
    """Every tier's eviction and admission policy: ``eviction``/``admission`` when given, else
    the tier's own; the top tier admits everything, a remote tier as its write policy says
    (``remote_admission``, counting in ``hits``). Made before any medium opens, so an
    unknown name (``PolicyError``) leaves nothing to close."""
    evictions = [make_eviction(eviction or t.eviction, t.capacity_blocks, i) for i, t in enumerate(tiers)]
    admissions = [make_admission("always")] + [make_admission(admission or t.admission) for t in tiers[1:]]
    if tiers[-1].remote is not None:
        admissions[-1] = remote_admission(tiers[-1].remote, hits)
    return evictions, admissions


def open_media(tiers: Sequence[TierConfig], layout: KVLayout, path, device) -> list:
    """The media of every tier (``open_medium``); above a remote tier, host pools keep
    ``HEADER_ROOM`` before each slot, so a remote value's header and block move as one buffer.
    If one fails to open, those opened before it are closed (``close_quietly``) first. Every
    tensor they make is a normal tensor, even in a store built under ``torch.inference_mode()``
    (``normal_tensors``): the store is then usable in and out of inference mode."""
    room = HEADER_ROOM if tiers[-1].remote is not None else 0
    media: list = []
    try:
        with normal_tensors():
            for tier in tiers:
                media.append(open_medium(tier, layout, path, device, room, lossy_codec(tiers)))
    except BaseException:
        close_quietly(media)
        raise
    return media


def close_quietly(media: Sequence[object]) -> None:
    """Closes every medium of a store whose construction failed (an NVMe store's lock and I/O
    threads are released), ignoring their errors: the error to report is the one that
    stopped the constructor."""
    for medium in media:
        with contextlib.suppress(Exception):
            medium.close()


def open_medium(tier: TierConfig, layout: KVLayout, path, device,
                header_room: int = 0, remote_codec: Codec = Codec.NONE) -> BlockPool | QuantizedPool | NVMeStore | RemoteStore:
    """The medium of one tier: a GPU (or CPU) pool, a pinned host pool (a ``QuantizedPool``
    on its device, HBM or host, with a codec), an NVMe store (encoding with the tier's codec), or a Mooncake Store
    client (which never fails to open: an unreachable master is retried).

    Raises:
        UserError: the pool could not be allocated, or the store directory not opened
            (permissions, a read-only mount): the message names the tier and the reason.
    """
    try:
        if tier.name == "hbm" and tier.codec is not Codec.NONE:
            return QuantizedPool(layout, tier.capacity_blocks, tier.codec, pin_memory=False,
                                 device=device if device is not None else ("cuda" if cuda_available() else "cpu"))
        if tier.name == "hbm":
            return hbm_pool(layout, tier.capacity_blocks, device, header_room)
        if tier.name == "dram":
            return dram_pool(layout, tier.capacity_blocks, header_room) if tier.codec is Codec.NONE else _quantized_pool(tier, layout)
        if tier.name == "remote":
            return RemoteStore(tier.remote, layout, codec=remote_codec)
        return _open_nvme(tier, layout, path)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename is not None and str(exc.filename) != os.fspath(path) else ""
        raise UserError(f"TieredKVStore: cannot open the {tier.name} tier at {os.fspath(path)!r}: "
                        f"{exc.strerror or exc}{where}") from None
    except (MemoryError, torch.cuda.OutOfMemoryError) as exc:
        if tier.name == "nvme":  # its blocks are on disk: what failed is its index in memory
            slots = tier.capacity_blocks + spare_slots(tier.capacity_blocks)
            raise UserError(f"TieredKVStore: cannot allocate the nvme tier's index of {slots:,} slots "
                            f"({slots * TABLE_SLOT_BYTES / 2**30:.1f} GiB of memory): {type(exc).__name__}") from None
        need = tier.capacity_blocks * tier.codec.block_bytes(layout) / 2**30
        raise UserError(f"TieredKVStore: cannot allocate the {tier.name} tier ({need:.1f} GiB): {type(exc).__name__}") from None


def _quantized_pool(tier: TierConfig, layout: KVLayout) -> QuantizedPool:
    """A DRAM tier holding blocks encoded with ``tier.codec``."""
    return QuantizedPool(layout, tier.capacity_blocks, tier.codec)


def spare_slots(capacity_blocks: int) -> int:
    """Physical NVMe slots beyond the tier's capacity: room for blocks whose deletion is not
    durable yet, so the store flushes once per ``spare`` evictions rather than once each."""
    return max(8, capacity_blocks // 8)


def _open_nvme(tier: TierConfig, layout: KVLayout, path) -> NVMeStore:
    """Opens (or creates with spare slots) the NVMe store of a tier of ``capacity`` blocks.

    Raises:
        UserError: an existing store with fewer slots than the tier's capacity.
    """
    exists = store_exists(os.fspath(path))  # an unfinished creation is created anew at the tier's capacity
    try:
        store = NVMeStore(path, layout, None if exists else tier.capacity_blocks + spare_slots(tier.capacity_blocks),
                          codec=tier.codec)
    except UserError:
        if exists or store_exists(os.fspath(path)) is False:
            raise
        # a store after all (another process created it meanwhile, or its folder could not be listed): its capacity
        store = NVMeStore(path, layout, None, codec=tier.codec)
    if store.capacity < tier.capacity_blocks:
        store.close()
        raise UserError(f"TieredKVStore: the NVMe store at {os.fspath(path)!r} has {store.capacity} slots, "
                        f"fewer than the nvme tier's {tier.capacity_blocks}")
    return store


def value_limit(tiers: Sequence[TierConfig]) -> float | None:
    """The largest |x| a block may hold in this hierarchy: None without a quantised tier, else
    the lowest bound of its codecs (fp16 scales: ``codec_base.SCALED_LIMIT`` for INT4,
    ``codec_base.INT8_LIMIT`` for INT8; FP8's scales are fp32: any finite value)."""
    codecs = {t.codec for t in tiers} - {Codec.NONE}
    if not codecs:
        return None
    return min(_CODEC_LIMITS.get(codec, math.inf) for codec in codecs)


_CODEC_LIMITS = {Codec.INT4: SCALED_LIMIT, Codec.INT8: INT8_LIMIT}


def manager_readers(manager) -> tuple:
    """``(locate, free)`` for ``LocalEngine.retain_moved_up``: where a block is held and a
    tier's free slots, reading ``manager`` through a weak reference. The engine is the
    manager's and the store's: strong references back would make a cycle, and a store
    dropped without ``close`` would keep its lock, journal and I/O threads until the cycle
    collector ran (a reopen of its path refused until then), where it should release them
    as soon as it is dropped."""
    ref = weakref.ref(manager)
    return (lambda block_id: ref().locate(block_id)), (lambda tier: ref().dirs[tier].n_free)
