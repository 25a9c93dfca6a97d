"""Replay and time travel: the view as it stood at a past moment or offset, what changed, and
every scheduling decision made again from the request log.

A moment is a log position: in every partition, the messages the broker had appended by then
(the view topics use LogAppendTime, so a message's timestamp is when the system saw it). The view
at a position is the newest snapshot at or before it plus the tail of the log after the snapshot,
folded by the same code as the live processor, so it equals what the live view was there.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from fleetline.config import KafkaSettings
from fleetline.errors import StreamError
from fleetline.processors.scheduling.capacity import FleetFacts, observe, observe_summaries
from fleetline.processors.view import codec as view_codec
from fleetline.processors.view.fold import compose, node_status
from fleetline.processors.view.folder import FLEET_PART, PartFolder
from fleetline.processors.view.model import Change, HealthPolicy, ResourceView
from fleetline.processors.view.read import StaticView
from fleetline.processors.view.runtime import SummaryFollower, tune_gc_for_large_state
from fleetline.processors.view.snapshots import ViewSnapshots
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.records import Offsets
from fleetline.streams.topics import Topics
from fleetline.streams.writers import replay_gate

log = logging.getLogger(__name__)
# Messages a view follower holds per partition past the position it was asked for before it
# pauses that partition's fetching (it resumes once half of them are folded).
AHEAD_LIMIT = 10_000
# Messages a rebuild folds at once: a node's records appear several times in a partition's
# run, so the fold takes most of them as repeats of the one before (fold.fold_repeat).
REBUILD_BATCH = 100_000
# Below this many messages to fold a rebuild stays in one process (another costs ~1 s to start).
PARALLEL_FROM = 200_000


def observe_at(
    kafka: KafkaSettings,
    topics: Topics,
    target: Offsets,
    snapshots: ViewSnapshots | None = None,
) -> FleetFacts:
    """What a scheduler observed at a TICK's offsets, read once (a scheduler restoring its
    state); `ViewFollower.facts` does the same for a replay's many ticks."""
    summaries = target.get(topics.summaries)
    if summaries is None:
        return observe(rebuild(kafka, topics, target, snapshots).view)
    follower = SummaryFollower(kafka, topics)
    try:
        return observe_summaries(follower.at(summaries.get(0, 0)), target)
    finally:
        follower.close()


def view_partitions(kafka: KafkaSettings, topics: Topics) -> list[TopicPartition]:
    admin = kafka_clients.admin_client(kafka)
    metadata = admin.list_topics(timeout=30)
    out: list[TopicPartition] = []
    for topic in (*topics.node_topics, *topics.fleet_topics):
        meta = metadata.topics.get(topic)
        if meta is None or meta.error is not None:
            raise StreamError(f"topic {topic} does not exist (is the prefix right?)")
        out.extend(TopicPartition(topic, p) for p in sorted(meta.partitions))
    return out


# A replay reads the log from the start as fast as it can: fetches of 16 MiB a partition (not
# librdkafka's 1 MiB) took 500,000 telemetry records in 2.7 s instead of 4.1 s on a local broker.
REPLAY_FETCH = {
    "max.partition.fetch.bytes": 16 * 2**20,
    "fetch.max.bytes": 64 * 2**20,
    "queued.max.messages.kbytes": 128 * 2**10,
}


def _consumer(kafka: KafkaSettings) -> Consumer:
    return kafka_clients.consumer(kafka, f"fleetline-replay-{uuid.uuid4().hex[:12]}", REPLAY_FETCH)


def log_bounds(kafka: KafkaSettings, topics: Topics) -> tuple[Offsets, Offsets]:
    """The first and the next offset of every view partition."""
    consumer = _consumer(kafka)
    try:
        low: Offsets = {}
        high: Offsets = {}
        for tp in view_partitions(kafka, topics):
            lo, hi = consumer.get_watermark_offsets(tp, timeout=30, cached=False)
            low.setdefault(tp.topic, {})[tp.partition] = lo
            high.setdefault(tp.topic, {})[tp.partition] = hi
        return low, high
    finally:
        consumer.close()


def offsets_at(kafka: KafkaSettings, topics: Topics, at_ms: int) -> Offsets:
    """The log position at `at_ms`: per partition, one past the last message appended at or
    before it."""
    _, high = log_bounds(kafka, topics)
    consumer = _consumer(kafka)
    try:
        query = [TopicPartition(t, p, at_ms + 1) for t, ps in high.items() for p in ps]
        found = consumer.offsets_for_times(query, timeout=30)
    finally:
        consumer.close()
    out: Offsets = {}
    for tp in found:
        offset = tp.offset if tp.offset >= 0 else high[tp.topic][tp.partition]
        out.setdefault(tp.topic, {})[tp.partition] = offset
    return out


