"""The API's request and response bodies, so OpenAPI shows what each route takes and gives.

Responses keep fields they do not declare (`extra="allow"`): a field added to a read of the
view reaches callers before its model names it, and nothing is silently dropped.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from fleetline.processors.view.model import ClusterHealth, Health, NodeStatus
from fleetline.processors.view.read import CapacityState

T = TypeVar("T")


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class AsOf(Body):
    """How a view read with `?at=` was reached: a replay of the log to that moment."""

    at_ms: int = Field(description="the moment asked for (epoch ms)")
    offsets: dict[str, dict[str, int]] = Field(
        description="the log position at that moment: topic -> partition -> next offset"
    )
    from_snapshots: dict[str, int] = Field(description="part -> position of the snapshot used")
    folded: int = Field(description="events folded after the snapshots")
    notes: list[str] = Field(description="what the replay could not use, and what it did instead")


class ViewRead(Body):
    """A read of the view: live, or (with `?at=`) as it stood at a past moment."""

    as_of: AsOf | None = Field(
        default=None, description="set only for a view replayed to `?at=`; null when live"
    )


class Page(ViewRead, Generic[T]):
    """Items read from one version of the view."""

    view_version: int
    watermark_ms: int = Field(description="the highest event time the view has folded (ms)")
    items: list[T]


class HealthPolicyBody(Body):
    nvlink_errors_per_interval: int
    rdma_loss_ratio: float
    degrade_xids: list[int]
    fail_xids: list[int]
    recover_after_samples: int
    unreachable_after_ms: int
    vendor_codes: dict[str, dict[str, list[int]]] = Field(
        default_factory=dict,
        description="other vendors' chip error events: vendor -> degrade and fail codes",
    )


class ViewMeta(ViewRead):
    version: int
    node_events: int
    fleet_events: int
    watermark_ms: int
    offsets: dict[str, dict[str, int]] = Field(description="topic -> partition -> next offset")
    clusters: int
    nodes: int
    gpus: int
    policy: HealthPolicyBody


class ClusterFactsBody(Body):
    cluster_id: str
    region: str
    kind: str
    price_per_gpu_hour: float | None
    energy_price_per_kwh: float | None
    pue: float | None
    link_latency_ms: dict[str, float]
    retired: bool
    seq: int
    ts: int


class ClusterControlBody(Body):
    cluster_id: str
    state: str = Field(description="HEALTHY, SUSPECT, UNHEALTHY (lost) or RECOVERING")
    since_ms: int
    cordoned: bool
    reason: str
    seq: int
    ts: int
    broken_links: list[str] = Field(description="peers this cluster cannot reach or be reached by")


class ClusterCapacity(Body):
    cluster_id: str
    region: str
    health: ClusterHealth
    gpus: int
    idle: int
    allocated: int
    degraded: int
    failed: int
    unavailable: int
    nodes: int
    nodes_up: int
    nodes_draining: int
    nodes_down: int
    nodes_unreachable: int
    nodes_cordoned: int = Field(description="UP, but taking no new work (CORDON)")
    info: ClusterFactsBody | None = Field(description="what the cluster's operator declared")
    control: ClusterControlBody | None = Field(
        default=None, description="the cluster health fold's last word on it (emergency topic)"
    )


class OneCluster(ClusterCapacity, ViewRead):
    view_version: int


class Gpu(Body):
    node_id: str
    cluster_id: str
    gpu_index: int
    gpu_uuid: str
    model: str
    gpu_util_pct: float
    fb_used_mib: int
    fb_total_mib: int
    temperature_c: float
    power_w: float
    health: Health
    cause: str | None
    health_since_ms: int
    capacity: CapacityState
    job_id: str | None = Field(description="only for the caller's own tenant's jobs")
    last_ts: int


class NodeAccelerator(Body):
    vendor: str
    model: str = Field(description="normalised device name, e.g. h100-80gb-hbm3")
    family: str = Field(description="the model's first word, e.g. h100")
    name: str = Field(description="the device's own name, as its driver reports it")
    memory_mib: int = Field(description="memory of the node's smallest GPU; 0: not reported")


class Node(Body):
    node_id: str
    cluster_id: str
    region: str
    status: NodeStatus
    declared_state: str
    reason: str | None
    labels: dict[str, str]
    accelerator: NodeAccelerator
    gpu_count: int
    leaf_switch: str | None
    spine_switch: str | None
    nvlink_islands: list[list[int]]
    last_heard_ms: int
    gpus_healthy: int
    gpus: list[Gpu] | None = None


class OneNode(Node, ViewRead):
    view_version: int


class TopologyNode(Body):
    node_id: str
    status: NodeStatus
    nvlink_islands: list[list[int]]
    degraded_gpus: list[int]


class Leaf(Body):
    leaf_switch: str
    nodes: list[TopologyNode]


class Spine(Body):
    spine_switch: str
    leaves: list[Leaf]


class Topology(ViewRead):
    view_version: int
    cluster_id: str
    spines: list[Spine]


class AllocationBody(Body):
    job_id: str
    tenant: str
    cluster_id: str
    priority: int
    since_ms: int
    gpus: list[str] = Field(description="node/index")


class DatasetBody(Body):
    dataset_id: str
    tenant: str
    size_bytes: int
    replicas: list[str]


class TenantUsageBody(Body):
    tenant: str
    jobs: int
    gpus: int
    by_cluster: dict[str, int]
    dataset_bytes: int | None = None


class AuditItem(Body):
    partition: int
    seq: int
    hash: str
    event_id: str
    ts: int
    actor: str
    operation: str
    outcome: str
    tenant: str | None
    details: dict[str, str]


class AuditPage(Body):
    items: list[AuditItem]


class Activity(Body):
    operation: str
    outcome: str
    calls: int


class ActivityPage(Body):
    items: list[Activity]


class SqlRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str = Field(description="one read-only ClickHouse query; $samples reads every tier")


class SqlResult(Body):
    columns: list[str]
    rows: list[list[Any]]


class Job(Body):
    key: str
    tenant: str
    name: str
    kind: str
    phase: str
    priority: int
    conditions: dict[str, Any]
    allocation: dict[str, dict[str, int]] = Field(description="cluster -> node -> GPU mask")
    document: dict[str, Any] = Field(description="the spec as applied")
    why: str | None = Field(default=None, description="the latest decision's reason")


class JobPage(Body):
    items: list[Job]


class QueuedFit(Body):
    job: str
    tenant: str
    gpus: int
    binding: str = Field(
        description="the constraint that holds it: quota, capacity, reservation, pool, "
        "accelerator, region, reachable, ..."
    )
    why: str = Field(description="the placement's own words for it")
    change: str | None = Field(description="the smallest change that would place it now")
    places_in: str | None = Field(description="where it goes once the change is made")
    checked: bool = Field(description="the placement ran again with the change and placed it")


class QueuePage(Body):
    items: list[QueuedFit]


class Explanation(Body):
    job: str
    phase: str
    conditions: dict[str, Any]
    decision: dict[str, Any] | None = Field(description="the latest SchedulingDecision")
    history: list[dict[str, Any]] | None = None


class Accepted(Body):
    key: str
    kind: str
    request_offset: int


class AcceptedPage(Body):
    trace_id: str = Field(description="the request's trace (`fleetline trace ID`)")
    accepted: list[Accepted]


class Deleted(Body):
    deleted: str
    request_offset: int


class TenantPolicySet(Body):
    tenant: str
    policy: dict[str, Any]
    request_offset: int


class ClusterDeclared(Body):
    cluster_id: str
    offset: int = Field(description="where the declaration landed on the clusters topic")
    record: dict[str, Any] = Field(description="the ClusterInfo record the view folds")


class Me(Body):
    subject: str
    role: str
    tenant: str | None
    permissions: list[str] = Field(description="resource:verb pairs this principal holds")
