"""The stream loop against the real broker, exactly once: a stateful step folds, dead-letters
bad input, restores its store after a restart, leaves no trace of an aborted batch, and never
processes from a restored state that does not stand where the group committed."""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import pytest
from confluent_kafka import KafkaError, KafkaException, Message

from fleetline.errors import InvalidEventError, StreamError
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import read_dead_letter
from fleetline.streams.events import NODE_STATE, NODE_TELEMETRY, check_telemetry
from fleetline.streams.loop import MessageStep, StreamLoop
from fleetline.streams.records import Output
from fleetline.streams.serde import Decoded, default_codec
from fleetline.streams.store import ChangelogStore
from fleetline.streams.topics import Topics, TopicSpec
from tests.support import (
    BASE_MS,
    Background,
    fresh_topics,
    make_publisher,
    read_all,
    small_fleet,
    wait_until,
)

pytestmark = pytest.mark.services
codec = default_codec()
APP = "node-summary"


@dataclass(frozen=True)
class NodeSummary:
    node_id: str
    state: str
    gpus: int
    last_seq: int


def apply(node: NodeSummary | None, event: Decoded) -> NodeSummary:
    """A per-node fold with a seq guard: an event already seen changes nothing."""
    record = event.record
    if node is not None and record["seq"] <= node.last_seq:
        return node
    base = node or NodeSummary(record["node_id"], "UP", 0, 0)
    if event.schema.full_name == NODE_TELEMETRY:
        check_telemetry(record)
        return replace(base, gpus=len(record["gpus"]), last_seq=record["seq"])
    if event.schema.full_name == NODE_STATE:
        return replace(base, state=record["state"], last_seq=record["seq"])
    raise InvalidEventError(f"not folded: {event.schema.full_name}")


class SummaryStep(MessageStep):
    def __init__(self, nodes: ChangelogStore[NodeSummary]) -> None:
        self.nodes = nodes
        self.stores = [nodes]

    def handle(self, message: Message) -> Sequence[Output]:
        event = codec.decode(message.value())
        key = message.key()
        if key is None or key.decode() != event.record["node_id"]:
            raise InvalidEventError(
                f"message key {key!r} is not the node id {event.record['node_id']!r}"
            )
        before = self.nodes.get(message.partition() or 0, key)
        after = apply(before, event)
        if after != before:
            self.nodes.put(message.partition() or 0, key, after)
        return ()

    def summaries(self) -> dict[str, NodeSummary]:
        return {key.decode(): value for key, value in self.nodes.items()}


def make_loop(settings, topics: Topics, restore_timeout_s: float = 60.0) -> StreamLoop:
    store = ChangelogStore(
        APP,
        topics.changelog(APP, "nodes"),
        lambda node: json.dumps(asdict(node)).encode(),
        lambda data: NodeSummary(**json.loads(data)),
    )
    return StreamLoop(
        settings.kafka,
        f"{topics.prefix}.{APP}",
        [topics.telemetry, topics.node_state],
        SummaryStep(store),
        topics.dead_letter,
        exactly_once=True,
        restore_timeout_s=restore_timeout_s,
    )


def setup_topics(settings) -> Topics:
    topics = fresh_topics()
    kafka_clients.ensure_topics(
        settings.kafka, [*topics.specs(), topics.changelog_spec(APP, "nodes")]
    )
    return topics


def reference(events) -> dict[str, NodeSummary]:
    nodes: dict[str, NodeSummary] = {}
    for name, record in events:
        nodes[record["node_id"]] = apply(
            nodes.get(record["node_id"]), codec.decode(codec.encode(name, record))
        )
    return nodes


def publish_run(settings, topics, fleet, ticks, start_tick=1):
    publisher = make_publisher(settings, topics)
    events = []
    if start_tick == 1:
        states = fleet.initial_states(BASE_MS)
        publisher.publish_states(states)
        events += [("NodeState", r) for r in states]
    for tick in range(start_tick, start_tick + ticks):
        records = fleet.telemetry(BASE_MS + tick * 1000)
        publisher.publish_telemetry(records)
        events += [("NodeTelemetry", r) for r in records]
    publisher.flush()
    return events


def run_until(loop: StreamLoop, messages: int, what: str) -> None:
    background = Background(loop.run)
    wait_until(lambda: loop.stats.messages >= messages, what=what)
    background.stop()


def test_the_step_folds_what_the_pure_fold_folds(settings) -> None:
    topics = setup_topics(settings)
    fleet = small_fleet(nodes=3)
    events = publish_run(settings, topics, fleet, ticks=4)
    down = fleet.take_down(fleet.nodes[1].node_id, BASE_MS + 9000, "psu")
    make_publisher(settings, topics).publish_states([down])
    events.append(("NodeState", down))

    loop = make_loop(settings, topics)
    run_until(loop, len(events), "the loop")
    step = loop.step
    assert isinstance(step, SummaryStep)
    assert step.summaries() == reference(events)
    assert len(step.summaries()) == 6
    assert step.summaries()[fleet.nodes[1].node_id].state == "DOWN"
    assert loop.stats.dead_letters == 0