@dataclass
class Replay:
    """The result of a rebuild: the global view and how it was reached."""

    view: ResourceView
    parts: dict[str, ResourceView]
    snapshot_positions: dict[str, int] = field(default_factory=dict)
    folded: int = 0
    dead_letters: int = 0
    seconds: float = 0.0
    gaps: list[str] = field(default_factory=list)
    # Snapshots the live process pruned between listing and reading, and what was used instead.
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class AsOf:
    """A view served as it stood at a past moment, and how it was reached."""

    at_ms: int
    offsets: Offsets
    from_snapshots: dict[str, int]
    folded: int
    notes: tuple[str, ...]

    def as_data(self) -> dict[str, Any]:
        return {
            "at_ms": self.at_ms,
            "offsets": {t: {str(p): o for p, o in ps.items()} for t, ps in self.offsets.items()},
            "from_snapshots": self.from_snapshots,
            "folded": self.folded,
            "notes": list(self.notes),
        }


class ViewHistory:
    """The view as it stood at a moment, for readers that ask by time (the API's `?at=`):
    rebuilt from the newest snapshots at or before that position plus the log. The view at a
    log position never changes, so the last one rebuilt is kept for the next request at the
    same position (one only: an 80,000-GPU view holds ~400 MB); rebuilds take turns."""

    def __init__(
        self, kafka: KafkaSettings, topics: Topics, snapshots: ViewSnapshots | None
    ) -> None:
        self.kafka = kafka
        self.topics = topics
        self.snapshots = snapshots
        self._lock = threading.Lock()
        self._last: tuple[Offsets, Replay] | None = None

    def at(self, at_ms: int) -> tuple[StaticView, AsOf]:
        target = offsets_at(self.kafka, self.topics, at_ms)
        with self._lock:
            if self._last is None or self._last[0] != target:
                self._last = (target, rebuild(self.kafka, self.topics, target, self.snapshots))
            _, replay = self._last
        as_of = AsOf(
            at_ms,
            target,
            dict(replay.snapshot_positions),
            replay.folded,
            (*replay.notes, *replay.gaps),
        )
        return StaticView(replay.view), as_of


def _part_partitions(folder: PartFolder, target: Offsets) -> dict[str, Offsets]:
    out: dict[str, Offsets] = {}
    for topic, parts in target.items():
        for partition, offset in parts.items():
            part = folder.part_of(topic, partition)
            out.setdefault(part, {}).setdefault(topic, {})[partition] = offset
    return out


def _fold_ranges(
    kafka: KafkaSettings,
    folder: PartFolder,
    parts: dict[str, ResourceView],
    ranges: list[tuple[str, int, int, int]],
    result: Replay,
    on_batch: Callable[[dict[str, ResourceView]], None] | None,
) -> None:
    """Fold each (topic, partition, begin, end) range of the log into its part."""
    remaining = {(topic, partition): end for topic, partition, _, end in ranges}
    if not remaining:
        return
    consumer = _consumer(kafka)
    try:
        consumer.assign([TopicPartition(t, p, begin) for t, p, begin, _ in ranges])
        idle_since = time.monotonic()
        while remaining:
            keep = _below_targets(
                consumer, consumer.consume(REBUILD_BATCH, 0.5), remaining, pause=True
            )
            if keep:
                idle_since = time.monotonic()
                failed = folder.fold(parts, keep)
                result.folded += len(keep)
                result.dead_letters += len(failed)
                if on_batch is not None:
                    on_batch(parts)
                continue
            # Transaction markers and compacted-away records leave offsets that hold no
            # message: a partition whose position reached the target is complete.
            _drop_reached(consumer, remaining)
            if remaining and time.monotonic() - idle_since > 60:
                raise StreamError(f"replay stalled short of the target in {sorted(remaining)}")
    finally:
        consumer.close()


def _shares(
    folder: PartFolder, ranges: list[tuple[str, int, int, int]], workers: int
) -> list[list[tuple[str, int, int, int]]]:
    """The ranges split by part over at most `workers` processes, the largest parts first to
    the least loaded; the first share (this process's) holds the fleet part, whose tables are
    small."""
    by_part: dict[str, list[tuple[str, int, int, int]]] = {}
    for r in ranges:
        by_part.setdefault(folder.part_of(r[0], r[1]), []).append(r)
    shares: list[list[tuple[str, int, int, int]]] = [[] for _ in range(max(1, workers))]
    load = [0] * len(shares)
    for part in sorted(by_part, key=lambda p: (p != FLEET_PART, -_size(by_part[p]), p)):
        at = 0 if part == FLEET_PART else load.index(min(load))
        shares[at] += by_part[part]
        load[at] += _size(by_part[part])
    return [share for share in shares if share]


