"""Reading the resource view: capacity, node and GPU detail, topology, usage. Pure functions of a
view, shared by the HTTP API, the CLI and the scheduler, so they all count the same way; and
`ViewSource`, what they read from (the live processor, a replay's result)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from fleetline.processors.view.fold import gpu_health, node_status, takes_new_work
from fleetline.processors.view.model import (
    DEGRADED,
    FAILED,
    HEALTHY,
    GpuState,
    NodeStatus,
    NodeView,
    ResourceView,
    Sample,
    declared_catalogue,
)
from fleetline.processors.view.summary import cluster_health, node_capacity

T = TypeVar("T")


class ViewSource(Protocol):
    """A view one can read consistently: `read(fn)` runs `fn` over one version of it."""

    def read(self, fn: Callable[[ResourceView], T]) -> T: ...


class StaticView:
    """A view that does not move: a replay's result, served for an investigation."""

    def __init__(self, view: ResourceView) -> None:
        self.view = view

    def read(self, fn: Callable[[ResourceView], T]) -> T:
        return fn(self.view)


class CapacityState(StrEnum):
    """What a GPU is, for capacity: usable and free, bound to a job, suspect, broken, or out of
    reach (its node is down, unreachable, draining or cordoned)."""

    IDLE = "idle"
    ALLOCATED = "allocated"
    DEGRADED = "degraded"
    FAILED = "failed"
    UNAVAILABLE = "unavailable"


IDLE, ALLOCATED, UNAVAILABLE = (
    CapacityState.IDLE,
    CapacityState.ALLOCATED,
    CapacityState.UNAVAILABLE,
)


def gpu_capacity_state(
    view: ResourceView, node: NodeView, status: NodeStatus, gpu: GpuState
) -> CapacityState:
    health, _ = gpu_health(node, gpu)
    if health == FAILED:
        return CapacityState.FAILED
    if not takes_new_work(node, status):
        return UNAVAILABLE
    if (node.node_id, gpu.index) in view.gpu_owner:
        return ALLOCATED
    return CapacityState.DEGRADED if health == DEGRADED else IDLE


def view_meta(view: ResourceView) -> dict[str, Any]:
    return {
        "version": view.version,
        "node_events": view.node_events,
        "fleet_events": view.fleet_events,
        "watermark_ms": view.watermark_ms,
        "offsets": {
            t: {str(p): o for p, o in sorted(ps.items())} for t, ps in sorted(view.offsets.items())
        },
        "clusters": len(cluster_ids(view)),
        "nodes": len(view.nodes),
        "gpus": sum(len(n.gpus) for n in view.nodes.values()),
        "policy": view.policy.as_dict(),
    }


def cluster_ids(view: ResourceView) -> list[str]:
    return sorted(
        {n.cluster_id for n in view.nodes.values()} | set(view.clusters) | set(view.cluster_health)
    )


def _empty_counts() -> dict[str, int]:
    return {
        "gpus": 0,
        IDLE: 0,
        ALLOCATED: 0,
        DEGRADED: 0,
        FAILED: 0,
        UNAVAILABLE: 0,
        "nodes": 0,
        "nodes_up": 0,
        "nodes_draining": 0,
        "nodes_down": 0,
        "nodes_unreachable": 0,
        "nodes_cordoned": 0,
    }


def cluster_capacity(view: ResourceView, region: str | None = None) -> list[dict[str, Any]]:
    """Per cluster: GPUs idle / allocated / degraded / failed / unavailable, nodes by status,
    the declared facts (price, latency, PUE) and a health word."""
    counts: dict[str, dict[str, int]] = {}
    unusable: dict[str, int] = {}
    regions: dict[str, str] = {}
    for node in view.nodes.values():
        c = counts.setdefault(node.cluster_id, _empty_counts())
        regions.setdefault(node.cluster_id, node.region)
        status = node_status(view, node)
        unusable[node.cluster_id] = (
            unusable.get(node.cluster_id, 0) + node_capacity(node, status).bad
        )
        c["nodes"] += 1
        c[f"nodes_{status.lower()}"] += 1
        c["nodes_cordoned"] += node.cordoned
        for gpu in node.gpus.values():
            c["gpus"] += 1
            c[gpu_capacity_state(view, node, status, gpu)] += 1
    out = []
    for cluster_id in cluster_ids(view):
        info = view.clusters.get(cluster_id)
        declared = view.cluster_health.get(cluster_id)
        c = counts.get(cluster_id, _empty_counts())
        cluster_region = info.region if info else regions.get(cluster_id, "")
        if region is not None and cluster_region != region:
            continue
        out.append(
            {
                "cluster_id": cluster_id,
                "region": cluster_region,
                "health": cluster_health(
                    nodes=c["nodes"],
                    unreachable=c["nodes_unreachable"],
                    gpus=c["gpus"],
                    unusable=unusable.get(cluster_id, 0),
                    retired=bool(info and info.retired),
                    declared=declared.word if declared else None,
                ),
                **c,
                "info": info.as_data() if info else None,
                "control": asdict(declared) if declared else None,
            }
        )
    return out


def gpu_data(
    view: ResourceView, node: NodeView, status: NodeStatus, gpu: GpuState
) -> dict[str, Any]:
    health, cause = gpu_health(node, gpu)
    return {
        "node_id": node.node_id,
        "cluster_id": node.cluster_id,
        **gpu.readings(),
        "health": health,
        "cause": cause,
        "health_since_ms": gpu.failed_at_ms if health == FAILED else gpu.health_since_ms,
        "capacity": gpu_capacity_state(view, node, status, gpu),
        "job_id": view.gpu_owner.get((node.node_id, gpu.index)),
        "last_ts": gpu.last_ts,
    }


