"""The resource view's data: GPUs, nodes, clusters, datasets, allocations and their health.

`fold.apply` changes these; `read` derives capacity and topology from them. Nothing here reads a
clock or does I/O.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from operator import itemgetter
from typing import Any, NamedTuple

from fleetline.processors.view.accelerators import UNKNOWN, Accelerator
from fleetline.processors.view.catalogue import Capability, Catalogue, builtin


class Health(StrEnum):
    """What a GPU's telemetry says of it (joined with its node's reboots by `gpu_health`)."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"  # usable, but not by communication-heavy work
    FAILED = "failed"  # out until its node comes back up


class NodeStatus(StrEnum):
    """What a node declared (UP, DRAINING, DOWN), or UNREACHABLE when it went silent."""

    UP = "UP"
    DRAINING = "DRAINING"
    DOWN = "DOWN"
    UNREACHABLE = "UNREACHABLE"


class ClusterHealth(StrEnum):
    """One word for a cluster, the same for the API's readers and the scheduler's facts
    (`summary.cluster_health` gives it)."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"  # some nodes out of reach, or over 10 % of its GPUs not usable
    UNREACHABLE = "unreachable"  # every node out of reach
    RETIRED = "retired"  # its operator took it out of the pool
    EMPTY = "empty"  # no node reports from it
    # From the cluster health fold (the emergency topic): its agent's heartbeats and peers.
    SUSPECT = "suspect"  # silent a moment: keeps its jobs, takes none
    LOST = "lost"  # declared lost: out of the pool, its jobs moved
    RECOVERING = "recovering"  # back, on probation
    CORDONED = "cordoned"  # an operator took new work away from it

    @property
    def takes_work(self) -> bool:
        """New work may be placed there."""
        return self in (ClusterHealth.HEALTHY, ClusterHealth.DEGRADED)


HEALTHY, DEGRADED, FAILED = Health.HEALTHY, Health.DEGRADED, Health.FAILED

# The NodeState label a node agent sets to "true" while the node is cordoned.
CORDONED_LABEL = "cordoned"


class Sample(NamedTuple):
    """One GPU's latest readings as the fold keeps them: the GpuSample fields the view reads,
    from a decoded record (`gpu_sample`) or from the columnar decoder (streams/columnar.py)."""

    gpu_index: int
    gpu_uuid: str
    model: str
    gpu_util_pct: float
    mem_copy_util_pct: float | None
    fb_used_mib: int
    fb_total_mib: int
    nvlink_tx_bytes_per_s: float | None
    nvlink_rx_bytes_per_s: float | None
    nvlink_errors_total: int | None
    rdma_packet_loss_ratio: float | None
    temperature_c: float
    power_w: float
    power_limit_w: float | None
    ecc_sbe_total: int
    ecc_dbe_total: int
    xid_codes: list[int]


GPU_FIELDS: tuple[str, ...] = Sample._fields
_gpu_values = itemgetter(*GPU_FIELDS)
# A row of exactly the GPU_FIELDS as a Sample, without `_make`'s classmethod call and length
# check (the rows come from `gpu_sample` or the columnar decoder): once per GPU folded.
sample_of_row: Callable[[Iterable[Any]], Sample] = functools.partial(tuple.__new__, Sample)


def gpu_sample(gpu: Mapping[str, Any]) -> Sample:
    """A decoded GpuSample's readings the view keeps."""
    return sample_of_row(_gpu_values(gpu))


# Each vendor's error events that change a chip's health, as its adapter reports them
# (agents/devices/): (vendor, degrade, fail).
VENDOR_CODES: tuple[tuple[str, frozenset[int], frozenset[int]], ...] = (
    # AMD SMI's event notifications (AmdSmiEvtNotificationType): 2 THERMAL_THROTTLE slows the
    # GPU; 3 GPU_PRE_RESET is the driver resetting it after a hang or a fatal RAS error.
    ("amd", frozenset({2}), frozenset({3})),
    # The simulated NPU and TPU families (agents/devices/simulated.py) number theirs as their
    # profiles say: 1xx degrade (link retrain, thermal), 2xx fail (HBM, core or link lost).
    ("simnpu", frozenset({101, 102}), frozenset({201, 202, 203})),
    ("simtpu", frozenset({101, 102}), frozenset({201, 202, 203})),
)


