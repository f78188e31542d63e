"""The files of a kv-cache-tester workload folder: which entries are conversations, and the
one warning for those that are not read.

A folder's conversations are its top-level ``*.json`` and ``*.json.gz`` files, in any case;
subfolders and other files are skipped (``skipped_entries_warning`` names them). A
conversation present both plain and gzipped (``a.json`` beside ``a.json.gz``, as ``gzip -k``
leaves them) is refused: read twice, its second copy would hit everything the first stored.
"""

from __future__ import annotations

import os

from tiercache.errors import TraceError

__all__ = ["GZIP_SUFFIX", "is_conversation_name", "conversation_files", "skipped_entries_warning"]

GZIP_SUFFIX = ".json.gz"
_SUFFIXES = (".json", GZIP_SUFFIX)


def is_conversation_name(name: str) -> bool:
    """Whether a folder's entry ``name`` is read as a conversation file: ``*.json`` or
    ``*.json.gz`` (gzipped), in any case (``a.JSON``)."""
    return name.lower().endswith(_SUFFIXES)


def conversation_files(name: str) -> list[str]:
    """The conversation files of a workload: ``name`` itself, or a folder's top-level entries
    that ``is_conversation_name`` takes, sorted (subfolders and other files are not read:
    ``skipped_entries_warning`` names them)."""
    if not os.path.isdir(name):
        return [name]
    files = sorted(os.path.join(name, f) for f in os.listdir(name) if is_conversation_name(f))
    if not files:
        raise TraceError(name, None, "no conversation files (*.json) nor gzipped ones (*.json.gz) in the folder")
    _refuse_twins(files)
    return files


def _refuse_twins(files: list[str]) -> None:
    """Refuses a folder holding one conversation plain and gzipped (``a.json`` and
    ``a.json.gz``, names compared in any case), naming both."""
    plain = {f.lower(): f for f in files if not f.lower().endswith(GZIP_SUFFIX)}
    for file in files:
        twin = plain.get(file.lower()[:-len(".gz")]) if file.lower().endswith(GZIP_SUFFIX) else None
        if twin is not None:
            raise TraceError(file, None, f"{twin} is in the folder too: one conversation plain and gzipped (as gzip -k "
                                         "leaves it) would be read twice, the second copy hitting everything the first "
                                         "stored; keep one of the two")


def skipped_entries_warning(path: str | os.PathLike) -> str | None:
    """The one ``warning:`` line for a workload folder's entries that are not read as
    conversations (subfolders, and files not named ``*.json``/``*.json.gz``), naming how many
    and one of them (a subfolder or a ``.json``-like name first); None for a file, or a folder
    whose entries are all read. Lists the folder once; opens nothing."""
    name = os.fspath(path)
    try:
        skipped = sorted(f for f in os.listdir(name) if not is_conversation_name(f)) if os.path.isdir(name) else []
    except OSError:
        return None
    if not skipped:
        return None
    folders = {f for f in skipped if os.path.isdir(os.path.join(name, f))}
    first = min(skipped, key=lambda f: (f not in folders and ".json" not in f.lower(), f))
    shown = os.path.join(name, first) + (os.sep if first in folders else "")
    count = f"{len(skipped)} entries" if len(skipped) > 1 else "1 entry"
    return (f"warning: {name}: {count} not read, e.g. {shown}: a workload folder's conversations are its own "
            "*.json and *.json.gz files (any case); subfolders and other files are skipped")


