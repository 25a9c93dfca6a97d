"""The shell around the health fold: the cluster signal log in, the emergency topic out, exactly
once; and the control plane's clock, which appends a TICK to the signal log every interval so
that a silent cluster's silence is seen (and seen again the same way by a replay).

The fold's state is one record in a store backed by a compacted changelog, written in the same
transaction as the emergency records and the consumed offset, like the scheduler's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Message

from fleetline.config import KafkaSettings
from fleetline.identity.writers import EstablishesWriters
from fleetline.processors.health.fold import ClusterHealthPolicy, HealthFold
from fleetline.schemas.records import ClusterSignal, ClusterSignalKind, PeerReach, WorkloadStatus
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import CLUSTER_HEALTH, CLUSTER_SIGNAL
from fleetline.streams.loop import FoldService, FoldStep, StepResult, fold_loop, produce
from fleetline.streams.records import Output, appended_ms, where
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.store import FOLD_STORE, ChangelogStore, fold_changelog, fold_store
from fleetline.streams.topics import Topics, TopicSpec
from fleetline.streams.writers import WriterGate

log = logging.getLogger(__name__)

APPLICATION_ID = "cluster-health"
STORE = FOLD_STORE
_KEY = b"fold"


def health_store(topics: Topics) -> ChangelogStore[Any]:
    return fold_store(topics, APPLICATION_ID)


def changelog(topics: Topics) -> TopicSpec:
    """The health fold's state changelog, as the composition root creates it."""
    return fold_changelog(topics, APPLICATION_ID)


def health_topics(topics: Topics) -> list[TopicSpec]:
    return [*topics.specs(), changelog(topics)]


def signal(
    kind: ClusterSignalKind,
    cluster_id: str,
    ts: int,
    *,
    seq: int = 0,
    incarnation: str = "",
    actor: str = "",
    reason: str | None = None,
    probe_address: str | None = None,
    gpus_reserved: int = 0,
    workloads: Sequence[WorkloadStatus] = (),
    peers: Sequence[PeerReach] = (),
) -> ClusterSignal:
    """A ClusterSignal record."""
    return {
        "kind": kind,
        "cluster_id": cluster_id,
        "ts": ts,
        "seq": seq,
        "incarnation": incarnation,
        "actor": actor,
        "reason": reason,
        "probe_address": probe_address,
        "gpus_reserved": gpus_reserved,
        "workloads": list(workloads),
        "peers": list(peers),
    }


def signal_output(topics: Topics, record: Mapping[str, Any], codec: AvroCodec) -> Output:
    return Output(
        topics.cluster_signals,
        (record["cluster_id"] or "-").encode(),
        codec.encode(topics.record_of(topics.cluster_signals), record),
    )


class HealthStep(FoldStep[HealthFold]):
    """Folds one signal; its health records and the fold's new state go out in one
    transaction."""

    def __init__(
        self,
        topics: Topics,
        store: ChangelogStore[Any],
        policy: ClusterHealthPolicy,
        gate: EstablishesWriters,
        codec: AvroCodec | None = None,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.topics = topics
        self.state = store
        self.stores = [store]
        self.policy = policy
        self.codec = codec or default_codec()

    def restore_fold(self) -> HealthFold:
        data = self.state.get(0, _KEY)
        # The configured policy wins over the stored one: thresholds are operator settings.
        fold = HealthFold.from_data(data) if data else HealthFold()
        fold.policy = self.policy
        return fold

    def process(self, messages: list[Message]) -> StepResult[None]:
        self.gate.new_batch(messages)
        return super().process(messages)

    def handle(self, message: Message) -> Sequence[Output]:
        _, _, offset = where(message)
        writer = self.gate.writer_of(message)
        with self.lock:
            fold = self.fold()
            record = self.codec.decode(message.value(), expect=CLUSTER_SIGNAL).record
            events = fold.step(record, offset, writer, appended_ms(message))
            self.state.put(0, _KEY, fold.as_data())
        return [
            Output(
                self.topics.emergency,
                e["cluster_id"].encode(),
                self.codec.encode(CLUSTER_HEALTH, e),
            )
            for e in events
        ]


@dataclass
class ClusterHealthService(FoldService):
    """The health fold's loop plus the control plane's clock, run together."""

    side_name = "cluster-clock"

    kafka: KafkaSettings
    topics: Topics
    policy: ClusterHealthPolicy = field(default_factory=ClusterHealthPolicy)
    tick_interval_s: float = 0.5
    instance_id: str = "0"
    clock: Callable[[], int] = field(default=lambda: int(time.time() * 1000))

    def __post_init__(self) -> None:
        self.store = health_store(self.topics)
        self.step = HealthStep(
            self.topics, self.store, self.policy, WriterGate(self.kafka, self.topics)
        )
        self.loop = fold_loop(
            self.kafka,
            self.topics,
            APPLICATION_ID,
            self.topics.cluster_signals,
            self.step,
            self.instance_id,
            max_messages=500,
        )
        self.name = self.loop.name
        self.ready = self.loop.ready
        self.ticks = 0

    def side(self, stop: threading.Event) -> None:
        producer = kafka_clients.producer(self.kafka, {"linger.ms": 0})
        codec = default_codec()
        try:
            while not stop.is_set():
                produce(
                    producer,
                    signal_output(
                        self.topics, signal("TICK", "", self.clock(), actor="clock"), codec
                    ),
                )
                producer.poll(0)
                self.ticks += 1
                stop.wait(self.tick_interval_s)
        finally:
            producer.flush(10)
