"""A Kubernetes control plane on this host for a fleetline cluster, with fake GPU nodes:
`fleetline infra start --kubernetes C:N`.

The real kube-apiserver, kube-scheduler and kube-controller-manager are built from the Go
module `k8s.io/kubernetes` (a plain `go install` refuses it: its go.mod replaces its staging
modules with folders of its own repository, so they are built inside a throwaway module that
replaces each staging module with its release); etcd from a throwaway module whose main calls
`etcdmain.Main`; kwok and kwokctl with `go install`. All into the user's cache,
`~/.cache/fleetline/kubernetes/<version>/bin` (the first build takes about 20 minutes on two
cores; into a fresh cache with Go's caches warm, under a minute; later starts take seconds).
`kwokctl create cluster --runtime binary` runs them on loopback, and the cluster's nodes are
Node objects kwok keeps alive: named as the simulator names the fleetline cluster's nodes
(`<cluster>-n0000`, ...), each with `nvidia.com/gpu: 8` allocatable. The real kube-scheduler
places pods on them; kwok moves the pods through their phases; nothing executes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetline.errors import ServiceError
from fleetline.infra.managed import cluster_nodes
from fleetline.infra.process import run_checked
from fleetline.kube import KubeApi, KubeError

KUBERNETES_VERSION = "v1.37.2"
STAGING_VERSION = "v0.37.2"  # the staging modules' release that goes with it
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.8.0"
COMPONENTS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager")
GPUS_PER_NODE = 8
GPU_RESOURCE = "nvidia.com/gpu"
ETCD_MAIN = """package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
\tetcdmain.Main(os.Args)
}
"""


def staging_modules(kubernetes_go_mod: str) -> list[str]:
    """The modules k8s.io/kubernetes's go.mod replaces with its own staging folders."""
    return re.findall(r"^\s*(k8s\.io/[\w.-]+) => \./staging/src/", kubernetes_go_mod, re.M)


def build_go_mod(kubernetes_go_mod: str) -> str:
    """The throwaway module's go.mod: k8s.io/kubernetes, its staging modules as releases."""
    replaces = [f"\t{m} => {m} {STAGING_VERSION}" for m in staging_modules(kubernetes_go_mod)]
    if not replaces:
        raise ServiceError("k8s.io/kubernetes's go.mod replaces no staging module: not its go.mod?")
    return "\n".join(
        [
            "module fleetline.local/kubernetes-build",
            "",
            "go 1.26.0",
            "",
            f"require k8s.io/kubernetes {KUBERNETES_VERSION}",
            "",
            "replace (",
            *replaces,
            ")",
            "",
        ]
    )


def shared_cache() -> Path:
    """Where the binaries are built once for every checkout of this user: the user's cache
    (`$XDG_CACHE_HOME`, else `~/.cache`), as Go keeps its own, so that a clean clone (CI's)
    starts in seconds rather than building for minutes; `FLEETLINE_KUBERNETES_CACHE` says
    otherwise."""
    given = os.environ.get("FLEETLINE_KUBERNETES_CACHE")
    if given:
        return Path(given).resolve()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base.resolve() / "fleetline" / "kubernetes" / KUBERNETES_VERSION


