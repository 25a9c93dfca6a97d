"""What other processes need of the scheduler, without running it: append requests to its log,
read its decisions and its committed state, load a policy file. The agents, the CLI, the API,
the demo and the tests reach the scheduler through these."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaError, Message, TopicPartition

from fleetline.config import KafkaSettings, mapping_file
from fleetline.errors import StreamError
from fleetline.observability import tracing
from fleetline.processors.scheduling.codec import spec_requests
from fleetline.processors.scheduling.policy import SchedulingPolicy
from fleetline.processors.scheduling.specs import parse_spec
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import SCHEDULING_DECISION
from fleetline.streams.loop import deliver, produce
from fleetline.streams.records import Output
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.store import FOLD_STORE, ChangelogStore, fold_changelog, fold_store
from fleetline.streams.topics import CLUSTER_AGENT, Topics, TopicSpec

APPLICATION_ID = "scheduler"
STORE = FOLD_STORE


def changelog(topics: Topics) -> TopicSpec:
    """The scheduler's state changelog, as the composition root creates it (cluster agents read
    their tenants' terms from it)."""
    return fold_changelog(topics, APPLICATION_ID, readers=(CLUSTER_AGENT,))


def state_store(topics: Topics) -> ChangelogStore[Any]:
    return fold_store(topics, APPLICATION_ID)


def request_output(
    topics: Topics, request: Mapping[str, Any], codec: AvroCodec | None = None
) -> Output:
    """One request as a message of the scheduler's log (keyed by its key, one partition)."""
    codec = codec or default_codec()
    return Output(
        topics.scheduler_requests,
        request["key"].encode() or b"-",
        codec.encode(topics.record_of(topics.scheduler_requests), request),
        headers=tracing.header(tracing.parse(request.get("traceparent"))) or None,
    )


def send(
    producer: Any,
    topics: Topics,
    request: Mapping[str, Any],
    codec: AvroCodec | None = None,
    on_delivery: Callable[[Any, Any], None] | None = None,
) -> None:
    """Append one request to the scheduler's log."""
    produce(producer, request_output(topics, request, codec), on_delivery)


def submit(
    kafka: KafkaSettings,
    topics: Topics,
    requests: Sequence[Mapping[str, Any]],
    timeout_s: float = 30.0,
    producer: Any = None,
) -> list[int]:
    """Append requests and wait until the broker has them; their log offsets, in order."""
    producer = producer or kafka_clients.producer(kafka, {"linger.ms": 0})
    codec = default_codec()
    outputs = [request_output(topics, r, codec) for r in requests]
    return deliver(producer, outputs, "the scheduler's request log", timeout_s)


def job_records(store: ChangelogStore[Any], tenant: str | None = None) -> list[dict[str, Any]]:
    out = []
    for key, value in store.items([0]):
        name = key.decode()
        if (
            name.startswith("job:")
            and value is not None
            and (tenant is None or value["tenant"] == tenant)
        ):
            out.append(value)
    out.sort(key=lambda j: j["key"])
    return out


def read_state(kafka: KafkaSettings, topics: Topics) -> ChangelogStore[Any]:
    """The scheduler's committed state, restored from its changelog (for the CLI). A prefix no
    scheduler has run under is said at once ("does not exist"), not after a minute's wait for
    the changelog's end."""
    store = state_store(topics)
    kafka_clients.partitions_of(kafka, store.changelog_topic, timeout_s=10)
    store.restore(kafka, [0])
    return store


def read_topic(kafka: KafkaSettings, topic: str, timeout_s: float = 30.0) -> Iterator[Message]:
    """Every committed message of a single-partition topic, from the start to its end now."""
    return kafka_clients.read_to_end(
        kafka, topic, [0], f"fleetline-read-{uuid.uuid4().hex[:12]}", timeout_s
    )


def decisions_of(
    kafka: KafkaSettings, topics: Topics, job: str | None = None, codec: AvroCodec | None = None
) -> list[dict[str, Any]]:
    codec = codec or default_codec()
    out = []
    for msg in read_topic(kafka, topics.decisions):
        if job is not None and msg.key() != job.encode():
            continue
        out.append(codec.decode(msg.value(), expect=SCHEDULING_DECISION).record)
    return out


class DecisionFollower:
    """The decision log read from its start and then as it grows, with one consumer (callers
    that wait for decisions poll this instead of reading the log again each time)."""

    def __init__(
        self, kafka: KafkaSettings, topics: Topics, codec: AvroCodec | None = None
    ) -> None:
        self.codec = codec or default_codec()
        self._consumer = kafka_clients.consumer(kafka, f"fleetline-follow-{uuid.uuid4().hex}")
        self._consumer.assign([TopicPartition(topics.decisions, 0, OFFSET_BEGINNING)])

    def poll(self, timeout_s: float = 0.3) -> list[dict[str, Any]]:
        """The decisions appended (and committed) since the last poll."""
        out = []
        for msg in self._consumer.consume(1000, timeout_s):
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    continue
                raise StreamError(f"reading the decision log: {error.str()}")
            out.append(self.codec.decode(msg.value(), expect=SCHEDULING_DECISION).record)
        return out

    def close(self) -> None:
        self._consumer.close()


def wait_for_decisions(
    kafka: KafkaSettings,
    topics: Topics,
    keys: Sequence[str],
    offsets: Sequence[int],
    timeout_s: float,
) -> dict[str, dict[str, Any]]:
    """The latest decision about each key made at or after its request's log offset, once each
    is settled (placed, accepted, rejected, or waiting for its data to be copied: the copy
    may take hours) or the time is up (then it may be QUEUED)."""
    wanted = dict(zip(keys, offsets, strict=True))
    latest: dict[str, dict[str, Any]] = {}
    follower = DecisionFollower(kafka, topics)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            for decision in follower.poll():
                key = decision["job"]
                if key in wanted and decision["input_offset"] >= wanted[key]:
                    latest[key] = decision
            settled = [
                k for k, d in latest.items() if d["outcome"] != "QUEUED" or d.get("prewarms")
            ]
            if len(settled) == len(wanted) or time.monotonic() > deadline:
                return latest
    finally:
        follower.close()


def load_policy(path: str | None) -> SchedulingPolicy | None:
    """A scheduling policy from a YAML or JSON file (None: keep the scheduler's own)."""
    if path is None:
        return None
    return SchedulingPolicy.from_data(mapping_file(path, "scheduling policy"))


def submit_specs(
    kafka: KafkaSettings,
    topics: Topics,
    documents: Sequence[Mapping[str, Any]],
    actor: str,
    now_ms: int,
) -> list[int]:
    """Parse spec documents and append their SUBMIT requests (datasets first), each entering a
    trace of its own as through `apply` (a derived trace id would be the same in every run
    sharing a ClickHouse store); their log offsets."""
    specs = [parse_spec(d) for d in documents]
    ordered = spec_requests(
        specs,
        documents,
        now_ms,
        actor,
        lambda: uuid.uuid4().hex,
        lambda: tracing.start().traceparent,
    )
    return submit(kafka, topics, [r for _, r in ordered])
