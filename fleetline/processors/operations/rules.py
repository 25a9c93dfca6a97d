"""Self-healing rules over the resource view: which nodes are unwell, and the readings that say
so. `observe(view, rules)` is what the operations ticker puts in an OBSERVE event: the findings
with their evidence, and each node's load and power limit (for power capping). The fold then
decides on that data alone, so a replay decides the same without the view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from fleetline.errors import InvalidEventError
from fleetline.processors.view.fold import gpu_health, node_status
from fleetline.processors.view.model import (
    DEGRADED,
    FAILED,
    NodeStatus,
    ResourceView,
)

# The rules judged on a GPU's latest readings (the rest on its health and its node's silence).
READING_RULES = frozenset({"rdma_loss", "thermal", "power"})
Settings = TypeVar("Settings")


def settings_from(cls: type[Settings], data: Mapping[str, Any], what: str) -> Settings:
    """A frozen settings dataclass from plain data: every key one of its fields, each value
    converted to its default's type; InvalidEventError naming `what` otherwise."""
    base = cls()
    known = set(asdict(base))  # type: ignore[call-overload]
    unknown = set(data) - known
    if unknown:
        raise InvalidEventError(f"{what}: unknown fields {sorted(unknown)}; known: {sorted(known)}")
    try:
        return cls(**{k: type(getattr(base, k))(v) for k, v in data.items()})
    except (TypeError, ValueError) as exc:
        raise InvalidEventError(f"{what}: {exc}") from None


CRITICAL = "CRITICAL"  # the node's work is at risk now: cordon and drain
WARNING = "WARNING"  # the node runs, but worse: cordon and drain before it fails


