"""Opening an NVMe store: lock, validate, load the index, reconcile the directory.

Ordering (each step relies on the ones before it):

1. Refusals that need no lock (a file in the way, nothing to open with ``create=False``,
   a capacity that cannot be parsed) touch nothing on disk.
2. The directory lock (``nvme_lock``) is taken before anything is read for recovery or
   changed: a second opener must never sweep the first one's unflushed chunks. From then on
   every read, sweep and write goes through the folder the lock holds open, checked right
   after locking and again at the end to be what the path names: a folder swapped onto the
   path meanwhile (another store's) is refused, never read, swept or written.
   Creation happens under the lock too, ``zarr.json`` first and the empty index snapshot
   last: the snapshot's atomic rename is what makes a store exist. A directory holding
   only what a creation killed before that leaves (``_unfinished_creation``: no snapshot,
   no journal, no chunk) never held a block, so it is created again, not refused.
3. ``zarr.json`` and the index are validated and loaded; every malformed file gives a
   ``UserError`` naming it, before anything is deleted.
4. The directory is reconciled with the index (``sweep_directory``): an entry is adopted
   only if its chunk file is a regular file of the entry's length whose crc trailer equals
   the entry's crc, so a crash leftover is dropped here and counted in
   ``recovered_dropped``, never reported present and then found corrupt on first read.
   That check costs a 4-byte read per live chunk (cold: about 75 us each on this
   machine's virtio disk), so it runs only after an unclean shutdown: a store that
   closed cleanly left a marker naming its index sequence number (``mark_clean``), and
   the marker is removed, durably, before the reopened store can write anything. The
   marker also proves that every batch up to its sequence number was acknowledged: if the
   journal's replay stops short of it (its tail damaged or cut after the clean close), the
   missing batches are counted in ``journal_skipped`` like a damaged middle batch, never
   taken for a torn, unacknowledged append.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..config import Codec, KVLayout, parse_capacity
from ..errors import UserError
from . import chunkio
from .chunkmeta import META_NAME
from .nvme_index import SNAPSHOT_TMP_NAME, IndexFiles, SlotTable, check_table_fits, record_cost
from .nvme_journal import sealed_crc
from .nvme_lock import LOCK_NAME, StoreLock

__all__ = ["TMP_PREFIX", "CLEAN_NAME", "Opened", "open_store", "store_exists", "mark_clean", "sweep_directory", "check_path",
           "check_arguments", "check_key", "check_keys", "check_slots", "check_encoded"]

TMP_PREFIX = ".tc-tmp."
CLEAN_NAME = "tiercache.clean"
_ZARR_PARTIAL = re.compile(r"zarr\.[0-9a-f]+\.partial")  # zarr's temp file while it writes zarr.json


def check_path(path: object, what: str) -> str:
    """``path`` as an absolute ``str`` (``os.path.abspath``: a store opened under a relative
    path keeps its directory when the process changes its working directory): it must be a
    non-empty ``str`` or an ``os.PathLike`` of one, without a NUL byte (which no file name
    can hold).

    Raises:
        UserError: naming ``what``, the path and what is wrong with it.
    """
    try:
        text = os.fspath(path)
    except TypeError:
        text = None
    if not isinstance(text, str):
        raise UserError(f"{what}: path must be a str or os.PathLike of a str, got {type(path).__name__} {path!r}")
    if "\0" in text:
        raise UserError(f"{what}: path {text!r} holds a NUL byte")
    if not text:
        raise UserError(f"{what}: path is empty")
    return os.path.abspath(text)


def check_arguments(path: object, layout: object, compression: object, io_threads: object) -> str:
    """Validates ``NVMeStore`` arguments before anything on disk is touched; returns the
    path as a ``str`` (``check_path``)."""
    path = check_path(path, "NVMeStore")
    if not isinstance(layout, KVLayout):
        raise UserError(f"NVMeStore: layout must be a KVLayout, got {type(layout).__name__}")
    if compression not in chunkio.COMPRESSIONS:
        raise UserError(f"NVMeStore: compression must be None or 'lz4', got {compression!r}")
    if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
        raise UserError(f"NVMeStore: io_threads must be a positive integer, got {io_threads!r}")
    return path


def check_key(key: object, what: str) -> bytes:
    """``key`` if it is ``bytes`` of 1..65535 bytes (the journal's key length field)."""
    if type(key) is not bytes:
        raise UserError(f"{what}: keys must be bytes, got {type(key).__name__}")
    if not 0 < len(key) <= 0xFFFF:
        raise UserError(f"{what}: key length must be 1..65535 bytes, got {len(key)}")
    return key


def check_keys(keys: Sequence[bytes], what: str) -> list[bytes]:
    """Validates a batch of keys before anything is written."""
    if not isinstance(keys, (list, tuple)):
        raise UserError(f"{what}: keys must be a list of bytes, got {type(keys).__name__}")
    return [check_key(k, what) for k in keys]


def check_slots(slots: Sequence[int]) -> list[int]:
    """Slots given to ``put`` as Python ints (numpy integers too); a float, bool or string
    would name a slot only by silent conversion.

    Raises:
        UserError: naming the first slot that is not an integer.
    """
    for slot in slots:
        if isinstance(slot, (bool, np.bool_)) or not isinstance(slot, (int, np.integer)):
            raise UserError(f"NVMeStore.put: slots must be integers, got {slot!r}")
    return [int(s) for s in slots]


def check_encoded(buffers: Sequence[torch.Tensor], count: int, chunk_bytes: int, codec: Codec,
                  what: str) -> list[torch.Tensor]:
    """Encoded blocks must be ``count`` contiguous 1-D uint8 host tensors of ``chunk_bytes``.

    Raises:
        UserError: naming the first buffer that is not, with what it is.
    """
    if not isinstance(buffers, (list, tuple)) or len(buffers) != count:
        raise UserError(f"{what}: expected a list of {count} encoded blocks")
    for i, buf in enumerate(buffers):
        if not (isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8 and buf.shape == (chunk_bytes,)
                and buf.is_cpu and buf.is_contiguous()):
            got = f"{buf.dtype} {tuple(buf.shape)} on {buf.device}" if isinstance(buf, torch.Tensor) else type(buf).__name__
            raise UserError(f"{what}[{i}]: expected a contiguous host uint8 tensor of {chunk_bytes} bytes "
                            f"(codec {codec.value}), got {got}")
    return list(buffers)


@dataclass
class Opened:
    """An opened store's state, handed to ``NVMeStore``: the lock is held until the store
    releases it. ``counts`` go into the store's stats; ``needs_flush`` asks for a flush
    that makes recovery durable (dropped entries, a repaired or damaged journal)."""

    capacity: int
    table: SlotTable
    files: IndexFiles
    lock: StoreLock
    counts: dict[str, int] = field(default_factory=dict)
    needs_flush: bool = False


def open_store(path: str, layout: KVLayout, compression: str | None,
               capacity_blocks: int | str | None, create: bool, codec: Codec = Codec.NONE) -> Opened:
    """Creates or reopens the store at ``path`` under its lock (see the module docstring).

    Raises:
        UserError: as ``NVMeStore.__init__`` documents; the lock is released on any error.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{path}: is a file, not a store directory")
    meta = os.path.join(path, META_NAME)
    wanted = None if capacity_blocks is None else parse_capacity(capacity_blocks, layout, "NVMeStore capacity", codec)
    if wanted is not None:
        check_table_fits(wanted, path)  # before anything on disk is created
    if not os.path.lexists(meta):
        _check_creatable(path, wanted, create)
    if os.path.islink(path) and not os.path.exists(path):
        _refuse_broken_link(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{path}: cannot create the store directory ({exc.strerror or exc})") from None
    lock = None
    try:  # again under the lock, in the locked folder: a racing creator may have won, or have been killed
        lock = StoreLock.acquire(path)
        _check_locked_folder(path, lock)
        has_meta = chunkio.has_entry(meta, lock.dir_fd)
        if has_meta and not _unfinished_creation(path, lock.dir_fd):
            opened = _reopen(path, layout, compression, wanted, lock, codec)
        else:
            if wanted is None and create and has_meta:
                wanted = _recorded_capacity(path, layout, compression, codec, lock.dir_fd)
                check_table_fits(wanted, path)
            _check_creatable(path, wanted, create, lock.dir_fd)
            opened = _create(path, layout, compression, wanted, lock, codec)
    except BaseException:  # an OSError stays one (a full disk, out of descriptors): callers tell it apart
        if lock is not None:
            lock.release()
        raise
    return _held_open(path, opened)


def store_exists(path: str) -> bool | None:
    """True if ``path`` holds a store (its ``zarr.json``, beside more than what an unfinished
    creation leaves), None if that cannot be told (the folder cannot be listed): an open with
    ``capacity_blocks`` checks it against a store's, where an unfinished creation is created
    anew at that capacity. A check by path, before any lock: an open may still find it
    otherwise."""
    try:
        return os.path.lexists(os.path.join(path, META_NAME)) and not _unfinished_creation(path)
    except OSError:
        return None


def _check_locked_folder(path: str, lock: StoreLock) -> None:
    """Raises UserError unless ``path`` still names the folder ``lock`` holds (its lock file
    was taken there): a folder replaced meanwhile (a clean-up script) is refused, not opened
    half by its path and half by the folder held open."""
    try:
        here = os.stat(path)
    except OSError as exc:
        raise UserError(f"{path}: the store's folder went away while it opened ({exc.strerror}); open it again") from None
    if not os.path.samestat(here, os.fstat(lock.dir_fd)):
        raise UserError(f"{path}: the store's folder was replaced while it opened; open it again")


def _held_open(path: str, opened: Opened) -> Opened:
    """``opened``, once the path is checked to name its locked folder still; else its files
    are closed, its lock released, and the UserError of ``_check_locked_folder`` raised.
    Everything the open read, swept and wrote went through that folder's descriptor, so a
    folder swapped onto the path meanwhile was never touched: it is refused, not adopted."""
    try:
        _check_locked_folder(path, opened.lock)
    except BaseException:
        opened.files.close()
        opened.lock.release()
        raise
    return opened


def _refuse_broken_link(path: str) -> None:
    """Raises the UserError for a symbolic link that leads to no folder, by why: a loop, a
    target that does not exist, or one that cannot be reached."""
    try:
        os.stat(path)
        return
    except OSError as exc:
        why = {errno.ELOOP: "a loop of symbolic links", errno.ENOENT: "which does not exist"}.get(
            exc.errno, f"which cannot be reached ({exc.strerror})")
    raise UserError(f"{path}: is a symbolic link to {os.readlink(path)!r}, {why}; make that folder, or give "
                    "another path")


def _check_creatable(path: str, capacity: int | None, create: bool, dir_fd: int | None = None) -> None:
    """Refuses to create a store where none may be created (in the folder ``dir_fd`` holds
    open, when given); changes nothing."""
    if not create:
        raise UserError(f"{path}: no store there (create=False)")
    if (dir_fd is not None or os.path.isdir(path)) and not _unfinished_creation(path, dir_fd):
        raise UserError(f"{path}: directory is not empty and holds no tiercache store")
    if capacity is None:
        raise UserError(f"{path}: capacity_blocks is needed to create a store")


def _is_creation_leftover(name: str) -> bool:
    """True for the files a creation writes before its index snapshot: the lock,
    ``zarr.json`` and zarr's temp file for it (``zarr.<hex>.partial``), the snapshot's
    temp file."""
    return name in (LOCK_NAME, META_NAME, SNAPSHOT_TMP_NAME) or _ZARR_PARTIAL.fullmatch(name) is not None


def _unfinished_creation(path: str, dir_fd: int | None = None) -> bool:
    """True if the directory ``path`` (the folder ``dir_fd`` holds open, when given) holds
    nothing but creation leftovers (an empty one included). A store exists once its index
    snapshot does, and its blocks need chunk files and index entries: such a directory
    never held a block, so creating a store there discards nothing. Stops at the first
    other file (a store's directory may hold millions of chunks)."""
    with chunkio.scan_folder(path, dir_fd) as entries:
        return all(_is_creation_leftover(entry.name) for entry in entries)


def _recorded_capacity(path: str, layout: KVLayout, compression: str | None, codec: Codec, dir_fd: int) -> int:
    """The capacity an unfinished creation recorded in its ``zarr.json``, so that a reopen
    without ``capacity_blocks`` finishes it.

    Raises:
        UserError: that ``zarr.json`` is unreadable or records another layout, compression
            or codec (the caller's capacity_blocks would create the store anew).
    """
    try:
        return chunkio.check_store(path, layout, compression, None, codec, dir_fd)
    except UserError as exc:
        raise UserError(f"{path}: holds a store whose creation was interrupted (no index yet), and it cannot be "
                        f"finished: {exc}; pass capacity_blocks to create the store again") from None


def _create(path: str, layout: KVLayout, compression: str | None, capacity: int, lock: StoreLock, codec: Codec) -> Opened:
    """Creates the store in the locked directory (through its descriptor), which is empty
    or holds an unfinished creation (whose leftovers are removed first).

    ``zarr.json`` is written atomically and made durable before the empty snapshot,
    whose rename and directory fsync are the commit point: a kill before it leaves an
    unfinished creation, never a ``zarr.json`` without an index behind a complete one.
    """
    table = SlotTable(capacity)  # first: out of memory here leaves the folder as it was
    _remove_leftovers(path, lock.dir_fd)
    chunkio.create_array(path, layout, capacity, compression, codec, lock.dir_fd)
    files = IndexFiles(path, lock.dir_fd)
    try:
        files.create()
    except BaseException:  # its journal may be open (a failed fsync after it was made)
        files.close()
        raise
    table.finish_load()
    return Opened(capacity, table, files, lock)


def _remove_leftovers(path: str, dir_fd: int) -> None:
    """Deletes an unfinished creation's files from the folder ``dir_fd`` holds open (never
    the lock, never another file)."""
    with chunkio.scan_folder(path, dir_fd) as entries:
        names = [entry.name for entry in entries]
    for name in names:
        if name != LOCK_NAME and _is_creation_leftover(name):
            chunkio.unlink(os.path.join(path, name), dir_fd)


def _reopen(path: str, layout: KVLayout, compression: str | None, wanted: int | None, lock: StoreLock,
            codec: Codec) -> Opened:
    """Checks the stored format, loads the index, reconciles the directory with it, all in
    the locked folder (through its descriptor)."""
    dir_fd = lock.dir_fd
    capacity = chunkio.check_store(path, layout, compression, wanted, codec, dir_fd)
    table, files = SlotTable(capacity), IndexFiles(path, dir_fd)
    try:
        files.load(table)
        clean = _check_clean_mark(path, files, dir_fd)
        ndim = 1 + len(chunkio.chunk_geometry(layout, codec)[0])
        removed, dropped = sweep_directory(path, ndim, table, verify=not clean, dir_fd=dir_fd)
        _remove_clean_mark(path, dir_fd)  # before the store can write: a crash from here on is unclean
        files.owe(record_cost(table.unwritten_keys()))  # what flushes may still write for these entries
    except BaseException:
        files.close()
        raise
    counts = {"garbage_removed": removed, "recovered_dropped": dropped,
              "journal_repaired": files.repaired_batches, "journal_skipped": files.lost_batches,
              "snapshot_repaired": int(files.repaired_snapshot)}
    return Opened(capacity, table, files, lock, counts, bool(removed or dropped or files.need_snapshot))


def mark_clean(root: str, seq: int, dir_fd: int | None = None) -> None:
    """Records that the store closed cleanly at index sequence ``seq``: no write in
    flight, every chunk matches the durable index, every batch up to ``seq`` durable.
    Best effort (a full disk may refuse it: the next open then checks every chunk's
    trailer)."""
    try:
        chunkio.write_file_durably(os.path.join(root, CLEAN_NAME), _clean_mark(seq), dir_fd)
        chunkio.fsync_dir(root, dir_fd)
    except OSError:
        pass


def _clean_mark(seq: int) -> bytes:
    """The marker's bytes: ``seq`` and a crc32c of it, so that a damaged marker is never
    read as another sequence number."""
    text = str(seq).encode()
    return text + b" %08x\n" % sealed_crc(text, b"")


def _read_clean_mark(root: str, dir_fd: int | None) -> int | None:
    """The index sequence number the last clean close reached, or None (no marker, or one
    that is unreadable or fails its crc, such as one from an older tiercache)."""
    try:
        data = chunkio.read_small_file(os.path.join(root, CLEAN_NAME), dir_fd)[:64]
    except OSError:
        return None
    try:
        seq = int(data.split(b" ", 1)[0])
    except ValueError:
        return None
    return seq if data == _clean_mark(seq) else None


def _check_clean_mark(root: str, files: IndexFiles, dir_fd: int | None) -> bool:
    """True if the last close was clean at the sequence number the replay of ``files``
    reached. A marker naming a later one proves the batches between were acknowledged
    and then lost from the journal's tail: counted (``IndexFiles.lose_tail``), and the
    close counts as unclean (every chunk's trailer is checked)."""
    marked = _read_clean_mark(root, dir_fd)
    if marked is None or marked < files.seq:
        return False
    if marked > files.seq:
        files.lose_tail(marked)
        return False
    return True


def _remove_clean_mark(root: str, dir_fd: int | None) -> None:
    """Removes the clean-shutdown marker durably (nothing to do when absent).

    Raises:
        UserError: it cannot be removed (a later crash would then look clean).
    """
    path = os.path.join(root, CLEAN_NAME)
    try:
        chunkio.unlink(path, dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UserError(f"{path}: cannot remove the clean-shutdown marker ({exc.strerror or exc})") from None
    try:
        chunkio.fsync_dir(root, dir_fd)
    except OSError as exc:
        raise UserError(f"{root}: cannot make the store directory durable ({exc.strerror or exc})") from None


def sweep_directory(root: str, ndim: int, table: SlotTable, verify: bool = True,
                    dir_fd: int | None = None) -> tuple[int, int]:
    """Reconciles a store directory with its freshly loaded index (at open, before any I/O),
    in the folder ``dir_fd`` holds open when given (files named by their paths under ``root``).

    Keeps a live entry only if its chunk file has the entry's length and, when ``verify``
    is set (after an unclean shutdown), its crc trailer (4-byte read, no full read: reads
    verify the whole chunk anyway). Removes temp files
    and chunk files that no kept entry explains (writes that never reached the index:
    garbage; chunk files carry no key, so nothing else could adopt them). Forgets entries
    whose chunk is missing or does not match (persisted by the caller's next flush).

    Returns:
        ``(files removed, index entries dropped)``.

    Raises:
        UserError: an entry named like a chunk or temp file is not a regular file (a
            directory, a symlink): tiercache never makes one, so it is not garbage to
            delete; checked for every entry before anything is removed.
    """
    chunks, temps = _scan(root, ndim, dir_fd)
    live = table.live_slots()
    candidates = [(slot, path) for slot, (path, size) in chunks.items() if live.get(slot, (None,))[0] == size]
    kept = _trailers_match(candidates, live, dir_fd) if verify else {slot for slot, _ in candidates}
    garbage = temps + [path for slot, (path, _) in chunks.items() if slot not in kept]
    for path in garbage:
        chunkio.unlink(path, dir_fd)
    dropped = live.keys() - kept
    for slot in dropped:
        table.drop_slot(slot)
    return len(garbage), len(dropped)


def _scan(root: str, ndim: int, dir_fd: int | None) -> tuple[dict[int, tuple[str, int]], list[str]]:
    """Chunk files (``slot -> (path, size)``, paths under ``root``) and temp files of the
    folder (``dir_fd``: as ``sweep_directory``); refuses any such name that is not a
    regular file."""
    chunks, temps = {}, []
    with chunkio.scan_folder(root, dir_fd) as entries:
        for entry in entries:
            slot = chunkio.parse_chunk_slot(entry.name, ndim)
            if slot is None and not entry.name.startswith(TMP_PREFIX):
                continue
            mode = entry.stat(follow_symlinks=False).st_mode
            if not stat.S_ISREG(mode):
                kind = "symlink" if stat.S_ISLNK(mode) else "directory" if stat.S_ISDIR(mode) else "special file"
                raise UserError(f"{os.path.join(root, entry.name)}: named like a chunk of this store but is a {kind}; tiercache "
                                "writes only regular files there: move it away, then reopen")
            if slot is None:
                temps.append(os.path.join(root, entry.name))
            else:
                chunks[slot] = (os.path.join(root, entry.name), entry.stat(follow_symlinks=False).st_size)
    return chunks, temps


def _trailers_match(candidates: list[tuple[int, str]], live: dict[int, tuple[int, int]],
                    dir_fd: int | None) -> set[int]:
    """Slots whose chunk's last 4 bytes equal their entry's crc. One thread: with the
    page cache warm, a pool of threads contending for the GIL took 3x longer."""
    return {slot for slot, path in candidates if _read_trailer(path, live[slot][0], dir_fd) == live[slot][1]}


def _read_trailer(path: str, length: int, dir_fd: int | None) -> int | None:
    """The crc trailer of a chunk file of ``length`` bytes, or None if unreadable."""
    try:
        fd = chunkio.open_file(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd)
    except OSError:
        return None
    try:
        tail = os.pread(fd, 4, length - 4)
    except OSError:
        return None
    finally:
        os.close(fd)
    return int.from_bytes(tail, "little") if len(tail) == 4 else None
