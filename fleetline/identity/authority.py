"""What each writer may write: one rule per kind of record, the folds' only authority check.

The control plane (the API for a signed-in identity with the right role and tenant, the
scheduler, the operations processor, the health clock) may write every kind. An agent speaks
only for what it is: a node for its node, a cluster agent for its cluster and the runs ordered
to it, a data mover for the copies it was ordered, a router for the load of services. Each
function returns why the writer may not, or None; the caller dead-letters the record with
`WriterRefused(writer, reason)`. Pure: the facts a rule needs (which cluster a run was ordered
to, whether a copy was ordered) are arguments, from the fold's own state.
"""

from __future__ import annotations

from collections.abc import Collection

from fleetline.identity.writers import Writer, WriterKind

# Scheduler requests an agent may make, by kind of writer; every other kind (SUBMIT, DELETE,
# TENANT_POLICY, POLICY, FENCE, UNFENCE, ENERGY, TICK) is the control plane's alone.
AGENT_REQUESTS: dict[WriterKind, frozenset[str]] = {
    # A cluster agent fences and gives back its own nodes as its manager sees them go and come.
    WriterKind.CLUSTER: frozenset({"PROGRESS", "FENCE", "UNFENCE"}),
    WriterKind.MOVER: frozenset({"DATASET_READY", "DATASET_PROGRESS"}),
    WriterKind.ROUTER: frozenset({"SERVICE_LOAD"}),
}


def request_refusal(
    writer: Writer,
    kind: str,
    *,
    cluster_id: str | None = None,
    ordered_clusters: Collection[str] = (),
    copy_ordered: bool = False,
    is_service: bool = False,
    node_cluster: str | None = None,
) -> str | None:
    """Why `writer` may not make a scheduler request of `kind`, or None.

    PROGRESS: `cluster_id` is the cluster the report names, `ordered_clusters` the clusters the
    job was ever ordered to (its placement's, and where it ran before: a stopped run's final
    checkpoint and a fenced copy's report come from there). DATASET_*: whether the copy
    (`<dataset>@<cluster>`) was ordered. SERVICE_LOAD:
    whether the key names a service."""
    if writer.is_control_plane:
        return None
    allowed = AGENT_REQUESTS.get(writer.kind, frozenset())
    if kind not in allowed:
        return f"may not {kind}"
    if writer.kind is WriterKind.CLUSTER and kind in ("FENCE", "UNFENCE"):
        if node_cluster != writer.cluster:
            return f"may not {kind} a node of {node_cluster or 'no cluster it knows'}"
        return None
    if writer.kind is WriterKind.CLUSTER:
        if cluster_id != writer.cluster:
            return f"may not report PROGRESS for cluster {cluster_id or '(none)'}"
        if writer.cluster not in ordered_clusters:
            return "may not report PROGRESS for a run not ordered to it"
    if writer.kind is WriterKind.MOVER and not copy_ordered:
        return f"may not report {kind} for a copy no mover was ordered to make"
    if writer.kind is WriterKind.ROUTER and not is_service:
        return "may not report SERVICE_LOAD for what is not a service"
    return None


def signal_refusal(writer: Writer, kind: str, cluster_id: str) -> str | None:
    """Why `writer` may not put a cluster signal of `kind` about `cluster_id`, or None: a
    cluster agent heartbeats for its own cluster; TICK, CORDON and UNCORDON are the control
    plane's."""
    if writer.is_control_plane:
        return None
    if writer.kind is not WriterKind.CLUSTER or kind != "HEARTBEAT":
        return f"may not send a {kind} signal"
    if cluster_id != writer.cluster:
        return f"may not heartbeat for cluster {cluster_id or '(none)'}"
    return None


def node_refusal(writer: Writer, what: str, cluster_id: str, node_id: str) -> str | None:
    """Why `writer` may not publish `what` (NodeState, telemetry, a command result) about
    `node_id` of `cluster_id`, or None: a node speaks for itself only."""
    if writer.is_control_plane:
        return None
    if writer.kind is not WriterKind.NODE:
        return f"may not publish {what}"
    if writer.cluster != cluster_id or writer.node != node_id:
        return f"may not publish {what} for node {node_id} of cluster {cluster_id}"
    return None


def workload_refusal(writer: Writer, cluster_id: str) -> str | None:
    """Why `writer` may not report a workload event from `cluster_id`, or None. (Which runs
    were ordered to a cluster is the scheduler's state: a PROGRESS report about a run not
    ordered to its writer is refused there, by `request_refusal`.)"""
    if writer.is_control_plane:
        return None
    if writer.kind is not WriterKind.CLUSTER:
        return "may not report workload events"
    if cluster_id != writer.cluster:
        return f"may not report workload events for cluster {cluster_id or '(none)'}"
    return None
