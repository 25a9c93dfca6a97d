"""The scheduler's decisions: try to place a job (preempting where its priority allows), bind
it to the GPUs found, release it, and say every time what was decided and why.

Each function takes the state (`SchedulerState`, mutated in place) and the step's `EffectLog`,
where it appends its decisions, allocation records and prewarm orders. Nothing here reads a
clock: time is `state.now_ms`, the requests' event time.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from fleetline.processors.scheduling.capacity import Gang, indices_of, usable_gpus
from fleetline.processors.scheduling.decisions import decide
from fleetline.processors.scheduling.effects import (
    AllocationChange,
    AllocationKind,
    Decision,
    EffectLog,
    Outcome,
    PrewarmOrder,
)
from fleetline.processors.scheduling.energy import best_start
from fleetline.processors.scheduling.estimate import DEFAULT_PRECISION, WorkSize
from fleetline.processors.scheduling.orders import order_run, order_stop
from fleetline.processors.scheduling.pipeline import (
    Attempt,
    ClusterScore,
    Context,
    DatasetPrewarm,
    JobRequest,
    place_federated,
    place_gang,
    place_replicas,
    place_split,
    rank_clusters,
    replace_request,
    unreserve,
)
from fleetline.processors.scheduling.placement import (
    inference_shape,
    refs_by_node,
    to_placement,
    training_shape,
)
from fleetline.processors.scheduling.policy import FLEET_FILTERS
from fleetline.processors.scheduling.preemption import Victims, plan_eviction
from fleetline.processors.scheduling.specs import (
    InferenceServiceSpec,
    TrainingJobSpec,
    dataset_prefix,
)
from fleetline.processors.scheduling.state import (
    Condition,
    Job,
    Phase,
    SchedulerState,
    checkpoint_before,
    lost_work_s,
)
from fleetline.processors.scheduling.tenancy import Request, quota_block

# A job's shape as far as whether it can be placed goes, not where: (fleet shape, tenant shape).
ShapeKey = tuple[Any, ...]


def request_for(
    s: SchedulerState,
    job: Job,
    workers: int | None = None,
    regions: tuple[str, ...] | None = None,
    data_only: bool = False,
) -> JobRequest:
    spec = job.spec
    if isinstance(spec, TrainingJobSpec):
        shape = training_shape(spec, workers)
        resumes_on = None
        if not spec.portable and job.ran_on and job.checkpoint_ms is not None:
            # Its checkpoint resumes on the chip that wrote it, unless the spec allows another.
            resumes_on = job.ran_on
            shape = replace(shape, accelerators=(job.ran_on,))
        return JobRequest(
            job.key,
            job.tenant,
            shape,
            job.priority,
            s.dataset(spec.dataset) if spec.dataset else None,
            user_region=spec.region,
            gpu_ms=shape.gpus * s.runtime_ms(spec),
            pool_keep=_pool_keep(s),
            data_only=data_only,
            work=work_size(spec, job.submitted_ms),
            resumes_on=resumes_on,
        )
    # One replica: each replica of a service is a job of its own.
    return JobRequest(
        job.key,
        job.tenant,
        inference_shape(spec, 1),
        job.priority,
        regions=regions or spec.regions,
        user_region=(regions or spec.regions)[0],
        spread=_sibling_spread(s, job),
        pool_room=_pool_room(s),
    )


def work_size(spec: TrainingJobSpec, submitted_ms: int) -> WorkSize | None:
    if spec.work is None:
        return None
    return WorkSize(
        spec.work.pflop_per_step,
        spec.work.steps,
        spec.precision or DEFAULT_PRECISION,
        spec.work.deadline_ms(submitted_ms),
    )


def inference_gpus(s: SchedulerState) -> dict[str, int]:
    """GPUs held by service replicas, per cluster: each cluster's inference pool as it is."""
    # Every bind and release moves the index's versions; a share beside others moves `shared`.
    state = (
        id(s.index),
        tuple(sorted(s.index.version.items())),
        sum(len(holders) for holders in s.shared.values()),
    )
    if s.inference_cache is not None and s.inference_cache[0] == state:
        return s.inference_cache[1]
    held: dict[str, int] = {}
    for cluster_id, keys in s.cluster_jobs.items():
        for job_key in keys:
            job = s.jobs[job_key]
            if job.service is not None:
                held[cluster_id] = held.get(cluster_id, 0) + sum(
                    m.bit_count() for m in job.allocation.get(cluster_id, {}).values()
                )
    s.inference_cache = (state, held)
    return held


