"""Capacities and byte sizes as users write them: ``4096``, ``4k``, ``16GiB``, ``512MB``.

A capacity is a block count (``4096``; ``4k`` = 4,000, powers of 1000) or a byte size, which
needs a layout (and the tier's codec) to become blocks. The two spellings never overlap: a
suffix without ``B`` counts blocks, a byte size always ends in ``B``, and anything else
(``4Ki``) is refused with the accepted spellings. A value must come to a whole number of its
unit: ``1.5k`` is 1,500 blocks, but ``1.5`` blocks or ``0.1B`` are refused, never rounded.
"""

from __future__ import annotations

import re
from fractions import Fraction
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import Codec, KVLayout

__all__ = ["Capacity", "SPELLINGS", "STORAGE_TIERS", "hop_block_bytes", "move_hops", "parse_size", "parse_capacity"]

#: Byte units: decimal (kB = 1000 B) and binary (KiB = 1024 B); case-insensitive.
_BYTE_UNITS = {
    "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
#: Block-count suffixes (decimal): ``4k`` is 4,000 blocks.
_COUNT_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3}
#: A number (a sign is read only to say that the value must be positive) and a unit.
_SIZE_RE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
#: How capacities and sizes are spelled, for error messages.
SPELLINGS = ("blocks: 4096, 4k (4,000), 2M (2,000,000); byte sizes need a B: "
             "512MB, 16GB (powers of 1000), 512MiB, 16GiB (powers of 1024)")


@dataclass(frozen=True)
class Capacity:
    """A capacity as written: a block count, or a byte size that a layout turns into blocks.

    Invariants: exactly one of ``blocks`` and ``nbytes`` is set, and it is positive.
    """

    text: str
    blocks: int | None = None
    nbytes: int | None = None

    def __post_init__(self) -> None:
        if (self.blocks is None) == (self.nbytes is None):
            raise ValueError("Capacity: exactly one of blocks and nbytes")

    @classmethod
    def parse(cls, value: int | str, what: str = "capacity") -> "Capacity":
        """``4096``/``"4k"`` (blocks) or ``"16GiB"``/``"512MB"`` (bytes).

        Raises:
            ConfigError: unparsable, ambiguous (``"4Ki"``: neither spelling), not positive, or
                not a whole number of blocks (``"1.5"``) or bytes (``"0.1B"``).
        """
        number, unit = _split(value, what)
        if unit in _COUNT_UNITS:
            return cls(str(value), blocks=_whole_positive(number * _COUNT_UNITS[unit], value, what, "blocks"))
        return cls(str(value), nbytes=_whole_positive(number * _BYTE_UNITS[unit], value, what, "bytes"))

    def to_blocks(self, layout: "KVLayout | None", what: str = "capacity", codec: "Codec" = None) -> int:
        """Blocks of this capacity; a byte size is divided by the bytes of one block stored
        with ``codec`` (``layout.block_bytes`` without one; rounded down).

        Raises:
            ConfigError: a byte size without a layout, or under one block.
        """
        if self.blocks is not None:
            return self.blocks
        if layout is None:
            raise ConfigError(f"{what}: {self.text!r} is a byte size; give --model or --layout to turn it into blocks")
        block_bytes = layout.block_bytes if codec is None else codec.block_bytes(layout)
        blocks = self.nbytes // block_bytes
        if blocks < 1:
            raise ConfigError(f"{what}: {self.text!r} is less than one block of {block_bytes} bytes")
        return blocks


