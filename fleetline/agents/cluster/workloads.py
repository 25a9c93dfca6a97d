"""Runs of workloads, each with a run directory that outlives the agent, whatever the backend.

`<state dir>/<job>/e<epoch>-a<attempt>/` holds the run's meta, the workload's progress file and
logs, the exit code the launcher writes, the backend's record of the run (a pid, a Slurm job
id) and the agent's own marks (`stopping`, `running`, `published` lines, `reported`). A
restarted agent reads these back: a workload still alive is adopted (not started again), one
that exited meanwhile has its exit reported, and nothing already published is published twice.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


class RunHandle(Protocol):
    """A run as its cluster's manager knows it (an OS process, a Slurm job)."""

    @property
    def label(self) -> str:
        """How a person finds it with the manager's own tools: `pid 4711`, `Slurm job 17`."""
        ...

    @property
    def pid(self) -> int | None: ...

    def alive(self) -> bool:
        """Not ended: waiting for its nodes, starting, running or stopping."""
        ...

    def placed(self) -> str | None:
        """Where the manager put it, once it runs there (None while it waits): its nodes and
        the GPUs the manager bound."""
        ...

    def signal(self, signum: int) -> None:
        """SIGTERM: checkpoint and exit; SIGKILL: end at once."""
        ...

    def ended(self, exit_code: int | None) -> tuple[int, str] | None:
        """The manager's word on how an ended run ended, where it stands in for the exit code
        the launcher wrote (None: none written) or overrides it (its node failed under it):
        the code to report and why. None: the exit code tells."""
        ...


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
    handle: RunHandle | None = None  # None: never started (a start that failed)
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
        return self.handle is not None and self.handle.alive()

    @property
    def pid(self) -> int | None:
        return None if self.handle is None else self.handle.pid

    @property
    def label(self) -> str:
        return "never started" if self.handle is None else self.handle.label

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

    def interrupted(self) -> dict[str, Any] | None:
        """The workload's `stopped` line (it checkpointed and exited on a SIGTERM), if any."""
        return next((x for x in self._progress(0) if x.get("event") == "stopped"), None)

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
        if self.handle is not None:
            self.handle.signal(signum)


def run_dir(root: Path, job: str, epoch: int, attempt: int) -> Path:
    return root / safe_name(job) / f"e{epoch:010d}-a{attempt:04d}"


def prepare(
    root: Path, meta: Mapping[str, Any], control: Mapping[str, Any] | None = None
) -> tuple[Path, dict[str, str]]:
    """The run's directory with its meta (and its control file, when given); (the directory,
    the contract's variables naming its files)."""
    directory = run_dir(root, meta["job"], meta["epoch"], meta["attempt"])
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "meta.json").write_text(json.dumps(dict(meta)))
    files = {"FLEETLINE_PROGRESS_FILE": str(directory / "progress.jsonl")}
    if control is not None:
        write_control(directory, control)
        files["FLEETLINE_CONTROL_FILE"] = str(directory / CONTROL_FILE)
    return directory, files


def record_failed_start(
    root: Path, job: str, tenant: str, epoch: int, attempt: int, trace_id: str, reason: str
) -> Workload:
    """A run that never got a process, recorded as reported so it is not started again."""
    meta = {"job": job, "tenant": tenant, "epoch": epoch, "attempt": attempt, "trace_id": trace_id}
    directory, _ = prepare(root, meta)
    (directory / "reported").write_text(reason)
    workload = Workload(job, tenant, epoch, attempt, trace_id, directory)
    workload.reported = True
    return workload


class Finder(Protocol):
    def find(self, directory: Path) -> RunHandle | None: ...


def adopt(root: Path, backend: Finder) -> list[Workload]:
    """Every run directory, as a Workload with its run as the backend finds it (alive,
    exited, or reported finished: a run that happened is never started again)."""
    found = []
    for directory in sorted(root.glob("*/e*-a*")):
        if not (directory / "meta.json").exists():
            continue
        meta = json.loads((directory / "meta.json").read_text())
        workload = Workload(
            meta["job"],
            meta["tenant"],
            meta["epoch"],
            meta["attempt"],
            meta["trace_id"],
            directory,
            backend.find(directory),
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


def stop(workload: Workload, final_checkpoint: bool, grace_s: float) -> None:
    """SIGTERM (it checkpoints and exits) with a deadline, or SIGKILL at once."""
    workload.mark("stopping", workload.stop_reason or "stopping")
    if final_checkpoint:
        workload.signal(signal.SIGTERM)
        workload.stop_deadline = time.monotonic() + grace_s
    else:
        workload.signal(signal.SIGKILL)
        workload.stop_deadline = time.monotonic()
