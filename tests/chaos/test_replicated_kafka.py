"""Brokers of three SIGKILLed while node agents stream telemetry and jobs arrive, one way each:
the broker leading the busiest topics, the leader of the scheduler's changelog, the
coordinator of the scheduler's consumer group, the coordinator of its transactional id, the
changelog's leader while a restarted scheduler restores its state, and two brokers one after
the other (with min.insync.replicas 2, writes stop until one returns).

After each, the checker (`faults.check_exactly_once`): no event a broker acknowledged is lost,
the view's lag drains, every request has exactly one decision, nothing was dead-lettered, the
scheduler's committed state is the state a clean fold of its request log reaches, and
`replay --decisions` re-makes every decision byte for byte."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from fleetline.agents.fleet import FleetAgent
from fleetline.agents.simulator import ClusterSpec, FleetSimulator, cluster_info
from fleetline.config import Settings
from fleetline.errors import StreamError
from fleetline.infra import KafkaCluster
from fleetline.processors.scheduling.client import APPLICATION_ID as SCHEDULER
from fleetline.processors.scheduling.client import STORE, submit
from fleetline.processors.scheduling.runtime import scheduler_topics
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics
from tests.chaos.conftest import rounds
from tests.chaos.faults import (
    Child,
    check_exactly_once,
    group_coordinator,
    leaders,
    partition_leader,
    transaction_coordinator,
)
from tests.scheduling_support import training
from tests.services import produce, serve_command, service_env, submits
from tests.support import BASE_MS, wait_until

codec = default_codec()
CLUSTERS = [ClusterSpec("us-east-a", "us-east", 4), ClusterSpec("eu-west-a", "eu-west", 4)]
TICKS = 30  # simulated seconds before a fault, and again after it


class FleetUnderLoad:
    """`fleetline serve` (view and scheduler) as a child process on the three brokers, the
    simulated fleet's node agents in this one, and a job submitted every sixth second."""

    def __init__(
        self, settings: Settings, cluster: KafkaCluster, tmp_path: Path, monkeypatch
    ) -> None:
        self.settings = settings
        self.cluster = cluster
        self.topics = Topics(prefix=f"test.{uuid.uuid4().hex[:10]}", node_partitions=6)
        kafka_clients.ensure_topics(settings.kafka, scheduler_topics(self.topics))
        # Every partition of every topic is on all three brokers.
        metadata = kafka_clients.admin_client(settings.kafka).list_topics(timeout=30)
        assert all(
            len(p.replicas) == 3
            for spec in scheduler_topics(self.topics)
            for p in metadata.topics[spec.name].partitions.values()
        )
        produce(
            settings,
            self.topics,
            [("ClusterInfo", cluster_info(c, 1, BASE_MS)) for c in CLUSTERS],
        )
        env = service_env(settings, tmp_path / "chdb")
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        self.group = f"v-{uuid.uuid4().hex[:8]}"
        self.serve = Child(
            serve_command(
                self.topics.prefix,
                self.group,
                "--tick-interval",
                "0.3",
                "--snapshot-interval",
                "1",
                verbose=True,
            ),
            env,
            tmp_path / "serve.log",
        )
        self.agent = FleetAgent.create(
            settings,
            codec,
            self.topics,
            FleetSimulator(CLUSTERS, seed=5),
            tmp_path / "agent",
            commands=False,
        )
        self.agent.start(BASE_MS)
        self.second = 0
        self.submitted: dict[str, int] = {}  # job -> the offset of its SUBMIT request
        self.down: list[int] = []

    @property
    def scheduler_group(self) -> str:
        return f"{self.topics.prefix}.{SCHEDULER}"

    @property
    def scheduler_changelog(self) -> str:
        return self.topics.changelog(SCHEDULER, STORE)

    def run(self, seconds: int = TICKS, jobs: bool = True) -> None:
        for _ in range(seconds):
            self.second += 1
            self.agent.tick(BASE_MS + self.second * 1000)
            if jobs and self.second % 6 == 0:
                self.submit()
            time.sleep(0.05)

    def submit(self, timeout_s: float = 30.0) -> None:
        name = f"j{self.second}"
        doc = training(name, per_worker=2, tensor=2, tenant="globex")
        (offset,) = submit(self.settings.kafka, self.topics, submits(doc), timeout_s)
        self.submitted[f"globex/{name}"] = offset

    def holder(self, role: str) -> int:
        """The broker that holds a part of the scheduler's exactly-once machinery now."""
        kafka = self.settings.kafka
        if role == "changelog leader":
            return partition_leader(kafka, self.scheduler_changelog)
        if role == "group coordinator":
            return group_coordinator(kafka, self.scheduler_group)
        assert role == "txn coordinator", role
        # The stream loop's transactional id: the application's name and the instance id.
        return transaction_coordinator(kafka, f"{self.scheduler_group}-0")

    def kill(self, broker: int) -> None:
        assert self.cluster.kill(broker - 1), f"broker {broker} was not running"
        self.down.append(broker)

    def restart(self, broker: int) -> None:
        self.cluster.restart(broker - 1)
        self.down.remove(broker)

    def check(self) -> None:
        for broker in list(self.down):
            self.restart(broker)
        self.agent.flush(120)
        assert self.serve.alive(), self.serve.log()
        check_exactly_once(
            self.settings,
            self.topics,
            self.group,
            self.submitted,
            self.serve,
            nodes=sum(c.nodes for c in CLUSTERS),
            telemetry_per_node=self.second,
        )

    def close(self) -> None:
        self.serve.stop()
        self.agent.close()


