"""The Kubernetes backend: every run one pod per worker, pinned to the nodes fleetline placed it
on, in the cluster's own Kubernetes.

A RUN order becomes, in the agent's namespace:
- a headless Service named after the run (`fl-<job>-e<epoch>-a<attempt>-<hash>`), through which
  each worker finds the others: worker k is the pod `<run>-r<k>`, reached at
  `<run>-r<k>.<run>` (its hostname and the Service as its subdomain);
- a Secret with the workload contract's environment (the storage credentials and checkpoint key
  among it), which each pod reads whole (`envFrom`), rather than credentials in the pod spec;
- one pod per worker: node affinity to its node (`kubernetes.io/hostname`), `nvidia.com/gpu`
  limits of its GPU count (the device plugin binds them; the API does not say which indices),
  a toleration of the GPU nodes' taint, its rank, world size and master address
  (`FLEETLINE_RANK`, `FLEETLINE_MASTER_ADDR`), `restartPolicy: Never` (fleetline's retry policy,
  not the kubelet's, says what follows a failure) and the run directory mounted at the same path
  (on a production cluster a shared filesystem, as for Slurm).
The pods and the Secret belong to the Service (owner references): deleting it removes the run.
Labels carry the cluster, job, epoch, attempt, run and rank; an annotation the run's meta
(JSON), so a restarted agent finds its runs by label even without their run directories.

What the agent learns comes from watches (list, then watch from the list's resourceVersion; a
watch the server ends is resumed, a 410 relisted), of the cluster's pods and of the nodes, kept in
memory by one thread each: the agent's loop never waits on the API server. STOP deletes the pods
with the agent's grace period (the kubelet sends SIGTERM, the workload checkpoints), then with
none. A node that is not Ready or is cordoned is a node out of service; a fleetline cordon
cordons the node (`spec.unschedulable`) with an annotation saying it is fleetline's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import threading
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetline.agents.cluster.backends import RunRequest, found_meta
from fleetline.agents.cluster.nodes import ManagerNode
from fleetline.agents.cluster.workloads import run_dir
from fleetline.kube import KubeApi, KubeError

log = logging.getLogger(__name__)

GPU_RESOURCE = "nvidia.com/gpu"
LABEL = "fleetline.io"
META_ANNOTATION = f"{LABEL}/meta"
DRAINED_ANNOTATION = f"{LABEL}/drained"
RUN_FILE = "kubernetes-run"
DEFAULT_IMAGE = "fleetline:latest"
WATCH_TIMEOUT_S = 30
DELETED_KEPT = 1024  # deletions remembered to refuse a late answer reviving one
SYNC_WAIT_S = 10.0  # how long a restarted agent waits for its first list before adopting
LIVE_PHASES = frozenset({"Pending", "Running", "Unknown"})


def label_value(text: str) -> str:
    """A label value for any text: letters, digits, `-_.`, at most 63, alphanumeric at the ends."""
    value = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:63]
    return value.strip("-_.") or "x"


def run_name(cluster_id: str, job: str, epoch: int, attempt: int) -> str:
    """The run's Service name (a DNS label, room left for `-r<rank>`): readable and unique."""
    digest = hashlib.sha256(f"{cluster_id}\0{job}\0{epoch}\0{attempt}".encode()).hexdigest()[:6]
    slug = re.sub(r"[^a-z0-9-]+", "-", job.lower()).strip("-")[:24].strip("-") or "job"
    return f"fl-{slug}-e{epoch}-a{attempt}-{digest}"


def pod_env(env: Mapping[str, str]) -> dict[str, str]:
    """What of the run's environment a pod gets: what fleetline set, not the agent's own host
    environment (its PATH, its HOME: meaningless in a container)."""
    return {k: v for k, v in env.items() if k.startswith("FLEETLINE_") or os.environ.get(k) != v}


def container_command(command: Iterable[str]) -> list[str]:
    """The workload's command inside its image: the agent's own interpreter is `python` there."""
    argv = list(command)
    if argv and argv[0] == sys.executable:
        argv[0] = "python"
    return argv


