"""After a test run that died of a fatal signal: the native stack of the thread that crashed,
read with gdb from the core the kernel wrote, printed last.

The test process reports the crashing thread's Python stack first (tests/conftest.py); a crash
inside a native library (the embedded ClickHouse, librdkafka) needs its native frames as well,
and CI shows the head and the tail of a failed run's output. `make test` allows core files and
runs this when pytest ended on a signal. Each core read is deleted (the test process's is
gigabytes)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path


def cores_since(marker: Path, where: Path) -> list[Path]:
    """The core files written in `where` (the crashed process's working directory) after
    `marker` was touched, oldest first."""
    since = marker.stat().st_mtime if marker.exists() else 0.0
    found = [
        path
        for path in [*where.glob("core"), *where.glob("core.[0-9]*")]
        if path.is_file() and path.stat().st_mtime >= since
    ]
    return sorted(found, key=lambda path: path.stat().st_mtime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("marker", type=Path, help="a file touched when the run started")
    parser.add_argument("--frames", type=int, default=40, help="native frames to print")
    args = parser.parse_args(argv)
    cores = cores_since(args.marker, Path.cwd())
    if not cores:
        pattern = Path("/proc/sys/kernel/core_pattern")
        written = pattern.read_text().strip() if pattern.exists() else "unknown"
        print(
            f"crash_backtrace: no core file here (core pattern {written!r}; "
            "core files may be off: ulimit -c)",
            file=sys.stderr,
        )
        return 1
    gdb = shutil.which("gdb")
    for core in cores:
        if gdb is None:
            print(f"crash_backtrace: {core} left for reading: gdb is not installed")
            continue
        done = subprocess.run(
            [
                gdb,
                "-q",
                "-batch",
                "-iex",
                "set debuginfod enabled off",
                "-iex",
                "set print frame-arguments none",
                "-ex",
                f"bt {args.frames}",
                sys.executable,
                str(core),
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        lines = done.stdout.splitlines()
        # gdb shows the crashing frame once as it loads the core, and again as the trace's #0.
        frames = list(dict.fromkeys(line for line in lines if line.startswith("#")))
        signal = [line for line in lines if line.startswith("Program terminated")]
        # Outermost first and the crashing frame last: the tail is what a CI log keeps.
        print(f"=== {core}: the crashing thread's native stack, the crashing frame last ===")
        print("\n".join(reversed(frames)) or done.stdout + done.stderr)
        print("\n".join(signal), flush=True)
        core.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
