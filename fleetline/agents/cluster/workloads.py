"""Workloads as OS processes, each with a run directory that outlives the agent.

`<state dir>/<job>/e<epoch>-a<attempt>/` holds the launcher's pid and start time, the
workload's progress file and logs, the exit code the launcher writes, and the agent's own marks
(`stopping`, `running`, `published` lines, `reported`). A restarted agent reads these back:
a workload still alive is adopted (not started again), one that exited meanwhile has its exit
reported, and nothing already published is published twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# CPU (cores), memory and I/O weight per priority class: what a workload's cgroup is given.
CLASS_LIMITS: Mapping[str, Mapping[str, int]] = {
    "critical": {"cpus": 4, "memory_bytes": 16 * 2**30, "io_weight": 500},
    "high": {"cpus": 4, "memory_bytes": 16 * 2**30, "io_weight": 300},
    "normal": {"cpus": 2, "memory_bytes": 8 * 2**30, "io_weight": 100},
    "low": {"cpus": 1, "memory_bytes": 4 * 2**30, "io_weight": 50},
    "best-effort": {"cpus": 1, "memory_bytes": 2 * 2**30, "io_weight": 10},
}


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) of a process, or None if there is none;
    the start time guards against a reused pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], fields[19]


def _start_time(pid: int) -> str | None:
    stat = _stat(pid)
    return None if stat is None else stat[1]


def alive(pid: int, started: str | None) -> bool:
    stat = _stat(pid)
    if stat is None or (started is not None and stat[1] != started):
        return False
    return stat[0] != "Z"


# The contract's control file in a run directory: what the running workload is told after its
# start (a tuned checkpoint interval), replaced whole; the workload reads it at each checkpoint.
CONTROL_FILE = "control.json"


def write_control(directory: Path, values: Mapping[str, Any]) -> None:
    """Replace the run's control file (written aside, then renamed: never read half-written)."""
    aside = directory / f"{CONTROL_FILE}.tmp"
    aside.write_text(json.dumps(dict(values), sort_keys=True))
    aside.replace(directory / CONTROL_FILE)


def read_control(directory: Path) -> dict[str, Any] | None:
    try:
        values = json.loads((directory / CONTROL_FILE).read_text())
    except (OSError, ValueError):
        return None
    return values if isinstance(values, dict) else None


@dataclass
class Workload:
    """One run of one job in this cluster, as its run directory records it."""

    job: str
    tenant: str
    epoch: int
    attempt: int
    trace_id: str
    directory: Path
    pid: int = 0
    started: str | None = None
    started_at: float = 0.0  # monotonic, in this agent process
    step: int | None = None
    loss: float | None = None
    published: int = 0  # progress lines already published
    running_reported: bool = False
    stop_deadline: float | None = None
    stop_reason: str | None = None
    fenced: bool = False
    reported: bool = False  # its end has been published
    done: dict[str, Any] = field(default_factory=dict)  # the workload's "done" line
    # A serving replica's "listening" and "ready" lines (its address, what it loaded) and the
    # load it last reported.
    serving: dict[str, Any] = field(default_factory=dict)
    told: dict[str, Any] | None = None  # what its control file says (None: not read yet)

    @property
    def run_id(self) -> tuple[int, int]:
        return (self.epoch, self.attempt)

    @property
    def stopping(self) -> bool:
        return (self.directory / "stopping").exists()

    @property
    def alive(self) -> bool:
        return self.pid > 0 and alive(self.pid, self.started)

    def exit_code(self) -> int | None:
        try:
            return int((self.directory / "exit").read_text())
        except (OSError, ValueError):
            return None

    def mark(self, name: str, text: str = "") -> None:
        (self.directory / name).write_text(text)

    def new_progress(self) -> list[dict[str, Any]]:
        """Progress lines not yet published (complete lines only)."""
        return self._progress(self.published)

    def _progress(self, first: int) -> list[dict[str, Any]]:
        try:
            text = (self.directory / "progress.jsonl").read_text()
        except OSError:
            return []
        lines = text.split("\n")[:-1]  # the last piece is empty or a line being written
        out = []
        for line in lines[first:]:
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"event": "unreadable", "line": line[:200]})
        return out

    def serving_lines(self) -> dict[str, Any]:
        """A replica's "listening" and "ready" lines (its address, what it loaded), read from
        its whole progress file until it is ready (an adopted replica's lines were published
        before the agent restarted)."""
        if "ready" not in self.serving:
            for line in self._progress(0):
                if line.get("event") in ("listening", "ready"):
                    self.serving[line["event"]] = line
        return self.serving

    def published_to(self, count: int) -> None:
        self.published = count
        self.mark("published", str(count))

    def stderr_tail(self, limit: int = 300) -> str:
        try:
            data = (self.directory / "stderr.log").read_bytes()[-4096:]
        except OSError:
            return ""
        lines = [line for line in data.decode(errors="replace").splitlines() if line.strip()]
        return lines[-1][-limit:] if lines else ""

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)


def run_dir(root: Path, job: str, epoch: int, attempt: int) -> Path:
    return root / _safe(job) / f"e{epoch:010d}-a{attempt:04d}"


