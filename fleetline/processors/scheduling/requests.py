"""The scheduler's requests, one handler each: SUBMIT (a spec: the desired state), DELETE,
PROGRESS (a job's checkpoint, finish or failure, from the cluster layer), TENANT_POLICY
(quotas, reservations, share), POLICY (the scheduling pipeline), DATASET_READY (a prewarm
finished), FENCE / UNFENCE (the operations processor drains a node and gives it back),
ENERGY (a cluster's electricity by the hour) and SERVICE_LOAD (a router's measure of a
service, which the autoscaler in `services.py` folds; SUBMIT and DELETE of a service go there
too). TICK is the reconcile loop (`reconcile.py`).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterable, Mapping
from dataclasses import replace
from enum import StrEnum
from typing import Any

from fleetline.errors import FleetlineError, InvalidEventError
from fleetline.observability import traceparent
from fleetline.processors.scheduling import reconcile, services
from fleetline.processors.scheduling.capacity import DatasetFacts
from fleetline.processors.scheduling.decide import (
    attempt,
    release,
    start,
    waiting_reason,
    work_size,
)
from fleetline.processors.scheduling.decisions import decide, decide_about
from fleetline.processors.scheduling.effects import DatasetRecord, EffectLog, Outcome
from fleetline.processors.scheduling.energy import EnergyProfile
from fleetline.processors.scheduling.estimate import Measured, interval_share, measured_key
from fleetline.processors.scheduling.orders import run_order
from fleetline.processors.scheduling.policy import SchedulingPolicy
from fleetline.processors.scheduling.reconcile import schedule_queue
from fleetline.processors.scheduling.specs import (
    Dataset,
    InferenceServiceSpec,
    JobSpec,
    SpecError,
    TrainingJobSpec,
    parse_spec,
)
from fleetline.processors.scheduling.state import (
    TERMINAL,
    Condition,
    Job,
    Phase,
    SchedulerState,
    spec_key,
)
from fleetline.processors.scheduling.tenancy import (
    PRIORITIES,
    Request,
    TenantPolicy,
    TenantUsage,
    quota_block,
)


class RequestKind(StrEnum):
    SUBMIT = "SUBMIT"
    DELETE = "DELETE"
    PROGRESS = "PROGRESS"
    TENANT_POLICY = "TENANT_POLICY"
    POLICY = "POLICY"
    DATASET_READY = "DATASET_READY"
    TICK = "TICK"
    FENCE = "FENCE"
    UNFENCE = "UNFENCE"
    ENERGY = "ENERGY"
    SERVICE_LOAD = "SERVICE_LOAD"
    DATASET_PROGRESS = "DATASET_PROGRESS"


class Progress(StrEnum):
    """What the cluster layer reports of a job."""

    RUNNING = "RUNNING"
    CHECKPOINT = "CHECKPOINT"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


def trace_of(request: Mapping[str, Any]) -> str | None:
    """The trace id in a request's W3C traceparent, if it has a valid one."""
    context = traceparent.parse(request.get("traceparent"))
    return context.trace_id if context else None


