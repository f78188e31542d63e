"""The reading half of ``remote.RemoteStore``: reading values into registered memory and
verifying them (``remote_values.verdict_of``), removing those that fail. A mixin of the
store (it uses its client calls, breaker, registered header rows and counters); it exists
to keep the store's module short, and is not used on its own.

A read's answer per key is True (a verified block), False (the store does not hold it, or
it failed verification: a miss the caller may drop) or ``NO_ANSWER`` (the store was not
asked, or did not answer: that says nothing about what it holds, so nothing is dropped).
"""

from __future__ import annotations

import errno
from typing import Sequence

import numpy as np
import torch

from .nvme_results import ReadIOError
from .pools import HEADER_BYTES
from .remote_values import header_rows, pieces, transfer_call, value_name, verdict_of

__all__ = ["RemoteReads", "NO_ANSWER", "HEADER_SLOTS"]

#: A read's answer for a key the store was not asked about or did not answer for (falsy: not
#: served; unlike False it says nothing about what the store holds).
NO_ANSWER = None

HEADER_SLOTS = 256  # headers registered per direction: the keys of one round


class RemoteReads:
    """``RemoteStore``'s reads (see the module docstring)."""

    def read_block(self, slot: int, key: bytes, dest: torch.Tensor) -> None:
        """Reads one block into ``dest`` through a staging row.

        Raises:
            ReadIOError: the store did not answer (a KeyError too; the block stays in the view).
            KeyError: the store does not hold the block, or its value failed verification.
        """
        row = len(self.staging) - 1
        answer = self.submit_get([key], [self.staging[row]]).result()[0]
        if answer is NO_ANSWER:
            raise ReadIOError({key: TimeoutError(errno.ETIMEDOUT, f"the remote store (master {self.config.master}) did not answer")})
        if not answer:
            raise KeyError(f"remote block {key.hex()} is missing or unreadable")
        dest.copy_(self.row_block(row, dest.dtype))

    def _get(self, keys: Sequence[bytes], payloads: Sequence[np.ndarray], inline: Sequence[np.ndarray] | None) -> list[bool | None]:
        ok: list[bool | None] = []
        for a in range(0, len(keys), HEADER_SLOTS):
            part = None if inline is None else inline[a : a + HEADER_SLOTS]
            ok.extend(self._get_batch(keys[a : a + HEADER_SLOTS], payloads[a : a + HEADER_SLOTS], part))
        return ok

    def _get_batch(self, keys: Sequence[bytes], payloads: Sequence[np.ndarray], inline: Sequence[np.ndarray] | None) -> list[bool | None]:
        """Up to 256 keys. One existence check first (at most ``timeout_s``; nothing is read
        when it fails), so a read started after the master stopped answering waits no longer
        than a lookup, and names the store does not hold count as ``missing`` with no
        transfer. Then every piece's batch get (``transfer_call``) of the names there is
        queued on the wire at once, and each piece is verified as soon as it landed (while
        the next moves)."""
        names = [value_name(self.tag, k) for k in keys]
        present = self._ask(names)
        if present is None:
            return [NO_ANSWER] * len(keys)
        self.stats["missing"] += int((~present).sum())
        todo = np.flatnonzero(present).tolist()
        ok = [False] * len(keys)
        for i, good in zip(todo, self._get_present([keys[i] for i in todo], [names[i] for i in todo],
                                                   [payloads[i] for i in todo], None if inline is None else [inline[i] for i in todo])):
            ok[i] = good
        return ok

    def _get_present(self, keys: Sequence[bytes], names: list[str], payloads: Sequence[np.ndarray],
                     inline: Sequence[np.ndarray] | None) -> list[bool | None]:
        """Reads and verifies the values of ``names`` (just found there), True for each served,
        ``NO_ANSWER`` for a piece whose call was skipped or failed as a whole."""
        headers = header_rows(inline, self.headers[HEADER_SLOTS:], payloads)
        moving = []
        for a, b in pieces(len(keys)):
            call = transfer_call("get", names[a:b], headers[a:b], payloads[a:b])
            moving.append((a, b, self._wire.submit(self._call, "get", call, b - a)))
        ok, damaged = [], []
        for a, b, future in moving:
            codes = future.result()
            if codes is None:
                ok.extend([NO_ANSWER] * (b - a))
                continue
            for i, code in zip(range(a, b), codes):
                verdict = verdict_of(code, headers[i], keys[i], payloads[i], self.tag)
                if verdict == "unreadable" and self._wrong_size(names[i], HEADER_BYTES + payloads[i].nbytes):
                    verdict = "corrupt"  # truncated or oversized: removed like any damaged value
                ok.append(verdict is None)
                if verdict is not None:
                    self.stats[verdict] += 1
                if verdict == "corrupt":
                    damaged.append(names[i])
        self.stats["gets"] += ok.count(True)
        if damaged:
            self._remove(damaged)
        return ok

    def _wrong_size(self, name: str, size: int) -> bool:
        """Whether the store holds ``name`` at another size than ``size`` (a truncated or
        oversized value: Mooncake fails its get with the same codes as a holder that is
        gone, so the size is asked; False when it cannot be)."""
        stored = self._call("size", lambda c: [c.get_size(name)], 0)
        return stored is not None and stored[0] >= 0 and stored[0] != size

    def _remove(self, names: list[str]) -> None:
        """Removes values that failed verification (best effort; ``removed`` counts those
        gone), so the next publisher of those blocks writes good ones instead of a no-op
        put. Forced: the failed read itself holds a lease on them."""
        codes = self._call("remove", lambda c: c.batch_remove(names, True), 0)
        if codes is not None:
            self.stats["removed"] += sum(code == 0 for code in codes)
