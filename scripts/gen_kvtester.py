"""Generates a seeded kv-cache-tester workload: one JSON file per conversation.

Shape (what serving traces of chat and document assistants look like):

* ``chat`` conversations: a shared system prompt (Zipf-popular among ``--prompts``), then turns;
  each turn's prompt is the previous turn's prompt plus the previous answer plus a new user
  message, so every request extends the previous turn's prefix. Think times are exponential.
* ``doc`` conversations: a system prompt and a long document (Zipf-popular among ``--docs``;
  the same document under the same prompt is the same prefix), then follow-up questions.
* ``oneoff`` requests: a single prompt nobody shares (written with local ids).

Ids name whole prefixes (a block id implies its parent), so shared prompts and documents use
``hash_id_scope: global``. Conversations start at seeded Poisson offsets (``start``).

    python scripts/gen_kvtester.py --out /tmp/kvt --conversations 600 --seed 1

Options are checked before anything is written (a bad one ends in one ``error:`` line naming
it, exit 2): counts are integers >= 1 (``--prompts`` and ``--docs`` at most 10**6), the block
size is in [1, 2**31), the seed in [0, 2**32), ``--turns`` a finite mean in [1, 100],
``--skew`` in [0, 10], ``--think`` and ``--gap`` finite seconds in [0, 10**6].

Output: ``--out`` is replaced whole, or left as it was. It must be a new folder, an empty one,
or one holding only this generator's own ``conv_NNNNN.json`` files (anything else in it is
refused, as it would be lost); its parent folder must exist. The files are written into a
fresh hidden folder beside it (``.NAME.XXXXXXXX.partial``), which is then renamed into place:
over a missing or empty ``--out`` in one ``rename``; over an earlier run's files by renaming
the old folder aside, the new one in, and removing the old one, with Ctrl-C and SIGTERM held
off (blocked) for those steps. An ``--out`` that cannot be renamed (a mount point, or a parent
folder not writable) is replaced in place instead: the files are written into a hidden
``.gen_kvtester.XXXXXXXX.partial`` folder inside it, then, signals held off, the old
``conv_NNNNN.json`` files are replaced by the new ones (each renamed over its namesake) and
the extra old ones removed; that swap is file by file, so an I/O error in the middle of it
(not a signal: those are held off) can leave some old files among the new. A signal held off
during a swap is delivered once it is done: the new set is then complete. So a rerun with fewer conversations or another seed never
leaves old files beside new ones, and an error, Ctrl-C or SIGTERM (exit 143) during the
writing leaves ``--out`` as it was and the hidden folder removed. The replacement over an earlier
run's folder is one atomic exchange of the two names where Linux and the filesystem offer it
(``renameat2(RENAME_EXCHANGE)``), so even a crash or SIGKILL leaves the old set or the new one
under ``--out``; elsewhere only a crash or SIGKILL between the two renames could leave the old
set under a hidden ``.NAME.XXXXXXXX.old`` name with ``--out`` missing. Nothing is ever left
mixed or partial under ``--out``.)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import signal
import stat
import sys
import threading
from typing import Callable, Iterator

import numpy as np

from tiercache.bench.rounds import checked_int, positive_int
from tiercache.bench.script_args import ScriptParser, seed_int
from tiercache.core.interrupts import raise_on_sigterm
from tiercache.data.libc import libc_function

#: The files this generator writes (``conv_00000.json``, more digits past 99,999).
OWN_FILE = re.compile(r"conv_[0-9]{5,}\.json")
#: The hidden staging folder's name inside an ``--out`` replaced in place (``_swap_files``).
STAGING_PREFIX = "gen_kvtester."
#: Most distinct shared prompts or documents (each conversation draws among them).
MAX_SHARED = 10**6
#: Longest part of ``--out``'s name kept in its hidden siblings' names (NAME_MAX is 255).
_NAME_KEPT = 200


class _Ids:
    """Global block ids: one range per (prompt, document) prefix, a counter for the rest."""

    def __init__(self) -> None:
        self.next = 0
        self.prefixes: dict[tuple, list[int]] = {}

    def fresh(self, n: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids

    def shared(self, key: tuple, n: int) -> list[int]:
        if key not in self.prefixes:
            self.prefixes[key] = self.fresh(n)
        return self.prefixes[key]


def _zipf_pick(rng: np.random.Generator, n: int, skew: float) -> int:
    weights = 1.0 / np.arange(1, n + 1) ** skew
    return int(rng.choice(n, p=weights / weights.sum()))


def _blocks(tokens: int, block: int) -> int:
    return max(1, tokens // block)


def _turns(rng, ids, prefix, n_turns, block, mean_think, user_tokens, kind):
    """Requests of a conversation whose turns extend ``prefix``."""
    requests, context, t = [], list(prefix), 0.0
    for _ in range(n_turns):
        user = int(rng.integers(*user_tokens))
        context = context + ids.fresh(_blocks(user, block))
        out = int(rng.integers(30, 600))
        requests.append({"t": round(t, 3), "in": len(context) * block, "out": out, "hash_ids": list(context),
                         "type": kind})
        context = context + ids.fresh(_blocks(out, block))
        t += float(rng.exponential(mean_think)) + out / 50.0
    return requests


def conversation(rng: np.random.Generator, ids: _Ids, args: argparse.Namespace, prompt_len: list[int],
                 doc_len: list[int]) -> dict:
    """One conversation's file content (without ``start``)."""
    block = args.block_size
    kind = rng.choice(["chat", "doc", "oneoff"], p=[0.6, 0.25, 0.15])
    if kind == "oneoff":
        n = int(rng.integers(5, 120))
        return {"block_size": block, "hash_id_scope": "local",
                "requests": [{"t": 0.0, "in": n * block, "out": int(rng.integers(30, 600)), "hash_ids": list(range(n)),
                              "type": "oneoff"}]}
    p = _zipf_pick(rng, len(prompt_len), args.skew)
    prefix = ids.shared(("prompt", p), prompt_len[p])
    if kind == "doc":
        d = _zipf_pick(rng, len(doc_len), args.skew)
        prefix = prefix + ids.shared(("doc", p, d), doc_len[d])
        requests = _turns(rng, ids, prefix, int(rng.geometric(0.4)), block, args.think, (20, 200), "doc")
    else:
        requests = _turns(rng, ids, prefix, int(rng.geometric(1 / args.turns)), block, args.think, (20, 400), "chat")
    return {"block_size": block, "hash_id_scope": "global", "requests": requests}


