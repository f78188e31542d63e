"""Writing one user-named output file whole, or leaving the previous one as it was.

A file named with ``--out`` or ``--json`` may already hold earlier results. It is written
to a temporary file in the same folder, flushed to disk (``fsync``) and renamed over the
target in one step (``os.replace``), so a write that fails part-way (a full disk, a file
size limit, Ctrl-C) leaves the target as it was and no temporary file behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import tempfile
from typing import Callable, TypeVar

from ..errors import UserError

__all__ = ["check_output_file", "check_not_the_trace", "creation_refused", "replace_file", "replace_file_with"]

T = TypeVar("T")

#: Longest part of the target's name kept in the temporary file's name (NAME_MAX is 255).
_NAME_KEPT = 200


def replace_file(path: str | os.PathLike, data: str | bytes, label: str) -> None:
    """Writes ``data`` (a str as UTF-8) to ``path`` whole, or not at all.

    Invariants: those of ``replace_file_with``.

    Args:
        path: the file to write.
        data: its whole contents.
        label: names the file in the error, e.g. ``"--out results.json"``.

    Raises:
        UserError: ``f"{label}: cannot write: {reason}"`` when any step fails.
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data

    def write(name: str) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC)
        try:
            _write_all(fd, payload)
        finally:
            os.close(fd)

    replace_file_with(path, write, label)


def replace_file_with(path: str | os.PathLike, write: Callable[[str], T], label: str) -> T:
    """Runs ``write(name)`` on a new temporary file beside ``path``, then renames it over ``path``.

    Invariants: on return ``path`` holds exactly what ``write`` wrote; on an error (or
    Ctrl-C, or MemoryError) it holds what it held before (or still does not exist) and no
    temporary file is left. A symlink is followed (the file it points to is replaced); an
    existing path that is not a regular file (``/dev/null``, a pipe) is written directly,
    as nothing can be renamed over it.

    Args:
        path: the file to write.
        write: writes the whole contents to the file it is given (it may open it anew).
        label: names the file in the error, e.g. ``"--out results.json"``.

    Returns:
        What ``write`` returned.

    Raises:
        UserError: ``f"{label}: cannot write: {reason}"`` when any step fails.
    """
    target = os.path.realpath(path)
    try:
        if os.path.exists(target) and not os.path.isfile(target) and not os.path.isdir(target):
            return write(target)
        return _write_and_rename(target, write)
    except OSError as exc:
        raise UserError(f"{label}: cannot write: {exc.strerror or exc}") from None


def _write_and_rename(target: str, write: Callable[[str], T]) -> T:
    """Creates a temporary file beside ``target``, has ``write`` fill it, syncs it and renames
    it over ``target``."""
    folder, name = os.path.split(target)
    if not os.path.isdir(folder):
        raise FileNotFoundError(errno.ENOENT, f"folder {folder} does not exist")
    temp = os.path.join(folder, f".{name[:_NAME_KEPT]}.{secrets.token_hex(4)}.partial")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)  # the umask applies
    try:
        try:
            _keep_mode(fd, target)
        finally:
            os.close(fd)
        result = write(temp)
        _fsync_file(temp)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _sync_folder(folder)
    return result


def _fsync_file(name: str) -> None:
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _keep_mode(fd: int, target: str) -> None:
    """Gives the temporary file the permission bits of the file it will replace, if any."""
    with contextlib.suppress(FileNotFoundError):
        os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))


def _write_all(fd: int, payload: bytes) -> None:
    """``os.write`` until every byte is written (a short write is not an error)."""
    view = memoryview(payload)
    while view:
        view = view[os.write(fd, view):]


def _sync_folder(folder: str) -> None:
    """Makes the rename durable where the platform allows (best effort: it already happened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_output_file(path: str, option: str) -> None:
    """Checks, before any work, that ``path`` can receive a file: for a regular or new file,
    that a file can be created beside it (``creation_refused``), as writing it will.

    Raises:
        UserError: ``path`` is empty or a folder, its folder is missing or not writable, or
            refuses a new file (named, with the system's reason).
    """
    if not path.strip():
        raise UserError(f"{option}: empty file name")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UserError(f"{option} {path}: is a folder; give a file name")
    if not os.path.isdir(folder):
        raise UserError(f"{option} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UserError(f"{option} {path}: not writable")
    if os.path.exists(path) and not os.path.isfile(path):
        return  # a device or a pipe is written in place (``replace_file_with``), no file created beside it
    beside = os.path.dirname(os.path.realpath(path))  # where ``replace_file_with`` creates its temporary file
    refused = creation_refused(beside)
    if refused:
        raise UserError(f"{option} {path}: cannot create a file in {beside}: {refused}")


def creation_refused(folder: str | os.PathLike) -> str | None:
    """Why no file can be created in ``folder`` (the system's reason), or None if one can.

    Creates an empty hidden file there and removes it at once: permission bits do not tell
    (root passes every ``os.access`` check, yet ``/proc`` refuses every new file).
    """
    try:
        fd, name = tempfile.mkstemp(prefix=".tiercache-probe-", suffix=".partial", dir=folder)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return None


def check_not_the_trace(path: str, trace: str, option: str) -> None:
    """Refuses an output file that is the trace itself, or lies in a trace folder (whose
    ``*.json`` files are its kv-cache-tester conversations), before any work.

    Raises:
        UserError: writing ``path`` would overwrite or change the trace; names ``option``.
    """
    out, source = os.path.realpath(path), os.path.realpath(trace)
    if same_file(path, trace):
        raise UserError(f"{option} {path}: is the trace being replayed; writing results there would overwrite it "
                        "(give another file)")
    if os.path.isdir(source) and os.path.dirname(out) == source:
        raise UserError(f"{option} {path}: lies in the trace folder {trace}, whose files make up the trace; "
                        "give a file outside it")


def same_file(first: str, second: str) -> bool:
    """Whether two paths name one file: the same resolved path (through symlinks), or, both
    existing, the same inode (a hard link)."""
    a, b = os.path.realpath(first), os.path.realpath(second)
    return a == b or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))