@dataclass(frozen=True)
class HealthPolicy:
    """When a GPU counts as degraded or failed, and a node as unreachable (all in event time).

    A chip's error events (GpuSample `xid_codes`) are numbered by its vendor, and read by the
    vendor its node declared. NVIDIA's XID catalogue: 48 (double-bit ECC), 61/62 (internal
    micro-controller), 79 (fallen off the bus), 95 (uncontained ECC), 119/120 (GSP) take a GPU
    out; 63/64 (row remapping), 74 (NVLink), 92 (high single-bit ECC rate), 94 (contained ECC)
    leave it usable but suspect. Other vendors' codes are in `vendor_codes` (VENDOR_CODES).
    """

    nvlink_errors_per_interval: int = 3
    rdma_loss_ratio: float = 1e-3
    degrade_xids: frozenset[int] = frozenset({63, 64, 74, 92, 94})
    fail_xids: frozenset[int] = frozenset({48, 61, 62, 79, 95, 119, 120})
    recover_after_samples: int = 30
    unreachable_after_ms: int = 10_000
    # vendor -> (codes that degrade a chip, codes that fail it), for vendors other than nvidia.
    vendor_codes: tuple[tuple[str, frozenset[int], frozenset[int]], ...] = field(
        default_factory=lambda: VENDOR_CODES
    )

    def codes(self, vendor: str) -> tuple[frozenset[int], frozenset[int]]:
        """The (degrade, fail) event codes of a vendor's chips; an unknown vendor's events are
        kept in telemetry and judge nothing."""
        if vendor in ("nvidia", "unknown"):  # "unknown": nodes from before NodeState v3
            return self.degrade_xids, self.fail_xids
        for name, degrade, fail in self.vendor_codes:
            if name == vendor:
                return degrade, fail
        return frozenset(), frozenset()

    def as_dict(self) -> dict[str, Any]:
        return {
            "nvlink_errors_per_interval": self.nvlink_errors_per_interval,
            "rdma_loss_ratio": self.rdma_loss_ratio,
            "degrade_xids": sorted(self.degrade_xids),
            "fail_xids": sorted(self.fail_xids),
            "recover_after_samples": self.recover_after_samples,
            "unreachable_after_ms": self.unreachable_after_ms,
            "vendor_codes": {
                vendor: {"degrade": sorted(degrade), "fail": sorted(fail)}
                for vendor, degrade, fail in self.vendor_codes
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HealthPolicy:
        return cls(
            nvlink_errors_per_interval=int(data["nvlink_errors_per_interval"]),
            rdma_loss_ratio=float(data["rdma_loss_ratio"]),
            degrade_xids=frozenset(data["degrade_xids"]),
            fail_xids=frozenset(data["fail_xids"]),
            recover_after_samples=int(data["recover_after_samples"]),
            unreachable_after_ms=int(data["unreachable_after_ms"]),
            # Snapshots from before other vendors were read carry none: the defaults then.
            vendor_codes=tuple(
                (vendor, frozenset(codes["degrade"]), frozenset(codes["fail"]))
                for vendor, codes in sorted(data["vendor_codes"].items())
            )
            if "vendor_codes" in data
            else VENDOR_CODES,
        )


class GpuState:
    """One GPU: its latest sample (a `Sample`, kept whole: unpacking 17 fields per sample
    would cost more than the rest of the fold) and the health its telemetry stream says it has."""

    __slots__ = (
        "cause",
        "clean_samples",
        "failed_at_ms",
        "failure",
        "health",
        "health_since_ms",
        "last_ts",
        "sample",
    )

    def __init__(self, sample: Sample) -> None:
        self.sample = sample
        # HEALTHY or DEGRADED, from the telemetry stream's thresholds, with hysteresis.
        self.health: Health = HEALTHY
        self.cause: str | None = None
        self.health_since_ms = 0
        self.clean_samples = 0
        # A failure (XID, double-bit ECC) stands until the node comes back UP after it, which
        # the node-state stream tells; `gpu_health` joins the two when the view is read.
        self.failure: str | None = None
        self.failed_at_ms: int | None = None
        self.last_ts = 0

    @property
    def index(self) -> int:
        return self.sample.gpu_index

    @property
    def uuid(self) -> str:
        return self.sample.gpu_uuid

    def readings(self) -> dict[str, Any]:
        return self.sample._asdict()


class NodeView:
    """One node: what its state stream declares and what its telemetry stream last said."""

    __slots__ = (
        "accelerator",
        "agent_version",
        "cluster_id",
        "epoch",
        "gpu_count",
        "gpus",
        "islands",
        "labels",
        "leaf_switch",
        "node_id",
        "numa_nodes",
        "nvlink_peers",
        "reason",
        "region",
        "spine_switch",
        "spool_bytes",
        "spool_dropped",
        "state",
        "state_seq",
        "state_ts",
        "telemetry_seq",
        "telemetry_ts",
        "up_since_ms",
    )

    def __init__(self, node_id: str, cluster_id: str, region: str) -> None:
        self.node_id = node_id
        self.cluster_id = cluster_id
        self.region = region
        self.state = NodeStatus.UP
        self.reason: str | None = None
        self.labels: dict[str, str] = {}
        # What its GPUs are, as its agent read them from the hardware (NodeState v3).
        self.accelerator: Accelerator = UNKNOWN
        self.gpu_count = 0
        self.islands: list[list[int]] = []
        self.leaf_switch: str | None = None
        self.spine_switch: str | None = None
        self.numa_nodes: list[int] = []
        self.nvlink_peers: dict[str, list[int]] = {}
        self.agent_version: str | None = None
        self.spool_bytes: int | None = None
        self.spool_dropped: int | None = None
        self.state_seq = 0
        self.state_ts = 0
        # Event time of the last UP that followed a DOWN: failures before it are cleared.
        self.up_since_ms = 0
        self.telemetry_seq = 0
        self.telemetry_ts = 0
        self.gpus: dict[int, GpuState] = {}
        # Bumped whenever something a scheduler reads changes (state, labels, topology, a
        # GPU's health or failure, the GPU set): readers cache what they derive per (node,
        # epoch). Not part of the view's value, and not kept in snapshots.
        self.epoch = 0

    @property
    def cordoned(self) -> bool:
        """Cordoned by its agent (the CORDON command): no new work, running work stays."""
        return self.labels.get(CORDONED_LABEL) == "true"

    def scheduling_facts(self) -> tuple[Any, ...]:
        """What a scheduler reads of the node's declared state; a change bumps `epoch`."""
        return (
            self.state,
            self.reason,
            self.up_since_ms,
            self.accelerator,
            self.cordoned,
            self.islands,
            self.leaf_switch,
            self.spine_switch,
        )

    @property
    def last_heard_ms(self) -> int:
        return max(self.state_ts, self.telemetry_ts)


@dataclass
class ClusterInfo:
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
    # Accelerator models its operator declares (over the shipped catalogue's).
    accelerator_models: tuple[Capability, ...] = ()

    def as_data(self) -> dict[str, Any]:
        """As JSON data (the view's reads and snapshots), its declared models as records."""
        return {
            **vars(self),
            "link_latency_ms": dict(self.link_latency_ms),
            "accelerator_models": [m.as_record() for m in self.accelerator_models],
        }


def declared_catalogue(clusters: Mapping[str, ClusterInfo]) -> Catalogue:
    """The shipped accelerator catalogue with every cluster's declared models over it (in
    cluster id order: where two clusters declare one model, the later id's figures stand)."""
    declared = [m for cid in sorted(clusters) for m in clusters[cid].accelerator_models]
    return builtin().with_declared(declared) if declared else builtin()


@dataclass
class ClusterHealthInfo:
    """A cluster's health as the health processor last declared it (the emergency topic)."""

    cluster_id: str
    state: str  # HEALTHY, SUSPECT, UNHEALTHY, RECOVERING
    since_ms: int
    cordoned: bool
    reason: str
    seq: int
    ts: int
    broken_links: list[str] = field(default_factory=list)

    @property
    def word(self) -> str | None:
        """What it says of the cluster, for readers and the scheduler alike: lost, suspect,
        recovering, cordoned; None when healthy and not cordoned (its nodes decide then)."""
        if self.state != "HEALTHY":
            return {"UNHEALTHY": "lost", "RECOVERING": "recovering"}.get(self.state, "suspect")
        return "cordoned" if self.cordoned else None


@dataclass
class DatasetInfo:
    dataset_id: str
    tenant: str
    size_bytes: int
    replicas: list[str]
    seq: int
    ts: int


@dataclass
class JobAllocation:
    job_id: str
    tenant: str
    cluster_id: str
    priority: int
    gpus: set[tuple[str, int]]
    seq: int
    since_ms: int
    # A small inference replica's eighths of the one GPU it holds, beside other replicas'
    # (None: its GPUs are its own).
    share_eighths: int | None = None


@dataclass(frozen=True)
class Change:
    """A transition the fold saw: what changed, when (event time) and why."""

    ts: int
    entity: str
    entity_id: str
    before: str
    after: str
    cause: str | None = None


@dataclass
class ResourceView:
    """The fold's state. A view over some partitions of the node topics (a shard) and/or the
    fleet topics; `compose` joins shards into the global view."""

    policy: HealthPolicy = field(default_factory=HealthPolicy)
    nodes: dict[str, NodeView] = field(default_factory=dict)
    clusters: dict[str, ClusterInfo] = field(default_factory=dict)
    cluster_health: dict[str, ClusterHealthInfo] = field(default_factory=dict)
    datasets: dict[str, DatasetInfo] = field(default_factory=dict)
    allocations: dict[str, JobAllocation] = field(default_factory=dict)
    # (node_id, gpu_index) -> job_id, kept by the allocation stream alone.
    gpu_owner: dict[tuple[str, int], str] = field(default_factory=dict)
    # topic -> partition -> next offset to fold: where this view stands in the log.
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    # Events folded from the node topics and from the fleet topics: the view's version.
    node_events: int = 0
    fleet_events: int = 0
    # The highest event time seen; a maximum, so it does not depend on interleaving.
    watermark_ms: int = 0
    # Transitions since the owner last drained them (`drain_changes`).
    changes: list[Change] = field(default_factory=list)

    @property
    def version(self) -> int:
        return self.node_events + self.fleet_events

    def advance(self, topic: str, partition: int, offset: int) -> None:
        """Record that the message at `offset` has been folded (or dead-lettered)."""
        self.offsets.setdefault(topic, {})[partition] = offset + 1

    def drain_changes(self) -> list[Change]:
        changes, self.changes = self.changes, []
        return changes


def copy_view(view: ResourceView) -> ResourceView:
    changes, view.changes = view.changes, []
    try:
        return copy.deepcopy(view)
    finally:
        view.changes = changes