def write_conversations(args: argparse.Namespace, folder: str) -> int:
    """Writes the workload's ``conv_NNNNN.json`` files into ``folder``; returns the number of requests."""
    rng = np.random.default_rng(args.seed)
    ids = _Ids()
    prompt_len = [int(rng.integers(8, 48)) for _ in range(args.prompts)]
    doc_len = [int(rng.integers(60, 400)) for _ in range(args.docs)]
    start, total = 0.0, 0
    for index in range(args.conversations):
        conv = conversation(rng, ids, args, prompt_len, doc_len)
        conv["start"] = round(start, 3)
        start += float(rng.exponential(args.gap))
        total += len(conv["requests"])
        with open(os.path.join(folder, f"conv_{index:05d}.json"), "w", encoding="utf-8") as fh:
            json.dump(conv, fh, separators=(",", ":"), allow_nan=False)
    return total


def generate(args: argparse.Namespace) -> int:
    """Writes the workload to ``args.out`` whole (see the module notes); returns the number
    of requests. On any error or interrupt ``args.out`` is left as it was (but for an I/O
    error in the middle of an in-place swap: the module notes).

    Raises:
        OSError: a step failed (the staging folder is removed first).
    """
    target = os.path.realpath(args.out)
    inside = _replaced_in_place(target)
    staging = os.path.join(target, f".{STAGING_PREFIX}{secrets.token_hex(4)}.partial") if inside else _sibling(target, "partial")
    os.mkdir(staging, 0o777)  # the umask applies, as to a folder os.makedirs creates
    try:
        if not inside:
            with contextlib.suppress(FileNotFoundError):  # an existing --out keeps its permissions
                os.chmod(staging, stat.S_IMODE(os.stat(target).st_mode))
        total = write_conversations(args, staging)
        (_swap_files if inside else _swap_in)(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return total


def _replaced_in_place(target: str) -> bool:
    """Whether ``target``, an existing folder, cannot be renamed (a mount point, a parent
    folder this user may not write): its files are then swapped inside it (``_swap_files``)."""
    parent = os.path.dirname(target)
    return os.path.isdir(target) and (os.path.ismount(target) or not os.access(parent, os.W_OK | os.X_OK))


def _swap_files(staging: str, target: str) -> None:
    """Replaces ``target``'s ``conv_NNNNN.json`` files by those of ``staging`` (a folder inside
    it, on its filesystem): the old ones removed, the new ones renamed in, ``staging`` and any
    staging folder an earlier killed run left removed, with Ctrl-C and SIGTERM held off."""
    with _signals_held():
        new = sorted(os.listdir(staging))
        for name in new:  # each replaces its namesake at once; the earlier run's extra files go after
            os.rename(os.path.join(staging, name), os.path.join(target, name))
        for entry in os.scandir(target):
            if OWN_FILE.fullmatch(entry.name) and entry.name not in new:
                os.unlink(entry.path)
        for entry in os.scandir(target):
            if entry.name.startswith("." + STAGING_PREFIX) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)


def _sibling(target: str, kind: str) -> str:
    """A hidden name beside ``target`` that does not exist yet: ``.NAME.XXXXXXXX.kind``."""
    folder, name = os.path.split(target)
    while True:
        path = os.path.join(folder, f".{name[:_NAME_KEPT]}.{secrets.token_hex(4)}.{kind}")
        if not os.path.lexists(path):
            return path


