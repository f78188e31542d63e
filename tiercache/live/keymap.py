"""The live store's identity map: content keys (and token ids) of the blocks it holds.

The manager names blocks by the 63-bit id of their 16-byte content key (``key_to_int``);
this map keeps the full key of every resident id, so a lookup compares whole keys and two
keys sharing an id are never confused (the second is refused and counted), and the token
ids of blocks stored with ``put_tokens``, so a prefix hit is confirmed by tokens.

Scratch keys (``scratch_key``: a decode sequence's private keys, which no later request can
name) end in ``SCRATCH_TAG``, so a reopened store recognises a scratch block left on NVMe
(by a crash) from its key alone and never adopts it (``lifecycle.adopt_stored_blocks``).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

from tiercache.errors import UserError
from tiercache.keys import KEY_BYTES, block_key, key_to_int, layer_key

__all__ = ["KeyMap", "SCRATCH_TAG", "scratch_key", "is_scratch"]

#: The last 8 bytes of every scratch key. A content key (a blake2b digest) ends in them with
#: probability 2**-64; a key made by hand should not end in them (its block would be scratch).
SCRATCH_TAG = b"\xfetc.scr\x00"


def scratch_key(seed: bytes, index: int, layer: int) -> bytes:
    """The scratch key of layer ``layer`` of block ``index`` under a private ``seed``: the
    first 8 bytes of that block's layer key, then ``SCRATCH_TAG`` (``is_scratch``)."""
    return layer_key(block_key(None, [index], seed), layer)[: KEY_BYTES - len(SCRATCH_TAG)] + SCRATCH_TAG


def is_scratch(key: bytes) -> bool:
    """True for a scratch key (``scratch_key``): no later request can name its block."""
    return key[KEY_BYTES - len(SCRATCH_TAG) :] == SCRATCH_TAG


class KeyMap:
    """Keys and tokens by manager id.

    ``scratch`` names the blocks stored under scratch keys (``is_scratch``: a decode
    sequence's private keys, which no later request can name): closing deletes them from
    every tier, NVMe included, and never persists them (``lifecycle.drop_scratch``).

    Invariants (``check``): ``keys`` holds exactly the resident ids (an id is registered
    just before its block is placed and forgotten once no tier holds it); ``tokens`` holds
    a subset of them; ``scratch`` is exactly the ids whose keys are scratch keys;
    ``key_to_int(keys[i]) == i``.
    """

    def __init__(self) -> None:
        self.keys: dict[int, bytes] = {}
        self.tokens: dict[int, np.ndarray] = {}
        self.scratch: set[int] = set()
        self.collisions = 0

    def key_of(self, block_id: int) -> bytes:
        """The full key of a registered id; raises KeyError for an unknown one."""
        return self.keys[block_id]

    @staticmethod
    def check_keys(keys: object, what: str) -> list[bytes]:
        """``keys`` as a list of plain ``bytes`` (a subclass's, ``numpy.bytes_``, is copied into
        one: the NVMe tier stores exactly ``bytes``), after checking it is a list or tuple of
        16-byte ``bytes``, none a scratch key (``is_scratch``: ending in ``SCRATCH_TAG``, which
        only a decode sequence's private keys may; such a block would be deleted, never
        persisted, at close and reopen).

        Raises:
            UserError: naming the call, the position and what was wrong.
        """
        if not isinstance(keys, (list, tuple)):
            raise UserError(f"{what}: keys must be a list of {KEY_BYTES}-byte bytes keys, got {type(keys).__name__}")
        for index, key in enumerate(keys):
            if not isinstance(key, bytes):
                raise UserError(f"{what}: keys[{index}] must be bytes, got {type(key).__name__}")
            if len(key) != KEY_BYTES:
                raise UserError(f"{what}: keys[{index}] must be {KEY_BYTES} bytes long, got {len(key)}")
            if is_scratch(key):
                raise UserError(f"{what}: keys[{index}] ({key.hex()}) ends in SCRATCH_TAG ({SCRATCH_TAG.hex()}), "
                                "which marks a decode's private scratch keys (deleted at close): use another key")
        return [key if type(key) is bytes else bytes(key) for key in keys]

    def ids(self, keys: Sequence[bytes], register: bool) -> list[int | None]:
        """Manager ids of ``keys``; None for a key whose id belongs to another key.

        With ``register`` unknown keys are recorded (the caller is about to place them and
        must ``forget_absent`` whatever it did not place), scratch keys in ``scratch`` too.

        ``keys`` were checked with ``check_keys``.
        """
        ids: list[int | None] = []
        for key in keys:
            block_id = key_to_int(key)
            known = self.keys.get(block_id)
            if known is None and register:
                self.keys[block_id] = key
                if is_scratch(key):
                    self.scratch.add(block_id)
            elif known is not None and known != key:
                self.collisions += 1
                block_id = None
            ids.append(block_id)
        return ids

    def stored_ids(self, keys: Sequence[bytes], locate: Callable[[int], int | None], what: str) -> list[int]:
        """Manager ids of ``keys``, each of a block some tier holds (``locate``).

        Raises:
            KeyError: naming ``what`` and the first key that is not stored (a key whose id
                belongs to another key is not stored either).
        """
        ids = self.ids(keys, register=False)
        for key, block_id in zip(keys, ids):
            if block_id is None or locate(block_id) is None:
                raise KeyError(f"{what}: key {key.hex()} is not stored")
        return ids

    def adopt(self, ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """Records the keys of blocks adopted from a durable tier on reopen (never scratch
        keys: ``lifecycle.adopt_stored_blocks`` deletes those instead)."""
        self.keys.update(zip(ids, keys))

    def forget_absent(self, ids: Iterable[int], locate: Callable[[int], int | None]) -> None:
        """Drops the entries of ``ids`` that no tier holds (refused, failed, or departed)."""
        for block_id in ids:
            if locate(block_id) is None:
                self.keys.pop(block_id, None)
                self.tokens.pop(block_id, None)
                self.scratch.discard(block_id)

    def check(self, resident: set[int]) -> None:
        """Asserts the map holds exactly the resident ids (see the class invariants)."""
        assert set(self.keys) == resident, (
            f"key map holds {len(set(self.keys) - resident)} non-resident id(s) and misses {len(resident - set(self.keys))}")
        assert set(self.tokens) <= resident, "token ids kept for a block no tier holds"
        assert self.scratch == {i for i, key in self.keys.items() if is_scratch(key)}, "scratch ids differ from scratch keys"
        assert all(key_to_int(key) == block_id for block_id, key in self.keys.items()), "key filed under a wrong id"