def _pool_room(s: SchedulerState) -> dict[str, int] | None:
    """GPUs replicas may still take per cluster under its pool's max_share (None: unbounded)."""
    if not s.policy.inference_pools:
        return None
    held = inference_gpus(s)
    return {
        c: int(s.policy.pool_of(c).max_share * total) - held.get(c, 0)
        for c, total in usable_gpus(s.facts).items()
    }


def _pool_keep(s: SchedulerState) -> dict[str, int] | None:
    """GPUs training must leave free per cluster for its pool's min_gpus (None: none kept)."""
    if not s.policy.inference_pools:
        return None
    held = inference_gpus(s)
    return {c: max(0, s.policy.pool_of(c).min_gpus - held.get(c, 0)) for c in usable_gpus(s.facts)}


def _sibling_spread(s: SchedulerState, job: Job) -> dict[str, int]:
    """The service's other replicas per cluster (the spread scorer keeps them apart)."""
    service = s.jobs.get(job.service or "")
    spread: dict[str, int] = {}
    for key in service.scaling.get("replicas", ()) if service else ():
        sibling = s.jobs.get(key)
        if sibling is not None and key != job.key:
            for cluster_id in sibling.allocation:
                spread[cluster_id] = spread.get(cluster_id, 0) + 1
    return spread


def replica_regions(job: Job) -> list[tuple[str, ...] | None]:
    """The regions a placement tries in turn: a replica its service's preference order (its
    demand's region first), one region at a time; any other job, once, anywhere it may go."""
    if job.service is None:
        return [None]
    spec = job.spec
    assert isinstance(spec, InferenceServiceSpec)
    return [(r,) for r in job.scaling.get("regions") or spec.regions]


def context(s: SchedulerState, request: JobRequest) -> Context:
    return Context(
        s.index,
        s.policy,
        s.tenants,
        s.usage,
        request,
        now_ms=s.now_ms,
        energy=s.energy,
        measured=s.measured,
    )


def try_place(s: SchedulerState, job: Job, regions: tuple[str, ...] | None = None) -> Attempt:
    """Where the job would go now (reserved in the index when it fits), without preempting."""
    spec = job.spec
    request = request_for(s, job, regions=regions)
    ctx = context(s, request)
    block = quota_block(
        ctx.tenant_policy, ctx.usage_of(), Request(request.shape.gpus, {}, request.gpu_ms)
    )
    if isinstance(spec, InferenceServiceSpec):
        if block is not None:
            return Attempt((), block, tuple(rank_clusters(ctx)))
        if spec.share_eighths is not None:
            beside = place_share(s, ctx, spec.share_eighths)
            if beside is not None:
                return beside
        return place_replicas(ctx, 1)
    if spec.dataset and request.dataset is None:
        return Attempt((), f"dataset {spec.dataset} is not registered (apply its Dataset spec)", ())
    if spec.federated is not None:
        return place_federated(ctx)
    attempt = place_gang(ctx) if block is None else Attempt((), block, ())
    if not attempt.placed and block is None and spec.allow_split_across_clusters:
        split = place_split(ctx)
        if split.placed:
            return split
    if not attempt.placed and spec.min_workers < spec.workers:
        unit = request.shape.replica_workers
        fewer = spec.workers - unit
        while fewer >= spec.min_workers:
            smaller = request_for(s, job, fewer)
            sctx = context(s, smaller)
            if (
                quota_block(
                    sctx.tenant_policy,
                    sctx.usage_of(),
                    Request(smaller.shape.gpus, {}, smaller.gpu_ms),
                )
                is None
            ):
                elastic = place_gang(sctx)
                if elastic.placed:
                    return replace(
                        elastic,
                        reason=f"elastic: {fewer} of {spec.workers} workers; " + elastic.reason,
                    )
            fewer -= unit
    if not attempt.alternatives and block is not None:
        attempt = Attempt((), block, tuple(rank_clusters(ctx)))
    return attempt


