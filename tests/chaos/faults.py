"""What the chaos tests inject and what they measure: which broker leads what, a consumer
group's lag, a child process that can be killed and started again."""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from fleetline.config import KafkaSettings, Settings
from fleetline.processors.audit.runtime import published_decisions
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.topics import Topics
from tests.support import wait_until


def leaders(kafka: KafkaSettings, topics: Iterable[str]) -> Counter[int]:
    """How many of these topics' partitions each broker (node id) leads."""
    metadata = kafka_clients.admin_client(kafka).list_topics(timeout=30)
    return Counter(
        partition.leader
        for topic in topics
        for partition in metadata.topics[topic].partitions.values()
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
