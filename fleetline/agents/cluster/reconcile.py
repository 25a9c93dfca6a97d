"""The cluster agent's decision, pure: the desired state (the latest order of each job) against
the actual state (the workloads it runs) -> what to start and what to stop.

A workload runs one (job, epoch, attempt). It is wanted while the job's latest order is a RUN
naming this cluster with that epoch and attempt; anything else alive is stopped: moved to
another cluster (its epoch has moved on: fenced), superseded by a newer attempt, stopped by the
scheduler (with a final checkpoint when the order asks for one), or unknown to every order.
An order is started once per (epoch, attempt): a workload that exited is not started again
until the scheduler orders a new attempt.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetline.processors.scheduling.tenancy import (
    Request,
    TenantPolicy,
    TenantUsage,
    quota_block,
)


@dataclass(frozen=True)
class Order:
    job: str
    tenant: str
    kind: str
    action: str  # RUN or STOP
    cluster_id: str
    epoch: int
    attempt: int
    ts: int
    reason: str
    trace_id: str
    spec: Mapping[str, Any] | None
    workers: tuple[tuple[str, tuple[int, ...]], ...]
    resume_from: tuple[str, ...]
    resume_step: int | None
    final_checkpoint: bool
    # A job split across clusters: every part (cluster, first global rank, workers).
    parts: tuple[tuple[str, int, tuple[tuple[str, tuple[int, ...]], ...]], ...] = ()

    @classmethod
    def from_record(cls, r: Mapping[str, Any]) -> Order:
        return cls(
            r["job"],
            r["tenant"],
            r["kind"],
            r["action"],
            r["cluster_id"],
            int(r["epoch"]),
            int(r["attempt"]),
            int(r["ts"]),
            r["reason"],
            r["trace_id"],
            json.loads(r["spec_json"]) if r.get("spec_json") else None,
            tuple((w["node_id"], tuple(w["gpus"])) for w in r["workers"]),
            tuple(r["resume_from"]),
            r.get("resume_step"),
            bool(r["final_checkpoint"]),
            tuple(
                (
                    p["cluster_id"],
                    int(p["first_rank"]),
                    tuple((w["node_id"], tuple(w["gpus"])) for w in p["workers"]),
                )
                for p in r.get("parts") or ()
            ),
        )

    def seen_from(self, cluster_id: str) -> Order:
        """The order as one cluster's agent acts on it: a split job's RUN names every part's
        cluster; to the cluster of a part it is its own RUN, of that part's workers."""
        for cluster, _, workers in self.parts:
            if cluster == cluster_id and cluster != self.cluster_id:
                return dataclasses.replace(self, cluster_id=cluster, workers=workers)
        return self

    @property
    def first_rank(self) -> int:
        """The global rank of this cluster's first worker (seen from it)."""
        return next((f for c, f, _ in self.parts if c == self.cluster_id), 0)

    @property
    def world_size(self) -> int:
        return sum(len(w) for _, _, w in self.parts) if self.parts else len(self.workers)

    @property
    def run_id(self) -> tuple[int, int]:
        return (self.epoch, self.attempt)

    def admits(self, epoch: int, step: int) -> bool:
        """Whether a checkpoint may be resumed from: one of this epoch (its earlier attempts),
        or of an earlier epoch up to the step the scheduler accepted. A checkpoint past that was
        written by a copy already fenced off (a lost cluster's workload running on)."""
        if epoch == self.epoch:
            return True
        return epoch < self.epoch and self.resume_step is not None and step <= self.resume_step


@dataclass(frozen=True)
class Actual:
    """What the agent knows of one workload it started."""

    job: str
    epoch: int
    attempt: int
    alive: bool
    stopping: bool = False

    @property
    def run_id(self) -> tuple[int, int]:
        return (self.epoch, self.attempt)


@dataclass(frozen=True)
class Start:
    order: Order


@dataclass(frozen=True)
class Stop:
    job: str
    run_id: tuple[int, int]
    reason: str
    final_checkpoint: bool
    fenced: bool  # its epoch has moved on (to another cluster, or a newer placement)


Action = Start | Stop


def plan(
    cluster_id: str,
    orders: Mapping[str, Order],
    actual: Mapping[str, list[Actual]],
    *,
    may_start: bool = True,
) -> list[Action]:
    """What to do now, in job order (stops before starts of the same job)."""
    actions: list[Action] = []
    for job in sorted(set(orders) | set(actual)):
        order = orders.get(job)
        wanted = (
            order
            if order is not None and order.action == "RUN" and order.cluster_id == cluster_id
            else None
        )
        runs = actual.get(job, [])
        for run in runs:
            if not run.alive or run.stopping or (wanted and run.run_id == wanted.run_id):
                continue
            actions.append(_stop(cluster_id, run, order))
        if (
            wanted is not None
            and may_start
            and not any(r.run_id == wanted.run_id for r in runs)
            and not any(r.alive for r in runs)
        ):
            actions.append(Start(wanted))
    return actions


def order_gpus(order: Order) -> int:
    return sum(len(ids) for _, ids in order.workers)


def quota_refusal(
    cluster_id: str,
    order: Order,
    policy: TenantPolicy | None,
    running: Sequence[Order],
) -> str | None:
    """The second level of a tenant's quota: why this cluster refuses to start `order` (its
    tenant's per-cluster GPUs, counted from the orders of the runs it has here, would pass
    the limit), or None. The rule is the scheduler's own (`tenancy.quota_block`); the count is
    what this cluster runs, which a scheduler's lagging or mistaken view cannot change."""
    held = sum(order_gpus(o) for o in running if o.tenant == order.tenant and o.job != order.job)
    usage = TenantUsage(cluster_gpus={cluster_id: held})
    return quota_block(policy, usage, Request(gpus_by_cluster={cluster_id: order_gpus(order)}))


def _stop(cluster_id: str, run: Actual, order: Order | None) -> Stop:
    if order is None:
        return Stop(run.job, run.run_id, "no order names it", False, True)
    if order.epoch != run.epoch:
        where = "here" if order.cluster_id == cluster_id else f"in {order.cluster_id}"
        return Stop(
            run.job,
            run.run_id,
            f"epoch {run.epoch} has moved on to epoch {order.epoch} {where}",
            False,
            True,
        )
    if order.action == "STOP":
        return Stop(run.job, run.run_id, order.reason, order.final_checkpoint, False)
    if order.cluster_id != cluster_id:
        return Stop(run.job, run.run_id, f"ordered to run in {order.cluster_id}", False, True)
    return Stop(
        run.job, run.run_id, f"attempt {run.attempt} superseded by {order.attempt}", False, False
    )
