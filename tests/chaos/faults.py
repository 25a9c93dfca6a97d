"""What the chaos tests inject and what they measure: which broker leads what, a consumer
group's lag, a child process that can be killed and started again."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition

from fleetline.config import KafkaSettings
from fleetline.streams import kafka as kafka_clients


def leaders(kafka: KafkaSettings, topics: Iterable[str]) -> Counter[int]:
    """How many of these topics' partitions each broker (node id) leads."""
    metadata = kafka_clients.admin_client(kafka).list_topics(timeout=30)
    return Counter(
        partition.leader
        for topic in topics
        for partition in metadata.topics[topic].partitions.values()
    )


def group_lag(kafka: KafkaSettings, group: str, topics: Iterable[str]) -> int:
    """Messages in these topics that `group` has not committed past (its whole log if it has
    committed nothing in a partition)."""
    metadata = kafka_clients.admin_client(kafka).list_topics(timeout=30)
    partitions = [
        TopicPartition(topic, p) for topic in topics for p in metadata.topics[topic].partitions
    ]
    probe = Consumer(kafka.client_config(**{"group.id": group, "enable.auto.commit": False}))
    try:
        lag = 0
        for tp in probe.committed(partitions, timeout=30):
            low, high = probe.get_watermark_offsets(tp, timeout=30, cached=False)
            lag += high - (tp.offset if tp.offset >= 0 else low)
        return lag
    finally:
        probe.close()


def reader_group() -> str:
    return f"chaos-reader-{uuid.uuid4().hex[:8]}"


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
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.kills += 1
        self.proc = self._start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]
