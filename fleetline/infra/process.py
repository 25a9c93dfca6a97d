"""Detached local service processes: start with a pid file and a log, wait for a port, stop."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fleetline.errors import ServiceError
from fleetline.probe import refusal


@dataclass(frozen=True)
class ServiceProcess:
    """One background service whose pid and log live in `run_dir`."""

    name: str
    run_dir: Path
    host: str
    port: int

    @property
    def pid_file(self) -> Path:
        return self.run_dir / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.run_dir / f"{self.name}.log"

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return pid

    def answers(self) -> bool:
        return port_open(self.host, self.port)

    def start(
        self, argv: Sequence[str], *, env: dict[str, str] | None = None, timeout_s: float = 90.0
    ) -> float:
        """Start the service unless it already runs; return the seconds until its port answered."""
        began = time.monotonic()
        proc = self.spawn(argv, env=env)
        return 0.0 if proc is None else self.await_port(proc, began, timeout_s)

    def spawn(
        self, argv: Sequence[str], *, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes] | None:
        """Start the service without waiting for it; None if it already runs (members of a
        cluster are spawned together, since none answers before a quorum of them is up)."""
        if self.pid() is not None and self.answers():
            return None
        if self.answers():
            raise ServiceError(
                f"{self.name}: port {self.host}:{self.port} is taken by a process we did not start"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as log:
            # A new session so the service outlives the command that started it (the README's
            # `fleetline infra start`) and a Ctrl-C in that terminal does not reach it.
            proc = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        self.pid_file.write_text(str(proc.pid))
        return proc

    def await_port(self, proc: subprocess.Popen[bytes], began: float, timeout_s: float) -> float:
        """Wait for a spawned service's port; the seconds since `began` when it answered."""
        deadline = began + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ServiceError(
                    f"{self.name} exited with status {proc.returncode} before its port answered; "
                    f"last log lines:\n{tail(self.log_file)}"
                )
            if self.answers():
                return time.monotonic() - began
            time.sleep(0.2)
        self.stop()
        raise ServiceError(
            f"{self.name} did not answer on {self.host}:{self.port} within {timeout_s:.0f}s; "
            f"last log lines:\n{tail(self.log_file)}"
        )

    def kill(self) -> bool:
        """SIGKILL the service at once (a crash, for the fault-injection tests); True if it ran."""
        pid = self.pid()
        self.pid_file.unlink(missing_ok=True)
        if pid is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        return True

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop the service gracefully (SIGTERM), forcefully after `timeout_s`; True if it ran."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self.pid_file.unlink(missing_ok=True)
        return True


def _alive(pid: int) -> bool:
    try:
        # Reap it if it is our child, so a zombie does not count as alive.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    return refusal(host, port, timeout_s) is None


def run_checked(
    argv: Sequence[str],
    *,
    what: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    log: Path | None = None,
) -> None:
    """Run a setup command to completion; on failure raise with its exact command and output."""
    result = subprocess.run(
        list(argv),
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        check=False,
    )
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip().splitlines()[-30:]
        raise ServiceError(
            f"{what} failed (exit {result.returncode}): {' '.join(argv)}\n" + "\n".join(output)
        )


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