def meta_annotation(request: RunRequest) -> str:
    """The run's meta as its objects carry it (with its run directory)."""
    return json.dumps({**request.meta(), "dir": str(request.directory)}, sort_keys=True)


def pods_for(
    request: RunRequest,
    namespace: str,
    image: str,
    grace_s: float,
    labels: Mapping[str, str],
) -> list[dict[str, Any]]:
    """The run's pods, one per worker (rank order), as the API takes them."""
    name = run_name(request.cluster_id, request.job, request.epoch, request.attempt)
    meta = meta_annotation(request)
    master = f"{name}-r0.{name}.{namespace}.svc"
    pods = []
    for rank, (node, gpus) in enumerate(request.workers):
        progress = request.env.get("FLEETLINE_PROGRESS_FILE", "")
        env = {
            # Global: a split job's part starts at its first rank.
            "FLEETLINE_RANK": str(int(request.env.get("FLEETLINE_RANK_BASE") or 0) + rank),
            "FLEETLINE_LOCAL_RANK": str(rank),
            "FLEETLINE_MASTER_ADDR": master,
            # Ranks above 0 write their progress beside rank 0's, which the agent reads.
            **({"FLEETLINE_PROGRESS_FILE": f"{progress}.rank{rank}"} if rank and progress else {}),
        }
        container: dict[str, Any] = {
            "name": "worker",
            "image": image,
            "command": container_command(request.command),
            "env": [{"name": k, "value": v} for k, v in env.items()],
            "envFrom": [{"secretRef": {"name": name}}],
            "volumeMounts": [{"name": "run", "mountPath": str(request.directory)}],
        }
        if gpus:
            container["resources"] = {"limits": {GPU_RESOURCE: str(len(gpus))}}
        pods.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{name}-r{rank}",
                    "namespace": namespace,
                    "labels": {**labels, f"{LABEL}/rank": str(rank)},
                    "annotations": {META_ANNOTATION: meta},
                },
                "spec": {
                    "hostname": f"{name}-r{rank}",
                    "subdomain": name,
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": int(grace_s),
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {
                                        "matchExpressions": [
                                            {
                                                "key": "kubernetes.io/hostname",
                                                "operator": "In",
                                                "values": [node],
                                            }
                                        ]
                                    }
                                ]
                            }
                        }
                    },
                    "tolerations": [
                        {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
                    ],
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "run",
                            "hostPath": {
                                "path": str(request.directory),
                                "type": "DirectoryOrCreate",
                            },
                        }
                    ],
                },
            }
        )
    return pods


def manager_node(node: Mapping[str, Any]) -> ManagerNode:
    """A Node as the backend sees it: usable when Ready and not cordoned."""
    metadata = node.get("metadata") or {}
    spec = node.get("spec") or {}
    ready: Mapping[str, Any] = next(
        (c for c in (node.get("status") or {}).get("conditions") or () if c.get("type") == "Ready"),
        {},
    )
    drained = (metadata.get("annotations") or {}).get(DRAINED_ANNOTATION)
    why = (
        "Ready"
        if ready.get("status") == "True"
        else f"NotReady ({ready.get('reason') or 'no Ready condition'})"
    )
    if spec.get("unschedulable"):
        why += ",SchedulingDisabled" + (f" ({drained})" if drained else "")
    return ManagerNode(
        str(metadata.get("name")),
        ready.get("status") == "True" and not spec.get("unschedulable"),
        why,
        drained is not None,
    )


def _version(obj: Mapping[str, Any]) -> int:
    """An object's resourceVersion as a number, to tell which of two states is newer. The API
    calls versions opaque; every server built on etcd (all of them) hands out its revision."""
    try:
        return int(obj["metadata"].get("resourceVersion") or -1)
    except ValueError:
        return -1


