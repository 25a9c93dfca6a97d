"""The resource view live: the stream loop folds the fleet's topics into view parts in memory,
snapshots them to object storage, and serves reads.

Instances in one consumer group share the shards (the range assignor gives each member the same
partition numbers of both node topics); every instance reads the fleet topics whole. A part's
effect is its snapshot, which carries the offsets it stands at, so a restarted instance loads
the newest snapshot of each shard it is given and resumes right after it: nothing is folded
twice or skipped. Consumer-group offsets are committed after each snapshot, for lag monitoring.

In a sharded deployment (`serve --sharded`) each instance also publishes its parts' capacity
summaries (`view/summary.py`) when they change, and a scheduler anywhere reads them with a
`SummaryFollower` instead of holding a view of every shard.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from confluent_kafka import OFFSET_BEGINNING, KafkaError, Message, TopicPartition

from fleetline.config import KafkaSettings
from fleetline.errors import StreamError
from fleetline.identity.writers import EstablishesWriters
from fleetline.observability import metrics
from fleetline.processors.view import APPLICATION_ID
from fleetline.processors.view.fold import compose
from fleetline.processors.view.folder import PartFolder
from fleetline.processors.view.model import HealthPolicy, ResourceView
from fleetline.processors.view.read import ViewSource, latest_samples
from fleetline.processors.view.snapshots import ViewSnapshots
from fleetline.processors.view.summary import SummaryCache, owned_by, summarize
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import CAPACITY_SUMMARY
from fleetline.streams.loop import Step, StepResult, StreamLoop, deliver, run_beside
from fleetline.streams.records import Output, position, where
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.topics import Topics
from fleetline.streams.writers import WriterGate

log = logging.getLogger(__name__)

T = TypeVar("T")


def tune_gc_for_large_state() -> None:
    """The view holds ~10 long-lived objects per GPU and a batch makes ~20 short-lived ones per
    sample; with the default thresholds the collector rescans the view every few batches for
    nothing (measured: it triples the cost of turning decoded columns into tuples)."""
    gc.set_threshold(200_000, 50, 1000)


@dataclass
class ViewStats:
    snapshots: int = 0
    restored_parts: int = 0


class ViewStep(Step[None]):
    """The view as the stream loop drives it: parts restored from snapshots on assignment,
    batches folded, parts snapshotted when due."""

    def __init__(
        self,
        topics: Topics,
        snapshots: ViewSnapshots,
        policy: HealthPolicy,
        snapshot_interval_s: float,
        stats: ViewStats,
        gate: EstablishesWriters,
    ) -> None:
        self.folder = PartFolder(topics, policy, gate=gate)
        self.snapshots = snapshots
        self.policy = policy
        self.snapshot_interval_s = snapshot_interval_s
        self.stats = stats
        self.parts: dict[str, ResourceView] = {}
        self.lock = threading.Lock()
        self._snapshotted: dict[str, int] = {}
        self._last_snapshot = time.monotonic()
        # Parts given to this instance since it last found nothing more to read: restored from
        # a snapshot, they may stand well behind the log (see `settled_parts`).
        self.catching_up: set[str] = set()

    def _restore(self, part: str) -> ResourceView:
        info, view, notes = self.snapshots.load_newest(part)
        for note in notes:
            log.warning("%s", note)
        if info is None or view is None:
            return self.folder.new_part()
        if view.policy != self.policy:
            log.warning("%s: snapshot was folded under another health policy; refolding", part)
            return self.folder.new_part()
        self.stats.restored_parts += 1
        self._snapshotted[part] = info.position
        return view

    def assigned(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        out = []
        for tp in partitions:
            part = self.folder.part_of(tp.topic, tp.partition)
            with self.lock:
                view = self.parts.get(part)
                if view is None:
                    view = self.parts[part] = self._restore(part)
                    self.catching_up.add(part)
            nxt = view.offsets.get(tp.topic, {}).get(tp.partition)
            out.append(
                TopicPartition(tp.topic, tp.partition, OFFSET_BEGINNING if nxt is None else nxt)
            )
        return out

    def revoked(self, partitions: list[TopicPartition]) -> None:
        gone = {self.folder.part_of(tp.topic, tp.partition) for tp in partitions}
        self.snapshot(gone)
        with self.lock:
            for part in gone:
                self.parts.pop(part, None)
                self._snapshotted.pop(part, None)

    def process(self, messages: list[Message]) -> StepResult[None]:
        with self.lock:
            failed = self.folder.fold(self.parts, messages)
            for view in self.parts.values():
                view.drain_changes()
        return StepResult(dead_letters=failed)

    def checkpoint(self, idle: bool) -> bool:
        if idle and self.catching_up:
            with self.lock:
                self.catching_up.clear()
        due = time.monotonic() - self._last_snapshot >= self.snapshot_interval_s
        if not (due or (idle and self._behind_snapshot())):
            return False
        self.snapshot()
        self._last_snapshot = time.monotonic()
        return True

    def _behind_snapshot(self) -> bool:
        with self.lock:
            positions = {name: position(view.offsets) for name, view in self.parts.items()}
        return any(at and at != self._snapshotted.get(name) for name, at in positions.items())

    def settled_parts(self) -> dict[str, ResourceView]:
        """The parts whose nodes may be judged now (call with the lock held): a part still
        catching up with the log after its assignment (a shard taken over from a dead instance,
        restored from its last snapshot) would make every node it holds look unheard-of against
        the other parts' event time, so it waits until the instance has read everything once,
        or until its own event time is within the unreachable timeout of theirs."""
        latest = max((v.watermark_ms for v in self.parts.values()), default=0)
        within = self.policy.unreachable_after_ms
        return {
            name: view
            for name, view in self.parts.items()
            if name not in self.catching_up or latest - view.watermark_ms <= within
        }

    def snapshot(self, parts: Iterable[str] | None = None) -> None:
        """Save every part (or the named ones) that moved since its last snapshot."""
        for name in list(self.parts) if parts is None else list(parts):
            with self.lock:
                view = self.parts.get(name)
                if view is None:
                    continue
                at = position(view.offsets)
                if at == 0 or self._snapshotted.get(name) == at:
                    continue  # nothing folded yet, or nothing new since the last one
                info = self.snapshots.save(name, view)
                self._snapshotted[name] = info.position
            self.stats.snapshots += 1


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
    # Publish the parts' capacity summaries every so often (None: a view that serves only
    # reads and a scheduler of its own process).
    summary_interval_s: float | None = None

    def __post_init__(self) -> None:
        self.step = ViewStep(
            self.topics,
            self.snapshots,
            self.policy,
            self.snapshot_interval_s,
            self.stats,
            WriterGate(self.kafka, self.topics),
        )
        self.loop = StreamLoop(
            self.kafka,
            self.group_id,
            list(self.topics.node_topics),
            self.step,
            self.topics.dead_letter,
            global_inputs=list(self.topics.fleet_topics),
            instance_id=self.instance_id,
            max_messages=self.batch_size,
            max_wait_s=self.poll_timeout_s,
            consumer_config={"partition.assignment.strategy": "range"},
        )
        self.name = self.group_id
        self.ready = self.loop.ready
        self.caught_up = self.loop.caught_up
        self.summaries: SummaryPublisher | None = None
        if self.summary_interval_s is not None:
            self.summaries = SummaryPublisher(self.kafka, self.topics, self.step)

    @property
    def parts(self) -> dict[str, ResourceView]:
        return self.step.parts

    def read(self, fn: Callable[[ResourceView], T]) -> T:
        """Run `fn` over the composed view of this instance's parts, with the fold paused."""
        with self.step.lock:
            return fn(compose(self.step.parts.values()))

    def snapshot(self, parts: Iterable[str] | None = None) -> None:
        self.step.snapshot(parts)

    def run(self, stop: threading.Event) -> None:
        tune_gc_for_large_state()
        if self.summaries is None:
            self.loop.run(stop)
        else:
            run_beside(self.loop, stop, self._publish_summaries, "view-summaries")

    def _publish_summaries(self, stop: threading.Event) -> None:
        assert self.summaries is not None and self.summary_interval_s is not None
        # Summaries of a view still restoring would tell the scheduler of a smaller fleet.
        while not stop.is_set() and not self.caught_up.wait(1.0):
            pass
        try:
            while not stop.is_set():
                self.summaries.publish()
                stop.wait(self.summary_interval_s)
        finally:
            self.summaries.close()


