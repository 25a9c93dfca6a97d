"""The one stream loop every processor and sink runs.

    receive a batch -> the step turns it into outputs, dead letters and something to store
    -> produce -> store durably -> commit the consumed offsets

A `Step` is the processor's own part (its pure fold behind a small adapter); the loop owns
Kafka. It commits in one of two ways, as Kafka Streams does:

- **Exactly once** (`exactly_once=True`): outputs, dead letters, the step's changelog records
  (with the input position they reflect) and the consumed offsets go in one transaction. An
  abortable error aborts it, drops the stores' pending writes, tells the step (`aborted`) and
  rewinds to the committed offsets; a retriable commit is retried. A producer that cannot
  abort (a fatal error, a failed abort, a transactional call stalled past
  `transaction_call_timeout_s`: librdkafka can block in one after the group coordinator's
  broker died) is fenced by a new one with the same transactional id and the batch redone the
  same way, up to 5 times in 5 minutes; a producer fenced by another (a second instance with
  the same id) stops the loop loudly (`StreamError`).
  After every restore of the stores (an assignment, or an abort whose state no longer matches
  the group's offsets) the loop checks the position the state reflects against the group's
  committed offsets and processes nothing until they agree: restored again while they differ,
  a `StreamError` naming both once `restore_timeout_s` has passed. A restore that stopped
  short (a changelog whose transaction markers have not reached its new leader yet) is caught
  there, not taken for the whole state; one whose read stalled (a changelog's leader lost
  while its end was being read) is started again within the same limit.
- **Effect first** (`exactly_once=False`): dead letters are flushed, the step stores the batch
  (`store`; with `overlap`, in a writer thread while the next batch is received and prepared,
  stores still in order), and only then are offsets committed. Such steps say where each
  partition resumes from their own durable state (`assigned`), so the committed offsets are
  for lag monitoring and a crash between store and commit neither loses nor repeats anything.

Either way a message is handed to the step at most once while its partition is this loop's:
what a fetch from before a rebalance still delivers for a revoked partition is dropped, and a
partition assigned again starts where the step says. Bad input never stops the loop: the step
names it and it goes whole to the dead-letter topic with the reason.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from fleetline.config import KafkaSettings
from fleetline.errors import FleetlineError, StreamError
from fleetline.observability import metrics
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import dead_letter_headers
from fleetline.streams.records import Output
from fleetline.streams.store import ChangelogStore
from fleetline.streams.topics import Topics

log = logging.getLogger(__name__)
P = TypeVar("P")
Partition = tuple[str, int]
_ANY = -1  # a partition whose next offset is whatever the broker gives first


@dataclass
class StepResult(Generic[P]):
    """What a step made of a batch: messages to produce, messages it could not handle (with
    why), and what `store` must make durable before the batch's offsets are committed."""

    outputs: list[Output] = field(default_factory=list)
    dead_letters: list[tuple[Message, FleetlineError]] = field(default_factory=list)
    payload: P | None = None


