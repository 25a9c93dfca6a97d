"""The cluster agent: one per cluster (`fleetline cluster-agent --cluster-id C`).

It follows the scheduler's workload orders (a compacted topic: the latest order of each job is
the desired state) and reconciles them with the workloads it runs (`reconcile.plan`): for a RUN
it reserves the GPUs, fetches the job's newest complete checkpoint from whichever cluster's
store holds it (`stores.py`: copied ciphertext, verified on arrival), starts the workload
through its backend (`backends/`: an OS process under its class's cgroup limits, a Slurm job, a
pod per worker), watches it, and reports every transition (WorkloadEvent) and
what the scheduler needs (PROGRESS requests: running, checkpoints, exits); anything it runs
that no order wants any more is stopped, with a final checkpoint when the order asks for one.
Every second it publishes the cluster's status (a HEARTBEAT signal: reserved GPUs, workloads,
what it sees of its peers) and probes its peers over TCP.

Fencing: it reports only on workloads whose (epoch, attempt) is the job's current order here,
so a copy left running on a cluster that was declared lost and came back speaks for nobody;
the scheduler ignores stale epochs too. After SIGKILL a restarted agent re-adopts what still
runs from the run directories (`workloads.py`) and starts nothing twice.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, KafkaError, TopicPartition

from fleetline.agents.cluster import workloads as procs
from fleetline.agents.cluster.backends import Launcher, RunRequest
from fleetline.agents.cluster.backends.process import ProcessLauncher
from fleetline.agents.cluster.nodes import DRAIN_REASON, Drain, Fence, Resume, Unfence, sync
from fleetline.agents.cluster.peers import Peers
from fleetline.agents.cluster.reconcile import Actual, Order, Start, Stop, plan, quota_refusal
from fleetline.agents.cluster.replicas import ReplicaRegistry
from fleetline.agents.cluster.reports import Event, said
from fleetline.agents.cluster.sharing import gpu_memory_mib, gpu_sharing, mps_running
from fleetline.agents.cluster.stores import JobStores
from fleetline.agents.dataplane.shards import Part, World
from fleetline.agents.workloads.train import federated_env, workload_env
from fleetline.config import Settings
from fleetline.errors import FleetlineError
from fleetline.identity.writers import Writer, WriterKind
from fleetline.observability import tracing
from fleetline.processors.health.runtime import signal as cluster_signal
from fleetline.processors.health.runtime import signal_output
from fleetline.processors.scheduling.client import changelog as scheduler_changelog
from fleetline.processors.scheduling.client import request_output
from fleetline.processors.scheduling.codec import new_request
from fleetline.processors.scheduling.services import REPLICA_KIND
from fleetline.processors.scheduling.specs import TrainingJobSpec, dataset_prefix
from fleetline.processors.scheduling.tenancy import TenantPolicy
from fleetline.processors.view.model import CORDONED_LABEL
from fleetline.schemas.records import (
    WorkloadEvent,
    WorkloadEventKind,
)
from fleetline.storage.checkpoints import cluster_bucket
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import (
    CLUSTER_HEALTH,
    CLUSTER_INFO,
    CLUSTER_SIGNAL,
    NODE_STATE,
    WORKLOAD_ORDER,
)
from fleetline.streams.loop import produce
from fleetline.streams.records import Output
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.topics import Topics

log = logging.getLogger(__name__)

# A training spec's checkpoint interval when it names none (the spec's default).
CHECKPOINT_INTERVAL_S: int = TrainingJobSpec.model_fields["checkpoint_interval_s"].default

DEFAULT_TRAINER = (sys.executable, "-m", "fleetline.agents.workloads.train")
DEFAULT_SERVER = (sys.executable, "-m", "fleetline.agents.workloads.serve")


def _trace(order: Order, seed: str) -> tracing.TraceContext | None:
    """A span of `order`'s trace (the submitting request's), its id derived from `seed` and
    the order's epoch and attempt."""
    return tracing.of_trace(order.trace_id, f"{seed}/{order.epoch}/{order.attempt}")