def place_share(s: SchedulerState, ctx: Context, eighths: int) -> Attempt | None:
    """A replica's share of a GPU other replicas already share, where it fits (the fullest such
    GPU first, in the clusters the pipeline allows, best scored first); None when there is
    none, and the replica takes a GPU of its own to share."""
    scores = rank_clusters(ctx)
    # A shared GPU adds nothing to a cluster's pool and needs no free GPU: those two filters'
    # verdicts do not apply to it.
    allowed = [c.cluster_id for c in scores if c.rejected is None or c.by in ("capacity", "pool")]
    for cluster_id in allowed:
        best: tuple[int, str, int] | None = None
        for (cluster, node, gpu), holders in s.shared.items():
            used = sum(holders.values())
            facts = s.facts.nodes.get(node)
            if (
                cluster != cluster_id
                or used + eighths > 8
                or facts is None
                or not facts.schedulable
                or not (facts.healthy | facts.degraded) >> gpu & 1
                or not ctx.request.shape.matches(facts.accelerator, ctx.index.facts.catalogue)
            ):
                continue
            if best is None or (-used, node, gpu) < (-best[0], best[1], best[2]):
                best = (used, node, gpu)
        if best is None:
            continue
        used, node, gpu = best
        leaf = s.facts.nodes[node].leaf
        gang = Gang(cluster_id, ((node, 1 << gpu),), (leaf,), 0)
        placement = to_placement(gang, ctx.request.shape, ctx.index)
        beside = ", ".join(sorted(s.shared[(cluster_id, node, gpu)]))
        return Attempt(
            (placement,),
            f"{eighths}/8 of {node}/{gpu} in {cluster_id}, beside {beside} ({used}/8 taken)",
            _shown_scores(ctx, scores),
            (),
            1,
        )
    return None


def _shown_scores(ctx: Context, scores: list[ClusterScore]) -> tuple[ClusterScore, ...]:
    return tuple(c for c in scores if c.rejected is None)[: ctx.policy.alternatives]


def shape_keys(job: Job) -> tuple[ShapeKey, ShapeKey]:
    """(fleet shape, tenant shape): what decides whether a job can be placed, not where; jobs
    with equal keys fail alike."""
    spec = job.spec
    if isinstance(spec, TrainingJobSpec):
        fleet: ShapeKey = (
            "T",
            job.priority,
            spec.accelerators,
            spec.min_gpu_memory_mib,
            spec.workers,
            spec.min_workers,
            spec.gpus_per_worker,
            spec.parallelism,
            spec.communication,
            spec.allow_split_across_clusters,
        )
        return fleet, (*fleet, job.tenant, spec.dataset, spec.max_runtime_s)
    fleet = (
        "I",
        job.priority,
        spec.accelerators,
        spec.min_gpu_memory_mib,
        spec.gpus_per_replica,
        tuple(replica_regions(job)),
    )
    return fleet, (*fleet, job.tenant)


def attempt(
    s: SchedulerState, out: EffectLog, job: Job, failed_shapes: dict[ShapeKey, str] | None
) -> bool:
    """Try to place a queued job (preempting if its priority allows); decide when it is placed
    or when its blocking reason changed. True when placed.

    In a queue pass, `failed_shapes` remembers what could not be placed since capacity last
    moved: by the job's whole shape (tenant included), and by its fleet shape alone when only
    fleet-wide filters (capacity, accelerator, region, reachability) ruled it out, so a job of
    the same shape from any tenant is not tried again."""
    keys = shape_keys(job)
    if failed_shapes is not None and any(k in failed_shapes for k in keys):
        return False
    if defer(s, out, job):
        return False
    victims: list[Decision] = []
    why: list[str] = []
    # A replica tries its regions in turn, preempting in one before it looks at the next: a
    # scale-out stays in the region its demand comes from until that region's pool is full.
    for regions in replica_regions(job):
        placed = try_place(s, job, regions)
        # (A federated job's participants are placed together or not at all: no eviction
        # plan covers every region yet.)
        may_preempt = (failed_shapes is None or s.preemptions_left > 0) and not (
            isinstance(job.spec, TrainingJobSpec) and job.spec.federated is not None
        )
        # Copying a dataset is the last resort: a job that may preempt is placed where its data
        # is, evicting lower priorities there, before its data is sent after free GPUs (which
        # others may take while it copies).
        copies = placed.placed and bool(placed.prewarms)
        if (
            (not placed.placed or copies)
            and s.policy.preemption
            and job.priority > 0
            and may_preempt
        ):
            if failed_shapes is not None:
                s.preemptions_left -= 1
            preempted = preempt_for(s, out, job, regions, data_only=copies)
            if preempted is not None:
                if copies:
                    unreserve(s.index, placed.placements)
                victims, placed = preempted
        if placed.placed:
            break
        why.append(f"{regions[0]}: {placed.reason}" if regions else placed.reason)
    if not placed.placed:
        placed = replace(placed, reason="; ".join(why))
        if failed_shapes is not None:
            fleet_only = bool(placed.alternatives) and all(
                score.by in FLEET_FILTERS for score in placed.alternatives if score.rejected
            )
            failed_shapes[keys[0] if fleet_only else keys[1]] = placed.reason
        job.phase = Phase.QUEUED
        job.condition(Condition.PLACED, False, placed.reason, s.now_ms)
        if placed.reason != job.queued_reason:
            job.queued_reason = placed.reason
            decide(s, out, job, Outcome.QUEUED, placed.reason, alternatives=placed.alternatives)
        s.dirty.add(f"job:{job.key}")
        return False
    if placed.prewarms:
        stage(s, out, job, placed)
        return False
    bind(s, out, job, placed, tuple(v.job for v in victims))
    return True


