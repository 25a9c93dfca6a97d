"""NodeState history in ClickHouse: every state a node declared, for "when was it down" queries
(the compacted state topic keeps only each node's latest)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clickhouse_connect.driver.client import Client

from fleetline.errors import StorageError
from fleetline.storage.clickhouse import CLICKHOUSE_ERRORS
from fleetline.storage.sinks import Destination, Sourced, table_resume_offsets

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

    def resume_offsets(self, topic: str) -> dict[int, int]:
        return table_resume_offsets(self.client, f"{self.database}.{TABLE}", topic)

    def store(self, batch: Sequence[Sourced]) -> None:
        try:
            self.client.insert(
                f"{self.database}.{TABLE}",
                [_row(i) for i in batch],
                column_names=list(_COLUMNS),
                settings={"max_partitions_per_insert_block": 1000},
            )
        except CLICKHOUSE_ERRORS as exc:
            raise StorageError(f"inserting {len(batch)} node states: {exc}") from None
