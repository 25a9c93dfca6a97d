"""How a cluster agent runs a workload on its cluster: the port, and one backend per kind of
cluster (`fleetline cluster-agent --backend process|slurm|kubernetes`).

The agent's reconcile loop, fencing, re-adoption and reporting are the same for every backend;
a backend only starts a run, finds it again and signals it, each the way its cluster's own
manager does. Every run keeps its run directory (`workloads.py`): the progress file, the exit
code the launcher writes and the agent's marks. On a cluster under a manager the state
directory must be on the cluster's shared filesystem, as a Slurm cluster's home directories
are, since the run's first worker writes there from its node.

A new backend is a module here with a `Launcher` and its `RunHandle`, named in `BACKENDS`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fleetline.agents.cluster.nodes import ManagerNode
from fleetline.agents.cluster.workloads import RunHandle

BACKENDS = ("process", "slurm", "kubernetes")


@dataclass(frozen=True)
class RunRequest:
    """One run to start: the order's job and run, where its workers go, what to run with which
    environment (the workload contract's, without GPU binding: the backend adds it), and its
    run directory (already holding its meta and control files)."""

    cluster_id: str
    job: str
    tenant: str
    epoch: int
    attempt: int
    trace_id: str
    priority_class: str
    workers: tuple[tuple[str, tuple[int, ...]], ...]
    command: Sequence[str]
    env: Mapping[str, str]
    directory: Path

    @property
    def run(self) -> str:
        return f"e{self.epoch}-a{self.attempt}"

    def meta(self) -> dict[str, Any]:
        """What names the run wherever it is found again (its directory, its manager's job;
        read back by `found_meta`)."""
        return {
            "job": self.job,
            "tenant": self.tenant,
            "epoch": self.epoch,
            "attempt": self.attempt,
            "trace_id": self.trace_id,
        }


def found_meta(kept: Mapping[str, Any]) -> dict[str, Any] | None:
    """A run's meta from what its manager kept of it (a job's comment, a pod's annotation);
    None when anything of it is missing."""
    meta = {k: kept.get(k) for k in ("job", "tenant", "epoch", "attempt", "trace_id")}
    return None if None in meta.values() else meta


class Launcher(Protocol):
    """One cluster's way of running workloads."""

    backend: str
    manager: str  # the manager's name, as reasons name it: "Slurm", "Kubernetes" ("" for none)

    def start(self, request: RunRequest) -> tuple[RunHandle, str]:
        """Start the run; (its handle, what was applied: isolation, the manager's job)."""
        ...

    def find(self, directory: Path) -> RunHandle | None:
        """The run a run directory records, as its manager knows it now (None: never started)."""
        ...

    def refresh(self) -> None:
        """Once per pass of the agent's loop: learn what the manager says of every run."""
        ...

    def unrecorded(self, root: Path) -> list[tuple[Path, dict[str, Any]]]:
        """Runs the manager knows that no run directory under `root` records (a state directory
        lost with its host, or an agent killed between starting a run and recording it): (the
        directory to record each in, its meta)."""
        ...

    def control_error(self) -> str | None:
        """Why the cluster's manager cannot be used now, in its own words; None when it can."""
        ...

    def manager_nodes(self) -> Mapping[str, ManagerNode] | None:
        """Every node as the manager last reported it; None where there is no manager."""
        ...

    def drain(self, node: str, reason: str) -> None:
        """Take new jobs off a node in the manager (what runs there finishes)."""
        ...

    def resume(self, node: str) -> None:
        """Give a node fleetline drained back to the manager's scheduling."""
        ...

    def close(self) -> None:
        """The agent stops: let go of what the launcher holds (its watches); runs go on."""
        ...


def launcher_for(
    backend: str,
    cluster_id: str,
    *,
    slurm_conf: Path | None = None,
    kubeconfig: Path | None = None,
    namespace: str = "default",
    image: str | None = None,
    grace_s: float = 20.0,
) -> Launcher:
    """The backend's launcher, with what its manager needs: Slurm's configuration, or the
    kubeconfig, namespace and workload image of a Kubernetes cluster."""
    if backend == "process":
        from fleetline.agents.cluster.backends.process import ProcessLauncher

        return ProcessLauncher()
    if backend == "slurm":
        from fleetline.agents.cluster.backends.slurm import SlurmLauncher

        return SlurmLauncher(cluster_id, slurm_conf)
    if backend == "kubernetes":
        from fleetline.agents.cluster.backends.kubernetes import DEFAULT_IMAGE, KubernetesLauncher
        from fleetline.kube import KubeApi

        if kubeconfig is None:
            raise ValueError("the kubernetes backend needs a kubeconfig")
        return KubernetesLauncher(
            cluster_id,
            KubeApi.from_kubeconfig(kubeconfig),
            namespace,
            image or DEFAULT_IMAGE,
            grace_s,
        )
    raise ValueError(f"unknown backend {backend!r}: one of {', '.join(BACKENDS)}")
