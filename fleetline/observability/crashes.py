"""Python's report of a fatal signal (SIGSEGV, SIGABRT and the like: every thread's stack, on
the process's stderr), kept in front of the handlers native libraries install.

chdb's engine installs ClickHouse's own handlers for those signals when it starts, and they
write nowhere a process shows: a crash in the engine, or anywhere in the process after it
started, ended with an exit status and not a word. `reinstall` puts Python's handler back in
front (it runs first, then hands the signal on to the one it displaced)."""

from __future__ import annotations

import faulthandler
import sys
from typing import TextIO

_reports_to: list[TextIO | int] = []  # the file chosen by `report_fatal_signals`


def report_fatal_signals(file: TextIO | int) -> None:
    """Report fatal signals on `file` (a stream, or a descriptor kept open), from now on."""
    _reports_to[:] = [file]
    faulthandler.enable(file, all_threads=True)


def reinstall() -> None:
    """Put the report back in front of a native library's handlers, where one is enabled (on
    the file it was given here, else on the process's stderr)."""
    if not faulthandler.is_enabled():
        return
    file = _reports_to[0] if _reports_to else sys.__stderr__
    if file is None:
        return
    faulthandler.disable()
    faulthandler.enable(file, all_threads=True)
