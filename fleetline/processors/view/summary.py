"""What a view shard tells the scheduler of the fleet: each node's capacity as bit masks, each
cluster's declared terms and health, each dataset's replicas. Pure.

A deployment whose view is split over several `serve` instances has no process that holds every
node's detail, so each instance publishes, for the parts it folds, one `CapacitySummary` per
(cluster, shard) with that cluster's nodes in that shard, and the instance holding shard 0 one per
cluster and per dataset from the fleet tables (every instance reads those whole). A node's facts
change when its health, status or cordon does, not with every sample, so the summaries topic
carries little; the scheduler composes them into the same facts `observe(view)` makes of a whole
view (`scheduling/capacity.observe_summaries`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fleetline.processors.view.accelerators import Accelerator, normalise_model
from fleetline.processors.view.fold import node_status, takes_new_work
from fleetline.processors.view.model import (
    DEGRADED,
    FAILED,
    HEALTHY,
    ClusterHealth,
    NodeStatus,
    NodeView,
    ResourceView,
)

NODES = "NODES"
CLUSTER = "CLUSTER"
DATASET = "DATASET"
# The part that folds the fleet topics; the holder of this shard publishes the fleet's tables.
FLEET_PUBLISHER = "shard-000"


def mask_of(indices: Iterable[int]) -> int:
    """GPU indices as a bit mask."""
    out = 0
    for i in indices:
        out |= 1 << i
    return out


@dataclass(frozen=True, slots=True)
class NodeFacts:
    node_id: str
    cluster_id: str
    leaf: str
    spine: str
    accelerator: Accelerator  # what its GPUs are (vendor, normalised model, memory)
    islands: tuple[int, ...]  # NVLink islands as GPU masks
    present: int  # every GPU the node reports
    healthy: int  # free-able for any job (node UP, GPU healthy)
    degraded: int  # only for jobs that tolerate degraded GPUs
    status: str  # UP, DRAINING, DOWN, UNREACHABLE
    schedulable: bool  # new work may land here (fold.takes_new_work)


@dataclass(frozen=True)
class NodeCapacity:
    """A node's facts, the GPUs its running jobs must leave and why, and its unusable GPUs."""

    facts: NodeFacts
    lost: int
    lost_reason: str
    bad: int


@dataclass(frozen=True)
class ClusterTerms:
    """What the fleet tables say of a cluster: what operators declared, and its declared health."""

    region: str
    kind: str
    price_per_gpu_hour: float
    energy_price_per_kwh: float
    pue: float
    link_latency_ms: Mapping[str, float]
    declared: bool
    retired: bool
    health: str | None
    health_reason: str


def node_capacity(node: NodeView, status: NodeStatus) -> NodeCapacity:
    healthy = degraded = present = failed = 0
    for index, gpu in node.gpus.items():
        bit = 1 << index
        present |= bit
        if gpu.failed_at_ms is not None and gpu.failed_at_ms >= node.up_since_ms:
            failed |= bit
        elif gpu.health == HEALTHY:
            healthy |= bit
        elif gpu.health == DEGRADED:
            degraded |= bit
    # Not usable, for its cluster's health: the failed and degraded GPUs (busy or not), or
    # every GPU of a node that takes no new work (draining, down, out of reach, cordoned).
    bad = (present if not takes_new_work(node, status) else failed | degraded).bit_count()
    lost_mask, reason = 0, ""
    if status in ("DOWN", "UNREACHABLE"):
        lost_mask = present
        reason = f"{node.node_id} is {status}" + (
            f" ({node.reason})" if status == "DOWN" and node.reason else ""
        )
    elif failed:
        lost_mask = failed
        failed_gpus = [i for i in sorted(node.gpus) if failed >> i & 1]
        causes = sorted({node.gpus[i].failure or FAILED for i in failed_gpus})
        reason = f"{node.node_id} GPU(s) {failed_gpus} failed ({', '.join(causes)})"
    # A node one of whose GPUs failed (XID, double-bit ECC) takes nothing new until it comes
    # back UP: its other GPUs share its board, power and driver, and repair takes it down.
    schedulable = takes_new_work(node, status) and not failed
    if not schedulable:
        healthy = degraded = 0
    islands = tuple(mask_of(i) for i in node.islands) or (present,)
    facts = NodeFacts(
        node_id=node.node_id,
        cluster_id=node.cluster_id,
        leaf=node.leaf_switch or "unknown",
        spine=node.spine_switch or "unknown",
        accelerator=node.accelerator,
        islands=islands,
        present=present,
        healthy=healthy,
        degraded=degraded,
        status=status,
        schedulable=schedulable,
    )
    return NodeCapacity(facts, lost_mask, reason, bad)


