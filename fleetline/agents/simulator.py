"""A deterministic simulated fleet with scriptable faults.

Clusters sit in named regions; each node has 8 GPUs in two NVLink islands of four; two nodes
share a leaf switch (16 GPUs behind one leaf), leaves hang off one spine per cluster. About 40% of
GPUs run training jobs (steady, near full); the rest serve inference that follows a diurnal
curve. Faults are data (`Fault`), active over an event-time window:
a GPU degraded by NVLink errors, a leaf switch losing RDMA packets (degrading its 16 GPUs), XID
or double-bit ECC events, a node going down, a whole cluster losing its link to Kafka.

Everything comes from the seed and the event times the caller passes in: no clock, no global
randomness, so two simulators with one seed and one fault script emit identical records.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from fleetline.agents.devices.simulated import ChipProfile, profile
from fleetline.errors import ConfigError
from fleetline.processors.view.accelerators import Accelerator
from fleetline.schemas.records import (
    ClusterInfo,
    GpuSample,
    NodeLifecycle,
    NodeState,
    NodeTelemetry,
)

GPUS_PER_NODE = 8  # the NVIDIA parts' (a node of another chip has its profile's count)
NODES_PER_LEAF = 2
DAY_MS = 24 * 3600 * 1000
AGENT_VERSION = "0.2.0"
# GPUs whose load bias is at least this run training jobs; the others serve inference.
TRAINING_BIAS = 0.6

FAULT_KINDS = ("nvlink_errors", "rdma_loss", "xid", "ecc_dbe", "node_down", "cluster_link_loss")


@dataclass(frozen=True)
class Fault:
    """One scripted fault, active for event times in [start_ms, end_ms) (end None: for ever).

    target: `node_id/gpu_index` for nvlink_errors, xid and ecc_dbe; a leaf switch id for
    rdma_loss; a node id for node_down; a cluster id for cluster_link_loss. value: errors per
    interval (nvlink_errors), loss ratio (rdma_loss), the XID code (xid).
    """

    kind: str
    target: str
    start_ms: int
    end_ms: int | None = None
    value: float = 0.0

    def active(self, ts_ms: int) -> bool:
        return self.start_ms <= ts_ms and (self.end_ms is None or ts_ms < self.end_ms)


def load_faults(source: str | Path | Iterable[Mapping[str, Any]], base_ms: int) -> list[Fault]:
    """Faults from YAML (a path, a YAML string, or parsed items) with times in seconds from base.

    Each item: `{kind, target, at_s, for_s (optional), value (optional)}`.
    """
    if isinstance(source, Path) or (isinstance(source, str) and source.endswith((".yaml", ".yml"))):
        items = yaml.safe_load(Path(source).read_text())
    elif isinstance(source, str):
        items = yaml.safe_load(source)
    else:
        items = list(source)
    faults = []
    for number, item in enumerate(items or [], start=1):
        if not isinstance(item, Mapping):
            raise ConfigError(f"fault {number}: expected a mapping, got {item!r}")
        unknown = set(item) - {"kind", "target", "at_s", "for_s", "value"}
        if unknown:
            raise ConfigError(f"fault {number}: unknown fields {sorted(unknown)}")
        kind = item.get("kind")
        if kind not in FAULT_KINDS:
            raise ConfigError(f"fault {number}: kind must be one of {FAULT_KINDS}, got {kind!r}")
        if not isinstance(item.get("target"), str):
            raise ConfigError(f"fault {number} ({kind}): target is required")
        try:
            start = base_ms + int(float(item.get("at_s", 0)) * 1000)
            end = None if item.get("for_s") is None else start + int(float(item["for_s"]) * 1000)
            value = float(item.get("value", 0.0))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"fault {number} ({kind}): {exc}") from None
        faults.append(Fault(kind, item["target"], start, end, value))
    return faults


@dataclass(frozen=True)
class ClusterSpec:
    cluster_id: str
    region: str
    nodes: int
    model: str = "NVIDIA H100 80GB HBM3"
    # Nodes behind one leaf switch: 2 keeps small test fleets spread over several leaves; a
    # rail-optimised scalable unit puts 16-32 nodes under a leaf.
    nodes_per_leaf: int = NODES_PER_LEAF


@dataclass(frozen=True)
class SimNode:
    cluster_id: str
    region: str
    node_id: str
    model: str
    chip: ChipProfile
    leaf_switch: str
    spine_switch: str
    # Per-GPU load bias in [0, 1): some GPUs run busy jobs, some sit idle.
    load_bias: tuple[float, ...]
    gpu_uuids: tuple[str, ...]


def default_clusters(nodes_per_cluster: int = 4, count: int = 3) -> list[ClusterSpec]:
    """`count` clusters over the three simulated regions: eu-west-a, us-east-a, ap-south-a
    (H200), then eu-west-b, us-east-b, ... (up to 78)."""
    if not 1 <= count <= 3 * 26:
        raise ValueError(f"between 1 and 78 simulated clusters, not {count}")
    regions = ("eu-west", "us-east", "ap-south")
    specs = [
        ClusterSpec(f"{regions[i % 3]}-{chr(ord('a') + i // 3)}", regions[i % 3], nodes_per_cluster)
        for i in range(count)
    ]
    return [replace(c, model="NVIDIA H200") if c.region == "ap-south" else c for c in specs]


# Round-trip times between the simulated regions, ms, and what a GPU-hour and a kWh cost there.
_REGION_RTT_MS = {
    ("eu-west", "us-east"): 75.0,
    ("eu-west", "ap-south"): 120.0,
    ("us-east", "ap-south"): 190.0,
}
_REGION_PRICES = {
    "eu-west": (2.40, 0.21, 1.25),
    "us-east": (2.10, 0.09, 1.35),
    "ap-south": (1.80, 0.11, 1.50),
}


def cluster_info(
    cluster: ClusterSpec, seq: int, ts_ms: int, regions: list[str] | None = None
) -> ClusterInfo:
    """A ClusterInfo record for a simulated cluster: what an operator would declare."""
    price, energy, pue = _REGION_PRICES.get(cluster.region, (2.50, 0.15, 1.40))
    names = regions or sorted({r for pair in _REGION_RTT_MS for r in pair})
    latency = {
        r: (
            0.5
            if r == cluster.region
            else _REGION_RTT_MS.get(
                (cluster.region, r), _REGION_RTT_MS.get((r, cluster.region), 150.0)
            )
        )
        for r in names
    }
    return {
        "cluster_id": cluster.cluster_id,
        "region": cluster.region,
        "seq": seq,
        "ts": ts_ms,
        "kind": "ON_PREMISES" if cluster.region == "eu-west" else "CLOUD",
        "price_per_gpu_hour": price,
        "energy_price_per_kwh": energy,
        "pue": pue,
        "link_latency_ms": latency,
        "retired": False,
    }


RDMA_PACKETS_PER_S = 1_000_000  # a NIC's packets per interval, for the background loss ratio


def _kib(bytes_per_s: float) -> float:
    return float(round(bytes_per_s / 1024) * 1024)


def _uuid(seed: int, node_id: str, index: int) -> str:
    digest = f"{zlib.crc32(f'{seed}/{node_id}/{index}'.encode()):08x}"
    return f"GPU-{digest}-{index:04x}-{seed & 0xFFFF:04x}-{len(node_id):04x}-{digest}{index:04x}"


def _domains(chip: ChipProfile) -> list[list[int]]:
    size = chip.domain_size
    return [list(range(i, min(i + size, chip.per_node))) for i in range(0, chip.per_node, size)]


@dataclass
class FleetSimulator:
    clusters: list[ClusterSpec]
    seed: int
    interval_ms: int = 1000
    faults: list[Fault] = field(default_factory=list)
    nodes: list[SimNode] = field(init=False)
    _rng: random.Random = field(init=False, repr=False)
    _seq: dict[str, int] = field(init=False, repr=False)
    _counters: dict[str, list[int]] = field(init=False, repr=False)
    _down: set[str] = field(init=False, repr=False)
    _power_limit: dict[str, float] = field(init=False, repr=False)
    _fired: set[Fault] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self.nodes = []
        for cluster in self.clusters:
            chip = profile(cluster.model)
            for n in range(cluster.nodes):
                node_id = f"{cluster.cluster_id}-n{n:04d}"
                self.nodes.append(
                    SimNode(
                        cluster_id=cluster.cluster_id,
                        region=cluster.region,
                        node_id=node_id,
                        model=cluster.model,
                        chip=chip,
                        leaf_switch=f"{cluster.cluster_id}-leaf{n // cluster.nodes_per_leaf:03d}",
                        spine_switch=f"{cluster.cluster_id}-spine0",
                        load_bias=tuple(self._rng.random() for _ in range(chip.per_node)),
                        gpu_uuids=tuple(_uuid(self.seed, node_id, i) for i in range(chip.per_node)),
                    )
                )
        self._by_id = {node.node_id: node for node in self.nodes}
        self._seq = {node.node_id: 0 for node in self.nodes}
        # Cumulative per-GPU counters: ECC single-bit, ECC double-bit, NVLink errors.
        self._counters = {}
        self._down = set()
        self._power_limit = {}
        self._fired = set()
        for fault in self.faults:
            self._check_target(fault)

    def _check_target(self, fault: Fault) -> None:
        if fault.kind in ("nvlink_errors", "xid", "ecc_dbe"):
            node_id, _, index = fault.target.rpartition("/")
            ok = (
                node_id in self._by_id
                and index.isdigit()
                and int(index) < self._by_id[node_id].chip.per_node
            )
        elif fault.kind == "rdma_loss":
            ok = any(n.leaf_switch == fault.target for n in self.nodes)
        elif fault.kind == "node_down":
            ok = fault.target in self._by_id
        else:
            ok = any(c.cluster_id == fault.target for c in self.clusters)
        if not ok:
            raise ConfigError(f"{fault.kind} fault: no such target {fault.target!r} in the fleet")

    def add_fault(self, fault: Fault) -> None:
        """Script one more fault (its target must be in the fleet)."""
        self._check_target(fault)
        self.faults.append(fault)

    def node(self, node_id: str) -> SimNode:
        return self._by_id[node_id]

    def _next_seq(self, node_id: str) -> int:
        self._seq[node_id] += 1
        return self._seq[node_id]

    def node_state(
        self,
        node: SimNode,
        ts_ms: int,
        state: NodeLifecycle = "UP",
        reason: str | None = None,
        labels: Mapping[str, str] | None = None,
        spool: tuple[int, int] | None = None,
    ) -> NodeState:
        chip = node.chip
        domains = _domains(chip)
        peers = {str(i): [j for j in domain if j != i] for domain in domains for i in domain}
        return {
            "cluster_id": node.cluster_id,
            "region": node.region,
            "node_id": node.node_id,
            "seq": self._next_seq(node.node_id),
            "ts": ts_ms,
            "state": state,
            "reason": reason,
            "labels": {"pool": "training", **(labels or {})},
            "topology": {
                "gpu_count": chip.per_node,
                "nvlink_islands": domains,
                "leaf_switch": node.leaf_switch,
                "spine_switch": node.spine_switch,
                "gpu_numa_nodes": [i * 2 // chip.per_node for i in range(chip.per_node)],
                "nvlink_peers": peers,
            },
            "agent_version": AGENT_VERSION,
            "agent_spool_bytes": None if spool is None else spool[0],
            "agent_spool_dropped": None if spool is None else spool[1],
            "accelerator": Accelerator.of_device(
                chip.vendor, node.model, chip.memory_mib
            ).as_record(),
        }

    def initial_states(self, ts_ms: int) -> list[NodeState]:
        return [self.node_state(node, ts_ms) for node in self.nodes]

    def take_down(self, node_id: str, ts_ms: int, reason: str) -> NodeState:
        """Mark a node DOWN: it emits this state and no telemetry afterwards."""
        self._down.add(node_id)
        return self.node_state(self._by_id[node_id], ts_ms, "DOWN", reason)

    def sequence_numbers(self) -> dict[str, int]:
        """The last seq each node used; pass to `resume_sequences` after a restart."""
        return dict(self._seq)

    def resume_sequences(self, last: dict[str, int]) -> None:
        for node_id, seq in last.items():
            if node_id in self._seq:
                self._seq[node_id] = max(self._seq[node_id], seq)

    def is_down(self, node_id: str) -> bool:
        return node_id in self._down

    def set_power_limit(self, node_id: str, watts: float) -> None:
        self._power_limit[node_id] = watts

    def power_limit(self, node_id: str) -> float:
        return self._power_limit.get(node_id, self._by_id[node_id].chip.power_limit_w)

    def link_up(self, node_id: str, ts_ms: int) -> bool:
        """False while a cluster_link_loss fault cuts the node's cluster off from Kafka."""
        return self.cluster_link_up(self._by_id[node_id].cluster_id, ts_ms)

    def cluster_link_up(self, cluster_id: str, ts_ms: int) -> bool:
        return not any(
            f.kind == "cluster_link_loss" and f.target == cluster_id and f.active(ts_ms)
            for f in self.faults
        )

    def state_changes(self, ts_ms: int) -> list[NodeState]:
        """NodeState records for node_down faults that start or end at this tick."""
        changes = []
        for fault in self.faults:
            if fault.kind != "node_down":
                continue
            active = fault.active(ts_ms)
            if active and fault.target not in self._down:
                changes.append(self.take_down(fault.target, ts_ms, "simulated node failure"))
            elif (
                not active
                and fault.target in self._down
                and fault.end_ms is not None
                and ts_ms >= fault.end_ms
            ):
                self._down.discard(fault.target)
                changes.append(self.node_state(self._by_id[fault.target], ts_ms, "UP", "recovered"))
        return changes

    def telemetry(self, ts_ms: int) -> list[NodeTelemetry]:
        """One NodeTelemetry record per node that is up, for the interval ending at `ts_ms`."""
        # Diurnal load: busiest mid-afternoon UTC, quietest before dawn.
        diurnal = 0.5 + 0.35 * math.sin(2 * math.pi * ((ts_ms % DAY_MS) / DAY_MS - 0.375))
        active = [f for f in self.faults if f.active(ts_ms)]
        nvlink_faults = {f.target: f.value for f in active if f.kind == "nvlink_errors"}
        rdma_faults = {f.target: f.value for f in active if f.kind == "rdma_loss"}
        xids: dict[str, list[int]] = {}
        dbe: set[str] = set()
        for fault in active:
            if fault.kind in ("xid", "ecc_dbe") and fault not in self._fired:
                self._fired.add(fault)  # an event, raised once
                if fault.kind == "xid":
                    xids.setdefault(fault.target, []).append(int(fault.value))
                else:
                    dbe.add(fault.target)
        out: list[NodeTelemetry] = []
        rng = self._rng
        for node in self.nodes:
            if node.node_id in self._down:
                continue
            limit = self.power_limit(node.node_id)
            loss = rdma_faults.get(node.leaf_switch)
            chip = node.chip
            memory_mib = chip.memory_mib
            gpus: list[GpuSample] = []
            for index in range(chip.per_node):
                bias = node.load_bias[index]
                # A training job runs steady and near full, whatever the hour; inference
                # follows the users' day.
                level = 85 + 12 * bias if bias >= TRAINING_BIAS else 100 * diurnal * (0.4 + bias)
                util = min(100.0, max(0.0, level + rng.gauss(0, 4)))
                busy = util / 100
                key = f"{node.node_id}/{index}"
                counters = self._counters.setdefault(key, [0, 0, 0])
                if rng.random() < 0.001:
                    counters[0] += 1
                if key in dbe:
                    counters[1] += 1
                link_errors = nvlink_faults.get(key)
                if link_errors is not None:
                    counters[2] += max(1, int(link_errors))
                # Errors force replays: a degraded link moves a fraction of the data.
                link_bytes = (
                    (0.3 if link_errors is not None else 1.0) * busy * chip.link_bytes_per_s
                )
                power = min(limit, chip.idle_w + chip.busy_w * busy + rng.gauss(0, 10))
                gpus.append(
                    {
                        "gpu_index": index,
                        "gpu_uuid": node.gpu_uuids[index],
                        "vendor": chip.vendor,
                        "model": node.model,
                        # NVML reports utilisation and temperature in whole percent and degrees.
                        "gpu_util_pct": float(round(util)),
                        "mem_copy_util_pct": float(round(util * 0.7)),
                        "fb_used_mib": int(memory_mib * min(0.98, 0.05 + 0.9 * bias)),
                        "fb_total_mib": memory_mib,
                        # NVML counts throughput in KiB, packets in whole packets: the readings
                        # have the resolution real collectors report, not float noise.
                        "nvlink_tx_bytes_per_s": _kib(link_bytes * (0.9 + 0.2 * rng.random())),
                        "nvlink_rx_bytes_per_s": _kib(link_bytes * (0.9 + 0.2 * rng.random())),
                        "nvlink_errors_total": counters[2],
                        "rdma_packet_loss_ratio": (
                            loss if loss is not None else (rng.random() < 0.3) / RDMA_PACKETS_PER_S
                        ),
                        "temperature_c": float(round(32 + 45 * busy + rng.gauss(0, 1))),
                        "power_w": round(power, 1),
                        "ecc_sbe_total": counters[0],
                        "ecc_dbe_total": counters[1],
                        "xid_codes": xids.get(key, []),
                        "pcie_tx_bytes_per_s": _kib(busy * 20e9),
                        "pcie_rx_bytes_per_s": _kib(busy * 22e9),
                        "sm_clock_mhz": int(
                            chip.sm_clock_mhz * min(1.0, limit / chip.power_limit_w)
                        ),
                        "mem_clock_mhz": chip.mem_clock_mhz,
                        "power_limit_w": limit,
                        "nvlink_links_active": chip.links,
                    }
                )
            out.append(
                {
                    "cluster_id": node.cluster_id,
                    "region": node.region,
                    "node_id": node.node_id,
                    "seq": self._next_seq(node.node_id),
                    "ts": ts_ms,
                    "interval_ms": self.interval_ms,
                    "gpus": gpus,
                    "agent_version": AGENT_VERSION,
                    "collector": "simulator",
                }
            )
        return out
