"""The service registry's records, pure: what a replica's run says of itself (alive, stopping,
its `ready` line, the load it last reported) -> its state, and the ReplicaEndpoint record the
cluster agent publishes for the router."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleetline.agents.cluster.reconcile import Order
from fleetline.processors.scheduling.services import ROLE_LABEL, SERVICE_LABEL
from fleetline.schemas.records import ReplicaEndpoint, ReplicaState


def _labels(order: Order) -> Mapping[str, Any]:
    return ((order.spec or {}).get("metadata") or {}).get("labels") or {}


def replica_state(
    order: Order, alive: bool, stopping: bool, ready: bool, load: Mapping[str, Any]
) -> ReplicaState:
    """GONE once it exited; DRAINING while it stops (ordered, or by its own word); READY (WARM
    for a standby) once it loaded its model and says it is ready; else STARTING."""
    if not alive:
        return "GONE"
    if stopping or load.get("draining"):
        return "DRAINING"
    if ready and load.get("ready"):
        return "WARM" if _labels(order).get(ROLE_LABEL) == "standby" else "READY"
    return "STARTING"


def endpoint_record(
    order: Order,
    cluster_id: str,
    region: str | None,
    ts: int,
    state: ReplicaState,
    address: str | None,
    load: Mapping[str, Any],
    heartbeat_ms: int,
    ready: Mapping[str, Any] | None = None,
) -> ReplicaEndpoint:
    latency = load.get("latency_ms") or {}
    ready = ready or {}
    return {
        "replica": order.job,
        "service": f"{order.tenant}/{_labels(order).get(SERVICE_LABEL, order.job)}",
        "tenant": order.tenant,
        "cluster_id": cluster_id,
        "region": region,
        "epoch": order.epoch,
        "attempt": order.attempt,
        "ts": ts,
        "state": state,
        "address": address,
        "heartbeat_ms": heartbeat_ms,
        "concurrency": int(load.get("concurrency") or 0),
        "inflight": int(load.get("inflight") or 0),
        "queue": int(load.get("queue") or 0),
        "served": int(load.get("served") or 0),
        "errors": int(load.get("errors") or 0),
        "refused": int(load.get("refused") or 0),
        "latency_p50_ms": latency.get("p50"),
        "latency_p95_ms": latency.get("p95"),
        "start_s": ready.get("start_s"),
        "checkpoint": ready.get("checkpoint"),
    }