class Step(ABC, Generic[P]):
    """A processor or sink as the loop drives it."""

    # Changelog-backed state (exactly once only): restored on assignment, written in the
    # batch's transaction, committed with it.
    stores: Sequence[ChangelogStore[Any]] = ()

    def assigned(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        """Where each newly assigned partition resumes (OFFSET_INVALID: from the group's
        committed offset). Called once what was received before is stored."""
        return partitions

    def revoked(self, partitions: list[TopicPartition]) -> None:
        """The partitions are another instance's now; what was received is stored."""

    @abstractmethod
    def process(self, messages: list[Message]) -> StepResult[P]:
        """Turn a batch into outputs, dead letters and a payload to store."""

    def store(self, payload: P) -> None:
        """Make a batch's payload durable (all of it, or raise)."""

    def checkpoint(self, idle: bool) -> bool:
        """After each batch (`idle` False), each empty receive (True) and once more when the
        loop stops: make what was processed durable if that is due; True when the offsets of
        what is stored may be committed (effect-first loops only). A step whose `store` makes
        each batch durable needs nothing more."""
        return True

    def aborted(self) -> None:
        """The batch's transaction was aborted: forget state kept beside the stores."""


class MessageStep(Step[None]):
    """A step that handles one message at a time; a message that raises a FleetlineError is
    dead-lettered with the reason and the others go on."""

    @abstractmethod
    def handle(self, message: Message) -> Sequence[Output]:
        """The outputs of one message, or a FleetlineError saying why it cannot be handled."""

    def process(self, messages: list[Message]) -> StepResult[None]:
        result: StepResult[None] = StepResult()
        for message in messages:
            try:
                result.outputs.extend(self.handle(message))
            except FleetlineError as exc:
                result.dead_letters.append((message, exc))
        return result


F = TypeVar("F")


class FoldStep(MessageStep, Generic[F]):
    """A message step whose fold lives in memory beside its changelog store. The fold is built
    from the committed store when first needed after the store was restored (an assignment) or
    a batch was aborted, and at no other time: the loop hands every message of a partition in
    order and once, so a gap between two offsets is transaction markers (any transactional
    producer leaves them), never a lost state."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._fold: F | None = None

    @abstractmethod
    def restore_fold(self) -> F:
        """The fold as the committed store holds it."""

    def fold(self) -> F:
        """The live fold (call with `lock` held)."""
        if self._fold is None:
            self._fold = self.restore_fold()
        return self._fold

    def forget(self) -> None:
        with self.lock:
            self._fold = None

    def assigned(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        self.forget()
        return partitions

    def revoked(self, partitions: list[TopicPartition]) -> None:
        self.forget()

    def aborted(self) -> None:
        self.forget()


@dataclass
class LoopStats:
    batches: int = 0
    messages: int = 0
    dead_letters: int = 0
    aborts: int = 0
    restored: int = 0


@dataclass
class _Writer(Generic[P]):
    """Stores prepared batches in order: in the calling thread, or with `overlap` in one
    writer thread while the next batch is received and prepared (at most one waits). After a
    failed store nothing later is stored, and the failure is raised in the consuming thread."""

    store: Callable[[P], None]
    overlap: bool
    _queue: queue.Queue[tuple[P | None, dict[Partition, int]] | None] = field(
        default_factory=lambda: queue.Queue(maxsize=1)
    )
    _stored: dict[Partition, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _failure: BaseException | None = None
    _thread: threading.Thread | None = None

    def submit(self, payload: P | None, offsets: dict[Partition, int]) -> None:
        self.check()
        if not self.overlap:
            self._store(payload, offsets)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stream-writer", daemon=True)
            self._thread.start()
        self._queue.put((payload, offsets))

    def _store(self, payload: P | None, offsets: dict[Partition, int]) -> None:
        if payload is not None:
            self.store(payload)
        with self._lock:
            self._stored.update(offsets)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._failure is None:
                    self._store(*item)
            # Thread boundary: whatever the store raised is raised again in the consuming
            # thread by check(), which stops the loop.
            except BaseException as exc:
                log.error("store failed; nothing received later will be stored: %s", exc)
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

    def take_stored(self) -> dict[Partition, int]:
        with self._lock:
            stored, self._stored = self._stored, {}
        return stored

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


@dataclass
class StreamLoop:
    """Runs `step` over `inputs` (a consumer group named `name`) until `stop` is set."""

    kafka: KafkaSettings
    name: str
    inputs: Sequence[str]
    step: Step[Any]
    dead_letter_topic: str
    exactly_once: bool = False
    # Topics every instance reads whole (small tables, like Kafka Streams' global tables),
    # through a consumer of its own; their positions come from the step. Effect first only.
    global_inputs: Sequence[str] = ()
    instance_id: str = "0"
    max_messages: int = 500
    # How long to gather a batch: a short wait keeps latency down, a long one makes fewer,
    # larger stores.
    max_wait_s: float = 0.5
    overlap: bool = False
    consumer_config: Mapping[str, object] = field(default_factory=dict)
    producer_config: Mapping[str, object] = field(default_factory=dict)
    stats: LoopStats = field(default_factory=LoopStats)
    # Set once partitions are assigned (and stores restored); services wait on it.
    ready: threading.Event = field(default_factory=threading.Event)
    # Set once the loop has handled its partitions as far as they went when it was assigned
    # them (readers that must not act on a half-restored state wait for it).
    caught_up: threading.Event = field(default_factory=threading.Event)
    # Prometheus series for this loop (messages, batches, dead letters, step and store time,
    # consumer lag); off only to measure what they cost.
    metrics: bool = True
    # How long a restore may take, read again while its changelog cannot be read to the end
    # (leaders moving) or the state it gives is not at the group's committed offsets, before
    # the loop stops rather than process from a stale state (Kafka Streams' task.timeout.ms:
    # brokers lost one after another can keep a changelog's end unreadable for a minute).
    restore_timeout_s: float = 300.0
    # The longest a transaction's offsets or commit may take. librdkafka can leave
    # send_offsets_to_transaction blocked past its own timeout when the group's coordinator
    # broker died (confluentinc/librdkafka issues 5456 and 5511); past this the producer is
    # fenced by a new one with the same transactional id and the batch is processed again.
    transaction_call_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.global_inputs and self.exactly_once:
            raise ValueError("global inputs are read outside the group: effect-first loops only")
        # The next offset to hand over, per partition this loop holds.
        self._expected: dict[Partition, int] = {}
        self._catch_up_to: dict[Partition, int] = {}
        self._admin: Any = None  # asks the partitions' leaders where they end; made once
        # Stored offsets not yet committed (or whose commit failed: a coordinator that moved
        # to another broker), and when to try them again: lag drains after a broker is lost.
        self._uncommitted: dict[Partition, int] = {}
        self._commit_retry_at = 0.0
        self._messages = metrics.STREAM_MESSAGES.labels(self.name)
        self._batches = metrics.STREAM_BATCHES.labels(self.name)
        # Producers fenced after a transactional call stalled, kept so that the call still
        # blocked in one is never left with a freed client.
        self._fenced: list[Producer] = []
        self._replaced: list[float] = []  # when a producer was last replaced
        self._process_seconds = metrics.STREAM_PROCESS_SECONDS.labels(self.name)
        self._store_seconds = metrics.STREAM_STORE_SECONDS.labels(self.name)

    def _consumer_config(self) -> Mapping[str, object]:
        config: dict[str, object] = {"on_commit": self._on_commit, **self.consumer_config}
        if not self.metrics:
            return config
        return {
            "statistics.interval.ms": 5000,
            "stats_cb": metrics.consumer_statistics(self.name),
            **config,
        }

    def _process(self, messages: list[Message]) -> StepResult[Any]:
        if not self.metrics:
            return self.step.process(messages)
        started = time.perf_counter()
        result = self.step.process(messages)
        self._process_seconds.observe(time.perf_counter() - started)
        return result

    def _timed_store(self, payload: Any) -> None:
        if not self.metrics:
            self.step.store(payload)
            return
        started = time.perf_counter()
        self.step.store(payload)
        self._store_seconds.observe(time.perf_counter() - started)

    def run(self, stop: threading.Event) -> None:
        producer = self._producer()
        consumer = kafka_clients.consumer(self.kafka, self.name, self._consumer_config())
        writer: _Writer[Any] = _Writer(self._timed_store, self.overlap and not self.exactly_once)
        global_consumer = self._global_consumer()

        def on_assign(cons: Consumer, partitions: list[TopicPartition]) -> None:
            writer.drain()
            if self.exactly_once and self.step.stores:
                partitions = self._restore(cons, partitions)
            positions = self.step.assigned(partitions)
            for tp in positions:
                self._expected[(tp.topic, tp.partition)] = tp.offset if tp.offset >= 0 else _ANY
            cons.assign(positions)
            self._catch_up_to = self._ends(positions)
            self.ready.set()

        def on_revoke(cons: Consumer, partitions: list[TopicPartition]) -> None:
            writer.drain()
            for tp in partitions:
                self._expected.pop((tp.topic, tp.partition), None)
            if stop.is_set():
                return  # closing: keep the last state readable
            for store in self.step.stores:
                store.drop({tp.partition for tp in partitions})
            self.step.revoked(partitions)

        consumer.subscribe(list(self.inputs), on_assign=on_assign, on_revoke=on_revoke)
        try:
            while not stop.is_set():
                writer.check()
                messages = self._receive(consumer, global_consumer, stop)
                if messages:
                    if self.exactly_once:
                        producer = self._transact(producer, consumer, messages)
                    else:
                        self._store(producer, writer, messages)
                if (
                    self.ready.is_set()
                    and not self.caught_up.is_set()
                    and self._reached(consumer, messages)
                ):
                    self.caught_up.set()
                if not self.exactly_once:
                    if self.step.checkpoint(idle=not messages):
                        self._uncommitted.update(writer.take_stored())
                        self._commit(consumer)
                    elif self._uncommitted and time.monotonic() >= self._commit_retry_at:
                        self._commit(consumer)
            if not self.exactly_once:
                writer.drain()
                if self.step.checkpoint(idle=True):
                    self._uncommitted.update(writer.take_stored())
                self._commit(consumer, asynchronous=False)
        finally:
            writer.close()
            consumer.close()
            if global_consumer is not None:
                global_consumer.close()
            try:
                producer.flush(10)
            except KafkaException as exc:
                # A producer that failed for good has nothing left to deliver; its error is
                # not to hide the one that stopped the loop.
                log.warning("%s: flushing the producer at the end: %s", self.name, exc)

    # -- receiving ----------------------------------------------------------------------------

    def _producer(self) -> Producer:
        if not self.exactly_once:
            return kafka_clients.producer(self.kafka, self.producer_config)
        producer = kafka_clients.producer(
            self.kafka,
            {"transaction.timeout.ms": 60000, **self.producer_config},
            transactional_id=self.transactional_id,
        )
        # Fence any zombie with our transactional id first, so its open transaction is aborted
        # before the stores are restored from their changelogs. While the transaction
        # coordinator cannot answer (its log short of in-sync replicas) this is asked again.
        deadline = time.monotonic() + INIT_TRANSACTIONS_TIMEOUT_S
        while True:
            try:
                producer.init_transactions(60)
                return producer
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if not error.retriable() or time.monotonic() >= deadline:
                    raise StreamError(
                        f"{self.name}: initialising transactional id {self.transactional_id}: "
                        f"{error.str()}"
                    ) from None
                log.warning("%s: initialising transactions (asked again): %s", self.name, error)

    @property
    def transactional_id(self) -> str:
        return f"{self.name}-{self.instance_id}"

    def _global_consumer(self) -> Consumer | None:
        if not self.global_inputs:
            return None
        consumer = kafka_clients.consumer(self.kafka, f"{self.name}.global.{self.instance_id}")
        partitions = [
            TopicPartition(topic, p)
            for topic in self.global_inputs
            for p in kafka_clients.partitions_of(self.kafka, topic)
        ]
        positions = self.step.assigned(partitions)
        for tp in positions:
            self._expected[(tp.topic, tp.partition)] = tp.offset if tp.offset >= 0 else _ANY
        consumer.assign(
            [
                TopicPartition(
                    tp.topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
                )
                for tp in positions
            ]
        )
        return consumer

    def _ends(self, positions: list[TopicPartition]) -> dict[Partition, int]:
        """Where each assigned partition ended at the assignment, for a read_committed reader
        (its last stable offset): caught up once all are reached. An empty receive alone is no
        proof: it never comes while agents stream without pause, and it does come while a
        partition's broker is down."""
        ends: dict[Partition, int] = {}
        by_topic: dict[str, list[int]] = {}
        for tp in positions:
            by_topic.setdefault(tp.topic, []).append(tp.partition)
        try:
            if self._admin is None:
                self._admin = kafka_clients.admin_client(self.kafka)
            for topic, partitions in by_topic.items():
                bounds = kafka_clients.stable_bounds(
                    self.kafka, topic, partitions, timeout_s=10, admin=self._admin
                )
                ends.update({(topic, p): high for p, (_, high) in bounds.items()})
        except (KafkaException, StreamError) as exc:
            log.warning("%s: the ends of its partitions: %s", self.name, exc)
            return {}  # caught up at the first empty receive, as before
        return ends

    def _reached(self, consumer: Consumer, messages: list[Message]) -> bool:
        """Caught up: every assigned partition has reached its end as of the assignment, by
        the next offset this loop hands over (assigned there, or past what it handled) or by
        the consumer's position (which passes transaction markers, though they hold no
        message); where those ends could not be read, the first receive that brings nothing."""
        if not self._catch_up_to:
            return not messages
        wanted = [
            TopicPartition(t, p)
            for (t, p), end in self._catch_up_to.items()
            if end and self._expected.get((t, p), -1) < end
        ]
        if not wanted:
            return True
        return all(
            tp.offset >= self._catch_up_to[(tp.topic, tp.partition)]
            for tp in consumer.position(wanted)
        )

    def _receive(
        self, consumer: Consumer, global_consumer: Consumer | None, stop: threading.Event
    ) -> list[Message]:
        """Up to `max_messages` gathered for up to `max_wait_s`, each handed at most once and
        only while its partition is this loop's."""
        batch: list[Message] = []
        deadline = time.monotonic() + self.max_wait_s
        while len(batch) < self.max_messages and not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            batch.extend(consumer.consume(self.max_messages - len(batch), min(left, 0.5)))
        if global_consumer is not None:
            batch.extend(global_consumer.consume(self.max_messages, 0))
        handed: list[Message] = []
        for msg in batch:
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    continue
                if not error.fatal() and kafka_clients.moving(error):
                    # librdkafka tells of what it is already retrying: the group's coordinator
                    # moved ("Failed to fetch committed offsets ...: Not coordinator" after a
                    # broker was killed), a leader changed. Stopping for it stopped the loop.
                    log.warning("%s: consuming %s: %s", self.name, msg.topic(), error.str())
                    continue
                raise StreamError(f"{self.name}: consuming {msg.topic()}: {error.str()}")
            key = (msg.topic() or "", msg.partition() or 0)
            offset = msg.offset() or 0
            expected = self._expected.get(key)
            if expected is None or offset < expected:
                continue  # not ours any more, or handed over already
            self._expected[key] = offset + 1
            handed.append(msg)
        return handed

    # -- effect first -------------------------------------------------------------------------

    def _store(self, producer: Producer, writer: _Writer[Any], messages: list[Message]) -> None:
        result = self._process(messages)
        for msg, exc in result.dead_letters:
            self._log_dead_letter(msg, exc)
            produce(producer, self._dead_letter(msg, exc))
        # Dead letters are durable before the batch's offsets can be passed.
        if result.dead_letters and producer.flush(30):
            raise StreamError(
                f"{self.name}: dead letters were not delivered within 30 s; not storing past them"
            )
        for out in result.outputs:
            produce(producer, out)
        if result.outputs and producer.flush(30):
            raise StreamError(f"{self.name}: outputs were not delivered within 30 s")
        writer.submit(result.payload, kafka_clients.next_offsets(messages))
        self._count(messages, result)

    def _commit(self, consumer: Consumer, asynchronous: bool = True) -> None:
        """Commit the stored offsets not committed yet. For lag monitoring only (the step's own
        durable state says where it resumes), so a failure is retried a second later, not
        raised; an asynchronous commit's failure comes back through `_on_commit`."""
        offsets = [
            TopicPartition(topic, partition, offset)
            for (topic, partition), offset in self._uncommitted.items()
            if topic not in self.global_inputs and (topic, partition) in self._expected
        ]
        self._uncommitted = {}
        if not offsets:
            return
        try:
            if asynchronous:
                consumer.commit(offsets=offsets, asynchronous=True)
            else:
                self._on_commit(None, consumer.commit(offsets=offsets, asynchronous=False))
        except KafkaException as exc:
            self._on_commit(exc.args[0], offsets)

    def _on_commit(self, error: KafkaError | None, offsets: list[TopicPartition]) -> None:
        """Keep the offsets of a failed commit to commit again (unless newer ones are due)."""
        failed = [tp for tp in offsets if error is not None or tp.error is not None]
        if not failed:
            return
        reason = error or failed[0].error
        log.warning("%s: committing offsets (retried in 1 s): %s", self.name, reason)
        for tp in failed:
            key = (tp.topic, tp.partition)
            if key in self._expected:
                self._uncommitted[key] = max(self._uncommitted.get(key, tp.offset), tp.offset)
        self._commit_retry_at = time.monotonic() + 1.0

    # -- exactly once -------------------------------------------------------------------------

    def _transact(
        self, producer: Producer, consumer: Consumer, messages: list[Message]
    ) -> Producer:
        """Process a batch in one transaction; the producer for the next one (a new one when
        this one could not end a failed transaction)."""
        try:
            producer.begin_transaction()
            result = self._process(messages)
            consumed = kafka_clients.next_offsets(messages)
            for store in self.step.stores:
                for (topic, partition), offset in consumed.items():
                    store.advance(partition, topic, offset)
            for out in result.outputs:
                produce(producer, out)
            for msg, exc in result.dead_letters:
                self._log_dead_letter(msg, exc)
                produce(producer, self._dead_letter(msg, exc))
            for store in self.step.stores:
                for partition, key, value in store.pending_changelog():
                    produce(producer, Output(store.changelog_topic, key, value, partition))
            timeout_s = self.transaction_call_timeout_s
            self._within(
                "sending the batch's offsets to its transaction",
                timeout_s,
                lambda: producer.send_offsets_to_transaction(
                    kafka_clients.topic_partitions(consumed),
                    consumer.consumer_group_metadata(),
                    max(1.0, timeout_s - 5),
                ),
            )
            self._within(
                "committing the batch's transaction",
                timeout_s * 5,
                lambda: _commit_transaction(producer, timeout_s),
            )
        except (_Stalled, KafkaException) as failed:
            producer = self._end_failed_transaction(producer, failed)
            self._abandon_batch(consumer)
        else:
            for store in self.step.stores:
                store.commit()
            self._count(messages, result)
        return producer

    def _end_failed_transaction(
        self, producer: Producer, failure: _Stalled | KafkaException
    ) -> Producer:
        """End a transaction that failed: abort it, or, where this producer cannot (a call of
        its stalled, it failed for good, the abort failed), fence it with a new producer of
        the same transactional id, which aborts the transaction unless it committed. The
        producer for the next batch. Fenced by another producer: StreamError."""
        while True:
            if isinstance(failure, KafkaException):
                error: KafkaError = failure.args[0]
                if error.code() in _FENCED:
                    raise StreamError(
                        f"{self.name}: another producer took transactional id "
                        f"{self.transactional_id} over ({error.str()}); is a second instance "
                        f"running with --instance-id {self.instance_id}?"
                    ) from None
                if not error.fatal():
                    log.warning("%s: aborting a batch after %s", self.name, error.str())
                    try:
                        self._within(
                            "aborting the batch's transaction",
                            self.transaction_call_timeout_s * 2,
                            lambda: producer.abort_transaction(self.transaction_call_timeout_s),
                        )
                        return producer
                    except (_Stalled, KafkaException) as abort_failed:
                        failure = abort_failed
                        continue
            now = time.monotonic()
            self._replaced = [at for at in self._replaced if now - at < REPLACEMENT_WINDOW_S]
            if len(self._replaced) >= MAX_REPLACEMENTS:
                raise StreamError(
                    f"{self.name}: the transactional producer failed {MAX_REPLACEMENTS + 1} "
                    f"times in {REPLACEMENT_WINDOW_S:.0f} s, the last: {failure}"
                )
            self._replaced.append(now)
            log.warning(
                "%s: %s; a new producer with the same transactional id fences this one (its "
                "transaction is aborted unless it committed) and the batch is processed again",
                self.name,
                failure.args[0].str() if isinstance(failure, KafkaException) else failure,
            )
            self._fenced.append(producer)
            return self._producer()

    def _abandon_batch(self, consumer: Consumer) -> None:
        """After an aborted transaction: forget its writes and hand its messages over again."""
        self.stats.aborts += 1
        if self.metrics:
            metrics.STREAM_ABORTS.labels(self.name).inc()
        for store in self.step.stores:
            store.abort()
        self.step.aborted()
        self._rewind(consumer)

    def _within(self, what: str, timeout_s: float, call: Callable[[], object]) -> None:
        """Make a transactional call that may block past its own timeout, in a thread of its
        own; _Stalled if it has not returned after `timeout_s`, its error if it raised."""
        raised: list[BaseException] = []
        done = threading.Event()

        def run() -> None:
            try:
                call()
            # Thread boundary: the error is raised again in the loop's thread below.
            except BaseException as exc:
                raised.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name=f"{self.name}-txn", daemon=True).start()
        if not done.wait(timeout_s):
            raise _Stalled(f"{what} did not return within {timeout_s:.0f} s")
        if raised:
            raise raised[0]

    def _rewind(self, consumer: Consumer) -> None:
        """Seek every assigned partition back to its committed offset (the aborted batch's
        start), and hand its messages over again from there. The stores hold what the last
        committed transaction left; should that not be where the group's offsets stand (a
        commit that failed after it took effect), they are restored and checked first."""
        assignment = consumer.assignment()
        if not assignment:
            return
        committed = self._committed(consumer, assignment, time.monotonic() + 30)
        positions = self._agreeing(assignment, committed)
        if self._differences(committed):
            positions = self._restore(consumer, assignment)
        for tp in positions:
            self._expected[(tp.topic, tp.partition)] = tp.offset if tp.offset >= 0 else _ANY
        starts = [
            TopicPartition(
                tp.topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
            )
            for tp in positions
        ]
        try:
            for tp in starts:
                consumer.seek(tp)
        except KafkaException:
            # seek() needs a partition already being fetched; reassigning works in any state.
            consumer.assign(starts)

    # -- restoring ----------------------------------------------------------------------------

    def _restore(
        self, consumer: Consumer, partitions: list[TopicPartition]
    ) -> list[TopicPartition]:
        """Restore the stores' partitions and check the positions they reflect against the
        group's committed offsets; the partitions at the offsets where both stand. While they
        differ (a transaction's offsets readable before its markers reached the changelog's
        new leader) the stores are restored again; after `restore_timeout_s`, StreamError."""
        numbers = sorted({tp.partition for tp in partitions})
        deadline = time.monotonic() + self.restore_timeout_s
        attempt = 0
        while True:
            attempt += 1
            log.info(
                "%s: restoring partition(s) %s of %s",
                self.name,
                numbers,
                ", ".join(store.changelog_topic for store in self.step.stores),
            )
            committed = self._committed(consumer, partitions, deadline)
            began = time.monotonic()
            try:
                for store in self.step.stores:
                    self.stats.restored += store.restore(
                        self.kafka, numbers, max(5.0, deadline - time.monotonic()), settle=True
                    )
            except StreamError as exc:
                if time.monotonic() >= deadline:
                    raise StreamError(
                        f"{self.name}: its state could not be restored in "
                        f"{self.restore_timeout_s:.0f} s ({attempt} attempt(s)): {exc}"
                    ) from exc
                log.warning("%s: the restore stopped (%s); restoring again", self.name, exc)
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                continue
            differences = self._differences(committed)
            if not differences:
                log.info(
                    "%s: restored in %.2f s (attempt %d); the state stands at the group's "
                    "committed offsets",
                    self.name,
                    time.monotonic() - began,
                    attempt,
                )
                return self._agreeing(partitions, committed)
            if time.monotonic() >= deadline:
                raise StreamError(
                    f"{self.name}: the state restored from its changelog does not stand where "
                    f"the group committed after {attempt} restore(s) in "
                    f"{self.restore_timeout_s:.0f} s ({'; '.join(differences)}); refusing to "
                    "process from it"
                )
            log.warning(
                "%s: restored state differs from the group's committed offsets (%s); "
                "restoring again",
                self.name,
                "; ".join(differences),
            )
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _committed(
        self, consumer: Consumer, partitions: Sequence[TopicPartition], deadline: float
    ) -> dict[Partition, int | None]:
        """The group's committed offset of each partition (None: nothing committed), asked
        again while the group's coordinator moves."""
        asked = [TopicPartition(tp.topic, tp.partition) for tp in partitions]
        while True:
            try:
                found = consumer.committed(asked, timeout=max(1.0, deadline - time.monotonic()))
                error = next((tp.error for tp in found if tp.error is not None), None)
                if error is None:
                    return {
                        (tp.topic, tp.partition): tp.offset if tp.offset >= 0 else None
                        for tp in found
                    }
            except KafkaException as exc:
                error = exc.args[0]
            if not kafka_clients.moving(error) or time.monotonic() >= deadline:
                raise StreamError(
                    f"{self.name}: reading the group's committed offsets: {error.str()}"
                )
            log.warning("%s: reading committed offsets (asked again): %s", self.name, error)
            time.sleep(0.5)

    def _differences(self, committed: Mapping[Partition, int | None]) -> list[str]:
        """Where a store's state does not stand at the group's committed offset."""
        out = []
        for store in self.step.stores:
            for (topic, partition), offset in sorted(committed.items()):
                stands = store.positions(partition).get(topic)
                if stands != offset:
                    out.append(
                        f"{store.changelog_topic}[{partition}] reflects {topic}[{partition}] "
                        f"up to {_offset_text(stands)}, the group committed "
                        f"{_offset_text(offset)}"
                    )
        return out

    @staticmethod
    def _agreeing(
        partitions: Sequence[TopicPartition], committed: Mapping[Partition, int | None]
    ) -> list[TopicPartition]:
        out = []
        for tp in partitions:
            offset = committed.get((tp.topic, tp.partition))
            out.append(
                TopicPartition(tp.topic, tp.partition, OFFSET_INVALID if offset is None else offset)
            )
        return out

    # -- shared -------------------------------------------------------------------------------

    def _dead_letter(self, msg: Message, exc: FleetlineError) -> Output:
        return Output(
            self.dead_letter_topic,
            msg.key(),
            msg.value(),
            headers=dead_letter_headers(msg, self.name, exc),
        )

    def _log_dead_letter(self, msg: Message, exc: FleetlineError) -> None:
        if self.metrics:
            metrics.STREAM_DEAD_LETTERS.labels(self.name, type(exc).__name__).inc()
        log.warning(
            "%s: dead-lettering %s[%s]@%s: %s",
            self.name,
            msg.topic(),
            msg.partition(),
            msg.offset(),
            exc,
        )

    def _count(self, messages: list[Message], result: StepResult[Any]) -> None:
        self.stats.batches += 1
        self.stats.messages += len(messages)
        self.stats.dead_letters += len(result.dead_letters)
        if self.metrics:
            self._batches.inc()
            self._messages.inc(len(messages))


