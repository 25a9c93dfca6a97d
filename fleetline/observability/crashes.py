"""Python's report of a fatal signal (SIGSEGV, SIGABRT and the like: every thread's stack, on
the process's stderr), kept in front of the handlers native libraries install.

chdb's engine installs ClickHouse's own handlers for those signals when it starts, and they
write nowhere a process shows: a crash in the engine, or anywhere in the process after it
started, ended with an exit status and not a word (or hung for minutes in those handlers first).
`reinstall` puts Python's handler back in front, handing the signal on to the default action:
the process ends at once, with a core dump where the host keeps them."""

from __future__ import annotations

import ctypes
import faulthandler
import signal
import sys
from typing import TextIO

# The file chosen by `report_fatal_signals`, and whether every thread is reported or only the
# crashing one.
_reports_to: list[TextIO | int] = []
_all_threads = [True]
# The signals Python's fault handler reports.
_FATAL = tuple(
    getattr(signal, name)
    for name in ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS", "SIGILL")
    if hasattr(signal, name)
)


def report_fatal_signals(file: TextIO | int, *, all_threads: bool = True) -> None:
    """Report fatal signals on `file` (a stream, or a descriptor kept open), from now on: the
    stack of every thread, or with `all_threads` False the crashing thread's alone (first and
    short, where only the head of a long output is shown)."""
    _reports_to[:] = [file]
    _all_threads[0] = all_threads
    faulthandler.enable(file, all_threads=all_threads)


def reinstall() -> None:
    """Put the report back in front of a native library's handlers, where one is enabled (on
    the file it was given here, else on the process's stderr)."""
    if not faulthandler.is_enabled():
        return
    file = _reports_to[0] if _reports_to else sys.__stderr__
    if file is None:
        return
    faulthandler.disable()
    _default_actions()
    faulthandler.enable(file, all_threads=_all_threads[0])


def _default_actions() -> None:
    """The fatal signals' default action, for the report to hand them on to instead of the
    handlers it displaced. Through libc: Python's `signal.signal` works in the main thread
    only, and a store may open in any."""
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    for signum in _FATAL:
        libc.signal(signum, None)  # NULL is SIG_DFL
