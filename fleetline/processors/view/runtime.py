"""The resource view live: the stream loop folds the fleet's topics into view parts in memory,
snapshots them to object storage, and serves reads.

Instances in one consumer group share the shards (the range assignor gives each member the same
partition numbers of both node topics); every instance reads the fleet topics whole. A part's
effect is its snapshot, which carries the offsets it stands at, so a restarted instance loads
the newest snapshot of each shard it is given and resumes right after it: nothing is folded
twice or skipped. Consumer-group offsets are committed after each snapshot, for lag monitoring.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from confluent_kafka import OFFSET_BEGINNING, Message, TopicPartition

from fleetline.config import KafkaSettings
from fleetline.observability import metrics
from fleetline.processors.view.fold import compose
from fleetline.processors.view.folder import PartFolder
from fleetline.processors.view.model import GPU_FIELDS, HealthPolicy, ResourceView
from fleetline.processors.view.read import ViewSource, latest_samples
from fleetline.processors.view.snapshots import ViewSnapshots
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.loop import Step, StepResult, StreamLoop, deliver
from fleetline.streams.records import Output, position
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics

log = logging.getLogger(__name__)

APPLICATION_ID = "resource-view"
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
    ) -> None:
        self.folder = PartFolder(topics, policy)
        self.snapshots = snapshots
        self.policy = policy
        self.snapshot_interval_s = snapshot_interval_s
        self.stats = stats
        self.parts: dict[str, ResourceView] = {}
        self.lock = threading.Lock()
        self._snapshotted: dict[str, int] = {}
        self._last_snapshot = time.monotonic()

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

    def __post_init__(self) -> None:
        self.step = ViewStep(
            self.topics, self.snapshots, self.policy, self.snapshot_interval_s, self.stats
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
        self.loop.run(stop)


def declare_clusters(
    kafka: KafkaSettings, topics: Topics, records: Sequence[Mapping[str, Any]]
) -> list[int]:
    """Append ClusterInfo records (what operators declare of their clusters) to the clusters
    topic, keyed by cluster, and wait until the broker has them; their offsets."""
    codec = default_codec()
    outputs = [
        Output(topics.clusters, r["cluster_id"].encode(), codec.encode("ClusterInfo", r))
        for r in records
    ]
    producer = kafka_clients.producer(kafka, {"linger.ms": 0})
    return deliver(producer, outputs, f"the clusters topic {topics.clusters}")


def dcgm_readings(source: ViewSource) -> Callable[[], Iterator[metrics.GpuReading]]:
    """The view's GPUs as DCGM exporter series: each GPU's latest sample, read at scrape time
    (references under the view's lock, the series built after it is let go)."""

    def readings() -> Iterator[metrics.GpuReading]:
        for node_id, cluster, region, sample in source.read(latest_samples):
            fields = dict(zip(GPU_FIELDS, sample, strict=True))
            yield metrics.gpu_reading(node_id, cluster, region, fields)

    return readings
