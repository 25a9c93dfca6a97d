"""What the chaos tests inject and what they measure: which broker leads or coordinates what,
a consumer group's lag, a child process that can be killed and started again, and the checker
every broker fault ends with."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from fleetline.cli import main
from fleetline.config import KafkaSettings, Settings
from fleetline.processors.audit.runtime import published_decisions
from fleetline.processors.decision_replay import replay_decisions
from fleetline.processors.replay import ViewFollower
from fleetline.processors.scheduling.client import decisions_of, read_topic
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import DeadLetter, read_dead_letter
from fleetline.streams.events import SCHEDULER_REQUEST
from fleetline.streams.records import where
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics
from tests.support import first_occurrences, read_all, wait_until


def leaders(kafka: KafkaSettings, topics: Iterable[str]) -> Counter[int]:
    """How many of these topics' partitions each broker (node id) leads."""
    metadata = kafka_clients.admin_client(kafka).list_topics(timeout=30)
    return Counter(
        partition.leader
        for topic in topics
        for partition in metadata.topics[topic].partitions.values()
    )


def partition_leader(kafka: KafkaSettings, topic: str, partition: int = 0) -> int:
    """The broker (node id) leading a partition, once one is elected."""
    found: list[int] = []

    def elected() -> bool:
        metadata = kafka_clients.admin_client(kafka).list_topics(topic, timeout=30)
        leader = metadata.topics[topic].partitions[partition].leader
        found[:] = [leader] if leader >= 0 else []
        return bool(found)

    wait_until(elected, 60, what=f"a leader of {topic}[{partition}]", every_s=0.5)
    return found[0]


def java_string_hash(text: str) -> int:
    """Java's String.hashCode (what Kafka maps a group or transactional id to a partition by)."""
    value = 0
    for unit in text.encode("utf-16-be").hex(" ", 2).split():
        value = (31 * value + int(unit, 16)) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def coordinator(kafka: KafkaSettings, internal_topic: str, key: str) -> int:
    """The broker coordinating `key` (a group in __consumer_offsets, a transactional id in
    __transaction_state): the leader of the partition Kafka maps it to,
    Utils.abs(key.hashCode) % partitions."""
    count = len(kafka_clients.partitions_of(kafka, internal_topic))
    code = java_string_hash(key)
    partition = (0 if code == -(1 << 31) else abs(code)) % count
    return partition_leader(kafka, internal_topic, partition)


def group_coordinator(kafka: KafkaSettings, group: str) -> int:
    by_hash = coordinator(kafka, "__consumer_offsets", group)
    # The broker's own answer, to keep the hash above honest (it is what the next helper
    # relies on for transactional ids, which no admin call of this client describes).
    admin = kafka_clients.admin_client(kafka)  # referenced until its future resolves
    described = admin.describe_consumer_groups([group], request_timeout=30)[group].result(60)
    assert described.coordinator.id == by_hash, (group, by_hash)
    return by_hash


def transaction_coordinator(kafka: KafkaSettings, transactional_id: str) -> int:
    return coordinator(kafka, "__transaction_state", transactional_id)


def dead_letters(kafka: KafkaSettings, topics: Topics) -> list[DeadLetter]:
    return [
        read_dead_letter(msg)
        for msg in kafka_clients.read_to_end(
            kafka,
            topics.dead_letter,
            kafka_clients.partitions_of(kafka, topics.dead_letter),
            f"chaos-dlq-{uuid.uuid4().hex[:8]}",
        )
    ]


