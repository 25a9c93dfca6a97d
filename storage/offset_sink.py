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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Message, TopicPartition

from fleetline.config import KafkaSettings
from fleetline.errors import FleetlineError, StorageError
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import dead_letter_headers
from fleetline.streams.serde import AvroCodec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sourced:
    partition: int
    offset: int
    record: dict[str, Any]


class Destination(ABC):
    """The port a sink writes through."""

    name: str = "destination"

    @abstractmethod
    def resume_offsets(self) -> dict[int, int]:
        """partition -> the next offset to store, from what is already stored."""

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
        consumer = kafka_clients.consumer(self.kafka, self.group_id)
        dlq = kafka_clients.producer(self.kafka)
        resume = self.destination.resume_offsets()

        def on_assign(cons, partitions: list[TopicPartition]) -> None:
            for tp in partitions:
                tp.offset = resume.get(tp.partition, OFFSET_BEGINNING)
            cons.assign(partitions)
            self.ready.set()

        consumer.subscribe([self.topic], on_assign=on_assign)
        try:
            while not stop.is_set():
                batch: list[Message] = []
                deadline = time.monotonic() + self.max_wait_s
                while len(batch) < self.max_batch and time.monotonic() < deadline \
                        and not stop.is_set():
                    batch.extend(consumer.consume(self.max_batch - len(batch), 0.1))
                if batch:
                    self._handle(consumer, dlq, batch)
                    for msg in batch:
                        resume[msg.partition()] = msg.offset() + 1
        finally:
            consumer.close()
            dlq.flush(10)

    def _handle(self, consumer, dlq, messages: list[Message]) -> None:
        good: list[Sourced] = []
        for msg in messages:
            if msg.error():
                raise StorageError(f"consuming {self.topic}: {msg.error().str()}")
            try:
                record = self.codec.decode(msg.value(), expect=self.expect).record
                good.append(Sourced(msg.partition(), msg.offset(), record))
            except FleetlineError as exc:
                self.stats.dead_letters += 1
                log.warning("%s: dead-lettering %s[%d]@%d: %s", self.group_id, msg.topic(),
                            msg.partition(), msg.offset(), exc)
                dlq.produce(self.dead_letter_topic, key=msg.key(), value=msg.value(),
                            headers=dead_letter_headers(msg, self.group_id, exc))
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