def defer(s: SchedulerState, out: EffectLog, job: Job) -> bool:
    """Hold a deferrable job until the cheapest window before its deadline (chosen once, at its
    first attempt, over the clusters that have its accelerator); True while it waits."""
    spec = job.spec
    if not isinstance(spec, TrainingJobSpec) or spec.deferrable is None:
        return False
    if job.deferred_until_ms is None:
        shape = training_shape(spec, spec.workers)
        candidates = [
            c
            for cluster_id, c in sorted(s.facts.clusters.items())
            if c.health.takes_work
            and any(shape.matches(m, s.facts.catalogue) for m in s.index.models(cluster_id))
        ]
        deferral = best_start(
            s.now_ms,
            spec.deferrable.deadline_ms,
            spec.deferrable.expected_runtime * 1000,
            candidates,
            s.energy,
            s.policy.renewable_weight,
            s.policy.energy_min_saving,
            s.policy.deferral_slack_s * 1000,
        )
        job.deferred_until_ms = deferral.start_ms if deferral else s.now_ms
        s.dirty.add(f"job:{job.key}")
        if deferral is not None:
            heapq.heappush(s.deferrals, (deferral.start_ms, job.key))
            reason = deferral.reason()
            job.queued_reason = reason
            job.condition(Condition.PLACED, False, reason, s.now_ms)
            decide(s, out, job, Outcome.QUEUED, reason)
    return job.deferred_until_ms > s.now_ms


def bind(
    s: SchedulerState, out: EffectLog, job: Job, placed: Attempt, victims: tuple[str, ...]
) -> None:
    """Give the job the GPUs it was placed on: allocation records, quota usage, its time
    limit and prewarms, and the decision that says so."""
    spec = job.spec
    if s.bound_floor is None or job.priority < s.bound_floor:
        s.bound_floor = job.priority
    usage = s.usage_of(job.tenant)
    seq = job.alloc_seq
    share = spec.share_eighths if isinstance(spec, InferenceServiceSpec) else None
    for placement in placed.placements:
        nodes = refs_by_node(placement.gpus)
        job.allocation[placement.cluster_id] = nodes
        first = s.facts.nodes.get(min(nodes))
        if first is not None:
            job.ran_on = first.accelerator.model
        if share is not None:
            job.scaling["share"] = share
            for node, mask in nodes.items():
                key = (placement.cluster_id, node, mask.bit_length() - 1)
                s.shared.setdefault(key, {})[job.key] = share
        job.allocation_changed()
        s.hold(placement.cluster_id, job, len(placement.gpus))
        for node in nodes:
            s.node_jobs.setdefault(node, set()).add(job.key)
        count = len(placement.gpus)
        usage.gpus += count
        usage.cluster_gpus[placement.cluster_id] = (
            usage.cluster_gpus.get(placement.cluster_id, 0) + count
        )
        seq += 1
        out.add(
            AllocationChange(
                job.key,
                job.tenant,
                AllocationKind.ALLOCATED,
                placement.cluster_id,
                placement.gpus,
                job.priority,
                seq,
                s.now_ms,
                f"placed by decision {out.next_id()}",
                share,
            )
        )
    job.alloc_seq = seq
    job.workers = placed.workers
    job.placed_ms = s.now_ms
    job.queued_reason = None
    resume = job.resume_from_ms
    if isinstance(spec, TrainingJobSpec):
        job.committed_gpu_ms = job.gpus * s.runtime_ms(spec)
        usage.committed_gpu_ms += job.committed_gpu_ms
        job.limit_end_ms = s.now_ms + s.runtime_ms(spec)
        heapq.heappush(s.limits, (job.limit_end_ms, job.key))
    job.waiting_for = []
    s.dirty.add(f"tenant:{job.tenant}")
    s.dirty.add(f"job:{job.key}")
    reason = placed.reason
    if victims:
        reason = f"after preempting {', '.join(victims)}: " + reason
    if resume is not None:
        reason += f"; resumes from its checkpoint at {resume}"
    decide(
        s,
        out,
        job,
        Outcome.PLACED,
        reason,
        placements=placed.placements,
        alternatives=placed.alternatives,
        victims=victims,
        resume_from_checkpoint_ms=resume,
    )
    job.condition(Condition.PLACED, True, reason, s.now_ms)
    job.condition(Condition.PREEMPTED, False, "", s.now_ms)
    start(s, out, job)