@dataclass(frozen=True)
class KubernetesBinaries:
    """The control plane's binaries, built once into the user's cache (`shared_cache`); what
    a checkout runs of them (kwokctl's clusters, the logs) under its own `.cache/kubernetes`."""

    cache_dir: Path
    shared: Path = field(default_factory=shared_cache)

    @property
    def root(self) -> Path:
        # Absolute: kwokctl runs the binaries from its own working folder.
        return self.cache_dir.resolve() / "kubernetes"

    @property
    def bin_dir(self) -> Path:
        return self.shared / "bin"

    def path(self, name: str) -> Path:
        return self.bin_dir / name

    def missing(self) -> list[str]:
        names = (*COMPONENTS, "etcd", "kwok", "kwokctl")
        return [n for n in names if not self.path(n).exists()]

    def build(self) -> float:
        """Build what is missing; the seconds it took (0 when nothing was)."""
        missing = self.missing()
        if not missing:
            return 0.0
        if shutil.which("go") is None:
            raise ServiceError("go is not on PATH; it is needed once to build Kubernetes")
        began = time.monotonic()
        logs = self.root / "logs"
        env = {"GOFLAGS": "-modcacherw"}
        if set(missing) & set(COMPONENTS):
            module = self.shared / "build"
            module.mkdir(parents=True, exist_ok=True)
            run_checked(
                ["go", "mod", "download", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"],
                what="fetching k8s.io/kubernetes's go.mod",
                cwd=module,
                env=env,
                log=logs / "kubernetes-download.log",
            )
            cache = subprocess.run(
                ["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=True
            ).stdout.strip()
            upstream = Path(
                cache, "cache/download/k8s.io/kubernetes/@v", f"{KUBERNETES_VERSION}.mod"
            )
            (module / "go.mod").write_text(build_go_mod(upstream.read_text()))
            run_checked(
                [
                    "go",
                    "get",
                    *(f"k8s.io/kubernetes/cmd/{c}@{KUBERNETES_VERSION}" for c in COMPONENTS),
                ],
                what="resolving Kubernetes' modules",
                cwd=module,
                env=env,
                log=logs / "kubernetes-get.log",
            )
            version = KUBERNETES_VERSION.lstrip("v").split(".")
            flags = (
                f"-X k8s.io/component-base/version.gitVersion={KUBERNETES_VERSION} "
                f"-X k8s.io/component-base/version.gitMajor={version[0]} "
                f"-X k8s.io/component-base/version.gitMinor={version[1]}"
            )
            run_checked(
                ["go", "build", "-ldflags", flags, "-o", f"{self.bin_dir}/"]
                + [f"k8s.io/kubernetes/cmd/{c}" for c in COMPONENTS],
                what="building the Kubernetes control plane",
                cwd=module,
                env=env,
                log=logs / "kubernetes-build.log",
            )
        if "etcd" in missing:
            module = self.shared / "etcd"
            module.mkdir(parents=True, exist_ok=True)
            (module / "main.go").write_text(ETCD_MAIN)
            (module / "go.mod").write_text("module fleetline.local/etcd-build\n\ngo 1.26.0\n")
            for argv, what in (
                (["go", "get", f"go.etcd.io/etcd/server/v3@{ETCD_VERSION}"], "resolving etcd"),
                (["go", "mod", "tidy"], "resolving etcd's modules"),
                (["go", "build", "-o", str(self.path("etcd")), "."], "building etcd"),
            ):
                run_checked(argv, what=what, cwd=module, env=env, log=logs / "etcd-build.log")
        if {"kwok", "kwokctl"} & set(missing):
            run_checked(
                ["go", "install"]
                + [f"sigs.k8s.io/kwok/cmd/{c}@{KWOK_VERSION}" for c in ("kwok", "kwokctl")],
                what="building kwok",
                env={**env, "GOBIN": str(self.bin_dir)},
                log=logs / "kwok-build.log",
            )
        return time.monotonic() - began


@dataclass(frozen=True)
class KwokCluster:
    """One fleetline cluster's Kubernetes: a kwokctl cluster named after it, and its nodes."""

    cluster_id: str
    nodes: tuple[str, ...]
    binaries: KubernetesBinaries

    @classmethod
    def parse(cls, cache_dir: Path, text: str) -> KwokCluster:
        """`CLUSTER[:NODES]` (1 node when not said)."""
        cluster_id, nodes = cluster_nodes(text)
        return cls(cluster_id, nodes, KubernetesBinaries(cache_dir))

    @property
    def workdir(self) -> Path:
        return self.binaries.root / "kwok"

    @property
    def name(self) -> str:
        return re.sub(r"[^a-z0-9-]", "-", self.cluster_id.lower())

    @property
    def kubeconfig(self) -> Path:
        """kwokctl's own kubeconfig of the cluster (its CA, its admin certificate)."""
        return self.workdir / "clusters" / self.name / "kubeconfig.yaml"

    def _kwokctl(self, *args: str, what: str) -> None:
        run_checked(
            [str(self.binaries.path("kwokctl")), *args, "--name", self.name],
            what=what,
            env={"KWOK_WORKDIR": str(self.workdir)},
            log=self.binaries.root / "logs" / f"kwokctl-{self.name}.log",
        )

    def running(self) -> bool:
        try:
            return self.api().get("/version") is not None
        except (KubeError, OSError):
            return False

    def start(self) -> float:
        """Build (once), start the control plane and declare the nodes; the seconds it took."""
        began = time.monotonic()
        self.binaries.build()
        if not self.running():
            # A cluster left half-made (its processes gone) is made again.
            shutil.rmtree(self.workdir / "clusters" / self.name, ignore_errors=True)
            b = self.binaries.path
            # Every component on loopback (etcd and the API server default to every address).
            config = self.workdir / "kwok.yaml"
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(
                "kind: KwokctlConfiguration\n"
                "apiVersion: config.kwok.x-k8s.io/v1alpha1\n"
                "options:\n"
                "  bindAddress: 127.0.0.1\n"
            )
            self._kwokctl(
                "create", "cluster", "--config", str(config), "--runtime", "binary",
                "--kube-apiserver-binary", str(b("kube-apiserver")),
                "--kube-controller-manager-binary", str(b("kube-controller-manager")),
                "--kube-scheduler-binary", str(b("kube-scheduler")),
                "--etcd-binary", str(b("etcd")),
                "--kwok-controller-binary", str(b("kwok")),
                "--kubeconfig", str(self.workdir / f"{self.name}.kubeconfig"),
                "--wait", "120s",
                what=f"starting Kubernetes for {self.cluster_id}",
            )  # fmt: skip
        api = self.api()
        for node in self.nodes:
            api.ensure("/api/v1/nodes", node, gpu_node(node))
        return time.monotonic() - began

    def stop(self) -> bool:
        if not self.kubeconfig.exists():
            return False
        self._kwokctl("delete", "cluster", what=f"stopping Kubernetes for {self.cluster_id}")
        return True

    def api(self) -> KubeApi:
        return KubeApi.from_kubeconfig(self.kubeconfig)


def gpu_node(name: str) -> dict[str, Any]:
    """A Node kwok keeps alive (its annotation), with 8 GPUs and the taint GPU nodes carry, so
    only pods that ask for GPUs land there."""
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", GPU_RESOURCE: str(GPUS_PER_NODE)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake"},
            "labels": {"type": "kwok", "kubernetes.io/hostname": name},
        },
        "spec": {"taints": [{"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}]},
        "status": {"allocatable": resources, "capacity": resources},
    }


def found(cache_dir: Path) -> list[KwokCluster]:
    """Every cluster `infra start --kubernetes` created under `cache_dir`."""
    binaries = KubernetesBinaries(cache_dir)
    root = binaries.root / "kwok" / "clusters"
    clusters = []
    for config in sorted(root.glob("*/kubeconfig.yaml")):
        cluster = KwokCluster(config.parent.name, (), binaries)
        try:
            nodes = cluster.api().get("/api/v1/nodes") or {}
        except KubeError:
            nodes = {}
        names = tuple(sorted(n["metadata"]["name"] for n in nodes.get("items", [])))
        clusters.append(KwokCluster(config.parent.name, names, binaries))
    return clusters
