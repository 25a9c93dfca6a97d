"""The reconcile loop, run by every TICK: jobs on GPUs that failed or on nodes that went down or
out of reach are migrated (released, resumed from their last checkpoint elsewhere); jobs past
their time limit are stopped; prewarm bandwidth past its estimate is given back; and the queue
is retried in priority order, fair share between tenants of equal priority, then submission
order, preempting lower priorities where the policy allows.
"""

from __future__ import annotations

import heapq

from fleetline.processors.scheduling import services
from fleetline.processors.scheduling.capacity import FleetFacts, usable_gpus
from fleetline.processors.scheduling.decide import (
    ShapeKey,
    attempt,
    release,
    shape_keys,
)
from fleetline.processors.scheduling.effects import EffectLog, Outcome
from fleetline.processors.scheduling.orders import order_run
from fleetline.processors.scheduling.state import Condition, Job, Phase, SchedulerState
from fleetline.processors.scheduling.tenancy import PRIORITIES, fair_share_key
from fleetline.processors.view.model import ClusterHealth


def tick(s: SchedulerState, out: EffectLog, facts: FleetFacts) -> None:
    before = s.facts
    s.observe(facts)
    if _grew(before, s.facts):
        s.pass_wanted = True  # some cluster has more usable GPUs than before
    displaced = migrate_off_lost_clusters(s, out) + migrate_off_faults(s, out)
    stop_at_limits(s, out)
    order_retries(s, out)
    services.tick(s, out)
    wake_deferred(s)
    expire_prewarms(s)
    if (
        not s.pass_wanted
        and s.bound_floor is not None
        and any(j.priority > s.bound_floor for j in s.jobs.values() if j.phase == Phase.QUEUED)
    ):
        s.pass_wanted = True  # lower-priority jobs started beside waiting ones
    if s.pass_wanted:
        # Jobs moved off a lost cluster or a fault are tried in this pass on top of its usual
        # budget: a cluster of 500 jobs is re-placed in one TICK, not in eight.
        schedule_queue(s, out, extra_attempts=displaced)


def migrate_off_lost_clusters(s: SchedulerState, out: EffectLog) -> int:
    """Every job holding GPUs in a cluster the health fold declared lost is released to resume
    from its last checkpoint elsewhere; the lost cluster's copies are fenced by their epoch."""
    moved = 0
    for cluster_id in sorted(s.cluster_jobs):
        facts = s.facts.clusters.get(cluster_id)
        if facts is None or facts.health != ClusterHealth.LOST:
            continue
        for key in sorted(s.cluster_jobs[cluster_id]):
            moved += 1
            release(
                s,
                out,
                s.jobs[key],
                Outcome.PREEMPTED,
                f"cluster {cluster_id} lost ({facts.health_reason}); resuming from its last "
                "checkpoint elsewhere",
                salvage=False,
            )
    return moved


def order_retries(s: SchedulerState, out: EffectLog) -> None:
    """Order the next attempt of jobs whose backoff after a failed attempt has passed."""
    while s.retries and s.retries[0][0] <= s.now_ms:
        due, key = heapq.heappop(s.retries)
        job = s.jobs.get(key)
        if job is None or job.retry_at_ms != due or not job.holds:
            continue  # released, or retried on another schedule since
        job.retry_at_ms = None
        s.dirty.add(f"job:{key}")
        order_run(s, out, job)


def wake_deferred(s: SchedulerState) -> None:
    """A deferred job whose cheap window has come is tried in this TICK's pass."""
    while s.deferrals and s.deferrals[0][0] <= s.now_ms:
        due, key = heapq.heappop(s.deferrals)
        job = s.jobs.get(key)
        if job is not None and job.deferred_until_ms == due and job.phase == Phase.QUEUED:
            s.pass_wanted = True


def fence(s: SchedulerState, out: EffectLog, node_id: str, reason: str) -> None:
    """Take a node out of placement and drain it: every job holding GPUs there is preempted
    with a final checkpoint and placed again elsewhere."""
    s.fenced[node_id] = reason
    s.observe(s.observed)
    for key in sorted(s.node_jobs.get(node_id, ())):
        release(
            s,
            out,
            s.jobs[key],
            Outcome.PREEMPTED,
            f"node {node_id} drained ({reason}); checkpointing and resuming elsewhere",
        )


