"""Reading and writing one ``results.json`` file: ``read_results`` (the file's checks, then
the strict reader of every version, ``reader``) and ``write_results`` (whole or not at all,
``outfile.replace_file``). The records and the versions are ``records``'. Metadata plane:
no torch, no numpy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import UserError
from .outfile import replace_file
from .records import ResultsDocument

__all__ = ["read_results", "write_results"]


def read_results(path: str | Path) -> ResultsDocument:
    """Reads and checks one results.json.

    Raises:
        UserError: missing, empty or non-JSON file, a key repeated in one object (which of
            its values a reader keeps is not defined), or as ``ResultsDocument.from_json``.
    """
    file = Path(path)
    if file.is_dir():
        raise UserError(f"{path}: is a directory, not a results file")
    if not file.is_file():
        raise UserError(f"{path}: no such results file" if not file.exists() else
                        f"{path}: not a regular file (a device, FIFO or socket), not a results file")
    text = file.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise UserError(f"{path}: the results file is empty (no runs)")
    try:
        data = json.loads(text, object_pairs_hook=_refuse_repeats)
    except _RepeatedKey as exc:
        raise UserError(f"{path}: not a results file: the key {exc.args[0]!r} appears twice in one object "
                        "(a JSON reader would keep either; a file tiercache wrote never repeats one)") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not a JSON results file ({exc.msg}: line {exc.lineno} column {exc.colno})") from None
    except ValueError:  # an integer literal of more digits than Python converts
        raise UserError(f"{path}: not a results file (a number of more than {sys.get_int_max_str_digits()} digits)") from None
    except RecursionError:
        raise UserError(f"{path}: not a results file (JSON nested too deeply)") from None
    return ResultsDocument.from_json(data, str(path))


class _RepeatedKey(ValueError):
    """A JSON object of a results file names one key twice (its name, ``args[0]``)."""


def _refuse_repeats(pairs: list[tuple[str, object]]) -> dict:
    """``json.loads``'s object hook: the object, unless a key appears twice in it."""
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        raise _RepeatedKey(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return data


def write_results(path: str | Path, document: ResultsDocument, option: str) -> None:
    """Writes ``document`` as results.json, whole or not at all: a write that fails part-way
    leaves an earlier file at ``path`` as it was (``outfile.replace_file``).

    Invariants: a file written here is one ``read_results`` accepts; a figure that is not a
    finite number (which the reader refuses) fails the write instead.

    Raises:
        UserError: the file cannot be written, or a figure is NaN or infinite (the message
            names ``option`` and the file).
    """
    try:
        text = json.dumps(document.to_json(), indent=1, allow_nan=False)
    except ValueError:
        raise UserError(f"{option} {path}: a figure of this run is not a finite number (NaN or infinite); "
                        "nothing was written") from None
    replace_file(path, text, f"{option} {path}")