@dataclass(frozen=True)
class HealingRules:
    """When a node trips a rule (thresholds per reading; GPU failures are the view's own, from
    its HealthPolicy: fatal XIDs, double-bit ECC).

    A GPU the view calls degraded (NVLink errors or links down, row remapping, RDMA loss past
    0.1 %) stays in service by default: the scheduler keeps communication-heavy work off it and
    light work may use it; with `degraded_trips` it opens a ticket. Past `rdma_loss_ratio` (5 %)
    the fabric needs a repair, and the node is taken out either way."""

    rdma_loss_ratio: float = 0.05
    max_temperature_c: float = 90.0
    # Drawing more than this share of its power limit is a sensor or regulator fault.
    power_over_limit: float = 1.10
    silent_after_ms: int = 30_000
    degraded_trips: bool = False  # a degraded GPU (view) opens a ticket, not only a failed one

    def as_data(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> HealingRules:
        return settings_from(cls, data, "healing rules")


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


_SHOWN = (
    "xid_codes",
    "ecc_dbe_total",
    "nvlink_errors_total",
    "rdma_packet_loss_ratio",
    "temperature_c",
    "power_w",
    "power_limit_w",
)


def node_findings(
    view: ResourceView,
    node_id: str,
    rules: HealingRules,
    readings: bool = True,
    health_cache: dict[str, tuple[int, list[Finding]]] | None = None,
) -> list[Finding]:
    """What is wrong with one node, each with the readings that show it: its silence and its
    GPUs' health always, the thresholds on its latest readings when `readings` (a scan of every
    GPU's sample, which the ticker makes less often). Without `readings`, what the GPUs' health
    says is kept in `health_cache` by the node's epoch (which any change of it bumps)."""
    node = view.nodes[node_id]
    status = node_status(view, node)
    silent_ms = view.watermark_ms - node.last_heard_ms
    if status in (NodeStatus.DOWN, NodeStatus.UNREACHABLE) or silent_ms > rules.silent_after_ms:
        summary = (
            f"{node_id} is down" + (f" ({node.reason})" if node.reason else "")
            if status == NodeStatus.DOWN
            else f"{node_id} silent for {silent_ms / 1000:.1f} s"
        )
        heard = {"status": status.value, "last_heard_ms": node.last_heard_ms}
        # Its readings are stale: judging them would add nothing.
        return [Finding(node_id, node.cluster_id, "node_silent", CRITICAL, summary, heard)]
    if not readings and health_cache is not None:
        cached = health_cache.get(node_id)
        if cached is not None and cached[0] == node.epoch:
            return cached[1]
    out: list[Finding] = []
    for index in sorted(node.gpus):
        gpu = node.gpus[index]
        health, cause = gpu_health(node, gpu)
        sample = gpu.sample
        hits: list[tuple[str, str, str]] = []
        if health == FAILED:
            hits.append(("gpu_failed", CRITICAL, f"GPU {index} failed: {cause}"))
        elif health == DEGRADED and rules.degraded_trips:
            hits.append(("gpu_degraded", WARNING, f"GPU {index} degraded: {cause}"))
        if readings and health != FAILED:
            loss = sample.rdma_packet_loss_ratio or 0.0
            if loss > rules.rdma_loss_ratio and not (health == DEGRADED and rules.degraded_trips):
                hits.append(("rdma_loss", WARNING, f"GPU {index} RDMA loss {loss:.2e}"))
            temperature = sample.temperature_c
            if temperature is not None and temperature > rules.max_temperature_c:
                hits.append(("thermal", WARNING, f"GPU {index} at {temperature:.0f} C"))
            power, limit = sample.power_w, sample.power_limit_w
            if power is not None and limit and power > limit * rules.power_over_limit:
                summary = f"GPU {index} draws {power:.0f} W over its {limit:.0f} W"
                hits.append(("power", WARNING, summary))
        if not hits:
            continue
        # The evidence is built only for a GPU that tripped something.
        evidence: dict[str, Any] = {
            "gpu": index,
            "gpu_uuid": gpu.uuid,
            "sample_ts": gpu.last_ts,
            "cause": cause,
            **{name: getattr(sample, name) for name in _SHOWN},
        }
        for rule, severity, summary in hits:
            out.append(Finding(node_id, node.cluster_id, rule, severity, summary, evidence))
    if not readings and health_cache is not None:
        health_cache[node_id] = (node.epoch, out)
    return out


NodeLoad = tuple[str, int, int, float]  # cluster, GPUs allocated, GPUs present, power limit W


def allocated_gpus(view: ResourceView) -> dict[str, int]:
    """GPUs allocated per node, from one pass over the allocation stream's GPU owners."""
    out: dict[str, int] = {}
    for node_id, _ in view.gpu_owner:
        out[node_id] = out.get(node_id, 0) + 1
    return out


def node_load(
    view: ResourceView, node_id: str, allocated: int, power_limit_w: float | None = None
) -> NodeLoad:
    """What power capping reads of a node: GPUs allocated, GPUs present and the highest power
    limit its GPUs report (read from the samples unless given)."""
    node = view.nodes[node_id]
    if power_limit_w is None:
        power_limit_w = max(
            (g.sample.power_limit_w or 0.0 for g in node.gpus.values()), default=0.0
        )
    return node.cluster_id, allocated, len(node.gpus), float(power_limit_w)


@dataclass(frozen=True)
class Observation:
    findings: list[Finding]
    loads: dict[str, NodeLoad]
    # Clusters the health fold declared lost, suspect or recovering: their nodes are not judged
    # (a cluster's loss is the health fold's to handle; repairing its nodes one by one would
    # keep them out when it comes back), and no burn-in there concludes.
    skipped_clusters: list[str]


def observe(
    view: ResourceView,
    rules: HealingRules,
    readings: bool = True,
    limits: Mapping[str, float] | None = None,
    health_cache: dict[str, tuple[int, list[Finding]]] | None = None,
) -> Observation:
    """Every finding in the view and every judged node's load. Without `readings` only
    silence and GPU health are judged (a node whose epoch has not moved answers from
    `health_cache`), and power limits come from `limits` (what an earlier full observation
    read) where known."""
    findings: list[Finding] = []
    loads: dict[str, NodeLoad] = {}
    skipped = sorted(
        c
        for c, declared in view.cluster_health.items()
        if declared.word in ("lost", "suspect", "recovering")
    )
    allocated = allocated_gpus(view)
    known = limits or {}
    for node_id in sorted(view.nodes):
        if view.nodes[node_id].cluster_id in skipped:
            continue
        findings.extend(node_findings(view, node_id, rules, readings, health_cache))
        limit = None if readings else known.get(node_id)
        loads[node_id] = node_load(view, node_id, allocated.get(node_id, 0), limit)
    return Observation(findings, loads, skipped)
