"""The scheduler as event handlers: a deterministic fold of its request log into decisions.

`Scheduler.step(request, position, facts)` handles one request from `<prefix>.scheduler.requests`
(one partition, so one total order) and returns what it decided as data (`Effect`s): scheduling
decisions with their reasons, the view position they read and the alternatives' scores;
allocation records for the resource view; dataset prewarms and dataset records. It reads no clock
and draws no random numbers: time is the requests' event time (a monotone maximum), ids come from
the request's log position, and the fleet is what `observe(view)` saw at the offsets a TICK names.
So folding the same requests with the views at the same offsets gives the same effects, byte for
byte; `fleetline replay --decisions` checks that against the log.

Requests: SUBMIT (a spec: the desired state), DELETE, PROGRESS (a job's checkpoint, finish or
failure, from the cluster layer), TENANT_POLICY (quotas, reservations, share), POLICY (the
scheduling pipeline), DATASET_READY (a prewarm finished), TICK (time moves on and the view is
observed at the offsets it names).

The reconcile loop is the TICK: jobs on GPUs that failed or nodes that went down or out of reach
are migrated (released, resumed from their last checkpoint elsewhere); jobs past their time limit
are stopped; the queue is retried in priority order, fair share between tenants of equal
priority, then submission order, preempting lower priorities where the policy allows.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fleetline.errors import FleetlineError, InvalidEventError
from fleetline.processors.scheduling.capacity import (
    CapacityIndex,
    DatasetFacts,
    FleetFacts,
    indices_of,
)
from fleetline.processors.scheduling.pipeline import (
    FLEET_FILTERS,
    ClusterScore,
    Context,
    DatasetPrewarm,
    JobRequest,
    Outcome,
    SchedulingPolicy,
    place_gang,
    place_replicas,
    place_split,
    rank_clusters,
    replace_request,
)
from fleetline.processors.scheduling.placement import (
    Placement,
    inference_shape,
    refs_by_node,
    training_shape,
)
from fleetline.processors.scheduling.preemption import Victim, plan_eviction
from fleetline.processors.scheduling.specs import (
    Dataset,
    InferenceService,
    SpecError,
    TrainingJob,
    parse_spec,
)
from fleetline.processors.scheduling.tenancy import (
    PRIORITIES,
    Request,
    TenantPolicy,
    TenantUsage,
    fair_share_key,
    quota_block,
)

# What evicting an inference replica costs, in seconds per GPU: loading the model and warming up.
SERVICE_RESTART_S = 300.0
TERMINAL = ("Succeeded", "Failed", "TimedOut", "Deleted", "Rejected")
REQUEST_KINDS = ("SUBMIT", "DELETE", "PROGRESS", "TENANT_POLICY", "POLICY", "DATASET_READY",
                 "TICK")


@dataclass(frozen=True)
class Decision:
    decision_id: str
    job: str
    tenant: str
    kind: str
    outcome: str  # PLACED, QUEUED, PREEMPTED, REJECTED, RELEASED, ACCEPTED
    ts: int
    input_offset: int
    view_version: int
    view_offsets: dict[str, dict[int, int]]
    policy_digest: str
    priority: int
    reason: str
    placements: tuple[Placement, ...] = ()
    alternatives: tuple[ClusterScore, ...] = ()
    prewarms: tuple[DatasetPrewarm, ...] = ()
    preempted_by: str | None = None
    victims: tuple[str, ...] = ()
    resume_from_checkpoint_ms: int | None = None
    lost_gpu_s: float | None = None

    @property
    def cluster_id(self) -> str | None:
        return self.placements[0].cluster_id if self.placements else None

    @property
    def placement(self) -> Placement | None:
        return self.placements[0] if self.placements else None

    @property
    def prewarm(self) -> DatasetPrewarm | None:
        return self.prewarms[0] if self.prewarms else None

    def as_record(self) -> dict[str, Any]:
        """The SchedulingDecision record."""
        d = self
        return {
            "decision_id": d.decision_id, "job": d.job, "tenant": d.tenant, "kind": d.kind,
            "outcome": d.outcome, "ts": d.ts, "input_offset": d.input_offset,
            "view_version": d.view_version,
            "view_offsets": [{"topic": t, "partition": p, "offset": o}
                             for t, ps in sorted(d.view_offsets.items())
                             for p, o in sorted(ps.items())],
            "policy_digest": d.policy_digest, "priority": d.priority, "reason": d.reason,
            "placements": [{"cluster_id": p.cluster_id, "leaves": list(p.leaves),
                            "workers": [{"node_id": w[0][0], "gpus": [i for _, i in w]}
                                        for w in p.workers if w]}
                           for p in d.placements],
            "alternatives": [{"cluster_id": a.cluster_id, "total": a.total,
                              "parts": dict(a.parts), "rejected": a.rejected}
                             for a in d.alternatives],
            "prewarms": [{"dataset_id": p.dataset_id, "from_cluster": p.from_cluster,
                          "to_cluster": p.to_cluster, "size_bytes": p.size_bytes,
                          "estimated_s": p.estimated_s, "rate_gbps": p.rate_gbps}
                         for p in d.prewarms],
            "preempted_by": d.preempted_by, "victims": list(d.victims),
            "resume_from_checkpoint_ms": d.resume_from_checkpoint_ms, "lost_gpu_s": d.lost_gpu_s,
        }


@dataclass(frozen=True)
class AllocationChange:
    job: str
    tenant: str
    kind: str  # ALLOCATED or RELEASED
    cluster_id: str
    gpus: tuple[tuple[str, int], ...]
    priority: int
    seq: int
    ts: int
    reason: str


@dataclass(frozen=True)
class PrewarmOrder:
    job: str
    tenant: str
    decision_id: str
    ts: int
    prewarm: DatasetPrewarm


@dataclass(frozen=True)
class DatasetRecord:
    dataset_id: str
    tenant: str
    seq: int
    ts: int
    size_bytes: int
    replicas: tuple[str, ...]
    deleted: bool = False


Effect = Decision | AllocationChange | PrewarmOrder | DatasetRecord


@dataclass
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
    phase: str = "Queued"
    conditions: dict[str, dict[str, Any]] = field(default_factory=dict)
    allocation: dict[str, dict[str, int]] = field(default_factory=dict)  # cluster -> node -> mask
    workers: int = 0
    started_ms: int | None = None
    limit_end_ms: int | None = None
    committed_gpu_ms: int = 0
    checkpoint_ms: int | None = None  # reported by the cluster layer
    resume_from_ms: int | None = None
    waiting_for: list[str] = field(default_factory=list)  # "dataset@cluster" being prewarmed
    queued_reason: str | None = None
    last_decision: str | None = None
    preemptions: int = 0
    placed_ms: int | None = None
    alloc_seq: int = 0  # the job key's last Allocation record; runs on across resubmissions
    # The latest decision about the job, whole (for `explain`): a Decision, or its record once
    # read back from the store.
    explanation: Any = None
    _spec: Any = field(default=None, repr=False, compare=False)
    _interval: int | None = field(default=None, repr=False, compare=False)
    _held: int | None = field(default=None, repr=False, compare=False)

    @property
    def spec(self) -> TrainingJob | InferenceService:
        if self._spec is None:
            self._spec = parse_spec(self.document)
        return self._spec

    @property
    def gpus(self) -> int:
        """GPUs held, cached until the allocation changes (`allocation_changed`)."""
        if self._held is None:
            self._held = sum(m.bit_count() for nodes in self.allocation.values()
                             for m in nodes.values())
        return self._held

    @property
    def interval_ms(self) -> int:
        """The checkpoint interval (0 for services, which keep no training state)."""
        if self._interval is None:
            spec = self.spec
            self._interval = (spec.checkpoint_interval_s * 1000 if isinstance(spec, TrainingJob)
                              else 0)
        return self._interval

    def allocation_changed(self) -> None:
        self._held = None

    def set_spec(self, document: dict[str, Any], spec: Any, priority: int) -> None:
        self.document, self._spec, self._interval, self.priority = document, spec, None, priority

    @property
    def holds(self) -> bool:
        return bool(self.allocation)

    def condition(self, name: str, status: bool, reason: str, ts: int) -> None:
        current = self.conditions.get(name)
        if current is None or current["status"] != status or current["reason"] != reason:
            self.conditions[name] = {"status": status, "reason": reason, "since_ms": ts}

    def as_data(self) -> dict[str, Any]:
        return {
            "key": self.key, "tenant": self.tenant, "name": self.name, "kind": self.kind,
            "document": self.document, "priority": self.priority, "order": self.order,
            "submitted_ms": self.submitted_ms, "phase": self.phase,
            "conditions": self.conditions,
            "allocation": {c: dict(sorted(n.items())) for c, n in sorted(self.allocation.items())},
            "workers": self.workers, "started_ms": self.started_ms,
            "limit_end_ms": self.limit_end_ms, "committed_gpu_ms": self.committed_gpu_ms,
            "checkpoint_ms": self.checkpoint_ms, "resume_from_ms": self.resume_from_ms,
            "waiting_for": self.waiting_for, "queued_reason": self.queued_reason,
            "last_decision": self.last_decision, "preemptions": self.preemptions,
            "placed_ms": self.placed_ms, "alloc_seq": self.alloc_seq,
            "explanation": (self.explanation.as_record()
                            if isinstance(self.explanation, Decision) else self.explanation),
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Job:
        fields = dict(data)
        fields["allocation"] = {c: {n: int(m) for n, m in nodes.items()}
                                for c, nodes in data["allocation"].items()}
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
    """The last checkpoint a training job has by `now`: the one it reported, or the last one its
    interval implies since it started (or resumed)."""
    start = job.started_ms if job.started_ms is not None else now
    interval = job.interval_ms
    implied = start + ((now - start) // interval) * interval if interval else start
    reported = job.checkpoint_ms if job.checkpoint_ms is not None else start
    return max(implied, reported, start)


def lost_work_s(job: Job, now: int) -> float:
    """What evicting the job now loses: GPU-seconds since its last checkpoint (a service: a
    restart's worth per GPU)."""
    if job.interval_ms:
        return job.gpus * (now - checkpoint_before(job, now)) / 1000
    return job.gpus * SERVICE_RESTART_S


class Scheduler:
    """The scheduler's state and its pure handlers. Mutated in place by `step` (like the view:
    copying every job per request would cost more than deciding)."""

    def __init__(self, policy: SchedulingPolicy | None = None,
                 facts: FleetFacts | None = None) -> None:
        self.policy = policy or SchedulingPolicy()
        self.digest = self.policy.digest()
        self.facts = facts or FleetFacts({}, {}, {}, {})
        self.jobs: dict[str, Job] = {}
        self.tenants: dict[str, TenantPolicy] = {}
        self.usage: dict[str, TenantUsage] = {}
        self.datasets: dict[str, DatasetRecord] = {}  # registered through the scheduler
        self.now_ms = 0
        self.position = -1  # the last request folded
        self.node_jobs: dict[str, set[str]] = {}
        self.cluster_jobs: dict[str, set[str]] = {}  # jobs holding GPUs, per cluster
        self.priority_gpus: dict[str, dict[int, int]] = {}  # cluster -> priority -> GPUs held
        self.limits: list[tuple[int, str]] = []  # (limit end, job) heap
        self.index = CapacityIndex(self.facts)
        self._effects: list[Effect] = []
        self._decisions = 0
        self._victim_cache: dict[tuple, list[Victim]] = {}
        # Whether the next TICK must retry the queue: something freed capacity, changed a
        # quota or a policy, or started jobs below the priority of jobs still waiting. Not
        # state of record: a restored scheduler retries at its first TICK.
        self._pass_wanted = True
        self._bound_floor: int | None = None
        self._preemptions_left = 0
        self.dirty: set[str] = set()  # store keys changed by the last steps

    # -- state as records, for the changelog store ------------------------------------------

    def records(self, keys: set[str] | None = None) -> Iterator[tuple[str, Any]]:
        """(store key, JSON-able value or None) for the given keys (all by default)."""
        wanted = keys if keys is not None else (
            {f"job:{k}" for k in self.jobs} | {f"tenant:{t}" for t in
                                                set(self.tenants) | set(self.usage)}
            | {f"dataset:{d}" for d in self.datasets} | {"meta"})
        for key in sorted(wanted):
            kind, _, name = key.partition(":")
            if kind == "job":
                job = self.jobs.get(name)
                yield key, job.as_data() if job else None
            elif kind == "tenant":
                policy, usage = self.tenants.get(name), self.usage.get(name)
                yield key, None if policy is None and usage is None else {
                    "policy": policy.as_data() if policy else None,
                    "usage": usage.as_data() if usage else None}
            elif kind == "dataset":
                d = self.datasets.get(name)
                yield key, None if d is None else {
                    "dataset_id": d.dataset_id, "tenant": d.tenant, "seq": d.seq, "ts": d.ts,
                    "size_bytes": d.size_bytes, "replicas": list(d.replicas),
                    "deleted": d.deleted}
            else:
                yield key, {"policy": self.policy.as_data(), "now_ms": self.now_ms,
                            "position": self.position,
                            "view_offsets": {t: {str(p): o for p, o in ps.items()}
                                             for t, ps in self.facts.offsets.items()}}

    def drain_dirty(self) -> list[tuple[str, Any]]:
        keys, self.dirty = self.dirty, set()
        return list(self.records(keys)) if keys else []

    @classmethod
    def from_records(cls, records: Mapping[str, Any], facts: FleetFacts) -> Scheduler:
        """The state the records describe, over the view facts it last observed."""
        meta = records.get("meta") or {}
        policy = (SchedulingPolicy.from_data(meta["policy"]) if meta.get("policy")
                  else SchedulingPolicy())
        s = cls(policy, facts)
        s.now_ms = meta.get("now_ms", 0)
        s.position = meta.get("position", -1)
        for key in sorted(records):
            value = records[key]
            kind, _, name = key.partition(":")
            if value is None:
                continue
            if kind == "job":
                s.jobs[name] = Job.from_data(value)
            elif kind == "tenant":
                if value.get("policy"):
                    s.tenants[name] = TenantPolicy.from_data(value["policy"])
                if value.get("usage"):
                    s.usage[name] = TenantUsage.from_data(value["usage"])
            elif kind == "dataset":
                s.datasets[name] = DatasetRecord(
                    value["dataset_id"], value["tenant"], value["seq"], value["ts"],
                    value["size_bytes"], tuple(value["replicas"]), value["deleted"])
        s._rebuild_index()
        return s

    @staticmethod
    def view_offsets_of(records: Mapping[str, Any]) -> dict[str, dict[int, int]]:
        meta = records.get("meta") or {}
        return {t: {int(p): int(o) for p, o in ps.items()}
                for t, ps in meta.get("view_offsets", {}).items()}

    def _rebuild_index(self) -> None:
        taken: dict[str, int] = {}
        self.node_jobs = {}
        self.cluster_jobs = {}
        self.priority_gpus = {}
        self.limits = []
        for key in sorted(self.jobs):
            job = self.jobs[key]
            for cluster_id, nodes in job.allocation.items():
                self.cluster_jobs.setdefault(cluster_id, set()).add(key)
                self._count_priority(cluster_id, job.priority,
                                     sum(m.bit_count() for m in nodes.values()))
                for node, mask in nodes.items():
                    taken[node] = taken.get(node, 0) | mask
                    self.node_jobs.setdefault(node, set()).add(key)
            if job.holds and job.limit_end_ms is not None:
                heapq.heappush(self.limits, (job.limit_end_ms, key))
        self.index = CapacityIndex(self.facts, taken)

    def _count_priority(self, cluster_id: str, priority: int, gpus: int) -> None:
        held = self.priority_gpus.setdefault(cluster_id, {})
        held[priority] = held.get(priority, 0) + gpus

    # -- the fold ---------------------------------------------------------------------------

    def step(self, request: Mapping[str, Any], position: int,
             facts: FleetFacts | None = None) -> list[Effect]:
        """Fold one request at log `position`; `facts` is the view observed at the offsets a
        TICK names (required for TICKs, ignored otherwise)."""
        self._effects = []
        self._decisions = 0
        self.position = position
        self.dirty.add("meta")
        if request["ts"] > self.now_ms:
            self.now_ms = request["ts"]
        kind = request["kind"]
        match kind:
            case "SUBMIT":
                self._submit(request)
            case "DELETE":
                self._delete(request)
            case "PROGRESS":
                self._progress(request)
            case "TENANT_POLICY":
                self._tenant_policy(request)
            case "POLICY":
                self._policy(request)
            case "DATASET_READY":
                self._dataset_ready(request)
            case "TICK":
                if facts is None:
                    raise InvalidEventError("a TICK needs the view observed at its offsets")
                self._tick(facts)
            case other:
                raise InvalidEventError(f"the scheduler does not handle {other} requests")
        effects, self._effects = self._effects, []
        return effects

    # -- requests ---------------------------------------------------------------------------

    def _submit(self, request: Mapping[str, Any]) -> None:
        try:
            document = json.loads(request["spec_json"] or "null")
            spec = parse_spec(document)
        except (ValueError, SpecError) as exc:
            self._decide_about(request["key"], request["tenant"], "Unknown", "REJECTED",
                               f"the spec does not validate: {exc}", 0)
            return
        tenant, name = spec.metadata.tenant, spec.metadata.name
        key = spec_key(spec)
        if key != request["key"] or tenant != request["tenant"]:
            self._decide_about(request["key"], request["tenant"], spec.kind, "REJECTED",
                               f"the request is keyed {request['key']!r} (tenant "
                               f"{request['tenant']!r}) but the spec names {key!r}", 0)
            return
        if isinstance(spec, Dataset):
            self._register_dataset(spec)
            return
        priority = PRIORITIES[spec.priority_class]
        job = self.jobs.get(key)
        if job is not None and job.phase not in TERMINAL:
            if job.kind != spec.kind:
                self._decide(job, "REJECTED", f"{key} is a {job.kind}; delete it before "
                             f"applying a {spec.kind} of that name")
                return
            if job.document == document:
                return  # applied again unchanged: nothing to do
            if job.holds and _same_shape(job.spec, spec):
                for cluster_id, nodes in job.allocation.items():
                    held = sum(m.bit_count() for m in nodes.values())
                    self._count_priority(cluster_id, job.priority, -held)
                    self._count_priority(cluster_id, priority, held)
                job.set_spec(document, spec, priority)
                self.dirty.add(f"job:{key}")
                return
            if job.holds:
                self._release(job, "RELEASED", "the spec changed; placing it again")
            job.set_spec(document, spec, priority)
            job.phase, job.queued_reason = "Queued", None
            self.dirty.add(f"job:{key}")
        else:
            before = self.jobs.get(key)
            job = Job(key, tenant, name, spec.kind, document, priority, self.position,
                      self.now_ms, alloc_seq=before.alloc_seq if before else 0, _spec=spec)
            self.jobs[key] = job
            self.dirty.add(f"job:{key}")
            never = self._never_fits(job)
            if never is not None:
                job.phase = "Rejected"
                job.condition("Admitted", False, never, self.now_ms)
                self._decide(job, "REJECTED", never)
                return
        self._attempt(job, None)

    def _never_fits(self, job: Job) -> str | None:
        spec = job.spec
        policy = self._tenant_policy_of(job.tenant)
        if isinstance(spec, TrainingJob):
            gpus = spec.gpus_per_worker * spec.min_workers
            gpu_ms = gpus * self._runtime_ms(spec)
            dataset = self._dataset(spec.dataset) if spec.dataset else None
            if spec.dataset and dataset is not None and dataset.tenant != job.tenant:
                return f"dataset {spec.dataset} belongs to another tenant"
        else:
            gpus, gpu_ms = spec.gpus_per_replica * spec.min_replicas, 0
        block = quota_block(policy, TenantUsage(), Request(gpus, {}, gpu_ms))
        return None if block is None else f"can never fit: {block}"

    def _delete(self, request: Mapping[str, Any]) -> None:
        key = request["key"]
        if key.startswith("dataset:"):
            self._delete_dataset(key.partition(":")[2], request["tenant"])
            return
        job = self.jobs.get(key)
        if job is None or job.phase in TERMINAL:
            return
        who = request.get("actor") or "someone"
        if job.holds:
            self._release(job, "RELEASED", f"deleted by {who}")
        job.phase = "Deleted"
        job.condition("Finished", True, f"deleted by {who}", self.now_ms)
        self.dirty.add(f"job:{key}")
        self._schedule_queue()

    def _progress(self, request: Mapping[str, Any]) -> None:
        job = self.jobs.get(request["key"])
        if job is None or job.phase in TERMINAL:
            return
        phase = request.get("phase")
        self.dirty.add(f"job:{job.key}")
        if phase == "CHECKPOINT":
            if request.get("checkpoint_ms") is not None and job.holds:
                job.checkpoint_ms = max(job.checkpoint_ms or 0, int(request["checkpoint_ms"]))
            return
        if phase == "RUNNING":
            if job.holds:
                job.condition("Running", True, "the cluster reports it running", self.now_ms)
            return
        if phase not in ("SUCCEEDED", "FAILED"):
            raise InvalidEventError(f"{job.key}: unknown progress phase {phase!r}")
        if job.holds:
            self._release(job, "RELEASED", f"the job {phase.lower()}")
        job.phase = "Succeeded" if phase == "SUCCEEDED" else "Failed"
        job.condition("Finished", True, f"the cluster reports it {phase.lower()}", self.now_ms)
        self._schedule_queue()

    def _tenant_policy(self, request: Mapping[str, Any]) -> None:
        policy = TenantPolicy.from_data(_payload(request, "tenant policy"))
        if policy.tenant != request["tenant"]:
            raise InvalidEventError(f"tenant policy for {policy.tenant} sent as "
                                    f"{request['tenant']}")
        self.tenants[policy.tenant] = policy
        self.dirty.add(f"tenant:{policy.tenant}")
        self._schedule_queue()

    def _policy(self, request: Mapping[str, Any]) -> None:
        data = _payload(request, "scheduling policy")
        if not isinstance(data, Mapping):
            raise InvalidEventError("a scheduling policy must be a mapping")
        try:
            self.policy = SchedulingPolicy.from_data(data)
        except FleetlineError as exc:
            raise InvalidEventError(str(exc)) from None
        self.digest = self.policy.digest()
        self._schedule_queue()

    def _dataset_ready(self, request: Mapping[str, Any]) -> None:
        dataset_id, _, cluster = request["key"].partition("@")
        current = self._dataset(dataset_id)
        if current is None or not cluster:
            raise InvalidEventError(f"DATASET_READY for unknown dataset or cluster "
                                    f"{request['key']!r}")
        usage = self.usage.setdefault(current.tenant, TenantUsage())
        usage.prewarms.pop(request["key"], None)
        self.dirty.add(f"tenant:{current.tenant}")
        self._pass_wanted = True
        if cluster not in current.replicas:
            self._record_dataset(DatasetRecord(
                current.dataset_id, current.tenant, 0, 0, current.size_bytes,
                tuple(sorted({*current.replicas, cluster}))))
        for key in sorted(self.jobs):
            job = self.jobs[key]
            if request["key"] in job.waiting_for:
                job.waiting_for.remove(request["key"])
                self.dirty.add(f"job:{key}")
                if not job.waiting_for and job.holds:
                    self._start(job)

    # -- datasets ---------------------------------------------------------------------------

    def _dataset(self, dataset_id: str) -> DatasetFacts | None:
        own = self.datasets.get(dataset_id)
        if own is not None:
            return None if own.deleted else DatasetFacts(own.dataset_id, own.tenant,
                                                         own.size_bytes, own.replicas)
        return self.facts.datasets.get(dataset_id)

    def _record_dataset(self, record: DatasetRecord) -> None:
        record = replace(record, seq=self.position + 1, ts=self.now_ms)
        self.datasets[record.dataset_id] = record
        self.dirty.add(f"dataset:{record.dataset_id}")
        self._effects.append(record)

    def _register_dataset(self, spec: Dataset) -> None:
        tenant, name = spec.metadata.tenant, spec.metadata.name
        current = self._dataset(name)
        if current is not None and current.tenant != tenant:
            self._decide_about(f"dataset:{name}", tenant, "Dataset", "REJECTED",
                               f"dataset {name} belongs to another tenant", 0)
            return
        usage = self.usage.setdefault(tenant, TenantUsage())
        before = current.size_bytes * len(current.replicas) if current else 0
        after = spec.size_bytes * len(spec.replicas)
        block = quota_block(self._tenant_policy_of(tenant), usage,
                            Request(storage_bytes=max(0, after - before)))
        if block is not None:
            self._decide_about(f"dataset:{name}", tenant, "Dataset", "REJECTED", block, 0)
            return
        usage.storage_bytes += after - before
        self.dirty.add(f"tenant:{tenant}")
        self._pass_wanted = True
        self._record_dataset(DatasetRecord(name, tenant, 0, 0, spec.size_bytes,
                                           tuple(sorted(spec.replicas))))
        self._decide_about(f"dataset:{name}", tenant, "Dataset", "ACCEPTED",
                           f"{spec.size_bytes} bytes in {len(spec.replicas)} replica(s); "
                           f"tenant {tenant} stores {usage.storage_bytes} bytes", 0)

    def _delete_dataset(self, name: str, tenant: str) -> None:
        current = self.datasets.get(name)
        if current is None or current.deleted or current.tenant != tenant:
            return
        usage = self.usage.setdefault(tenant, TenantUsage())
        usage.storage_bytes -= current.size_bytes * len(current.replicas)
        self.dirty.add(f"tenant:{tenant}")
        self._record_dataset(replace(current, deleted=True))

    # -- placing ----------------------------------------------------------------------------

    def _tenant_policy_of(self, tenant: str) -> TenantPolicy | None:
        return self.tenants.get(tenant, self.policy.default_tenant)

    def _runtime_ms(self, spec: TrainingJob) -> int:
        return (spec.max_runtime_s or self.policy.default_max_runtime_s) * 1000

    def _request(self, job: Job, workers: int | None = None) -> JobRequest:
        spec = job.spec
        if isinstance(spec, TrainingJob):
            shape = training_shape(spec, workers)
            return JobRequest(job.key, job.tenant, shape, job.priority,
                              self._dataset(spec.dataset) if spec.dataset else None,
                              user_region=spec.region,
                              gpu_ms=shape.gpus * self._runtime_ms(spec))
        shape = inference_shape(spec, spec.min_replicas)
        return JobRequest(job.key, job.tenant, shape, job.priority, regions=spec.regions)

    def _context(self, request: JobRequest) -> Context:
        return Context(self.index, self.policy, self.tenants, self.usage, request)

    def _try_place(self, job: Job) -> Outcome:
        spec = job.spec
        request = self._request(job)
        ctx = self._context(request)
        block = quota_block(ctx.tenant_policy, ctx.usage_of(),
                            Request(request.shape.gpus, {}, request.gpu_ms))
        if isinstance(spec, InferenceService):
            if block is not None:
                return Outcome((), block, tuple(rank_clusters(ctx)))
            return place_replicas(ctx, spec.min_replicas)
        if spec.dataset and request.dataset is None:
            return Outcome((), f"dataset {spec.dataset} is not registered (apply its Dataset "
                           "spec)", ())
        outcome = place_gang(ctx) if block is None else Outcome((), block, ())
        if not outcome.placed and block is None and spec.allow_split_across_clusters:
            split = place_split(ctx)
            if split.placed:
                return split
        if not outcome.placed and spec.min_workers < spec.workers:
            unit = request.shape.replica_workers
            fewer = spec.workers - unit
            while fewer >= spec.min_workers:
                smaller = self._request(job, fewer)
                sctx = self._context(smaller)
                if quota_block(sctx.tenant_policy, sctx.usage_of(),
                               Request(smaller.shape.gpus, {}, smaller.gpu_ms)) is None:
                    attempt = place_gang(sctx)
                    if attempt.placed:
                        return replace(attempt, reason=f"elastic: {fewer} of {spec.workers} "
                                       f"workers; " + attempt.reason)
                fewer -= unit
        if not outcome.alternatives and block is not None:
            outcome = Outcome((), block, tuple(rank_clusters(ctx)))
        return outcome

    def _attempt(self, job: Job, failed_shapes: dict[tuple, str] | None) -> bool:
        """Try to place a queued job (preempting if its priority allows); emit a decision when
        it is placed or when its blocking reason changed. True when placed.

        In a queue pass, `failed_shapes` remembers what could not be placed since capacity
        last moved: by the job's whole shape (tenant included), and by its fleet shape alone
        when only fleet-wide filters (capacity, accelerator, region, reachability) ruled it
        out, so a job of the same shape from any tenant is not tried again."""
        keys = self._shape_keys(job)
        if failed_shapes is not None and any(k in failed_shapes for k in keys):
            return False
        outcome = self._try_place(job)
        victims: list[Decision] = []
        may_preempt = failed_shapes is None or self._preemptions_left > 0
        if not outcome.placed and self.policy.preemption and job.priority > 0 and may_preempt:
            if failed_shapes is not None:
                self._preemptions_left -= 1
            preempted = self._preempt_for(job)
            if preempted is not None:
                victims, outcome = preempted
        if not outcome.placed:
            if failed_shapes is not None:
                fleet_only = bool(outcome.alternatives) and all(
                    s.by in FLEET_FILTERS for s in outcome.alternatives if s.rejected)
                failed_shapes[keys[0] if fleet_only else keys[1]] = outcome.reason
            job.phase = "Queued"
            job.condition("Placed", False, outcome.reason, self.now_ms)
            if outcome.reason != job.queued_reason:
                job.queued_reason = outcome.reason
                self._decide(job, "QUEUED", outcome.reason, alternatives=outcome.alternatives)
            self.dirty.add(f"job:{job.key}")
            return False
        self._bind(job, outcome, tuple(v.job for v in victims))
        return True

    def _shape_keys(self, job: Job) -> tuple[tuple, tuple]:
        """(fleet shape, tenant shape): what decides whether a job can be placed, not where;
        jobs with equal keys fail alike."""
        spec = job.spec
        if isinstance(spec, TrainingJob):
            fleet: tuple = ("T", job.priority, spec.accelerator, spec.workers, spec.min_workers,
                            spec.gpus_per_worker, spec.parallelism, spec.communication,
                            spec.allow_split_across_clusters)
            return fleet, (*fleet, job.tenant, spec.dataset, spec.max_runtime_s)
        fleet = ("I", job.priority, spec.accelerator, spec.gpus_per_replica, spec.min_replicas,
                 spec.regions)
        return fleet, (*fleet, job.tenant)

    def _bind(self, job: Job, outcome: Outcome, victims: tuple[str, ...]) -> None:
        spec = job.spec
        if self._bound_floor is None or job.priority < self._bound_floor:
            self._bound_floor = job.priority
        usage = self.usage.setdefault(job.tenant, TenantUsage())
        seq = job.alloc_seq
        for placement in outcome.placements:
            nodes = refs_by_node(placement.gpus)
            job.allocation[placement.cluster_id] = nodes
            job.allocation_changed()
            self.cluster_jobs.setdefault(placement.cluster_id, set()).add(job.key)
            self._count_priority(placement.cluster_id, job.priority, len(placement.gpus))
            for node in nodes:
                self.node_jobs.setdefault(node, set()).add(job.key)
            count = len(placement.gpus)
            usage.gpus += count
            usage.cluster_gpus[placement.cluster_id] = (
                usage.cluster_gpus.get(placement.cluster_id, 0) + count)
            seq += 1
            self._effects.append(AllocationChange(
                job.key, job.tenant, "ALLOCATED", placement.cluster_id, placement.gpus,
                job.priority, seq, self.now_ms, f"placed by decision {self._next_id()}"))
        job.alloc_seq = seq
        job.workers = outcome.workers
        job.placed_ms = self.now_ms
        job.queued_reason = None
        resume = job.resume_from_ms
        if isinstance(spec, TrainingJob):
            job.committed_gpu_ms = job.gpus * self._runtime_ms(spec)
            usage.committed_gpu_ms += job.committed_gpu_ms
            job.limit_end_ms = self.now_ms + self._runtime_ms(spec)
            heapq.heappush(self.limits, (job.limit_end_ms, job.key))
        job.waiting_for = []
        for prewarm in outcome.prewarms:
            ticket = f"{prewarm.dataset_id}@{prewarm.to_cluster}"
            job.waiting_for.append(ticket)
            if ticket not in usage.prewarms:
                usage.prewarms[ticket] = (prewarm.rate_gbps,
                                          self.now_ms + int(prewarm.estimated_s * 1000))
                usage.storage_bytes += prewarm.size_bytes
        self.dirty.add(f"tenant:{job.tenant}")
        self.dirty.add(f"job:{job.key}")
        reason = outcome.reason
        if victims:
            reason = f"after preempting {', '.join(victims)}: " + reason
        if resume is not None:
            reason += f"; resumes from its checkpoint at {resume}"
        decision = self._decide(job, "PLACED", reason, placements=outcome.placements,
                                alternatives=outcome.alternatives, prewarms=outcome.prewarms,
                                victims=victims, resume=resume)
        for prewarm in outcome.prewarms:
            self._effects.append(PrewarmOrder(job.key, job.tenant, decision.decision_id,
                                              self.now_ms, prewarm))
        job.condition("Placed", True, reason, self.now_ms)
        job.condition("Preempted", False, "", self.now_ms)
        if job.waiting_for:
            job.phase = "Placed"
            job.condition("DataReady", False, "waiting for "
                          + ", ".join(job.waiting_for), self.now_ms)
        else:
            self._start(job)

    def _start(self, job: Job) -> None:
        job.phase = "Running"
        job.started_ms = self.now_ms
        job.condition("DataReady", True, "the dataset is in the cluster", self.now_ms)
        job.condition("Running", True, "started" + (
            f" from its checkpoint at {job.resume_from_ms}" if job.resume_from_ms else ""),
            self.now_ms)
        self.dirty.add(f"job:{job.key}")

    def _release(self, job: Job, outcome: str, reason: str, *, preempted_by: str | None = None,
                 ) -> Decision:
        """Free a job's GPUs (one RELEASED allocation record), charge its GPU-hours, and say so
        with a decision."""
        self._pass_wanted = True
        usage = self.usage.setdefault(job.tenant, TenantUsage())
        refs: list[tuple[str, int]] = []
        for cluster_id, nodes in sorted(job.allocation.items()):
            count = 0
            holding = self.cluster_jobs.get(cluster_id)
            if holding is not None:
                holding.discard(job.key)
            self._count_priority(cluster_id, job.priority,
                                 -sum(m.bit_count() for m in nodes.values()))
            for node, mask in sorted(nodes.items()):
                self.index.release(node, mask)
                holders = self.node_jobs.get(node)
                if holders is not None:
                    holders.discard(job.key)
                    if not holders:
                        del self.node_jobs[node]
                count += mask.bit_count()
                refs.extend((node, i) for i in indices_of(mask))
            usage.gpus -= count
            left = usage.cluster_gpus.get(cluster_id, 0) - count
            if left:
                usage.cluster_gpus[cluster_id] = left
            else:
                usage.cluster_gpus.pop(cluster_id, None)
        if job.committed_gpu_ms:
            ran = max(0, min(self.now_ms, job.limit_end_ms or self.now_ms)
                      - (job.placed_ms or self.now_ms))
            usage.consumed_gpu_ms += min(job.committed_gpu_ms, len(refs) * ran)
            usage.committed_gpu_ms -= job.committed_gpu_ms
            job.committed_gpu_ms = 0
        lost = lost_work_s(job, self.now_ms) if job.phase == "Running" else 0.0
        checkpoint = (checkpoint_before(job, self.now_ms)
                      if isinstance(job.spec, TrainingJob) and job.started_ms is not None
                      else job.resume_from_ms)
        seq = job.alloc_seq + 1
        job.alloc_seq = seq
        first_cluster = min(job.allocation) if job.allocation else ""
        # The GPUs are named (the view frees them either way; sinks keep one row per GPU).
        self._effects.append(AllocationChange(job.key, job.tenant, "RELEASED", first_cluster,
                                              tuple(refs), job.priority, seq, self.now_ms,
                                              reason))
        for ticket in job.waiting_for:
            usage.prewarms.pop(ticket, None)
        job.allocation = {}
        job.allocation_changed()
        job.waiting_for = []
        job.limit_end_ms = None
        self.dirty.add(f"job:{job.key}")
        self.dirty.add(f"tenant:{job.tenant}")
        if outcome == "PREEMPTED":
            job.resume_from_ms = checkpoint
            job.started_ms = None
            job.preemptions += 1
            job.phase = "Queued"
            job.queued_reason = None
            job.condition("Running", False, reason, self.now_ms)
            job.condition("Preempted", True, reason, self.now_ms)
            return self._decide(job, "PREEMPTED", reason, preempted_by=preempted_by,
                                resume=checkpoint, lost=round(lost, 3))
        job.condition("Running", False, reason, self.now_ms)
        return self._decide(job, "RELEASED", reason, lost=round(lost, 3) if lost else None)

    def _victims(self, cluster_id: str, below: int) -> list[Victim]:
        """The jobs in a cluster that a job of priority `below` may preempt, by the work each
        would lose, with their GPUs; cached while the cluster and the clock stand still (a
        queue pass asks again and again)."""
        key = (cluster_id, below, self.index.version.get(cluster_id, 0), self.now_ms)
        cached = self._victim_cache.get(key)
        if cached is not None:
            return cached
        now = self.now_ms
        jobs = self.jobs
        out: list[Victim] = []
        for job_key in self.cluster_jobs.get(cluster_id, ()):
            job = jobs[job_key]
            if job.priority >= below:
                continue
            cost = lost_work_s(job, now) if job.phase == "Running" else 0.0
            out.append((cost, job_key, job.allocation[cluster_id]))
        out.sort()  # by loss, then job key (unique), so the masks are never compared
        if len(self._victim_cache) > 64:
            self._victim_cache.clear()
        self._victim_cache[key] = out
        return out

    def _preempt_for(self, job: Job) -> tuple[list[Decision], Outcome] | None:
        """Evict the lower-priority jobs that lose the least work so the job fits; None when no
        eviction makes room (nothing is evicted then)."""
        request = self._request(job)
        filters = tuple(f for f in self.policy.filters if f not in ("capacity", "reservation"))
        ranked = rank_clusters(Context(self.index, replace(self.policy, filters=filters),
                                       self.tenants, self.usage, request))
        best = None
        found = 0
        shape = request.shape
        for score in ranked:
            if score.rejected is not None or found >= self.policy.preemption_clusters:
                break
            held = self.priority_gpus.get(score.cluster_id, {})
            below = sum(n for p, n in held.items() if p < job.priority)
            free = self.index.free_gpus(score.cluster_id, shape.allow_degraded,
                                        shape.accelerator)
            if below + free < shape.gpus:
                continue  # even evicting every lower priority would not make room
            plan = plan_eviction(self.index, score.cluster_id, shape,
                                 self._victims(score.cluster_id, job.priority))
            if plan is None:
                continue
            found += 1
            if best is None or (plan.lost_gpu_s, -score.total) < (best[1].lost_gpu_s,
                                                                   -best[0].total):
                best = (score, plan)
        if best is None:
            return None
        score, plan = best
        decisions = []
        for victim in plan.victims:
            decisions.append(self._release(
                self.jobs[victim], "PREEMPTED",
                f"preempted by {job.key} (priority {job.priority} over "
                f"{self.jobs[victim].priority}) in {score.cluster_id}, freeing "
                f"{', '.join(plan.leaves)}", preempted_by=job.key))
        single = Context(self.index, replace(self.policy, filters=(*filters, "capacity")),
                         self.tenants, self.usage, request)
        if isinstance(job.spec, InferenceService):
            outcome = place_replicas(single, job.spec.min_replicas)
        else:
            outcome = place_gang(replace_request(single))
        # Were the plan and the placement ever to disagree, the victims stay queued and the
        # queue pass places them again.
        return decisions, outcome

    # -- the reconcile loop -----------------------------------------------------------------

    def _tick(self, facts: FleetFacts) -> None:
        if _grew(self.facts, facts):
            self._pass_wanted = True  # some cluster has more usable GPUs than before
        self.facts = facts
        self.index.refresh(facts)
        self._migrate_off_faults()
        self._stop_at_limits()
        self._expire_prewarms()
        if not self._pass_wanted and self._bound_floor is not None and any(
                j.priority > self._bound_floor for j in self.jobs.values()
                if j.phase == "Queued"):
            self._pass_wanted = True  # lower-priority jobs started beside waiting ones
        if self._pass_wanted:
            self._schedule_queue()

    def _migrate_off_faults(self) -> None:
        # Only what the view says is broken moves a job: a node the view does not hold (a shard
        # not restored yet, another instance's shard) is unknown, not lost.
        hit: dict[str, str] = {}
        for node_id in sorted(self.node_jobs):
            lost = self.facts.lost.get(node_id)
            if not lost:
                continue
            for key in sorted(self.node_jobs[node_id]):
                job = self.jobs[key]
                masks = [nodes.get(node_id, 0) for nodes in job.allocation.values()]
                if any(m & lost for m in masks):
                    hit.setdefault(key, self.facts.lost_reason(node_id))
        for key in sorted(hit):
            job = self.jobs[key]
            self._release(job, "PREEMPTED", f"fault: {hit[key]}; migrating from its last "
                          "checkpoint")

    def _stop_at_limits(self) -> None:
        while self.limits and self.limits[0][0] <= self.now_ms:
            end, key = heapq.heappop(self.limits)
            job = self.jobs.get(key)
            if job is None or not job.holds or job.limit_end_ms != end:
                continue  # released or re-placed since
            self._release(job, "RELEASED", "reached its max runtime")
            job.phase = "TimedOut"
            job.condition("Finished", True, "reached its max runtime", self.now_ms)

    def _expire_prewarms(self) -> None:
        # A move's bandwidth is given back once its estimate has passed, even if the mover has
        # not reported it done (the job keeps waiting for the replica).
        for tenant in sorted(self.usage):
            usage = self.usage[tenant]
            done = [t for t, (_, until) in sorted(usage.prewarms.items()) if until <= self.now_ms]
            for ticket in done:
                del usage.prewarms[ticket]
            if done:
                self.dirty.add(f"tenant:{tenant}")
                self._pass_wanted = True

    def queue(self) -> list[Job]:
        """Queued jobs by priority, then submission order (fair share reorders tenants)."""
        return sorted((j for j in self.jobs.values() if j.phase == "Queued"),
                      key=lambda j: (-j.priority, j.order, j.key))

    def _schedule_queue(self) -> None:
        self._pass_wanted = False
        self._bound_floor = None
        self._pass()

    def _pass(self) -> None:
        """One pass over the queue: priorities high to low; within a priority the tenant holding
        the fewest GPUs per unit of share goes next (fair share); within a tenant, FIFO. Jobs
        preempted during the pass have a lower priority and are tried when their level comes.
        At most `pass_attempts` jobs are tried; past that the next TICK goes on."""
        failed: dict[tuple, str] = {}
        budget = self.policy.pass_attempts
        self._preemptions_left = self.policy.pass_preemptions
        for priority in sorted(set(PRIORITIES.values()), reverse=True):
            queues: dict[str, list[Job]] = {}
            for job in self.queue():
                if job.priority == priority:
                    queues.setdefault(job.tenant, []).append(job)
            for q in queues.values():
                q.reverse()
            while queues:
                tenant = min(queues, key=lambda t: (fair_share_key(self.tenants, self.usage, t),
                                                    t))
                job = queues[tenant].pop()
                if not queues[tenant]:
                    del queues[tenant]
                if job.phase != "Queued" or any(k in failed for k in self._shape_keys(job)):
                    continue
                if budget <= 0:
                    self._pass_wanted = True
                    return
                budget -= 1
                # A preemption in the pass frees GPUs only for the preemptor; what failed before
                # it is tried again by the next pass (a release asks for one).
                self._attempt(job, failed)

    # -- decisions --------------------------------------------------------------------------

    def _next_id(self) -> str:
        return f"{self.position}.{self._decisions}"

    def _decide(self, job: Job, outcome: str, reason: str, *,
                placements: tuple[Placement, ...] = (),
                alternatives: tuple[ClusterScore, ...] = (),
                prewarms: tuple[DatasetPrewarm, ...] = (), preempted_by: str | None = None,
                victims: tuple[str, ...] = (), resume: int | None = None,
                lost: float | None = None) -> Decision:
        decision = self._decide_about(job.key, job.tenant, job.kind, outcome, reason,
                                      job.priority, placements=placements,
                                      alternatives=alternatives, prewarms=prewarms,
                                      preempted_by=preempted_by, victims=victims, resume=resume,
                                      lost=lost)
        job.last_decision = decision.decision_id
        job.explanation = decision
        self.dirty.add(f"job:{job.key}")
        return decision

    def _decide_about(self, key: str, tenant: str, kind: str, outcome: str, reason: str,
                      priority: int, **extra: Any) -> Decision:
        decision = Decision(
            decision_id=self._next_id(), job=key, tenant=tenant, kind=kind, outcome=outcome,
            ts=self.now_ms, input_offset=self.position, view_version=self.facts.view_version,
            view_offsets=self.facts.offsets, policy_digest=self.digest, priority=priority,
            reason=reason, placements=extra.get("placements", ()),
            alternatives=extra.get("alternatives", ()), prewarms=extra.get("prewarms", ()),
            preempted_by=extra.get("preempted_by"), victims=extra.get("victims", ()),
            resume_from_checkpoint_ms=extra.get("resume"), lost_gpu_s=extra.get("lost"))
        self._decisions += 1
        self._effects.append(decision)
        return decision


def _payload(request: Mapping[str, Any], what: str) -> Any:
    """The JSON a request carries, or InvalidEventError naming what it should have been."""
    try:
        return json.loads(request["spec_json"] or "null")
    except ValueError as exc:
        raise InvalidEventError(f"{what} is not JSON: {exc}") from None


def _room(facts: FleetFacts) -> dict[str, int]:
    """Usable GPUs per cluster (none in a cluster out of reach), once per observation."""
    cached = facts.memo.get("room")
    if cached is None:
        cached = {}
        for node in facts.nodes.values():
            cached[node.cluster_id] = (cached.get(node.cluster_id, 0)
                                       + (node.healthy | node.degraded).bit_count())
        for cluster_id, cluster in facts.clusters.items():
            if cluster.health not in ("healthy", "degraded"):
                cached[cluster_id] = 0
        facts.memo["room"] = cached
    return cached


def _grew(before: FleetFacts, after: FleetFacts) -> bool:
    old = _room(before)
    return any(n > old.get(c, 0) for c, n in _room(after).items())


def _same_shape(old: Any, new: Any) -> bool:
    """True when only the priority (or labels) changed: the placement can stay."""
    if type(old) is not type(new):
        return False
    strip = {"priority_class": "normal", "metadata": None}
    return replace(old, **strip) == replace(new, **strip)