def node_data(view: ResourceView, node: NodeView, with_gpus: bool = True) -> dict[str, Any]:
    status = node_status(view, node)
    capability = declared_catalogue(view.clusters).of(node.accelerator)
    data: dict[str, Any] = {
        "node_id": node.node_id,
        "cluster_id": node.cluster_id,
        "region": node.region,
        "status": status,
        "declared_state": node.state,
        "reason": node.reason,
        "labels": dict(node.labels),
        "accelerator": {**node.accelerator.as_record(), "family": node.accelerator.family},
        # What the accelerator catalogue says its chips can do (None: a model it lacks).
        "capability": capability.as_record() if capability is not None else None,
        "gpu_count": node.gpu_count or len(node.gpus),
        "leaf_switch": node.leaf_switch,
        "spine_switch": node.spine_switch,
        "nvlink_islands": node.islands,
        "gpu_numa_nodes": node.numa_nodes,
        "agent_version": node.agent_version,
        "agent_spool_bytes": node.spool_bytes,
        "agent_spool_dropped": node.spool_dropped,
        "last_heard_ms": node.last_heard_ms,
        "gpus_healthy": sum(1 for g in node.gpus.values() if gpu_health(node, g)[0] == HEALTHY),
    }
    if with_gpus:
        data["gpus"] = [gpu_data(view, node, status, node.gpus[i]) for i in sorted(node.gpus)]
    return data


def select_nodes(
    view: ResourceView,
    cluster: str | None = None,
    status: str | None = None,
    labels: Mapping[str, str] | None = None,
    leaf_switch: str | None = None,
) -> Iterator[NodeView]:
    for node_id in sorted(view.nodes):
        node = view.nodes[node_id]
        if cluster is not None and node.cluster_id != cluster:
            continue
        if status is not None and node_status(view, node) != status.upper():
            continue
        if leaf_switch is not None and node.leaf_switch != leaf_switch:
            continue
        if labels and any(node.labels.get(k) != v for k, v in labels.items()):
            continue
        yield node


def select_gpus(
    view: ResourceView,
    cluster: str | None = None,
    health: str | None = None,
    capacity: str | None = None,
) -> list[dict[str, Any]]:
    out = []
    for node in select_nodes(view, cluster=cluster):
        status = node_status(view, node)
        for index in sorted(node.gpus):
            gpu = node.gpus[index]
            if health is not None and gpu_health(node, gpu)[0] != health:
                continue
            if capacity is not None and gpu_capacity_state(view, node, status, gpu) != capacity:
                continue
            out.append(gpu_data(view, node, status, gpu))
    return out


def topology(view: ResourceView, cluster_id: str) -> dict[str, Any]:
    """The cluster as a tree: spine switches, their leaf switches, the nodes under each leaf
    and each node's NVLink islands (GPU indices)."""
    spines: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for node in select_nodes(view, cluster=cluster_id):
        leaves = spines.setdefault(node.spine_switch or "unknown", {})
        leaves.setdefault(node.leaf_switch or "unknown", []).append(
            {
                "node_id": node.node_id,
                "status": node_status(view, node),
                "nvlink_islands": node.islands,
                "degraded_gpus": sorted(
                    i for i, g in node.gpus.items() if gpu_health(node, g)[0] != HEALTHY
                ),
            }
        )
    return {
        "cluster_id": cluster_id,
        "spines": [
            {
                "spine_switch": spine,
                "leaves": [
                    {"leaf_switch": leaf, "nodes": nodes} for leaf, nodes in sorted(leaves.items())
                ],
            }
            for spine, leaves in sorted(spines.items())
        ],
    }


def tenant_usage(view: ResourceView) -> list[dict[str, Any]]:
    usage: dict[str, dict[str, Any]] = {}
    for allocation in view.allocations.values():
        u = usage.setdefault(
            allocation.tenant, {"tenant": allocation.tenant, "jobs": 0, "gpus": 0, "by_cluster": {}}
        )
        u["jobs"] += 1
        u["gpus"] += len(allocation.gpus)
        u["by_cluster"][allocation.cluster_id] = u["by_cluster"].get(
            allocation.cluster_id, 0
        ) + len(allocation.gpus)
    for dataset in view.datasets.values():
        u = usage.setdefault(
            dataset.tenant, {"tenant": dataset.tenant, "jobs": 0, "gpus": 0, "by_cluster": {}}
        )
        u["dataset_bytes"] = u.get("dataset_bytes", 0) + dataset.size_bytes
    return [usage[t] for t in sorted(usage)]


def allocations(view: ResourceView) -> list[dict[str, Any]]:
    return [
        {
            "job_id": a.job_id,
            "tenant": a.tenant,
            "cluster_id": a.cluster_id,
            "priority": a.priority,
            "since_ms": a.since_ms,
            "gpus": [f"{n}/{i}" for n, i in sorted(a.gpus)],
        }
        for a in (view.allocations[k] for k in sorted(view.allocations))
    ]


def datasets(view: ResourceView) -> list[dict[str, Any]]:
    return [asdict(view.datasets[k]) for k in sorted(view.datasets)]


def latest_samples(view: ResourceView) -> list[tuple[str, str, str, Sample]]:
    """(node, cluster, region, latest GPU sample) of every GPU: references only, so a reader
    holding the view's lock (a metrics scrape of 80,000 GPUs) lets go of it quickly."""
    return [
        (node.node_id, node.cluster_id, node.region, gpu.sample)
        for node in view.nodes.values()
        for gpu in node.gpus.values()
    ]
