"""The imperative shell around the resource view: Kafka in, view parts in memory, snapshots out.

The view is split into parts: `shard-<p>` folds partition p of the node topics (telemetry and
node state are co-partitioned by node id), `fleet` folds the small fleet topics whole. Instances
in one consumer group share the shards (the range assignor gives each member the same partition
numbers of both node topics); every instance reads the fleet topics itself. A part's effect is
its snapshot, which carries the offsets it stands at, so a restarted instance loads the newest
snapshot of each shard it is given and resumes right after it: nothing is folded twice or
skipped. Consumer-group offsets are committed after each snapshot, for lag monitoring only.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, Message, TopicPartition

from fleetline.config import KafkaSettings
from fleetline.errors import FleetlineError, InvalidEventError
from fleetline.processors.view.fold import (
    GPU_FIELDS,
    HealthPolicy,
    ResourceView,
    apply,
    compose,
    fold_telemetry,
    forget,
)
from fleetline.storage.snapshots import ViewSnapshots
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.columnar import TelemetryBatchDecoder
from fleetline.streams.deadletter import send_dead_letter
from fleetline.streams.events import (
    ALLOCATION,
    CLUSTER_INFO,
    DATASET_STATE,
    NODE_STATE,
    NODE_TELEMETRY,
)
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.topics import Topics

log = logging.getLogger(__name__)

APPLICATION_ID = "resource-view"
FLEET_PART = "fleet"
T = TypeVar("T")


def tune_gc_for_large_state() -> None:
    """The view holds ~10 long-lived objects per GPU and a batch makes ~20 short-lived ones per
    sample; with the default thresholds the collector rescans the view every few batches for
    nothing (measured: it triples the cost of turning decoded columns into tuples)."""
    gc.set_threshold(200_000, 50, 1000)


def shard_part(partition: int) -> str:
    return f"shard-{partition:03d}"


@dataclass(frozen=True)
class TopicRole:
    record: str  # the record the topic carries
    key_field: str  # the field the message key must equal
    tombstone: str | None  # what a null value removes, on compacted topics


def topic_roles(topics: Topics) -> dict[str, TopicRole]:
    return {
        topics.telemetry: TopicRole(NODE_TELEMETRY, "node_id", None),
        topics.node_state: TopicRole(NODE_STATE, "node_id", "node"),
        topics.clusters: TopicRole(CLUSTER_INFO, "cluster_id", "cluster"),
        topics.datasets: TopicRole(DATASET_STATE, "dataset_id", "dataset"),
        topics.allocations: TopicRole(ALLOCATION, "job_id", None),
    }


@dataclass
class PartFolder:
    """Folds batches of Kafka messages into view parts, the same way live and in replay.

    A run of telemetry messages from one partition goes through the columnar decoder; anything
    it will not vouch for, and every other record, is decoded and folded one by one. A message
    that cannot be folded is returned with its error (to be dead-lettered) and still counts as
    consumed, so a bad message never stops the fold and is never silently lost.
    """

    topics: Topics
    policy: HealthPolicy = field(default_factory=HealthPolicy)
    codec: AvroCodec = field(default_factory=default_codec)

    def __post_init__(self) -> None:
        self.roles = topic_roles(self.topics)
        self.decoder = TelemetryBatchDecoder(self.codec, GPU_FIELDS)
        self.node_topics = set(self.topics.node_topics)

    def part_of(self, topic: str, partition: int) -> str:
        return shard_part(partition) if topic in self.node_topics else FLEET_PART

    def new_part(self) -> ResourceView:
        return ResourceView(policy=self.policy)

    def fold(self, parts: dict[str, ResourceView],
             messages: Iterable[Message]) -> list[tuple[Message, FleetlineError]]:
        runs: dict[tuple[str, int], list[Message]] = {}
        for msg in messages:
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    continue
                raise KafkaException(msg.error())
            runs.setdefault((msg.topic(), msg.partition()), []).append(msg)
        failed: list[tuple[Message, FleetlineError]] = []
        for (topic, partition), run in runs.items():
            name = self.part_of(topic, partition)
            view = parts.get(name)
            if view is None:
                view = parts[name] = self.new_part()
            if topic == self.topics.telemetry:
                self._fold_telemetry_run(view, topic, partition, run, failed)
            else:
                for msg in run:
                    self._fold_one(view, msg, failed)
        return failed

    def _fold_telemetry_run(self, view: ResourceView, topic: str, partition: int,
                            run: Sequence[Message],
                            failed: list[tuple[Message, FleetlineError]]) -> None:
        rows = self.decoder.decode([m.key() for m in run], [m.value() for m in run])
        for msg, row in zip(run, rows, strict=True):
            if row is None:  # the batch path could not read it: record by record, in order
                self._fold_one(view, msg, failed)
                continue
            try:
                fold_telemetry(view, *row)
            except FleetlineError as exc:
                failed.append((msg, exc))
            view.advance(topic, partition, msg.offset())

    def _fold_one(self, view: ResourceView, msg: Message,
                  failed: list[tuple[Message, FleetlineError]]) -> None:
        role = self.roles.get(msg.topic())
        try:
            if role is None:
                raise InvalidEventError(f"the resource view does not read {msg.topic()}")
            key = msg.key()
            if msg.value() is None and role.tombstone is not None and key is not None:
                forget(view, role.tombstone, key.decode(errors="replace"))
            else:
                event = self.codec.decode(msg.value(), expect=role.record)
                entity = event.record[role.key_field]
                if key is None or key.decode(errors="replace") != entity:
                    raise InvalidEventError(
                        f"message key {key!r} is not the record's {role.key_field} {entity!r}")
                apply(view, event)
        except FleetlineError as exc:
            failed.append((msg, exc))
        view.advance(msg.topic(), msg.partition(), msg.offset())


@dataclass
class ViewStats:
    messages: int = 0
    dead_letters: int = 0
    snapshots: int = 0
    batches: int = 0
    restored_parts: int = 0


@dataclass
class ViewProcessor:
    """Runs the fold live: consumes, folds, dead-letters, snapshots, and serves reads."""

    kafka: KafkaSettings
    topics: Topics
    snapshots: ViewSnapshots
    policy: HealthPolicy = field(default_factory=HealthPolicy)
    group_id: str = APPLICATION_ID
    instance_id: str = "0"
    batch_size: int = 5000
    poll_timeout_s: float = 0.2
    snapshot_interval_s: float = 30.0
    stats: ViewStats = field(default_factory=ViewStats)
    ready: threading.Event = field(default_factory=threading.Event)
    # Set once a poll after the assignment comes back empty: the view has folded the log as far
    # as it went (readers that must not act on a half-restored view wait for it).
    caught_up: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.folder = PartFolder(self.topics, self.policy)
        self.parts: dict[str, ResourceView] = {}
        self._lock = threading.Lock()
        self._snapshotted: dict[str, int] = {}

    def read(self, fn: Callable[[ResourceView], T]) -> T:
        """Run `fn` over the composed view of this instance's parts, with the fold paused."""
        with self._lock:
            return fn(compose(self.parts.values()))

    def _restore(self, part: str) -> ResourceView:
        info = self.snapshots.latest(part)
        if info is None:
            return self.folder.new_part()
        view = self.snapshots.load(info)
        if view.policy != self.policy:
            log.warning("%s: snapshot was folded under another health policy; refolding", part)
            return self.folder.new_part()
        self.stats.restored_parts += 1
        self._snapshotted[part] = info.position
        return view

    def _resume_offsets(self, partitions: Iterable[TopicPartition]) -> list[TopicPartition]:
        out = []
        for tp in partitions:
            part = self.folder.part_of(tp.topic, tp.partition)
            with self._lock:
                view = self.parts.get(part)
                if view is None:
                    view = self.parts[part] = self._restore(part)
            nxt = view.offsets.get(tp.topic, {}).get(tp.partition)
            out.append(TopicPartition(tp.topic, tp.partition,
                                      OFFSET_BEGINNING if nxt is None else nxt))
        return out

    def run(self, stop: threading.Event) -> None:
        tune_gc_for_large_state()
        dlq = kafka_clients.producer(self.kafka)
        nodes = kafka_clients.consumer(self.kafka, self.group_id,
                                       **{"partition.assignment.strategy": "range"})
        fleet = kafka_clients.consumer(self.kafka, f"{self.group_id}.fleet.{self.instance_id}")
        fleet.assign(self._resume_offsets(
            TopicPartition(t, 0) for t in self.topics.fleet_topics))

        def on_assign(consumer, partitions: list[TopicPartition]) -> None:
            consumer.assign(self._resume_offsets(partitions))
            self.ready.set()

        def on_revoke(consumer, partitions: list[TopicPartition]) -> None:
            gone = {self.folder.part_of(tp.topic, tp.partition) for tp in partitions}
            self.snapshot(gone)
            with self._lock:
                for part in gone:
                    self.parts.pop(part, None)
                    self._snapshotted.pop(part, None)

        nodes.subscribe(list(self.topics.node_topics), on_assign=on_assign, on_revoke=on_revoke)
        last_snapshot = time.monotonic()
        try:
            while not stop.is_set():
                messages = nodes.consume(self.batch_size, self.poll_timeout_s)
                messages += fleet.consume(self.batch_size, 0)
                if messages:
                    self._fold(dlq, messages)
                elif self.ready.is_set():
                    self.caught_up.set()
                due = time.monotonic() - last_snapshot >= self.snapshot_interval_s
                if due or (not messages and self._behind_snapshot()):
                    self.snapshot()
                    self._commit(nodes)
                    last_snapshot = time.monotonic()
            self.snapshot()
            self._commit(nodes)
        finally:
            nodes.close()
            fleet.close()
            dlq.flush(10)

    def _fold(self, dlq: Any, messages: list[Message]) -> None:
        with self._lock:
            failed = self.folder.fold(self.parts, messages)
            for view in self.parts.values():
                view.drain_changes()
        for msg, exc in failed:
            send_dead_letter(dlq, self.topics.dead_letter, self.group_id, msg, exc)
        if failed:
            # Dead letters must be durable before the snapshot that skips past them.
            dlq.flush(30)
        self.stats.messages += len(messages)
        self.stats.dead_letters += len(failed)
        self.stats.batches += 1

    def _behind_snapshot(self) -> bool:
        with self._lock:
            positions = {name: sum(sum(p.values()) for p in view.offsets.values())
                         for name, view in self.parts.items()}
        return any(position and position != self._snapshotted.get(name)
                   for name, position in positions.items())

    def snapshot(self, parts: Iterable[str] | None = None) -> None:
        """Save every part (or the named ones) that moved since its last snapshot."""
        names = list(self.parts) if parts is None else list(parts)
        for name in names:
            with self._lock:
                view = self.parts.get(name)
                if view is None:
                    continue
                position = sum(sum(p.values()) for p in view.offsets.values())
                if position == 0 or self._snapshotted.get(name) == position:
                    continue  # nothing folded yet, or nothing new since the last one
                info = self.snapshots.save(name, view)
                self._snapshotted[name] = info.position
            self.stats.snapshots += 1

    def _commit(self, nodes: Any) -> None:
        with self._lock:
            offsets = [TopicPartition(t, p, o) for view in self.parts.values()
                       for t, ps in view.offsets.items() if t in self.folder.node_topics
                       for p, o in ps.items()]
        if offsets:
            try:
                nodes.commit(offsets=offsets, asynchronous=False)
            except KafkaException as exc:
                log.warning("%s: committing offsets for lag monitoring: %s", self.group_id, exc)

