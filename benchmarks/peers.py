"""Peers side by side: one job stream through fleetline's scheduler, Slurm's slurmctld and the
Kubernetes scheduler, on this machine, in one run.

The fleet: one cluster of `--nodes` nodes (32), 8 GPUs each in two NVLink islands of four,
`--nodes-per-leaf` (8) under each leaf switch, one spine. Each system is told as much of it as
it can take: fleetline's view has it all (from the simulator's node states); Slurm 22.05 gets
the leaves as `topology/tree` and the islands as the GPUs' gres `Links` (`select/cons_tres`,
`sched/backfill`, one `slurmd -N` per node); the kube-scheduler of Kubernetes 1.37 gets nodes
with `nvidia.com/gpu: 8` (kwok keeps them alive) labelled with their leaf.

The jobs (seeded): training gangs of 1 to 4 workers of 1 to 8 GPUs, with tensor and pipeline
parallelism, at three priorities. Two phases, each on an empty fleet, nothing ending during it:
- `fits`: jobs asking for 90 % of the fleet, all submitted at once. Jobs started per second
  (first submission to last start), submit-to-start p50/p99, GPUs in use, tensor-parallel
  groups inside one NVLink island, multi-node pipelines under one leaf.
- `contended`: jobs asking for 150 %, all at once: what each system lets in once it settles
  (no start for `--settle-s`, which leaves Slurm's backfill a pass): GPUs held by whole gangs
  and by gangs started in part, the share of high-priority GPUs that started against low.

Each system is driven through its own front door by 8 concurrent clients: fleetline's
requests go to Kafka and its decisions are read back (the scheduler's exactly-once loop in a
process of its own); Slurm's jobs through `sbatch` (starts seen by polling `squeue` every
20 ms); Kubernetes' pods are POSTed to the API server, their binding seen on a watch. Each
system first starts one warm-up job, so that no first-request cost lands on the figures.

What a peer cannot express is reported as such (None), not guessed: the kube-scheduler picks no
GPU indices (the node's device plugin does, after it), has no gangs (a job's pods are scheduled
one by one, so a gang can start in part) and keeps the pods of one job under one leaf only by
pod affinity to the first; Slurm keeps a job's nodes under one leaf with `--switches=1` (it
waits up to its `max_switch_wait` for that, then takes any).

    .venv/bin/python benchmarks/peers.py [--nodes 32] [--nodes-per-leaf 8] [--seed 5]
        [--settle-s 35] [--systems fleetline,slurm,kubernetes]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from _common import local_services, report, serve_scheduler, simulated_view

from fleetline.agents.simulator import ClusterSpec
from fleetline.config import Settings
from fleetline.infra.kubernetes import GPU_RESOURCE, KubernetesBinaries, KwokCluster, gpu_node
from fleetline.infra.managed import node_names
from fleetline.infra.slurm import SlurmCluster, missing_programs
from fleetline.processors.view.model import ResourceView
from fleetline.streams.serde import default_codec

CLUSTER = "peers"
REGION = "eu-west"
BASE_MS = 1_796_000_000_000
GPUS_PER_NODE = 8
ISLANDS = ((0, 1, 2, 3), (4, 5, 6, 7))  # the simulator's H100 nodes: two NVLink islands of four
SHAPES = [  # (weight, workers, gpus per worker, tensor, pipeline)
    (25, 1, 1, 1, 1),
    (15, 1, 2, 2, 1),
    (20, 1, 4, 4, 1),
    (15, 1, 8, 8, 1),
    (10, 2, 4, 4, 1),
    (10, 2, 8, 8, 2),
    (5, 4, 8, 8, 4),
]
PRIORITIES = [(20, "high"), (60, "normal"), (20, "low")]
PRIORITY_VALUES = {"high": 1000, "normal": 500, "low": 100}
PHASES = {"fits": 0.9, "contended": 1.5}  # the GPUs the stream asks for, against the fleet's
CLIENTS = 8
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PeerJob:
    name: str
    workers: int
    per_worker: int
    tensor: int
    pipeline: int
    priority: str

    @property
    def gpus(self) -> int:
        return self.workers * self.per_worker

    @property
    def nodes_per_pipeline(self) -> int:
        """Nodes one model replica spans (its tensor x pipeline GPUs over whole workers)."""
        return max(1, self.tensor * self.pipeline // self.per_worker)


# Submitted and started before the stream, in every system, so that no system's first-request
# costs (a scheduler's first transaction, a controller's first RPC) land on the stream's figures.
WARMUP = PeerJob("warmup", 1, 1, 1, 1, "normal")


class System(Protocol):
    """A scheduler under test, driven through its own front door."""

    name: str
    picks_gpus: bool  # whether it chooses the GPUs of a node (Kubernetes leaves it to the node)

    def submit(self, job: PeerJob) -> None: ...

    def started(self) -> dict[str, float]:
        """Job -> when it was seen started whole (monotonic seconds)."""
        ...

    def in_part(self) -> set[str]:
        """Jobs of which some workers were placed and some not."""
        ...

    def workers(self, names: list[str]) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        """Where each job's workers went, in rank order: (node, GPU indices; empty where the
        system does not choose them)."""
        ...

    def clear(self) -> None:
        """Every job gone: the fleet empty for the next phase."""
        ...


@dataclass
class Run:
    system: str
    submitted: dict[str, float] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)
    in_part: set[str] = field(default_factory=set)
    workers: dict[str, list[tuple[str, tuple[int, ...]]]] = field(default_factory=dict)


def job_stream(nodes: int, load: float, seed: int) -> list[PeerJob]:
    """Jobs drawn until the next would take the stream past `load` times the fleet's GPUs."""
    rng = random.Random(seed)
    room = int(nodes * GPUS_PER_NODE * load)
    jobs: list[PeerJob] = []
    shapes, weights = [s[1:] for s in SHAPES], [s[0] for s in SHAPES]
    misses = 0
    while misses < 20:
        workers, per_worker, tensor, pipeline = rng.choices(shapes, weights)[0]
        if workers * per_worker > room:
            misses += 1
            continue
        priority = rng.choices([p[1] for p in PRIORITIES], [p[0] for p in PRIORITIES])[0]
        jobs.append(PeerJob(f"j{len(jobs):04d}", workers, per_worker, tensor, pipeline, priority))
        room -= workers * per_worker
    return jobs