def submit(s: SchedulerState, out: EffectLog, request: Mapping[str, Any]) -> None:
    try:
        document = json.loads(request["spec_json"] or "null")
        spec = parse_spec(document)
    except (ValueError, SpecError) as exc:
        decide_about(
            s,
            out,
            request["key"],
            request["tenant"],
            "Unknown",
            Outcome.REJECTED,
            f"the spec does not validate: {exc}",
            0,
        )
        return
    tenant, name = spec.metadata.tenant, spec.metadata.name
    key = spec_key(spec)
    if key != request["key"] or tenant != request["tenant"]:
        decide_about(
            s,
            out,
            request["key"],
            request["tenant"],
            spec.kind,
            Outcome.REJECTED,
            f"the request is keyed {request['key']!r} (tenant "
            f"{request['tenant']!r}) but the spec names {key!r}",
            0,
        )
        return
    if isinstance(spec, Dataset):
        register_dataset(s, out, spec)
        return
    refusal = residency_refusal(s, spec.spec)
    if refusal is not None:
        decide_about(s, out, key, tenant, spec.kind, Outcome.REJECTED, refusal, 0)
        return
    priority = PRIORITIES[spec.spec.priority_class]
    job = s.jobs.get(key)
    if job is not None and job.phase not in TERMINAL:
        if job.kind != spec.kind:
            decide(
                s,
                out,
                job,
                Outcome.REJECTED,
                f"{key} is a {job.kind}; delete it before applying a {spec.kind} of that name",
            )
            return
        if job.document == document:
            return  # applied again unchanged: nothing to do
        if job.is_service:
            assert isinstance(spec.spec, InferenceServiceSpec)
            services.update(s, out, job, document, spec.spec, priority)
            return
        if job.holds and _same_shape(job.spec, spec.spec):
            retold = _retold(job.spec, spec.spec)
            s.respec(job, document, spec.spec, priority)
            s.dirty.add(f"job:{key}")
            if retold and job.ordered_cluster is not None:
                # Its cluster agent tells the running workload (the contract's control file).
                out.add(run_order(s, job, retold))
            return
        if job.holds:
            release(s, out, job, Outcome.RELEASED, "the spec changed; placing it again")
        job.set_spec(document, spec.spec, priority)
        job.phase, job.queued_reason = Phase.QUEUED, None
        job.waiting_for, job.copied = [], {}  # the new spec's data is looked at afresh
        job.deferred_until_ms = None  # a new spec (a new deadline) is deferred afresh
        job.entered_trace = trace_of(request)
        s.dirty.add(f"job:{key}")
    else:
        before = s.jobs.get(key)
        job = Job(
            key,
            tenant,
            name,
            spec.kind,
            document,
            priority,
            s.position,
            s.now_ms,
            alloc_seq=before.alloc_seq if before else 0,
            entered_trace=trace_of(request),
            _spec=spec.spec,
        )
        s.jobs[key] = job
        s.dirty.add(f"job:{key}")
        never = never_fits(s, job)
        if never is not None:
            job.phase = Phase.REJECTED
            job.condition(Condition.ADMITTED, False, never, s.now_ms)
            decide(s, out, job, Outcome.REJECTED, never)
            return
        if job.is_service:
            services.start(s, out, job)
            return
    attempt(s, out, job, None)


def never_fits(s: SchedulerState, job: Job) -> str | None:
    """Why the job could never fit its tenant's quota, even with nothing else running (a
    reason to reject it rather than queue it), or None."""
    spec = job.spec
    if isinstance(spec, TrainingJobSpec):
        gpus = spec.gpus_per_worker * spec.min_workers
        gpu_ms = gpus * s.runtime_ms(spec)
        dataset = s.dataset(spec.dataset) if spec.dataset else None
        if spec.dataset and dataset is not None and dataset.tenant != job.tenant:
            return f"dataset {spec.dataset} belongs to another tenant"
    else:
        gpus, gpu_ms = spec.whole_gpus * spec.min_replicas, 0
    block = quota_block(s.tenant_policy_of(job.tenant), TenantUsage(), Request(gpus, {}, gpu_ms))
    return None if block is None else f"can never fit: {block}"


def delete(s: SchedulerState, out: EffectLog, request: Mapping[str, Any]) -> None:
    key = request["key"]
    if key.startswith("dataset:"):
        delete_dataset(s, out, key.partition(":")[2], request["tenant"])
        return
    job = s.jobs.get(key)
    if job is None or job.phase in TERMINAL:
        return
    who = request.get("actor") or "someone"
    if job.is_service:
        services.delete(s, out, job, f"its service was deleted by {who}")
    if job.holds:
        release(s, out, job, Outcome.RELEASED, f"deleted by {who}")
    job.phase = Phase.DELETED
    job.waiting_for, job.copied = [], {}  # a copy under way goes on: the replica stays useful
    job.condition(Condition.FINISHED, True, f"deleted by {who}", s.now_ms)
    s.dirty.add(f"job:{key}")
    schedule_queue(s, out)


