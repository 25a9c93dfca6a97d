"""The transactional live-view processor against the real broker: fold, dead letters, restore."""

from __future__ import annotations

from fleetline.processors.view import summary as live_view
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import read_dead_letter
from fleetline.streams.processor import TransactionalProcessor
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics
from tests.support import (
    BASE_MS,
    Background,
    fresh_topics,
    make_publisher,
    read_all,
    small_fleet,
    wait_until,
)

codec = default_codec()


def make_processor(settings, topics: Topics, instance: str = "0"):
    store = live_view.node_store(topics.changelog(live_view.APPLICATION_ID, "nodes"))
    handler = live_view.LiveViewHandler(codec, store)
    processor = TransactionalProcessor(
        kafka=settings.kafka, application_id=f"{topics.prefix}.live-view",
        inputs=[topics.telemetry, topics.node_state], handler=handler,
        dead_letter_topic=topics.dead_letter, stores=[store], instance_id=instance,
    )
    return processor, handler


def setup_topics(settings) -> Topics:
    topics = fresh_topics()
    kafka_clients.ensure_topics(
        settings.kafka, [*topics.specs(), topics.changelog_spec(live_view.APPLICATION_ID, "nodes")])
    return topics


def reference_view(events) -> list[live_view.ClusterSummary]:
    nodes: dict[str, live_view.NodeSummary] = {}
    for name, record in events:
        decoded = codec.decode(codec.encode(name, record))
        nodes[record["node_id"]] = live_view.apply(nodes.get(record["node_id"]), decoded)
    return live_view.summarize(nodes.values())


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


def test_view_equals_the_pure_fold_of_the_same_events(settings) -> None:
    topics = setup_topics(settings)
    fleet = small_fleet(nodes=3)
    events = publish_run(settings, topics, fleet, ticks=4)
    down = fleet.take_down(fleet.nodes[1].node_id, BASE_MS + 9000, "psu")
    make_publisher(settings, topics).publish_states([down])
    events.append(("NodeState", down))

    processor, handler = make_processor(settings, topics)
    loop = Background(processor.run)
    wait_until(lambda: processor.stats.messages >= len(events), what="the processor")
    loop.stop()
    assert handler.view() == reference_view(events)
    c1 = next(c for c in handler.view() if c.cluster_id == "c1")
    assert (c1.nodes, c1.nodes_down, c1.gpus) == (3, 1, 24)
    assert processor.stats.dead_letters == 0


def test_bad_messages_go_to_the_dead_letter_topic_and_processing_goes_on(settings) -> None:
    topics = setup_topics(settings)
    fleet = small_fleet(nodes=1)
    producer = kafka_clients.producer(settings.kafka)
    invalid = fleet.telemetry(BASE_MS)[0]
    invalid["gpus"][0]["gpu_util_pct"] = 250.0
    mismatched = fleet.telemetry(BASE_MS + 1000)[1]
    producer.produce(topics.telemetry, key=b"n-garbage", value=b"\x01\x02 not avro")
    producer.produce(topics.telemetry, key=invalid["node_id"].encode(),
                     value=codec.encode("NodeTelemetry", invalid))
    producer.produce(topics.telemetry, key=b"someone-else",
                     value=codec.encode("NodeTelemetry", mismatched))
    producer.flush(30)
    good = publish_run(settings, topics, fleet, ticks=2, start_tick=5)

    processor, handler = make_processor(settings, topics)
    loop = Background(processor.run)
    wait_until(lambda: processor.stats.messages >= 3 + len(good), what="the processor")
    loop.stop()

    letters = [read_dead_letter(m) for m in read_all(settings, topics.dead_letter, 3)]
    assert len(letters) == 3
    reasons = {letter.key: letter.reason for letter in letters}
    assert "not Avro single-object encoded" in reasons[b"n-garbage"]
    assert "gpu_util_pct 250.0 is outside 0-100" in reasons[invalid["node_id"].encode()]
    assert "is not the node id" in reasons[b"someone-else"]
    assert {letter.topic for letter in letters} == {topics.telemetry}
    assert all(letter.application == f"{topics.prefix}.live-view" for letter in letters)
    garbage = next(letter for letter in letters if letter.key == b"n-garbage")
    assert garbage.value == b"\x01\x02 not avro"  # kept whole
    # The good messages after the bad ones were folded.
    assert sum(c.gpus for c in handler.view()) == 16
    assert handler.view() == reference_view(good)


def test_a_restarted_processor_restores_its_store_and_resumes(settings) -> None:
    topics = setup_topics(settings)
    fleet = small_fleet(nodes=2)
    first = publish_run(settings, topics, fleet, ticks=3)
    processor, _ = make_processor(settings, topics)
    loop = Background(processor.run)
    wait_until(lambda: processor.stats.messages >= len(first), what="the first processor")
    loop.stop()

    second = publish_run(settings, topics, fleet, ticks=2, start_tick=4)
    restarted, handler = make_processor(settings, topics, instance="0")
    loop = Background(restarted.run)
    wait_until(lambda: restarted.stats.messages >= len(second), what="the restarted processor")
    loop.stop()
    # Only the new messages were consumed; the earlier state came back from the changelog.
    assert restarted.stats.messages == len(second)
    assert restarted.stats.restored == 4
    assert handler.view() == reference_view(first + second)


def test_an_aborted_batch_leaves_no_trace_and_is_processed_again(settings) -> None:
    """Exactly once across an abort: outputs of the aborted attempt are invisible to
    read_committed readers, the store drops its pending writes, the batch is redone."""
    from fleetline.streams.processor import Output
    from fleetline.streams.topics import TopicSpec

    topics = setup_topics(settings)
    out_topic = f"{topics.prefix}.out"
    kafka_clients.ensure_topics(settings.kafka, [TopicSpec(out_topic, 1)])
    fleet = small_fleet(nodes=1)
    events = publish_run(settings, topics, fleet, ticks=3)

    processor, handler = make_processor(settings, topics)
    poisoned = {"left": 1}

    def flaky(msg):
        handler(msg)
        outputs = [Output(out_topic, msg.key(), msg.value())]
        if poisoned["left"]:
            poisoned["left"] -= 1
            # Partition 7 of a one-partition topic: the producer refuses it, the batch aborts.
            outputs.append(Output(out_topic, msg.key(), msg.value(), partition=7))
        return outputs

    processor.handler = flaky
    loop = Background(processor.run)
    wait_until(lambda: processor.stats.messages >= len(events), what="the processor")
    loop.stop()
    assert processor.stats.aborts == 1
    assert handler.view() == reference_view(events)  # nothing folded twice
    committed = read_all(settings, out_topic, len(events))
    assert len(committed) == len(events)  # each input's output once
