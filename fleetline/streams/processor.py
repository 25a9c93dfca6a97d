"""The exactly-once consume-transform-produce loop every stream processor runs.

init transactions -> poll a batch -> transform each message (pure fold behind a small handler)
-> produce outputs, dead letters and store changelog records -> send the consumed offsets to the
transaction -> commit. An abortable error aborts and rewinds to the committed offsets (the stores
drop their pending writes); a fatal one stops loudly. Bad input never stops the loop: it goes to
the dead-letter topic, with the reason, inside the same transaction.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, Message, TopicPartition

from fleetline.config import KafkaSettings
from fleetline.errors import FleetlineError, StreamError
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import dead_letter_headers
from fleetline.streams.store import ChangelogStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Output:
    topic: str
    key: bytes | None
    value: bytes | None
    partition: int | None = None
    headers: list[tuple[str, bytes]] | None = None


Handler = Callable[[Message], Sequence[Output]]


@dataclass
class ProcessorStats:
    batches: int = 0
    messages: int = 0
    dead_letters: int = 0
    aborts: int = 0
    restored: int = 0


@dataclass
class TransactionalProcessor:
    """Runs `handler` over `inputs` with exactly-once effect on outputs and stores."""

    kafka: KafkaSettings
    application_id: str
    inputs: Sequence[str]
    handler: Handler
    dead_letter_topic: str
    stores: Sequence[ChangelogStore] = ()
    instance_id: str = "0"
    batch_size: int = 500
    poll_timeout_s: float = 0.5
    # Called after an abort, once the stores dropped their pending writes: a handler that keeps
    # state of its own beside the stores forgets it here.
    on_abort: Callable[[], None] | None = None
    producer_config: dict[str, object] = field(default_factory=dict)
    stats: ProcessorStats = field(default_factory=ProcessorStats)
    # Set once partitions are assigned and stores restored; the slice and tests wait on it.
    ready: threading.Event = field(default_factory=threading.Event)

    def run(self, stop: threading.Event) -> None:
        producer = kafka_clients.producer(
            self.kafka,
            transactional_id=f"{self.application_id}-{self.instance_id}",
            **{"transaction.timeout.ms": 60000, **self.producer_config},
        )
        consumer = kafka_clients.consumer(self.kafka, self.application_id)
        # Fence any zombie with our transactional id first, so its open transaction is aborted
        # before the stores are restored from their changelogs.
        producer.init_transactions(60)

        def on_assign(cons, partitions: list[TopicPartition]) -> None:
            numbers = {tp.partition for tp in partitions}
            for store in self.stores:
                self.stats.restored += store.restore(self.kafka, numbers)
            self.ready.set()

        def on_revoke(cons, partitions: list[TopicPartition]) -> None:
            if stop.is_set():
                return  # closing: keep the last committed state readable
            numbers = {tp.partition for tp in partitions}
            for store in self.stores:
                store.drop(numbers)

        consumer.subscribe(list(self.inputs), on_assign=on_assign, on_revoke=on_revoke)
        try:
            while not stop.is_set():
                messages = consumer.consume(self.batch_size, self.poll_timeout_s)
                if messages:
                    self._process_batch(producer, consumer, messages)
        finally:
            consumer.close()
            producer.flush(10)

    def _process_batch(self, producer, consumer, messages: list[Message]) -> None:
        next_offsets: dict[tuple[str, int], int] = {}
        handled = 0
        producer.begin_transaction()
        try:
            for msg in messages:
                if msg.error():
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(msg.error())
                next_offsets[(msg.topic(), msg.partition())] = msg.offset() + 1
                handled += 1
                for out in self._transform(msg):
                    produce(producer, out)
            for store in self.stores:
                for partition, key, value in store.pending_changelog():
                    produce(producer, Output(store.changelog_topic, key, value, partition))
            producer.send_offsets_to_transaction(
                [TopicPartition(t, p, o) for (t, p), o in next_offsets.items()],
                consumer.consumer_group_metadata(),
                30,
            )
            _commit(producer)
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.fatal():
                raise StreamError(
                    f"{self.application_id}: fatal Kafka error: {error.str()}"
                ) from None
            log.warning("%s: aborting batch after %s", self.application_id, error.str())
            self.stats.aborts += 1
            producer.abort_transaction(60)
            for store in self.stores:
                store.abort()
            if self.on_abort is not None:
                self.on_abort()
            _rewind(consumer)
            return
        for store in self.stores:
            store.commit()
        self.stats.batches += 1
        self.stats.messages += handled

    def _transform(self, msg: Message) -> Sequence[Output]:
        try:
            return self.handler(msg)
        except FleetlineError as exc:
            self.stats.dead_letters += 1
            log.warning(
                "%s: dead-lettering %s[%d]@%d: %s",
                self.application_id,
                msg.topic(),
                msg.partition(),
                msg.offset(),
                exc,
            )
            return [
                Output(
                    self.dead_letter_topic,
                    msg.key(),
                    msg.value(),
                    headers=dead_letter_headers(msg, self.application_id, exc),
                )
            ]


def produce(producer, out: Output, on_delivery: Callable[..., None] | None = None) -> None:
    """Produce one output, waiting for room when librdkafka's local queue is full."""
    kwargs: dict[str, object] = {"key": out.key, "value": out.value}
    if out.partition is not None:
        kwargs["partition"] = out.partition
    if out.headers:
        kwargs["headers"] = out.headers
    if on_delivery is not None:
        kwargs["on_delivery"] = on_delivery
    while True:
        try:
            producer.produce(out.topic, **kwargs)
            return
        except BufferError:
            # Local queue full: let librdkafka deliver, then try again.
            producer.poll(0.1)


def _commit(producer, attempts: int = 5) -> None:
    """Commit the transaction, retrying what librdkafka calls retriable (a commit timeout)."""
    for attempt in range(attempts):
        try:
            producer.commit_transaction(60)
            return
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if attempt + 1 == attempts or not error.retriable() or error.txn_requires_abort():
                raise


def _rewind(consumer) -> None:
    """Seek every assigned partition back to its committed offset (the aborted batch's start)."""
    assignment = consumer.assignment()
    if not assignment:
        return
    positions = [TopicPartition(tp.topic, tp.partition,
                                tp.offset if tp.offset >= 0 else OFFSET_BEGINNING)
                 for tp in consumer.committed(assignment, timeout=30)]
    try:
        for tp in positions:
            consumer.seek(tp)
    except KafkaException:
        # seek() needs a partition already being fetched; reassigning works in any state.
        consumer.assign(positions)