class Informer:
    """One collection kept current in memory: listed, then watched from the list's version."""

    def __init__(self, api: KubeApi, collection: str, selector: str | None = None) -> None:
        self.api = api
        self.collection = collection
        self.query = {"labelSelector": selector} if selector else {}
        self.objects: dict[str, dict[str, Any]] = {}
        self.error: str | None = None
        self.listed = threading.Event()  # a first list has been read
        self.began = 0  # lists asked for so far
        self.read = 0  # the number (in `began`) of the last list read
        self._lock = threading.Lock()
        # Names the watch saw deleted, with the deletion's version (the newest few).
        self._deleted: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"watch {self.collection}", daemon=True
            )
            self._thread.start()

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return dict(self.objects)

    def get(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self.objects.get(name)

    def put(self, obj: Mapping[str, Any]) -> None:
        """What a call of ours has just made (a created pod): known before the watch says so.
        The watch may have overtaken the call's answer (the pod already scheduled and running,
        or deleted): an answer older than what the watch showed is dropped, or the pod would
        stay Pending, or alive, in memory while no further event comes to correct it."""
        name = obj["metadata"]["name"]
        version = _version(obj)
        with self._lock:
            seen = self.objects.get(name)
            if seen is not None and _version(seen) >= version:
                return
            if self._deleted.get(name, -1) >= version:
                return
            self.objects[name] = dict(obj)

    def close(self) -> None:
        """Watch no more (the watch under way ends within its timeout)."""
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self.began += 1
                number = self.began
                listed = self.api.ok(
                    "GET", f"{self.collection}?{urllib.parse.urlencode(self.query)}"
                )
                with self._lock:
                    self.objects = {o["metadata"]["name"]: o for o in listed.get("items") or ()}
                    self.read = number
                self.error = None
                self.listed.set()
                version = str(listed["metadata"]["resourceVersion"])
                while not self._closed.is_set():
                    for event in self.api.watch(
                        self.collection, self.query, version, WATCH_TIMEOUT_S
                    ):
                        if self._closed.is_set():
                            return
                        obj = event["object"]
                        version = str(obj["metadata"].get("resourceVersion") or version)
                        with self._lock:
                            if event["type"] == "DELETED":
                                self.objects.pop(obj["metadata"]["name"], None)
                                self._deleted[obj["metadata"]["name"]] = _version(obj)
                                while len(self._deleted) > DELETED_KEPT:
                                    del self._deleted[next(iter(self._deleted))]
                            elif event["type"] in ("ADDED", "MODIFIED"):
                                self.objects[obj["metadata"]["name"]] = obj
            except KubeError as exc:
                if exc.status != 410:  # 410 Gone: the version is too old; list afresh
                    if self.error != str(exc):
                        log.warning("%s", exc)
                    self.error = str(exc)
                    self._closed.wait(1.0)
            except (KeyError, TypeError, ValueError) as exc:
                self.error = f"watch {self.collection}: unreadable answer ({exc!r})"
                self._closed.wait(1.0)


def _terminated(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    for status in (pod.get("status") or {}).get("containerStatuses") or ():
        terminated = (status.get("state") or {}).get("terminated")
        if terminated:
            return dict(terminated)
    return {}


@dataclass
class KubernetesRun:
    """One run's pods, as the launcher's watch shows them."""

    launcher: KubernetesLauncher
    directory: Path
    name: str  # the run's Service
    pods: tuple[str, ...]
    # The pod watch's lists asked for before the pods were made: a pod missing from a list
    # asked for later is gone; from an earlier one, it is not known yet.
    made_after: int

    @property
    def label(self) -> str:
        return (
            f"Kubernetes pods {self.name}-r*"
            if len(self.pods) > 1
            else f"Kubernetes pod {self.pods[0]}"
        )

    @property
    def pid(self) -> int | None:
        return None

    def _pods(self) -> dict[str, dict[str, Any] | None]:
        return {name: self.launcher.pods.get(name) for name in self.pods}

    def _unknown_yet(self) -> bool:
        return self.launcher.pods.read <= self.made_after

    def alive(self) -> bool:
        if self.launcher.control_error() is not None or not self.launcher.pods.listed.is_set():
            return True  # the API server does not answer: nothing is known to have ended
        pods = self._pods()
        if any(p is None for p in pods.values()) and not self._unknown_yet():
            return False
        if any(
            p is not None and p.get("status", {}).get("phase") == "Failed" for p in pods.values()
        ):
            return False
        return any(
            p is None or p.get("status", {}).get("phase", "Pending") in LIVE_PHASES
            for p in pods.values()
        )

    def placed(self) -> str | None:
        pods = self._pods()
        if any(p is None or p.get("status", {}).get("phase") != "Running" for p in pods.values()):
            return None
        where = []
        for pod in pods.values():
            assert pod is not None
            limits = pod["spec"]["containers"][0].get("resources", {}).get("limits", {})
            where.append(
                f"{pod['spec'].get('nodeName')} ({limits.get(GPU_RESOURCE, 0)} {GPU_RESOURCE})"
            )
        return f"{self.label} on {', '.join(where)}"

    def signal(self, signum: int) -> None:
        grace = int(self.launcher.grace_s) if signum == 15 else 0
        for pod in self.pods:
            self.launcher.delete(f"pods/{pod}", grace)

    def ended(self, exit_code: int | None) -> tuple[int, str] | None:
        pods = self._pods()
        failed = [
            p for p in pods.values() if p is not None and p["status"].get("phase") == "Failed"
        ]
        gone = [name for name, p in pods.items() if p is None]
        # Whatever ends the run ends all of it: the other workers go with the Service.
        self.launcher.delete(f"services/{self.name}", 0, propagation="Background")
        if failed:
            pod = failed[0]
            terminated = _terminated(pod)
            why = terminated.get("reason") or pod["status"].get("reason") or "Failed"
            message = terminated.get("message") or pod["status"].get("message")
            reason = (
                f"Kubernetes: pod {pod['metadata']['name']} Failed ({why}"
                + (f": {message}" if message else "")
                + ")"
            )
            return int(terminated.get("exitCode") or 1), reason
        if gone:
            return 137, f"Kubernetes: pod {gone[0]} was deleted"
        codes = [int(_terminated(p).get("exitCode") or 0) for p in pods.values() if p is not None]
        return (max(codes, default=0), f"{self.label} Succeeded")


class KubernetesLauncher:
    backend = "kubernetes"
    manager = "Kubernetes"

    def __init__(
        self,
        cluster_id: str,
        api: KubeApi,
        namespace: str = "default",
        image: str = DEFAULT_IMAGE,
        grace_s: float = 20.0,
    ) -> None:
        self.cluster_id = cluster_id
        self.api = api
        self.namespace = namespace
        self.image = image
        self.grace_s = grace_s
        base = f"/api/v1/namespaces/{namespace}"
        self.base = base
        self.pods = Informer(api, f"{base}/pods", f"{LABEL}/cluster={label_value(cluster_id)}")
        self.nodes = Informer(api, "/api/v1/nodes")

    def _started(self) -> None:
        self.pods.start()
        self.nodes.start()

    def refresh(self) -> None:
        self._started()

    def close(self) -> None:
        self.pods.close()
        self.nodes.close()

    def control_error(self) -> str | None:
        error = self.pods.error or self.nodes.error
        return None if error is None else f"Kubernetes: {error}"

    def manager_nodes(self) -> Mapping[str, ManagerNode] | None:
        if not self.nodes.listed.is_set():
            return None
        return {name: manager_node(node) for name, node in self.nodes.snapshot().items()}

    def _patch_node(self, node: str, body: Mapping[str, Any]) -> None:
        self.api.ok(
            "PATCH", f"/api/v1/nodes/{node}", body, content_type="application/merge-patch+json"
        )

    def drain(self, node: str, reason: str) -> None:
        self._patch_node(
            node,
            {
                "spec": {"unschedulable": True},
                "metadata": {"annotations": {DRAINED_ANNOTATION: reason}},
            },
        )

    def resume(self, node: str) -> None:
        self._patch_node(
            node,
            {
                "spec": {"unschedulable": False},
                "metadata": {"annotations": {DRAINED_ANNOTATION: None}},
            },
        )

    def delete(self, path: str, grace_s: int, propagation: str | None = None) -> None:
        query = f"?gracePeriodSeconds={grace_s}" + (
            f"&propagationPolicy={propagation}" if propagation else ""
        )
        try:
            status, answer = self.api.call("DELETE", f"{self.base}/{path}{query}")
        except KubeError as exc:
            log.warning("%s: deleting %s: %s", self.cluster_id, path, exc)
            return
        if status >= 300 and status != 404:
            log.warning("%s: deleting %s: %s", self.cluster_id, path, answer)

    def start(self, request: RunRequest) -> tuple[KubernetesRun, str]:
        self._started()
        if not self.nodes.listed.wait(SYNC_WAIT_S):
            raise KubeError(f"no list of nodes from the API server in {SYNC_WAIT_S:.0f} s")
        known = self.nodes.snapshot()
        unknown = sorted({node for node, _ in request.workers} - set(known))
        if unknown:
            raise KubeError(
                f"{', '.join(unknown)}: not a node of this Kubernetes cluster "
                f'(nodes "{unknown[0]}" not found)',
                404,
            )
        name = run_name(request.cluster_id, request.job, request.epoch, request.attempt)
        labels = {
            f"{LABEL}/cluster": label_value(self.cluster_id),
            f"{LABEL}/job": label_value(request.job),
            f"{LABEL}/epoch": str(request.epoch),
            f"{LABEL}/attempt": str(request.attempt),
            f"{LABEL}/run": name,
        }
        meta = meta_annotation(request)
        service = self.api.ok(
            "POST",
            f"{self.base}/services",
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    "name": name,
                    "labels": labels,
                    "annotations": {META_ANNOTATION: meta},
                },
                "spec": {"clusterIP": "None", "selector": {f"{LABEL}/run": name}},
            },
        )
        owner = [
            {"apiVersion": "v1", "kind": "Service", "name": name, "uid": service["metadata"]["uid"]}
        ]
        self.api.ok(
            "POST",
            f"{self.base}/secrets",
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": name, "labels": labels, "ownerReferences": owner},
                "stringData": pod_env(request.env),
            },
        )
        pods = pods_for(request, self.namespace, self.image, self.grace_s, labels)
        made_after = self.pods.began
        for pod in pods:
            pod["metadata"]["ownerReferences"] = owner
            self.pods.put(self.api.ok("POST", f"{self.base}/pods", pod))
        names = tuple(p["metadata"]["name"] for p in pods)
        (request.directory / RUN_FILE).write_text(json.dumps({"service": name, "pods": names}))
        gpus = sum(len(g) for _, g in request.workers)
        return (
            KubernetesRun(self, request.directory, name, names, made_after),
            f"Kubernetes Service {name} and {len(pods)} pod(s) in {self.namespace} "
            f"({gpus} {GPU_RESOURCE} on {','.join(dict.fromkeys(n for n, _ in request.workers))})",
        )

    def find(self, directory: Path) -> KubernetesRun | None:
        try:
            record = json.loads((directory / RUN_FILE).read_text())
            return KubernetesRun(self, directory, str(record["service"]), tuple(record["pods"]), -1)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def unrecorded(self, root: Path) -> list[tuple[Path, dict[str, Any]]]:
        self._started()
        self.pods.listed.wait(SYNC_WAIT_S)
        runs: dict[str, list[dict[str, Any]]] = {}
        for pod in self.pods.snapshot().values():
            run = (pod["metadata"].get("labels") or {}).get(f"{LABEL}/run")
            if run and pod.get("status", {}).get("phase", "Pending") in LIVE_PHASES:
                runs.setdefault(run, []).append(pod)
        found = []
        for name, pods in sorted(runs.items()):
            try:
                kept = json.loads(pods[0]["metadata"]["annotations"][META_ANNOTATION])
                meta = found_meta(kept)
            except (AttributeError, KeyError, TypeError, ValueError):
                continue
            if meta is None:
                continue
            directory = run_dir(root, str(meta["job"]), int(meta["epoch"]), int(meta["attempt"]))
            if (directory / RUN_FILE).exists():
                continue  # recorded (a directory without it: the agent died before writing it)
            directory.mkdir(parents=True, exist_ok=True)
            ranks = sorted(pods, key=lambda p: int(p["metadata"]["labels"].get(f"{LABEL}/rank", 0)))
            (directory / RUN_FILE).write_text(
                json.dumps({"service": name, "pods": [p["metadata"]["name"] for p in ranks]})
            )
            found.append((directory, meta))
        return found