def stage(s: SchedulerState, out: EffectLog, job: Job, placed: Attempt) -> None:
    """The job's data is not where it would run: order the copies and keep the job Queued,
    holding no GPUs, until every copy is done (DATASET_READY); then a queue pass places it,
    where the data now is. A copy already under way for another job is not ordered again."""
    unreserve(s.index, placed.placements)
    usage = s.usage_of(job.tenant)
    job.waiting_for = [f"{p.dataset_id}@{p.to_cluster}" for p in placed.prewarms]
    fresh = []
    for prewarm, ticket in zip(placed.prewarms, job.waiting_for, strict=True):
        if ticket not in usage.prewarms:
            usage.prewarms[ticket] = (prewarm.rate_gbps, s.now_ms + int(prewarm.estimated_s * 1000))
            usage.storage_bytes += prewarm.size_bytes
            fresh.append(prewarm)
    s.dirty.add(f"tenant:{job.tenant}")
    s.dirty.add(f"job:{job.key}")
    job.phase = Phase.QUEUED
    job.queued_reason = waiting_reason(job.waiting_for, {})
    job.condition(Condition.PLACED, False, job.queued_reason, s.now_ms)
    job.condition(Condition.DATA_READY, False, job.queued_reason, s.now_ms)
    decision = decide(
        s,
        out,
        job,
        Outcome.QUEUED,
        f"{job.queued_reason} before it is placed: {placed.reason}",
        alternatives=placed.alternatives,
        prewarms=placed.prewarms,
    )
    for prewarm in fresh:
        out.add(
            PrewarmOrder(
                job.key,
                job.tenant,
                decision.decision_id,
                s.now_ms,
                prewarm,
                dataset_prefix_of(s, prewarm.dataset_id),
                masked_in(s, prewarm),
            )
        )


def masked_in(s: SchedulerState, prewarm: DatasetPrewarm) -> tuple[str, ...]:
    """The dataset's sensitive fields when the copy leaves the source's region, else ()."""
    own = s.datasets.get(prewarm.dataset_id)
    if own is None or not own.sensitive_fields or prewarm.from_cluster is None:
        return ()
    source = s.facts.clusters.get(prewarm.from_cluster)
    target = s.facts.clusters.get(prewarm.to_cluster)
    if source is not None and target is not None and source.region == target.region:
        return ()
    return own.sensitive_fields


def waiting_reason(tickets: list[str], copied: Mapping[str, float]) -> str:
    """'waiting for data in C: 42 %' for each copy a job waits for (`copied`: the fraction
    done by ticket, as the data mover last reported)."""
    parts = []
    for ticket in tickets:
        dataset_id, _, cluster = ticket.partition("@")
        parts.append(f"{cluster}: {int(copied.get(ticket, 0.0) * 100)} % of {dataset_id}")
    return "waiting for data in " + ", ".join(parts)


def dataset_prefix_of(s: SchedulerState, dataset_id: str) -> str:
    """Where a dataset's objects are: its spec's `source`, else its tenant's default place."""
    own = s.datasets.get(dataset_id)
    if own is not None:
        return dataset_prefix(own.tenant, dataset_id, own.source)
    known = s.dataset(dataset_id)  # known from the view alone: the default place
    return dataset_prefix(known.tenant if known is not None else "", dataset_id)


