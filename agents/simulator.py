"""A deterministic simulated fleet: clusters in regions, nodes of 8 GPUs in NVLink islands.

Everything comes from the seed and the event times the caller passes in; no clock, no global
randomness, so two simulators with one seed emit identical records.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field
from typing import Any

GPUS_PER_NODE = 8
ISLAND_SIZE = 4
NODES_PER_LEAF = 4
H100_FB_MIB = 81559
DAY_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class ClusterSpec:
    cluster_id: str
    region: str
    nodes: int
    model: str = "NVIDIA H100 80GB HBM3"


@dataclass(frozen=True)
class SimNode:
    cluster_id: str
    region: str
    node_id: str
    model: str
    leaf_switch: str
    spine_switch: str
    # Per-GPU load bias in [0, 1): some GPUs run busy jobs, some sit idle.
    load_bias: tuple[float, ...]
    gpu_uuids: tuple[str, ...]


def default_clusters(nodes_per_cluster: int = 4) -> list[ClusterSpec]:
    return [
        ClusterSpec("eu-west-a", "eu-west", nodes_per_cluster),
        ClusterSpec("us-east-a", "us-east", nodes_per_cluster),
        ClusterSpec("ap-south-a", "ap-south", nodes_per_cluster, model="NVIDIA H200"),
    ]


def _uuid(seed: int, node_id: str, index: int) -> str:
    digest = f"{zlib.crc32(f'{seed}/{node_id}/{index}'.encode()):08x}"
    return f"GPU-{digest}-{index:04x}-{seed & 0xFFFF:04x}-{len(node_id):04x}-{digest}{index:04x}"


@dataclass
class FleetSimulator:
    clusters: list[ClusterSpec]
    seed: int
    interval_ms: int = 1000
    nodes: list[SimNode] = field(init=False)
    _rng: random.Random = field(init=False, repr=False)
    _seq: dict[str, int] = field(init=False, repr=False)
    _ecc_sbe: dict[str, int] = field(init=False, repr=False)
    _down: set[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self.nodes = []
        for cluster in self.clusters:
            for n in range(cluster.nodes):
                node_id = f"{cluster.cluster_id}-n{n:04d}"
                self.nodes.append(SimNode(
                    cluster_id=cluster.cluster_id, region=cluster.region, node_id=node_id,
                    model=cluster.model,
                    leaf_switch=f"{cluster.cluster_id}-leaf{n // NODES_PER_LEAF:03d}",
                    spine_switch=f"{cluster.cluster_id}-spine0",
                    load_bias=tuple(self._rng.random() for _ in range(GPUS_PER_NODE)),
                    gpu_uuids=tuple(_uuid(self.seed, node_id, i) for i in range(GPUS_PER_NODE)),
                ))
        self._seq = {node.node_id: 0 for node in self.nodes}
        self._ecc_sbe = {}
        self._down = set()

    def _next_seq(self, node_id: str) -> int:
        self._seq[node_id] += 1
        return self._seq[node_id]

    def node_state(self, node: SimNode, ts_ms: int, state: str = "UP",
                   reason: str | None = None) -> dict[str, Any]:
        return {
            "cluster_id": node.cluster_id, "region": node.region, "node_id": node.node_id,
            "seq": self._next_seq(node.node_id), "ts": ts_ms, "state": state, "reason": reason,
            "labels": {"accelerator": node.model, "pool": "training"},
            "topology": {
                "gpu_count": GPUS_PER_NODE,
                "nvlink_islands": [list(range(i, i + ISLAND_SIZE))
                                   for i in range(0, GPUS_PER_NODE, ISLAND_SIZE)],
                "leaf_switch": node.leaf_switch, "spine_switch": node.spine_switch,
            },
        }

    def initial_states(self, ts_ms: int) -> list[dict[str, Any]]:
        return [self.node_state(node, ts_ms) for node in self.nodes]

    def take_down(self, node_id: str, ts_ms: int, reason: str) -> dict[str, Any]:
        """Mark a node DOWN: it emits this state and no telemetry afterwards."""
        node = next(n for n in self.nodes if n.node_id == node_id)
        self._down.add(node_id)
        return self.node_state(node, ts_ms, "DOWN", reason)

    def telemetry(self, ts_ms: int) -> list[dict[str, Any]]:
        """One NodeTelemetry record per node that is up, for the interval ending at `ts_ms`."""
        # Diurnal load: busiest mid-afternoon UTC, quietest before dawn.
        diurnal = 0.5 + 0.35 * math.sin(2 * math.pi * ((ts_ms % DAY_MS) / DAY_MS - 0.375))
        records = []
        rng = self._rng
        for node in self.nodes:
            if node.node_id in self._down:
                continue
            gpus = []
            for index in range(GPUS_PER_NODE):
                bias = node.load_bias[index]
                util = min(100.0, max(0.0, 100 * (0.6 * bias + 0.4 * diurnal)
                                      + rng.gauss(0, 4)))
                busy = util / 100
                key = f"{node.node_id}/{index}"
                if rng.random() < 0.001:
                    self._ecc_sbe[key] = self._ecc_sbe.get(key, 0) + 1
                gpus.append({
                    "gpu_index": index,
                    "gpu_uuid": node.gpu_uuids[index],
                    "vendor": "nvidia",
                    "model": node.model,
                    "gpu_util_pct": round(util, 2),
                    "mem_copy_util_pct": round(util * 0.7, 2),
                    "fb_used_mib": int(H100_FB_MIB * min(0.98, 0.05 + 0.9 * bias)),
                    "fb_total_mib": H100_FB_MIB,
                    "nvlink_tx_bytes_per_s": busy * 180e9 * (0.9 + 0.2 * rng.random()),
                    "nvlink_rx_bytes_per_s": busy * 180e9 * (0.9 + 0.2 * rng.random()),
                    "nvlink_errors_total": 0,
                    "rdma_packet_loss_ratio": abs(rng.gauss(0, 1e-6)),
                    "temperature_c": round(32 + 45 * busy + rng.gauss(0, 1), 1),
                    "power_w": round(90 + 600 * busy + rng.gauss(0, 10), 1),
                    "ecc_sbe_total": self._ecc_sbe.get(key, 0),
                    "ecc_dbe_total": 0,
                    "xid_codes": [],
                })
            records.append({
                "cluster_id": node.cluster_id, "region": node.region, "node_id": node.node_id,
                "seq": self._next_seq(node.node_id), "ts": ts_ms,
                "interval_ms": self.interval_ms, "gpus": gpus,
            })
        return records
