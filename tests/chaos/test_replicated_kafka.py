"""A broker of three SIGKILLed while node agents stream telemetry and jobs arrive: no event the
broker acknowledged is lost, the view and the scheduler ride through the leader changes, the
view's lag drains, every job is decided once and `replay --decisions` re-makes every decision."""

from __future__ import annotations

import time
import uuid

from fleetline.agents.fleet import FleetAgent
from fleetline.agents.simulator import ClusterSpec, FleetSimulator, cluster_info
from fleetline.cli import main
from fleetline.processors.scheduling.runtime import decisions_of, scheduler_topics, submit
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from tests.chaos.conftest import rounds
from tests.chaos.faults import Child, leaders, wait_decided, wait_lag_drained
from tests.scheduling_support import training
from tests.services import produce, serve_command, service_env, submits
from tests.support import BASE_MS, first_occurrences, fresh_topics, read_all

codec = default_codec()
CLUSTERS = [ClusterSpec("us-east-a", "us-east", 4), ClusterSpec("eu-west-a", "eu-west", 4)]
TICKS_PER_ROUND = 30


def test_a_broker_killed_under_load_loses_no_acknowledged_event(
    replicated, kafka_cluster, tmp_path, monkeypatch
) -> None:
    settings = replicated
    topics = fresh_topics(partitions=6)
    kafka_clients.ensure_topics(settings.kafka, scheduler_topics(topics))
    # Every partition of every topic is on all three brokers.
    metadata = kafka_clients.admin_client(settings.kafka).list_topics(timeout=30)
    assert all(
        len(p.replicas) == 3
        for spec in scheduler_topics(topics)
        for p in metadata.topics[spec.name].partitions.values()
    )
    produce(settings, topics, [("ClusterInfo", cluster_info(c, 1, BASE_MS)) for c in CLUSTERS])
    env = service_env(settings, tmp_path / "chdb")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    group = f"v-{uuid.uuid4().hex[:8]}"
    serve = Child(
        serve_command(topics.prefix, group, "--tick-interval", "0.3", "--snapshot-interval", "1"),
        env,
        tmp_path / "serve.log",
    )
    agent = FleetAgent.create(
        settings,
        codec,
        topics,
        FleetSimulator(CLUSTERS, seed=5),
        tmp_path / "agent",
        commands=False,
    )
    agent.start(BASE_MS)
    submitted: set[str] = set()
    killed: list[int] = []
    tick = 0
    try:
        for _ in range(rounds(1, 4)):
            # The broker leading the most of the busiest topics goes, mid-stream.
            for phase in ("before", "down"):
                for _ in range(TICKS_PER_ROUND):
                    tick += 1
                    agent.tick(BASE_MS + tick * 1000)
                    if tick % 6 == 0:
                        doc = training(f"j{tick}", per_worker=2, tensor=2, tenant="globex")
                        submit(settings.kafka, topics, submits(doc))
                        submitted.add(f"globex/j{tick}")
                    time.sleep(0.05)
                if phase == "before":
                    busiest = leaders(
                        settings.kafka,
                        [topics.telemetry, topics.node_state, topics.scheduler_requests],
                    )
                    victim = busiest.most_common(1)[0][0]
                    assert kafka_cluster.kill(victim - 1)
                    killed.append(victim)
            # Writes went on with two brokers in sync; the third comes back and catches up.
            kafka_cluster.restart(killed[-1] - 1)
        agent.flush(120)
        assert serve.alive(), serve.log()

        # Every telemetry record the agents collected is in the log: each node's sequence
        # numbers, with its states', are 1..n without a gap (repeats only after a retry).
        ticks = tick
        by_node = first_occurrences(read_all(settings, topics.telemetry, ticks * 8, timeout_s=90))
        assert len(by_node) == 8
        assert all(len(seqs) == ticks for seqs in by_node.values()), {
            n: len(s) for n, s in by_node.items()
        }
        # The view caught up past the fault: its committed offsets reached the log's end.
        wait_lag_drained(settings, f"{topics.prefix}.{group}", topics.node_topics)
        # Every job was decided, once.
        wait_decided(settings, topics, submitted)
        decisions = decisions_of(settings.kafka, topics)
        ids = [d["decision_id"] for d in decisions]
        assert len(ids) == len(set(ids)), "a decision was written twice"
        assert sum(d["outcome"] == "PLACED" for d in decisions) >= 4, serve.log()
    finally:
        serve.stop()
        agent.close()
    assert main(["replay", "--decisions", "--group", group, "--topic-prefix", topics.prefix]) == 0