def start(s: SchedulerState, out: EffectLog, job: Job) -> None:
    """The job has its GPUs and its data: order its cluster to run it (it is Running once the
    cluster says so), or, for a service no agent starts, take it as running."""
    job.condition(Condition.DATA_READY, True, "the dataset is in the cluster", s.now_ms)
    s.dirty.add(f"job:{job.key}")
    if job.carried_out:
        job.epoch = job.alloc_seq
        job.attempt = 1
        job.retry_at_ms = None
        job.phase = Phase.STARTING
        order_run(s, out, job)
        return
    job.phase = Phase.RUNNING
    job.started_ms = s.now_ms
    job.condition(
        Condition.RUNNING,
        True,
        "started (no workload to start: no agent reports on it)"
        + (f" from its checkpoint at {job.resume_from_ms}" if job.resume_from_ms else ""),
        s.now_ms,
    )


def _unshared(s: SchedulerState, job: Job, cluster_id: str, node: str, mask: int) -> int:
    """The GPUs of `mask` a releasing job frees: all of them, but a shared GPU only when the
    job was the last replica holding a share of it."""
    if job.scaling.get("share") is None:
        return mask
    key = (cluster_id, node, mask.bit_length() - 1)
    holders = s.shared.get(key, {})
    holders.pop(job.key, None)
    if holders:
        return 0
    s.shared.pop(key, None)
    return mask


def release(
    s: SchedulerState,
    out: EffectLog,
    job: Job,
    outcome: Outcome,
    reason: str,
    *,
    preempted_by: str | None = None,
    salvage: bool = True,
) -> Decision:
    """Free a job's GPUs (one RELEASED allocation record), charge its GPU-hours, and say so
    with a decision (PREEMPTED puts it back in the queue, to resume from its checkpoint), and
    order its cluster to stop the workload."""
    s.pass_wanted = True
    usage = s.usage_of(job.tenant)
    refs: list[tuple[str, int]] = []
    for cluster_id, nodes in sorted(job.allocation.items()):
        count = 0
        s.unhold(cluster_id, job, sum(m.bit_count() for m in nodes.values()))
        for node, mask in sorted(nodes.items()):
            s.index.release(node, _unshared(s, job, cluster_id, node, mask))
            holders = s.node_jobs.get(node)
            if holders is not None:
                holders.discard(job.key)
                if not holders:
                    del s.node_jobs[node]
            count += mask.bit_count()
            refs.extend((node, i) for i in indices_of(mask))
        usage.gpus -= count
        left = usage.cluster_gpus.get(cluster_id, 0) - count
        if left:
            usage.cluster_gpus[cluster_id] = left
        else:
            usage.cluster_gpus.pop(cluster_id, None)
    if job.committed_gpu_ms:
        ran = max(0, min(s.now_ms, job.limit_end_ms or s.now_ms) - (job.placed_ms or s.now_ms))
        usage.consumed_gpu_ms += min(job.committed_gpu_ms, len(refs) * ran)
        usage.committed_gpu_ms -= job.committed_gpu_ms
        job.committed_gpu_ms = 0
    # `salvage`: the workload may checkpoint on its way out (preempted, deleted); off a fault or
    # a lost cluster there is nothing sound left to checkpoint from.
    order_stop(s, out, job, reason, final=salvage)
    lost = lost_work_s(job, s.now_ms) if job.phase == Phase.RUNNING else 0.0
    checkpoint = (
        checkpoint_before(job, s.now_ms)
        if isinstance(job.spec, TrainingJobSpec) and job.started_ms is not None
        else job.resume_from_ms
    )
    seq = job.alloc_seq + 1
    job.alloc_seq = seq
    first_cluster = min(job.allocation) if job.allocation else ""
    # The GPUs are named (the view frees them either way; sinks keep one row per GPU).
    out.add(
        AllocationChange(
            job.key,
            job.tenant,
            AllocationKind.RELEASED,
            first_cluster,
            tuple(refs),
            job.priority,
            seq,
            s.now_ms,
            reason,
            job.scaling.get("share"),
        )
    )
    job.scaling.pop("share", None)
    for ticket in job.waiting_for:
        usage.prewarms.pop(ticket, None)
    job.allocation = {}
    job.allocation_changed()
    job.waiting_for = []
    job.limit_end_ms = None
    s.dirty.add(f"job:{job.key}")
    s.dirty.add(f"tenant:{job.tenant}")
    if outcome == Outcome.PREEMPTED:
        job.resume_from_ms = checkpoint
        job.started_ms = None
        job.preemptions += 1
        job.phase = Phase.QUEUED
        job.queued_reason = None
        job.condition(Condition.RUNNING, False, reason, s.now_ms)
        job.condition(Condition.PREEMPTED, True, reason, s.now_ms)
        return decide(
            s,
            out,
            job,
            Outcome.PREEMPTED,
            reason,
            preempted_by=preempted_by,
            resume_from_checkpoint_ms=checkpoint,
            lost_gpu_s=round(lost, 3),
        )
    job.condition(Condition.RUNNING, False, reason, s.now_ms)
    return decide(
        s, out, job, Outcome.RELEASED, reason, lost_gpu_s=round(lost, 3) if lost else None
    )