def progress(s: SchedulerState, out: EffectLog, request: Mapping[str, Any]) -> None:
    """A cluster's report on a job. A report naming an epoch (or attempt) other than the one
    the job was last ordered to run is stale: a fenced copy speaking, counted and ignored."""
    job = s.jobs.get(request["key"])
    if job is None or job.phase in TERMINAL:
        return
    phase = request.get("phase")
    if phase not in tuple(Progress):
        raise InvalidEventError(f"{job.key}: unknown progress phase {phase!r}")
    s.dirty.add(f"job:{job.key}")
    epoch, attempt = request.get("epoch"), request.get("attempt")
    # A checkpoint of the current epoch counts whichever attempt wrote it, and after the STOP
    # too (the final checkpoint a preempted workload writes on its way out).
    if epoch is not None and (
        epoch != job.epoch
        or (
            phase != Progress.CHECKPOINT
            and (job.ordered_cluster is None or (attempt is not None and attempt != job.attempt))
        )
    ):
        job.stale_reports += 1
        return
    cluster = request.get("cluster_id") or job.ordered_cluster or "its cluster"
    if (
        phase in (Progress.RUNNING, Progress.SUCCEEDED)
        and job.ordered_cluster is not None
        and cluster != job.ordered_cluster
    ):
        # A split job's other parts: the part with rank 0 speaks for the job's running and
        # its end (it writes the last checkpoint); a failure anywhere fails the whole attempt.
        return
    if phase == Progress.CHECKPOINT:
        if request.get("checkpoint_ms") is not None and (job.holds or epoch is not None):
            job.checkpoint_ms = max(job.checkpoint_ms or 0, int(request["checkpoint_ms"]))
        if request.get("step") is not None:
            job.checkpoint_step = max(job.checkpoint_step or 0, int(request["step"]))
            job.actual = {**job.actual, "checkpoint_step": job.checkpoint_step}
            if epoch == job.epoch and job.holds:
                _measure(s, job, int(request["step"]))
        return
    if phase == Progress.RUNNING:
        if job.holds:
            if job.phase == Phase.STARTING:
                job.phase = Phase.RUNNING
                job.started_ms = s.now_ms
            job.condition(Condition.RUNNING, True, f"{cluster} reports it running", s.now_ms)
            job.actual = {
                **job.actual,
                "state": "Running",
                "cluster": cluster,
                "since_ms": s.now_ms,
                "detail": request.get("detail"),
            }
            _replica_moved(s, job)
        return
    code = request.get("exit_code")
    detail = request.get("detail") or ""
    if phase == Progress.FAILED and epoch is not None and job.holds:
        what = f"attempt {job.attempt} failed" + (
            f" with exit code {code}" if code is not None else ""
        )
        what += f": {detail}" if detail else ""
        if job.spec.retry.retries(code, job.attempt):
            wait = job.spec.retry.backoff_ms(job.attempt)
            job.retry_at_ms = s.now_ms + wait
            heapq.heappush(s.retries, (job.retry_at_ms, job.key))
            job.actual = {**job.actual, "state": "Failed", "since_ms": s.now_ms, "detail": what}
            job.attempt += 1
            job.phase = Phase.STARTING
            job.condition(
                Condition.RUNNING,
                False,
                f"{what}; attempt {job.attempt} of {job.spec.retry.max_attempts} "
                f"in {wait / 1000:g}s",
                s.now_ms,
            )
            return
        reason = (
            f"{what}; no retry left"
            if job.attempt >= job.spec.retry.max_attempts
            else (f"{what}; exit code {code} does not retry")
        )
    else:
        reason = f"the job {phase.lower()}" + (f": {detail}" if detail else "")
    # The release still orders a STOP: the compacted order topic must not keep a RUN for a job
    # that has ended, or an agent restarting would start it again.
    if job.holds:
        release(s, out, job, Outcome.RELEASED, reason, salvage=False)
    job.actual = {**job.actual, "state": phase.title(), "since_ms": s.now_ms, "detail": reason}
    job.phase = Phase.SUCCEEDED if phase == Progress.SUCCEEDED else Phase.FAILED
    job.condition(Condition.FINISHED, True, f"{cluster} reports: {reason}", s.now_ms)
    _replica_moved(s, job)
    schedule_queue(s, out)


