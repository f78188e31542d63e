"""Block keys: pinned digests, chaining, namespaces, input normalization."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tiercache.keys import KEY_BYTES, block_key, key_to_int, prefix_keys

# Pinned: a change here invalidates every stored block key, so it must be deliberate.
GOLDEN_BLOCK = "4b05fcd0ffca3b9058aae229f1e8a11d"  # block_key(None, [1, 2, 3], "tenant-a")
GOLDEN_PREFIX = ["bf6d137b07545a2a8206c68a0590880e", "2b684ae124813df4bcb9e887968e5355"]  # range(10), 4, "t"
GOLDEN_INT = 3411561602431721217  # key_to_int of GOLDEN_PREFIX[0] (blake2b-64 of the whole key, "tiercache.id.v1")


def test_golden_digests():
    assert block_key(None, [1, 2, 3], "tenant-a").hex() == GOLDEN_BLOCK
    assert [k.hex() for k in prefix_keys(list(range(10)), 4, "t")] == GOLDEN_PREFIX
    assert key_to_int(bytes.fromhex(GOLDEN_PREFIX[0])) == GOLDEN_INT


def test_stable_across_processes_and_hash_seeds():
    code = "from tiercache.keys import block_key; print(block_key(None, [1, 2, 3], 'tenant-a').hex())"
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == GOLDEN_BLOCK


def test_chaining_matches_block_key():
    tokens = np.arange(1000, 1037)
    keys = prefix_keys(tokens, 8, "ns")
    assert len(keys) == 4  # 37 tokens: 4 full blocks, the partial tail has no key
    parent = None
    for i, key in enumerate(keys):
        assert len(key) == KEY_BYTES
        assert key == block_key(parent, tokens[i * 8 : (i + 1) * 8], "ns")
        parent = key


def test_prefix_of_tokens_gives_prefix_of_keys_and_divergence_propagates():
    tokens = list(range(64))
    full = prefix_keys(tokens, 16)
    assert prefix_keys(tokens[:40], 16) == full[:2]
    changed = tokens.copy()
    changed[5] = 999  # first block differs, so every later key differs too (chained)
    assert all(a != b for a, b in zip(prefix_keys(changed, 16), full))


@pytest.mark.parametrize("other", ["b", "", "a\x00", b"a\x00\x00"])
def test_namespaces_never_share_keys(other):
    tokens = list(range(32))
    a = prefix_keys(tokens, 8, "a")
    b = prefix_keys(tokens, 8, other)
    assert all(x != y for x, y in zip(a, b))
    assert block_key(None, tokens[:8], "a") != block_key(None, tokens[:8], other)


def test_str_and_bytes_namespace_agree():
    assert block_key(None, [7], "tenant") == block_key(None, [7], b"tenant")
    assert prefix_keys([1, 2], 1, "") == prefix_keys([1, 2], 1, b"")


def test_parent_none_differs_from_any_parent():
    root = block_key(None, [1, 2], "")
    assert block_key(root, [1, 2], "") != root
    assert block_key(b"\x00" * 16, [1, 2], "") != root


@pytest.mark.parametrize("dtype", ["<i8", ">i8", "<i4", "<u2", "<u8"])
def test_token_dtype_does_not_change_the_key(dtype):
    tokens = [3, 1, 4, 1, 5]
    assert block_key(None, np.array(tokens, dtype=dtype), "x") == block_key(None, tokens, "x")


def test_bad_inputs_raise():
    with pytest.raises(TypeError):
        block_key(None, [1.0, 2.0], "")
    with pytest.raises(TypeError):
        block_key(None, [1, 2], 3)
    with pytest.raises(ValueError):
        block_key(b"short", [1], "")
    with pytest.raises(ValueError):
        prefix_keys([1, 2], 0)
    with pytest.raises(ValueError):
        block_key(None, np.array([2**63], dtype=np.uint64), "")
    with pytest.raises(ValueError):
        key_to_int(b"123")


def test_key_to_int_is_63_bit_non_negative():
    for i in range(200):
        value = key_to_int(block_key(None, [i], "k"))
        assert 0 <= value < 2**63


def test_ids_hash_the_whole_key():
    """Hand-made keys sharing their first 8 bytes get different ids (issue 8, item 14)."""
    a, b = b"s0-l0-b10".ljust(16, b"_"), b"s0-l0-b11".ljust(16, b"_")
    assert a[:8] == b[:8] and key_to_int(a) != key_to_int(b)
    ids = {key_to_int(f"s0-l{layer}-b{block}".encode().ljust(16, b"_")) for layer in range(32) for block in range(100)}
    assert len(ids) == 3200
