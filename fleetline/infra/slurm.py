"""A Slurm cluster on this host for a fleetline cluster: `fleetline infra start --slurm C:N`.

One `munged` with a key of the cluster's own, one `slurmctld` and one `slurmd` per node (`slurmd
-N <node>`, each on its own port), all under `.cache/slurm/<cluster>/`, bound to loopback. The
Slurm node names are the fleetline node ids the simulator gives that cluster's nodes
(`<cluster>-n0000`, ...), each with `gpu:8` generic resources backed by device-like files
(symlinks to /dev/null, `AutoDetect=off`): Slurm allocates and binds them
(`CUDA_VISIBLE_DEVICES`), nothing executes on a GPU. `select/cons_tres` and
`proctrack/linuxproc`; the daemons run as root, as `slurmd` must. Slurm itself comes from the
host's packages (`slurmctld slurmd slurm-client munge`, Slurm 22.05 on Debian 12).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleetline.errors import ServiceError
from fleetline.infra.managed import cluster_nodes, node_names
from fleetline.infra.process import ServiceProcess, tail

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
GPUS_PER_NODE = 8
READY_TIMEOUT_S = 60.0


# The first line of a slurm.conf this code wrote: one written by an earlier version (without
# the nodes' own TmpFS, say) is written again.
CONF_VERSION = "# fleetline slurm.conf v2"


def slurm_conf_path(cache_dir: Path, cluster_id: str) -> Path:
    return cache_dir / "slurm" / cluster_id / "slurm.conf"


def _ephemeral_low() -> int:
    """The first port the kernel hands out to outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_ports(host: str, count: int) -> list[int]:
    """`count` ports free now, below the kernel's ephemeral range: a port the kernel handed out
    (a bind to port 0) may be taken by an outgoing connection before the daemon binds it, and
    with 30 nodes starting beside a busy broker, one was."""
    low = _ephemeral_low()
    candidates = list(range(20_000, low)) if low > 21_000 else []
    random.shuffle(candidates)
    found: list[int] = []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    # No room below the ephemeral range: the kernel's choice, as before.
    while len(found) < count:
        with socket.socket() as s:
            s.bind((host, 0))
            found.append(int(s.getsockname()[1]))
    return found


def missing_programs() -> list[str]:
    return [p for p in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(p) is None]