class SummaryFollower:
    """The summaries topic read from its start, by key: what the shards last published as of a
    position of the log (the next offset to read), for a scheduler's ticks and their replay."""

    def __init__(
        self,
        kafka: KafkaSettings,
        topics: Topics,
        codec: AvroCodec | None = None,
        decode: bool = True,
    ):
        self.kafka = kafka
        self.topic = topics.summaries
        self.codec = codec or default_codec()
        # Without `decode` only `raw` is kept (a publisher compares bytes, it reads no record).
        self.decode = decode
        self.records: dict[str, dict[str, Any]] = {}
        self.raw: dict[str, tuple[int, bytes | None]] = {}  # key -> (offset, value)
        self.position = 0
        self._held: Message | None = None  # read past the position a replay asked for
        self._consumer = kafka_clients.consumer(kafka, f"fleetline-summaries-{uuid.uuid4().hex}")
        self._consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])

    def close(self) -> None:
        self._consumer.close()

    @property
    def offsets(self) -> dict[str, dict[int, int]]:
        return {self.topic: {0: self.position}}

    def _apply(self, msg: Message) -> None:
        key = (msg.key() or b"").decode(errors="replace")
        value = msg.value()
        if value is None:
            self.records.pop(key, None)
        elif self.decode:
            self.records[key] = self.codec.decode(value, expect=CAPACITY_SUMMARY).record
        offset = where(msg)[2]
        self.raw[key] = (offset, value)
        self.position = offset + 1

    def _receive(self, timeout_s: float) -> list[Message]:
        out = []
        for msg in self._consumer.consume(1000, timeout_s):
            error = msg.error()
            if error is None:
                out.append(msg)
            elif error.code() != KafkaError._PARTITION_EOF:
                raise StreamError(f"reading {self.topic}: {error.str()}")
        return out

    def poll(self, timeout_s: float = 0.0) -> int:
        """Apply what has been appended since; how many records."""
        applied = 0
        if self._held is not None:
            # Read past the target of an `at` (a record appended after `to_end` took the end):
            # the consumer has moved on from it, so it is applied here or never.
            held, self._held = self._held, None
            self._apply(held)
            applied += 1
        while True:
            batch = self._receive(timeout_s if not applied else 0.0)
            for msg in batch:
                self._apply(msg)
            applied += len(batch)
            if not batch:
                return applied

    def _end(self) -> int:
        _, high = self._consumer.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=30)
        return int(high)

    def to_end(self, timeout_s: float = 60.0) -> None:
        """Read up to the end the topic has now."""
        self.at(self._end(), timeout_s)

    def at(self, target: int, timeout_s: float = 60.0) -> dict[str, dict[str, Any]]:
        """The summaries as of `target` (every record below that offset applied, none at or
        past it); forwards from where it stands, or again from the start."""
        if target < self.position:
            self._consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
            self.records, self.raw, self.position, self._held = {}, {}, 0, None
        deadline = time.monotonic() + timeout_s
        while self.position < target:
            if self._held is not None:
                batch, self._held = [self._held], None
            else:
                batch = self._receive(0.5)
            if not batch:
                end = self._end()
                if end <= self.position:  # nothing more to read
                    self.position = max(self.position, min(target, end))
                    break
                if time.monotonic() > deadline:
                    raise StreamError(
                        f"{self.topic} did not reach offset {target} in {timeout_s:.0f} s "
                        f"(at {self.position})"
                    )
                continue
            for i, msg in enumerate(batch):
                offset = where(msg)[2]
                if offset >= target:  # compaction left a gap just below the target
                    self.position, self._held = target, msg
                    if i + 1 < len(batch):
                        self._consumer.seek(TopicPartition(self.topic, 0, where(batch[i + 1])[2]))
                    break
                self._apply(msg)
        return self.records


