"""What the control plane itself did, as audit events: each scheduling decision, each order the
scheduler gave a cluster, and each transition of a workload that a cluster agent reported (not
its progress reports), so the hash chain holds the system's actions beside the people's.

Pure: an event is made from the record and the digest of the message's exact bytes (which the
chain then commits to, so a decision changed on its topic no longer matches the chain). The
shell adds the salt. Event ids are derived from the record, so the same decision or transition
read twice is the same event.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Workload reports that are not transitions: the chain would only grow with them.
_NOT_AUDITED = frozenset({"PROGRESS"})
_FAILED = frozenset({"FAILED", "FENCED"})


def decision_event(decision: Mapping[str, Any], value_digest: str) -> dict[str, Any]:
    """A scheduling decision: who (the scheduler) decided what about which job, and why."""
    placed = ",".join(p["cluster_id"] for p in decision.get("placements") or [])
    details = {
        "decision_id": decision["decision_id"],
        "kind": decision["kind"],
        "reason": decision["reason"],
        "input_offset": str(decision["input_offset"]),
        "view_version": str(decision["view_version"]),
        "policy_digest": decision["policy_digest"],
        "record_sha256": value_digest,
    }
    if placed:
        details["clusters"] = placed
    if decision.get("victims"):
        details["victims"] = ",".join(decision["victims"])
    if decision.get("preempted_by"):
        details["preempted_by"] = decision["preempted_by"]
    return _event(
        event_id=f"decision:{decision['decision_id']}",
        ts=decision["ts"],
        actor="scheduler",
        tenant=decision["tenant"],
        operation=f"decision.{decision['outcome']}",
        target=decision["job"],
        outcome="FAILED" if decision["outcome"] == "REJECTED" else "SUCCEEDED",
        request_id=decision["decision_id"],
        trace_id=decision.get("trace_id"),
        source="scheduler",
        details=details,
    )


def order_event(order: Mapping[str, Any], value_digest: str) -> dict[str, Any]:
    """An order to a cluster: RUN the job there under this epoch and attempt, or STOP it."""
    epoch, attempt = order["epoch"], order["attempt"]
    return _event(
        event_id=f"order:{order['job']}:{epoch}:{attempt}:{order['action']}:{order['ts']}",
        ts=order["ts"],
        actor="scheduler",
        tenant=order["tenant"],
        operation=f"order.{order['action']}",
        target=order["job"],
        outcome="SUCCEEDED",
        request_id=order["decision_id"] or f"{order['job']}:{epoch}:{attempt}",
        trace_id=order.get("trace_id") or None,
        source="scheduler",
        details={
            "cluster_id": order["cluster_id"],
            "epoch": str(epoch),
            "attempt": str(attempt),
            "decision_id": order["decision_id"],
            "reason": order["reason"],
            "nodes": ",".join(w["node_id"] for w in order.get("workers") or []),
            "record_sha256": value_digest,
        },
    )


def workload_event(
    event: Mapping[str, Any], value_digest: str, writer: str = ""
) -> dict[str, Any] | None:
    """A workload's transition as its cluster agent reported it, with who wrote the report as
    the gate established it (`writer`); None for a progress report."""
    kind = event["event"]
    if kind in _NOT_AUDITED:
        return None
    epoch, attempt = event["epoch"], event["attempt"]
    details = {
        "cluster_id": event["cluster_id"],
        "epoch": str(epoch),
        "attempt": str(attempt),
        "record_sha256": value_digest,
    }
    if writer:
        details["writer"] = writer
    for name in ("pid", "exit_code", "step", "checkpoint_uri", "from_cluster", "detail"):
        if event.get(name) is not None:
            details[name] = str(event[name])
    return _event(
        event_id=f"workload:{event['job']}:{epoch}:{attempt}:{kind}:{event['ts']}",
        ts=event["ts"],
        actor=f"cluster-agent:{event['cluster_id']}",
        tenant=event["tenant"],
        operation=f"workload.{kind}",
        target=event["job"],
        outcome="FAILED" if kind in _FAILED else "SUCCEEDED",
        request_id=f"{event['job']}:{epoch}:{attempt}",
        trace_id=event.get("trace_id") or None,
        source="cluster-agent",
        details=details,
    )


def refused_event(
    writer: str,
    reason: str,
    application: str,
    source: tuple[str, int, int],
    claimed_actor: str | None,
    ts: int,
) -> dict[str, Any]:
    """A record a fold refused because its writer may not write it (or none was established):
    the true writer as the actor, what the record claimed beside it, where it lies (it stays
    on its topic for the postmortem) and why."""
    topic, partition, offset = source
    details = {
        "topic": topic,
        "partition": str(partition),
        "offset": str(offset),
        "reason": reason,
        "refused_by": application,
    }
    if claimed_actor:
        details["claimed_actor"] = claimed_actor
    return _event(
        event_id=f"refused:{topic}:{partition}:{offset}",
        ts=ts,
        actor=writer or "unauthenticated",
        tenant=None,
        operation="record.REFUSED",
        target=f"{topic}/{partition}/{offset}",
        outcome="FAILED",
        request_id=f"{topic}:{partition}:{offset}",
        trace_id=None,
        source="writer-gate",
        details=details,
    )


def _event(**fields: Any) -> dict[str, Any]:
    return {"actor_role": "component", "status": 0, **fields}


def unaudited_decisions(
    events: Iterable[Mapping[str, Any]], published: Mapping[str, str]
) -> tuple[list[str], list[str]]:
    """Which published decisions (id -> digest of its bytes on the decisions topic) the chain's
    events do not hold, and which it holds with another digest (changed after it was chained)."""
    chained: dict[str, str] = {}
    for event in events:
        if event["operation"].startswith("decision."):
            details = event["details"]
            chained[details["decision_id"]] = details.get("record_sha256", "")
    missing = sorted(d for d in published if d not in chained)
    changed = sorted(d for d, digest in published.items() if d in chained and chained[d] != digest)
    return missing, changed