def launch(
    root: Path,
    job: str,
    tenant: str,
    epoch: int,
    attempt: int,
    trace_id: str,
    command: Sequence[str],
    env: Mapping[str, str],
    cgroup: Path | None,
    control: Mapping[str, Any] | None = None,
) -> Workload:
    """Start the command under the launcher, in a session of its own (so it outlives the
    agent), and record it in its run directory (with its control file, when given)."""
    directory = run_dir(root, job, epoch, attempt)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"job": job, "tenant": tenant, "epoch": epoch, "attempt": attempt, "trace_id": trace_id}
    (directory / "meta.json").write_text(json.dumps(meta))
    if cgroup is not None:
        (directory / "cgroup").write_text(str(cgroup))
    files = {"FLEETLINE_PROGRESS_FILE": str(directory / "progress.jsonl")}
    if control is not None:
        write_control(directory, control)
        files["FLEETLINE_CONTROL_FILE"] = str(directory / CONTROL_FILE)
    process = subprocess.Popen(
        [sys.executable, "-m", "fleetline.agents.cluster.launch", str(directory), "--", *command],
        env={**env, **files},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    started = _start_time(process.pid)
    (directory / "pid").write_text(f"{process.pid} {started}")
    workload = Workload(
        job, tenant, epoch, attempt, trace_id, directory, process.pid, started, time.monotonic()
    )
    # The agent reaps its own children (an exited launcher must not linger as a zombie); a
    # restarted agent finds its exit code in the run directory.
    _children[process.pid] = process
    return workload


def record_failed_start(
    root: Path, job: str, tenant: str, epoch: int, attempt: int, trace_id: str, reason: str
) -> Workload:
    """A run that never got a process, recorded as reported so it is not started again."""
    directory = run_dir(root, job, epoch, attempt)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"job": job, "tenant": tenant, "epoch": epoch, "attempt": attempt, "trace_id": trace_id}
    (directory / "meta.json").write_text(json.dumps(meta))
    (directory / "reported").write_text(reason)
    workload = Workload(job, tenant, epoch, attempt, trace_id, directory)
    workload.reported = True
    return workload


_children: dict[int, subprocess.Popen[bytes]] = {}


def reap() -> None:
    # Several agents may run in one process (`fleetline run`), each reaping from its thread.
    for pid, process in list(_children.items()):
        if process.poll() is not None:
            _children.pop(pid, None)


def adopt(root: Path) -> list[Workload]:
    """Every run directory, as a Workload (alive, exited, or reported finished: a run that
    happened is never started again)."""
    found = []
    for directory in sorted(root.glob("*/e*-a*")):
        if not (directory / "meta.json").exists():
            continue
        meta = json.loads((directory / "meta.json").read_text())
        pid, started = 0, None
        if (directory / "pid").exists():
            pid_text, _, started = (directory / "pid").read_text().partition(" ")
            pid = int(pid_text)
        workload = Workload(
            meta["job"],
            meta["tenant"],
            meta["epoch"],
            meta["attempt"],
            meta["trace_id"],
            directory,
            pid,
            started or None,
            time.monotonic(),
        )
        if (directory / "published").exists():
            workload.published = int((directory / "published").read_text() or 0)
        workload.running_reported = (directory / "running").exists()
        workload.reported = (directory / "reported").exists()
        if (directory / "stopping").exists():
            workload.stop_reason = (directory / "stopping").read_text() or "stopping"
            workload.stop_deadline = time.monotonic()
        found.append(workload)
    return found


def cgroup_root() -> Path | None:
    """Where cgroup v2 is mounted, if anywhere."""
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and parts[2] == "cgroup2":
                return Path(parts[1])
    except OSError:
        return None
    return None


def isolate(cluster_id: str, job: str, run: str, priority_class: str) -> tuple[Path | None, str]:
    """A cgroup v2 group for one workload with its class's limits, as far as the host allows;
    (the group or None, what was applied and what could not be)."""
    limits = CLASS_LIMITS.get(priority_class, CLASS_LIMITS["normal"])
    root = cgroup_root()
    if root is None:
        return None, "not isolated: no cgroup v2 hierarchy is mounted"
    group = root / "fleetline" / _safe(cluster_id) / _safe(job) / run
    try:
        group.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return None, f"not isolated: cannot create {group}: {exc.strerror}"
    available = set((root / "cgroup.controllers").read_text().split())
    wanted = {
        "cpu": ("cpu.max", f"{limits['cpus'] * 100000} 100000"),
        "memory": ("memory.max", str(limits["memory_bytes"])),
        "io": ("io.weight", f"default {limits['io_weight']}"),
    }
    # Controllers must be enabled on every level above the group.
    level = root
    for part in group.relative_to(root).parts:
        for controller in sorted(available & set(wanted)):
            with contextlib.suppress(OSError):
                (level / "cgroup.subtree_control").write_text(f"+{controller}")
        level = level / part
    applied, missing = [], []
    for controller, (name, value) in sorted(wanted.items()):
        try:
            (group / name).write_text(value)
            applied.append(f"{name}={value}")
        except OSError:
            missing.append(controller)
    note = f"cgroup v2 {group}"
    note += f": {', '.join(applied)}" if applied else ": joined, no limit applied"
    if missing:
        note += (
            f"; not available here: {', '.join(missing)} (the host delegates only "
            f"{', '.join(sorted(available)) or 'no controllers'})"
        )
    return group, note


def stop(workload: Workload, final_checkpoint: bool, grace_s: float) -> None:
    """SIGTERM (it checkpoints and exits) with a deadline, or SIGKILL at once."""
    workload.mark("stopping", workload.stop_reason or "stopping")
    if final_checkpoint:
        workload.signal(signal.SIGTERM)
        workload.stop_deadline = time.monotonic() + grace_s
    else:
        workload.signal(signal.SIGKILL)
        workload.stop_deadline = time.monotonic()
