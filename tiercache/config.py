"""Frozen, validated configuration: KV layout, tiers, model presets.

Everything here is metadata-plane: plain Python and numpy, never torch. Sizes may be
given as integers (bytes) or human strings with a byte unit, ``"8GiB"`` / ``"512MB"``;
capacities may be given in blocks (``4096``, ``4k`` = 4,000) or as such sizes, which need a
layout to turn into blocks. The two spellings never overlap: a suffix without ``B``
counts blocks, a byte size always ends in ``B``, and anything else (``4Ki``) is refused.
"""

from __future__ import annotations

import enum
import functools
import math
import numbers
from dataclasses import dataclass, replace

from .errors import ConfigError
from .remote_config import RemoteConfig, RemoteWrite
from .sizes import SPELLINGS, Capacity, parse_capacity, parse_size

__all__ = [
    "ConfigError", "Route", "DTYPE_BYTES", "KVLayout", "TierConfig", "CacheConfig", "check_tier_names",
    "MODEL_PRESETS", "layout_preset", "parse_size", "parse_capacity", "Capacity", "SPELLINGS", "parse_tiers",
    "parse_layout", "split_items", "TIER_NAMES", "Semantics", "Mode", "TraceKind", "REQUEST_SEMANTICS_NAMES",
    "Codec", "RemoteWrite", "RemoteConfig", "REMOTE_TIER", "codec_group", "AttentionMode"
]

TIER_NAMES = ("hbm", "dram", "nvme")
#: The shared tier behind the local ones (live store only; Mooncake Store).
REMOTE_TIER = "remote"

DTYPE_BYTES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
#: Layout dtypes a quantised tier stores (``data.codec_base.FLOAT_DTYPES`` by name; a test keeps them equal).
CODEC_DTYPES = ("float16", "bfloat16", "float32")
#: The widest head a codec stores: it records the key channels it keeps exact or refines as int16.
CODEC_MAX_HEAD_DIM = 32768

class Semantics(enum.Enum):
    """How a trace is replayed.

    ``OBJECT``: request trace as a flat stream of independent block ids (comparable with
    libCacheSim). ``PREFIX``: a request uses its longest cached prefix; blocks after the first
    miss are recomputed. ``DECODE``: a step trace; reads are accesses, writes new blocks.
    """

    OBJECT = "object"
    PREFIX = "prefix"
    DECODE = "decode"

    @classmethod
    def parse(cls, text: str, option: str = "--semantics") -> "Semantics":
        """The request-trace semantics named by ``text`` (``"object"`` or ``"prefix"``).

        ``DECODE`` is not chosen by name: it is how every step trace replays.

        Raises:
            UserError: unknown name; the message names ``option`` and lists the known ones.
        """
        name = text.strip().lower()
        if name not in REQUEST_SEMANTICS_NAMES:
            raise ConfigError(f"{option}: unknown {text!r}; known: {', '.join(REQUEST_SEMANTICS_NAMES)}")
        return cls(name)


#: The semantics a request trace can be replayed in, as the CLI spells them.
REQUEST_SEMANTICS_NAMES = (Semantics.OBJECT.value, Semantics.PREFIX.value)


class AttentionMode(enum.Enum):
    """How ``Sequence.attend`` reads a layer's KV.

    ``EXACT``: every block, streamed chunk by chunk through a bounded window and merged by
    log-sum-exp; equal to dense attention. ``SPARSE``: only the blocks whose key summaries
    (per-channel min/max, Quest) bound the highest scores, plus the sink and recent blocks,
    up to a budget.
    """

    EXACT = "exact"
    SPARSE = "sparse"


