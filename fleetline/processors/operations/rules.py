"""Self-healing rules over the resource view: which nodes are unwell, and the readings that say
so. `observe(view, rules)` is what the operations ticker puts in an OBSERVE event: the findings
with their evidence, and each node's load and power limit (for power capping). The fold then
decides on that data alone, so a replay decides the same without the view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from fleetline.processors.view.fold import gpu_health, node_status
from fleetline.processors.view.model import DEGRADED, FAILED, NodeStatus, ResourceView

CRITICAL = "CRITICAL"  # the node's work is at risk now: cordon and drain
WARNING = "WARNING"  # the node runs, but worse: cordon and drain before it fails


@dataclass(frozen=True)
class HealingRules:
    """When a node trips a rule (thresholds per reading; GPU failures are the view's own, from
    its HealthPolicy: fatal XIDs, double-bit ECC).

    A GPU the view calls degraded (RDMA loss past 0.1 %, NVLink errors) stays in service by
    default: the scheduler keeps communication-heavy work off it and light work may use it.
    Past `rdma_loss_ratio` (5 %) the fabric needs a repair, and the node is taken out."""

    rdma_loss_ratio: float = 0.05
    max_temperature_c: float = 90.0
    # Drawing more than this share of its power limit is a sensor or regulator fault.
    power_over_limit: float = 1.10
    min_nvlink_links: int = 1  # fewer active links than this on a GPU that has links: down
    silent_after_ms: int = 30_000
    degraded_trips: bool = False  # a degraded GPU (view) opens a ticket, not only a failed one

    def as_data(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> HealingRules:
        return cls(**{k: type(getattr(cls(), k))(v) for k, v in data.items()})


@dataclass(frozen=True)
class Finding:
    node_id: str
    cluster_id: str
    rule: str
    severity: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_data(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Finding:
        return cls(**data)


def node_findings(view: ResourceView, node_id: str, rules: HealingRules) -> list[Finding]:
    """What is wrong with one node, each with the readings that show it."""
    node = view.nodes[node_id]
    status = node_status(view, node)
    out: list[Finding] = []

    def found(rule: str, severity: str, summary: str, **evidence: Any) -> None:
        out.append(Finding(node_id, node.cluster_id, rule, severity, summary, evidence))

    silent_ms = view.watermark_ms - node.last_heard_ms
    if status in (NodeStatus.DOWN, NodeStatus.UNREACHABLE) or silent_ms > rules.silent_after_ms:
        found(
            "node_silent",
            CRITICAL,
            f"{node_id} is down" + (f" ({node.reason})" if node.reason else "")
            if status == NodeStatus.DOWN
            else f"{node_id} silent for {silent_ms / 1000:.1f} s",
            status=status.value,
            last_heard_ms=node.last_heard_ms,
            silent_ms=silent_ms,
        )
        return out  # its readings are stale: judging them would add nothing
    for index in sorted(node.gpus):
        gpu = node.gpus[index]
        readings = gpu.readings()
        health, cause = gpu_health(node, gpu)
        shown: dict[str, Any] = {
            k: readings[k]
            for k in (
                "xid_codes",
                "ecc_dbe_total",
                "nvlink_errors_total",
                "nvlink_links_active",
                "rdma_packet_loss_ratio",
                "temperature_c",
                "power_w",
                "power_limit_w",
            )
            if k in readings
        }
        at: dict[str, Any] = {"gpu": index, "gpu_uuid": gpu.uuid, "sample_ts": gpu.last_ts, **shown}
        if health == FAILED:
            found("gpu_failed", CRITICAL, f"GPU {index} failed: {cause}", cause=cause, **at)
            continue
        if health == DEGRADED and rules.degraded_trips:
            found("gpu_degraded", WARNING, f"GPU {index} degraded: {cause}", cause=cause, **at)
        loss = readings.get("rdma_packet_loss_ratio") or 0.0
        if loss > rules.rdma_loss_ratio and not (health == DEGRADED and rules.degraded_trips):
            found("rdma_loss", WARNING, f"GPU {index} RDMA loss {loss:.2e}", **at)
        links = readings.get("nvlink_links_active")
        if links is not None and rules.min_nvlink_links > 0 and links < rules.min_nvlink_links:
            found("nvlink_down", WARNING, f"GPU {index} has {links} NVLink links up", **at)
        temperature = readings.get("temperature_c")
        if temperature is not None and temperature > rules.max_temperature_c:
            found("thermal", WARNING, f"GPU {index} at {temperature:.0f} C", **at)
        power, limit = readings.get("power_w"), readings.get("power_limit_w")
        if power is not None and limit and power > limit * rules.power_over_limit:
            found("power", WARNING, f"GPU {index} draws {power:.0f} W over its {limit:.0f} W", **at)
    return out


NodeLoad = tuple[str, int, int, float]  # cluster, GPUs allocated, GPUs present, power limit W


def node_load(view: ResourceView, node_id: str) -> NodeLoad:
    """What power capping reads of a node: GPUs allocated (the allocation stream), GPUs present
    and the highest power limit its GPUs report."""
    node = view.nodes[node_id]
    allocated = sum(1 for index in node.gpus if (node_id, index) in view.gpu_owner)
    limits = [g.readings().get("power_limit_w") or 0.0 for g in node.gpus.values()]
    return node.cluster_id, allocated, len(node.gpus), float(max(limits, default=0.0))


@dataclass(frozen=True)
class Observation:
    findings: list[Finding]
    loads: dict[str, NodeLoad]
    # Clusters the health fold declared lost, suspect or recovering: their nodes are not judged
    # (a cluster's loss is the health fold's to handle; repairing its nodes one by one would
    # keep them out when it comes back), and no burn-in there concludes.
    skipped_clusters: list[str]


def observe(view: ResourceView, rules: HealingRules) -> Observation:
    """Every finding in the view and every judged node's load."""
    findings: list[Finding] = []
    loads: dict[str, NodeLoad] = {}
    skipped = sorted(
        c
        for c, declared in view.cluster_health.items()
        if declared.word in ("lost", "suspect", "recovering")
    )
    for node_id in sorted(view.nodes):
        if view.nodes[node_id].cluster_id in skipped:
            continue
        findings.extend(node_findings(view, node_id, rules))
        loads[node_id] = node_load(view, node_id)
    return Observation(findings, loads, skipped)