def leaves_of(nodes: int, per_leaf: int) -> dict[str, str]:
    """Node -> its leaf switch, as the simulator names them."""
    names = node_names(CLUSTER, nodes)
    return {n: f"{CLUSTER}-leaf{i // per_leaf:03d}" for i, n in enumerate(names)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _wait(done: Callable[[], bool], timeout_s: float = START_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.02)
    return done()


def drive(system: System, jobs: list[PeerJob], settle_s: float) -> Run:
    """The warm-up job, then the stream from `CLIENTS` clients at once; until every job started,
    or none did for `settle_s`. A job preempted meanwhile counts as not started."""
    run = Run(system.name)
    system.submit(WARMUP)
    if not _wait(lambda: WARMUP.name in system.started()):
        raise SystemExit(f"{system.name}: the warm-up job did not start in {START_TIMEOUT_S} s")

    def submit(job: PeerJob) -> None:
        run.submitted[job.name] = time.monotonic()
        system.submit(job)

    with ThreadPoolExecutor(CLIENTS) as clients:
        list(clients.map(submit, jobs))
    names = {j.name for j in jobs}
    last, seen = time.monotonic(), 0
    while time.monotonic() - last < settle_s:
        count = len(names & set(system.started()))
        if count == len(names):
            break
        if count > seen:
            last, seen = time.monotonic(), count
        time.sleep(0.05)
    started = system.started()
    run.started = {n: started[n] for n in names if n in started}
    run.in_part = system.in_part() & names
    run.workers = system.workers(sorted(run.started))
    return run


def figures(
    phase: str, run: Run, jobs: list[PeerJob], leaf: dict[str, str], picks: bool
) -> dict[str, Any]:
    """The run's figures, under `<system>_<phase>_` names; None where the system cannot
    express it."""
    by_name = {j.name: j for j in jobs}
    started = sorted(run.started)
    latencies = [run.started[n] - run.submitted[n] for n in started]
    first = min(run.submitted.values())
    span = max(run.started.values()) - first if started else 0.0
    tp_total = tp_inside = pp_total = pp_leaf = 0
    for name in started:
        job, workers = by_name[name], run.workers.get(name, [])
        tensor = min(job.tensor, job.per_worker)
        if 1 < tensor <= len(ISLANDS[0]):
            for _, gpus in workers:
                for g in range(0, len(gpus), tensor):
                    group = set(gpus[g : g + tensor])
                    tp_total += 1
                    tp_inside += any(group <= set(island) for island in ISLANDS)
        if job.nodes_per_pipeline > 1:
            nodes = [node for node, _ in workers]
            for r in range(0, len(nodes), job.nodes_per_pipeline):
                pp_total += 1
                pp_leaf += len({leaf[n] for n in nodes[r : r + job.nodes_per_pipeline]}) == 1

    def share_started(priority: str) -> float | None:
        asked = sum(j.gpus for j in jobs if j.priority == priority)
        got = sum(by_name[n].gpus for n in started if by_name[n].priority == priority)
        return round(got / asked, 3) if asked else None

    p = f"{run.system}_{phase}"
    out: dict[str, Any] = {
        f"{p}_jobs_started": len(started),
        f"{p}_jobs_submitted": len(jobs),
        f"{p}_gpus_in_whole_gangs": sum(by_name[n].gpus for n in started),
        f"{p}_jobs_started_in_part": len(run.in_part),
        f"{p}_tp_groups_in_one_nvlink_island": (
            round(tp_inside / tp_total, 3) if tp_total and picks else None
        ),
        f"{p}_pipelines_under_one_leaf": round(pp_leaf / pp_total, 3) if pp_total else None,
    }
    if phase == "fits":
        out[f"{p}_jobs_per_s"] = round(len(started) / span, 1) if span > 0 else None
        out[f"{p}_submit_to_start_p50_ms"] = (
            round(statistics.median(latencies) * 1000, 1) if latencies else None
        )
        out[f"{p}_submit_to_start_p99_ms"] = (
            round(percentile(latencies, 0.99) * 1000, 1) if latencies else None
        )
    else:
        out[f"{p}_high_priority_gpus_started_share"] = share_started("high")
        out[f"{p}_low_priority_gpus_started_share"] = share_started("low")
    return out


# -- fleetline ------------------------------------------------------------------------------------


def peers_view(nodes: int, per_leaf: int) -> ResourceView:
    return simulated_view([ClusterSpec(CLUSTER, REGION, nodes, nodes_per_leaf=per_leaf)], BASE_MS)


def training_doc(job: PeerJob) -> dict[str, Any]:
    return {
        "apiVersion": "fleetline/v1",
        "kind": "TrainingJob",
        "metadata": {"name": job.name, "tenant": "bench"},
        "spec": {
            "accelerator": "H100",
            "gpus_per_worker": job.per_worker,
            "workers": job.workers,
            "parallelism": {
                "tensor": job.tensor,
                "pipeline": job.pipeline,
                "data": job.gpus // (job.tensor * job.pipeline),
            },
            "communication": "heavy",
            "priority_class": job.priority,
        },
    }


class Fleetline:
    """fleetline's scheduler service over Kafka; each phase a scheduler of its own (a fresh
    topic prefix), so that `clear` is starting the next one."""

    name = "fleetline"
    picks_gpus = True

    def __init__(self, settings: Settings, nodes: int, per_leaf: int) -> None:
        from fleetline.streams import kafka as kafka_clients

        self.settings, self.nodes, self.per_leaf = settings, nodes, per_leaf
        self.codec = default_codec()
        self.producer = kafka_clients.producer(settings.kafka, {"linger.ms": 0})
        self._start()

    def _start(self) -> None:
        from fleetline.processors.scheduling.runtime import scheduler_topics
        from fleetline.streams import kafka as kafka_clients
        from fleetline.streams.topics import Topics

        self.topics = Topics(prefix=f"bench.peers.{uuid.uuid4().hex[:8]}")
        kafka_clients.ensure_topics(self.settings.kafka, scheduler_topics(self.topics))
        context = multiprocessing.get_context("spawn")
        ready, self.stop = context.Event(), context.Event()
        self.server = context.Process(
            target=serve_scheduler,
            args=(peers_view, (self.nodes, self.per_leaf), self.topics.prefix, ready, self.stop),
            daemon=True,
        )
        self.server.start()
        if not ready.wait(180):
            raise SystemExit("fleetline's scheduler did not start within 180 s")
        self._started: dict[str, float] = {}
        self._workers: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        self.done = threading.Event()
        reading = threading.Event()
        self.reader = threading.Thread(target=self._read, args=(reading,), daemon=True)
        self.reader.start()
        reading.wait(30)
        time.sleep(2.0)  # the reader's assignment

    def _read(self, reading: threading.Event) -> None:
        from fleetline.streams import kafka as kafka_clients

        # Fetches answered within 10 ms (librdkafka waits up to 500 ms for a read_committed
        # fetch to fill), as Slurm's queue is polled every 20 ms.
        consumer = kafka_clients.consumer(
            self.settings.kafka, f"bench-{uuid.uuid4().hex}", {"fetch.wait.max.ms": 10}
        )
        consumer.subscribe([self.topics.decisions])
        reading.set()
        try:
            while not self.done.is_set():
                for msg in consumer.consume(1000, 0.005):
                    if msg.error() or msg.value() is None:
                        continue
                    record = self.codec.decode(msg.value()).record
                    name = str(record["job"]).removeprefix("bench/")
                    if record["outcome"] in ("PREEMPTED", "RELEASED"):
                        self._started.pop(name, None)
                        continue
                    if record["outcome"] != "PLACED":
                        continue
                    self._workers[name] = [
                        (w["node_id"], tuple(w["gpus"]))
                        for p in record["placements"]
                        for w in p["workers"]
                    ]
                    self._started.setdefault(name, time.monotonic())
        finally:
            consumer.close()

    def submit(self, job: PeerJob) -> None:
        from fleetline.processors.scheduling.client import send
        from fleetline.processors.scheduling.codec import submit_request
        from fleetline.processors.scheduling.specs import parse_spec

        doc = training_doc(job)
        request = submit_request(parse_spec(doc), doc, int(time.time() * 1000), uuid.uuid4().hex)
        send(self.producer, self.topics, request)
        self.producer.flush(30)

    def started(self) -> dict[str, float]:
        return dict(self._started)

    def in_part(self) -> set[str]:
        return set()  # a gang is placed whole or not at all

    def workers(self, names: list[str]) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        return {n: self._workers[n] for n in names}

    def close(self) -> None:
        self.done.set()
        self.reader.join(30)
        self.stop.set()
        self.server.join(60)

    def clear(self) -> None:
        self.close()
        self._start()


# -- Slurm ----------------------------------------------------------------------------------------

_IDX = re.compile(r"Nodes=(\S+) .*GRES=\S*?\(IDX:([0-9,-]+)\)")


def _indices(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return tuple(out)


class Slurm:
    name = "slurm"
    picks_gpus = True

    def __init__(self, nodes: int, per_leaf: int, work: Path) -> None:
        leaves: dict[str, list[str]] = {}
        for node, leaf in leaves_of(nodes, per_leaf).items():
            leaves.setdefault(leaf, []).append(node)
        self.cluster = SlurmCluster(
            CLUSTER,
            node_names(CLUSTER, nodes),
            work / "slurm" / CLUSTER,
            leaves=tuple((leaf, tuple(ns)) for leaf, ns in sorted(leaves.items())),
            nvlink_islands=ISLANDS,
        )
        try:
            print(f"slurm: {nodes} slurmd started in {self.cluster.start():.1f} s")
        except BaseException:
            self.cluster.stop()  # the daemons that did start
            raise
        self.env = {**os.environ, **self.cluster.env}
        self.ids: dict[str, str] = {}
        self._started: dict[str, float] = {}
        self.done = threading.Event()
        self.poller = threading.Thread(target=self._poll, daemon=True)
        self.poller.start()

    def _run(self, *argv: str) -> str:
        answer = subprocess.run(argv, env=self.env, capture_output=True, text=True, check=False)
        if answer.returncode != 0:
            raise SystemExit(f"{' '.join(argv[:2])}: {answer.stderr.strip()}")
        return answer.stdout

    def _poll(self) -> None:
        while not self.done.is_set():
            running = self._run("squeue", "-h", "-t", "RUNNING", "-o", "%i").split()
            now = time.monotonic()
            names = {v: k for k, v in list(self.ids.items())}
            for job_id in running:
                name = names.get(job_id)
                if name is not None:
                    self._started.setdefault(name, now)
            time.sleep(0.02)

    def submit(self, job: PeerJob) -> None:
        out = self._run(
            "sbatch", "--parsable", "-J", job.name, "-N", str(job.workers),
            "--ntasks-per-node=1", "--cpus-per-task=1", f"--gres=gpu:{job.per_worker}",
            f"--priority={PRIORITY_VALUES[job.priority]}", "-o", "/dev/null",
            *(["--switches=1"] if job.nodes_per_pipeline > 1 else []),
            "--wrap", "sleep 3600",
        )  # fmt: skip
        self.ids[job.name] = out.strip().split(";")[0]

    def started(self) -> dict[str, float]:
        return dict(self._started)

    def in_part(self) -> set[str]:
        return set()  # a job's nodes are allocated together

    def workers(self, names: list[str]) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        out: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for name in names:
            shown = self._run("scontrol", "show", "job", "-d", self.ids[name])
            placed: list[tuple[str, tuple[int, ...]]] = []
            for hostlist, idx in _IDX.findall(shown):
                hosts = self._run("scontrol", "show", "hostnames", hostlist).split()
                placed.extend((host, _indices(idx)) for host in hosts)
            out[name] = placed
        return out

    def clear(self) -> None:
        self._run("scancel", "--user=root")
        if not _wait(lambda: not self._run("squeue", "-h", "-o", "%i").split(), 60):
            raise SystemExit("slurm: jobs still queued 60 s after scancel")
        self.cluster.kill_orphaned_jobs()
        self.ids, self._started = {}, {}

    def close(self) -> None:
        self.done.set()
        self.poller.join(5)
        self.cluster.stop()


# -- Kubernetes -----------------------------------------------------------------------------------

LEAF_LABEL = "fleetline.io/leaf"
JOB_LABEL = "fleetline.io/job"
PODS = "/api/v1/namespaces/default/pods"


def pod(job: PeerJob, rank: int) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "priorityClassName": f"fl-{job.priority}",
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [
            {
                "name": "worker",
                "image": "busybox",
                "resources": {"limits": {GPU_RESOURCE: str(job.per_worker)}},
            }
        ],
    }
    if job.nodes_per_pipeline > 1:
        # The one way the default scheduler keeps a job's pods under one leaf: affinity to the
        # pods of the same job, by the nodes' leaf label (the first pod matches itself).
        spec["affinity"] = {
            "podAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {"matchLabels": {JOB_LABEL: job.name}},
                        "topologyKey": LEAF_LABEL,
                    }
                ]
            }
        }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{job.name}-w{rank}", "labels": {JOB_LABEL: job.name}},
        "spec": spec,
    }