def cluster_health(
    *, nodes: int, unreachable: int, gpus: int, unusable: int, retired: bool, declared: str | None
) -> ClusterHealth:
    """A cluster's health word from its node counts (`unusable`: the sum of its nodes'
    `NodeCapacity.bad`) and what the fleet tables say of it: retired, or the health fold's
    word (lost, suspect, recovering, cordoned). The API and the scheduler both read it here."""
    if retired:
        return ClusterHealth.RETIRED
    if declared is not None:
        return ClusterHealth(declared)
    if nodes == 0:
        return ClusterHealth.EMPTY
    if unreachable == nodes:
        return ClusterHealth.UNREACHABLE
    if unreachable or (gpus and unusable / gpus > 0.1):
        return ClusterHealth.DEGRADED
    return ClusterHealth.HEALTHY


def cluster_terms(view: ResourceView) -> dict[str, ClusterTerms]:
    """Every cluster the fleet tables name (declared, or with a declared health), by id."""
    out = {}
    for cluster_id in sorted(set(view.clusters) | set(view.cluster_health)):
        info = view.clusters.get(cluster_id)
        declared = view.cluster_health.get(cluster_id)
        out[cluster_id] = ClusterTerms(
            region=info.region if info else "",
            kind=info.kind if info else "UNKNOWN",
            price_per_gpu_hour=(info.price_per_gpu_hour or 0.0) if info else 0.0,
            energy_price_per_kwh=(info.energy_price_per_kwh or 0.0) if info else 0.0,
            pue=(info.pue or 1.0) if info else 1.0,
            link_latency_ms=dict(info.link_latency_ms) if info else {},
            declared=info is not None,
            retired=bool(info and info.retired),
            health=declared.word if declared is not None else None,
            health_reason=declared.reason if declared is not None else "",
        )
    return out


# -- the records -------------------------------------------------------------------------------


def nodes_key(cluster_id: str, part: str) -> str:
    return f"nodes/{cluster_id}/{part}"


def _empty(
    kind: str, key: str, part: str, cluster_id: str = "", region: str = ""
) -> dict[str, Any]:
    return {
        "kind": kind,
        "key": key,
        "cluster_id": cluster_id,
        "region": region,
        "part": part,
        "nodes": [],
        "cluster": None,
        "dataset": None,
    }


def capacity_record(capacity: NodeCapacity) -> dict[str, Any]:
    f = capacity.facts
    return {
        "node_id": f.node_id,
        "leaf": f.leaf,
        "spine": f.spine,
        "model": f.accelerator.model,
        "vendor": f.accelerator.vendor,
        "gpu_memory_mib": f.accelerator.memory_mib,
        "islands": list(f.islands),
        "present": f.present,
        "healthy": f.healthy,
        "degraded": f.degraded,
        "status": f.status,
        "schedulable": f.schedulable,
        "lost": capacity.lost,
        "lost_reason": capacity.lost_reason,
        "bad": capacity.bad,
    }


def capacity_of(cluster_id: str, record: Mapping[str, Any]) -> NodeCapacity:
    facts = NodeFacts(
        node_id=record["node_id"],
        cluster_id=cluster_id,
        leaf=record["leaf"],
        spine=record["spine"],
        accelerator=Accelerator(
            vendor=record["vendor"],
            model=normalise_model(record["model"]),  # a v1 summary's is the label, lower case
            memory_mib=record["gpu_memory_mib"],
        ),
        islands=tuple(record["islands"]),
        present=record["present"],
        healthy=record["healthy"],
        degraded=record["degraded"],
        status=record["status"],
        schedulable=record["schedulable"],
    )
    return NodeCapacity(facts, record["lost"], record["lost_reason"], record["bad"])


