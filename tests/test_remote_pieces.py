"""The remote tier's transfer pieces and checksum: the GIL-free streaming xxh3 against the
one-shot reference on random inputs, the piece ranges' invariants, and a batch of many
pieces on a real master where one damaged value in each piece is a miss and every other
block is read bit-identical.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import xxhash

from tiercache.data.remote import _FIRST_PIECE, _GET_PIECE, _PUT_PIECE, _checksum, _pieces


def test_the_streaming_checksum_equals_the_one_shot_xxh3_on_random_inputs():
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    sizes = [0, 1, 3, 16, 17, 128, 129, 240, 241, 1023, 4096, 65_537, 1 << 20] + rng.integers(0, 300_000, 12).tolist()
    for size in sizes:
        key = rng.bytes(16)
        payload = rng.integers(0, 256, int(size), dtype=np.uint8)
        reference = xxhash.xxh3_64_intdigest(payload, seed=int.from_bytes(key[:8], "little"))
        assert _checksum(key, payload) == reference, f"payload of {size} bytes"
    payload = rng.integers(0, 256, 4096, dtype=np.uint8)
    assert _checksum(b"\x01" * 16, payload) != _checksum(b"\x02" * 16, payload)  # seeded by the key


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 8, 14, 15, 64, 255, 256] + random.Random().sample(range(1, 300), 5))
def test_pieces_cover_the_keys_in_order_small_at_the_start_of_puts_and_the_end_of_gets(n):
    for most in (_PUT_PIECE, _GET_PIECE, 3):
        for shrinking in (False, True):
            pieces = _pieces(n, most, shrinking)
            bounds = [0] + [b for _, b in pieces]
            assert pieces == list(zip(bounds[:-1], bounds[1:])) and bounds[-1] == n  # contiguous, in order, all n
            assert all(0 < b - a <= max(most, _FIRST_PIECE) for a, b in pieces)
        growing, shrinking = [b - a for a, b in _pieces(n, most)], [b - a for a, b in _pieces(n, most, True)]
        assert shrinking == growing[::-1]
        if n:
            assert growing[0] == min(n, _FIRST_PIECE)  # a put's wire starts after hashing 2 blocks
            assert shrinking[-1] == min(n, _FIRST_PIECE)  # a get verifies 2 blocks after the wire is idle
        if n >= 4 * most:
            assert growing.count(most) >= 2  # full-size pieces in the middle


def test_one_damaged_value_in_each_piece_is_a_miss_and_the_rest_read_bit_identical():
    from remote_helpers import remote_config, require_mooncake

    require_mooncake()
    from store_helpers import LAYOUT
    from tiercache.data.remote import RemoteStore, value_name
    from tiercache.data.remote_master import start_master

    master = start_master()
    store = RemoteStore(remote_config(master), LAYOUT)
    try:
        n, rng = 29, np.random.default_rng(7)
        source = rng.integers(0, 256, (n, LAYOUT.block_bytes), dtype=np.uint8)
        dest = np.zeros_like(source)
        store.register(source)
        store.register(dest)
        keys = [rng.bytes(16) for _ in range(n)]
        assert store.submit_put(keys, list(source)).result() == [True] * n
        pieces = _pieces(n, _GET_PIECE, shrinking=True)
        assert len(pieces) >= 4
        damaged = {a + (b - a) // 2 for a, b in pieces}  # one value inside every piece
        for i in damaged:
            name = value_name(store.tag, keys[i])
            value = bytearray(store.client.get(name))
            value[-1 - i] ^= 0x01  # one bit of the payload
            store.client.remove(name, True)
            assert store.client.put(name, bytes(value)) == 0
        ok = store.submit_get(keys, list(dest)).result()
        assert [i for i, good in enumerate(ok) if not good] == sorted(damaged)
        good = [i for i in range(n) if i not in damaged]
        assert np.array_equal(dest[good], source[good])
        assert store.stats["corrupt"] == len(damaged) and store.stats["gets"] == len(good)
    finally:
        store.close()
        master.stop()