def test_bad_messages_go_to_the_dead_letter_topic_and_processing_goes_on(settings) -> None:
    topics = setup_topics(settings)
    fleet = small_fleet(nodes=1)
    producer = kafka_clients.producer(settings.kafka)
    invalid = fleet.telemetry(BASE_MS)[0]
    invalid["gpus"][0]["gpu_util_pct"] = 250.0
    mismatched = fleet.telemetry(BASE_MS + 1000)[1]
    producer.produce(topics.telemetry, key=b"n-garbage", value=b"\x01\x02 not avro")
    producer.produce(
        topics.telemetry,
        key=invalid["node_id"].encode(),
        value=codec.encode("NodeTelemetry", invalid),
    )
    producer.produce(
        topics.telemetry, key=b"someone-else", value=codec.encode("NodeTelemetry", mismatched)
    )
    producer.flush(30)
    good = publish_run(settings, topics, fleet, ticks=2, start_tick=5)

    loop = make_loop(settings, topics)
    run_until(loop, 3 + len(good), "the loop")

    letters = [read_dead_letter(m) for m in read_all(settings, topics.dead_letter, 3)]
    assert len(letters) == 3
    reasons = {letter.key: letter.reason for letter in letters}
    assert "not Avro single-object encoded" in reasons[b"n-garbage"]
    assert "gpu_util_pct 250.0 is outside 0-100" in reasons[invalid["node_id"].encode()]
    assert "is not the node id" in reasons[b"someone-else"]
    assert {letter.topic for letter in letters} == {topics.telemetry}
    assert all(letter.application == f"{topics.prefix}.{APP}" for letter in letters)
    garbage = next(letter for letter in letters if letter.key == b"n-garbage")
    assert garbage.value == b"\x01\x02 not avro"  # kept whole
    # The good messages after the bad ones were folded.
    step = loop.step
    assert isinstance(step, SummaryStep)
    assert step.summaries() == reference(good)


def test_a_restarted_loop_restores_its_store_and_resumes(settings) -> None:
    topics = setup_topics(settings)
    fleet = small_fleet(nodes=2)
    first = publish_run(settings, topics, fleet, ticks=3)
    run_until(make_loop(settings, topics), len(first), "the first loop")

    second = publish_run(settings, topics, fleet, ticks=2, start_tick=4)
    restarted = make_loop(settings, topics)
    run_until(restarted, len(second), "the restarted loop")
    # Only the new messages were consumed; the earlier state came back from the changelog.
    assert restarted.stats.messages == len(second)
    assert restarted.stats.restored == 4
    step = restarted.step
    assert isinstance(step, SummaryStep)
    assert step.summaries() == reference(first + second)


def test_an_aborted_batch_leaves_no_trace_and_is_processed_again(settings) -> None:
    """Exactly once across an abort: outputs of the aborted attempt are invisible to
    read_committed readers, the store drops its pending writes, the batch is redone."""
    topics = setup_topics(settings)
    out_topic = f"{topics.prefix}.out"
    kafka_clients.ensure_topics(settings.kafka, [TopicSpec(out_topic, 1)])
    fleet = small_fleet(nodes=1)
    events = publish_run(settings, topics, fleet, ticks=3)

    loop = make_loop(settings, topics)
    step = loop.step
    assert isinstance(step, SummaryStep)
    fold = step.handle
    poisoned = {"left": 1}

    def flaky(message: Message) -> list[Output]:
        fold(message)
        outputs = [Output(out_topic, message.key(), message.value())]
        if poisoned["left"]:
            poisoned["left"] -= 1
            # Partition 7 of a one-partition topic: the producer refuses it, the batch aborts.
            outputs.append(Output(out_topic, message.key(), message.value(), partition=7))
        return outputs

    step.handle = flaky  # type: ignore[method-assign]
    run_until(loop, len(events), "the loop")
    assert loop.stats.aborts == 1
    assert step.summaries() == reference(events)  # nothing folded twice
    committed = read_all(settings, out_topic, len(events))
    assert len(committed) == len(events)  # each input's output once


def hold_changelog_open(settings, topics: Topics):
    """A transaction left open on every partition of the store's changelog: a read_committed
    reader stops before it, as it does before a committed transaction whose markers have not
    reached a new leader yet. The producer aborts it when asked."""
    changelog = topics.changelog(APP, "nodes")
    held = kafka_clients.producer(settings.kafka, transactional_id=f"held-{uuid.uuid4().hex[:8]}")
    held.init_transactions(30)
    held.begin_transaction()
    for partition in kafka_clients.partitions_of(settings.kafka, changelog):
        held.produce(changelog, key=b"held", value=b"{}", partition=partition)
    held.flush(30)
    return held


def stale_changelog(settings):
    """Two runs of the loop, the second committing behind an open transaction: the group's
    offsets stand past everything, the changelog's last stable offsets at the first run."""
    topics = setup_topics(settings)
    fleet = small_fleet(nodes=2)
    first = publish_run(settings, topics, fleet, ticks=2)
    run_until(make_loop(settings, topics), len(first), "the first loop")
    held = hold_changelog_open(settings, topics)
    second = publish_run(settings, topics, fleet, ticks=2, start_tick=3)
    run_until(make_loop(settings, topics), len(second), "the second loop")
    return topics, held, first + second