def _measure(s: SchedulerState, job: Job, step: int) -> None:
    """A sized job's steps since its last checkpoint report of this epoch, against what its
    chips' peak allowed in that time: the model's measured share of peak (estimate.py)."""
    spec = job.spec
    work = work_size(spec, job.submitted_ms) if isinstance(spec, TrainingJobSpec) else None
    if work is None or not job.allocation:
        return
    mark, job.rate_mark = job.rate_mark, [job.epoch, step, s.now_ms]
    if mark is None or mark[0] != job.epoch:
        return
    facts = s.facts.nodes.get(min(n for placed in job.allocation.values() for n in placed))
    if facts is None:
        return
    capability = s.facts.catalogue.of(facts.accelerator)
    peak = capability.peak(work.precision) if capability is not None else None
    gpus = sum(m.bit_count() for placed in job.allocation.values() for m in placed.values())
    share = interval_share(
        work.pflop_per_step, step - mark[1], (s.now_ms - mark[2]) / 1000, gpus, peak or 0.0
    )
    if share is None:
        return
    key = measured_key(facts.accelerator.model, work.precision)
    found = s.measured.get(key) or Measured()
    s.measured[key] = Measured(
        found.achieved_tflop + share[0], found.peak_tflop + share[1], found.intervals + 1
    )
    s.dirty.add(f"measured:{key}")


def _replica_moved(s: SchedulerState, job: Job) -> None:
    service = s.jobs.get(job.service) if job.service else None
    if service is not None:
        services.refresh(s, service)


def service_load(s: SchedulerState, out: EffectLog, request: Mapping[str, Any]) -> None:
    services.service_load(s, out, request["key"], _payload(request, "a service load"))


def tenant_policy(s: SchedulerState, out: EffectLog, request: Mapping[str, Any]) -> None:
    policy = TenantPolicy.from_data(_payload(request, "tenant policy"))
    if policy.tenant != request["tenant"]:
        raise InvalidEventError(f"tenant policy for {policy.tenant} sent as {request['tenant']}")
    s.tenants[policy.tenant] = policy
    s.dirty.add(f"tenant:{policy.tenant}")
    schedule_queue(s, out)


def scheduling_policy(s: SchedulerState, out: EffectLog, request: Mapping[str, Any]) -> None:
    data = _payload(request, "scheduling policy")
    if not isinstance(data, Mapping):
        raise InvalidEventError("a scheduling policy must be a mapping")
    try:
        s.policy = SchedulingPolicy.from_data(data)
    except FleetlineError as exc:
        raise InvalidEventError(str(exc)) from None
    s.digest = s.policy.digest()
    schedule_queue(s, out)


def _copy_of(s: SchedulerState, request: Mapping[str, Any]) -> tuple[str, DatasetFacts]:
    dataset_id, _, cluster = request["key"].partition("@")
    current = s.dataset(dataset_id)
    if current is None or not cluster:
        raise InvalidEventError(
            f"{request['kind']} for unknown dataset or cluster {request['key']!r}"
        )
    return cluster, current


def _waiting_on(s: SchedulerState, ticket: str) -> list[Job]:
    return [s.jobs[key] for key in sorted(s.jobs) if ticket in s.jobs[key].waiting_for]


def dataset_ready(s: SchedulerState, out: EffectLog, request: Mapping[str, Any]) -> None:
    """The data mover copied a dataset to a cluster: a replica there, and a queue pass at once
    for the jobs that waited for it (it prefers where their data now is)."""
    ticket = request["key"]
    cluster, current = _copy_of(s, request)
    usage = s.usage_of(current.tenant)
    usage.prewarms.pop(ticket, None)
    s.dirty.add(f"tenant:{current.tenant}")
    if cluster not in current.replicas:
        own = s.datasets.get(current.dataset_id)
        record_dataset(
            s,
            out,
            DatasetRecord(
                current.dataset_id,
                current.tenant,
                0,
                0,
                current.size_bytes,
                tuple(sorted({*current.replicas, cluster})),
                residency=current.residency,
                source=own.source if own is not None else None,
                sensitive_fields=own.sensitive_fields if own is not None else (),
            ),
        )
    for job in _waiting_on(s, ticket):
        job.waiting_for.remove(ticket)
        job.copied.pop(ticket, None)
        s.dirty.add(f"job:{job.key}")
        if job.waiting_for:
            job.queued_reason = waiting_reason(job.waiting_for, job.copied)
            continue
        job.condition(Condition.DATA_READY, True, f"the dataset is in {cluster}", s.now_ms)
        job.queued_reason = None
        if job.holds:  # placed before it waited (a snapshot from before GPU-less prewarms)
            start(s, out, job)
    schedule_queue(s, out)


