"""How a read to the end of a changelog gets through a stall (streams/kafka.py `_read_until`),
with a scripted reader standing for the consumer: no broker, so each case is exact."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
from confluent_kafka import OFFSET_BEGINNING, OFFSET_INVALID, KafkaError

from fleetline.errors import StreamError
from fleetline.streams.kafka import _read_until

TOPIC = "t.scheduler.state.changelog"


@dataclass
class Record:
    at: int
    code: int | None = None  # an error event instead of a record

    def topic(self) -> str:
        return TOPIC

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self.at

    def error(self) -> KafkaError | None:
        return None if self.code is None else KafkaError(self.code)


@dataclass
class ScriptedReader:
    """Partition 0 holds records at `offsets` below `log_end` (the gaps are transaction
    markers). A consumer `stuck` delivers nothing, as librdkafka's fetcher left on a lost
    leader; `renew` gives a consumer that works, from the next offset on."""

    offsets: list[int]
    log_end: int
    stuck: bool = False
    events: list[Record] = field(default_factory=list)  # handed over before any record
    topic: str = TOPIC
    next: dict[int, int] = field(default_factory=lambda: {0: OFFSET_BEGINNING})
    renewed: int = 0
    _position: int = OFFSET_INVALID

    def poll(self, timeout_s: float) -> Record | None:
        if self.events:
            return self.events.pop(0)
        if self.stuck:
            return None
        start = max(self.next[0], 0)
        ahead = [o for o in self.offsets if o >= start and o >= self._position]
        if not ahead:
            # Past the last record the fetcher's position goes over the markers to the end.
            self._position = self.log_end
            return None
        self._position = ahead[0] + 1
        return Record(ahead[0])

    def handed_over(self, partition: int, offset: int) -> None:
        self.next[partition] = offset + 1

    def positions(self, partitions: Iterable[int]) -> dict[int, int]:
        return dict.fromkeys(partitions, self._position)

    def renew(self) -> None:
        self.renewed += 1
        self.stuck = False
        self._position = OFFSET_INVALID


def read(reader: ScriptedReader, end: int, leader_ends: list[int], timeout_s: float = 5.0):
    """Read partition 0 to `end`; each stall check is answered with the next of `leader_ends`
    (its last one from then on)."""
    asked: list[int] = []

    def ends_now(partitions: Iterable[int]) -> dict[int, int]:
        asked.append(leader_ends[min(len(asked), len(leader_ends) - 1)])
        return dict.fromkeys(partitions, asked[-1])

    got = [m.offset() for m in _read_until(reader, {0: end}, {0}, timeout_s, ends_now, 0.05)]
    return got, asked


def test_a_read_ends_past_the_last_record_when_only_markers_follow_it() -> None:
    reader = ScriptedReader(offsets=[0, 1, 3, 4], log_end=6)  # 2 and 5: commit markers
    got, asked = read(reader, end=6, leader_ends=[6])
    assert got == [0, 1, 3, 4]
    assert asked == [] and reader.renewed == 0


def test_a_consumer_that_delivers_nothing_the_leader_has_is_replaced_and_the_read_goes_on() -> None:
    reader = ScriptedReader(offsets=[0, 1, 3, 4], log_end=6)
    first = []
    stream = _read_until(reader, {0: 6}, {0}, 5.0, lambda ps: dict.fromkeys(ps, 6), 0.05)
    first.append(next(stream).offset())
    first.append(next(stream).offset())
    reader.stuck = True  # its leader lost after two records
    rest = [m.offset() for m in stream]
    assert first + rest == [0, 1, 3, 4]  # nothing twice, nothing left out
    assert reader.renewed >= 1


def test_a_leader_behind_the_reads_end_is_waited_for_not_taken_for_the_end() -> None:
    # The new leader's high watermark waits for an in-sync replica: the consumer has nothing
    # past offset 1 to give until it catches up; then the read goes on to the old end.
    reader = ScriptedReader(offsets=[0, 1, 3, 4], log_end=6, stuck=True)
    got, asked = read(reader, end=6, leader_ends=[2, 2, 6])
    assert got == [0, 1, 3, 4]
    assert asked[:2] == [2, 2]
    assert reader.renewed == 1  # only once the leader had it


def test_a_read_that_never_gets_its_records_is_an_error_naming_where_it_stands() -> None:
    reader = ScriptedReader(offsets=[0, 1], log_end=3, stuck=True)
    with pytest.raises(StreamError, match=r"nothing arrived for 0s.*\[0\] next the first of end 3"):
        read(reader, end=3, leader_ends=[1], timeout_s=0.3)
    assert reader.renewed == 0  # the leader never had it: nothing to read afresh


def test_a_leader_moving_is_passed_over_and_a_fatal_error_stops_the_read() -> None:
    reader = ScriptedReader(
        offsets=[0, 1], log_end=2, events=[Record(-1, KafkaError.NOT_LEADER_FOR_PARTITION)]
    )
    assert read(reader, end=2, leader_ends=[2])[0] == [0, 1]
    broken = ScriptedReader(
        offsets=[0], log_end=1, events=[Record(-1, KafkaError.TOPIC_AUTHORIZATION_FAILED)]
    )
    with pytest.raises(StreamError, match=r"reading t\.scheduler\.state\.changelog"):
        read(broken, end=1, leader_ends=[1])


class ScriptedAdmin:
    """An admin client whose ListOffsets answers come from a script: (low, high) pairs, or a
    KafkaError code for both; its metadata gives each partition the leader `leaders` says
    next (broker 1 once the script ends), -1 while none is elected."""

    def __init__(
        self,
        answers: list[tuple[int, int] | int],
        leaders: Iterable[int] = (),
        denied: bool = False,
    ) -> None:
        self.answers = answers
        self.denied = denied
        self.asked = 0
        self.leaders = list(leaders)
        self.asked_metadata = 0
        self.asked_unled = 0  # ListOffsets asked while the last metadata had no leader

    def list_topics(self, topic, timeout):
        from types import SimpleNamespace

        leader = self.leaders.pop(0) if self.leaders else 1
        self.asked_metadata += 1
        self.led = leader >= 0
        partition = SimpleNamespace(leader=leader, error=None)
        error = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED) if self.denied else None
        listed = SimpleNamespace(error=error, partitions={0: partition})
        return SimpleNamespace(topics={topic: listed})

    def list_offsets(self, requests, isolation_level, request_timeout):
        from concurrent.futures import Future

        from confluent_kafka import KafkaException

        answer = self.answers[min(self.asked // 2, len(self.answers) - 1)]
        self.asked += 1
        self.asked_unled += not getattr(self, "led", True)
        side = (self.asked - 1) % 2  # earliest first, then latest

        def future() -> Future:
            done: Future = Future()
            if isinstance(answer, int):
                done.set_exception(KafkaException(KafkaError(answer)))
            else:
                done.set_result(type("Offset", (), {"offset": answer[side]})())
            return done

        return {tp: future() for tp in requests}


def test_bounds_ask_a_new_admin_client_when_one_keeps_a_fenced_epoch(monkeypatch) -> None:
    from fleetline.config import KafkaSettings
    from fleetline.streams import kafka

    # A leader being elected answers with no offsets and no error, then the client keeps a
    # leader epoch the broker has fenced; a new client gets the answer.
    stale = ScriptedAdmin([(-1, -1001), KafkaError.FENCED_LEADER_EPOCH])
    fresh = ScriptedAdmin([(3, 9)])
    monkeypatch.setattr(kafka, "ADMIN_RENEW_S", 0.3)
    monkeypatch.setattr(kafka, "admin_client", lambda settings: fresh)
    bounds = kafka.stable_bounds(KafkaSettings("127.0.0.1:1"), TOPIC, [0], 5.0, stale)
    assert bounds == {0: (3, 9)}
    assert stale.asked >= 4 and fresh.asked == 2
    # Never a negative offset taken for an end: past the limit it is an error naming it.
    never = ScriptedAdmin([(-1, -1001)])
    monkeypatch.setattr(kafka, "admin_client", lambda settings: never)
    with pytest.raises(StreamError, match=r"could not be established.*offsets -1 to -1001"):
        kafka.stable_bounds(KafkaSettings("127.0.0.1:1"), TOPIC, [0], 1.0, never)


def test_bounds_are_asked_only_of_a_client_that_knows_each_partition_s_leader() -> None:
    from fleetline.config import KafkaSettings
    from fleetline.streams import kafka

    # librdkafka's ListOffsets waits for a leader it does not know asynchronously, and a
    # metadata update racing that wait's setup crashed the process (`kafka._unled`): the
    # leaders are had first, and ListOffsets is asked only once each partition has one.
    electing = ScriptedAdmin([(3, 9)], leaders=[-1, -1, 2])
    bounds = kafka.stable_bounds(KafkaSettings("127.0.0.1:1"), TOPIC, [0], 5.0, electing)
    assert bounds == {0: (3, 9)}
    assert electing.asked_metadata == 3 and electing.asked == 2
    assert electing.asked_unled == 0
    never = ScriptedAdmin([(3, 9)], leaders=[-1] * 100)
    with pytest.raises(StreamError, match=r"no leader known for partition\(s\) \[0\]"):
        kafka.stable_bounds(KafkaSettings("127.0.0.1:1"), TOPIC, [0], 1.0, never)
    assert never.asked == 0
    # An answer asking again cannot mend ends the wait at once, in its words.
    denied = ScriptedAdmin([(3, 9)], denied=True)
    with pytest.raises(StreamError, match=r"the end of t\.scheduler.*[Aa]uthoriz"):
        kafka.stable_bounds(KafkaSettings("127.0.0.1:1"), TOPIC, [0], 30.0, denied)
    assert denied.asked_metadata == 1 and denied.asked == 0