def _size(ranges: list[tuple[str, int, int, int]]) -> int:
    return sum(end - begin for *_, begin, end in ranges)


def _fold_in_worker(
    kafka: KafkaSettings,
    topics: Topics,
    policy: HealthPolicy,
    ranges: list[tuple[str, int, int, int]],
    starts: dict[str, tuple[bytes, str]],
) -> tuple[dict[str, tuple[bytes, str]], int, int]:
    """In another process: fold the ranges into their parts, each from its start (encoded as
    a snapshot is; a part without one from the start of the log), and return the parts encoded
    the same way, with the messages folded and dead-lettered."""
    tune_gc_for_large_state()
    folder = PartFolder(topics, policy, gate=replay_gate(kafka, topics))
    parts = {
        part: view_codec.decode(*starts[part]) if part in starts else folder.new_part()
        for part in (folder.part_of(t, p) for t, p, _, _ in ranges)
    }
    result = Replay(view=ResourceView(), parts=parts)
    _fold_ranges(kafka, folder, parts, ranges, result, None)
    return {n: view_codec.encode(v) for n, v in parts.items()}, result.folded, result.dead_letters


def rebuild(
    kafka: KafkaSettings,
    topics: Topics,
    target: Offsets,
    snapshots: ViewSnapshots | None = None,
    policy: HealthPolicy | None = None,
    on_batch: Callable[[dict[str, ResourceView]], None] | None = None,
    start: dict[str, ResourceView] | None = None,
    workers: int = 1,
) -> Replay:
    """Fold the log up to `target` (exclusive offsets): from `start` parts if given, else from
    each part's newest snapshot within the target (when `snapshots` is given), else from the
    beginning of the log. With `workers` > 1 and at least `PARALLEL_FROM` messages to fold
    (and no `on_batch`), the parts are folded in up to that many processes at once, each its
    own parts (a part is one partition's stream, or the fleet topics): the same parts as one
    process folds."""
    began = time.perf_counter()
    folder = PartFolder(topics, policy or HealthPolicy(), gate=replay_gate(kafka, topics))
    low, _ = log_bounds(kafka, topics)
    parts: dict[str, ResourceView] = dict(start or {})
    result = Replay(view=ResourceView(), parts=parts)
    for part, limit in _part_partitions(folder, target).items():
        if part in parts:
            continue
        info, view = None, None
        if snapshots is not None:
            info, view, notes = snapshots.load_newest(part, within=limit)
            result.notes += notes
        if info is not None and view is not None and view.policy == folder.policy:
            parts[part] = view
            result.snapshot_positions[part] = info.position
            continue
        parts[part] = folder.new_part()

    ranges: list[tuple[str, int, int, int]] = []  # (topic, partition, begin, end)
    for topic, ps in target.items():
        for partition, end in ps.items():
            folded = parts[folder.part_of(topic, partition)]
            begin = folded.offsets.get(topic, {}).get(partition)
            first = low.get(topic, {}).get(partition, 0)
            if begin is None:
                begin = first
                if first > 0:
                    result.gaps.append(
                        f"{topic}[{partition}] starts at offset {first}: earlier "
                        "events were removed by retention or compaction"
                    )
            if begin < end:
                ranges.append((topic, partition, begin, end))
    shares = (
        _shares(folder, ranges, workers)
        if on_batch is None and sum(e - b for *_, b, e in ranges) >= PARALLEL_FROM
        else [ranges]
    )
    if len(shares) > 1:
        spawn = multiprocessing.get_context("spawn")  # no Kafka client state crosses a fork
        with ProcessPoolExecutor(len(shares) - 1, mp_context=spawn) as pool:
            elsewhere = []
            for share in shares[1:]:
                names = {folder.part_of(t, p) for t, p, _, _ in share}
                # Parts that start from a snapshot (or were given) travel with their share.
                starts = {n: view_codec.encode(parts[n]) for n in names if parts[n].offsets}
                elsewhere.append(
                    pool.submit(_fold_in_worker, kafka, topics, folder.policy, share, starts)
                )
            _fold_ranges(kafka, folder, parts, shares[0], result, None)
            for future in elsewhere:
                encoded, messages, dead_letters = future.result()
                for part, (blob, sha) in encoded.items():
                    parts[part] = view_codec.decode(blob, sha)
                result.folded += messages
                result.dead_letters += dead_letters
    else:
        _fold_ranges(kafka, folder, parts, ranges, result, on_batch)
    for topic, ps in target.items():
        for partition, end in ps.items():
            # The part stands at the target even where the last offsets held no record.
            offsets = parts[folder.part_of(topic, partition)].offsets
            if end > offsets.get(topic, {}).get(partition, 0):
                offsets.setdefault(topic, {})[partition] = end
    result.view = compose(parts.values())
    result.seconds = time.perf_counter() - began
    return result