def dataset_progress(s: SchedulerState, out: EffectLog, request: Mapping[str, Any]) -> None:
    """How far the data mover is with a copy ({"copied_bytes", "total_bytes"}), or why it gave
    up ({"error"}): the waiting jobs say so. A failed copy gives its bandwidth back; its jobs
    wait until the dataset is applied again (its objects mended), which orders it afresh."""
    ticket = request["key"]
    _, current = _copy_of(s, request)
    report = _payload(request, "dataset progress")
    if not isinstance(report, Mapping):
        raise InvalidEventError("a dataset progress report must be a mapping")
    error = report.get("error")
    if error is None:
        copied, total = report.get("copied_bytes"), report.get("total_bytes")
        if not (isinstance(copied, int) and isinstance(total, int) and 0 <= copied <= total):
            raise InvalidEventError("dataset progress needs 0 <= copied_bytes <= total_bytes")
        fraction = copied / total if total else 1.0
    else:
        s.usage_of(current.tenant).prewarms.pop(ticket, None)
        s.dirty.add(f"tenant:{current.tenant}")
    for job in _waiting_on(s, ticket):
        s.dirty.add(f"job:{job.key}")
        if error is None:
            job.copied[ticket] = fraction
            job.queued_reason = waiting_reason(job.waiting_for, job.copied)
        else:
            job.queued_reason = (
                f"the copy of {ticket} failed: {error}; apply dataset {current.dataset_id} "
                "again once its objects are mended"
            )
        job.condition(Condition.DATA_READY, False, job.queued_reason, s.now_ms)


def record_dataset(s: SchedulerState, out: EffectLog, record: DatasetRecord) -> None:
    record = replace(record, seq=s.position + 1, ts=s.now_ms)
    s.datasets[record.dataset_id] = record
    s.dirty.add(f"dataset:{record.dataset_id}")
    out.add(record)


def register_dataset(s: SchedulerState, out: EffectLog, spec: Dataset) -> None:
    tenant, name = spec.metadata.tenant, spec.metadata.name
    current = s.dataset(name)
    usage = s.usage_of(tenant)
    before = current.size_bytes * len(current.replicas) if current else 0
    after = spec.spec.size_bytes * len(spec.spec.replicas)
    refusal = (
        f"dataset {name} belongs to another tenant"
        if current is not None and current.tenant != tenant
        else quota_block(
            s.tenant_policy_of(tenant), usage, Request(storage_bytes=max(0, after - before))
        )
    )
    if refusal is None:
        outside = outside_residency(s, spec.spec.replicas, spec.spec.residency)
        refusal = f"spec.replicas: {outside}" if outside else None
    if refusal is not None:
        decide_about(s, out, f"dataset:{name}", tenant, "Dataset", Outcome.REJECTED, refusal, 0)
        return
    usage.storage_bytes += after - before
    s.dirty.add(f"tenant:{tenant}")
    s.pass_wanted = True
    for key in sorted(s.jobs):
        job = s.jobs[key]
        stalled = [
            t for t in job.waiting_for if t.startswith(f"{name}@") and t not in usage.prewarms
        ]
        if stalled and not job.holds:
            job.waiting_for = [t for t in job.waiting_for if t not in stalled]
            job.copied = {}
            job.queued_reason = None
            s.dirty.add(f"job:{key}")
    record_dataset(
        s,
        out,
        DatasetRecord(
            name,
            tenant,
            0,
            0,
            spec.spec.size_bytes,
            tuple(sorted(spec.spec.replicas)),
            residency=tuple(spec.spec.residency),
            source=spec.spec.source,
            sensitive_fields=tuple(spec.spec.sensitive_fields),
        ),
    )
    decide_about(
        s,
        out,
        f"dataset:{name}",
        tenant,
        "Dataset",
        Outcome.ACCEPTED,
        f"{spec.spec.size_bytes} bytes in {len(spec.spec.replicas)} replica(s); "
        f"tenant {tenant} stores {usage.storage_bytes} bytes",
        0,
    )


