"""What the scheduler decides, as data: decisions with their reasons and inputs, allocation
records for the resource view, dataset prewarm orders, dataset records, and workload orders
for the cluster agents.

A step collects its effects in an `EffectLog`, which also numbers its decisions: a decision's
id is the request's log position and its place among the step's decisions, so a replay of the
same log gives the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fleetline.processors.scheduling.capacity import GpuRef
from fleetline.processors.scheduling.pipeline import ClusterScore, DatasetPrewarm
from fleetline.processors.scheduling.placement import Placement
from fleetline.streams.records import Offsets


class Outcome(StrEnum):
    """What a decision did."""

    PLACED = "PLACED"
    QUEUED = "QUEUED"  # emitted again only when the blocking reason changes
    PREEMPTED = "PREEMPTED"  # by a higher priority, or moved off a fault
    REJECTED = "REJECTED"  # a spec that can never fit, or a bad one
    RELEASED = "RELEASED"  # deleted, finished, timed out, or re-placed after a change
    ACCEPTED = "ACCEPTED"  # datasets
    SCALED = "SCALED"  # a service's replica counts, with the load that moved them


class AllocationKind(StrEnum):
    ALLOCATED = "ALLOCATED"
    RELEASED = "RELEASED"


@dataclass(frozen=True)
class Decision:
    decision_id: str
    job: str
    tenant: str
    kind: str
    outcome: Outcome
    ts: int
    input_offset: int
    view_version: int
    view_offsets: Offsets
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

    def placement_records(self) -> list[dict[str, Any]]:
        """The placements as the record has them: workers in rank order, with their GPUs."""
        return [
            {
                "cluster_id": p.cluster_id,
                "leaves": list(p.leaves),
                "workers": [
                    {"node_id": w[0][0], "gpus": [i for _, i in w]} for w in p.workers if w
                ],
            }
            for p in self.placements
        ]

    def as_record(self) -> dict[str, Any]:
        """The SchedulingDecision record."""
        d = self
        return {
            "decision_id": d.decision_id,
            "job": d.job,
            "tenant": d.tenant,
            "kind": d.kind,
            "outcome": d.outcome,
            "ts": d.ts,
            "input_offset": d.input_offset,
            "view_version": d.view_version,
            "view_offsets": [
                {"topic": t, "partition": p, "offset": o}
                for t, ps in sorted(d.view_offsets.items())
                for p, o in sorted(ps.items())
            ],
            "policy_digest": d.policy_digest,
            "priority": d.priority,
            "reason": d.reason,
            "placements": self.placement_records(),
            "alternatives": [
                {
                    "cluster_id": a.cluster_id,
                    "total": a.total,
                    "parts": dict(a.parts),
                    "rejected": a.rejected,
                }
                for a in d.alternatives
            ],
            "prewarms": [
                {
                    "dataset_id": p.dataset_id,
                    "from_cluster": p.from_cluster,
                    "to_cluster": p.to_cluster,
                    "size_bytes": p.size_bytes,
                    "estimated_s": p.estimated_s,
                    "rate_gbps": p.rate_gbps,
                }
                for p in d.prewarms
            ],
            "preempted_by": d.preempted_by,
            "victims": list(d.victims),
            "resume_from_checkpoint_ms": d.resume_from_checkpoint_ms,
            "lost_gpu_s": d.lost_gpu_s,
        }


@dataclass(frozen=True)
class AllocationChange:
    job: str
    tenant: str
    kind: AllocationKind
    cluster_id: str
    gpus: tuple[GpuRef, ...]
    priority: int
    seq: int
    ts: int
    reason: str
    share_eighths: int | None = None  # a replica's share of the one GPU it names


@dataclass(frozen=True)
class PrewarmOrder:
    job: str
    tenant: str
    decision_id: str
    ts: int
    prewarm: DatasetPrewarm
    prefix: str  # the dataset's objects, in the source cluster's store and the target's
    mask_fields: tuple[str, ...] = ()  # masked by keyed hashing: the copy leaves its region


class OrderAction(StrEnum):
    RUN = "RUN"
    STOP = "STOP"


@dataclass(frozen=True)
class WorkloadOrder:
    """What a cluster must run (or stop) for a job: the desired state its agent reconciles."""

    job: str
    tenant: str
    kind: str
    action: OrderAction
    cluster_id: str
    epoch: int
    attempt: int
    ts: int
    decision_id: str
    reason: str
    trace_id: str
    spec_json: str | None = None
    workers: tuple[tuple[str, tuple[int, ...]], ...] = ()
    resume_from: tuple[str, ...] = ()
    resume_step: int | None = None
    final_checkpoint: bool = False
    # A job split across clusters: (cluster, first global rank, workers) per part, rank order.
    parts: tuple[tuple[str, int, tuple[tuple[str, tuple[int, ...]], ...]], ...] = ()

    def as_record(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "tenant": self.tenant,
            "kind": self.kind,
            "action": self.action,
            "cluster_id": self.cluster_id,
            "epoch": self.epoch,
            "attempt": self.attempt,
            "ts": self.ts,
            "decision_id": self.decision_id,
            "reason": self.reason,
            "trace_id": self.trace_id,
            "spec_json": self.spec_json,
            "workers": [{"node_id": n, "gpus": list(g)} for n, g in self.workers],
            "resume_from": list(self.resume_from),
            "resume_step": self.resume_step,
            "final_checkpoint": self.final_checkpoint,
            "parts": [
                {
                    "cluster_id": cluster,
                    "first_rank": first,
                    "workers": [{"node_id": n, "gpus": list(g)} for n, g in workers],
                }
                for cluster, first, workers in self.parts
            ],
        }


@dataclass(frozen=True)
class DatasetRecord:
    dataset_id: str
    tenant: str
    seq: int
    ts: int
    size_bytes: int
    replicas: tuple[str, ...]
    deleted: bool = False
    residency: tuple[str, ...] = ()  # kept in the scheduler's state, not (yet) on the topic
    source: str | None = None  # its objects' key prefix in a replica's store (spec.source)
    sensitive_fields: tuple[str, ...] = ()  # masked in a copy that leaves its region


Effect = Decision | AllocationChange | PrewarmOrder | DatasetRecord | WorkloadOrder


@dataclass
class EffectLog:
    """The effects of one step, in order, and the count of its decisions (for their ids)."""

    position: int
    effects: list[Effect] = field(default_factory=list)
    decisions: int = 0

    def next_id(self) -> str:
        return f"{self.position}.{self.decisions}"

    def add(self, effect: Effect) -> None:
        if isinstance(effect, Decision):
            self.decisions += 1
        self.effects.append(effect)
