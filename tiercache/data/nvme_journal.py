"""Reading the NVMe store's journal back: valid batches, repaired ones, and skipped damage.

A journal is a sequence of batches ``header(magic, seq, length, crc) + body``, the crc
covering the header fields before it and the body. Appends only ever add at the end, so
a crash leaves at most one torn batch, and nothing valid after it. Damage in the middle
(a flipped bit on disk) is different: valid batches follow it, and they hold acknowledged
blocks. So a batch that fails its check is

1. repaired when one flipped bit explains it: crc32c locates any single-bit error in a
   message shorter than 2**31 bits (its Hamming distance is at least 3, so two single-bit
   errors never share a syndrome); the repaired batch must then also decode;
2. else skipped, when a valid batch follows somewhere after it (found by its magic and
   checked by its own crc);
3. else it is the torn tail, and the journal ends there.

Only ever bytes whose crc verifies (as stored or after a one-bit repair) are returned: a
damaged batch's records are never half-trusted, since a flipped key bit could name
another real key and serve its block under the wrong name.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from .chunkio import crc32c

__all__ = ["HEADER", "MAGIC", "REPAIR_MAX_BYTES", "JournalScan", "fix_one_bit", "scan_journal", "sealed_crc"]

HEADER = struct.Struct("<4sQII")  # magic, sequence, payload length, crc
MAGIC = b"TCJ1"
_POLY = 0x82F63B78  # crc32c polynomial, bit-reflected
REPAIR_MAX_BYTES = 1 << 20  # the bit-by-bit syndrome search is Python: ~3 s per MiB
_CRC_AT = HEADER.size - 4
_LENGTH_AT = 12


@dataclass
class JournalScan:
    """What a journal holds: ``batches`` as ``(seq, body)`` in file order, the offset just
    after the last good batch (``end``: appends continue there), and how many batches were
    repaired and how many damaged regions were skipped."""

    batches: list[tuple[int, bytes]] = field(default_factory=list)
    end: int = 0
    repaired: int = 0
    skipped: int = 0


def sealed_crc(head: bytes, body: bytes) -> int:
    """crc32c of header fields then body."""
    return crc32c(np.frombuffer(head + body, np.uint8))


def scan_journal(data: bytes, decodes) -> JournalScan:
    """Splits journal bytes into verified batches.

    Args:
        data: the whole journal file.
        decodes: ``decodes(body) -> bool``, True when a body parses as operations (a
            repaired batch must, as a second check of the repair).
    """
    scan, pos = JournalScan(), 0
    while pos + HEADER.size <= len(data):
        found = _batch_at(data, pos)
        if found is None:
            found = _repair_at(data, pos, decodes)
            scan.repaired += found is not None
        if found is not None:
            seq, body, end = found
            if end <= pos:  # cannot happen (a batch has a header): never loop on one offset
                raise AssertionError(f"journal scan made no progress at offset {pos}")
            scan.batches.append((seq, body))
            scan.end = pos = end
            continue
        pos = _next_batch(data, pos + 1)
        if pos is None:
            break  # a torn tail: nothing valid after it, never acknowledged
        scan.skipped += 1
    return scan


def _batch_at(data: bytes, pos: int) -> tuple[int, bytes, int] | None:
    """``(seq, body, end)`` of a batch at ``pos`` whose magic and crc verify, else None."""
    magic, seq, length, crc = HEADER.unpack_from(data, pos)
    body = data[pos + HEADER.size : pos + HEADER.size + length]
    if magic != MAGIC or len(body) != length or sealed_crc(data[pos : pos + _CRC_AT], body) != crc:
        return None
    return seq, body, pos + HEADER.size + length


def _next_batch(data: bytes, start: int) -> int | None:
    """Offset of the first verified batch at or after ``start``, or None."""
    pos = data.find(MAGIC, start)
    while pos >= 0 and pos + HEADER.size <= len(data):
        if _batch_at(data, pos) is not None:
            return pos
        pos = data.find(MAGIC, pos + 1)
    return None


def _repair_at(data: bytes, pos: int, decodes) -> tuple[int, bytes, int] | None:
    """A batch at ``pos`` with exactly one flipped bit, repaired, or None.

    The bit may be in the length field (then the body's extent is wrong: each of its 32
    one-bit variants is tried), in the stored crc, or anywhere else (syndrome search).
    Like ``_batch_at``, the end returned is an offset in ``data`` (past ``pos``).
    """
    stored_length = HEADER.unpack_from(data, pos)[2]
    for bit in range(32):
        length = stored_length ^ (1 << bit)
        if pos + HEADER.size + length <= len(data):
            fixed = bytearray(data[pos : pos + HEADER.size + length])
            fixed[_LENGTH_AT : _LENGTH_AT + 4] = length.to_bytes(4, "little")
            found = _verified(bytes(fixed), pos, decodes)
            if found is not None:
                return found
    message = bytearray(data[pos : pos + HEADER.size + stored_length])
    if len(message) != HEADER.size + stored_length or len(message) > REPAIR_MAX_BYTES:
        return None
    if not _fix_one_bit(message):
        return None
    return _verified(bytes(message), pos, decodes)


def _verified(batch: bytes, pos: int, decodes) -> tuple[int, bytes, int] | None:
    """``_batch_at`` on a candidate repair of the batch at ``pos``, which must also decode;
    its end is an offset in the journal (``pos`` plus the batch's length)."""
    found = _batch_at(batch, 0)
    if found is None or not decodes(found[1]):
        return None
    seq, body, end = found
    return seq, body, pos + end


def _fix_one_bit(batch: bytearray) -> bool:
    """``fix_one_bit`` of a journal batch (crc field at ``_CRC_AT``)."""
    return fix_one_bit(batch, _CRC_AT, HEADER.size)


def fix_one_bit(record: bytearray, crc_at: int, header_size: int) -> bool:
    """Flips the one bit whose error explains the crc mismatch of ``record`` in place.

    ``record`` is a header of ``header_size`` bytes whose last 4 (from ``crc_at``) are a
    crc32c sealing the rest of the header and the body after it (``sealed_crc``). Flipping
    input bit ``k`` of an ``n``-bit message changes a reflected crc by
    ``step^(n-1-k)(POLY)``, independent of the message, so walking that sequence finds
    ``k``. A mismatch of one bit in the crc field itself means the covered bytes are
    intact. Returns False if no single bit explains it. Python: ~3 s per MiB.
    """
    stored = int.from_bytes(record[crc_at:header_size], "little")
    message = bytes(record[:crc_at]) + bytes(record[header_size:])
    syndrome = sealed_crc(message, b"") ^ stored
    if bin(syndrome).count("1") == 1:
        record[crc_at:header_size] = (stored ^ syndrome).to_bytes(4, "little")
        return True
    bits, value = 8 * len(message), _POLY
    for distance in range(bits):
        if value == syndrome:
            byte, bit = divmod(bits - 1 - distance, 8)
            record[byte if byte < crc_at else byte + header_size - crc_at] ^= 1 << bit
            return True
        value = (value >> 1) ^ (_POLY if value & 1 else 0)
    return False
