"""confluent-kafka clients built from settings, and idempotent topic creation."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec  # type: ignore[attr-defined]

from fleetline.config import KafkaSettings
from fleetline.errors import NotPermitted, ServiceUnavailable, StreamError
from fleetline.identity.writers import H_MAC, H_WRITER, Signer
from fleetline.probe import refusal
from fleetline.streams.records import where
from fleetline.streams.topics import TopicSpec

log = logging.getLogger(__name__)
# The Java clients' default partitioner, so every client maps a key to the same partition.
PARTITIONER = "murmur2_random"


def admin_client(kafka: KafkaSettings) -> AdminClient:
    return AdminClient(dict(kafka.client_config()))  # type: ignore[arg-type]  # a Logger too


def probe(kafka: KafkaSettings, timeout_s: float = 5.0) -> None:
    """Raise ServiceUnavailable unless a broker answers a metadata request within `timeout_s`
    (librdkafka's own connection errors are kept out of the log; the one line says it)."""

    def unavailable(reason: str) -> ServiceUnavailable:
        return ServiceUnavailable(
            f"Kafka is not answering at {kafka.bootstrap_servers} ({reason}); start the local "
            "broker with `fleetline infra start`, or point FLEETLINE_KAFKA_BOOTSTRAP at a "
            "running one"
        )

    # A refused connection is known at once; librdkafka would retry it until the timeout.
    refused = []
    for server in kafka.bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        why = refusal(host, int(port), timeout_s) if port.isdigit() else "no port"
        if why is None:
            break
        refused.append(f"{server.strip()}: {why}")
    else:
        raise unavailable("; ".join(refused))
    said = _KeptLines()
    silent = logging.getLogger("fleetline.librdkafka.probe")
    silent.propagate = False
    silent.handlers = [said]
    silent.setLevel(logging.INFO)  # a dropped connection is said at INFO
    admin = AdminClient(dict(kafka.client_config(logger=silent)))  # type: ignore[arg-type]
    try:
        admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        admin.poll(0.2)  # librdkafka's log lines reach the logger when the client is polled
        raise _refusal(kafka, said.lines) or unavailable(exc.args[0].str()) from None


class _KeptLines(logging.Handler):
    """librdkafka's log lines of a probe, kept to say why a broker that took the connection
    answered nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _refusal(kafka: KafkaSettings, said: list[str]) -> NotPermitted | None:
    """A secured broker that took the connection and refused this client, in one line: one
    without credentials (it closes the connection before answering), or a sign-in it turned
    down. None when librdkafka said neither."""
    principal = kafka.client_overrides.get("sasl.username")
    where = kafka.bootstrap_servers
    how = "`fleetline infra credentials KIND` on the broker's host prints a kind's settings"
    if principal is None and any("connection closed by peer" in line for line in said):
        return NotPermitted(
            f"Kafka at {where} closed the connection of a client without credentials: it "
            f"is a secured broker (SASL/SCRAM); set FLEETLINE_KAFKA_CONF_SASL_* ({how})"
        )
    failed = next((line for line in said if "SASL" in line or "uthentication" in line), None)
    if principal is not None and failed is not None:
        return NotPermitted(
            f"Kafka at {where} refused the sign-in of principal {principal!r}: "
            f"{failed[failed.find('SASL') if 'SASL' in failed else 0 :][:160]} ({how})"
        )
    return None


# The broker's answers to a principal that may not create topics.
_NOT_ALLOWED = frozenset(
    {KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED}
)


def ensure_topics(
    kafka: KafkaSettings, specs: Iterable[TopicSpec], timeout_s: float = 60.0
) -> list[str]:
    """Create the topics that do not exist yet, replicated as the settings say (by default as
    the cluster's defaults say); an existing topic is left as it is. While the cluster's
    controller moves (a broker lost: "Timed out waiting for controller") the creation is asked
    again, with fresh metadata, until `timeout_s`. Returns the topics this principal may
    neither create nor see (a secured broker's ACLs: for the control plane, which owns them,
    a deployment it cannot run)."""
    specs = list(specs)
    durability = (
        {"min.insync.replicas": str(kafka.min_insync_replicas)}
        if kafka.min_insync_replicas is not None
        else {}
    )
    if not specs:
        return []
    deadline = time.monotonic() + timeout_s
    pending = {spec.name: spec for spec in specs}
    not_ours: set[str] = set()
    while pending:
        left = max(1.0, deadline - time.monotonic())
        # Keep the client referenced until every future resolves: collecting it cancels them.
        admin = admin_client(kafka)
        futures = admin.create_topics(
            [
                NewTopic(
                    spec.name,
                    num_partitions=spec.partitions,
                    replication_factor=kafka.replication_factor,
                    config={**durability, **spec.config},
                )
                for spec in pending.values()
            ],
            operation_timeout=min(left, 30.0),
            request_timeout=min(left, 30.0),
        )
        why = ""
        for name, future in futures.items():
            try:
                future.result(timeout=left + 5)
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    pass
                elif error.code() in _NOT_ALLOWED:
                    # On a secured broker only the control plane creates topics (the broker
                    # refuses another principal even a topic that exists): this process finds
                    # them made, or fails by name on one it may not reach when it uses it.
                    not_ours.add(name)
                elif moving(error) and time.monotonic() < deadline:
                    why = error.str()
                    continue
                else:
                    raise StreamError(f"creating topic {name}: {error.str()}") from None
            pending.pop(name)
        if pending:
            log.warning("creating %d topic(s) (asked again): %s", len(pending), why)
            time.sleep(1.0)
    # Created is not yet visible: a consumer subscribing before the broker's metadata has the
    # topic gets "Subscribed topic not available". Return once every topic is listed.
    admin = admin_client(kafka)
    while True:
        listed = admin.list_topics(timeout=max(1.0, deadline - time.monotonic())).topics
        missing = [
            spec.name
            for spec in specs
            if spec.name not in not_ours
            and (
                spec.name not in listed
                or listed[spec.name].error is not None
                or not listed[spec.name].partitions
            )
        ]
        if not missing:
            return sorted(n for n in not_ours if n not in listed)
        if time.monotonic() > deadline:
            raise StreamError(f"topics created but not visible after {timeout_s}s: {missing}")
        time.sleep(0.1)


def producer(
    kafka: KafkaSettings,
    config: Mapping[str, object] | None = None,
    *,
    transactional_id: str | None = None,
) -> Producer:
    """An idempotent producer (transactional when an id is given), batching with lz4;
    `config` adds or overrides librdkafka settings."""
    conf = kafka.client_config(
        **{
            "enable.idempotence": True,
            "acks": "all",
            "compression.type": "lz4",
            "linger.ms": 20,
            "partitioner": PARTITIONER,
            **(config or {}),
        }
    )
    if transactional_id is not None:
        conf["transactional.id"] = transactional_id
    if kafka.signer is None:
        return Producer(conf)
    return SigningProducer(conf, kafka.signer)


class SigningProducer(Producer):
    """A producer every record of which carries its writer and the MAC by that writer's key
    (identity/writers.py), whoever calls `produce`: the stream loop's outputs, an agent's
    reports, a dead letter."""

    def __init__(self, conf: Mapping[str, object], signer: Signer) -> None:
        super().__init__(dict(conf))
        self.signer = signer
        # GMAC's nonces: a random prefix of this producer and a counter, so none repeats under
        # a writer's key (a new prefix before the counter could wrap).
        self._prefix = os.urandom(8)
        self._count = itertools.count()
        self._lock = threading.Lock()

    def _nonce(self) -> bytes:
        with self._lock:
            number = next(self._count)
            if number >= 2**32:
                self._prefix, self._count = os.urandom(8), itertools.count(1)
                number = 0
            return self._prefix + number.to_bytes(4, "big")

    def produce(  # type: ignore[override]
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        *,
        headers: Sequence[tuple[str, Any]] | Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(key, str):
            key = key.encode()
        if isinstance(value, str):
            value = value.encode()
        own = [
            (name, v)
            for name, v in (headers.items() if isinstance(headers, Mapping) else headers or ())
            if name not in (H_WRITER, H_MAC)
        ]
        own.extend(self.signer.headers(topic, key, value, self._nonce()))
        super().produce(topic, value, key, headers=own, **kwargs)


# For the clients of processes on the far side of links that can be cut (cluster agents, node
# agents): a request on a connection that went silent is given up after 10 s, not librdkafka's
# 60 s, and idle connections are probed. After a 30 s cut healed, a cluster agent's fetch sat on
# its dead connection and it learnt nothing of the orders for a minute more.
ACROSS_LINKS: Mapping[str, object] = {"socket.timeout.ms": 10_000, "socket.keepalive.enable": True}


def consumer(
    kafka: KafkaSettings, group_id: str, config: Mapping[str, object] | None = None
) -> Consumer:
    """A read_committed consumer that never commits by itself (unless `config` says so)."""
    return Consumer(
        kafka.client_config(
            **{
                "group.id": group_id,
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
                **(
                    {"session.timeout.ms": kafka.session_timeout_ms}
                    if kafka.session_timeout_ms
                    else {}
                ),
                **(config or {}),
            }
        )
    )


def next_offsets(messages: Iterable[Message]) -> dict[tuple[str, int], int]:
    """The offsets to commit after `messages`: one past the last of each partition."""
    last: dict[tuple[str, int], int] = {}
    for msg in messages:
        last[(msg.topic() or "", msg.partition() or 0)] = (msg.offset() or 0) + 1
    return last


def topic_partitions(offsets: Mapping[tuple[str, int], int]) -> list[TopicPartition]:
    return [
        TopicPartition(topic, partition, offset) for (topic, partition), offset in offsets.items()
    ]


def partitions_of(kafka: KafkaSettings, topic: str, timeout_s: float = 30.0) -> list[int]:
    """The partition numbers of an existing topic."""
    metadata = admin_client(kafka).list_topics(topic, timeout=timeout_s).topics.get(topic)
    if metadata is None or metadata.error is not None or not metadata.partitions:
        raise StreamError(f"topic {topic} does not exist (is the topic prefix right?)")
    return sorted(metadata.partitions)


def committed_offsets(
    kafka: KafkaSettings, group: str, topic: str, timeout_s: float = 30.0
) -> dict[int, int]:
    """The offsets consumer `group` has committed in `topic`, by partition (none: absent)."""
    partitions = [TopicPartition(topic, p) for p in partitions_of(kafka, topic, timeout_s)]
    reader = Consumer(kafka.client_config(**{"group.id": group, "enable.auto.commit": False}))
    try:
        return {
            tp.partition: tp.offset
            for tp in reader.committed(partitions, timeout=timeout_s)
            if tp.offset >= 0
        }
    finally:
        reader.close()


def group_lag(
    kafka: KafkaSettings, group: str, topics: Iterable[str], timeout_s: float = 30.0
) -> int:
    """Messages in these topics that consumer `group` has not committed past (all of a
    partition's retained log where it has committed nothing)."""
    partitions = [TopicPartition(t, p) for t in topics for p in partitions_of(kafka, t, timeout_s)]
    reader = Consumer(kafka.client_config(**{"group.id": group, "enable.auto.commit": False}))
    try:
        lag = 0
        for tp in reader.committed(partitions, timeout=timeout_s):
            low, high = _watermarks(reader, tp, timeout_s)
            lag += high - (tp.offset if tp.offset >= 0 else low)
        return lag
    finally:
        reader.close()


# What a broker answers while a partition's leadership or a coordinator moves to another broker
# (a new topic electing its leaders, a broker killed, a new leader whose high watermark has not
# caught up yet): asked again a moment later, the new one answers.
_MOVING = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.OFFSET_NOT_AVAILABLE,
        KafkaError.FENCED_LEADER_EPOCH,
        KafkaError.UNKNOWN_LEADER_EPOCH,
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.UNSTABLE_OFFSET_COMMIT,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._WAIT_COORD,
    }
)


def moving(error: KafkaError) -> bool:
    """Whether `error` is one that asking again, a moment later, may answer."""
    return error.code() in _MOVING or bool(error.retriable())


def _watermarks(reader: Consumer, tp: TopicPartition, timeout_s: float) -> tuple[int, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            low, high = reader.get_watermark_offsets(tp, timeout=timeout_s, cached=False)
            return int(low), int(high)
        except KafkaException as exc:
            if not moving(exc.args[0]) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# How long `stable_bounds` asks one admin client before it asks through a new one.
ADMIN_RENEW_S = 2.0


def _unled(admin: AdminClient, topic: str, partitions: list[int], timeout_s: float) -> str:
    """Why `admin`'s metadata has no leader for some of `partitions` of `topic` ("" when it
    has one for each), after asking the cluster for that topic's metadata now.

    librdkafka's ListOffsets (2.16) looks up the leaders in its metadata cache; one it does not
    find there is waited for asynchronously, and a cache update landing while the calling
    thread is still setting that wait up frees the request under it: the test process died of
    SIGSEGV in `rd_kafka_topic_partition_list_query_leaders_async_worker`, in a pthread mutex,
    asking through an admin client just made. With the leaders in the cache the lookup ends at
    once, in the calling thread. The topic's error that asking again cannot mend is raised
    (StreamError)."""
    try:
        listed = admin.list_topics(topic=topic, timeout=timeout_s).topics.get(topic)
    except KafkaException as exc:  # the client's own (no broker answered in time): asked again
        return f"metadata: {exc.args[0].str()}"
    if listed is None:
        return "metadata: no such topic"
    if listed.error is not None:
        if not moving(listed.error):
            raise StreamError(f"the end of {topic}: {listed.error.str()}")  # denied, say
        return f"metadata: {listed.error.str()}"
    # A leader is what the lookup needs (a partition with a replica down still has one and
    # answers with REPLICA_NOT_AVAILABLE).
    unled = [p for p in partitions if p not in listed.partitions or listed.partitions[p].leader < 0]
    return f"no leader known for partition(s) {unled}" if unled else ""


def stable_bounds(
    kafka: KafkaSettings,
    topic: str,
    partitions: Iterable[int],
    timeout_s: float = 30.0,
    admin: AdminClient | None = None,
) -> dict[int, tuple[int, int]]:
    """Each partition's first offset and its last stable offset, as its leader answers now: the
    end a read_committed reader reaches (past every decided transaction, before the first one
    still open). While leadership moves it asks again; a partition whose bounds cannot be had
    within `timeout_s` is a StreamError, so that no caller takes a short log for the whole."""
    admin = admin or admin_client(kafka)
    asked_since = time.monotonic()
    wanted = sorted(set(partitions))
    bounds: dict[int, tuple[int, int]] = {}
    deadline = time.monotonic() + timeout_s
    why = ""
    while True:
        pending = [p for p in wanted if p not in bounds]
        if not pending:
            return bounds
        left = deadline - time.monotonic()
        if left <= 0:
            raise StreamError(
                f"the end of {topic} partition(s) {pending} could not be established in "
                f"{timeout_s:.0f} s (last answer: {why or 'none'})"
            )
        # The leaders first (`_unled`); the bounds only of a client that knows them.
        unled = _unled(admin, topic, pending, max(1.0, min(10.0, left)))
        why = unled or why
        if not unled:
            first, last = (
                admin.list_offsets(
                    {TopicPartition(topic, p): spec for p in pending},
                    isolation_level=IsolationLevel.READ_COMMITTED,
                    request_timeout=max(1.0, min(10.0, left)),
                )
                for spec in (OffsetSpec.earliest(), OffsetSpec.latest())  # type: ignore[no-untyped-call]
            )
            for tp, future in first.items():
                try:
                    low = future.result().offset
                    high = last[tp].result().offset
                except KafkaException as exc:
                    error: KafkaError = exc.args[0]
                    if not moving(error):
                        raise StreamError(
                            f"the end of {topic}[{tp.partition}]: {error.str()}"
                        ) from None
                    why = error.str()
                    continue
                if low < 0 or high < low:
                    # A leader being elected can answer with no offset and no error.
                    why = f"offsets {low} to {high}"
                    continue
                bounds[tp.partition] = (int(low), int(high))
        if len(bounds) < len(wanted):
            if time.monotonic() - asked_since >= ADMIN_RENEW_S:
                # librdkafka's admin client can go on asking with a leader epoch the broker
                # has fenced (FENCED_LEADER_EPOCH for minutes after a broker kill, seen in
                # `make chaos`); a new client asks with fresh metadata.
                admin, asked_since = admin_client(kafka), time.monotonic()
            time.sleep(0.2)


# How many times a settling read asks for the ends again once it reached them.
SETTLE_ROUNDS = 3
# How long a read may receive nothing before it asks the partitions' leaders where their ends
# stand now (and, where they are past this read, starts its consumer afresh).
STALL_CHECK_S = 10.0


def read_to_end(
    kafka: KafkaSettings,
    topic: str,
    partitions: Iterable[int],
    group_id: str,
    timeout_s: float = 60.0,
    settle: bool = False,
) -> Iterator[Message]:
    """The committed messages of `partitions` of `topic`, from the start up to each one's last
    stable offset as its leader gave it when the read began. Waiting for end-of-partition
    instead would never finish while a live writer keeps appending.

    With `settle` (a store restoring partitions that no one else writes), the ends are asked
    again once reached, and reading goes on to the new ones, until they stop moving or
    `SETTLE_ROUNDS` times (a live writer would move them for ever): a transaction that was
    still being decided when the read began (its markers in flight to a new leader) is read
    too once it commits.

    A read that receives nothing for `STALL_CHECK_S` asks the leaders again: a leader whose
    end is behind this read's (leadership moved, and the new leader's high watermark waits for
    an in-sync replica) is waited for; a leader that has what this read waits for while the
    consumer delivers nothing gets a new consumer, from the next offset on (librdkafka's
    fetcher can stay on a partition's old leader). A read that cannot establish an end, or
    receives nothing for `timeout_s`, is a StreamError: never a short read returned as
    whole."""
    admin = admin_client(kafka)
    bounds = stable_bounds(kafka, topic, partitions, timeout_s, admin)
    ends = {p: high for p, (low, high) in bounds.items()}
    remaining = {p for p, (low, high) in bounds.items() if high > low}
    if not remaining and not settle:
        return
    reader = _PartitionReader(kafka, topic, group_id, sorted(bounds))

    def ends_now(wanted: Iterable[int]) -> dict[int, int]:
        now = stable_bounds(kafka, topic, wanted, min(timeout_s, STALL_CHECK_S), admin)
        return {p: high for p, (_, high) in now.items()}

    try:
        for round_ in range(SETTLE_ROUNDS + 1):
            yield from _read_until(reader, ends, remaining, timeout_s, ends_now)
            if not settle or round_ == SETTLE_ROUNDS:
                return
            again = stable_bounds(kafka, topic, bounds, timeout_s, admin)
            grown = {p: high for p, (_, high) in again.items() if high > ends[p]}
            if not grown:
                return
            for p, high in sorted(grown.items()):
                # Messages past the old end may have been fetched and passed over: read them
                # again from there.
                reader.seek(p, ends[p])
                ends[p] = high
                remaining.add(p)
    finally:
        reader.close()


class _PartitionReader:
    """A consumer assigned to some partitions of a topic, which knows the next offset it is to
    hand over of each, so that it can be replaced by a new one that goes on from there."""

    def __init__(
        self, kafka: KafkaSettings, topic: str, group_id: str, partitions: list[int]
    ) -> None:
        self.kafka = kafka
        self.topic = topic
        self.group_id = group_id
        self.next = dict.fromkeys(partitions, OFFSET_BEGINNING)
        self.consumer = self._assigned()

    def _assigned(self) -> Consumer:
        reader = consumer(self.kafka, self.group_id)
        reader.assign([TopicPartition(self.topic, p, o) for p, o in sorted(self.next.items())])
        return reader

    def poll(self, timeout_s: float) -> Message | None:
        return self.consumer.poll(timeout_s)

    def handed_over(self, partition: int, offset: int) -> None:
        self.next[partition] = offset + 1

    def positions(self, partitions: Iterable[int]) -> dict[int, int]:
        """Where the consumer stands in each partition (negative before its first message)."""
        asked = [TopicPartition(self.topic, p) for p in partitions]
        return {tp.partition: tp.offset for tp in self.consumer.position(asked)}

    def seek(self, partition: int, offset: int) -> None:
        self.next[partition] = offset
        _seek(self.consumer, TopicPartition(self.topic, partition, offset))

    def renew(self) -> None:
        self.consumer.close()
        self.consumer = self._assigned()

    def close(self) -> None:
        self.consumer.close()


def _seek(reader: Consumer, tp: TopicPartition) -> None:
    try:
        reader.seek(tp)
    except KafkaException:
        # seek() needs a partition already being fetched; assigning it again works in any state.
        reader.incremental_unassign([TopicPartition(tp.topic, tp.partition)])
        reader.incremental_assign([tp])


def _read_until(
    reader: _PartitionReader,
    ends: dict[int, int],
    remaining: set[int],
    timeout_s: float,
    ends_now: Callable[[Iterable[int]], dict[int, int]],
    stall_check_s: float = STALL_CHECK_S,
) -> Iterator[Message]:
    """Yield what `reader` fetches below `ends` until every partition in `remaining` is there;
    `ends_now` asks the leaders for their ends when nothing arrives for `stall_check_s`."""
    topic = reader.topic
    progressed = checked = time.monotonic()
    while remaining:
        now = time.monotonic()
        if now - progressed > timeout_s:
            raise StreamError(
                f"reading {topic}: nothing arrived for {timeout_s:.0f}s; partitions not at "
                f"their end: {_standing(reader, ends, remaining)}"
            )
        if now - max(progressed, checked) >= stall_check_s:
            checked = now
            _unstick(reader, ends, remaining, ends_now)
        msg = reader.poll(0.2)
        error = None if msg is None else msg.error()
        if error is not None and not (error.code() == KafkaError._PARTITION_EOF or moving(error)):
            raise StreamError(f"reading {topic}: {error.str()}")
        if msg is None or error is not None:
            # Nothing handed over (or a leader moving: the fetcher follows it, the clock bounds
            # it): past the end is the end, whether or not a message was left to hand over
            # (transaction markers and aborted records never are).
            for partition, position in reader.positions(remaining).items():
                if position >= ends[partition]:
                    remaining.discard(partition)
                    progressed = time.monotonic()
            continue
        _, partition, offset = where(msg)
        if offset >= ends[partition]:
            remaining.discard(partition)
            progressed = time.monotonic()
            continue  # appended after the read began
        reader.handed_over(partition, offset)
        yield msg
        # The limit is on a stalled read, not on what the caller does with each message
        # (a replay folds the scheduler's whole log as it reads it).
        progressed = time.monotonic()
        if offset + 1 >= ends[partition]:
            remaining.discard(partition)


def _standing(reader: _PartitionReader, ends: Mapping[int, int], partitions: Iterable[int]) -> str:
    """Where each partition's read stands against its end, for a log line or an error."""
    return ", ".join(
        f"[{p}] next {reader.next[p] if reader.next[p] >= 0 else 'the first'} of end {ends[p]}"
        for p in sorted(partitions)
    )


def _unstick(
    reader: _PartitionReader,
    ends: Mapping[int, int],
    remaining: set[int],
    ends_now: Callable[[Iterable[int]], dict[int, int]],
) -> None:
    """A read that received nothing for a while: wait for leaders behind its ends, and take a
    new consumer where a leader has what the old one does not deliver."""
    try:
        now = ends_now(sorted(remaining))
    except StreamError as exc:
        log.warning(
            "reading %s: nothing arrived, and the ends are not known now: %s", reader.topic, exc
        )
        return
    behind = {p: high for p, high in now.items() if high < ends[p]}
    if behind:
        log.warning(
            "reading %s: nothing arrived; the leader's end of %s is behind this read's (%s): "
            "waiting for it",
            reader.topic,
            ", ".join(f"[{p}] at {high}" for p, high in sorted(behind.items())),
            _standing(reader, ends, behind),
        )
    if len(behind) < len(now):
        log.warning(
            "reading %s: nothing arrived though the leaders have it (%s): reading on with a "
            "new consumer",
            reader.topic,
            _standing(reader, ends, set(now) - set(behind)),
        )
        reader.renew()
