"""The scheduler's decisions, the GPU allocations and the cluster agents' workload events in
ClickHouse, for "how long did jobs wait", "who used the GPUs" and "how did the loss move"
queries: one row per decision, per GPU bound or freed, per workload event, each with its trace
id. Each resumes after the highest source offset it holds (a record sink)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clickhouse_connect.driver.client import Client

from fleetline.errors import StorageError
from fleetline.storage.clickhouse import CLICKHOUSE_ERRORS
from fleetline.storage.sinks import Destination, Sourced, table_resume_offsets

DECISIONS = "scheduling_decisions"
ALLOCATIONS = "gpu_allocations"
WORKLOAD_EVENTS = "workload_events"
_DECISION_COLUMNS = (
    "ts_ms",
    "decision_id",
    "job",
    "tenant",
    "kind",
    "outcome",
    "priority",
    "reason",
    "clusters",
    "gpus",
    "preempted_by",
    "victims",
    "lost_gpu_s",
    "resume_from_checkpoint_ms",
    "input_offset",
    "view_version",
    "policy_digest",
    "source_partition",
    "source_offset",
    "source_topic",
    "trace_id",
)
_ALLOCATION_COLUMNS = (
    "ts_ms",
    "job_id",
    "tenant",
    "cluster_id",
    "node_id",
    "gpu_index",
    "kind",
    "priority",
    "seq",
    "source_partition",
    "source_offset",
    "source_topic",
    "trace_id",
)
_WORKLOAD_EVENT_COLUMNS = (
    "ts_ms",
    "job",
    "tenant",
    "cluster_id",
    "epoch",
    "attempt",
    "event",
    "trace_id",
    "pid",
    "step",
    "loss",
    "samples_per_s",
    "exit_code",
    "checkpoint_uri",
    "bytes",
    "seconds",
    "from_cluster",
    "detail",
    "source_partition",
    "source_offset",
    "source_topic",
)


def decision_row(item: Sourced) -> list[Any]:
    d = item.record
    return [
        d["ts"],
        d["decision_id"],
        d["job"],
        d["tenant"],
        d["kind"],
        d["outcome"],
        d["priority"],
        d["reason"],
        [p["cluster_id"] for p in d["placements"]],
        sum(len(w["gpus"]) for p in d["placements"] for w in p["workers"]),
        d["preempted_by"],
        list(d["victims"]),
        d["lost_gpu_s"],
        d["resume_from_checkpoint_ms"],
        d["input_offset"],
        d["view_version"],
        d["policy_digest"],
        item.partition,
        item.offset,
        item.topic,
        item.trace_id,
    ]


def allocation_rows(item: Sourced) -> list[list[Any]]:
    a = item.record
    return [
        [
            a["ts"],
            a["job_id"],
            a["tenant"],
            a["cluster_id"],
            g["node_id"],
            g["gpu_index"],
            a["kind"],
            a["priority"],
            a["seq"],
            item.partition,
            item.offset,
            item.topic,
            item.trace_id,
        ]
        for g in a["gpus"]
    ]


class TableDestination(Destination):
    """A ClickHouse table a record sink inserts `rows` of each batch into."""

    table = ""
    columns: tuple[str, ...] = ()

    def __init__(self, client: Client, database: str) -> None:
        self.client = client
        self.database = database

    def resume_offsets(self, topic: str) -> dict[int, int]:
        return table_resume_offsets(self.client, f"{self.database}.{self.table}", topic)

    def rows(self, batch: Sequence[Sourced]) -> list[list[Any]]:
        """One row per record, column for column (`ts_ms` is the record's `ts`), then where it
        came from (`columns` end with source_partition, source_offset, source_topic)."""
        fields = ("ts", *self.columns[1:-3])
        return [
            [*(item.record[f] for f in fields), item.partition, item.offset, item.topic]
            for item in batch
        ]

    def store(self, batch: Sequence[Sourced]) -> None:
        rows = self.rows(batch)
        if not rows:
            return
        try:
            self.client.insert(
                f"{self.database}.{self.table}",
                rows,
                column_names=list(self.columns),
                settings={"max_partitions_per_insert_block": 1000},
            )
        except CLICKHOUSE_ERRORS as exc:
            raise StorageError(f"inserting {len(rows)} rows into {self.table}: {exc}") from None


class DecisionTable(TableDestination):
    name = "decisions"
    table = DECISIONS
    columns = _DECISION_COLUMNS

    def rows(self, batch: Sequence[Sourced]) -> list[list[Any]]:
        return [decision_row(item) for item in batch]


class AllocationTable(TableDestination):
    name = "allocations"
    table = ALLOCATIONS
    columns = _ALLOCATION_COLUMNS

    def rows(self, batch: Sequence[Sourced]) -> list[list[Any]]:
        return [row for item in batch for row in allocation_rows(item)]


class WorkloadEventTable(TableDestination):
    """What the cluster agents report of each workload (starts, progress with loss and
    throughput, checkpoints, exits), one row per event, with its trace id."""

    name = "workload-events"
    table = WORKLOAD_EVENTS
    columns = _WORKLOAD_EVENT_COLUMNS
