"""The order file of an NVMe store (``ORDER_FILE``): the keys of the blocks a ``TieredKVCache``'s
close left on NVMe, in its persist order, which a reopen on a smaller tier keeps first
(``lifecycle.adopt_stored_blocks``), so that what it keeps is whole block positions."""

from __future__ import annotations

import os
import struct
import warnings
import zlib
from typing import Callable, Sequence

import numpy as np

from tiercache.core.manager import TierManager
from tiercache.data.chunkio import fsync_dir, replace_file, unlink, unlink_quietly, write_file_durably
from tiercache.keys import KEY_BYTES, key_to_int

from .keymap import KeyMap

__all__ = ["ORDER_FILE", "UNRANKED", "Rank", "write_order", "read_order", "save_order", "ordered_ids"]

#: A persist order (``persist_to_nvme``'s ``rank``): maps block ids to sort keys, lowest
#: first, ``UNRANKED`` for a block it knows nothing of (``cache.WriteRanks.of``).
Rank = Callable[[Sequence[int]], np.ndarray]

#: The sort key of a block a ``Rank`` knows nothing of: after every ranked one.
UNRANKED = int(np.iinfo(np.int64).max)


#: A file in an NVMe store's directory: the keys of the blocks a ``TieredKVCache``'s close
#: left on NVMe, in its persist order (``save_order``); a reopen on a smaller tier keeps them
#: first, in that order (``adopt_stored_blocks``).
ORDER_FILE = "tiercache.order"
_ORDER_HEADER = struct.Struct("<4sQI")  # magic, key count, crc32 of the keys
_ORDER_MAGIC = b"TCO1"


def write_order(medium: object, keys: Sequence[bytes]) -> None:
    """Replaces ``medium``'s ``ORDER_FILE`` with ``keys`` (a medium without ``path`` has
    none): a temp file, fsynced, renamed over it, the directory fsynced, so a reopen reads
    the old list or the new one, never a mix. A list that cannot be written (a full disk)
    is warned of (``UserWarning`` naming the file and the OS error) and the old list is
    deleted, so no stale list orders the next smaller reopen (which then keeps blocks by
    slot); the close goes on, as the file only orders what a smaller reopen keeps first (a
    key it names that is not stored is skipped; a stored one it does not name comes after)."""
    path = getattr(medium, "path", None)
    if not isinstance(path, str):
        return
    try:  # a folder removed or replaced since the store opened: its order file (another store's) is left alone
        getattr(medium, "check_folder", lambda: None)()
    except OSError as exc:
        warnings.warn(f"{path}: the order a smaller reopen keeps blocks in is not written ({exc})", UserWarning,
                      stacklevel=2)
        return
    body = b"".join(keys)
    final, temp = os.path.join(path, ORDER_FILE), os.path.join(path, ORDER_FILE + ".tmp")
    dir_fd = getattr(medium, "folder_fd", None)  # the folder the store opened, whatever its path names now
    try:
        write_file_durably(temp, _ORDER_HEADER.pack(_ORDER_MAGIC, len(keys), zlib.crc32(body)) + body, dir_fd)
        replace_file(temp, final, dir_fd)
        fsync_dir(path, dir_fd)
    except OSError as exc:
        unlink_quietly(temp, dir_fd)
        _drop_stale_order(final, exc, dir_fd)


def _drop_stale_order(final: str, exc: OSError, dir_fd: int | None) -> None:
    """A new order list could not be written (``exc``): deletes the old one and warns."""
    try:
        unlink(final, dir_fd)
        fate = "the previous list was deleted"
    except FileNotFoundError:
        fate = "there was no previous list"
    except OSError as unlink_error:
        fate = f"the previous list could not be deleted either ({unlink_error.strerror}) and may order it wrongly"
    warnings.warn(f"{final}: the order a smaller reopen keeps blocks in could not be written ({exc}); {fate}, "
                  "so such a reopen keeps blocks by slot", UserWarning, stacklevel=2)


def read_order(medium: object) -> list[bytes]:
    """The keys of ``medium``'s ``ORDER_FILE``, in its order; [] when there is none (a
    medium without ``path``, a store no cache closed) or it is damaged (a wrong magic,
    length or crc32: a damaged hint is dropped, never half used)."""
    path = getattr(medium, "path", None)
    if not isinstance(path, str):
        return []
    try:
        with open(os.path.join(path, ORDER_FILE), "rb") as file:
            data = file.read()
    except OSError:
        return []
    if len(data) < _ORDER_HEADER.size:
        return []
    magic, count, crc = _ORDER_HEADER.unpack_from(data)
    body = data[_ORDER_HEADER.size :]
    if magic != _ORDER_MAGIC or len(body) != count * KEY_BYTES or zlib.crc32(body) != crc:
        return []
    return [body[start : start + KEY_BYTES] for start in range(0, len(body), KEY_BYTES)]


def save_order(manager: TierManager, media: Sequence[object], keymap: KeyMap, rank: Rank) -> None:
    """Closing, after the persist: writes the NVMe tier's ``ORDER_FILE``, the keys of the
    blocks it holds that ``rank`` ranks (every content-keyed block a cache wrote, or adopted
    from an earlier list: ``cache.WriteRanks``), lowest rank first. Blocks spilled there
    before close are listed at their ranks too: the list, not their slots, orders a smaller
    reopen. Blocks ``rank`` does not know are not listed (they come after, by slot)."""
    names = [d.name for d in manager.dirs]
    if "nvme" not in names:
        return
    nvme = names.index("nvme")
    ids = list(manager.dirs[nvme].slot_of)
    ranks = rank(ids) if ids else np.zeros(0, dtype=np.int64)
    order = np.argsort(ranks, kind="stable")
    write_order(media[nvme], [keymap.keys[ids[n]] for n in order.tolist() if ranks[n] != UNRANKED])


def ordered_ids(media: Sequence[object], keymap: KeyMap) -> np.ndarray:
    """Opening, after the adoption: the ids of the adopted blocks that a medium's
    ``ORDER_FILE`` names, in its order (``cache.WriteRanks.seed`` ranks them so, and the
    next close lists them again)."""
    ids = []
    for medium in media:
        for key in read_order(medium):
            block_id = key_to_int(key)
            if keymap.keys.get(block_id) == key:
                ids.append(block_id)
    return np.asarray(ids, dtype=np.int64)
