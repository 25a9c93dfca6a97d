"""Workload orders: what the scheduler tells a cluster to run or stop for a job (the desired
state its cluster agent reconciles). Pure."""

from __future__ import annotations

import json

from fleetline.processors.scheduling.capacity import indices_of
from fleetline.processors.scheduling.effects import Decision, EffectLog, OrderAction, WorkloadOrder
from fleetline.processors.scheduling.state import Condition, Job, SchedulerState


def order_run(s: SchedulerState, out: EffectLog, job: Job) -> None:
    """A RUN order for the job's current epoch and attempt: in its one cluster, or, split
    across several, in every one (one order, each cluster's part in it, rank 0 in the first)."""
    cluster_id = min(job.allocation)
    job.ordered_cluster = cluster_id
    order = run_order(s, job)
    out.add(order)
    where = ", ".join(c for c, _, _ in order.parts) if order.parts else cluster_id
    job.condition(
        Condition.RUNNING,
        False,
        f"ordered to start in {where} (epoch {job.epoch}, attempt {job.attempt})",
        s.now_ms,
    )
    job.actual = {
        "state": "Ordered",
        "cluster": cluster_id,
        "epoch": job.epoch,
        "attempt": job.attempt,
        "since_ms": s.now_ms,
    }


def run_order(s: SchedulerState, job: Job, reason: str | None = None) -> WorkloadOrder:
    """The RUN order of the job's current epoch and attempt in its ordered cluster (sent again
    with a new document when only what the workload is told changes: a replica's role)."""
    cluster_id = job.ordered_cluster or min(job.allocation)
    parts = split_parts(job, cluster_id)
    return WorkloadOrder(
        job.key,
        job.tenant,
        job.kind,
        OrderAction.RUN,
        cluster_id,
        job.epoch,
        job.attempt,
        s.now_ms,
        job.last_decision or "",
        reason or f"attempt {job.attempt} of epoch {job.epoch}",
        job.trace_id,
        spec_json=json.dumps(job.document, sort_keys=True, separators=(",", ":")),
        workers=_ranked_workers(job, cluster_id),
        resume_from=(cluster_id, *(c for c in job.ran_in if c != cluster_id)),
        resume_step=job.checkpoint_step,
        parts=parts,
    )


def split_parts(
    job: Job, root: str
) -> tuple[tuple[str, int, tuple[tuple[str, tuple[int, ...]], ...]], ...]:
    """A training job's parts when it holds GPUs in several clusters: the root (rank 0) first,
    the others by name, each with its workers and the first of its global ranks. () for a job
    in one cluster, and for a replica (a service's replicas are jobs of their own)."""
    if len(job.allocation) < 2 or job.service:
        return ()
    parts, first = [], 0
    for cluster in [root, *sorted(c for c in job.allocation if c != root)]:
        workers = _ranked_workers(job, cluster)
        parts.append((cluster, first, workers))
        first += len(workers)
    return tuple(parts)


def _ranked_workers(job: Job, cluster_id: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The job's workers in a cluster in rank order, as its placing decision chose them (the
    same whether the decision is in memory or read back from the store)."""
    explanation = job.explanation
    placements = (
        explanation.placement_records()
        if isinstance(explanation, Decision)
        else (explanation or {}).get("placements", ())
    )
    for placement in placements:
        if placement["cluster_id"] == cluster_id:
            return tuple((w["node_id"], tuple(w["gpus"])) for w in placement["workers"])
    nodes = job.allocation[cluster_id]  # no placing decision: node order
    return tuple((node, indices_of(mask)) for node, mask in sorted(nodes.items()))


def order_stop(s: SchedulerState, out: EffectLog, job: Job, reason: str, final: bool) -> None:
    """Tell the cluster that was ordered to run the job to stop it (checkpointing first when
    `final` and the job allows it)."""
    cluster_id = job.ordered_cluster
    if cluster_id is None:
        return
    spec = job.spec
    allows = spec.workload.final_checkpoint if spec.workload is not None else False
    out.add(
        WorkloadOrder(
            job.key,
            job.tenant,
            job.kind,
            OrderAction.STOP,
            cluster_id,
            job.epoch,
            job.attempt,
            s.now_ms,
            out.next_id(),
            reason,
            job.trace_id,
            final_checkpoint=final and allows,
        )
    )
    job.ran_in = [cluster_id, *(c for c in job.ran_in if c != cluster_id)][:8]
    job.ordered_cluster = None
    job.retry_at_ms = None
    job.actual = {**job.actual, "state": "Stopping", "since_ms": s.now_ms, "detail": reason}
