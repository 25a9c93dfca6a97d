"""The process backend: every workload an OS process on the agent's own host, under the
launcher (`launch.py`) in a session of its own, so it outlives the agent, and in a cgroup v2
group with its priority class's limits where the host allows one. A run directory records the
launcher's pid and start time (which tells a reused pid apart)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetline.agents.cluster.backends import RunRequest
from fleetline.agents.cluster.nodes import ManagerNode
from fleetline.agents.cluster.workloads import safe_name

# CPU (cores), memory and I/O weight per priority class: what a workload's cgroup is given.
CLASS_LIMITS: Mapping[str, Mapping[str, int]] = {
    "critical": {"cpus": 4, "memory_bytes": 16 * 2**30, "io_weight": 500},
    "high": {"cpus": 4, "memory_bytes": 16 * 2**30, "io_weight": 300},
    "normal": {"cpus": 2, "memory_bytes": 8 * 2**30, "io_weight": 100},
    "low": {"cpus": 1, "memory_bytes": 4 * 2**30, "io_weight": 50},
    "best-effort": {"cpus": 1, "memory_bytes": 2 * 2**30, "io_weight": 10},
}
PID_FILE = "pid"
# Open MPI on one host, as root where the agent runs as root, in containers without
# cross-memory attach; its own binding off (the workers share the host with everything else).
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
    "OMPI_MCA_hwloc_base_binding_policy": "none",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}


def worker_command(request: RunRequest) -> list[str]:
    """One process for a run of one worker; one per worker under `mpirun` otherwise, each told
    its rank and GPUs by `rank.py` (what torchrun or mpirun gives any such program)."""
    if len(request.workers) <= 1:
        return list(request.command)
    return [
        "mpirun",
        "-np",
        str(len(request.workers)),
        sys.executable,
        "-m",
        "fleetline.agents.cluster.rank",
        *request.command,
    ]


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


@dataclass(frozen=True)
class ProcessRun:
    """The launcher process of one run (its pid and start time)."""

    directory: Path
    launcher_pid: int
    started: str | None

    @property
    def label(self) -> str:
        return f"pid {self.launcher_pid}"

    @property
    def pid(self) -> int | None:
        return self.launcher_pid

    def alive(self) -> bool:
        stat = _stat(self.launcher_pid)
        if stat is None or (self.started is not None and stat[1] != self.started):
            return False
        return stat[0] != "Z"

    def placed(self) -> str | None:
        return f"on this host as pid {self.launcher_pid}"

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.launcher_pid, signum)

    def ended(self, exit_code: int | None) -> tuple[int, str] | None:
        if exit_code is None and (self.directory / "child.pid").exists():
            # The launcher is gone without writing the code: killed with its group.
            return 137, "killed with its launcher"
        return None


class ProcessLauncher:
    backend = "process"
    manager = ""

    def __init__(self) -> None:
        # The agent reaps its own children (an exited launcher must not linger as a zombie); a
        # restarted agent finds its exit code in the run directory.
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, request: RunRequest) -> tuple[ProcessRun, str]:
        directory = request.directory
        group, isolation = isolate(
            request.cluster_id, request.job, request.run, request.priority_class
        )
        if group is not None:
            (directory / "cgroup").write_text(str(group))
        gpus = request.workers[0][1] if request.workers else ()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fleetline.agents.cluster.launch",
                str(directory),
                *(["--own-group"] if len(request.workers) > 1 else []),
                "--",
                *worker_command(request),
            ],
            env=(
                # Each worker's GPUs are rank.py's to set, from FLEETLINE_WORKERS.
                {k: v for k, v in request.env.items() if k != "CUDA_VISIBLE_DEVICES"} | MPI_ENV
                if len(request.workers) > 1
                else {
                    **request.env,
                    "FLEETLINE_RANK": "0",
                    "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
                }
            ),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
        started = _start_time(process.pid)
        (directory / PID_FILE).write_text(f"{process.pid} {started}")
        self._children[process.pid] = process
        return ProcessRun(directory, process.pid, started), isolation

    def find(self, directory: Path) -> ProcessRun | None:
        try:
            pid_text, _, started = (directory / PID_FILE).read_text().partition(" ")
            return ProcessRun(directory, int(pid_text), started or None)
        except (OSError, ValueError):
            return None

    def refresh(self) -> None:
        for pid, process in list(self._children.items()):
            if process.poll() is not None:
                self._children.pop(pid, None)

    def unrecorded(self, root: Path) -> list[tuple[Path, dict[str, Any]]]:
        return []  # a process's only record is its run directory

    def control_error(self) -> str | None:
        return None

    def manager_nodes(self) -> Mapping[str, ManagerNode] | None:
        return None  # the host is the only node, and the node agents speak for it

    def drain(self, node: str, reason: str) -> None:
        raise NotImplementedError("the process backend has no manager to drain a node in")

    def resume(self, node: str) -> None:
        raise NotImplementedError("the process backend has no manager to resume a node in")

    def close(self) -> None:
        pass  # it holds nothing: its runs are processes of their own


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
    group = root / "fleetline" / safe_name(cluster_id) / safe_name(job) / run
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