class Kubernetes:
    name = "kubernetes"
    picks_gpus = False

    def __init__(self, nodes: int, per_leaf: int, work: Path) -> None:
        self.cluster = KwokCluster(CLUSTER, node_names(CLUSTER, nodes), KubernetesBinaries(work))
        try:
            took = self.cluster.start()
        except BaseException:
            self.cluster.stop()
            raise
        print(f"kubernetes: control plane and {nodes} kwok nodes in {took:.1f} s")
        self.api = api = self.cluster.api()
        for node, leaf in leaves_of(nodes, per_leaf).items():
            labels = gpu_node(node)["metadata"]["labels"]
            api.ok(
                "PATCH",
                f"/api/v1/nodes/{node}",
                {"metadata": {"labels": {**labels, LEAF_LABEL: leaf}}},
                content_type="application/merge-patch+json",
            )
        for priority, value in PRIORITY_VALUES.items():
            api.ensure(
                "/apis/scheduling.k8s.io/v1/priorityclasses",
                f"fl-{priority}",
                {
                    "apiVersion": "scheduling.k8s.io/v1",
                    "kind": "PriorityClass",
                    "metadata": {"name": f"fl-{priority}"},
                    "value": value,
                },
            )
        # Pods need the namespace's default ServiceAccount, which the controller manager makes.
        if not _wait(lambda: api.get("/api/v1/namespaces/default/serviceaccounts/default"), 60):
            raise SystemExit("kubernetes: no default ServiceAccount within 60 s")
        self.workers_of: dict[str, int] = {}
        self.bound: dict[str, tuple[float, str]] = {}  # pod -> (when, node)
        self.done = threading.Event()
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()
        time.sleep(1.0)

    def _watch(self) -> None:
        version = self.api.ok("GET", PODS)["metadata"]["resourceVersion"]
        while not self.done.is_set():
            for event in self.api.watch(PODS, {}, version, 5):
                obj = event["object"]
                version = obj["metadata"]["resourceVersion"]
                node = obj.get("spec", {}).get("nodeName")
                name = obj["metadata"]["name"]
                if event["type"] == "DELETED":  # preempted, or cleared
                    self.bound.pop(name, None)
                elif node and name not in self.bound:
                    self.bound[name] = (time.monotonic(), node)

    def submit(self, job: PeerJob) -> None:
        self.workers_of[job.name] = job.workers
        for rank in range(job.workers):
            self.api.ok("POST", PODS, pod(job, rank))

    def _placed(self, name: str) -> list[tuple[float, str] | None]:
        return [self.bound.get(f"{name}-w{r}") for r in range(self.workers_of[name])]

    def started(self) -> dict[str, float]:
        out = {}
        for name in list(self.workers_of):
            placed = self._placed(name)
            if all(placed):
                out[name] = max(p[0] for p in placed if p)
        return out

    def in_part(self) -> set[str]:
        return {
            n for n in list(self.workers_of) if any(self._placed(n)) and not all(self._placed(n))
        }

    def workers(self, names: list[str]) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        return {n: [(p[1], ()) for p in self._placed(n) if p] for n in names}

    def clear(self) -> None:
        self.api.ok("DELETE", f"{PODS}?gracePeriodSeconds=0")
        if not _wait(lambda: not self.api.ok("GET", PODS)["items"], 60):
            raise SystemExit("kubernetes: pods still there 60 s after their deletion")
        self.workers_of, self.bound = {}, {}

    def close(self) -> None:
        self.done.set()
        self.cluster.stop()


