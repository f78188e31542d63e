"""Writing a report folder all at once, or not at all.

Files are written into a temporary folder beside the target and renamed into place, so an
error (or Ctrl-C) never leaves half a report behind. A report folder carries a marker file
naming the files the report wrote; only an empty folder, or one with the marker that holds
nothing else (no file added since, no folder), is ever replaced, so ``-o`` pointed at the
wrong folder, or at a report someone kept notes in, cannot delete their files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Mapping

from ..errors import UserError
from ..results import ResultsDocument
from ..results.outfile import creation_refused
from .document import Document
from .html import render_html
from .markdown import render_markdown

__all__ = ["MARKER", "check_output_dir", "visible_text", "write_folder", "write_report"]

#: Marks a folder as written by ``tiercache compare/report`` (safe to replace).
MARKER = ".tiercache-report"
#: Every name a report wrote before its marker listed its files: such a marker vouches for
#: these alone (a user's ``notes.md`` or ``my_run.json`` is not one of them).
_LEGACY_FILES = re.compile(r"index\.html|report\.md|split\.md|gaps\.md|results\.csv|results(_first_half)?\.json"
                           r"|(miss_ratio|tiers|movement|prefix_savings)(_[a-z0-9_-]+)?\.png|fleet(_[0-9]+)?\.png")
#: Files an operating system's file browser drops into folders it shows: replaced with the report.
_SYSTEM_FILES = frozenset({".DS_Store", "Thumbs.db", "desktop.ini"})
# A lone surrogate: what Python makes of a file name's bytes that are not UTF-8.
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_output_dir(out: str) -> Path:
    """Checks that ``out`` may receive a report, before any work is done.

    Raises:
        UserError: ``out`` is a file, a non-empty folder that is not a previous report, or
            cannot be created (its nearest existing ancestor is a file, not writable, or
            refuses a new file: ``creation_refused``).
    """
    target = Path(out)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise UserError(f"-o {out}: exists and is not a folder; give a new folder name")
    ancestor = target.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"-o {out}: cannot create a folder under {ancestor} (not a writable folder)")
    refused = creation_refused(ancestor)  # what the permission bits miss: root in /proc
    if refused:
        raise UserError(f"-o {out}: cannot create a folder under {ancestor} ({refused})")
    if target.is_dir() and not (target / MARKER).is_file() and any(target.iterdir()):
        raise UserError(
            f"-o {out}: the folder exists and is not a tiercache report (no {MARKER} file); "
            "give a new or empty folder, or a previous report's folder to replace it"
        )
    foreign = _not_the_reports(target) if target.is_dir() else []
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UserError(f"-o {out}: a previous report, but it holds what the report did not write ({shown}), which "
                        "replacing it would delete; move that away, or give another folder")
    return target


def _not_the_reports(folder: Path) -> list[str]:
    """The entries of a report folder that its report did not write, sorted: any not named
    in its marker's ``files`` (for a marker without that list, any name no report wrote:
    ``_LEGACY_FILES``), and any that is not a regular file. ``_SYSTEM_FILES`` are not counted."""
    listed = _listed_files(folder / MARKER)
    foreign = []
    for entry in os.scandir(folder):
        if entry.name == MARKER or (entry.name in _SYSTEM_FILES and entry.is_file(follow_symlinks=False)):
            continue
        written = entry.name in listed if listed is not None else _LEGACY_FILES.fullmatch(entry.name) is not None
        if not written or not entry.is_file(follow_symlinks=False):
            foreign.append(entry.name)
    return sorted(foreign)


def _listed_files(marker: Path) -> set[str] | None:
    """The file names a report's marker lists, or None (a marker from before it listed them,
    or unreadable)."""
    try:
        files = json.loads(marker.read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return set(files) if isinstance(files, list) and all(isinstance(f, str) for f in files) else None


def write_report(out: str, document: Document, csv_text: str, results: ResultsDocument | None, version: str,
                 extra: Mapping[str, str] | None = None) -> list[str]:
    """Writes ``index.html``, ``report.md``, the PNGs, ``results.csv`` (and ``results.json``).

    Args:
        out: the report folder; replaced if it holds a previous report.
        document: the report's content.
        csv_text: the contents of ``results.csv``.
        results: a results document to save as ``results.json`` (None: not written).
        version: tiercache version recorded in the marker.
        extra: more files of the folder, name -> text (``compare --split``'s), written with the rest.

    Returns:
        The names of the files written, sorted.

    Raises:
        UserError: as ``write_folder``.
    """
    files: dict[str, str | bytes] = {image.filename: image.png for image in document.images()}
    files["index.html"] = render_html(document)
    files["report.md"] = render_markdown(document)
    files["results.csv"] = csv_text
    if results is not None:
        files["results.json"] = json.dumps(results.to_json(), indent=1) + "\n"
    files.update(extra or {})
    return write_folder(out, files, version)


def write_folder(out: str, files: Mapping[str, str | bytes], version: str | None) -> list[str]:
    """Writes ``files`` (name -> contents; a str as UTF-8, lone surrogates escaped as
    ``visible_text`` does) and the marker as the folder ``out``.

    Invariants: on return ``out`` holds exactly ``files`` and the marker; after any error
    (a disk that fills up part-way, Ctrl-C) ``out`` is as it was, a previous report kept
    whole, and no temporary folder is left.

    Args:
        out: the folder (``-o``); replaced if it holds a previous report.
        files: the folder's files.
        version: tiercache version recorded in the marker (None: not recorded).

    Returns:
        The names of the files written, sorted (the marker left out).

    Raises:
        UserError: ``out`` may not receive a report (``check_output_dir``) or cannot be
            written; the message names ``out`` and the reason.
    """
    target = check_output_dir(out)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as exc:
        raise UserError(f"-o {out}: cannot create the report folder: {exc.strerror or exc}") from None
    try:
        _write_files(staging, files, version)
        os.chmod(staging, 0o755)  # mkdtemp makes it private; a report is meant to be shared
        _swap_in(staging, target)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"-o {out}: cannot write the report: {exc.strerror or exc}; nothing written") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return sorted(files)


def _write_files(folder: Path, files: Mapping[str, str | bytes], version: str | None) -> None:
    marker = {"tiercache_report": 1, "files": sorted(files)}
    if version is not None:
        marker["version"] = version
    for name, data in {**files, MARKER: json.dumps(marker) + "\n"}.items():
        if isinstance(data, bytes):
            (folder / name).write_bytes(data)
        else:
            (folder / name).write_text(visible_text(data), encoding="utf-8")


def visible_text(text: str) -> str:
    """``text`` with every lone surrogate written as a visible escape, so that it encodes as
    UTF-8: a byte of a file name that is not UTF-8 (which ``os.listdir`` and ``sys.argv``
    hand over as ``\\udc80``-``\\udcff``) as ``\\xNN``, any other lone surrogate as ``\\uNNNN``.
    Text without one is returned as it is."""
    return _SURROGATE.sub(_escape_surrogate, text)


def _escape_surrogate(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"


def _swap_in(staging: Path, target: Path) -> None:
    """Renames ``staging`` to ``target``; a previous report is moved aside first, then deleted."""
    if not target.exists():
        staging.rename(target)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    aside.rmdir()  # only the unique name is wanted: rename needs a free path
    try:  # both renames in one try: Ctrl-C or SIGTERM right after the first still puts it back
        target.rename(aside)
        staging.rename(target)
    except BaseException:
        if aside.exists() and not target.exists():
            aside.rename(target)  # put the previous report back
        raise
    shutil.rmtree(aside, ignore_errors=True)