def _swap_in(staging: str, target: str) -> None:
    """Renames the finished ``staging`` folder to ``target``; an earlier run's folder there is
    renamed aside first and removed after (Ctrl-C and SIGTERM held off meanwhile)."""
    with _signals_held():
        try:
            os.rename(staging, target)  # target missing or an empty folder: one step
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if _exchange(staging, target):  # one atomic step: staging now holds the old set
            shutil.rmtree(staging, ignore_errors=True)
            return
        old = _sibling(target, "old")
        os.rename(target, old)
        try:
            os.rename(staging, target)
        except BaseException:
            if not os.path.lexists(target):
                os.rename(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)


_renameat2 = libc_function("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint])
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: str, b: str) -> bool:
    """Swaps the names ``a`` and ``b`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``), so
    no crash leaves either name missing; False, nothing done, where the platform, libc or
    filesystem cannot (the caller then renames in two steps)."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), b)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Blocks SIGINT and SIGTERM (main thread, where the platform can): one that arrives
    meanwhile is delivered when the block ends."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def output_folder(text: str) -> str:
    """argparse type of ``--out``: a folder this generator may replace whole.

    Raises:
        argparse.ArgumentTypeError: an empty name, a missing or unwritable parent folder, a
            path that is not a folder, or a folder holding anything but ``conv_NNNNN.json`` files.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError("empty folder name")
    target = os.path.realpath(text)
    parent = os.path.dirname(target)
    if not os.path.basename(target) or target == os.path.realpath(os.curdir):
        raise argparse.ArgumentTypeError(f"{text}: give a folder of its own to write conv_NNNNN.json files into")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: folder {parent} does not exist")
    if not os.path.lexists(target):
        if not os.access(parent, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"{text}: folder {parent} is not writable")
        return text
    if not os.path.isdir(target):
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a folder")
    if not os.access(target, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: not writable")
    try:
        with os.scandir(target) as entries:
            foreign = sorted(e.name for e in entries
                             if not (OWN_FILE.fullmatch(e.name) and e.is_file(follow_symlinks=False))
                             and not (e.name.startswith("." + STAGING_PREFIX) and e.is_dir(follow_symlinks=False)))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: cannot read: {exc.strerror or exc}") from None
    if foreign:
        raise argparse.ArgumentTypeError(
            f"{text} holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} this generator did not write "
            f"(e.g. {foreign[0]!r}), which replacing it would lose; give a new or empty folder, or one of "
            "conv_NNNNN.json files only")
    return text


def bounded_float(low: float, high: float, expected: str) -> Callable[[str], float]:
    """argparse type of a finite number in ``[low, high]`` (nan and inf refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not low <= value <= high:  # nan fails both
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse


def block_size(text: str) -> int:
    """argparse type of ``--block-size``: tokens per block, in [1, 2**31) as readers take."""
    return checked_int(text, 1, 2**31 - 1, "a positive integer", "a block size from 1 to 2**31 - 1")


def shared_count(text: str) -> int:
    """argparse type of ``--prompts``/``--docs``: an integer in [1, MAX_SHARED]."""
    return checked_int(text, 1, MAX_SHARED, "a positive integer", f"an integer from 1 to {MAX_SHARED}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, every one checked before anything is written (a bad one: one line, exit 2)."""
    parser = ScriptParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=output_folder,
                        help="folder to write conv_NNNNN.json files into (replaced whole)")
    parser.add_argument("--conversations", type=positive_int, default=600)
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--block-size", type=block_size, default=64, help="tokens per block")
    parser.add_argument("--prompts", type=shared_count, default=12, help="distinct shared system prompts")
    parser.add_argument("--docs", type=shared_count, default=40, help="distinct shared documents")
    parser.add_argument("--skew", type=bounded_float(0.0, 10.0, "a skew from 0 to 10"), default=1.0,
                        help="Zipf skew of prompt and document popularity")
    parser.add_argument("--turns", type=bounded_float(1.0, 100.0, "a mean from 1 to 100"), default=4.0,
                        help="mean turns of a chat")
    parser.add_argument("--think", type=bounded_float(0.0, 1e6, "seconds from 0 to 1e6"), default=30.0,
                        help="mean think time between turns (s)")
    parser.add_argument("--gap", type=bounded_float(0.0, 1e6, "seconds from 0 to 1e6"), default=2.0,
                        help="mean gap between conversation starts (s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = raise_on_sigterm()  # SIGTERM ends the run as Ctrl-C does: generate removes its staging folder
    try:
        total = generate(args)
    except OSError as exc:
        print(f"error: --out {args.out}: cannot write: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: --out {args.out} is as it was, or holds the new set whole if the swap had begun",
              file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(f"wrote {args.conversations} conversations, {total} requests to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
