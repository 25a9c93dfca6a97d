"""NodeState history in ClickHouse: every state a node declared, for "when was it down" queries
(the compacted state topic keeps only each node's latest).

A state an agent sends again after a crash or an outage (acknowledged by Kafka but not yet in
its spool's mark) has the seq of the one already stored, at another offset: it is dropped by its
per-node seq, as the sample sink drops repeated telemetry (the chaos suite's SIGKILL loops
found such repeats stored twice)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clickhouse_connect.driver.client import Client

from fleetline.errors import StorageError
from fleetline.storage.clickhouse import CLICKHOUSE_ERRORS
from fleetline.storage.sinks import Destination, Sourced, table_node_seqs, table_resume_offsets

TABLE = "node_states"
_COLUMNS = (
    "ts_ms",
    "cluster_id",
    "region",
    "node_id",
    "seq",
    "state",
    "reason",
    "labels",
    "gpu_count",
    "leaf_switch",
    "spine_switch",
    "agent_version",
    "agent_spool_bytes",
    "agent_spool_dropped",
    "source_partition",
    "source_offset",
    "source_topic",
)


def _row(item: Sourced) -> list[Any]:
    r = item.record
    topology = r["topology"]
    return [
        r["ts"],
        r["cluster_id"],
        r["region"],
        r["node_id"],
        r["seq"],
        r["state"],
        r["reason"],
        dict(r["labels"]),
        topology["gpu_count"],
        topology["leaf_switch"],
        topology["spine_switch"],
        r.get("agent_version", "unknown"),
        r.get("agent_spool_bytes"),
        r.get("agent_spool_dropped"),
        item.partition,
        item.offset,
        item.topic,
    ]


class NodeStateTable(Destination):
    name = "node-states"

    def __init__(self, client: Client, database: str) -> None:
        self.client = client
        self.database = database
        # The highest seq stored per (topic, node): read from the table when a topic is first
        # stored after a (re)start, then kept up as batches are stored.
        self._seen: dict[str, dict[str, int]] = {}

    def resume_offsets(self, topic: str) -> dict[int, int]:
        self._seen.pop(topic, None)  # a restart or rebalance: the table is the truth
        return table_resume_offsets(self.client, f"{self.database}.{TABLE}", topic)

    def _highest_seqs(self, topic: str) -> dict[str, int]:
        seen = self._seen.get(topic)
        if seen is None:
            seen = self._seen[topic] = table_node_seqs(
                self.client, f"{self.database}.{TABLE}", topic
            )
        return seen

    def store(self, batch: Sequence[Sourced]) -> None:
        fresh = []
        highest: dict[tuple[str, str], int] = {}  # what this batch adds, kept once it is stored
        for item in batch:
            node_id, seq = item.record["node_id"], item.record["seq"]
            key = (item.topic, node_id)
            if seq > highest.get(key, self._highest_seqs(item.topic).get(node_id, 0)):
                highest[key] = seq
                fresh.append(item)
        if not fresh:
            return
        try:
            self.client.insert(
                f"{self.database}.{TABLE}",
                [_row(i) for i in fresh],
                column_names=list(_COLUMNS),
                settings={"max_partitions_per_insert_block": 1000},
            )
        except CLICKHOUSE_ERRORS as exc:
            raise StorageError(f"inserting {len(fresh)} node states: {exc}") from None
        for (topic, node_id), seq in highest.items():
            self._seen[topic][node_id] = seq