def test_a_restore_that_stops_short_is_restored_again_until_it_stands_at_the_commit(
    settings, caplog
) -> None:
    topics, held, events = stale_changelog(settings)
    loop = make_loop(settings, topics, restore_timeout_s=60)

    def restored_again() -> bool:
        return any("restoring again" in r.getMessage() for r in caplog.records)

    def release_once_refused() -> None:
        # The transaction ends (as a late marker lands) only after the loop refused the
        # state it first restored.
        wait_until(restored_again, 60, "the loop to refuse its first restore")
        held.abort_transaction(30)

    with caplog.at_level(logging.WARNING, logger="fleetline.streams.loop"):
        release = threading.Thread(target=release_once_refused, daemon=True)
        release.start()
        background = Background(loop.run)
        try:
            wait_until(loop.ready.is_set, 60, "the loop to restore and be assigned")
            wait_until(loop.caught_up.is_set, 30, "the loop to catch up")
        finally:
            background.stop()
            release.join(60)
    assert restored_again()
    assert loop.stats.messages == 0  # nothing was folded again
    step = loop.step
    assert isinstance(step, SummaryStep)
    assert step.summaries() == reference(events)


def test_a_restored_state_that_never_reaches_the_commit_stops_the_loop(settings) -> None:
    topics, held, _ = stale_changelog(settings)
    loop = make_loop(settings, topics, restore_timeout_s=4)
    background = Background(loop.run)
    try:
        wait_until(lambda: not background.thread.is_alive(), 60, "the loop to stop")
    finally:
        held.abort_transaction(30)
    with pytest.raises(StreamError) as stopped:
        background.stop()
    message = str(stopped.value)
    assert "does not stand where the group committed" in message
    assert f"reflects {topics.telemetry}[" in message and "the group committed offset" in message
    assert loop.stats.messages == 0  # nothing processed from the stale state


class FailingProducer:
    """A transactional producer whose first send_offsets_to_transaction fails as told: it
    stalls until released (as librdkafka's may once the group coordinator's broker died), or
    raises the given error."""

    def __init__(self, real, release: threading.Event, error: KafkaError | None) -> None:
        self.real = real
        self.release = release
        self.error = error
        self.failed = False

    def send_offsets_to_transaction(self, *args):
        if not self.failed:
            self.failed = True
            if self.error is not None:
                raise KafkaException(self.error)
            self.release.wait(120)
        return self.real.send_offsets_to_transaction(*args)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


def failing_first_producer(
    loop: StreamLoop, error: KafkaError | None
) -> tuple[list, threading.Event]:
    """Make the loop's first producer fail once as `FailingProducer` says; the producers the
    loop made, and the event that releases a stalled call."""
    new_producer = loop._producer
    made: list = []
    release = threading.Event()

    def producer():
        made.append(new_producer())
        return FailingProducer(made[-1], release, error) if len(made) == 1 else made[-1]

    loop._producer = producer  # type: ignore[method-assign]
    return made, release


@pytest.mark.parametrize(
    "failure",
    [
        None,
        KafkaError(KafkaError.INVALID_TXN_STATE, "failed for good", fatal=True),
    ],
    ids=["stalled", "fatal"],
)
def test_a_producer_that_cannot_abort_is_fenced_and_its_batch_processed_again(
    settings, failure
) -> None:
    topics = setup_topics(settings)
    out_topic = f"{topics.prefix}.out"
    kafka_clients.ensure_topics(settings.kafka, [TopicSpec(out_topic, 1)])
    events = publish_run(settings, topics, small_fleet(nodes=1), ticks=3)
    loop = make_loop(settings, topics)
    loop.transaction_call_timeout_s = 3
    step = loop.step
    assert isinstance(step, SummaryStep)
    fold = step.handle

    def echoed(message: Message) -> list[Output]:
        fold(message)
        return [Output(out_topic, message.key(), message.value())]

    step.handle = echoed  # type: ignore[method-assign]
    made, release = failing_first_producer(loop, failure)
    try:
        run_until(loop, len(events), "the loop")
    finally:
        release.set()
    assert loop.stats.aborts == 1 and len(made) == 2
    assert step.summaries() == reference(events)  # nothing folded twice, nothing lost
    # The failed transaction was aborted by the fence: each input's output once.
    assert len(read_all(settings, out_topic, len(events))) == len(events)


def test_a_producer_fenced_by_another_stops_the_loop(settings) -> None:
    topics = setup_topics(settings)
    publish_run(settings, topics, small_fleet(nodes=1), ticks=1)
    loop = make_loop(settings, topics)
    failing_first_producer(loop, KafkaError(KafkaError.PRODUCER_FENCED, "fenced", fatal=True))
    background = Background(loop.run)
    wait_until(lambda: not background.thread.is_alive(), 60, "the loop to stop")
    with pytest.raises(StreamError, match="is a second instance running with --instance-id 0"):
        background.stop()
    assert loop.stats.messages == 0
