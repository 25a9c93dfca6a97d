"""The Slurm backend: every run a Slurm batch job on the nodes fleetline placed it on.

A RUN order becomes `sbatch --nodelist=<the placement's nodes> --gres=gpu:N --ntasks=<workers>
--no-requeue`: the batch script runs the launcher (`launch.py`, which writes the exit code into
the run directory) around `srun`, one task per worker, each with the workload contract's rank
(`FLEETLINE_RANK` = `SLURM_PROCID`), world size and master address (`FLEETLINE_MASTER_ADDR`,
the first task's node); Slurm binds the GPUs (`CUDA_VISIBLE_DEVICES`) and the agent reports
which ones it bound. Only rank 0 writes the progress file the agent reads; the others write
beside it. The job is named `<job>.e<epoch>-a<attempt>` and its comment carries the run's meta
(JSON), so a restarted agent finds its runs with `squeue` even without their run directories,
and fences any its orders no longer want with `scancel`. SIGTERM is `scancel --signal=TERM`
(every task checkpoints and exits), SIGKILL `scancel`. Slurm's node names are fleetline's node
ids. A node failure ends the job (`--no-requeue`): fleetline's retry policy, not Slurm's, says
what happens next.

The commands run with `SLURM_CONF` set to the cluster's configuration when one is given, else
as the host's Slurm client is configured. Everything Slurm says is passed on in its own words.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetline.agents.cluster.backends import RunRequest, found_meta
from fleetline.agents.cluster.nodes import DRAIN_REASON, ManagerNode
from fleetline.agents.cluster.workloads import run_dir
from fleetline.errors import FleetlineError

log = logging.getLogger(__name__)

JOB_FILE = "slurm-job"
COMMENT_TAG = "fleetline"
# Slurm job states of a job that has not ended (squeue's `job_state`).
LIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
    }
)
# A node in these base states takes jobs, unless a flag below says otherwise (sinfo --json).
# NOT_RESPONDING is not one: Slurm sets it for a missed ping (and just after a resume), and
# sets the node DOWN itself once the node stays silent for SlurmdTimeout.
USABLE_STATES = frozenset({"IDLE", "ALLOCATED", "MIXED", "COMPLETING"})
UNUSABLE_FLAGS = frozenset(
    {
        "DRAIN",
        "DRAINING",
        "DRAINED",
        "FAIL",
        "MAINTENANCE",
        "POWERED_DOWN",
        "POWERING_DOWN",
        "POWER_DOWN",
        "REBOOT_ISSUED",
        "REBOOT_REQUESTED",
    }
)
# Job states in which Slurm ended a run whatever its tasks' exit codes say.
FAILED_UNDER_IT = frozenset(
    {"NODE_FAIL", "TIMEOUT", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
)
COMMAND_TIMEOUT_S = 30.0
REFRESH_S = 1.0  # how often squeue is asked (the agent's loop passes every 100 ms)


class SlurmError(FleetlineError):
    """A Slurm command failed; the message is Slurm's own."""


@dataclass(frozen=True)
class SlurmJob:
    """One job as `squeue --json` shows it."""

    job_id: int
    state: str
    reason: str
    nodes: str
    gres: tuple[str, ...]  # per node, in `nodes` order: "gpu:2(IDX:0-1)"
    exit_code: int | None
    comment: Mapping[str, Any]

    @classmethod
    def from_squeue(cls, record: Mapping[str, Any]) -> SlurmJob:
        state = record.get("job_state")
        if isinstance(state, list):  # newer Slurm: a list of flags
            state = state[0] if state else "UNKNOWN"
        try:
            comment = json.loads(record.get("comment") or "{}")
        except ValueError:
            comment = {}
        code = record.get("exit_code")
        if isinstance(code, dict):  # newer Slurm: {"status": ..., "return_code": ...}
            code = code.get("return_code")
        return cls(
            int(record["job_id"]),
            str(state),
            str(record.get("state_reason") or ""),
            str(record.get("nodes") or ""),
            tuple(record.get("gres_detail") or ()),
            code if isinstance(code, int) else None,
            comment if isinstance(comment, dict) else {},
        )

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES


class SlurmClient:
    """Slurm's commands, with the cluster's configuration."""

    def __init__(self, conf: Path | None = None) -> None:
        self.env = {**os.environ, **({"SLURM_CONF": str(conf)} if conf else {})}

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
        try:
            done = subprocess.run(
                list(argv),
                env=dict(env) if env is not None else self.env,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
                check=False,
            )
        except FileNotFoundError as exc:
            raise SlurmError(f"{argv[0]}: not installed here ({exc.strerror})") from exc
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(f"{argv[0]}: no answer in {COMMAND_TIMEOUT_S:.0f} s") from exc
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise SlurmError(f"{argv[0]}: {said[-1] if said else f'exit {done.returncode}'}")
        return done.stdout

    def _json(self, argv: Sequence[str], key: str) -> list[dict[str, Any]]:
        """A `--json` command's records. Its errors (exit 0, an `errors` list and no records
        when the controller does not answer) are raised in the plain command's own words."""
        out = self.run([*argv, "--json"])
        try:
            document = json.loads(out)
            records, errors = document[key], document.get("errors") or []
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SlurmError(f"{argv[0]} --json: unreadable answer: {out[:200]!r}") from exc
        if errors:
            self.run([*argv, "--noheader"])  # raises with what Slurm says, when it fails so
            said = "; ".join(f"{e.get('description')}: {e.get('error')}" for e in errors)
            raise SlurmError(f"{argv[0]}: {said}")
        return list(records)

    def jobs(self) -> list[SlurmJob]:
        """Every job the controller knows (ended ones for MinJobAge), fleetline's or not."""
        return [SlurmJob.from_squeue(r) for r in self._json(["squeue"], "jobs")]

    def submit(self, argv: Sequence[str], script: Path, env: Mapping[str, str]) -> int:
        out = self.run(["sbatch", "--parsable", *argv, str(script)], {**self.env, **env})
        return int(out.strip().split(";")[0])

    def cancel(self, job_id: int, signal_name: str | None = None) -> None:
        argv = ["scancel", *([f"--signal={signal_name}"] if signal_name else []), str(job_id)]
        self.run(argv)

    def nodes(self) -> dict[str, ManagerNode]:
        """Every node whose state Slurm knows, by name, from `sinfo --json`."""
        nodes = (manager_node(r) for r in self._json(["sinfo"], "nodes"))
        # UNKNOWN: a controller just restarted has not heard from the node yet; no word.
        return {n.name: n for n in nodes if not n.why.startswith("UNKNOWN")}

    def update_node(self, node: str, state: str, reason: str | None = None) -> None:
        argv = ["scontrol", "update", f"nodename={node}", f"state={state}"]
        self.run(argv + ([f"reason={reason}"] if reason else []))


def manager_node(record: Mapping[str, Any]) -> ManagerNode:
    """A `sinfo --json` node: its base state (a string, or a list of flags in newer Slurm)
    and its flags."""
    state = record.get("state")
    words = [str(w).upper() for w in (state if isinstance(state, list) else [state])]
    words += [str(f).upper() for f in record.get("state_flags") or ()]
    base = words[0] if words else "UNKNOWN"
    flags = [w for w in words[1:] if w != base]
    reason = str(record.get("reason") or "")
    why = "+".join([base, *flags]) + (f" ({reason})" if reason else "")
    return ManagerNode(
        str(record["name"]),
        base in USABLE_STATES and not UNUSABLE_FLAGS & set(flags),
        why,
        reason.startswith(DRAIN_REASON.split(":")[0] + ":"),
    )


def _gres_indices(detail: str) -> str:
    """ "gpu:2(IDX:0-1)" -> "0-1"."""
    return detail.partition("IDX:")[2].rstrip(")") or detail