def check_exactly_once(
    settings: Settings,
    topics: Topics,
    view_group: str,
    acknowledged: Mapping[str, int],
    serve: Child,
    nodes: int,
    telemetry_per_node: int,
) -> None:
    """What a broker fault must leave as it found: every telemetry record the node agents
    collected (`telemetry_per_node` from each of `nodes`) is in the log, the view's lag
    drains, every SUBMIT has exactly one decision (and every acknowledged one is among them),
    nothing was dead-lettered, and once the scheduler stops, its committed state is the state
    a clean fold of its request log reaches and every decision is made again byte for byte."""
    codec = default_codec()
    # Every telemetry record of every node is in the log (a repeat only after a retry).
    by_node = first_occurrences(
        read_all(settings, topics.telemetry, nodes * telemetry_per_node, timeout_s=90)
    )
    assert len(by_node) == nodes
    assert all(len(seqs) == telemetry_per_node for seqs in by_node.values()), {
        n: len(s) for n, s in by_node.items()
    }
    try:
        wait_lag_drained(settings, f"{topics.prefix}.{view_group}", topics.node_topics)
        wait_decided(settings, topics, set(acknowledged))
    except AssertionError as exc:
        story = serve.story()
        raise AssertionError(f"{exc}; serve {serve.state()}; its log:\n{story}") from None
    serve.stop()
    assert serve.proc.returncode == 0, f"serve exited {serve.proc.returncode}: {serve.log()}"

    committed = kafka_clients.committed_offsets(
        settings.kafka, f"{topics.prefix}.scheduler", topics.scheduler_requests
    )[0]
    submits = {
        offset: record["key"]
        for offset, record in (
            (where(m)[2], codec.decode(m.value(), expect=SCHEDULER_REQUEST).record)
            for m in read_topic(settings.kafka, topics.scheduler_requests)
        )
        if record["kind"] == "SUBMIT" and offset < committed
    }
    assert set(acknowledged.items()) <= {(job, offset) for offset, job in submits.items()}
    decisions = decisions_of(settings.kafka, topics)
    ids = [d["decision_id"] for d in decisions]
    assert len(ids) == len(set(ids)), "a decision was written twice"
    answered = Counter(
        (d["input_offset"], d["job"]) for d in decisions if d["input_offset"] in submits
    )
    assert {(offset, job): answered[(offset, job)] for offset, job in submits.items()} == {
        (offset, job): 1 for offset, job in submits.items()
    }
    assert sum(d["outcome"] == "PLACED" for d in decisions) >= 4, [
        (d["job"], d["outcome"], d["reason"]) for d in decisions
    ]
    letters = dead_letters(settings.kafka, topics)
    assert not letters, [(d.application, d.topic, d.offset, d.reason) for d in letters]

    follower = ViewFollower(settings.kafka, topics)
    try:
        replayed = replay_decisions(settings.kafka, topics, follower.facts)
    finally:
        follower.close()
    assert replayed.ok, replayed.first_difference or replayed.state_difference
    assert replayed.state == "equal", replayed.state_difference
    assert replayed.matched == len(decisions)
    assert (
        main(["replay", "--decisions", "--group", view_group, "--topic-prefix", topics.prefix]) == 0
    )


def wait_lag_drained(settings: Settings, group: str, topics: Iterable[str]) -> None:
    """Until consumer `group` has committed past every message of these topics."""
    topics = list(topics)
    wait_until(
        lambda: kafka_clients.group_lag(settings.kafka, group, topics) == 0,
        120,
        what=f"{group}'s lag to drain",
        every_s=1,
    )


def wait_decided(settings: Settings, topics: Topics, jobs: set[str]) -> dict[str, str]:
    """Until every job has a decision; then each decision's id -> the SHA-256 of its bytes."""
    published: list[tuple[dict, str]] = []

    def all_decided() -> bool:
        published[:] = published_decisions(settings.kafka, topics)
        return jobs <= {record["job"] for record, _ in published}

    wait_until(all_decided, 120, what="every job's decision", every_s=1)
    return {record["decision_id"]: digest for record, digest in published}


class Child:
    """A `fleetline` process that a test SIGKILLs and starts again with the same command."""

    def __init__(self, command: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.command = list(command)
        self.env = {**os.environ, **env}
        self.log_path = log
        self.kills = 0
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        with self.log_path.open("ab") as log:
            return subprocess.Popen(self.command, env=self.env, stdout=log, stderr=log)

    def kill_and_restart(self) -> None:
        self.kill()
        self.start()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.kills += 1

    def start(self) -> None:
        assert self.proc.poll() is not None, "still running"
        self.proc = self._start()

    def _dump_threads(self) -> None:
        dump_threads(self.proc.pid, self.log_path)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self._dump_threads()
                self.proc.kill()
                self.proc.wait(10)

    def log(self) -> str:
        return self.log_text()[-4000:]

    def state(self) -> str:
        """How it exited, or where its threads stand (a child that does not do what it
        should)."""
        code = self.proc.poll()
        if code is not None:
            return f"exited {code}"
        before = len(self.log_text())
        self._dump_threads()
        return f"running, its threads:\n{self.log_text()[before:][-6000:]}"

    def story(self, lines: int = 80) -> str:
        """The last `lines` of its own log lines (librdkafka's connection noise left out)."""
        own = [ln for ln in self.log_text().splitlines() if "fleetline.librdkafka" not in ln]
        return "\n".join(own[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def scalars_from_clickhouse(url: str, queries: Sequence[str]) -> list[int]:
    """One number per query, asked of an embedded ClickHouse folder from a process of its own
    (chdb admits one folder per process, and the test's may already have opened another)."""
    import json
    import sys

    script = (
        "import json, sys\n"
        "from fleetline.storage.clickhouse import connect\n"
        "client = connect(sys.argv[1])\n"
        "print(json.dumps([int(client.query(q).result_rows[0][0]) for q in sys.argv[2:]]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, url, *queries], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [int(v) for v in json.loads(done.stdout.strip().splitlines()[-1])]


def dump_threads(pid: int, log_path: Path) -> None:
    """Where each thread of a process stands, appended to `log_path` (py-spy, a dev dependency,
    reads a process's Python and native stacks from outside): for a child that does not stop,
    or does not do what it should."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return
    with log_path.open("ab") as log:
        subprocess.run(
            [str(spy), "dump", "--native", "--pid", str(pid)],
            stdout=log,
            stderr=log,
            timeout=60,
            check=False,
        )