def victims_in(s: SchedulerState, cluster_id: str, below: int) -> Victims:
    """The jobs in a cluster that a job of priority `below` may preempt, by the work each
    would lose; cached while the cluster stands still within one request (a queue pass asks
    again and again)."""
    key = (cluster_id, below, s.index.version.get(cluster_id, 0))
    cached = s.victim_cache.get(key)
    if cached is not None:
        return cached
    now = s.now_ms
    order: list[tuple[float, str]] = []
    for priority, holding in s.evictable.get(cluster_id, {}).items():
        if priority < below:
            order.extend(
                (lost_work_s(job, now) if job.phase == Phase.RUNNING else 0.0, job_key)
                for job_key, job in holding.items()
            )
    order.sort()
    jobs, node_jobs = s.jobs, s.node_jobs
    victims = Victims(
        order,
        {job_key: cost for cost, job_key in order},
        lambda job_key: jobs[job_key].allocation[cluster_id],
        lambda node_id: node_jobs.get(node_id, ()),
    )
    s.victim_cache[key] = victims
    return victims


def preempt_for(
    s: SchedulerState,
    out: EffectLog,
    job: Job,
    regions: tuple[str, ...] | None = None,
    data_only: bool = False,
) -> tuple[list[Decision], Attempt] | None:
    """Evict the lower-priority jobs that lose the least work so the job fits (with
    `data_only`, only in clusters that hold its dataset); None when no eviction makes room
    (nothing is evicted then)."""
    request = request_for(s, job, regions=regions, data_only=data_only)
    filters = tuple(f for f in s.policy.filters if f not in ("capacity", "reservation"))
    ranked = rank_clusters(
        Context(
            s.index,
            replace(s.policy, filters=filters),
            s.tenants,
            s.usage,
            request,
            now_ms=s.now_ms,
            measured=s.measured,
        )
    )
    best = None
    found = 0
    shape = request.shape
    for score in ranked:
        if score.rejected is not None or found >= s.policy.preemption_clusters:
            break
        held = s.priority_gpus.get(score.cluster_id, {})
        below = sum(n for p, n in held.items() if p < job.priority)
        free = s.index.free_gpus(score.cluster_id, shape)
        if below + free < shape.gpus:
            continue  # even evicting every lower priority would not make room
        plan = plan_eviction(
            s.index, score.cluster_id, shape, victims_in(s, score.cluster_id, job.priority)
        )
        if plan is None:
            continue
        found += 1
        if best is None or (plan.lost_gpu_s, -score.total) < (best[1].lost_gpu_s, -best[0].total):
            best = (score, plan)
    if best is None:
        return None
    score, plan = best
    decisions = []
    for victim in plan.victims:
        decisions.append(
            release(
                s,
                out,
                s.jobs[victim],
                Outcome.PREEMPTED,
                f"preempted by {job.key} (priority {job.priority} over "
                f"{s.jobs[victim].priority}) in {score.cluster_id}, freeing "
                f"{', '.join(plan.leaves)}",
                preempted_by=job.key,
            )
        )
    single = Context(
        s.index,
        replace(s.policy, filters=(*filters, "capacity")),
        s.tenants,
        s.usage,
        request,
        now_ms=s.now_ms,
        measured=s.measured,
    )
    if isinstance(job.spec, InferenceServiceSpec):
        placed = place_replicas(single, 1)
    else:
        placed = place_gang(replace_request(single))
    # Were the plan and the placement ever to disagree, the victims stay queued and the queue
    # pass places them again.
    return decisions, placed