def walk(
    kafka: KafkaSettings,
    topics: Topics,
    begin: Offsets,
    end: Offsets,
    snapshots: ViewSnapshots | None = None,
    policy: HealthPolicy | None = None,
) -> tuple[Replay, list[Change]]:
    """The view at `begin`, then every change between `begin` and `end`: GPU health and node
    state transitions from the fold, and nodes becoming unreachable (or reachable again) as
    event time moves on."""
    first = rebuild(kafka, topics, begin, snapshots, policy)
    for part in first.parts.values():
        part.drain_changes()
    changes: list[Change] = []
    statuses = _statuses(first.view)

    def on_batch(parts: dict[str, ResourceView]) -> None:
        nonlocal statuses
        for part in parts.values():
            changes.extend(part.drain_changes())
        view = compose(parts.values())
        now = _statuses(view)
        for node_id, status in now.items():
            before = statuses.get(node_id)
            if before is not None and before != status and "UNREACHABLE" in (before, status):
                changes.append(
                    Change(
                        view.watermark_ms,
                        "node",
                        node_id,
                        before,
                        status,
                        "heartbeats stopped" if status == "UNREACHABLE" else "heard from again",
                    )
                )
        statuses = now

    second = rebuild(kafka, topics, end, None, policy, on_batch=on_batch, start=first.parts)
    second.snapshot_positions = first.snapshot_positions
    changes.sort(key=lambda c: (c.ts, c.entity, c.entity_id))
    return second, changes


def _statuses(view: ResourceView) -> dict[str, str]:
    return {node_id: node_status(view, node) for node_id, node in view.nodes.items()}


def _below_targets(
    consumer: Any,
    messages: list[Any],
    remaining: dict[tuple[str, int], int],
    pause: bool,
    past: Callable[[tuple[str, int], Any], None] | None = None,
) -> list[Any]:
    """The messages before their partition's target; a partition whose target is reached
    leaves `remaining` (and is paused, if asked). A message at or past its partition's target
    (or of a partition without one) goes to `past`, or is dropped."""
    keep = []
    for msg in messages:
        error = msg.error()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                continue
            raise StreamError(f"replaying {msg.topic()}: {error.str()}")
        key = (msg.topic(), msg.partition())
        end = remaining.get(key)
        if end is None or msg.offset() >= end:
            if past is not None:
                past(key, msg)
            continue
        keep.append(msg)
        if msg.offset() + 1 >= end:
            del remaining[key]
            if pause:
                consumer.pause([TopicPartition(*key)])
    return keep


def _drop_reached(consumer: Any, remaining: dict[tuple[str, int], int]) -> None:
    """Forget the partitions whose consumer position has reached their target offset."""
    if remaining:
        for tp in consumer.position([TopicPartition(*k) for k in remaining]):
            if tp.offset >= remaining[(tp.topic, tp.partition)]:
                del remaining[(tp.topic, tp.partition)]


def behind(target: Offsets, position: Offsets) -> bool:
    """Whether `target` lies before `position` in any partition. A partition the target does
    not name stands at 0 there: a scheduler whose view had not read it yet (restarted, its
    view still restoring) observed nothing of it, not everything."""
    return any(
        offset > target.get(topic, {}).get(partition, 0)
        for topic, parts in position.items()
        for partition, offset in parts.items()
    )


