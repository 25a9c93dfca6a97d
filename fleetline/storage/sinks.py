"""Sinks: stream-loop steps whose effect is a durable store, resumed from what is stored.

receive a batch -> decode (the bad go to the dead-letter topic) -> `destination.store(batch)`
-> commit. Each stored item carries its topic, partition and offset, so on every (re)assignment
the destination's own contents say where each partition resumes: a crash between storing and
committing neither loses nor duplicates, and a partition that moves to another instance resumes
after the rows the first one stored. Consumer-group offsets are for lag monitoring only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from clickhouse_connect.driver.client import Client
from confluent_kafka import OFFSET_BEGINNING, Message, TopicPartition

from fleetline.errors import FleetlineError, StorageError
from fleetline.observability import metrics, tracing
from fleetline.storage.clickhouse import CLICKHOUSE_ERRORS
from fleetline.streams.loop import Step, StepResult
from fleetline.streams.records import where
from fleetline.streams.serde import AvroCodec


def table_resume_offsets(
    client: Client, table: str, topic: str | None, partition_column: str = "source_partition"
) -> dict[int, int]:
    """partition -> one past the highest `source_offset` a ClickHouse table holds from `topic`
    (rows written before tables named their topic count for any topic; None: the table does
    not name topics)."""
    where_topic = "WHERE source_topic IN ({topic:String}, '') " if topic is not None else ""
    try:
        rows = client.query(
            f"SELECT {partition_column}, max(source_offset) + 1 FROM {table} "
            f"{where_topic}GROUP BY {partition_column}",
            parameters={"topic": topic} if topic is not None else None,
        ).result_rows
    except CLICKHOUSE_ERRORS as exc:
        raise StorageError(f"reading resume offsets from {table}: {exc}") from None
    return {int(p): int(o) for p, o in rows}


def table_node_seqs(client: Client, table: str, topic: str) -> dict[str, int]:
    """node -> the highest `seq` a ClickHouse table holds from `topic`: an agent that sends
    again after an outage or a crash repeats records the table has, recognised by their seq
    (another topic prefix is another fleet, whose agents count from 1; rows written before
    tables named their topic count for any)."""
    try:
        rows = client.query(
            f"SELECT node_id, max(seq) FROM {table} "
            "WHERE source_topic IN ({topic:String}, '') GROUP BY node_id",
            parameters={"topic": topic},
        ).result_rows
    except CLICKHOUSE_ERRORS as exc:
        raise StorageError(f"reading node seqs from {table}: {exc}") from None
    return {str(node): int(seq) for node, seq in rows}


def resume_positions(
    partitions: list[TopicPartition], stored: dict[int, int]
) -> list[TopicPartition]:
    """Each partition from one past what the destination holds (the beginning: nothing)."""
    return [
        TopicPartition(tp.topic, tp.partition, stored.get(tp.partition, OFFSET_BEGINNING))
        for tp in partitions
    ]


@dataclass(frozen=True)
class Sourced:
    """A decoded record and where in the log it came from."""

    partition: int
    offset: int
    record: dict[str, Any]
    topic: str = ""
    trace_id: str = ""  # from the message's `traceparent` header


class Destination(ABC):
    """The port a record sink writes through."""

    name: str = "destination"

    @abstractmethod
    def resume_offsets(self, topic: str) -> dict[int, int]:
        """partition -> the next offset of `topic` to store, from what is already stored (one
        database may hold the records of several topic prefixes)."""

    @abstractmethod
    def store(self, batch: Sequence[Sourced]) -> None:
        """Store a batch durably (all of it, or raise)."""


@dataclass
class SinkStats:
    batches: int = 0
    records: int = 0
    dead_letters: int = 0


@dataclass
class RecordSink(Step[list[Sourced]]):
    """Decodes each message as an `expect` record, makes it what the destination keeps
    (`convert`, plain data to plain data; the record as it is by default) and stores the batch
    in `destination`."""

    codec: AvroCodec
    topic: str
    expect: str
    destination: Destination
    convert: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    stats: SinkStats = field(default_factory=SinkStats)

    def assigned(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return resume_positions(partitions, self.destination.resume_offsets(self.topic))

    def process(self, messages: list[Message]) -> StepResult[list[Sourced]]:
        result: StepResult[list[Sourced]] = StepResult(payload=[])
        assert result.payload is not None
        for msg in messages:
            try:
                record = self.codec.decode(msg.value(), expect=self.expect).record
                if self.convert is not None:
                    record = self.convert(record)
            except FleetlineError as exc:
                result.dead_letters.append((msg, exc))
                continue
            topic, partition, offset = where(msg)
            trace_id = tracing.trace_id_in(msg.headers())
            result.payload.append(Sourced(partition, offset, record, topic, trace_id))
        self.stats.dead_letters += len(result.dead_letters)
        return result

    def store(self, payload: list[Sourced]) -> None:
        if payload:
            self.destination.store(payload)
            metrics.SINK_ROWS.labels(type(self.destination).__name__).inc(len(payload))
        self.stats.batches += 1
        self.stats.records += len(payload)
