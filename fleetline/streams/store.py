"""Local key-value state backed by a compacted changelog topic (the Kafka Streams vocabulary).

The store is partitioned like the processor's input. Writes made while a batch is processed are
pending: they go to the changelog inside the batch's transaction and become committed state only
when that transaction commits, so an aborted batch leaves no trace in memory either.

Each partition of the changelog also says which input it reflects: one record per input topic,
keyed `POSITION_KEY + topic`, holding the next input offset, written by the stream loop in every
transaction beside the state it changed. The group's committed offset goes in the same
transaction, so a state restored whole stands exactly where the group committed; the loop checks
that after every restore (`streams/loop.py`) instead of trusting that a read reached the end.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from fleetline.config import KafkaSettings
from fleetline.streams.kafka import read_to_end
from fleetline.streams.records import where
from fleetline.streams.topics import Topics, TopicSpec

V = TypeVar("V")
_ABSENT = object()
# The key prefix of a changelog's position records (no state key starts with a NUL byte).
POSITION_KEY = b"\x00position\x00"


@dataclass
class ChangelogStore(Generic[V]):
    name: str
    changelog_topic: str
    encode: Callable[[V], bytes]
    decode: Callable[[bytes], V]
    _committed: dict[int, dict[bytes, V]] = field(default_factory=dict)
    _pending: dict[int, dict[bytes, V | None]] = field(default_factory=dict)
    # partition -> input topic -> the next input offset the partition's state reflects.
    _positions: dict[int, dict[str, int]] = field(default_factory=dict)
    _pending_positions: dict[int, dict[str, int]] = field(default_factory=dict)
    # Readers in other threads (the slice's live printout) see whole commits only.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def get(self, partition: int, key: bytes) -> V | None:
        pending = self._pending.get(partition, {}).get(key, _ABSENT)
        if pending is not _ABSENT:
            return pending  # type: ignore[return-value]
        return self._committed.get(partition, {}).get(key)

    def committed(self, partition: int, key: bytes) -> V | None:
        """The committed value only (for readers in other threads than the processor's)."""
        with self._lock:
            return self._committed.get(partition, {}).get(key)

    def put(self, partition: int, key: bytes, value: V | None) -> None:
        """Stage a write (None deletes); it is durable once the batch's transaction commits."""
        self._pending.setdefault(partition, {})[key] = value

    def advance(self, partition: int, topic: str, next_offset: int) -> None:
        """Stage where the partition's state stands in input `topic` once this batch commits."""
        self._pending_positions.setdefault(partition, {})[topic] = next_offset

    def positions(self, partition: int) -> dict[str, int]:
        """The committed input positions of a partition's state (input topic -> next offset;
        empty for a partition that has folded nothing)."""
        with self._lock:
            return dict(self._positions.get(partition, {}))

    def items(self, partitions: Iterable[int] | None = None) -> Iterator[tuple[bytes, V]]:
        """Committed state of the given partitions (all owned ones by default), as of now."""
        with self._lock:
            chosen = sorted(self._committed if partitions is None else partitions)
            snapshot = [item for p in chosen for item in self._committed.get(p, {}).items()]
        yield from snapshot

    def partitions(self) -> list[int]:
        return sorted(self._committed)

    def pending_changelog(self) -> Iterator[tuple[int, bytes, bytes | None]]:
        for partition, writes in self._pending.items():
            for key, value in writes.items():
                yield partition, key, None if value is None else self.encode(value)
        for partition, moved in self._pending_positions.items():
            for topic, offset in moved.items():
                yield partition, POSITION_KEY + topic.encode(), str(offset).encode()

    def commit(self) -> None:
        with self._lock:
            for partition, writes in self._pending.items():
                target = self._committed.setdefault(partition, {})
                for key, value in writes.items():
                    if value is None:
                        target.pop(key, None)
                    else:
                        target[key] = value
            for partition, moved in self._pending_positions.items():
                self._positions.setdefault(partition, {}).update(moved)
        self._pending.clear()
        self._pending_positions.clear()

    def abort(self) -> None:
        self._pending.clear()
        self._pending_positions.clear()

    def drop(self, partitions: Iterable[int]) -> None:
        with self._lock:
            for partition in partitions:
                self._committed.pop(partition, None)
                self._pending.pop(partition, None)
                self._positions.pop(partition, None)
                self._pending_positions.pop(partition, None)

    def restore(
        self,
        kafka: KafkaSettings,
        partitions: Iterable[int],
        timeout_s: float = 60.0,
        settle: bool = False,
    ) -> int:
        """Rebuild the given partitions from the changelog's committed records, read to its end
        (with `settle`, as the processor that owns them restores: until the end stops moving);
        count the state's records. Whether that is the whole state is for the caller to check
        against `positions` (the loop compares them with the group's offsets). A reader beside
        a live processor (the CLI, the API) gets the state as of about when it read."""
        partitions = sorted(set(partitions))
        self.drop(partitions)
        restored: dict[int, dict[bytes, V]] = {p: {} for p in partitions}
        positions: dict[int, dict[str, int]] = {p: {} for p in partitions}
        count = 0
        for msg in read_to_end(
            kafka,
            self.changelog_topic,
            partitions,
            f"{self.changelog_topic}.restore",
            timeout_s,
            settle=settle,
        ):
            _, partition, _ = where(msg)
            key, value = msg.key(), msg.value()
            if key is None:
                continue  # a changelog record always has its key
            if key.startswith(POSITION_KEY):
                topic = key[len(POSITION_KEY) :].decode()
                if value is None:
                    positions[partition].pop(topic, None)
                else:
                    positions[partition][topic] = int(value)
                continue
            count += 1
            target = restored[partition]
            if value is None:
                target.pop(key, None)
            else:
                target[key] = self.decode(value)
        with self._lock:
            self._committed.update(restored)
            self._positions.update(positions)
        return count


def json_store(name: str, changelog_topic: str) -> ChangelogStore[Any]:
    """A store of JSON values (sorted keys), as the scheduler and the health fold keep."""
    return ChangelogStore(
        name,
        changelog_topic,
        lambda value: json.dumps(value, sort_keys=True).encode(),
        lambda data: json.loads(data),
    )


FOLD_STORE = "state"


def fold_changelog(topics: Topics, application_id: str, readers: tuple[str, ...] = ()) -> TopicSpec:
    """The changelog topic of a fold's store (`fold_store`): one compacted partition, read by
    `readers` besides the control plane."""
    return topics.changelog_spec(application_id, FOLD_STORE, partitions=1, readers=readers)


def fold_store(topics: Topics, application_id: str) -> ChangelogStore[Any]:
    """The JSON store of a fold over a single-partition log (the scheduler's, cluster
    health's, operations'): partition 0 of `<prefix>.<application>.state.changelog`."""
    return json_store(FOLD_STORE, topics.changelog(application_id, FOLD_STORE))