@dataclass
class SlurmRun:
    """One run's Slurm job, as the launcher's last look at the queue shows it."""

    launcher: SlurmLauncher
    directory: Path
    job_id: int

    @property
    def label(self) -> str:
        return f"Slurm job {self.job_id}"

    @property
    def pid(self) -> int | None:
        return None

    def _job(self) -> SlurmJob | None:
        return self.launcher.queue.get(self.job_id)

    def alive(self) -> bool:
        if self.launcher.error is not None or self.job_id in self.launcher.unseen:
            # The controller does not answer, or was not asked since the job was submitted:
            # nothing is known to have ended.
            return True
        job = self._job()
        return job is not None and job.live

    def placed(self) -> str | None:
        job = self._job()
        if job is None or job.state != "RUNNING":
            return None
        names = self.launcher.hostnames(job.nodes)
        bound = ", ".join(
            f"{node} GPU {_gres_indices(gres)}" for node, gres in zip(names, job.gres, strict=False)
        )
        return f"{self.label} on {job.nodes}" + (f" ({bound})" if bound else "")

    def signal(self, signum: int) -> None:
        name = "TERM" if signum == 15 else None  # anything else ends the job at once
        try:
            self.launcher.client.cancel(self.job_id, name)
        except SlurmError as exc:
            log.warning("%s: %s", self.label, exc)
        self.launcher.stale()

    def ended(self, exit_code: int | None) -> tuple[int, str] | None:
        job = self._job()
        if job is None:
            return None if exit_code is not None else (1, f"Slurm no longer knows {self.label}")
        if job.live:
            return None
        reason = f"Slurm: {self.label} {job.state}"
        if job.reason and job.reason != "None":
            reason += f" ({job.reason})"
        if job.state in FAILED_UNDER_IT:
            # The tasks may have exited 0 on the SIGTERM Slurm sent: the run did not end well.
            return (exit_code if exit_code else 1), reason
        if exit_code is not None:
            return None
        # Cancelled outright: killed, by the shell's convention; else Slurm's code, or 1.
        if job.state == "CANCELLED":
            return 137, reason
        return (job.exit_code if job.exit_code is not None else 1), reason


