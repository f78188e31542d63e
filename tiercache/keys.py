"""Chained content keys of token blocks.

A block's key is ``blake2b-128(domain, namespace, parent key, token ids)``: it names the
block *and everything before it*, so two sequences share a block key only when they share
the whole prefix up to and including that block (the prefix-tree property that prefix
caches such as vLLM's and SGLang's rely on).

Invariants:

* Stable across processes, Python versions and platforms: token ids are hashed as
  little-endian int64 bytes, never through Python's ``hash()`` (salted per process).
* The byte string fed to the hash is an injective encoding of ``(namespace, parent,
  tokens)`` (length-prefixed namespace, tagged parent), so two different inputs, in
  particular two namespaces, can only give equal keys through a blake2b collision.
* A key is a *lookup* hint, not a proof: a 128-bit digest can collide, so a cache hit must
  still be confirmed by comparing the stored block's token ids (and namespace) with the
  request's before its KV is used.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

__all__ = ["KEY_BYTES", "block_key", "prefix_keys", "key_to_int"]

#: Length of every key, in bytes.
KEY_BYTES = 16

# Versioned domain tag: changing the encoding must change every key, never alias old ones.
_DOMAIN = b"tiercache.block.v1\x00"
_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"
_MASK63 = (1 << 63) - 1
_ID_PERSON = b"tiercache.id.v1"  # domain of key -> id hashing (blake2b personalisation)
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _namespace_bytes(namespace: bytes | str) -> bytes:
    """Length-prefixed namespace, so ``("ab", tokens)`` never encodes like ``("a", ...)``."""
    if isinstance(namespace, str):
        namespace = namespace.encode("utf-8")
    elif not isinstance(namespace, (bytes, bytearray)):
        raise TypeError(f"namespace must be bytes or str, got {type(namespace).__name__}")
    return len(namespace).to_bytes(8, "little") + bytes(namespace)


def _parent_bytes(parent: bytes | None) -> bytes:
    """Tagged parent key: a root block and a child can never encode alike."""
    if parent is None:
        return _NO_PARENT
    if not isinstance(parent, (bytes, bytearray)) or len(parent) != KEY_BYTES:
        raise ValueError(f"parent must be None or a {KEY_BYTES}-byte key, got {parent!r}")
    return _HAS_PARENT + bytes(parent)


def _token_array(token_ids: Sequence[int] | np.ndarray, shown_shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Token ids as a contiguous little-endian int64 array. An object array of integers
    (Python's or numpy's, no bools: a pandas column's ``.values``, or ids numpy could not fit in
    one integer dtype) is taken id by id. ``shown_shape``: the shape an error names, when the
    ids are one row of what the caller was given (an ``[1, n]`` ``input_ids``).

    Raises:
        TypeError: the ids are not integers (floats would hash a silently rounded value).
        ValueError: an id beyond int64 (and only then).
    """
    refuse_listed_bools(token_ids)
    arr = np.asarray(token_ids)
    if arr.size == 0:
        return np.zeros(0, dtype="<i8")
    if arr.dtype == object and arr.ndim == 1 and all(_is_integer(t) for t in arr):
        return _object_ids(arr)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        shape = arr.shape if shown_shape is None else shown_shape
        raise TypeError(f"token_ids must be a 1-D sequence of integers, got dtype {arr.dtype} shape {shape}")
    if arr.dtype == np.uint64 and arr.max() > np.iinfo(np.int64).max:
        raise ValueError("token_ids: a token id does not fit in int64")
    return np.ascontiguousarray(arr, dtype="<i8")


def refuse_listed_bools(token_ids) -> None:
    """Raises TypeError naming the first bool (Python's, numpy's, or a 0-d bool tensor or
    array) among a list's or tuple's ids, one level of nesting included (a
    ``[[...]]`` row): numpy would read ``[1, True]`` as ``[1, 1]``. Arrays and tensors pass
    (their dtype says bool, which ``_token_array`` refuses)."""
    if not isinstance(token_ids, (list, tuple)):
        return
    rows = token_ids if token_ids and all(isinstance(r, (list, tuple)) for r in token_ids) else [token_ids]
    for row in rows:
        for position, value in enumerate(row):
            if _is_bool(value):
                raise TypeError(f"token_ids must be integers, got the bool {value!r} at position {position}")


