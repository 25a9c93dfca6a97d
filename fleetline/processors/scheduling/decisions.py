"""A decision and the inputs it was made on (the request offset, the view version and offsets,
the policy digest), recorded as an effect and kept as its job's explanation. Pure."""

from __future__ import annotations

from typing import TypedDict, Unpack

from fleetline.processors.scheduling.effects import Decision, EffectLog, Outcome
from fleetline.processors.scheduling.pipeline import ClusterScore, DatasetPrewarm
from fleetline.processors.scheduling.placement import Placement
from fleetline.processors.scheduling.state import Job, SchedulerState


class DecisionDetails(TypedDict, total=False):
    """What a decision names besides its outcome and reason (fields of `Decision`)."""

    placements: tuple[Placement, ...]
    alternatives: tuple[ClusterScore, ...]
    prewarms: tuple[DatasetPrewarm, ...]
    preempted_by: str | None
    victims: tuple[str, ...]
    resume_from_checkpoint_ms: int | None
    lost_gpu_s: float | None


def decide(
    s: SchedulerState,
    out: EffectLog,
    job: Job,
    outcome: Outcome,
    reason: str,
    **details: Unpack[DecisionDetails],
) -> Decision:
    """A decision about a job, which becomes its explanation."""
    decision = decide_about(
        s, out, job.key, job.tenant, job.kind, outcome, reason, job.priority, **details
    )
    job.last_decision = decision.decision_id
    job.explanation = decision
    s.dirty.add(f"job:{job.key}")
    return decision


def decide_about(
    s: SchedulerState,
    out: EffectLog,
    key: str,
    tenant: str,
    kind: str,
    outcome: Outcome,
    reason: str,
    priority: int,
    **details: Unpack[DecisionDetails],
) -> Decision:
    """A decision with the inputs it was made on: the request, the view version and offsets,
    the policy digest."""
    decision = Decision(
        decision_id=out.next_id(),
        job=key,
        tenant=tenant,
        kind=kind,
        outcome=outcome,
        ts=s.now_ms,
        input_offset=s.position,
        view_version=s.facts.view_version,
        view_offsets=s.facts.offsets,
        policy_digest=s.digest,
        priority=priority,
        reason=reason,
        **details,
    )
    out.add(decision)
    return decision