def residency_refusal(s: SchedulerState, spec: object) -> str | None:
    """Why a training job may not have its dataset where it asks for it (its `region` outside
    the dataset's residency; federated over a dataset that declares none), or None."""
    if not isinstance(spec, TrainingJobSpec) or not spec.dataset:
        return None
    dataset = s.dataset(spec.dataset)
    if spec.federated is not None and dataset is not None and not dataset.residency:
        return (
            f"spec.federated: dataset {spec.dataset} declares no residency; a federated job "
            "trains in each region its data must stay in (give the Dataset a residency)"
        )
    if spec.region is None:
        return None
    if dataset is None or not dataset.residency or spec.region in dataset.residency:
        return None
    return (
        f"spec.region: {spec.region} is outside the residency of dataset {spec.dataset} "
        f"({', '.join(dataset.residency)}): its data may not leave those regions"
    )


def outside_residency(
    s: SchedulerState, clusters: Iterable[str], residency: Iterable[str]
) -> str | None:
    """Why a dataset's replicas break its residency (a cluster outside its regions), or None;
    a cluster the scheduler has not seen yet is judged when a job would use it."""
    regions = tuple(residency)
    if not regions:
        return None
    for cluster_id in clusters:
        facts = s.facts.clusters.get(cluster_id)
        if facts is not None and facts.region not in regions:
            return (
                f"a replica in {cluster_id} (region {facts.region}) is outside its residency "
                f"({', '.join(regions)})"
            )
    return None


def delete_dataset(s: SchedulerState, out: EffectLog, name: str, tenant: str) -> None:
    current = s.datasets.get(name)
    if current is None or current.deleted or current.tenant != tenant:
        return
    usage = s.usage_of(tenant)
    usage.storage_bytes -= current.size_bytes * len(current.replicas)
    s.dirty.add(f"tenant:{tenant}")
    record_dataset(s, out, replace(current, deleted=True))


def fence_node(s: SchedulerState, out: EffectLog, request: Mapping[str, Any]) -> None:
    node_id = request["key"]
    if not node_id:
        raise InvalidEventError("FENCE needs the node as its key")
    reconcile.fence(s, out, node_id, request.get("detail") or "fenced by operations")


def unfence_node(s: SchedulerState, out: EffectLog, request: Mapping[str, Any]) -> None:
    if not request["key"]:
        raise InvalidEventError("UNFENCE needs the node as its key")
    reconcile.unfence(s, request["key"])


def energy_profile(s: SchedulerState, out: EffectLog, request: Mapping[str, Any]) -> None:
    """A cluster's electricity by the hour; from now on placement and deferral price by it."""
    profile = EnergyProfile.from_data(_payload(request, "an energy profile"))
    if profile.cluster_id != request["key"]:
        raise InvalidEventError(
            f"ENERGY keyed {request['key']!r} carries the profile of {profile.cluster_id!r}"
        )
    s.energy[profile.cluster_id] = profile
    s.pass_wanted = True


def _payload(request: Mapping[str, Any], what: str) -> Any:
    """The JSON a request carries, or InvalidEventError naming what it should have been."""
    try:
        return json.loads(request["spec_json"] or "null")
    except ValueError as exc:
        raise InvalidEventError(f"{what} is not JSON: {exc}") from None


def _retold(old: JobSpec, new: JobSpec) -> str | None:
    """What a running workload must be told again of a spec change that keeps its placement
    (a tuned checkpoint interval), or None."""
    if (
        isinstance(old, TrainingJobSpec)
        and isinstance(new, TrainingJobSpec)
        and old.checkpoint_interval_s != new.checkpoint_interval_s
    ):
        return f"checkpoint interval {old.checkpoint_interval_s} s -> {new.checkpoint_interval_s} s"
    return None


def _same_shape(old: JobSpec, new: JobSpec) -> bool:
    """True when only the priority or the checkpoint interval changed (labels are metadata;
    a tuned interval counts from the job's next checkpoint): the placement can stay."""
    if type(old) is not type(new):
        return False
    strip: dict[str, Any] = {"priority_class": "normal"}
    if isinstance(old, TrainingJobSpec):
        strip["checkpoint_interval_s"] = 1800
    return old.model_copy(update=strip) == new.model_copy(update=strip)