def _split(value: int | str, what: str) -> tuple[Fraction, str]:
    """``(number, unit)`` of a capacity or size: the number exact (``"1.2345"`` is not rounded
    through a float), the unit lower-cased and known."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a number, got {value!r}")
    if isinstance(value, int):
        return Fraction(value), ""
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ConfigError(f"{what}: cannot parse {value!r} ({SPELLINGS})")
    unit = match.group(2).lower()
    if unit not in _COUNT_UNITS and unit not in _BYTE_UNITS:
        raise ConfigError(f"{what}: {value!r} is ambiguous or unknown; spell {SPELLINGS}")
    return Fraction(match.group(1)), unit


def _whole_positive(number: Fraction, value: int | str, what: str, unit: str) -> int:
    """``number`` as an int: positive and whole (a fraction of a block or byte is refused).

    Raises:
        ConfigError: zero or negative, or not a whole number of ``unit``; names ``what``.
    """
    if number <= 0:
        raise ConfigError(f"{what}: must be positive, got {value!r}")
    if number.denominator != 1:
        raise ConfigError(f"{what}: {value!r} is {float(number):g} {unit}, not a whole number of {unit}")
    return int(number)


def parse_size(value: int | str, what: str = "size") -> int:
    """Parses a byte size: an int (bytes), ``"8GiB"``, ``"1.5GB"``, ``"4096"``.

    A suffix needs a B (``"4k"`` would read as 4,000 blocks elsewhere: refused here).

    Raises:
        ConfigError: the value is not a positive whole number of bytes; the message names ``what``.
    """
    number, unit = _split(value, what)
    if unit not in ("", *_BYTE_UNITS):
        raise ConfigError(f"{what}: {value!r} is not a byte size; write a unit with B ({SPELLINGS})")
    return _whole_positive(number * _BYTE_UNITS.get(unit, 1), value, what, "bytes")


def parse_capacity(value: int | str, layout: "KVLayout | None", what: str = "capacity", codec: "Codec | None" = None) -> int:
    """Turns a capacity into blocks (``Capacity.parse`` then ``Capacity.to_blocks``).

    A plain integer (or digit string, optionally with a ``k``/``M``/``G`` suffix, powers of
    1000) counts blocks; a size with a byte unit (``"8GiB"``, ``"512MB"``) is divided by
    the bytes of one block stored with ``codec`` (``layout.block_bytes`` without one).

    Raises:
        ConfigError: not positive, not a whole number of blocks or bytes, unparsable or
            ambiguous, a byte size without a layout, or under one block.
    """
    return Capacity.parse(value, what).to_blocks(layout, what, codec)


#: Tiers on media that store and carry bytes but compute nothing (a drive, the network's
#: shared store): the host encodes and decodes for them.
STORAGE_TIERS = ("nvme", "remote")  # config.REMOTE_TIER

def hop_block_bytes(src: str, src_form: int, dst: str, dst_form: int, dst_quantised: bool) -> int:
    """Bytes one block takes on a hop from tier ``src`` to tier ``dst``, as the live data
    plane (``tiercache/data/handlers.py``, ``quantized.py``) moves it.

    Args:
        src: source tier name; ``src_form`` the bytes of a block as it holds it.
        dst: destination tier name; ``dst_form`` the bytes of a block as it holds it.
        dst_quantised: whether ``dst`` stores blocks with a codec (its ``TierConfig.codec``
            is not ``Codec.NONE``), whatever the sizes of the two forms.

    Invariants: a hop to or from a storage tier (``STORAGE_TIERS``) carries that tier's
    form, whatever the other end's (an INT4 DRAM block is decoded on the host and written
    to a plain NVMe tier whole; a plain NVMe block is read whole and encoded on the host).
    Between two memory tiers the converting side is the one that makes the encoded form
    cross: a quantised destination's form (encoded where the block lies, then copied), else
    the source's (an encoded block is copied, then decoded where it lands).
    """
    if dst in STORAGE_TIERS:
        return dst_form
    if src in STORAGE_TIERS:
        return src_form
    return dst_form if dst_quantised else src_form


def move_hops(src: str, src_form: int, dst: str, dst_form: int, dst_quantised: bool,
              direct: bool = False) -> tuple[tuple[str, int], ...]:
    """The hops of a move from tier ``src`` to tier ``dst``, each as (link name, bytes one block
    takes on it: ``hop_block_bytes``).

    One hop when an end is DRAM or the link is ``direct`` (a profile's GPUDirect link); else
    two, through host memory, where the block is held in the memory end's form when the
    source is a storage tier, else in the source's (the live handlers stage a plain HBM's
    blocks plain and a quantised HBM's encoded). What a move brings is its last hop's bytes.
    """
    if direct or "dram" in (src, dst):
        return ((f"{src}->{dst}", hop_block_bytes(src, src_form, dst, dst_form, dst_quantised)),)
    host = dst_form if src in STORAGE_TIERS else src_form
    # The first hop's answer does not depend on the flag: from a storage tier it is the
    # stored form, from a memory tier the source's, which is what host memory holds.
    return ((f"{src}->dram", hop_block_bytes(src, src_form, "dram", host, False)),
            (f"dram->{dst}", hop_block_bytes("dram", host, dst, dst_form, dst_quantised)))