class Codec(enum.Enum):
    """How a tier stores the bytes of a block: as given, or quantised.

    ``NONE`` keeps the layout's dtype. ``INT8``: keys per channel, values per token (KIVI).
    ``FP8``: e4m3 with one scale per block half, the 4 largest key channels kept exact.
    ``INT4``: groups of 64, two codes a byte.
    The codecs themselves are data-plane (``tiercache.data.codecs``); this is only the name.
    """

    NONE = "none"
    INT8 = "int8"
    FP8 = "fp8"
    INT4 = "int4"

    @classmethod
    def parse(cls, text: str, option: str = "--codec") -> "Codec":
        """The codec named by ``text`` (case-insensitive).

        Raises:
            ConfigError: unknown name; the message names ``option`` and lists the known ones.
        """
        name = text.strip().lower()
        known = [c.value for c in cls]
        if name not in known:
            raise ConfigError(f"{option}: unknown codec {text!r}; known: {', '.join(known)}")
        return cls(name)

    def check_layout(self, layout: "KVLayout | None", where: str) -> None:
        """Raises ConfigError naming ``where`` if this codec cannot store ``layout``'s dtype
        (``CODEC_DTYPES``; plain: any), or would store its blocks in no fewer bytes than plain:
        a prime ``block_tokens`` or ``head_dim`` above 64 makes groups of one value, each with
        its own scale (``codec_group``), and such a "quantised" tier would hold fewer blocks."""
        if layout is None or self is Codec.NONE:
            return
        self.check_head_dim(layout.head_dim, where)
        if layout.dtype not in CODEC_DTYPES:
            raise ConfigError(f"{where}: codec {self.value} cannot store layout dtype {layout.dtype!r}: the codecs take "
                              "float16, bfloat16 or float32 blocks; keep the tier plain or use one of those dtypes")
        encoded, plain = self.block_bytes(layout), layout.block_bytes
        if encoded >= plain:
            why, fix = self._overhead(layout)
            raise ConfigError(f"{where}: codec {self.value} would store a block of layout {layout.name} (block_tokens="
                              f"{layout.block_tokens}, head_dim={layout.head_dim}, {layout.dtype}) in {encoded:,} bytes, not "
                              f"fewer than its {plain:,} plain bytes ({why}): the tier would hold fewer blocks than a plain "
                              f"one; keep it plain, or use {fix}")

    def check_head_dim(self, head_dim: int, where: str) -> None:
        """Raises ConfigError naming ``where`` for heads wider than ``CODEC_MAX_HEAD_DIM``
        (the codecs record key channel ids as int16); plain: any."""
        if self is not Codec.NONE and head_dim > CODEC_MAX_HEAD_DIM:
            raise ConfigError(f"{where}: codec {self.value} cannot store head_dim {head_dim}: the codecs take heads of "
                              f"at most {CODEC_MAX_HEAD_DIM} channels; keep the tier plain")

    def _overhead(self, layout: "KVLayout") -> tuple[str, str]:
        """What makes this codec's blocks of ``layout`` large, and the layout that avoids it
        (``check_layout``'s message)."""
        if self is Codec.FP8:
            kept = min(FP8_OUTLIER_CHANNELS, layout.head_dim)
            return (f"FP8 keeps {kept} key channels of each head exact, of head_dim {layout.head_dim}",
                    "a larger head_dim")
        k_group = codec_group(layout.block_tokens, INT8_K_GROUP if self is Codec.INT8 else CODEC_GROUP)
        sizes = [f"{'one value' if g == 1 else f'{g} values'} along {name}" for name, g in
                 (("block_tokens", k_group), ("head_dim", codec_group(layout.head_dim)))]
        return (f"K groups of {sizes[0]}, V groups of {sizes[1]}, each group with its own scale",
                "a block_tokens and head_dim with a divisor near 64 (a multiple of 16, say)")

    def block_bytes(self, layout: "KVLayout") -> int:
        """Exact bytes of one block of ``layout`` stored with this codec, scales included.

        Plain arithmetic (the metadata plane sizes tiers with it); ``tiercache.data.codecs``
        builds the same parts as tensors and a test checks that the two agree.
        """
        if self is Codec.NONE:
            return layout.block_bytes
        lead, heads, tokens, dim = layout.block_layers, layout.kv_heads, layout.block_tokens, layout.head_dim
        elements = 2 * lead * heads * tokens * dim
        k_groups = lead * heads * (tokens // codec_group(tokens)) * dim  # K: along tokens, per channel
        v_groups = lead * heads * tokens * (dim // codec_group(dim))  # V: along head_dim, per token
        if self is Codec.INT8:  # int8 codes, fp16 scales (K per channel over up to 256 tokens),
            k_scales = lead * heads * (tokens // codec_group(tokens, INT8_K_GROUP)) * dim
            outliers = min(KEY_OUTLIER_CHANNELS, dim)  # an int8 residual per outlier key value, int16 channel ids
            return elements + 2 * (k_scales + v_groups) + lead * heads * outliers * (tokens + 2)
        if self is Codec.INT4:  # two codes a byte, fp16 scale + uint8 zero; outlier key channels: a nibble each
            outliers = min(KEY_OUTLIER_CHANNELS, dim)
            return (elements + 1) // 2 + 3 * (k_groups + v_groups) + (lead * heads * tokens * outliers + 1) // 2 + 2 * lead * heads * outliers
        outliers = min(KEY_OUTLIER_CHANNELS, dim)  # FP8: e4m3 codes, fp32 scale per half, exact key channels
        return elements + 8 * lead + lead * heads * outliers * (tokens * layout.dtype_bytes + 2)


#: Group size cap of the INT8 and INT4 codecs (the issue's groups of 64).
CODEC_GROUP = 64
#: Token group cap of INT8's key scales: one scale per channel over a whole 256-token block.
INT8_K_GROUP = 256
#: Key channels per (layer, head) that FP8 keeps exact and INT8 refines to ~15 bits.
KEY_OUTLIER_CHANNELS = 4
FP8_OUTLIER_CHANNELS = KEY_OUTLIER_CHANNELS
#: On-disk format of each codec's blocks (a store records it; another is refused on open).
CODEC_FORMATS = {"none": 1, "int8": 2, "fp8": 1, "int4": 2}


@functools.lru_cache(maxsize=256)
def codec_group(n: int, cap: int = CODEC_GROUP) -> int:
    """The codecs' group size along a dim of ``n``: its largest divisor up to ``cap``
    (cached: every encode asks for the same few)."""
    return max(g for g in range(1, min(n, cap) + 1) if n % g == 0)


class Mode(enum.Enum):
    """The hierarchy a run used: one tier, exclusive tiers, or write-through (inclusive)."""

    SINGLE = "single"
    EXCLUSIVE = "exclusive"
    WRITE_THROUGH = "write_through"


class Route(enum.Enum):
    """How a fleet replay spreads requests over its engine instances."""

    ROUND_ROBIN = "round_robin"  # request i to instance i % N
    PREFIX_AFFINITY = "prefix_affinity"  # by a stable hash of the first block: shared prefixes meet
    KV_AWARE = "kv_aware"  # to the longest cached prefix, load permitting (tiercache.sim.router)


class TraceKind(enum.Enum):
    """The two JSONL trace formats tiercache reads."""

    REQUESTS = "requests"  # Mooncake request trace (tiercache.sim.traces)
    STEPS = "steps"  # decode step trace (tiercache.sim.steptrace)


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache and of one block.

    Invariants: every field positive; ``dtype`` is one of ``DTYPE_BYTES``. A block holds
    ``block_tokens`` tokens of one sequence across all ``layers`` when ``per_layer`` is False,
    or of one layer when it is True (the unit that allows layer-ahead prefetch). ``params``
    is the model's parameter count and ``heads`` its query heads (None when unknown): they
    give its prefill FLOPs, weights and attention (``tiercache.sim.prefill``).
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_tokens: int = 256
    per_layer: bool = False
    name: str = "custom"
    params: int | None = None
    heads: int | None = None

    def __post_init__(self) -> None:
        for attr in ("layers", "kv_heads", "head_dim", "block_tokens", "params", "heads"):
            value = getattr(self, attr)
            if attr in ("params", "heads") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ConfigError(f"KVLayout.{attr}: must be a positive integer, got {value!r}")
            object.__setattr__(self, attr, int(value))  # a numpy integer is kept as Python's (JSON, equality)
        if self.heads is not None and self.heads % self.kv_heads:  # each KV head serves heads / kv_heads query heads
            raise ConfigError(f"KVLayout.heads: query heads must be a multiple of kv_heads, got heads={self.heads} "
                              f"with kv_heads={self.kv_heads}")
        if type(self.dtype).__module__ == "torch":  # torch.float16 names "float16", as kv_layout takes it
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"KVLayout.dtype: unknown dtype {self.dtype!r} (a name, or a torch dtype); known: "
                              f"{', '.join(DTYPE_BYTES)}")
        if not isinstance(self.per_layer, bool):
            raise ConfigError(f"KVLayout.per_layer: must be True or False, got {self.per_layer!r}")
        if not isinstance(self.name, str):
            raise ConfigError(f"KVLayout.name: must be a str, got {self.name!r}")

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_layers(self) -> int:
        """Layers held by one block (1 when per_layer)."""
        return 1 if self.per_layer else self.layers

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block's tensor: ``[layers, 2, kv_heads, block_tokens, head_dim]``."""
        return (self.block_layers, 2, self.kv_heads, self.block_tokens, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block."""
        return 2 * self.block_layers * self.kv_heads * self.block_tokens * self.head_dim * self.dtype_bytes

    def with_block_tokens(self, block_tokens: int) -> "KVLayout":
        """The same layout with another block size."""
        return replace(self, block_tokens=block_tokens)


# Parameter counts (embeddings and LM head included; weight FLOPs per token are about 2 x params)
# and query heads (num_attention_heads; attention FLOPs) from each model's public config.
MODEL_PRESETS: dict[str, KVLayout] = {
    "llama-3-8b": KVLayout(layers=32, kv_heads=8, head_dim=128, name="llama-3-8b", params=8_030_261_248, heads=32),
    "llama-3-70b": KVLayout(layers=80, kv_heads=8, head_dim=128, name="llama-3-70b", params=70_553_706_496, heads=64),
    "llama-3.1-8b": KVLayout(layers=32, kv_heads=8, head_dim=128, name="llama-3.1-8b", params=8_030_261_248, heads=32),
    "qwen2.5-7b": KVLayout(layers=28, kv_heads=4, head_dim=128, name="qwen2.5-7b", params=7_615_616_512, heads=28),
    "qwen2.5-72b": KVLayout(layers=80, kv_heads=8, head_dim=128, name="qwen2.5-72b", params=72_706_203_648, heads=64),
    "mistral-7b": KVLayout(layers=32, kv_heads=8, head_dim=128, name="mistral-7b", params=7_241_732_096, heads=32),
}


def layout_preset(name: str, block_tokens: int | None = None) -> KVLayout:
    """Returns the layout of a model preset, optionally with another block size.

    Raises:
        ConfigError: unknown preset; the message lists the known ones.
    """
    key = name.strip().lower()
    if key not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known: {', '.join(sorted(MODEL_PRESETS))}")
    layout = MODEL_PRESETS[key]
    return layout if block_tokens is None else layout.with_block_tokens(block_tokens)


@dataclass(frozen=True)
class TierConfig:
    """One tier: its name, capacity in blocks, and the policies that run it.

    Invariants: ``name`` in ``TIER_NAMES`` or ``REMOTE_TIER``; ``capacity_blocks >= 1``;
    ``codec`` is how the tier stores a block (``Codec.NONE``: as given; a quantised tier
    holds ``codec.block_bytes(layout)`` bytes per block); ``remote`` (how to reach the
    store, when to write) is set exactly for the remote tier, whose capacity is how many
    remote blocks this process keeps track of (its view).
    """

    name: str
    capacity_blocks: int
    eviction: str = "lru"
    admission: str = "always"
    codec: Codec = Codec.NONE
    remote: RemoteConfig | None = None

    def __post_init__(self) -> None:
        if self.name not in TIER_NAMES + (REMOTE_TIER,):
            raise ConfigError(f"tier name {self.name!r}: must be one of {', '.join(TIER_NAMES + (REMOTE_TIER,))}")
        if (self.name == REMOTE_TIER) != (self.remote is not None):
            raise ConfigError(f"tier {self.name}: remote=RemoteConfig(...) is given with the remote tier, and only with it")
        if self.remote is not None and not isinstance(self.remote, RemoteConfig):
            raise ConfigError(f"tier {self.name}: remote must be a RemoteConfig, got {type(self.remote).__name__}")
        if isinstance(self.capacity_blocks, bool) or not isinstance(self.capacity_blocks, numbers.Integral):
            raise ConfigError(f"tier {self.name}: capacity must be an integer number of blocks, got "
                              f"{self.capacity_blocks!r} ({type(self.capacity_blocks).__name__})")
        object.__setattr__(self, "capacity_blocks", int(self.capacity_blocks))  # a numpy integer as Python's
        if self.capacity_blocks < 1:
            raise ConfigError(f"tier {self.name}: capacity must be at least one block, got {self.capacity_blocks!r}")
        object.__setattr__(self, "codec", Codec.NONE if self.codec is None else self.codec)  # None: no codec, as "none"
        if isinstance(self.codec, str):
            object.__setattr__(self, "codec", Codec.parse(self.codec, f"tier {self.name} codec"))
        if not isinstance(self.codec, Codec):
            raise ConfigError(f"tier {self.name}: codec must be a Codec or its name, got {self.codec!r}")
        if self.name == REMOTE_TIER and self.codec is not Codec.NONE:
            raise ConfigError(f"tier {self.name}: its values are plain blocks shared with other processes; "
                              f"codec {self.codec.value} is not supported there")


def check_tier_names(tiers: tuple["TierConfig", ...], where: str) -> None:
    """Refuses a hierarchy that is empty, repeats a tier or is not ordered fastest first.

    Raises:
        ConfigError: names ``where`` (``"CacheConfig"``, ``"RunSpec.tiers"``) and the tiers.
    """
    names = [t.name for t in tiers]
    order = [TIER_NAMES.index(n) if n in TIER_NAMES else len(TIER_NAMES) for n in names]
    if not tiers or len(set(names)) != len(names) or order != sorted(order):
        why = ("at least one tier is needed" if not tiers else f"tier names repeat: {names}" if len(set(names)) != len(names)
               else f"tiers must be ordered fastest first (hbm, dram, nvme), got {names}")
        raise ConfigError(f"{where}: {why}")


@dataclass(frozen=True)
class CacheConfig:
    """A whole hierarchy: tiers ordered fastest first, and the inclusion mode.

    Invariants: at least one tier; names unique and in the order hbm, dram, nvme.
    ``write_through`` False is the exclusive hierarchy (a block lives in exactly one tier);
    True keeps a copy in every lower tier it was written to (inclusive).
    """

    tiers: tuple[TierConfig, ...]
    write_through: bool = False
    layout: KVLayout | None = None

    def __post_init__(self) -> None:
        check_tier_names(self.tiers, "CacheConfig")

    @property
    def capacity_blocks(self) -> int:
        """Total capacity over all tiers."""
        return sum(t.capacity_blocks for t in self.tiers)


def parse_tiers(spec: str, layout: KVLayout | None, eviction: str = "lru", admission: str = "always") -> tuple[TierConfig, ...]:
    """Parses ``"hbm=4096,dram=16GiB,nvme=1TiB:int4"`` into tier configs.

    ``:codec`` after a capacity stores that tier's blocks with the codec (``none``, ``int8``,
    ``fp8``, ``int4``); a byte size then counts blocks of the codec's size. Names and codecs are
    case-insensitive (``HBM`` is hbm). The tiers are validated as a ``CacheConfig`` would be:
    names unique and ordered fastest first (hbm, dram, nvme).

    Raises:
        ConfigError: empty spec or empty item (``hbm=2,,dram=2``), unknown or repeated tier,
            wrong order, missing ``=``, a bad capacity, an unknown or empty codec (``hbm=2:``)
            or one that cannot store ``layout``'s dtype; the message names ``--tiers``.
    """
    tiers = []
    for part in split_items(spec, "--tiers") if spec.strip() else []:
        if "=" not in part:
            raise ConfigError(f"--tiers: {part!r} should look like name=capacity[:codec] (e.g. hbm=4096, nvme=1TiB:int4)")
        given, value = (s.strip() for s in part.split("=", 1))
        if (name := given.lower()) not in TIER_NAMES:
            raise ConfigError(f"--tiers: unknown tier {given!r}; known: {', '.join(TIER_NAMES)}; remote=CAP last for a fleet replay")
        cap, colon, codec_name = (s.strip() for s in value.partition(":"))
        if colon and not codec_name:
            raise ConfigError(f"--tiers {name}: {value!r} has an empty codec after ':'; give one of "
                              f"{', '.join(c.value for c in Codec)}, or leave out the ':'")
        codec = Codec.parse(codec_name, f"--tiers {name}") if codec_name else Codec.NONE
        codec.check_layout(layout, f"--tiers {name}")
        tiers.append(TierConfig(name, parse_capacity(cap, layout, f"--tiers {name}", codec), eviction, admission, codec))
    if not tiers:
        raise ConfigError("--tiers: no tier given (e.g. hbm=4096,dram=16384)")
    try:
        CacheConfig(tuple(tiers))
    except ConfigError as exc:
        raise ConfigError(f"--tiers {spec!r}: {str(exc).removeprefix('CacheConfig: ')}") from None
    return tuple(tiers)


def split_items(text: str, option: str) -> list[str]:
    """The items of a comma list, stripped; an empty item (``"4,,5"``, ``"lru,"``) is refused.

    Raises:
        ConfigError: the list or one of its items is empty; the message names ``option``.
    """
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise ConfigError(f"{option}: empty list")
    if not all(items):
        raise ConfigError(f"{option} {text!r}: empty item in the comma list")
    return items


def _parameter_count(raw: str) -> int:
    """A parameter count as given to ``--layout params=``: an integer or a number in
    e-notation (``70553706496``, ``70.55e9``), rounded to a whole count."""
    try:
        return int(raw)
    except ValueError:
        number = float(raw)  # ValueError: not a number
        if not math.isfinite(number) or number < 1:
            raise ValueError(raw) from None
        return round(number)


_LAYOUT_FIELDS = {"layers": int, "kv_heads": int, "head_dim": int, "dtype": str, "block_tokens": int,
                  "params": _parameter_count, "heads": int}


def parse_layout(spec: str, block_tokens: int | None = None) -> KVLayout:
    """Parses ``"layers=32,kv_heads=8,head_dim=128[,dtype=bfloat16][,block_tokens=256][,params=8.03e9][,heads=32]"``.

    ``params`` is the model's parameter count (without it, prefill is charged the reference
    model's weight FLOPs) and ``heads`` its query heads (without it, prefill has no attention
    term): see ``tiercache.sim.prefill``.
    A model preset name is accepted too. ``block_tokens``, when given, is the trace's block
    size: the layout takes it, and a spec that names another is refused (never silently
    replaced).

    Raises:
        ConfigError: unknown, repeated or missing key, an empty item, a non-integer where
            one is needed, or a ``block_tokens=`` other than ``block_tokens``.
    """
    if "=" not in spec:
        return layout_preset(spec, block_tokens)
    values: dict = {}
    for part in split_items(spec, "--layout"):
        key, _, raw = (s.strip() for s in part.partition("="))
        if key not in _LAYOUT_FIELDS:
            raise ConfigError(f"--layout: unknown key {key!r}; known: {', '.join(_LAYOUT_FIELDS)}")
        if key in values:
            raise ConfigError(f"--layout: {key} given twice ({key}={values[key]} and {key}={raw}); give it once")
        try:
            values[key] = _LAYOUT_FIELDS[key](raw)
        except ValueError:
            kind = "a parameter count (e.g. 8030261248 or 8.03e9)" if key == "params" else "an integer"
            raise ConfigError(f"--layout: {key}={raw!r} is not {kind}") from None
    missing = [k for k in ("layers", "kv_heads", "head_dim") if k not in values]
    if missing:
        raise ConfigError(f"--layout: missing {', '.join(missing)}")
    if block_tokens is not None:
        if values.setdefault("block_tokens", block_tokens) != block_tokens:
            raise ConfigError(f"--layout: block_tokens={values['block_tokens']}, but the trace's blocks are {block_tokens} "
                              f"tokens; leave block_tokens out (the trace sets it) or give {block_tokens}")
    try:
        return KVLayout(**values)
    except ConfigError as exc:  # "KVLayout.layers: ..." is the option's key here
        raise ConfigError(f"--layout: {str(exc).removeprefix('KVLayout.')}") from None