# -- the run --------------------------------------------------------------------------------------


def speedups(out: dict[str, Any], peers: list[str]) -> Iterator[tuple[str, Any]]:
    """How many times better fleetline's figure is than each peer's (> 1: fleetline's is)."""
    for peer in peers:
        for figure, higher_is_better in (
            ("fits_jobs_per_s", True),
            ("fits_submit_to_start_p50_ms", False),
            ("fits_submit_to_start_p99_ms", False),
        ):
            ours, theirs = out.get(f"fleetline_{figure}"), out.get(f"{peer}_{figure}")
            if ours and theirs:
                ratio = ours / theirs if higher_is_better else theirs / ours
                yield f"fleetline_vs_{peer}_{figure.removeprefix('fits_')}_x", round(ratio, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--nodes-per-leaf", type=int, default=8)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument(
        "--settle-s",
        type=float,
        default=35.0,
        help="a contended phase ends once no job started for this long (Slurm's backfill "
        "runs every 30 s)",
    )
    parser.add_argument("--systems", default="fleetline,slurm,kubernetes")
    args = parser.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - {"fleetline", "slurm", "kubernetes"}
    if unknown:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    streams = {phase: job_stream(args.nodes, load, args.seed) for phase, load in PHASES.items()}
    leaf = leaves_of(args.nodes, args.nodes_per_leaf)
    out: dict[str, Any] = {
        "nodes": args.nodes,
        "gpus": args.nodes * GPUS_PER_NODE,
        "nodes_per_leaf": args.nodes_per_leaf,
        **{f"{phase}_jobs": len(jobs) for phase, jobs in streams.items()},
        **{f"{phase}_gpus_asked": sum(j.gpus for j in jobs) for phase, jobs in streams.items()},
    }
    work = Path(tempfile.mkdtemp(prefix="fleetline-peers-"))
    try:
        with local_services(Settings.from_env()) as settings:
            for name in systems:
                system: Fleetline | Slurm | Kubernetes
                if name == "fleetline":
                    system = Fleetline(settings, args.nodes, args.nodes_per_leaf)
                elif name == "slurm":
                    if missing_programs():
                        out["slurm_blocked"] = f"not installed: {', '.join(missing_programs())}"
                        continue
                    system = Slurm(args.nodes, args.nodes_per_leaf, work)
                else:
                    system = Kubernetes(args.nodes, args.nodes_per_leaf, work)
                try:
                    for n, (phase, jobs) in enumerate(streams.items()):
                        if n:
                            system.clear()
                        settle = args.settle_s if phase == "contended" else START_TIMEOUT_S
                        run = drive(system, jobs, settle)
                        out.update(figures(phase, run, jobs, leaf, system.picks_gpus))
                finally:
                    system.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out.update(speedups(out, [s for s in systems if s != "fleetline"]))
    report("peers", out)


if __name__ == "__main__":
    main()