def unfence(s: SchedulerState, node_id: str) -> None:
    """Give a fenced node back to placement (what the view says of it counts again)."""
    if s.fenced.pop(node_id, None) is not None:
        s.observe(s.observed)
        s.pass_wanted = True


def migrate_off_faults(s: SchedulerState, out: EffectLog) -> int:
    # Only what the view says is broken moves a job: a node the view does not hold (a shard not
    # restored yet, another instance's shard) is unknown, not lost.
    hit: dict[str, str] = {}
    for node_id in sorted(s.node_jobs):
        lost = s.facts.lost.get(node_id)
        if not lost:
            continue
        for key in sorted(s.node_jobs[node_id]):
            job = s.jobs[key]
            masks = [nodes.get(node_id, 0) for nodes in job.allocation.values()]
            if any(m & lost for m in masks):
                hit.setdefault(key, s.facts.lost_reason(node_id))
    for key in sorted(hit):
        release(
            s,
            out,
            s.jobs[key],
            Outcome.PREEMPTED,
            f"fault: {hit[key]}; migrating from its last checkpoint",
            salvage=False,
        )
    return len(hit)


def stop_at_limits(s: SchedulerState, out: EffectLog) -> None:
    while s.limits and s.limits[0][0] <= s.now_ms:
        end, key = heapq.heappop(s.limits)
        job = s.jobs.get(key)
        if job is None or not job.holds or job.limit_end_ms != end:
            continue  # released or re-placed since
        release(s, out, job, Outcome.RELEASED, "reached its max runtime")
        job.phase = Phase.TIMED_OUT
        job.condition(Condition.FINISHED, True, "reached its max runtime", s.now_ms)


def expire_prewarms(s: SchedulerState) -> None:
    # A move's bandwidth is given back once its estimate has passed, even if the mover has not
    # reported it done (the job keeps waiting for the replica).
    for tenant in sorted(s.usage):
        usage = s.usage[tenant]
        done = [t for t, (_, until) in sorted(usage.prewarms.items()) if until <= s.now_ms]
        for ticket in done:
            del usage.prewarms[ticket]
        if done:
            s.dirty.add(f"tenant:{tenant}")
            s.pass_wanted = True


def schedule_queue(s: SchedulerState, out: EffectLog, extra_attempts: int = 0) -> None:
    s.pass_wanted = False
    s.bound_floor = None
    _pass(s, out, extra_attempts)


def _pass(s: SchedulerState, out: EffectLog, extra_attempts: int = 0) -> None:
    """One pass over the queue: priorities high to low; within a priority the tenant holding
    the fewest GPUs per unit of share goes next (fair share); within a tenant, FIFO. Jobs
    preempted during the pass have a lower priority and are tried when their level comes. At
    most `pass_attempts` jobs are tried; past that the next TICK goes on."""
    failed: dict[ShapeKey, str] = {}
    budget = s.policy.pass_attempts + extra_attempts
    s.preemptions_left = s.policy.pass_preemptions
    for priority in sorted(set(PRIORITIES.values()), reverse=True):
        queues: dict[str, list[Job]] = {}
        for job in s.queue():
            if job.priority == priority:
                queues.setdefault(job.tenant, []).append(job)
        for q in queues.values():
            q.reverse()
        while queues:
            tenant = min(queues, key=lambda t: (fair_share_key(s.tenants, s.usage, t), t))
            job = queues[tenant].pop()
            if not queues[tenant]:
                del queues[tenant]
            if job.phase != Phase.QUEUED or any(k in failed for k in shape_keys(job)):
                continue
            if job.deferred_until_ms is not None and job.deferred_until_ms > s.now_ms:
                continue  # waits for its cheap window, and takes none of the pass's budget
            if job.waiting_for:
                continue  # waits for its data (DATASET_READY), holding no GPUs
            if budget <= 0:
                s.pass_wanted = True
                return
            budget -= 1
            # A preemption in the pass frees GPUs only for the preemptor; what failed before it
            # is tried again by the next pass (a release asks for one).
            attempt(s, out, job, failed)


def _grew(before: FleetFacts, after: FleetFacts) -> bool:
    old = usable_gpus(before)
    return any(n > old.get(c, 0) for c, n in usable_gpus(after).items())