def _traceparent(order: Order, seed: str) -> str | None:
    trace = _trace(order, seed)
    return trace.traceparent if trace else None


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class ClusterAgent:
    settings: Settings
    topics: Topics
    cluster_id: str
    state_dir: Path
    heartbeat_s: float = 1.0
    stop_grace_s: float = 20.0
    running_after_s: float = 0.3
    probe_timeout_s: float = 0.3
    registry_s: float = 0.5  # how often each replica's endpoint and load are published
    chaos_file: Path | None = None  # peers whose link is cut, one per line (fault injection)
    codec: AvroCodec = field(default_factory=default_codec)
    ready: threading.Event = field(default_factory=threading.Event)
    # How its workloads run: OS processes on this host, or jobs of the cluster's manager.
    launcher: Launcher = field(default_factory=ProcessLauncher)
    # The agent's own clock, which stamps its heartbeats and reports (a chaos test gives it
    # one that runs ahead or behind: no fold takes its time from it).
    clock: Callable[[], int] = _now_ms

    def __post_init__(self) -> None:
        # Every record this agent writes is its cluster's: a heartbeat, a report, a replica.
        self.settings = self.settings.writing_as(Writer(WriterKind.CLUSTER, self.cluster_id))
        self.name = f"{self.topics.prefix}.cluster-agent.{self.cluster_id}"
        self.incarnation = uuid.uuid4().hex[:12]
        self.orders: dict[str, Order] = {}
        self.running: dict[str, list[procs.Workload]] = {}
        self.health: dict[str, dict[str, Any]] = {}  # cluster -> its last ClusterHealth record
        self.peers = Peers(
            self.cluster_id,
            self.settings.advertise_host,
            self.heartbeat_s,
            self.probe_timeout_s,
            self.chaos_file,
        )
        # This cluster's region: its ClusterInfo's, else what its nodes report.
        self.region: str | None = None
        self.declared_region = False
        self.cordoned: dict[str, bool] = {}  # this cluster's nodes: cordoned in fleetline?
        # Each tenant's terms, from the scheduler's committed state (its changelog).
        self.tenants: dict[str, TenantPolicy] = {}
        self._scheduler_state = scheduler_changelog(self.topics).name
        self._fenced_file = self.state_dir / self.cluster_id / "fenced-nodes.json"
        self.registry_wake = threading.Event()  # a replica changed: publish it now
        self.lock = threading.Lock()
        self.root = self.state_dir / self.cluster_id
        self.root.mkdir(parents=True, exist_ok=True)
        self.job_stores = JobStores(self.settings, self.topics, self.cluster_id)
        # Passes of the loop since it started: what a watcher waits on to know the agent has
        # acted on what it saw (not a sleep that passes when the agent is merely slow).
        self.passes = 0

    # -- the loop -------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        kafka = self.settings.kafka
        self.producer = kafka_clients.producer(
            kafka, {"linger.ms": 5, **kafka_clients.ACROSS_LINKS}
        )
        consumer = kafka_clients.consumer(
            kafka, f"{self.name}.{self.incarnation}", kafka_clients.ACROSS_LINKS
        )
        # Orders and health from their start (the compacted desired state, every declaration);
        # the busy signal log only from a minute ago, enough to learn where the peers listen.
        recent = consumer.offsets_for_times(
            [TopicPartition(self.topics.cluster_signals, 0, self.clock() - 60_000)], timeout=30
        )
        consumer.assign(
            [
                TopicPartition(self.topics.orders, 0, OFFSET_BEGINNING),
                TopicPartition(self.topics.emergency, 0, OFFSET_BEGINNING),
                TopicPartition(self.topics.clusters, 0, OFFSET_BEGINNING),
                TopicPartition(
                    self.topics.cluster_signals,
                    0,
                    recent[0].offset if recent[0].offset >= 0 else OFFSET_END,
                ),
            ]
        )
        # What the agent learns beside its orders, on a consumer of its own so that a long
        # history there never delays the start: its nodes' cordons (the compacted node states)
        # and the tenants' terms (the scheduler's changelog), each read whole.
        aside = kafka_clients.consumer(
            kafka, f"{self.name}.{self.incarnation}.aside", kafka_clients.ACROSS_LINKS
        )
        aside.assign(
            [
                *(
                    TopicPartition(self.topics.node_state, p, OFFSET_BEGINNING)
                    for p in range(self.topics.node_partitions)
                ),
                TopicPartition(self._scheduler_state, 0, OFFSET_BEGINNING),
            ]
        )
        server = self.peers.serve(stop)
        # Alive before it has read its orders: a restarted agent heartbeats at once, so that
        # its cluster is not taken for lost while it catches up (its runs go on meanwhile).
        alive = [
            threading.Thread(target=self._heartbeats, args=(stop,), daemon=True),
            threading.Thread(target=self.peers.run, args=(stop,), daemon=True),
        ]
        for thread in alive:
            thread.start()
        registry = ReplicaRegistry(self)
        threads = [*alive, threading.Thread(target=registry.run, args=(stop,), daemon=True)]
        try:
            # The desired state first: read every order there is before acting on any.
            self._catch_up(consumer, stop)
            for directory, meta in self.launcher.unrecorded(self.root):
                procs.prepare(self.root, meta)
                log.info(
                    "%s: found %s in the cluster's manager: %s", self.cluster_id, meta, directory
                )
            with self.lock:
                for workload in procs.adopt(self.root, self.launcher):
                    self.running.setdefault(workload.job, []).append(workload)
                    log.info(
                        "%s: adopted %s run %s (%s)",
                        self.cluster_id,
                        workload.job,
                        workload.run_id,
                        workload.label,
                    )
            threads[-1].start()
            self.ready.set()
            while not stop.is_set():
                self._consume(consumer, 0.1)
                self._consume(aside, 0)
                # Nodes first: a node its manager lost is fenced before its runs' ends are
                # reported, so the scheduler moves them rather than retrying them there.
                self.launcher.refresh()
                self.sync_nodes()
                self.reconcile()
                self.watch()
                self.passes += 1
        finally:
            stop.set()
            for thread in threads:
                if thread.is_alive():
                    thread.join(5)
            server.close()
            self.launcher.close()
            consumer.close()
            aside.close()
            self.producer.flush(10)

    def _catch_up(self, consumer: Any, stop: threading.Event) -> None:
        ends = {}
        for topic in (self.topics.orders, self.topics.emergency):
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)
            ends[topic] = high
        while not stop.is_set():
            positions = {
                tp.topic: tp.offset
                for tp in consumer.position([TopicPartition(t, 0) for t in ends])
            }
            if all(positions[t] >= end or end == 0 for t, end in ends.items()):
                return
            self._consume(consumer, 0.2)

    def _consume(self, consumer: Any, timeout_s: float) -> None:
        for msg in consumer.consume(500, timeout_s):
            error = msg.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("%s: %s", self.cluster_id, error.str())
                continue
            if msg.topic() == self._scheduler_state:
                self._tenant_terms(msg.key(), msg.value())
                continue
            decoded = self.codec.decode(msg.value())
            record = decoded.record
            name = decoded.schema.full_name
            if name == WORKLOAD_ORDER:
                order = Order.from_record(record).seen_from(self.cluster_id)
                current = self.orders.get(order.job)
                if current is None or (order.epoch, order.attempt, order.ts) >= (
                    current.epoch,
                    current.attempt,
                    current.ts,
                ):
                    self.orders[order.job] = order
                    if order.kind == REPLICA_KIND:
                        self.registry_wake.set()  # a role may have changed
            elif name == CLUSTER_INFO:
                if record["cluster_id"] == self.cluster_id:
                    self.region = record["region"]
                    self.declared_region = True
            elif name == CLUSTER_HEALTH:
                self.health[record["cluster_id"]] = record
            elif name == NODE_STATE:
                if record["cluster_id"] == self.cluster_id:
                    if not self.declared_region:  # the operator's word (ClusterInfo) first
                        self.region = record["region"]
                    labels = record.get("labels") or {}
                    self.cordoned[record["node_id"]] = labels.get(CORDONED_LABEL) == "true"
            elif (
                name == CLUSTER_SIGNAL
                and record["kind"] == "HEARTBEAT"
                and record["probe_address"]
                and record["cluster_id"] != self.cluster_id
            ):
                self.peers.addresses[record["cluster_id"]] = record["probe_address"]

    def _tenant_terms(self, key: bytes | None, value: bytes | None) -> None:
        """A tenant's record in the scheduler's state (JSON; None: removed). Jobs and other
        keys pass unread."""
        if not key or not key.startswith(b"tenant:"):
            return
        tenant = key.decode().removeprefix("tenant:")
        data = json.loads(value) if value else None
        policy = (data or {}).get("policy")
        try:
            if policy:
                self.tenants[tenant] = TenantPolicy.from_data(policy)
            else:
                self.tenants.pop(tenant, None)
        except FleetlineError as exc:
            log.warning("%s: tenant %s: %s", self.cluster_id, tenant, exc)

    # -- the manager's nodes against fleetline's ------------------------------------------------

    def _fenced_here(self) -> set[str]:
        try:
            return set(json.loads(self._fenced_file.read_text()))
        except (OSError, ValueError):
            return set()

    def sync_nodes(self) -> None:
        """Carry node states across (`nodes.sync`): the manager's outages become fences, fleetline's
        cordons become the manager's drains."""
        manager = self.launcher.manager_nodes()
        if manager is None:
            return
        fenced = self._fenced_here()
        for action in sync(manager, self.cordoned, fenced, self.launcher.manager):
            try:
                if isinstance(action, Fence | Unfence):
                    kind = "FENCE" if isinstance(action, Fence) else "UNFENCE"
                    request = new_request(
                        kind,
                        action.node,
                        "",
                        self.clock(),
                        uuid.uuid4().hex,
                        actor=f"cluster-agent/{self.cluster_id}",
                        cluster_id=self.cluster_id,
                        detail=action.reason,
                    )
                    produce(self.producer, request_output(self.topics, request, self.codec))
                    self.producer.flush(10)
                    fenced = fenced | {action.node} if kind == "FENCE" else fenced - {action.node}
                    self._fenced_file.write_text(json.dumps(sorted(fenced)))
                elif isinstance(action, Drain):
                    self.launcher.drain(action.node, DRAIN_REASON)
                elif isinstance(action, Resume):
                    self.launcher.resume(action.node)
            except FleetlineError as exc:
                log.warning("%s: %s: %s", self.cluster_id, action, exc)
                continue
            log.info("%s: %s", self.cluster_id, action)

    # -- desired against actual -----------------------------------------------------------------

    def fenced(self) -> bool:
        """Declared lost and not yet healthy again: start nothing new."""
        mine = self.health.get(self.cluster_id)
        return mine is not None and mine["state"] in ("UNHEALTHY", "RECOVERING")

    def reconcile(self) -> None:
        with self.lock:
            actual = {
                job: [
                    Actual(w.job, w.epoch, w.attempt, w.alive, w.stop_deadline is not None)
                    for w in runs
                ]
                for job, runs in self.running.items()
            }
        # A manager that does not answer starts nothing (what runs is stopped as ordered).
        may_start = not self.fenced() and self.launcher.control_error() is None
        for action in plan(self.cluster_id, self.orders, actual, may_start=may_start):
            if isinstance(action, Start):
                refusal = self._over_quota(action.order)
                if refusal is not None:
                    self._could_not_start(action.order, FleetlineError(refusal))
                    continue
                try:
                    self._start(action.order)
                except (FleetlineError, OSError) as exc:
                    self._could_not_start(action.order, exc)
            elif isinstance(action, Stop):
                self._stop(action)

    def _over_quota(self, order: Order) -> str | None:
        with self.lock:
            runs = [w for runs in self.running.values() for w in runs if w.alive]
        current = [o for o in (self.current(w) for w in runs) if o is not None]
        refusal = quota_refusal(self.cluster_id, order, self.tenants.get(order.tenant), current)
        return None if refusal is None else f"refused by cluster {self.cluster_id}: {refusal}"

    def _could_not_start(self, order: Order, exc: Exception) -> None:
        """A start that failed before any process ran (the store unreachable, the command not
        executable): reported FAILED like a crash, so the retry policy applies, and recorded so
        that this (epoch, attempt) is not tried again."""
        reason = f"could not start: {exc}"
        log.warning(
            "%s: %s: %s", self.cluster_id, order.job, reason, extra={"trace_id": order.trace_id}
        )
        workload = procs.record_failed_start(
            self.root, order.job, order.tenant, order.epoch, order.attempt, order.trace_id, reason
        )
        with self.lock:
            self.running.setdefault(order.job, []).append(workload)
        self._event(order, "FAILED", detail=reason)
        self._report(order, "FAILED", detail=reason)
        self.producer.flush(10)

    def _stop(self, action: Stop) -> None:
        for workload in self.running.get(action.job, []):
            if workload.run_id == action.run_id and workload.stop_deadline is None:
                workload.stop_reason = action.reason
                workload.fenced = action.fenced
                procs.stop(workload, action.final_checkpoint, self.stop_grace_s)
                self.registry_wake.set()  # a replica drains: out of the registry at once
                log.info(
                    "%s: stopping %s %s: %s",
                    self.cluster_id,
                    action.job,
                    action.run_id,
                    action.reason,
                )

    def _start(self, order: Order) -> None:
        attributes = {"job": order.job, "cluster": self.cluster_id, "epoch": order.epoch}
        with tracing.span("cluster-agent start workload", _trace(order, "order"), attributes):
            self._launch(order)

    def _launch(self, order: Order) -> None:
        spec = order.spec or {}
        body = spec.get("spec", {})
        workload_spec = body.get("workload") or {}
        gpus = " ".join(f"{node}:{','.join(map(str, ids))}" for node, ids in order.workers)
        self._event(order, "RESERVED", detail=f"GPUs {gpus}")
        if order.kind == REPLICA_KIND:
            checkpoints_env, restored = self.job_stores.serving_env(order, body), None
            command = workload_spec.get("command") or DEFAULT_SERVER
        else:
            checkpoints_env, restored = self.job_stores.prepare(order, self._event)
            command = workload_spec.get("command") or DEFAULT_TRAINER
        sharing_env, sharing = gpu_sharing(
            order.workers, body.get("gpus_per_replica", 1), gpu_memory_mib, mps_running()
        )
        env = {
            **os.environ,
            **checkpoints_env,
            **self._contract(order, workload_spec),
            **federated_env(body.get("federated")),
            **self._dataset_env(order, body.get("dataset")),
            **sharing_env,
            **{str(k): str(v) for k, v in (workload_spec.get("env") or {}).items()},
        }
        began = time.perf_counter()
        control = self._control(order)
        request = RunRequest(
            self.cluster_id,
            order.job,
            order.tenant,
            order.epoch,
            order.attempt,
            order.trace_id,
            body.get("priority_class", "normal"),
            order.workers,
            tuple(command),
            env,
            self.root,
        )
        directory, files = procs.prepare(self.root, request.meta(), control)
        request = replace(request, env={**env, **files}, directory=directory)
        handle, isolation = self.launcher.start(request)
        if sharing:
            isolation += f"; {sharing}"
        workload = procs.Workload(
            order.job,
            order.tenant,
            order.epoch,
            order.attempt,
            order.trace_id,
            directory,
            handle,
            time.monotonic(),
        )
        workload.told = control
        with self.lock:
            self.running.setdefault(order.job, []).append(workload)
        self._event(
            order,
            "STARTING",
            pid=workload.pid,
            seconds=round(time.perf_counter() - began, 4),
            detail=f"{' '.join(command)}; {isolation}"
            + (f"; resumes from {restored}" if restored else ""),
        )
        log.info(
            "%s: started %s epoch %d attempt %d as %s (%s)",
            self.cluster_id,
            order.job,
            order.epoch,
            order.attempt,
            workload.label,
            isolation,
            extra={"trace_id": order.trace_id},
        )
        self.producer.poll(0)

    def _control(self, order: Order) -> dict[str, Any] | None:
        """What a training workload is told through its control file (read at its start and
        after each checkpoint): the spec's checkpoint interval, which operations may tune while
        it runs. None for a replica."""
        if order.kind == REPLICA_KIND:
            return None
        body = (order.spec or {}).get("spec", {})
        return {"checkpoint_interval_s": body.get("checkpoint_interval_s", CHECKPOINT_INTERVAL_S)}

    def _retell(self, workload: procs.Workload, order: Order) -> None:
        """Rewrite a running workload's control file when its order tells it something new."""
        wanted = self._control(order)
        if wanted is None:
            return
        if workload.told is None:  # a run adopted after a restart: what its file says
            workload.told = procs.read_control(workload.directory)
        if wanted != workload.told:
            procs.write_control(workload.directory, wanted)
            workload.told = wanted
            log.info(
                "%s: %s told %s",
                self.cluster_id,
                order.job,
                wanted,
                extra={"trace_id": order.trace_id},
            )

    def _dataset_env(self, order: Order, dataset: object) -> dict[str, str]:
        """Where the job's dataset is in this cluster's store (its default place: a Dataset
        whose `source` names another prefix is not located for the workload yet)."""
        if not isinstance(dataset, str) or not dataset:
            return {}
        return {
            "FLEETLINE_DATASET": dataset,
            "FLEETLINE_DATASET_BUCKET": cluster_bucket(self.settings.s3.bucket, self.cluster_id),
            "FLEETLINE_DATASET_PREFIX": dataset_prefix(order.tenant, dataset),
        }

    def _contract(self, order: Order, workload_spec: Mapping[str, Any]) -> dict[str, str]:
        """The workload contract's environment (see agents/workloads/train.py)."""
        workers = [
            {"rank": order.first_rank + rank, "node_id": node, "gpus": list(ids)}
            for rank, (node, ids) in enumerate(order.workers)
        ]
        env = {
            "FLEETLINE_JOB": order.job,
            "FLEETLINE_TENANT": order.tenant,
            "FLEETLINE_CLUSTER": self.cluster_id,
            "FLEETLINE_EPOCH": str(order.epoch),
            "FLEETLINE_ATTEMPT": str(order.attempt),
            "FLEETLINE_TRACE_ID": order.trace_id,
            "TRACEPARENT": _traceparent(order, "workload") or "",
            "FLEETLINE_WORKERS": json.dumps(workers),
            "FLEETLINE_WORLD_SIZE": str(order.world_size),
            "FLEETLINE_LOCAL_WORKERS": str(len(workers)),
            "FLEETLINE_RANK_BASE": str(order.first_rank),
            # One thread: the same sums in the same order on every cluster (bit-identical).
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            # Where a workload that listens (an inference replica) binds and is reached, and
            # the certificate it shows there (this host's).
            "FLEETLINE_ADVERTISE_HOST": self.settings.advertise_host,
            # Where this cluster is (its ClusterInfo): what a federated round says contributed.
            "FLEETLINE_REGION": self.region or self.cluster_id,
            **(self.settings.tls.as_env() if self.settings.tls else {}),
        }
        if order.parts:
            # The job's world across clusters, and where its leaders meet: the store of the
            # cluster with rank 0 (the data plane's rendezvous).
            env["FLEETLINE_PARTS"] = World(
                tuple(Part(c, first, len(w)) for c, first, w in order.parts)
            ).to_json()
            env["FLEETLINE_DATAPLANE_BUCKET"] = cluster_bucket(
                self.settings.s3.bucket, order.parts[0][0]
            )
        return env | workload_env(workload_spec)

    # -- watching -------------------------------------------------------------------------------

    def current(self, workload: procs.Workload) -> Order | None:
        """The order the workload runs under, if it is still the job's order here (fencing)."""
        order = self.orders.get(workload.job)
        if (
            order is None
            or order.action != "RUN"
            or order.cluster_id != self.cluster_id
            or order.run_id != workload.run_id
        ):
            return None
        return order

    def stopped_here(self, workload: procs.Workload) -> Order | None:
        """The STOP order for the workload's own run, if that is the job's order: the epoch has
        not moved on, so what the workload writes on its way out (a final checkpoint) counts."""
        order = self.orders.get(workload.job)
        if (
            order is not None
            and order.action == "STOP"
            and order.cluster_id == self.cluster_id
            and order.run_id == workload.run_id
        ):
            return order
        return None

    def forget_finished(self) -> None:
        """Drop finished runs no order refers to any more (and their directories): what a run
        did is on the workload topic; only the current order's run must stay known, so that it
        is never started twice."""
        with self.lock:
            for job in list(self.running):
                order = self.orders.get(job)
                keep = (
                    order.run_id
                    if order is not None
                    and order.action == "RUN"
                    and order.cluster_id == self.cluster_id
                    else None
                )
                for w in [w for w in self.running[job] if w.reported and w.run_id != keep]:
                    self.running[job].remove(w)
                    shutil.rmtree(w.directory, ignore_errors=True)
                if not self.running[job]:
                    del self.running[job]

    def watch(self) -> None:
        self.forget_finished()
        with self.lock:
            workloads = [w for runs in self.running.values() for w in runs]
        for workload in workloads:
            if workload.reported:
                continue
            order = self.current(workload)
            self._publish_progress(workload, order or self.stopped_here(workload))
            alive = workload.alive
            if alive and order is not None:
                self._retell(workload, order)
            placed = (
                workload.handle.placed()
                if alive
                and order is not None
                and not workload.running_reported
                and workload.handle is not None
                else None
            )
            if (
                placed is not None
                and order is not None
                and time.monotonic() - workload.started_at >= self.running_after_s
                # A replica runs once it serves: its model loaded and its probe answered.
                and (order.kind != REPLICA_KIND or "ready" in workload.serving_lines())
            ):
                self._event(order, "RUNNING", pid=workload.pid, detail=placed)
                self._report(order, "RUNNING", detail=placed)
                workload.running_reported = True
                workload.mark("running")
            if (
                alive
                and workload.stop_deadline is not None
                and time.monotonic() > workload.stop_deadline
            ):
                workload.signal(signal.SIGKILL)
            if not alive:
                self._finished(workload, order)
        self.producer.poll(0)

    def _publish_progress(self, workload: procs.Workload, order: Order | None) -> None:
        lines = workload.new_progress()
        if not lines:
            return
        for line in lines:
            kind = line.get("event")
            if kind == "progress":
                workload.step = line.get("step")
            elif kind == "done":
                workload.done = line
            elif kind in ("listening", "ready"):
                workload.serving[kind] = line
                self.registry_wake.set()
            if order is None:
                continue
            for told in said(line):
                if isinstance(told, Event):
                    self._event(order, told.kind, **told.fields)
                else:
                    self._report(order, told.phase, **told.fields)
        # A fenced copy's lines are passed over, never published: it speaks for no epoch.
        self.producer.flush(10)
        workload.published_to(workload.published + len(lines))

    def _finished(self, workload: procs.Workload, order: Order | None) -> None:
        code = workload.exit_code()
        # The manager's word: killed before the launcher wrote a code, or its node lost.
        said = workload.handle.ended(code) if workload.handle is not None else None
        if said is not None:
            code = said[0]
        stopped = workload.interrupted() if workload.stop_deadline is None else None
        if code == 0 and stopped is not None and said is None:
            # It checkpointed and exited on a SIGTERM no stop of ours sent (its host shutting
            # down): interrupted, not done; the retry resumes it from that checkpoint.
            code = 143
            said = (
                code,
                f"interrupted at step {stopped.get('step')} by a SIGTERM not ordered here",
            )
        speaking_for = order or self._order_of(workload)
        if workload.stop_deadline is not None or order is None:
            # Stopped as ordered, or fenced: stopped (or found exited) after its epoch moved on.
            fenced = workload.fenced or workload.stop_deadline is None
            kind: WorkloadEventKind = "FENCED" if fenced else "STOPPED"
            self._event(
                speaking_for,
                "EXITED",
                exit_code=code,
                pid=workload.pid,
                detail=f"stopped: {workload.stop_reason or 'no longer ordered here'}",
            )
            self._event(speaking_for, kind, detail=workload.stop_reason or "no longer ordered here")
        elif code == 0:
            digest = workload.done.get("params_sha256")
            self._event(
                order,
                "EXITED",
                exit_code=0,
                step=workload.done.get("step"),
                detail=f"params sha256 {digest}" if digest else None,
            )
            self._report(
                order,
                "SUCCEEDED",
                exit_code=0,
                detail=f"params sha256 {digest}" if digest else "exit code 0",
            )
        else:
            reason = (
                (said[1] if said is not None else None)
                or workload.stderr_tail()
                or ("the workload could not be started" if code == 127 else "no error output")
            )
            self._event(order, "EXITED", exit_code=code, pid=workload.pid, detail=reason)
            self._event(order, "FAILED", exit_code=code, detail=reason)
            self._report(order, "FAILED", exit_code=code, detail=reason)
        self.producer.flush(10)
        workload.mark("reported")
        workload.reported = True
        self.registry_wake.set()

    def _order_of(self, workload: procs.Workload) -> Order:
        """An order shaped like the one the workload was started under (for its last events)."""
        return Order(
            workload.job,
            workload.tenant,
            "",
            "RUN",
            self.cluster_id,
            workload.epoch,
            workload.attempt,
            0,
            "",
            workload.trace_id,
            None,
            (),
            (),
            None,
            False,
        )

    # -- publishing -----------------------------------------------------------------------------

    def _event(
        self,
        order: Order,
        kind: WorkloadEventKind,
        *,
        pid: int | None = None,
        step: int | None = None,
        loss: float | None = None,
        samples_per_s: float | None = None,
        exit_code: int | None = None,
        checkpoint_uri: str | None = None,
        bytes: int | None = None,  # the schema's field
        seconds: float | None = None,
        from_cluster: str | None = None,
        detail: str | None = None,
    ) -> None:
        record: WorkloadEvent = {
            "job": order.job,
            "tenant": order.tenant,
            "cluster_id": self.cluster_id,
            "epoch": order.epoch,
            "attempt": order.attempt,
            "ts": self.clock(),
            "event": kind,
            "trace_id": order.trace_id,
            "pid": pid,
            "step": step,
            "loss": loss,
            "samples_per_s": samples_per_s,
            "exit_code": exit_code,
            "checkpoint_uri": checkpoint_uri,
            "bytes": bytes,
            "seconds": seconds,
            "from_cluster": from_cluster,
            "detail": detail,
        }
        trace = _trace(order, f"workload/{kind}")
        produce(
            self.producer,
            Output(
                self.topics.workloads,
                order.job.encode(),
                self.codec.encode(self.topics.record_of(self.topics.workloads), record),
                headers=tracing.header(trace) or None,
            ),
        )

    def _report(self, order: Order, phase: str, **fields: Any) -> None:
        request = new_request(
            "PROGRESS",
            order.job,
            order.tenant,
            self.clock(),
            uuid.uuid4().hex,
            actor=f"cluster-agent/{self.cluster_id}",
            phase=phase,
            cluster_id=self.cluster_id,
            epoch=order.epoch,
            attempt=order.attempt,
            traceparent=_traceparent(order, f"report/{phase}"),
            **fields,
        )
        produce(self.producer, request_output(self.topics, request, self.codec))

    # -- status and peers -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self.lock:
            workloads = [w for runs in self.running.values() for w in runs if w.alive]
        reserved = 0
        for w in workloads:
            order = self.orders.get(w.job)
            if order is not None and order.cluster_id == self.cluster_id:
                reserved += sum(len(ids) for _, ids in order.workers)
        return {
            "gpus_reserved": reserved,
            "workloads": [
                {
                    "job": w.job,
                    "epoch": w.epoch,
                    "attempt": w.attempt,
                    "state": "Stopping" if w.stop_deadline is not None else "Running",
                    "pid": w.pid,
                    "step": w.step,
                }
                for w in sorted(workloads, key=lambda w: (w.job, w.run_id))
            ],
            "peers": [
                {"cluster_id": c, "reachable": ok, "rtt_ms": rtt}
                for c, (ok, rtt) in sorted(self.peers.reach.items())
            ],
        }

    def _heartbeats(self, stop: threading.Event) -> None:
        producer = kafka_clients.producer(
            self.settings.kafka, {"linger.ms": 0, **kafka_clients.ACROSS_LINKS}
        )
        seq = 0
        try:
            while not stop.is_set():
                seq += 1
                record = cluster_signal(
                    "HEARTBEAT",
                    self.cluster_id,
                    self.clock(),
                    seq=seq,
                    incarnation=self.incarnation,
                    actor=f"cluster-agent/{self.cluster_id}",
                    # Why this cluster starts nothing now, in its manager's words.
                    reason=self.launcher.control_error(),
                    probe_address=self.peers.probe_address,
                    **self.status(),
                )
                produce(producer, signal_output(self.topics, record, self.codec))
                producer.poll(0)
                stop.wait(self.heartbeat_s)
        finally:
            producer.flush(5)
