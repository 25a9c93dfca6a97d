"""A process that crashes (SIGSEGV) after it opened the embedded ClickHouse store still says
where: chdb's engine puts ClickHouse's own signal handlers first when it starts, and those
write nowhere a process shows (the test suite's process died twice of a segmentation fault
without a word before this). Where a crash is native, `make test` prints the crashing thread's
native frames from its core, last (`tools/crash_backtrace.py`)."""

from __future__ import annotations

import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = str(Path(__file__).with_name("crash_child.py"))
TOOLS = Path(__file__).parents[2] / "tools"


def no_core() -> None:
    """In the crashing child: no core file (`make test` allows them, to read the suite's own)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


CRASH = """
import ctypes, sys
{arm}
from fleetline.storage.clickhouse import connect
connect("chdb://{path}").command("SELECT 1")
print("opened", flush=True)
ctypes.string_at(0)  # reads address 0: SIGSEGV
"""


@pytest.mark.parametrize(
    "arm",
    [
        "from fleetline.observability import crashes; crashes.report_fatal_signals(sys.stderr)",
        "import faulthandler; faulthandler.enable()",  # as `python -X faulthandler` does
    ],
)
def test_a_crash_after_the_store_opened_prints_python_s_fault_report(arm, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", CRASH.format(arm=arm, path=tmp_path / "chdb")],
        capture_output=True,
        text=True,
        timeout=60,  # without the fix it may hang in ClickHouse's handler
        preexec_fn=no_core,
    )
    assert done.stdout.strip() == "opened", done.stderr
    assert done.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in done.stderr, done.stderr
    assert 'File "<string>", line 7' in done.stderr, done.stderr


def test_the_cli_reports_fatal_signals():
    probe = (
        "import faulthandler, sys; from fleetline.cli import main; "
        "main(['contract', '--help']); print(faulthandler.is_enabled(), file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stderr.strip().splitlines()[-1] == "True", done.stderr


def test_a_test_that_crashes_the_suite_s_process_is_named_and_the_process_ends():
    # The suite's own path: pytest's fault handler, on its copy of stderr (tests/conftest.py),
    # and a store opened inside a test. Before, this process hung in ClickHouse's handler.
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", CHILD],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=no_core,
    )
    assert done.returncode == -signal.SIGSEGV, done.stdout + done.stderr
    assert "Fatal Python error: Segmentation fault" in done.stderr, done.stderr
    assert 'crash_child.py", line 13 in test_crashes_after_opening_a_store' in done.stderr
    # The crashing thread's stack alone, first (CI shows the head of a long output).
    assert "Stack (most recent call first)" in done.stderr, done.stderr
    assert "Current thread" not in done.stderr, done.stderr


def test_the_crashing_thread_s_native_stack_is_read_from_its_core_and_printed_last(tmp_path):
    pattern = Path("/proc/sys/kernel/core_pattern").read_text().strip()
    if pattern.startswith("|") or "/" in pattern or shutil.which("gdb") is None:
        pytest.skip(f"cores are not written to the working directory here ({pattern!r})")
    marker = tmp_path / "started"
    marker.touch()
    crashed = subprocess.run(
        [sys.executable, "-c", "import ctypes; ctypes.string_at(0)"],
        cwd=tmp_path,
        capture_output=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (-1, -1)),
        timeout=60,
    )
    assert crashed.returncode == -signal.SIGSEGV
    read = subprocess.run(
        [sys.executable, str(TOOLS / "crash_backtrace.py"), str(marker)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert read.returncode == 0, read.stdout + read.stderr
    last = read.stdout.strip().splitlines()
    assert last[-1] == "Program terminated with signal SIGSEGV, Segmentation fault.", last
    assert last[-2].startswith("#0 "), last  # the crashing frame, last
    assert any("string_at" in line for line in last), last
    assert list(tmp_path.glob("core*")) == []  # read, then deleted
