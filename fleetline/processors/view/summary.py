"""The minimal live view: per-node summaries folded from telemetry and state, per-cluster totals.

`apply` is the pure fold; `LiveViewHandler` is the thin shell that the transactional processor
calls for each message, keeping one summary per node in a changelog-backed store.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from confluent_kafka import Message

from fleetline.errors import InvalidEventError
from fleetline.streams.events import NODE_STATE, NODE_TELEMETRY, check_telemetry
from fleetline.streams.processor import Output
from fleetline.streams.serde import AvroCodec, Decoded
from fleetline.streams.store import ChangelogStore

APPLICATION_ID = "live-view"


@dataclass(frozen=True)
class NodeSummary:
    cluster_id: str
    region: str
    node_id: str
    state: str
    gpus: int
    util_sum: float
    last_seq: int
    last_ts: int


def apply(node: NodeSummary | None, event: Decoded) -> NodeSummary:
    """Fold one event into its node's summary; an event already seen (seq not newer) is a no-op."""
    record = event.record
    if node is not None and record["seq"] <= node.last_seq:
        return node
    match event.schema.full_name:
        case name if name == NODE_TELEMETRY:
            check_telemetry(record)
            utils = [gpu["gpu_util_pct"] for gpu in record["gpus"]]
            base = node or NodeSummary(record["cluster_id"], record["region"], record["node_id"],
                                       "UP", 0, 0.0, 0, 0)
            return replace(base, gpus=len(utils), util_sum=float(sum(utils)),
                           last_seq=record["seq"], last_ts=record["ts"])
        case name if name == NODE_STATE:
            base = node or NodeSummary(record["cluster_id"], record["region"], record["node_id"],
                                       "UP", record["topology"]["gpu_count"], 0.0, 0, 0)
            return replace(base, state=record["state"], last_seq=record["seq"],
                           last_ts=record["ts"])
        case other:
            raise InvalidEventError(f"the live view does not fold {other} events")


@dataclass(frozen=True)
class ClusterSummary:
    cluster_id: str
    region: str
    nodes: int
    nodes_down: int
    gpus: int
    avg_gpu_util_pct: float | None


def summarize(nodes: Iterable[NodeSummary]) -> list[ClusterSummary]:
    """Per-cluster totals; average utilisation counts the GPUs of nodes that are not DOWN."""
    by_cluster: dict[str, list[NodeSummary]] = {}
    for node in nodes:
        by_cluster.setdefault(node.cluster_id, []).append(node)
    clusters = []
    for cluster_id in sorted(by_cluster):
        members = by_cluster[cluster_id]
        live = [n for n in members if n.state != "DOWN"]
        live_gpus = sum(n.gpus for n in live)
        clusters.append(ClusterSummary(
            cluster_id=cluster_id, region=members[0].region, nodes=len(members),
            nodes_down=len(members) - len(live), gpus=sum(n.gpus for n in members),
            avg_gpu_util_pct=(round(sum(n.util_sum for n in live) / live_gpus, 2)
                              if live_gpus else None),
        ))
    return clusters


def _encode(node: NodeSummary) -> bytes:
    return json.dumps(asdict(node), sort_keys=True).encode()


def _decode(data: bytes) -> NodeSummary:
    return NodeSummary(**json.loads(data))


def node_store(changelog_topic: str) -> ChangelogStore[NodeSummary]:
    return ChangelogStore("nodes", changelog_topic, _encode, _decode)


@dataclass
class LiveViewHandler:
    codec: AvroCodec
    store: ChangelogStore[NodeSummary]

    def __call__(self, msg: Message) -> Sequence[Output]:
        event = self.codec.decode(msg.value())
        key = msg.key()
        if key is None or key.decode(errors="replace") != event.record["node_id"]:
            raise InvalidEventError(
                f"message key {key!r} is not the node id {event.record['node_id']!r}"
            )
        before = self.store.get(msg.partition(), key)
        after = apply(before, event)
        if after != before:
            self.store.put(msg.partition(), key, after)
        return ()

    def view(self) -> list[ClusterSummary]:
        return summarize(node for _, node in self.store.items())


def view_as_dict(clusters: Sequence[ClusterSummary]) -> list[dict[str, Any]]:
    return [asdict(c) for c in clusters]
