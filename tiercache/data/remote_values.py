"""What a remote value is: its name, its 64-byte header, its checksum, and the Mooncake
calls that move values (see ``remote.RemoteStore``).

A block is one value named by the layout tag and its full 16-byte content key:

    magic "TCKV" | version | key (16 B) | payload bytes | layout tag | xxh3-64 of the payload

A value is served only if its size, header and checksum match (``verdict_of``).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Sequence

import numpy as np
import xxhash

from tiercache.config import Codec, KVLayout

from .chunkio import layout_attributes
from .pools import HEADER_BYTES  # a pool's header room ends with exactly one header

__all__ = ["HEADER_BYTES", "layout_tag", "value_name", "checksum", "pack_header", "verdict_of", "transport_error",
           "header_rows", "transfer_call", "pieces", "PIECE", "NOT_FOUND"]

MAGIC, VERSION = b"TCKV", 1
HEADER = struct.Struct("<4sHH16sQQQ")  # magic, version, reserved, key, payload bytes, layout tag, checksum
PIECE = 16  # keys per transfer call: piece k + 1 is on the wire while piece k is checksummed
NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND


def layout_tag(layout: KVLayout, codec: Codec = Codec.NONE) -> int:
    """A 64-bit tag of everything that gives a value's bytes their meaning.

    That is the whole layout as the NVMe tier records it (layers, per-layer or not, kv
    heads, head dim, dtype, block tokens), the ``codec`` whose error the values may carry
    (a store with a quantised tier above its remote tier publishes decoded lossy blocks:
    ``Codec.NONE`` only for exact ones), the model's name and the value format (header
    version): values of two layouts or codecs that differ in any of these never share a
    name, so neither is served as the other's (a 2-layer per-layer model's blocks have the
    same shape as a 4-layer one's; an INT8-rounded block is never served as exact).
    """
    described = layout_attributes(layout, None, codec)
    described = {"layout": described["layout"], "codec": described["codec"], "codec_format": described["codec_format"],
                 "model": layout.name, "value_format": VERSION}
    text = json.dumps(described, sort_keys=True).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def value_name(tag: int, key: bytes) -> str:
    """The Mooncake key of a block: the layout tag and the full content key."""
    return f"tiercache/{tag:016x}/{key.hex()}"


def checksum(key: bytes, payload: np.ndarray) -> int:
    """xxh3-64 of a payload, seeded with its key (a value moved under another key fails)."""
    return xxhash.xxh3_64_intdigest(payload, seed=int.from_bytes(key[:8], "little"))


def pack_header(header: np.ndarray, key: bytes, payload: np.ndarray, tag: int) -> None:
    """Writes the header of ``payload``'s value (stored under ``key``, layout ``tag``) into ``header``."""
    HEADER.pack_into(header, 0, MAGIC, VERSION, 0, key, payload.nbytes, tag, checksum(key, payload))


def verdict_of(code: int, header: np.ndarray, key: bytes, payload: np.ndarray, tag: int) -> str | None:
    """None when a read value is exactly this block (size, header and checksum match);
    else the counter it goes to: ``missing``, ``unreadable`` or ``corrupt``."""
    if code == NOT_FOUND:
        return "missing"
    if code < 0:  # a transfer that failed (the holder is gone, a size that does not fit)
        return "unreadable"
    if code != HEADER_BYTES + payload.nbytes:
        return "corrupt"
    magic, version, _, stored_key, size, stored_tag, stored_sum = HEADER.unpack_from(header, 0)
    if (magic, version, stored_key, size, stored_tag) != (MAGIC, VERSION, key, payload.nbytes, tag) \
            or stored_sum != checksum(key, payload):
        return "corrupt"
    return None


def transport_error(code: int) -> bool:
    """Mooncake's RPC failures (-900s): the master was not reached, as opposed to an
    answer about one key (not found -704, no space -200, a transfer that failed -800)."""
    return -1000 < code <= -900


def header_rows(inline: Sequence[np.ndarray] | None, rows: np.ndarray, payloads: Sequence[np.ndarray]):
    """The header of each value: ``inline`` when every one lies right before its payload
    (one buffer per value), else this store's own registered rows (two buffers per value)."""
    if inline is not None and len(inline) == len(payloads) and all(
            h.nbytes == HEADER_BYTES and h.ctypes.data + HEADER_BYTES == p.ctypes.data for h, p in zip(inline, payloads)):
        return list(inline)
    return rows


def transfer_call(what: str, names: list[str], headers, payloads: Sequence[np.ndarray]):
    """The client call moving ``names``' values: one buffer ``[header | payload]`` per value
    where each header lies right before its payload (measured 13-16% faster than two buffers
    per value over TCP here), else a header row and the payload, two buffers per value. The
    value's bytes are the same either way, so both kinds of reader and writer share it."""
    if all(h.ctypes.data + HEADER_BYTES == p.ctypes.data for h, p in zip(headers, payloads)):
        pointers = [h.ctypes.data for h in headers]
        sizes = [HEADER_BYTES + p.nbytes for p in payloads]
        if what == "put":
            return lambda c: c.batch_put_from(names, pointers, sizes)
        return lambda c: c.batch_get_into(names, pointers, sizes)
    pointers = [[h.ctypes.data, p.ctypes.data] for h, p in zip(headers, payloads)]
    sizes = [[HEADER_BYTES, p.nbytes] for p in payloads]
    if what == "put":
        return lambda c: c.batch_put_from_multi_buffers(names, pointers, sizes)
    return lambda c: c.batch_get_into_multi_buffers(names, pointers, sizes)


def pieces(n: int) -> list[tuple[int, int]]:
    """``[a, b)`` ranges of at most ``PIECE`` of ``n`` keys: one transfer call each."""
    return [(a, min(a + PIECE, n)) for a in range(0, n, PIECE)]
