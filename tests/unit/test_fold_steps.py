"""A fold step's state and the input position it reflects, without a broker.

The store stages where each partition's state stands in its input beside the state it changed,
and makes both committed or neither. A fold step rebuilds its in-memory fold from the committed
store after a restore or an abort, and at no other time: a gap between two offsets is what
transaction markers leave in any log a transactional producer writes, not a lost state."""

from __future__ import annotations

from fleetline.processors.scheduling.capacity import observe
from fleetline.processors.scheduling.codec import canonical_json
from fleetline.processors.scheduling.runtime import Observations, SchedulerStep, state_store
from fleetline.processors.view.model import ResourceView
from fleetline.streams.serde import default_codec
from fleetline.streams.store import POSITION_KEY, json_store
from fleetline.streams.topics import Topics
from tests.scheduling_support import training
from tests.services import submits

codec = default_codec()
TOPICS = Topics("t-fold")


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


def request_messages(offsets: list[int]) -> list[Message]:
    documents = [training(f"j{i}", per_worker=2, tensor=2) for i in range(len(offsets))]
    return [
        Message(offset, codec.encode("SchedulerRequest", request))
        for offset, request in zip(offsets, submits(*documents), strict=True)
    ]


def scheduler_step() -> SchedulerStep:
    empty = observe(ResourceView())
    return SchedulerStep(TOPICS, state_store(TOPICS), lambda offsets: empty, Observations())


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
        Topics("unit"), state_store(Topics("unit")), observe_at_nothing, Observations()
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


def observe_at_nothing(offsets):
    return observe(ResourceView())