def _is_bool(value) -> bool:
    """Whether ``value`` is one bool: Python's, numpy's, or a 0-d array or tensor of dtype bool
    (a list of one-id arrays or tensors is ``flat_token_ids``'s per-step form, checked there)."""
    dtype = getattr(value, "dtype", None)
    return isinstance(value, (bool, np.bool_)) or (
        dtype is not None and str(dtype) in ("bool", "torch.bool") and getattr(value, "ndim", 1) == 0)


def _is_integer(value) -> bool:
    """Whether ``value`` is a Python or numpy integer, not a bool of either kind."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _object_ids(arr: np.ndarray) -> np.ndarray:
    """An object array of integers (``_is_integer``) as int64.

    Raises:
        ValueError: an id beyond int64 (numpy keeps ints past uint64 as objects).
    """
    ids = [int(t) for t in arr]
    if any(not _INT64_MIN <= t <= _INT64_MAX for t in ids):
        raise ValueError("token_ids: a token id does not fit in int64")
    return np.array(ids, dtype="<i8")


def _digest(ns: bytes, parent: bytes, tokens: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(_DOMAIN, digest_size=KEY_BYTES)
    h.update(ns)
    h.update(parent)
    h.update(tokens)
    return h.digest()


def block_key(parent: bytes | None, token_ids: Sequence[int] | np.ndarray, namespace: bytes | str = b"") -> bytes:
    """Key of one block given its parent's key.

    Args:
        parent: key of the previous block of the sequence, or ``None`` for the first block.
        token_ids: the block's token ids (integers that fit in int64).
        namespace: tenant / model salt; blocks of different namespaces never share keys.

    Returns:
        A 16-byte digest. A hit found by this key must be confirmed by comparing token ids.
    """
    tokens = _token_array(token_ids)
    return _digest(_namespace_bytes(namespace), _parent_bytes(parent), tokens.tobytes())


def prefix_keys(token_ids: Sequence[int] | np.ndarray, block_tokens: int, namespace: bytes | str = "") -> list[bytes]:
    """Chained keys of every *full* block of a sequence (a partial tail block has none).

    ``prefix_keys(t, n)[i] == block_key(prefix_keys(t, n)[i - 1], t[i*n:(i+1)*n])``, the
    first block having parent ``None``. Keys of a prefix are a prefix of the keys.

    Raises:
        ValueError: ``block_tokens`` is not a positive integer.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ValueError(f"block_tokens must be a positive integer, got {block_tokens!r}")
    raw = memoryview(_token_array(token_ids).tobytes())  # one conversion, then zero-copy slices
    ns = _namespace_bytes(namespace)
    step = 8 * block_tokens
    keys: list[bytes] = []
    parent = _NO_PARENT
    for start in range(0, len(raw) - step + 1, step):
        key = _digest(ns, parent, raw[start : start + step])
        keys.append(key)
        parent = _HAS_PARENT + key
    return keys


def key_to_int(key: bytes) -> int:
    """Stable non-negative 63-bit id of a key, for int-keyed metadata tables.

    The id hashes the *whole* key (blake2b-64 under its own domain tag), so hand-made keys
    that share a prefix (``b"s0-l0-b10".ljust(16, b"_")`` and ``b"s0-l0-b11"...``) get
    unrelated ids. Two keys may still map to the same int (63 bits of a 128-bit key);
    tables keyed by it must keep the full key (or the token ids) to confirm a match.
    """
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {key!r}")
    digest = hashlib.blake2b(bytes(key), digest_size=8, person=_ID_PERSON).digest()
    return int.from_bytes(digest, "little") & _MASK63


_LAYER_PERSON = b"tiercache.lyr.v1"  # domain of per-layer block keys


def layer_key(key: bytes, layer: int) -> bytes:
    """The key of one layer's part of block ``key`` (per-layer blocks move on their own).

    Distinct layers of one block, and the same layer of distinct blocks, get unrelated keys;
    the block key itself is never a layer key (separate blake2b personalisation).

    Raises:
        ValueError: a key that is not 16 bytes, or a negative layer.
    """
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {key!r}")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be a non-negative integer, got {layer!r}")
    return hashlib.blake2b(bytes(key) + layer.to_bytes(4, "little"), digest_size=KEY_BYTES, person=_LAYER_PERSON).digest()