def terms_record(terms: ClusterTerms) -> dict[str, Any]:
    return {
        "kind": terms.kind,
        "price_per_gpu_hour": terms.price_per_gpu_hour,
        "energy_price_per_kwh": terms.energy_price_per_kwh,
        "pue": terms.pue,
        "link_latency_ms": dict(sorted(terms.link_latency_ms.items())),
        "declared": terms.declared,
        "retired": terms.retired,
        "health": terms.health,
        "health_reason": terms.health_reason,
    }


def terms_of(region: str, record: Mapping[str, Any]) -> ClusterTerms:
    return ClusterTerms(
        region=region,
        kind=record["kind"],
        price_per_gpu_hour=record["price_per_gpu_hour"],
        energy_price_per_kwh=record["energy_price_per_kwh"],
        pue=record["pue"],
        link_latency_ms=dict(record["link_latency_ms"]),
        declared=record["declared"],
        retired=record["retired"],
        health=record["health"],
        health_reason=record["health_reason"],
    )


# node id -> (the view's node object, its epoch, its status, its capacity record)
SummaryCache = dict[str, tuple[NodeView, int, str, dict[str, Any]]]


def summarize(
    parts: Mapping[str, ResourceView],
    watermark_ms: int | None = None,
    cache: SummaryCache | None = None,
) -> dict[str, dict[str, Any]]:
    """The summaries of the view parts an instance holds, by key: one per (cluster, shard) with
    nodes, and the fleet tables' when it holds `FLEET_PUBLISHER`. A node's status is judged
    against `watermark_ms` (default: the latest event time of any part), as a whole view's is.

    With `cache` (kept by the caller between calls over the same live parts), a node whose
    object, epoch and status are unchanged keeps its record: summarising 10,000 nodes then
    costs a lookup each, and an unchanged summary is equal item for item."""
    if watermark_ms is None:
        watermark_ms = max((p.watermark_ms for p in parts.values()), default=0)
    cache = {} if cache is None else cache
    out: dict[str, dict[str, Any]] = {}
    for part, view in sorted(parts.items()):
        judge = ResourceView(policy=view.policy, watermark_ms=watermark_ms)
        for node_id in sorted(view.nodes):
            node = view.nodes[node_id]
            status = node_status(judge, node)
            entry = cache.get(node_id)
            if (
                entry is None
                or entry[0] is not node
                or entry[1] != node.epoch
                or entry[2] != status
            ):
                entry = cache[node_id] = (
                    node,
                    node.epoch,
                    status,
                    capacity_record(node_capacity(node, status)),
                )
            key = nodes_key(node.cluster_id, part)
            record = out.get(key)
            if record is None:
                record = out[key] = _empty(NODES, key, part, node.cluster_id, node.region)
            record["nodes"].append(entry[3])
    if FLEET_PUBLISHER in parts:
        fleet = max(parts.values(), key=lambda p: p.fleet_events)
        for cluster_id, terms in cluster_terms(fleet).items():
            key = f"cluster/{cluster_id}"
            out[key] = _empty(CLUSTER, key, "fleet", cluster_id, terms.region)
            out[key]["cluster"] = terms_record(terms)
        for dataset_id, info in sorted(fleet.datasets.items()):
            key = f"dataset/{dataset_id}"
            out[key] = _empty(DATASET, key, "fleet")
            out[key]["dataset"] = {
                "dataset_id": dataset_id,
                "tenant": info.tenant,
                "size_bytes": info.size_bytes,
                "replicas": list(info.replicas),
            }
    return out


def owned_by(key: str, parts: Iterable[str]) -> bool:
    """Whether the holder of `parts` publishes `key` (so may remove it when it is gone)."""
    held = set(parts)
    if key.startswith("nodes/"):
        return key.rsplit("/", 1)[-1] in held
    return FLEET_PUBLISHER in held
