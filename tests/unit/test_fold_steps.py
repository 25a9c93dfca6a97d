"""A fold step's state and the input position it reflects, without a broker.

The store stages where each partition's state stands in its input beside the state it changed,
and makes both committed or neither. A fold step rebuilds its in-memory fold from the committed
store after a restore or an abort, and at no other time: a gap between two offsets is what
transaction markers leave in any log a transactional producer writes, not a lost state."""

from __future__ import annotations

from fleetline.identity.writers import CONTROL_PLANE_WRITER, Gate
from fleetline.processors.scheduling.capacity import observe
from fleetline.processors.scheduling.client import state_store
from fleetline.processors.scheduling.codec import canonical_json
from fleetline.processors.scheduling.runtime import Observations, SchedulerStep
from fleetline.processors.view.model import ResourceView
from fleetline.streams.serde import default_codec
from fleetline.streams.store import POSITION_KEY, json_store
from fleetline.streams.topics import Topics
from tests.scheduling_support import training
from tests.services import submits
from tests.support import TEST_ROOT

codec = default_codec()
TOPICS = Topics("t-fold")
CONTROL_PLANE = Gate(TEST_ROOT).credential(CONTROL_PLANE_WRITER)


class Message:
    """The accessors of `confluent_kafka.Message` a step reads."""

    def __init__(self, offset: int, value: bytes, topic: str = TOPICS.scheduler_requests):
        self._offset, self._value, self._topic = offset, value, topic

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes:
        return b"k"

    def value(self) -> bytes:
        return self._value

    def timestamp(self) -> tuple[int, int]:
        return (0, 0)

    def headers(self) -> list[tuple[str, bytes]]:
        nonce = self._offset.to_bytes(12, "big")  # never twice: one offset, one record
        return CONTROL_PLANE.headers(self._topic, self.key(), self._value, nonce)


def request_messages(offsets: list[int]) -> list[Message]:
    documents = [training(f"j{i}", per_worker=2, tensor=2) for i in range(len(offsets))]
    return [
        Message(offset, codec.encode("SchedulerRequest", request))
        for offset, request in zip(offsets, submits(*documents), strict=True)
    ]


def scheduler_step() -> SchedulerStep:
    empty = observe(ResourceView())
    return SchedulerStep(
        TOPICS, state_store(TOPICS), lambda offsets: empty, Observations(), Gate(TEST_ROOT)
    )


def run(step: SchedulerStep, messages: list[Message]) -> None:
    """What the loop does with a batch that commits."""
    result = step.process(messages)  # type: ignore[arg-type]
    assert not result.dead_letters, result.dead_letters
    step.state.commit()


def test_a_gap_in_the_offsets_is_not_a_restore() -> None:
    step = scheduler_step()
    messages = request_messages([0, 1, 4, 9, 12])  # 2-3, 5-8, 10-11: transaction markers
    run(step, messages[:2])
    live = step.scheduler
    assert live is not None and live.position == 1
    run(step, messages[2:])
    assert step.scheduler is live, "the fold was rebuilt at a gap"
    assert live.position == 12
    assert len(live.jobs) == 5


def test_after_an_abort_the_fold_is_rebuilt_from_the_committed_store() -> None:
    messages = request_messages([0, 1, 2, 3])
    uninterrupted = scheduler_step()
    run(uninterrupted, messages)

    step = scheduler_step()
    run(step, messages[:2])
    # What the loop does when the third message's transaction aborts: drop the store's pending
    # writes, tell the step, hand the message over again.
    step.process(messages[2:3])  # type: ignore[arg-type]
    step.state.abort()
    step.aborted()
    assert step.scheduler is None
    run(step, messages[2:])
    assert dict(step.state.items()) == dict(uninterrupted.state.items())
    assert step.scheduler is not None and uninterrupted.scheduler is not None
    assert canonical_json(dict(step.scheduler.records())) == canonical_json(
        dict(uninterrupted.scheduler.records())
    )
    # A (re)assignment restores the store: the fold is read from it again.
    step.assigned([])
    assert step.scheduler is None


def test_positions_are_staged_with_the_state_and_committed_or_dropped_with_it() -> None:
    store = json_store("state", "t.changelog")
    store.put(0, b"a", {"n": 1})
    store.advance(0, "t.in", 5)
    store.advance(1, "t.in", 3)
    staged = sorted(store.pending_changelog())
    assert (0, POSITION_KEY + b"t.in", b"5") in staged
    assert (1, POSITION_KEY + b"t.in", b"3") in staged
    assert store.positions(0) == {}  # not before the transaction commits
    store.abort()
    assert store.positions(0) == {} and list(store.pending_changelog()) == []

    store.put(0, b"a", {"n": 1})
    store.advance(0, "t.in", 5)
    store.commit()
    assert store.positions(0) == {"t.in": 5}
    assert dict(store.items()) == {b"a": {"n": 1}}  # the position is not state
    store.advance(0, "t.in", 9)
    store.advance(0, "t.other", 2)
    store.commit()
    assert store.positions(0) == {"t.in": 9, "t.other": 2}
    store.drop([0])
    assert store.positions(0) == {} and dict(store.items()) == {}