def _offset_text(offset: int | None) -> str:
    return "nothing" if offset is None else f"offset {offset}"


def produce(
    producer: Producer,
    out: Output,
    on_delivery: Callable[[KafkaError | None, Message], None] | None = None,
) -> None:
    """Produce one output, waiting for room when librdkafka's local queue is full."""
    kwargs: dict[str, Any] = {"key": out.key, "value": out.value}
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
            producer.poll(0.1)  # local queue full: let librdkafka deliver, then try again


# A producer fenced by another with its transactional id: a second instance with this one's
# id runs, and replacing the producer would only fence that one back.
_FENCED = frozenset(
    {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
)
# How many times in how long a loop replaces a failed transactional producer before stopping.
MAX_REPLACEMENTS = 5
REPLACEMENT_WINDOW_S = 300.0
# How long a new transactional producer may wait for the transaction coordinator.
INIT_TRANSACTIONS_TIMEOUT_S = 300.0


class _Stalled(Exception):
    """A transactional call did not return in time (see `transaction_call_timeout_s`)."""


def _commit_transaction(producer: Producer, timeout_s: float = 60.0, attempts: int = 5) -> None:
    """Commit, retrying what librdkafka calls retriable (a commit timeout)."""
    for attempt in range(attempts):
        try:
            producer.commit_transaction(timeout_s)
            return
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if attempt + 1 == attempts or not error.retriable() or error.txn_requires_abort():
                raise


__all__ = [
    "OFFSET_INVALID",
    "FoldStep",
    "LoopStats",
    "MessageStep",
    "Output",
    "Step",
    "StepResult",
    "StreamLoop",
    "produce",
]


def deliver(
    producer: Producer, outputs: Sequence[Output], what: str, timeout_s: float = 30.0
) -> list[int]:
    """Produce `outputs` and wait until the broker has them all; their offsets, in order.
    StreamError names `what` did not land (and librdkafka's first reasons)."""
    offsets: list[int | None] = [None] * len(outputs)
    errors: list[str] = []

    def delivered(index: int) -> Callable[[KafkaError | None, Message], None]:
        def done(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                errors.append(str(err))
            else:
                offsets[index] = msg.offset()

        return done

    for i, out in enumerate(outputs):
        try:
            produce(producer, out, delivered(i))
        except KafkaException as exc:  # refused before sending: a topic this principal may
            # not write, an unknown topic, a full queue
            raise StreamError(f"{what} refused the message: {exc.args[0].str()}") from None
    left = producer.flush(timeout_s)
    if left or errors:
        raise StreamError(f"{what} did not take {left or len(errors)} message(s): {errors[:3]}")
    return [o for o in offsets if o is not None]


def wait_for(event: threading.Event, stop: threading.Event, timeout_s: float) -> bool:
    """Wait until `event` is set (True), or `stop` is set or `timeout_s` has passed (False): a
    thread beside a loop waits so, and stops with it instead of after its timeout."""
    deadline = time.monotonic() + timeout_s
    while not event.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
        if stop.is_set() or time.monotonic() >= deadline:
            return event.is_set()
    return True


def run_beside(
    loop: StreamLoop, stop: threading.Event, side: Callable[[threading.Event], None], name: str
) -> None:
    """Run the loop with a thread of its own beside it (a ticker, a clock): the loop stopping
    stops the thread too."""
    thread = threading.Thread(target=side, args=(stop,), name=name, daemon=True)
    thread.start()
    try:
        loop.run(stop)
    finally:
        stop.set()
        thread.join(30)


def fold_loop(
    kafka: KafkaSettings,
    topics: Topics,
    application_id: str,
    log_topic: str,
    step: Step[Any],
    instance_id: str,
    max_messages: int,
    max_wait_s: float = 0.005,
) -> StreamLoop:
    """The exactly-once loop of a fold over one single-partition log (the scheduler, cluster
    health, operations): its consumer group and transactional id named by the application, a
    short poll (a batch is what arrived during the last commit) and a producer that lingers a
    millisecond."""
    return StreamLoop(
        kafka,
        f"{topics.prefix}.{application_id}",
        [log_topic],
        step,
        topics.dead_letter,
        exactly_once=True,
        instance_id=instance_id,
        max_messages=max_messages,
        max_wait_s=max_wait_s,
        producer_config={"linger.ms": 1},
    )


class FoldService:
    """A fold's loop with the thread that appends to its log beside it (the scheduler's ticker,
    the control plane's clock, operations' ticker over the view), run together: the loop
    stopping stops the thread. A service sets `loop` and `side_name` and writes `side`."""

    loop: StreamLoop
    side_name: ClassVar[str]

    def run(self, stop: threading.Event) -> None:
        run_beside(self.loop, stop, self.side, self.side_name)

    def side(self, stop: threading.Event) -> None:
        raise NotImplementedError
