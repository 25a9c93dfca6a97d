"""The scheduler's state: the fold of its request log, and that state as changelog records.

`SchedulerState` is what the fold keeps between requests: the jobs (desired and actual state,
phase and conditions), the tenants' policies and usage, the datasets it registered, the time
(the requests' event time, a running maximum), the log position, and the fleet as last observed
with the scheduler's own allocations in a capacity index. It is mutated in place by the step
(like the view: copying every job per request would cost more than deciding). `records` and
`from_records` turn it into the compacted changelog's records and back.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fleetline.processors.scheduling.capacity import (
    CapacityIndex,
    DatasetFacts,
    FleetFacts,
    fenced_facts,
)
from fleetline.processors.scheduling.effects import DatasetRecord, Decision
from fleetline.processors.scheduling.energy import EnergyProfile
from fleetline.processors.scheduling.estimate import Measured
from fleetline.processors.scheduling.policy import SchedulingPolicy
from fleetline.processors.scheduling.preemption import Victims
from fleetline.processors.scheduling.specs import (
    Dataset,
    InferenceService,
    JobSpec,
    TrainingJob,
    TrainingJobSpec,
    parse_spec,
)
from fleetline.processors.scheduling.tenancy import TenantPolicy, TenantUsage
from fleetline.streams.records import Offsets

# What evicting an inference replica costs, in seconds per GPU: loading the model and warming up.
SERVICE_RESTART_S = 300.0


class Phase(StrEnum):
    QUEUED = "Queued"
    PLACED = "Placed"  # holds its GPUs, waits for its data
    STARTING = "Starting"  # ordered to its cluster, not reported running (yet, or again)
    RUNNING = "Running"  # its cluster reports it running
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    TIMED_OUT = "TimedOut"
    DELETED = "Deleted"
    REJECTED = "Rejected"


TERMINAL = (Phase.SUCCEEDED, Phase.FAILED, Phase.TIMED_OUT, Phase.DELETED, Phase.REJECTED)


class Condition(StrEnum):
    ADMITTED = "Admitted"
    PLACED = "Placed"
    DATA_READY = "DataReady"
    RUNNING = "Running"
    PREEMPTED = "Preempted"
    FINISHED = "Finished"


@dataclass(slots=True)
class Job:
    """One job's desired and actual state, conditions and the latest decision about it."""

    key: str
    tenant: str
    name: str
    kind: str
    document: dict[str, Any]
    priority: int
    order: int  # submission position: FIFO among equals
    submitted_ms: int
    phase: Phase = Phase.QUEUED
    conditions: dict[str, dict[str, Any]] = field(default_factory=dict)
    allocation: dict[str, dict[str, int]] = field(default_factory=dict)  # cluster -> node -> mask
    workers: int = 0
    started_ms: int | None = None
    limit_end_ms: int | None = None
    committed_gpu_ms: int = 0
    checkpoint_ms: int | None = None  # reported by the cluster layer
    resume_from_ms: int | None = None
    waiting_for: list[str] = field(default_factory=list)  # "dataset@cluster" being prewarmed
    copied: dict[str, float] = field(default_factory=dict)  # ticket -> fraction the mover copied
    queued_reason: str | None = None
    last_decision: str | None = None
    preemptions: int = 0
    placed_ms: int | None = None
    alloc_seq: int = 0  # the job key's last Allocation record; runs on across resubmissions
    # The placement epoch its cluster was ordered to run (the alloc_seq of that placement, so it
    # only grows): reports about another epoch are stale, and ignored (fencing).
    epoch: int = 0
    attempt: int = 0  # start attempt within the epoch
    ordered_cluster: str | None = None  # where the last RUN order went
    retry_at_ms: int | None = None  # when the next attempt is ordered
    # A deferrable job's start, chosen once for the cheapest hours before its deadline.
    deferred_until_ms: int | None = None
    ran_in: list[str] = field(default_factory=list)  # clusters of earlier epochs, newest first
    ran_on: str | None = None  # the model of the chips its latest placement got
    checkpoint_step: int | None = None
    # A sized job's last checkpoint report of its epoch: [epoch, step, ts] (its step rate
    # between two reports measures its chips' share of peak).
    rate_mark: list[int] | None = None
    # What the cluster reports (actual state), beside the phase (desired state).
    actual: dict[str, Any] = field(default_factory=dict)
    stale_reports: int = 0
    # The trace id of the request that submitted this spec (its W3C traceparent), if it had one.
    entered_trace: str | None = None
    # The latest decision about the job, whole (for `explain`): a Decision, or its record once
    # read back from the store.
    explanation: Decision | dict[str, Any] | None = None
    # A service's replicas are jobs of their own (one gang each, placed, ordered, retried and
    # preempted like any job): `service` is the service a replica serves, `role` whether the
    # router may send it requests ("serving") or it is kept loaded for a scale-out
    # ("standby"). A service's own job holds no GPUs; `scaling` is its autoscaler's state
    # (services.py), or a replica's region order.
    service: str | None = None
    role: str | None = None
    scaling: dict[str, Any] = field(default_factory=dict)
    _spec: JobSpec | None = field(default=None, repr=False, compare=False)
    _interval: int | None = field(default=None, repr=False, compare=False)
    _held: int | None = field(default=None, repr=False, compare=False)

    @property
    def spec(self) -> JobSpec:
        """The job's `spec` section (TrainingJob or InferenceService), parsed once."""
        if self._spec is None:
            manifest = parse_spec(self.document)
            assert not isinstance(manifest, Dataset), "a job's document is a job's"
            self._spec = manifest.spec
        return self._spec

    @property
    def gpus(self) -> int:
        """GPUs held, cached until the allocation changes (`allocation_changed`)."""
        if self._held is None:
            self._held = sum(
                m.bit_count() for nodes in self.allocation.values() for m in nodes.values()
            )
        return self._held

    @property
    def interval_ms(self) -> int:
        """The checkpoint interval (0 for services, which keep no training state)."""
        if self._interval is None:
            spec = self.spec
            self._interval = (
                spec.checkpoint_interval_s * 1000 if isinstance(spec, TrainingJobSpec) else 0
            )
        return self._interval

    def allocation_changed(self) -> None:
        self._held = None

    def set_spec(self, document: dict[str, Any], spec: JobSpec, priority: int) -> None:
        self.document, self._spec, self._interval, self.priority = document, spec, None, priority

    @property
    def is_service(self) -> bool:
        """A service's own job: it holds no GPUs, its replicas do."""
        return self.kind == "InferenceService"

    @property
    def carried_out(self) -> bool:
        """A cluster agent starts it (and reports it running): every training job, and a
        service that names a workload."""
        spec = self.spec
        return isinstance(spec, TrainingJobSpec) or spec.workload is not None

    @property
    def trace_id(self) -> str:
        """32 hex digits, the same for every placement of this submission: the trace the
        submitting request entered with, or one derived from the submission."""
        if self.entered_trace is not None:
            return self.entered_trace
        return hashlib.sha256(f"{self.key}#{self.order}".encode()).hexdigest()[:32]

    @property
    def holds(self) -> bool:
        return bool(self.allocation)

    def condition(self, name: Condition, status: bool, reason: str, ts: int) -> None:
        current = self.conditions.get(name)
        if current is None or current["status"] != status or current["reason"] != reason:
            self.conditions[name] = {"status": status, "reason": reason, "since_ms": ts}

    def as_data(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "tenant": self.tenant,
            "name": self.name,
            "kind": self.kind,
            "document": self.document,
            "priority": self.priority,
            "order": self.order,
            "submitted_ms": self.submitted_ms,
            "phase": self.phase,
            "conditions": self.conditions,
            "allocation": {c: dict(sorted(n.items())) for c, n in sorted(self.allocation.items())},
            "workers": self.workers,
            "started_ms": self.started_ms,
            "limit_end_ms": self.limit_end_ms,
            "committed_gpu_ms": self.committed_gpu_ms,
            "checkpoint_ms": self.checkpoint_ms,
            "resume_from_ms": self.resume_from_ms,
            "waiting_for": self.waiting_for,
            "copied": self.copied,
            "queued_reason": self.queued_reason,
            "last_decision": self.last_decision,
            "preemptions": self.preemptions,
            "placed_ms": self.placed_ms,
            "alloc_seq": self.alloc_seq,
            "epoch": self.epoch,
            "attempt": self.attempt,
            "ordered_cluster": self.ordered_cluster,
            "retry_at_ms": self.retry_at_ms,
            "deferred_until_ms": self.deferred_until_ms,
            "ran_in": self.ran_in,
            "ran_on": self.ran_on,
            "checkpoint_step": self.checkpoint_step,
            "rate_mark": self.rate_mark,
            "actual": self.actual,
            "stale_reports": self.stale_reports,
            "entered_trace": self.entered_trace,
            "service": self.service,
            "role": self.role,
            "scaling": self.scaling,
            "explanation": (
                self.explanation.as_record()
                if isinstance(self.explanation, Decision)
                else self.explanation
            ),
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Job:
        fields = dict(data)
        fields.setdefault("deferred_until_ms", None)  # a record from before deferral existed
        fields.setdefault("service", None)  # ... or before services had replica jobs
        fields.setdefault("role", None)
        fields.setdefault("scaling", {})
        fields.setdefault("copied", {})  # ... or before the data mover reported progress
        fields.setdefault("rate_mark", None)  # ... or before step rates were measured
        fields.setdefault("ran_on", None)  # ... or before chips were told apart
        fields["phase"] = Phase(data["phase"])
        fields["allocation"] = {
            c: {n: int(m) for n, m in nodes.items()} for c, nodes in data["allocation"].items()
        }
        return cls(**fields)


def job_key(tenant: str, name: str) -> str:
    return f"{tenant}/{name}"


def spec_key(spec: TrainingJob | InferenceService | Dataset) -> str:
    """The key of a spec's requests and decisions: tenant/name for jobs; dataset:<name> for
    datasets, whose names are global (the resource view knows datasets by name)."""
    if isinstance(spec, Dataset):
        return f"dataset:{spec.metadata.name}"
    return job_key(spec.metadata.tenant, spec.metadata.name)


def checkpoint_before(job: Job, now: int) -> int:
    """The last checkpoint a training job has by `now`: the last one it reported since it
    started (or resumed), else the last one its interval implies since then. A workload that
    reports its checkpoints is taken at its word: its first comes after its start-up and each
    after its own stall, so the interval's count from the start would run ahead of them and
    name a checkpoint that does not exist."""
    start = job.started_ms if job.started_ms is not None else now
    if job.checkpoint_ms is not None and job.checkpoint_ms >= start:
        return min(job.checkpoint_ms, now)
    interval = job.interval_ms
    return start + ((now - start) // interval) * interval if interval else start


def lost_work_s(job: Job, now: int) -> float:
    """What evicting the job now loses: GPU-seconds since its last checkpoint (a service: a
    restart's worth per GPU)."""
    if job.interval_ms:
        return job.gpus * (now - checkpoint_before(job, now)) / 1000
    return job.gpus * SERVICE_RESTART_S


class SchedulerState:
    """The fold's state (see the module's docstring)."""

    def __init__(
        self, policy: SchedulingPolicy | None = None, facts: FleetFacts | None = None
    ) -> None:
        self.policy = policy or SchedulingPolicy()
        self.digest = self.policy.digest()
        # Nodes the operations processor fenced (FENCE): no placement there, whatever the view
        # says, until UNFENCE. `facts` is the observation with them taken out; `observed` as
        # the view had it.
        self.fenced: dict[str, str] = {}
        self.observed = facts or FleetFacts({}, {}, {}, {})
        self.facts = self.observed
        # Each cluster's electricity by the hour (ENERGY requests).
        self.energy: dict[str, EnergyProfile] = {}
        self.jobs: dict[str, Job] = {}
        self.tenants: dict[str, TenantPolicy] = {}
        self.usage: dict[str, TenantUsage] = {}
        self.datasets: dict[str, DatasetRecord] = {}  # registered through the scheduler
        self.now_ms = 0
        self.position = -1  # the last request folded
        self.node_jobs: dict[str, set[str]] = {}
        self.cluster_jobs: dict[str, set[str]] = {}  # jobs holding GPUs, per cluster
        self.priority_gpus: dict[str, dict[int, int]] = {}  # cluster -> priority -> GPUs held
        # cluster -> priority -> the jobs holding whole GPUs there at it, by key: a preemption
        # looks only at the priorities below its own, and never at a share of a GPU, which
        # frees nothing while others hold it (changed through hold, unhold and respec alone).
        self.evictable: dict[str, dict[int, dict[str, Job]]] = {}
        self.limits: list[tuple[int, str]] = []  # (limit end, job) heap
        self.retries: list[tuple[int, str]] = []  # (next attempt due, job) heap
        self.deferrals: list[tuple[int, str]] = []  # (deferred start, job) heap
        self.index = CapacityIndex(self.facts)
        # GPUs small replicas share: (cluster, node, GPU) -> replica -> its eighths. The index
        # holds such a GPU taken once, for all of them, until the last one leaves.
        self.shared: dict[tuple[str, str, int], dict[str, int]] = {}
        # GPUs replicas hold per cluster, while the index and the shares stand still (a queue
        # pass with tidal pools asks for it for every job it tries).
        self.inference_cache: tuple[Any, dict[str, int]] | None = None
        self.victim_cache: dict[tuple[str, int, int], Victims] = {}  # within one step
        # Whether the next TICK must retry the queue: something freed capacity, changed a
        # quota or a policy, or started jobs below the priority of jobs still waiting. Not
        # state of record: a restored scheduler retries at its first TICK.
        self.pass_wanted = True
        self.bound_floor: int | None = None
        self.preemptions_left = 0
        self.dirty: set[str] = set()  # store keys changed by the last steps
        # The share of peak sized jobs reached, per "model/precision": the TFLOP they computed
        # and the TFLOP their chips' peak allowed in the same time, and how many intervals.
        self.measured: dict[str, Measured] = {}

    # -- derived ----------------------------------------------------------------------------

    def tenant_policy_of(self, tenant: str) -> TenantPolicy | None:
        return self.tenants.get(tenant, self.policy.default_tenant)

    def runtime_ms(self, spec: TrainingJobSpec) -> int:
        return (spec.max_runtime_s or self.policy.default_max_runtime_s) * 1000

    def dataset(self, dataset_id: str) -> DatasetFacts | None:
        """A dataset as the scheduler knows it: registered here, else as the view saw it."""
        own = self.datasets.get(dataset_id)
        if own is not None:
            return (
                None
                if own.deleted
                else DatasetFacts(
                    own.dataset_id, own.tenant, own.size_bytes, own.replicas, own.residency
                )
            )
        return self.facts.datasets.get(dataset_id)

    def usage_of(self, tenant: str) -> TenantUsage:
        return self.usage.setdefault(tenant, TenantUsage())

    def hold(self, cluster_id: str, job: Job, gpus: int) -> None:
        """The job holds `gpus` GPUs in the cluster (more, when it held some already)."""
        self.cluster_jobs.setdefault(cluster_id, set()).add(job.key)
        if job.scaling.get("share") is None:
            self.evictable.setdefault(cluster_id, {}).setdefault(job.priority, {})[job.key] = job
        held = self.priority_gpus.setdefault(cluster_id, {})
        held[job.priority] = held.get(job.priority, 0) + gpus

    def unhold(self, cluster_id: str, job: Job, gpus: int) -> None:
        """The job holds its `gpus` GPUs in the cluster no more."""
        holding = self.cluster_jobs.get(cluster_id)
        if holding is not None:
            holding.discard(job.key)
        self.evictable.get(cluster_id, {}).get(job.priority, {}).pop(job.key, None)
        held = self.priority_gpus.setdefault(cluster_id, {})
        held[job.priority] = held.get(job.priority, 0) - gpus

    def respec(self, job: Job, document: dict[str, Any], spec: JobSpec, priority: int) -> None:
        """The job takes a new spec at `priority`, keeping whatever GPUs it holds (counted at
        its new priority from now on)."""
        held = {c: sum(m.bit_count() for m in ns.values()) for c, ns in job.allocation.items()}
        for cluster_id, gpus in held.items():
            self.unhold(cluster_id, job, gpus)
        job.set_spec(document, spec, priority)
        for cluster_id, gpus in held.items():
            self.hold(cluster_id, job, gpus)

    def queue(self) -> list[Job]:
        """Queued jobs by priority, then submission order (fair share reorders tenants)."""
        return sorted(
            (j for j in self.jobs.values() if j.phase == Phase.QUEUED),
            key=lambda j: (-j.priority, j.order, j.key),
        )

    def observe(self, facts: FleetFacts) -> None:
        """Take a new observation of the view, fences applied (the index follows)."""
        self.observed = facts
        self.facts = fenced_facts(facts, self.fenced)
        self.index.refresh(self.facts)

    def rebuild_index(self) -> None:
        taken: dict[str, int] = {}
        self.node_jobs = {}
        self.cluster_jobs = {}
        self.priority_gpus = {}
        self.evictable = {}
        self.limits = []
        self.retries = []
        self.deferrals = []
        self.shared = {}
        self.facts = fenced_facts(self.observed, self.fenced)
        for key in sorted(self.jobs):
            job = self.jobs[key]
            share = job.scaling.get("share")
            if share is not None:
                for cluster_id, nodes in job.allocation.items():
                    for node, mask in nodes.items():
                        gpu = mask.bit_length() - 1
                        self.shared.setdefault((cluster_id, node, gpu), {})[key] = share
            for cluster_id, nodes in job.allocation.items():
                self.hold(cluster_id, job, sum(m.bit_count() for m in nodes.values()))
                for node, mask in nodes.items():
                    taken[node] = taken.get(node, 0) | mask
                    self.node_jobs.setdefault(node, set()).add(key)
            if job.holds and job.limit_end_ms is not None:
                heapq.heappush(self.limits, (job.limit_end_ms, key))
            if job.retry_at_ms is not None:
                heapq.heappush(self.retries, (job.retry_at_ms, key))
            if job.deferred_until_ms is not None and job.phase == Phase.QUEUED:
                heapq.heappush(self.deferrals, (job.deferred_until_ms, key))
        self.index = CapacityIndex(self.facts, taken)

    # -- as changelog records -------------------------------------------------------------------

    def records(self, keys: set[str] | None = None) -> Iterator[tuple[str, Any]]:
        """(store key, JSON-able value or None) for the given keys (all by default)."""
        wanted = (
            keys
            if keys is not None
            else (
                {f"job:{k}" for k in self.jobs}
                | {f"tenant:{t}" for t in set(self.tenants) | set(self.usage)}
                | {f"dataset:{d}" for d in self.datasets}
                | {f"measured:{m}" for m in self.measured}
                | {"meta"}
            )
        )
        for key in sorted(wanted):
            kind, _, name = key.partition(":")
            if kind == "job":
                job = self.jobs.get(name)
                yield key, job.as_data() if job else None
            elif kind == "tenant":
                policy, usage = self.tenants.get(name), self.usage.get(name)
                yield (
                    key,
                    None
                    if policy is None and usage is None
                    else {
                        "policy": policy.as_data() if policy else None,
                        "usage": usage.as_data() if usage else None,
                    },
                )
            elif kind == "dataset":
                d = self.datasets.get(name)
                yield (
                    key,
                    None
                    if d is None
                    else {
                        "dataset_id": d.dataset_id,
                        "tenant": d.tenant,
                        "seq": d.seq,
                        "ts": d.ts,
                        "size_bytes": d.size_bytes,
                        "replicas": list(d.replicas),
                        "deleted": d.deleted,
                        "residency": list(d.residency),
                        "source": d.source,
                        "sensitive_fields": list(d.sensitive_fields),
                    },
                )
            elif kind == "measured":
                found = self.measured.get(name)
                yield key, None if found is None else found.as_data()
            else:
                yield (
                    key,
                    {
                        "policy": self.policy.as_data(),
                        "fenced": dict(sorted(self.fenced.items())),
                        "energy": {c: p.as_data() for c, p in sorted(self.energy.items())},
                        "now_ms": self.now_ms,
                        "position": self.position,
                        "view_offsets": {
                            t: {str(p): o for p, o in ps.items()}
                            for t, ps in self.facts.offsets.items()
                        },
                    },
                )

    def drain_dirty(self) -> list[tuple[str, Any]]:
        keys, self.dirty = self.dirty, set()
        return list(self.records(keys)) if keys else []

    def restore(self, records: Mapping[str, Any]) -> None:
        """Take the state the records describe (over the facts already set)."""
        meta = records.get("meta") or {}
        if meta.get("policy"):
            self.policy = SchedulingPolicy.from_data(meta["policy"])
            self.digest = self.policy.digest()
        self.now_ms = meta.get("now_ms", 0)
        self.fenced = dict(meta.get("fenced") or {})
        self.energy = {c: EnergyProfile.from_data(p) for c, p in (meta.get("energy") or {}).items()}
        self.position = meta.get("position", -1)
        for key in sorted(records):
            value = records[key]
            kind, _, name = key.partition(":")
            if value is None:
                continue
            if kind == "job":
                self.jobs[name] = Job.from_data(value)
            elif kind == "tenant":
                if value.get("policy"):
                    self.tenants[name] = TenantPolicy.from_data(value["policy"])
                if value.get("usage"):
                    self.usage[name] = TenantUsage.from_data(value["usage"])
            elif kind == "dataset":
                self.datasets[name] = DatasetRecord(
                    value["dataset_id"],
                    value["tenant"],
                    value["seq"],
                    value["ts"],
                    value["size_bytes"],
                    tuple(value["replicas"]),
                    value["deleted"],
                    tuple(value.get("residency") or ()),  # absent from older snapshots
                    value.get("source"),
                    tuple(value.get("sensitive_fields") or ()),
                )
            elif kind == "measured":
                self.measured[name] = Measured.from_data(value)
        self.rebuild_index()


def view_offsets_of(records: Mapping[str, Any]) -> Offsets:
    """The view offsets the recorded state last observed."""
    meta = records.get("meta") or {}
    return {
        t: {int(p): int(o) for p, o in ps.items()} for t, ps in meta.get("view_offsets", {}).items()
    }