class _Scripted:
    """A consumer whose `consume` returns one scripted batch, then nothing."""

    def __init__(self, batch: list) -> None:
        self.batch = batch

    def consume(self, count: int, timeout: float) -> list:
        batch, self.batch = self.batch, []
        return batch


def test_a_coordinator_moving_is_logged_and_the_loop_goes_on_a_fatal_error_stops_it() -> None:
    """After a broker is killed librdkafka reports errors it is already retrying (a group's
    coordinator moved while its committed offsets were fetched): the loop goes on. It stopped,
    and `serve`'s cluster health with it, in a `make chaos` run."""
    import threading

    import pytest
    from confluent_kafka import KafkaError, Message

    from fleetline.config import KafkaSettings
    from fleetline.errors import StreamError
    from fleetline.streams.loop import StreamLoop

    step = SchedulerStep(
        Topics("unit"),
        state_store(Topics("unit")),
        observe_at_nothing,
        Observations(),
        Gate(TEST_ROOT),
    )
    loop = StreamLoop(KafkaSettings(), "unit.loop", ["unit.in"], step, "unit.dlq", metrics=False)
    loop._expected[("unit.in", 0)] = 0
    moved = Message(
        error=KafkaError(KafkaError.NOT_COORDINATOR, "Failed to fetch committed offsets")
    )
    record = Message(topic="unit.in", partition=0, offset=0, value=b"x")
    handed = loop._receive(_Scripted([moved, record]), None, threading.Event())
    assert [m.offset() for m in handed] == [0]
    fatal = Message(error=KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "not allowed"))
    with pytest.raises(StreamError, match="not allowed"):
        loop._receive(_Scripted([fatal]), None, threading.Event())


class _Positions:
    """A consumer whose positions are given."""

    def __init__(self, positions: dict) -> None:
        self.positions = positions

    def position(self, partitions: list) -> list:
        from confluent_kafka import TopicPartition

        return [
            TopicPartition(
                tp.topic, tp.partition, self.positions.get((tp.topic, tp.partition), -1001)
            )
            for tp in partitions
        ]


def test_caught_up_means_every_partition_reached_its_end_not_an_empty_receive() -> None:
    """A receive that brings nothing while a partition's broker is down is not the end of the
    log: in a `make chaos` run the scheduler ticked after two brokers were lost, its view
    holding no node yet, and queued a job as if its clusters were empty."""
    from confluent_kafka import Message

    from fleetline.config import KafkaSettings
    from fleetline.streams.loop import StreamLoop

    step = SchedulerStep(
        Topics("unit"),
        state_store(Topics("unit")),
        observe_at_nothing,
        Observations(),
        Gate(TEST_ROOT),
    )
    loop = StreamLoop(KafkaSettings(), "unit.loop", ["unit.in"], step, "unit.dlq", metrics=False)
    loop._catch_up_to = {("unit.in", 0): 40, ("unit.in", 1): 7, ("unit.in", 2): 0}
    record = Message(topic="unit.in", partition=0, offset=38, value=b"x")
    behind = _Positions({("unit.in", 0): 12, ("unit.in", 1): 7})
    assert not loop._reached(behind, [])
    assert not loop._reached(behind, [record])
    # Past the last record and the transaction marker after it; an empty partition counts as
    # reached however far its position is.
    there = _Positions({("unit.in", 0): 40, ("unit.in", 1): 7})
    assert loop._reached(there, [record]) and loop._reached(there, [])
    # Assigned at its end (a restore at the committed offsets), nothing to fetch: the
    # consumer has no position yet, the offset the loop hands next says it.
    loop._expected = {("unit.in", 0): 40}
    assert loop._reached(_Positions({("unit.in", 1): 7}), [])
    # Where the ends could not be read, the first empty receive, as before.
    loop._catch_up_to = {}
    assert not loop._reached(behind, [record]) and loop._reached(behind, [])


def test_a_view_position_that_names_no_partition_stands_before_one_that_read_it() -> None:
    """A replayed TICK whose scheduler had read nothing of a partition yet (its view still
    restoring after a restart) is behind a follower that folded that partition already: the
    view is rebuilt, not reused with what the scheduler never saw."""
    from fleetline.processors.replay import behind

    position = {"node": {0: 18, 2: 4}, "cluster": {0: 2}}
    assert behind({"cluster": {0: 2}}, position)
    assert behind({"node": {0: 18, 2: 3}, "cluster": {0: 2}}, position)
    assert not behind({"node": {0: 18, 2: 4}, "cluster": {0: 2}}, position)
    assert not behind({"node": {0: 20, 1: 5, 2: 4}, "cluster": {0: 3}}, position)
    assert not behind({"node": {0: 1}}, {})


def observe_at_nothing(offsets):
    return observe(ResourceView())