class SlurmLauncher:
    backend = "slurm"
    manager = "Slurm"

    def __init__(self, cluster_id: str, conf: Path | None = None) -> None:
        self.cluster_id = cluster_id
        self.client = SlurmClient(conf)
        self.queue: dict[int, SlurmJob] = {}
        self.nodes: dict[str, ManagerNode] | None = None
        self.unseen: set[int] = set()  # submitted since the queue was last read
        self.error: str | None = None
        self._asked = 0.0
        self._hostnames: dict[str, list[str]] = {}

    def stale(self) -> None:
        """What the queue says has changed (a job submitted or cancelled): ask at once."""
        self._asked = 0.0

    def refresh(self) -> None:
        if time.monotonic() - self._asked < REFRESH_S:
            return
        self._asked = time.monotonic()
        asked_after = set(self.unseen)
        try:
            jobs = self.client.jobs()
            self.nodes = self.client.nodes()
        except SlurmError as exc:
            if self.error != str(exc):
                log.warning("%s: Slurm: %s", self.cluster_id, exc)
            self.error = str(exc)
            return
        self.error = None
        self.unseen -= asked_after
        self.queue = {j.job_id: j for j in jobs if j.comment.get(COMMENT_TAG) == self.cluster_id}

    def control_error(self) -> str | None:
        return None if self.error is None else f"Slurm: {self.error}"

    def manager_nodes(self) -> Mapping[str, ManagerNode] | None:
        return self.nodes

    def drain(self, node: str, reason: str) -> None:
        self.client.update_node(node, "DRAIN", reason)
        self.stale()

    def resume(self, node: str) -> None:
        self.client.update_node(node, "RESUME")
        self.stale()

    def close(self) -> None:
        pass  # it holds nothing: each look at Slurm is a command of its own

    def hostnames(self, nodes: str) -> list[str]:
        """A Slurm node list ("sa-n[0000-0001]") as names."""
        if nodes not in self._hostnames:
            try:
                out = self.client.run(["scontrol", "show", "hostnames", nodes])
                self._hostnames[nodes] = out.split()
            except SlurmError:
                return [nodes]
        return self._hostnames[nodes]

    def start(self, request: RunRequest) -> tuple[SlurmRun, str]:
        per_node: dict[str, int] = {}
        for node, gpus in request.workers:
            per_node[node] = per_node.get(node, 0) + len(gpus)
        counts = set(per_node.values())
        binding = (
            [f"--gres=gpu:{counts.pop()}"]
            if len(counts) == 1
            else [f"--gpus={sum(per_node.values())}"]
        )
        tasks = max(len(request.workers), 1)
        directory = request.directory
        # Each task is one worker, its master the first task's node; `rank.py` tells it its
        # rank (Slurm's task id) and gives ranks above 0 a progress file beside rank 0's,
        # which the agent reads. Several workers are one MPI world through Slurm's PMIx.
        rank = 'export FLEETLINE_MASTER_ADDR=$SLURM_LAUNCH_NODE_IPADDR; exec "$@"'
        step = [
            "srun",
            f"--ntasks={tasks}",
            "--kill-on-bad-exit=1",
            *(["--mpi=pmix"] if tasks > 1 else []),
            "bash",
            "-c",
            rank,
            "fleetline-rank",
            sys.executable,
            "-m",
            "fleetline.agents.cluster.rank",
        ]
        script = directory / "slurm-batch.sh"
        script.write_text(
            "#!/bin/bash\n"
            f"# fleetline {request.job} epoch {request.epoch} attempt {request.attempt}\n"
            f"exec {shlex.quote(sys.executable)} -m fleetline.agents.cluster.launch "
            f"{shlex.quote(str(directory))} -- {shlex.join(step)} "
            f"{shlex.join(request.command)}\n"
        )
        script.chmod(0o755)
        comment = json.dumps(
            {COMMENT_TAG: self.cluster_id, "dir": str(directory), **request.meta()},
            sort_keys=True,
        )
        argv = [
            f"--job-name={request.job}.{request.run}",
            f"--comment={comment}",
            f"--nodelist={','.join(per_node)}",
            f"--nodes={len(per_node)}",
            f"--ntasks={tasks}",
            *binding,
            "--no-requeue",
            "--export=ALL",
            f"--chdir={directory}",
            f"--output={directory / 'slurm.out'}",
        ]
        env = {k: v for k, v in request.env.items() if k != "CUDA_VISIBLE_DEVICES"}
        job_id = self.client.submit(argv, script, env)
        (directory / JOB_FILE).write_text(str(job_id))
        self.unseen.add(job_id)
        self.stale()
        return SlurmRun(self, directory, job_id), (f"Slurm job {job_id}: {' '.join(argv[2:])}")

    def find(self, directory: Path) -> SlurmRun | None:
        try:
            return SlurmRun(self, directory, int((directory / JOB_FILE).read_text()))
        except (OSError, ValueError):
            return None

    def unrecorded(self, root: Path) -> list[tuple[Path, dict[str, Any]]]:
        self.refresh()
        found = []
        for job in self.queue.values():
            meta = found_meta(job.comment)
            if meta is None or not job.live:
                continue
            directory = run_dir(root, str(meta["job"]), int(meta["epoch"]), int(meta["attempt"]))
            # Unrecorded: no directory, or one the agent died in before writing the job's id.
            if not (directory / JOB_FILE).exists():
                directory.mkdir(parents=True, exist_ok=True)
                (directory / JOB_FILE).write_text(str(job.job_id))
                found.append((directory, meta))
        return found