@dataclass(frozen=True)
class SlurmCluster:
    """One fleetline cluster's Slurm: its controller, its nodes and their munge daemon."""

    cluster_id: str
    nodes: tuple[str, ...]
    directory: Path
    host: str = "127.0.0.1"
    # The fabric, when Slurm is to know it: each leaf switch and its nodes (`topology/tree`,
    # one spine above them), and the GPUs of a node that share an NVLink island (gres `Links`).
    leaves: tuple[tuple[str, tuple[str, ...]], ...] = ()
    nvlink_islands: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, cache_dir: Path, cluster_id: str, node_count: int) -> SlurmCluster:
        return cls(cluster_id, node_names(cluster_id, node_count), cache_dir / "slurm" / cluster_id)

    @classmethod
    def parse(cls, cache_dir: Path, text: str) -> SlurmCluster:
        """`CLUSTER[:NODES]` (1 node when not said)."""
        cluster_id, nodes = cluster_nodes(text)
        return cls(cluster_id, nodes, cache_dir / "slurm" / cluster_id)

    @property
    def conf(self) -> Path:
        return self.directory / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def _daemon(self, name: str, port: int = 0) -> ServiceProcess:
        return ServiceProcess(name, self.directory / "run", self.host, port)

    def _daemons(self) -> list[ServiceProcess]:
        return [
            self._daemon("munged"),
            self._daemon("slurmctld"),
            *(self._daemon(f"slurmd-{n}") for n in self.nodes),
        ]

    def running(self) -> bool:
        return all(d.pid() is not None for d in self._daemons())

    def start(self) -> float:
        """Configure (once) and start whichever daemons do not run; the seconds until every
        node answered `idle`."""
        missing = missing_programs()
        if missing:
            raise ServiceError(
                f"Slurm is not installed here ({', '.join(missing)} not found): run "
                f"`apt-get install -y {' '.join(PACKAGES)}` as root"
            )
        if os.geteuid() != 0:
            raise ServiceError("slurmd runs as root: start the Slurm cluster as root")
        began = time.monotonic()
        if self.running():
            return 0.0
        if (
            not self.conf.exists()
            or self.found_nodes(self.conf) != self.nodes
            or not self.conf.read_text().startswith(CONF_VERSION)
        ):
            self.stop()
            self._configure()
        munge = self.directory / "munge"
        munged = self._daemon("munged")
        if munged.pid() is None:
            (munge / "munge.socket").unlink(missing_ok=True)
            munged.spawn(
                [
                    "munged", "--foreground", "--force",
                    f"--socket={munge / 'munge.socket'}",
                    f"--key-file={munge / 'munge.key'}",
                    f"--pid-file={munge / 'munged.pid'}",
                    f"--log-file={munge / 'munged.log'}",
                    f"--seed-file={munge / 'munged.seed'}",
                ]
            )  # fmt: skip
            self._await(lambda: (munge / "munge.socket").exists(), "munged's socket", munged)
        controller = self._daemon("slurmctld", int(self._setting("SlurmctldPort")))
        if controller.pid() is None:
            controller.start(["slurmctld", "-D", "-f", str(self.conf)], env=self.env)
        for node, port in zip(self.nodes, self._node_ports(), strict=True):
            daemon = self._daemon(f"slurmd-{node}", port)
            if daemon.pid() is None:
                (self.directory / "spool" / node).mkdir(parents=True, exist_ok=True)
                (self.directory / "tmp" / node).mkdir(parents=True, exist_ok=True)
                daemon.start(["slurmd", "-D", "-N", node, "-f", str(self.conf)], env=self.env)
        self._await(self._nodes_idle, "every node to be idle", controller)
        return time.monotonic() - began

    def kill_controller(self) -> bool:
        """SIGKILL slurmctld (a controller crash, for the tests); `start` brings it back."""
        return self._daemon("slurmctld").kill()

    def _configure(self) -> None:
        munge = self.directory / "munge"
        munge.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o700)
        key = munge / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        devices = self.directory / "dev"
        devices.mkdir(exist_ok=True)
        for i in range(GPUS_PER_NODE):
            with contextlib.suppress(FileExistsError):
                (devices / f"gpu{i}").symlink_to("/dev/null")
        for sub in ("state", "spool", "log", "run"):
            (self.directory / sub).mkdir(exist_ok=True)
        d = self.directory
        ports = _free_ports(self.host, len(self.nodes) + 2)
        lines = [
            CONF_VERSION,
            f"ClusterName={self.cluster_id.lower().replace('-', '')[:40] or 'fleetline'}",
            f"SlurmctldHost=localhost({self.host})",
            f"SlurmctldPort={ports[0]}",
            f"SlurmdPort={ports[1]}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge / 'munge.socket'}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'run' / 'slurmctld.pidfile'}",
            f"SlurmdPidFile={d / 'run'}/slurmd-%n.pidfile",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            # The nodes share this host: their declared CPUs and memory stand, not the host's.
            "SlurmdParameters=config_overrides",
            # A node that stopped answering comes back by itself; one set DOWN stays down.
            "ReturnToService=1",
            "MpiDefault=none",
            # Each node's own temporary directory: PMIx (srun --mpi=pmix) makes its step
            # directories there, and the nodes sharing this host would otherwise collide.
            f"TmpFS={d / 'tmp'}/%n",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "KillWait=5",
            # Loopback answers in milliseconds: a controller that does not answer in 4 s is
            # down, and a command says so then rather than after Slurm's default 10 s.
            "MessageTimeout=4",
            "MinJobAge=600",
        ]
        for node, port in zip(self.nodes, ports[2:], strict=True):
            lines.append(
                f"NodeName={node} NodeHostname=localhost NodeAddr={self.host} Port={port} "
                f"CPUs=8 RealMemory=16000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
            )
        lines.append("PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        if self.leaves:
            lines.append("TopologyPlugin=topology/tree")
            (self.directory / "topology.conf").write_text(
                "".join(f"SwitchName={leaf} Nodes={','.join(ns)}\n" for leaf, ns in self.leaves)
                + f"SwitchName=spine Switches={','.join(leaf for leaf, _ in self.leaves)}\n"
            )
        self.conf.write_text("\n".join(lines) + "\n")
        nodes = ",".join(self.nodes)
        if self.nvlink_islands:
            island_of = {g: i for i, island in enumerate(self.nvlink_islands) for g in island}
            gres = "".join(
                f"NodeName={nodes} Name=gpu File={devices}/gpu{g} Links="
                + ",".join(
                    "-1" if o == g else str(int(island_of.get(o) == island_of.get(g)))
                    for o in range(GPUS_PER_NODE)
                )
                + "\n"
                for g in range(GPUS_PER_NODE)
            )
        else:
            gres = f"NodeName={nodes} Name=gpu File={devices}/gpu[0-{GPUS_PER_NODE - 1}]\n"
        (self.directory / "gres.conf").write_text("AutoDetect=off\n" + gres)

    def _setting(self, name: str) -> str:
        for line in self.conf.read_text().splitlines():
            if line.startswith(f"{name}="):
                return line.split("=", 1)[1]
        raise ServiceError(f"{self.conf}: no {name}")

    def _node_ports(self) -> list[int]:
        ports = {}
        for line in self.conf.read_text().splitlines():
            if line.startswith("NodeName="):
                fields = dict(f.split("=", 1) for f in line.split())
                ports[fields["NodeName"]] = int(fields["Port"])
        return [ports[n] for n in self.nodes]

    def _nodes_idle(self) -> bool:
        try:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"],
                env={**os.environ, **self.env},
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout
        except subprocess.TimeoutExpired:
            return False
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(n) in ("idle", "mix", "alloc") for n in self.nodes)

    def _await(self, done: Callable[[], bool], what: str, daemon: ServiceProcess) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if done():
                return
            time.sleep(0.2)
        raise ServiceError(
            f"Slurm {self.cluster_id}: no {what} within {READY_TIMEOUT_S:.0f} s; "
            f"{daemon.name}'s last log lines:\n{tail(daemon.log_file)}"
        )

    def stop(self) -> bool:
        """Cancel every job, then stop the daemons (a job step left behind would run on with
        no slurmd to end it); True if any ran."""
        if self._daemon("slurmctld").pid() is not None:
            env = {**os.environ, **self.env}
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                subprocess.run(
                    ["scancel", "--full", "--state=RUNNING,PENDING,SUSPENDED", "--user=root"],
                    env=env,
                    capture_output=True,
                    timeout=15,
                    check=False,
                )
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    queue = subprocess.run(
                        ["squeue", "-h", "-t", "RUNNING,PENDING,COMPLETING,SUSPENDED"],
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=10,
                        check=False,
                    )
                    if queue.returncode != 0 or not queue.stdout.strip():
                        break
                    time.sleep(0.3)
        ran = False
        for daemon in reversed(self._daemons()):
            ran = daemon.stop(timeout_s=10) or ran
        self.kill_orphaned_jobs()
        return ran

    def kill_orphaned_jobs(self) -> int:
        """SIGKILL what is left of this cluster's jobs: a batch script running from one of its
        nodes' spool directories, the `slurmstepd` above it and everything below it. A job
        cancelled while its node was still launching it can leave them running with no
        controller that knows of them (seen with 32 nodes and jobs cancelled within a second of
        starting). How many processes were killed."""
        spool = str(self.directory / "spool") + "/"
        children: dict[int, list[int]] = {}
        commands: dict[int, str] = {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                stat = (proc / "stat").read_text()
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue  # gone meanwhile
            pid, parent = int(proc.name), int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(pid)
            commands[pid] = command
        parents = {pid: parent for parent, pids in children.items() for pid in pids}
        doomed: set[int] = set()
        for pid, command in commands.items():
            if spool not in command:
                continue
            parent = parents.get(pid, 0)
            if commands.get(parent, "").startswith("slurmstepd"):
                doomed.add(parent)
            below = [pid]
            while below:
                doomed.add(below[-1])
                below.extend(children.get(below.pop(), []))
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(doomed)

    @staticmethod
    def found_nodes(conf: Path) -> tuple[str, ...]:
        return tuple(
            line.split()[0].removeprefix("NodeName=")
            for line in conf.read_text().splitlines()
            if line.startswith("NodeName=")
        )

    @classmethod
    def found(cls, cache_dir: Path) -> list[SlurmCluster]:
        """Every Slurm cluster `infra start --slurm` configured under `cache_dir`."""
        return [
            cls(conf.parent.name, cls.found_nodes(conf), conf.parent)
            for conf in sorted((cache_dir / "slurm").glob("*/slurm.conf"))
        ]

    def wipe(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