class SummaryPublisher:
    """Publishes the summaries of the parts an instance holds, each when it differs from what
    the topic last holds for its key, and removes its keys that no longer summarise anything."""

    def __init__(self, kafka: KafkaSettings, topics: Topics, step: ViewStep) -> None:
        self.topics = topics
        self.step = step
        self.codec = default_codec()
        self.cache: SummaryCache = {}
        self.published = 0
        self._seen = SummaryFollower(kafka, topics, self.codec, decode=False)
        self._mine: dict[str, tuple[int, bytes | None]] = {}
        self._producer = kafka_clients.producer(kafka, {"linger.ms": 5})

    def close(self) -> None:
        self._seen.close()
        self._producer.flush(10)

    def _current(self, key: str) -> bytes | None:
        """What the topic holds for `key` now: the later of what was read and what was sent."""
        read, mine = self._seen.raw.get(key), self._mine.get(key)
        latest = read if mine is None or (read is not None and read[0] >= mine[0]) else mine
        return None if latest is None else latest[1]

    def publish(self) -> int:
        """One round; how many records it sent."""
        self._seen.poll()
        with self.step.lock:
            parts = self.step.settled_parts()
            records = summarize(parts, cache=self.cache)
        outputs = []
        for key, record in records.items():
            value = self.codec.encode(CAPACITY_SUMMARY, record)
            if self._current(key) != value:
                outputs.append(Output(self.topics.summaries, key.encode(), value))
        for key in sorted(set(self._seen.raw) | set(self._mine)):
            if key not in records and owned_by(key, parts) and self._current(key) is not None:
                outputs.append(Output(self.topics.summaries, key.encode(), None))
        if outputs:
            offsets = deliver(
                self._producer, outputs, f"the summaries topic {self.topics.summaries}"
            )
            for out, offset in zip(outputs, offsets, strict=True):
                self._mine[(out.key or b"").decode()] = (offset, out.value)
            self.published += len(outputs)
        return len(outputs)


def declare_clusters(
    kafka: KafkaSettings, topics: Topics, records: Sequence[Mapping[str, Any]]
) -> list[int]:
    """Append ClusterInfo records (what operators declare of their clusters) to the clusters
    topic, keyed by cluster, and wait until the broker has them; their offsets."""
    codec = default_codec()
    outputs = [
        Output(
            topics.clusters,
            r["cluster_id"].encode(),
            codec.encode(topics.record_of(topics.clusters), r),
        )
        for r in records
    ]
    producer = kafka_clients.producer(kafka, {"linger.ms": 0})
    return deliver(producer, outputs, f"the clusters topic {topics.clusters}")


def dcgm_readings(source: ViewSource) -> Callable[[], Iterator[metrics.GpuReading]]:
    """The view's GPUs as DCGM exporter series: each GPU's latest sample, read at scrape time
    (references under the view's lock, the series built after it is let go)."""

    def readings() -> Iterator[metrics.GpuReading]:
        for node_id, cluster, region, sample in source.read(latest_samples):
            yield metrics.gpu_reading(node_id, cluster, region, sample._asdict())

    return readings
