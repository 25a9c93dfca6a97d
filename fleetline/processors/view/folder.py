"""Batches of records folded into view parts: the same code live, in replay and in benchmarks.

The view is split into parts: `shard-<p>` folds partition p of the node topics (telemetry and
node state are co-partitioned by node id), `fleet` folds the small fleet topics whole. A run of
telemetry records from one partition goes through the columnar decoder; anything it will not
vouch for, and every other record, is decoded and folded one by one; a record that repeats
its node's previous one in the run folds as `fold.fold_repeat` when that one settled the node
(docs/resource-view.md, "Repeats"). A record that cannot be
folded is returned with its error (to be dead-lettered) and still counts as consumed, so a bad
message never stops the fold and is never silently lost.

A node event's time is its agent's clock, but never more than `MAX_AHEAD_MS` past the moment
the broker appended it (the node topics stamp LogAppendTime, so this is in the log and a replay
folds the same). Without that bound one agent whose clock runs ahead would carry the view's
event time with it, and every other node would look unheard-of and unreachable.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

import numpy as np
import pyarrow.compute as pc

from fleetline.errors import FleetlineError, InvalidEventError
from fleetline.identity.authority import node_refusal
from fleetline.identity.writers import EstablishesWriters, Headed, WriterRefused
from fleetline.processors.view.fold import (
    REPEAT_FIELDS,
    apply,
    fold_repeat,
    fold_telemetry,
    forget,
    repeats_fold,
    settled,
)
from fleetline.processors.view.model import (
    GPU_FIELDS,
    HealthPolicy,
    ResourceView,
    Sample,
    sample_of_row,
)
from fleetline.streams.columnar import Deferred, Repeats, TelemetryBatchDecoder
from fleetline.streams.events import (
    ALLOCATION,
    CLUSTER_HEALTH,
    CLUSTER_INFO,
    DATASET_STATE,
    NODE_STATE,
    NODE_TELEMETRY,
)
from fleetline.streams.records import Record, appended_ms, where
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.topics import Topics

FLEET_PART = "fleet"
# How far an agent's clock may run ahead of the broker's before its events' times are held back.
MAX_AHEAD_MS = 5_000
R = TypeVar("R", bound=Record)


def _latest_ts(record: Record) -> int | None:
    """The latest event time a node record may carry: its append time plus `MAX_AHEAD_MS`."""
    appended = appended_ms(record)
    return None if appended is None else appended + MAX_AHEAD_MS


def repeats_of(policy: HealthPolicy) -> Repeats | None:
    """What makes a telemetry record a repeat the fold may take as `fold_repeat` (fold.py's
    `REPEAT_FIELDS` equal, `quiet` over the batch's columns); None when the policy rules
    repeats out."""
    if not repeats_fold(policy):
        return None
    limit = policy.rdma_loss_ratio

    def quiet_rows(columns: Mapping[str, Any]) -> np.ndarray:
        no_events = pc.equal(pc.list_value_length(columns["xid_codes"]), 0)
        loss = columns["rdma_packet_loss_ratio"]
        low = pc.or_kleene(pc.is_null(loss), pc.less(loss, limit))
        calm = pc.fill_null(pc.and_kleene(no_events, low), False)
        return np.asarray(calm.to_numpy(zero_copy_only=False), dtype=bool)

    return Repeats(REPEAT_FIELDS, quiet_rows)


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
        topics.emergency: TopicRole(CLUSTER_HEALTH, "cluster_id", None),
    }


@dataclass
class PartFolder:
    """Folds batches of records into view parts (see the module's docstring)."""

    topics: Topics
    policy: HealthPolicy = field(default_factory=HealthPolicy)
    codec: AvroCodec = field(default_factory=default_codec)
    # Who wrote each record (identity/writers.py): the live view and every replay pass the
    # deployment's gate, and a node record its writer may not publish is refused; None folds
    # records as they come (pure tests and benchmarks of records made in memory).
    gate: EstablishesWriters | None = None

    def __post_init__(self) -> None:
        self.roles = topic_roles(self.topics)
        self.decoder = TelemetryBatchDecoder(self.codec, GPU_FIELDS, sample_of_row)
        self.repeats = repeats_of(self.policy)
        self.node_topics = set(self.topics.node_topics)

    def part_of(self, topic: str, partition: int) -> str:
        return shard_part(partition) if topic in self.node_topics else FLEET_PART

    def new_part(self) -> ResourceView:
        return ResourceView(policy=self.policy)

    def fold(
        self, parts: dict[str, ResourceView], records: Iterable[R]
    ) -> list[tuple[R, FleetlineError]]:
        """Fold the records into their parts (made as needed); the ones that could not be
        folded, with why."""
        runs: dict[tuple[str, int], list[R]] = {}
        for record in records:
            topic, partition, _ = where(record)
            runs.setdefault((topic, partition), []).append(record)
        failed: list[tuple[R, FleetlineError]] = []
        if self.gate is not None:
            self.gate.new_batch(cast(Headed, r) for run in runs.values() for r in run)
        for (topic, partition), run in runs.items():
            name = self.part_of(topic, partition)
            view = parts.get(name)
            if view is None:
                view = parts[name] = self.new_part()
            if topic == self.topics.telemetry:
                self._fold_telemetry_run(view, topic, partition, run, failed)
            else:
                for record in run:
                    self.fold_one(view, record, failed)
        return failed

    def _fold_telemetry_run(
        self,
        view: ResourceView,
        topic: str,
        partition: int,
        run: Sequence[R],
        failed: list[tuple[R, FleetlineError]],
    ) -> None:
        keys, values = [m.key() for m in run], [m.value() for m in run]
        rows = (
            self.decoder.decode_repeats(keys, values, self.repeats)
            if self.repeats is not None
            else self.decoder.decode(keys, values)
        )
        # Per node, the GPU readings of its last record folded here whole, or True once that
        # record is known to have `settled` (its repeats then fold without their readings).
        last: dict[str, Sequence[Sample] | bool] = {}
        for record, row in zip(run, rows, strict=True):
            if row is None:  # the batch path could not read it: record by record, in order
                last.clear()  # that path may have folded any node
                self.fold_one(view, record, failed)
                continue
            cluster_id, region, node_id, seq, ts, gpus = row
            if self.gate is not None:
                try:
                    self._check_node(record, "telemetry", cluster_id, node_id)
                except FleetlineError as exc:
                    # The next record of this node may be decoded as a repeat of this one.
                    last.pop(node_id, None)
                    failed.append((record, exc))
                    continue
            latest = _latest_ts(record)
            if latest is not None and ts > latest:
                ts = latest
            if isinstance(gpus, Deferred):
                head = last.get(node_id)
                if head is True or (head and settled(view, node_id, head)):
                    last[node_id] = True
                    fold_repeat(view, node_id, seq, ts)
                    continue
                gpus = gpus.rows()
            try:
                if fold_telemetry(view, cluster_id, region, node_id, seq, ts, gpus, vouched=True):
                    last[node_id] = gpus
                else:
                    last.pop(node_id, None)
            except FleetlineError as exc:
                last.pop(node_id, None)
                failed.append((record, exc))
        if run:  # a run's offsets only grow: the last one folded stands for all
            view.advance(topic, partition, where(run[-1])[2])

    def fold_one(
        self, view: ResourceView, record: R, failed: list[tuple[R, FleetlineError]]
    ) -> None:
        """Fold one record by the per-record path (decode, check the key, apply)."""
        topic, partition, offset = where(record)
        role = self.roles.get(topic)
        try:
            if role is None:
                raise InvalidEventError(f"the resource view does not read {topic}")
            key = record.key()
            value = record.value()
            node_topic = topic in self.node_topics
            if value is None and role.tombstone is not None and key is not None:
                if self.gate is not None:
                    self._check_control_plane(record, f"forget a {role.tombstone}")
                forget(view, role.tombstone, key.decode(errors="replace"))
            else:
                event = self.codec.decode(value, expect=role.record)
                entity = event.record[role.key_field]
                if key is None or key.decode(errors="replace") != entity:
                    raise InvalidEventError(
                        f"message key {key!r} is not the record's {role.key_field} {entity!r}"
                    )
                if self.gate is not None:
                    if node_topic:
                        what = "telemetry" if topic == self.topics.telemetry else "NodeState"
                        self._check_node(record, what, event.record["cluster_id"], entity)
                    else:
                        self._check_control_plane(record, f"publish {role.record}")
                latest = _latest_ts(record) if node_topic else None
                if latest is not None and event.record["ts"] > latest:
                    event = replace(event, record={**event.record, "ts": latest})
                apply(view, event)
        except FleetlineError as exc:
            failed.append((record, exc))
        view.advance(topic, partition, offset)

    def _check_node(self, record: Any, what: str, cluster_id: str, node_id: str) -> None:
        assert self.gate is not None
        writer = self.gate.writer_of(record)
        refusal = node_refusal(writer, what, cluster_id, node_id)
        if refusal is not None:
            raise WriterRefused(writer.header, refusal)

    def _check_control_plane(self, record: Any, what: str) -> None:
        assert self.gate is not None
        writer = self.gate.writer_of(record)
        if not writer.is_control_plane:
            raise WriterRefused(writer.header, f"may not {what}")
