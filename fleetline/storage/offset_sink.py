"""A Kafka -> storage sink whose destination itself says where to resume.

receive a batch -> decode -> `destination.store(batch)`. Each stored item carries its partition
and offset, so on (re)start, and on every reassignment, the destination's own contents say where
each partition resumes: a crash between storing and committing neither loses nor duplicates.
Consumer-group offsets are committed after the store, for lag monitoring only. A sink may store
one batch while it receives and decodes the next (`overlap`); stores still happen in order.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from confluent_kafka import OFFSET_BEGINNING, Message, TopicPartition

from fleetline.config import KafkaSettings
from fleetline.errors import FleetlineError, StorageError
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import send_dead_letter
from fleetline.streams.serde import AvroCodec

log = logging.getLogger(__name__)
P = TypeVar("P")


class BatchSteps(Protocol[P]):
    """A sink's two halves: `prepare` turns received messages into something to store (decode,
    check, dead-letter the bad ones durably) in the consuming thread; `write` stores it
    durably, all or nothing."""

    def prepare(self, dlq: Any, messages: list[Message]) -> P: ...

    def write(self, prepared: P) -> None: ...


@dataclass
class _Writer(Generic[P]):
    """Stores prepared batches in order, in the calling thread or, with `overlap`, in one
    writer thread while the next batch is received and prepared (decode and insert then use
    both cores). At most one batch waits; a failed store stops the sink at the next batch."""

    store: Callable[[P], None]
    overlap: bool
    _queue: queue.Queue = field(default_factory=lambda: queue.Queue(maxsize=1))
    _stored: deque = field(default_factory=deque)  # offsets of stored batches, to commit
    _failure: BaseException | None = None
    _thread: threading.Thread | None = None

    def submit(self, prepared: P, offsets: list[TopicPartition]) -> None:
        self.check()
        if not self.overlap:
            self.store(prepared)
            self._stored.append(offsets)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sink-writer", daemon=True)
            self._thread.start()
        self._queue.put((prepared, offsets))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._failure is None:  # after a failure nothing later may be stored
                    self.store(item[0])
                    self._stored.append(item[1])
            except BaseException as exc:  # raised again in the consuming thread
                self._failure = exc
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        """Wait until every submitted batch is stored (or one failed: raise its error)."""
        if self._thread is not None:
            self._queue.join()
        self.check()

    def check(self) -> None:
        if self._failure is not None:
            raise self._failure

    def stored(self) -> list[list[TopicPartition]]:
        out = []
        while self._stored:
            out.append(self._stored.popleft())
        return out

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


def run_resuming(kafka: KafkaSettings, group_id: str, topic: str,
                 resume: Callable[[], dict[int, int]], steps: BatchSteps[Any],
                 stop: threading.Event, ready: threading.Event, max_batch: int,
                 max_wait_s: float, overlap: bool = False) -> None:
    """The loop every offset-tracked sink runs: subscribe; on each assignment, once what was
    received before is stored, start every assigned partition where the destination's own
    contents say (`resume()`; from the beginning if it holds nothing of it), so a partition
    that comes back from another instance resumes after that instance's rows; receive batches
    of up to `max_batch` messages or `max_wait_s`, `steps.prepare` and `steps.write` each.
    Consumer-group offsets are committed after the store, for lag monitoring only."""
    consumer = kafka_clients.consumer(kafka, group_id)
    dlq = kafka_clients.producer(kafka)
    writer: _Writer[Any] = _Writer(steps.write, overlap)

    # The next offset to hand over, per assigned partition: what a fetch from before a
    # rebalance still delivers is handed over at most once, and only while the partition is
    # this sink's.
    expected: dict[tuple[str, int], int] = {}

    def on_assign(cons, partitions: list[TopicPartition]) -> None:
        writer.drain()
        offsets = resume()
        for tp in partitions:
            tp.offset = offsets.get(tp.partition, OFFSET_BEGINNING)
            expected[(tp.topic, tp.partition)] = max(tp.offset, 0)
        cons.assign(partitions)
        ready.set()

    def on_revoke(cons, partitions: list[TopicPartition]) -> None:
        # The next owner resumes from what the destination holds: finish storing first.
        writer.drain()
        for tp in partitions:
            expected.pop((tp.topic, tp.partition), None)

    consumer.subscribe([topic], on_assign=on_assign, on_revoke=on_revoke)
    try:
        while not stop.is_set():
            writer.check()
            batch: list[Message] = []
            deadline = time.monotonic() + max_wait_s
            while len(batch) < max_batch and not stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                batch.extend(consumer.consume(max_batch - len(batch), min(left, 0.5)))
            handed: list[Message] = []
            for msg in batch:
                if msg.error():
                    raise StorageError(f"consuming {topic}: {msg.error().str()}")
                key = (msg.topic(), msg.partition())
                if key in expected and msg.offset() >= expected[key]:
                    expected[key] = msg.offset() + 1
                    handed.append(msg)
            if handed:
                writer.submit(steps.prepare(dlq, handed), kafka_clients.next_offsets(handed))
            _commit(consumer, group_id, writer.stored())
        writer.drain()
        _commit(consumer, group_id, writer.stored())
    finally:
        writer.close()
        consumer.close()
        dlq.flush(10)


def _commit(consumer: Any, group_id: str, stored: list[list[TopicPartition]]) -> None:
    if not stored:
        return
    latest: dict[tuple[str, int], TopicPartition] = {}
    for offsets in stored:
        for tp in offsets:
            latest[(tp.topic, tp.partition)] = tp
    try:
        consumer.commit(offsets=list(latest.values()), asynchronous=True)
    except Exception as exc:  # lag monitoring only; the destination holds the truth
        log.debug("%s: offset commit failed: %s", group_id, exc)


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
                     lambda: self.destination.resume_offsets(self.topic), self, stop,
                     self.ready, self.max_batch, self.max_wait_s)

    def prepare(self, dlq: Any, messages: list[Message]) -> list[Sourced]:
        good: list[Sourced] = []
        for msg in messages:
            try:
                record = self.codec.decode(msg.value(), expect=self.expect).record
                good.append(Sourced(msg.partition(), msg.offset(), record, msg.topic()))
            except FleetlineError as exc:
                self.stats.dead_letters += 1
                send_dead_letter(dlq, self.dead_letter_topic, self.group_id, msg, exc)
        if dlq.flush(30):
            raise StorageError(f"{self.group_id}: dead letters not delivered; not storing")
        return good

    def write(self, prepared: list[Sourced]) -> None:
        if prepared:
            self.destination.store(prepared)
        self.stats.batches += 1
        self.stats.records += len(prepared)