@pytest.fixture
def fleet(replicated, kafka_cluster, tmp_path, monkeypatch):
    under_load = FleetUnderLoad(replicated, kafka_cluster, tmp_path, monkeypatch)
    yield under_load
    under_load.close()


def test_the_broker_leading_the_busiest_topics_killed_under_load(fleet) -> None:
    for _ in range(rounds(1, 4)):
        fleet.run()
        busiest = leaders(
            fleet.settings.kafka,
            [fleet.topics.telemetry, fleet.topics.node_state, fleet.topics.scheduler_requests],
        )
        fleet.kill(busiest.most_common(1)[0][0])
        # Writes go on with two brokers in sync; the third comes back and catches up.
        fleet.run()
        fleet.restart(fleet.down[-1])
    fleet.check()


@pytest.mark.chaos_full
@pytest.mark.parametrize("role", ["changelog leader", "group coordinator", "txn coordinator"])
def test_the_broker_holding_a_part_of_the_schedulers_exactly_once_killed(fleet, role) -> None:
    for _ in range(2):
        fleet.run()
        victim = fleet.holder(role)
        fleet.kill(victim)
        fleet.run()
        fleet.restart(victim)
    fleet.check()


@pytest.mark.chaos_full
@pytest.mark.parametrize("when", ["before it restarts", "as its restore begins"])
def test_the_changelog_leader_killed_while_a_restarted_scheduler_restores(fleet, when) -> None:
    fleet.run()
    leader = partition_leader(fleet.settings.kafka, fleet.scheduler_changelog)
    restores = fleet.serve.log_text().count(": restoring partition")
    if when == "before it restarts":
        # The restore then meets a leader that no longer answers, which the brokers will take
        # seconds to notice and replace.
        fleet.serve.kill()
        fleet.kill(leader)
        fleet.serve.start()
    else:
        fleet.serve.kill_and_restart()
        wait_until(
            lambda: fleet.serve.log_text().count(": restoring partition") > restores,
            60,
            "the restarted scheduler to begin its restore",
            every_s=0.02,
        )
        fleet.kill(leader)
    fleet.run()
    fleet.restart(leader)
    fleet.run()
    fleet.check()


@pytest.mark.chaos_full
def test_two_brokers_lost_stop_writes_and_everything_resumes_when_one_returns(fleet) -> None:
    fleet.run()
    first = partition_leader(fleet.settings.kafka, fleet.scheduler_changelog)
    fleet.kill(first)
    fleet.run(10)
    second = next(b for b in (1, 2, 3) if b not in fleet.down)
    fleet.kill(second)
    # One broker of three: no write reaches two in-sync replicas, so none is acknowledged
    # (the node agents keep theirs in their spools).
    with pytest.raises(StreamError):
        fleet.submit(timeout_s=5)
    fleet.run(10, jobs=False)
    fleet.restart(first)
    fleet.run()
    fleet.restart(second)
    fleet.run()
    fleet.check()
