"""Deferring Ctrl-C (SIGINT) to the end of a critical section.

Python raises ``KeyboardInterrupt`` from its default SIGINT handler between any two
bytecodes, so a Ctrl-C can split a multi-statement update (a pin without its plan, a
release without the flag that says it happened). ``deferred_interrupts`` makes such a
section atomic with respect to Ctrl-C: while it runs, a SIGINT is only recorded, and the
``KeyboardInterrupt`` is raised when the outermost section ends, after its state is whole.

Scope (the invariants callers rely on):

* Main thread only (the only thread Python runs signal handlers in); elsewhere a no-op.
* Only when SIGINT's handler is Python's ``default_int_handler``: a program that installed
  its own handler keeps it, and gets no deferral (handlers that raise are not supported).
* Nesting-safe: inner sections are counted; only the outermost swaps the handler back and
  raises the recorded interrupt. A section costs two ``signal.signal`` calls (about 1 us
  each); nested sections cost a counter update.
* Interrupts raised by other signal handlers (SIGALRM, SIGTERM handlers that raise) are not
  deferred.
* Real Ctrl-Cs are counted where a caller asks (``counting_sigints``): a ``KeyboardInterrupt``
  that code raised itself (a policy's, say) is then told apart from one a SIGINT raised.
* Waits stay interruptible: inside ``interruptible_wait`` (the manager's wait for a move in
  flight, a point every caller already survives), a SIGINT that arrives while the thread is
  blocked in ``threading.Condition.wait`` is raised there, as without deferral, so a hung
  disk never makes a call deaf to Ctrl-C. ``uninterruptible`` (a close) turns that off.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["deferred_interrupts", "enter_deferred", "exit_deferred", "interruptible_wait", "uninterruptible",
           "counting_sigints", "raise_on_sigterm"]

_MAIN = threading.main_thread().ident
_depth = 0  # outermost active section = 1; touched only by the main thread
_pending = False  # a SIGINT arrived while deferred
_saved = None  # the handler the outermost section replaced
_waiting = 0  # main thread: nesting of ``interruptible_wait`` inside a deferred section
_shielded = 0  # main thread: nesting of ``uninterruptible`` (even waits defer)
_CONDITION_WAIT = threading.Condition.wait.__code__
_sigints = 0  # SIGINTs this module's handlers received (``counting_sigints``)


def _count(signum, frame) -> None:
    """Python's default SIGINT handler (raises ``KeyboardInterrupt``), counting each SIGINT."""
    global _sigints
    _sigints += 1
    signal.default_int_handler(signum, frame)


def _record(signum, frame) -> None:
    """The SIGINT handler while deferred: remembers the interrupt for the section's end, or
    raises it at once when the thread is blocked in an interruptible wait."""
    global _pending, _sigints
    _sigints += 1
    if _waiting and not _shielded and frame is not None and frame.f_code is _CONDITION_WAIT:
        raise KeyboardInterrupt
    _pending = True


def enter_deferred() -> None:
    """Starts a deferred section (pair with ``exit_deferred``, which must run even on error).

    A section that an exception from another signal handler cut short between its handler
    swap and its depth update leaves ``_record`` installed at depth 0: the next section
    adopts it (so Ctrl-C is never left recorded-only outside a section for long)."""
    global _depth, _saved
    if threading.get_ident() != _MAIN:
        return
    if _depth:
        _depth += 1
        return
    current = signal.getsignal(signal.SIGINT)
    if current is _record:  # left installed by a section cut short: adopt it
        _saved = signal.default_int_handler
    elif current is signal.default_int_handler or current is _count:
        _saved = signal.signal(signal.SIGINT, _record)  # from here a SIGINT is only recorded
    else:
        return  # someone else's handler: left alone (and _depth stays 0, so exit does nothing)
    _depth = 1


def exit_deferred() -> None:
    """Ends a deferred section; the outermost one restores the handler and raises the
    ``KeyboardInterrupt`` a SIGINT recorded meanwhile."""
    global _depth, _pending
    if threading.get_ident() != _MAIN or not _depth:
        return
    _depth -= 1
    if _depth:
        return
    signal.signal(signal.SIGINT, _saved)
    if _pending:
        _pending = False
        raise KeyboardInterrupt


class deferred_interrupts:  # noqa: N801 - used like a function: ``with deferred_interrupts():``
    """Context manager form of ``enter_deferred``/``exit_deferred``."""

    __slots__ = ()

    def __enter__(self) -> None:
        enter_deferred()

    def __exit__(self, *exc_info: object) -> None:
        exit_deferred()


class _Counted:
    """Counts a main-thread nesting level inside a deferred section (no-op elsewhere)."""

    __slots__ = ("_counted",)
    _name = ""

    def __enter__(self) -> None:
        self._counted = bool(_depth) and threading.get_ident() == _MAIN
        if self._counted:
            globals()[self._name] += 1

    def __exit__(self, *exc_info: object) -> None:
        if self._counted:
            globals()[self._name] -= 1


class interruptible_wait(_Counted):  # noqa: N801
    """Marks a blocking wait a Ctrl-C may interrupt at once (see the module docstring)."""

    __slots__ = ()
    _name = "_waiting"


class uninterruptible(_Counted):  # noqa: N801
    """Defers Ctrl-C even during ``interruptible_wait`` (a close must run to its end)."""

    __slots__ = ()
    _name = "_shielded"


class counting_sigints:  # noqa: N801 - used like a function: ``with counting_sigints() as ctrl_c:``
    """Counts the SIGINTs that arrive while it runs, each still raising ``KeyboardInterrupt``
    as Python's default handler does; ``ctrl_c.pressed()`` then tells a real Ctrl-C from a
    ``KeyboardInterrupt`` that code raised itself.

    Counts only in the main thread under Python's default handler (or inside another
    ``counting_sigints`` or a deferred section, which count too); elsewhere it installs
    nothing and ``pressed()`` is always True: any ``KeyboardInterrupt`` may be a Ctrl-C.
    """

    __slots__ = ("_counting", "_installed", "_start")

    def __enter__(self) -> "counting_sigints":
        current = signal.getsignal(signal.SIGINT) if threading.get_ident() == _MAIN else None
        self._counting = current in (signal.default_int_handler, _count, _record)
        self._installed = current is signal.default_int_handler
        self._start = _sigints
        if self._installed:
            signal.signal(signal.SIGINT, _count)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._installed and signal.getsignal(signal.SIGINT) is _count:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def pressed(self) -> bool:
        """Whether a SIGINT arrived since ``__enter__`` (True when it cannot be told)."""
        return not self._counting or _sigints != self._start


def raise_on_sigterm():
    """Makes SIGTERM (``timeout``, systemd, a batch scheduler) raise ``SystemExit`` with the
    shell's status for it (143), so that ``finally`` clauses run (a half-written file's
    temporary is removed, a sweep's workers are killed) instead of the process vanishing.
    Only a default disposition is replaced, and only in the main thread; returns the one to
    restore (None: left alone). Such a SystemExit is not deferred (see the module notes):
    callers install it around work a torn exit leaves nothing persistent half-done in."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)
