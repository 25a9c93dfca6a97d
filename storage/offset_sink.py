"""A Kafka -> storage sink whose destination itself says where to resume.

receive a batch -> decode -> `destination.store(batch)` -> only then remember the offsets. Each
stored item carries its partition and offset, so on (re)start the destination's own contents
say where every partition resumes: a crash between storing and committing neither loses nor
duplicates. Consumer-group offsets are committed afterwards, for lag monitoring only.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Message, TopicPartition

from fleetline.config import KafkaSettings
from fleetline.errors import FleetlineError, StorageError
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import send_dead_letter
from fleetline.streams.serde import AvroCodec

log = logging.getLogger(__name__)


BatchHandler = Callable[[Any, Any, list[Message]], None]


def run_resuming(kafka: KafkaSettings, group_id: str, topic: str, resume: dict[int, int],
                 handle: BatchHandler, stop: threading.Event, ready: threading.Event,
                 max_batch: int, max_wait_s: float) -> None:
    """The loop every offset-tracked sink runs: subscribe, start each assigned partition where
    the destination's own contents say (`resume`; from the beginning if it holds nothing of
    it), receive batches of up to `max_batch` messages or `max_wait_s`, hand each to
    `handle(consumer, dead_letter_producer, batch)`, which stores it durably, and only then
    remember the batch's offsets for a later reassignment."""
    consumer = kafka_clients.consumer(kafka, group_id)
    dlq = kafka_clients.producer(kafka)

    def on_assign(cons, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            tp.offset = resume.get(tp.partition, OFFSET_BEGINNING)
        cons.assign(partitions)
        ready.set()

    consumer.subscribe([topic], on_assign=on_assign)
    try:
        while not stop.is_set():
            batch: list[Message] = []
            deadline = time.monotonic() + max_wait_s
            while len(batch) < max_batch and not stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                batch.extend(consumer.consume(max_batch - len(batch), min(left, 0.5)))
            if batch:
                handle(consumer, dlq, batch)
                for msg in batch:
                    resume[msg.partition()] = msg.offset() + 1
    finally:
        consumer.close()
        dlq.flush(10)


def table_resume_offsets(client: Any, table: str, topic: str | None,
                         partition_column: str = "source_partition") -> dict[int, int]:
    """partition -> one past the highest `source_offset` a ClickHouse table holds from `topic`
    (rows written before tables named their topic count for any topic; None: the table does
    not name topics)."""
    where = "WHERE source_topic IN ({topic:String}, '') " if topic is not None else ""
    try:
        rows = client.query(f"SELECT {partition_column}, max(source_offset) + 1 FROM {table} "
                            f"{where}GROUP BY {partition_column}",
                            parameters={"topic": topic} if topic is not None else None
                            ).result_rows
    except Exception as exc:
        raise StorageError(f"reading resume offsets from {table}: {exc}") from None
    return {int(p): int(o) for p, o in rows}


@dataclass(frozen=True)
class Sourced:
    partition: int
    offset: int
    record: dict[str, Any]
    topic: str = ""


class Destination(ABC):
    """The port a sink writes through."""

    name: str = "destination"

    @abstractmethod
    def resume_offsets(self, topic: str) -> dict[int, int]:
        """partition -> the next offset of `topic` to store, from what is already stored (one
        database may hold the records of several topic prefixes)."""

    @abstractmethod
    def store(self, batch: Sequence[Sourced]) -> None:
        """Store a batch durably (all of it, or raise)."""


@dataclass
class OffsetSinkStats:
    batches: int = 0
    records: int = 0
    dead_letters: int = 0


@dataclass
class OffsetSink:
    kafka: KafkaSettings
    codec: AvroCodec
    topic: str
    expect: str
    destination: Destination
    dead_letter_topic: str
    group_id: str
    max_batch: int = 5000
    max_wait_s: float = 0.5
    stats: OffsetSinkStats = field(default_factory=OffsetSinkStats)
    ready: threading.Event = field(default_factory=threading.Event)

    def run(self, stop: threading.Event) -> None:
        run_resuming(self.kafka, self.group_id, self.topic,
                     self.destination.resume_offsets(self.topic),
                     self._handle, stop, self.ready, self.max_batch, self.max_wait_s)

    def _handle(self, consumer, dlq, messages: list[Message]) -> None:
        good: list[Sourced] = []
        for msg in messages:
            if msg.error():
                raise StorageError(f"consuming {self.topic}: {msg.error().str()}")
            try:
                record = self.codec.decode(msg.value(), expect=self.expect).record
                good.append(Sourced(msg.partition(), msg.offset(), record, msg.topic()))
            except FleetlineError as exc:
                self.stats.dead_letters += 1
                send_dead_letter(dlq, self.dead_letter_topic, self.group_id, msg, exc)
        if dlq.flush(30):
            raise StorageError(f"{self.group_id}: dead letters not delivered; not storing")
        if good:
            self.destination.store(good)
        self.stats.batches += 1
        self.stats.records += len(good)
        try:
            consumer.commit(offsets=kafka_clients.next_offsets(messages), asynchronous=True)
        except Exception as exc:  # lag monitoring only; the destination holds the truth
            log.debug("%s: offset commit failed: %s", self.group_id, exc)