class ViewFollower:
    """The view folded forward to one log position after another, with one consumer: a replay
    of the scheduler asks for the view at every TICK's offsets, in log order.

    A position behind the one already reached (the live view restarted from an older snapshot
    before that tick) is rebuilt from the snapshots and the log; otherwise only the messages
    between the two positions are folded.
    """

    def __init__(
        self,
        kafka: KafkaSettings,
        topics: Topics,
        snapshots: ViewSnapshots | None = None,
        policy: HealthPolicy | None = None,
    ) -> None:
        self.kafka = kafka
        self.topics = topics
        self.snapshots = snapshots
        self.folder = PartFolder(topics, policy or HealthPolicy(), gate=replay_gate(kafka, topics))
        self.parts: dict[str, ResourceView] | None = None
        self.position: Offsets = {}
        self.rebuilds = 0
        self.folded = 0
        self._consumer = _consumer(kafka)
        # One assignment for the whole replay (assigning again per position restarts every
        # fetch): what is fetched past a position waits here, its partition paused, until a
        # later position takes it.
        self._assigned: set[tuple[str, int]] = set()
        self._paused: set[tuple[str, int]] = set()
        self._ahead: dict[tuple[str, int], deque[Any]] = {}
        self._summaries: SummaryFollower | None = None

    def close(self) -> None:
        self._consumer.close()
        if self._summaries is not None:
            self._summaries.close()

    def facts(self, target: Offsets, last: FleetFacts | None = None) -> FleetFacts:
        """What a scheduler observed at a TICK's offsets: the view shards' summaries when the
        TICK names the summaries topic (a sharded deployment), else the view folded there."""
        summaries = target.get(self.topics.summaries)
        if summaries is None:
            return observe(self.at(target), last)
        if self._summaries is None:
            self._summaries = SummaryFollower(self.kafka, self.topics)
        return observe_summaries(self._summaries.at(summaries.get(0, 0)), target, last)

    def _reset(self) -> None:
        """Forget the assignment and what was fetched ahead (after a rebuild from snapshots)."""
        if self._assigned:
            self._consumer.unassign()
        self._assigned.clear()
        self._paused.clear()
        self._ahead.clear()

    def _fold_to(self, remaining: dict[tuple[str, int], int]) -> None:
        """Fold each partition's messages up to its target offset (exclusive)."""
        assert self.parts is not None
        keep: list[Any] = []
        for key, end in list(remaining.items()):
            ahead = self._ahead.get(key)
            while ahead and ahead[0].offset() < end:
                keep.append(ahead.popleft())
            if ahead:  # fetched past the target already: reached
                del remaining[key]
        new = [key for key in remaining if key not in self._assigned]
        if new:
            self._consumer.incremental_assign(
                [TopicPartition(t, p, self.position.get(t, {}).get(p, 0)) for t, p in new]
            )
            self._assigned.update(new)
        wanted = [k for k in self._paused if len(self._ahead.get(k) or ()) < AHEAD_LIMIT // 2]
        if wanted:
            self._consumer.resume([TopicPartition(*k) for k in wanted])
            self._paused.difference_update(wanted)
        if keep:
            self.folder.fold(self.parts, keep)
            self.folded += len(keep)
        idle_since = time.monotonic()
        while remaining:
            # What is fetched already, else a wait for the next message (not for a full batch:
            # consume() waits its whole timeout unless the batch fills).
            fetched = self._consumer.consume(5000, 0) or self._consumer.consume(1, 0.05)
            keep = _below_targets(
                self._consumer, fetched, remaining, pause=False, past=self._hold_for_later
            )
            if keep:
                idle_since = time.monotonic()
                self.folder.fold(self.parts, keep)
                self.folded += len(keep)
            # A target just past a transaction marker holds no message to stop on, and one a
            # message past it was fetched for is reached too: the consumer's position (a local
            # call) says when.
            _drop_reached(self._consumer, remaining)
            if remaining and time.monotonic() - idle_since > 60:
                raise StreamError(f"view follower stalled short of {sorted(remaining)}")

    def _hold_for_later(self, key: tuple[str, int], msg: Any) -> None:
        """Keep a message a later position will fold (a long way ahead: fetching pauses)."""
        ahead = self._ahead.setdefault(key, deque())
        ahead.append(msg)
        if len(ahead) >= AHEAD_LIMIT and key not in self._paused:
            self._consumer.pause([TopicPartition(*key)])
            self._paused.add(key)

    def at(self, target: Offsets) -> ResourceView:
        if self.parts is None or behind(target, self.position):
            self._reset()
            result = rebuild(self.kafka, self.topics, target, self.snapshots, self.folder.policy)
            self.parts = result.parts
            self.rebuilds += 1
            self.folded += result.folded
            self.position = {t: dict(ps) for t, ps in target.items()}
            return result.view
        remaining = {
            (t, p): end
            for t, ps in target.items()
            for p, end in ps.items()
            if end > self.position.get(t, {}).get(p, 0)
        }
        if remaining:
            self._fold_to(remaining)
        for topic, ps in target.items():
            for partition, end in ps.items():
                name = self.folder.part_of(topic, partition)
                part = self.parts.get(name)
                if part is None:
                    part = self.parts[name] = self.folder.new_part()
                if end > part.offsets.get(topic, {}).get(partition, 0):
                    part.offsets.setdefault(topic, {})[partition] = end
                self.position.setdefault(topic, {})[partition] = end
        return compose(self.parts.values())
