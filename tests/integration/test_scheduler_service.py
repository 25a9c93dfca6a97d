"""The scheduler against the real broker and S3 server: requests in, decisions, allocations and
prewarms out, exactly once across a restart, the view folding the allocations, and a replay of
the request log reproducing every decision byte for byte."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from confluent_kafka import TopicPartition

from fleetline.agents.simulator import ClusterSpec, cluster_info
from fleetline.config import Settings
from fleetline.processors.decision_replay import (
    DecisionReplay,
    live_dead_letters,
    replay_decisions,
    replay_operations,
)
from fleetline.processors.operations.runtime import APPLICATION_ID as OPS_APP
from fleetline.processors.operations.runtime import OpsService
from fleetline.processors.operations.runtime import changelog as ops_changelog
from fleetline.processors.replay import ViewFollower, log_bounds, rebuild
from fleetline.processors.scheduling.capacity import observe
from fleetline.processors.scheduling.client import decisions_of, job_records, read_state, submit
from fleetline.processors.scheduling.codec import canonical_json, new_request
from fleetline.processors.scheduling.runtime import SchedulerService, scheduler_topics
from fleetline.processors.view import read as view_read
from fleetline.processors.view.model import ResourceView
from fleetline.processors.view.read import StaticView
from fleetline.processors.view.runtime import ViewProcessor
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import MAGIC
from fleetline.streams.topics import Topics
from tests.fleet_events import scenario_events, scenario_fleet
from tests.scheduling_support import dataset, service, training
from tests.services import caught_up, produce, running, snapshot_store, submits
from tests.support import BASE_MS, fresh_topics, wait_until

pytestmark = pytest.mark.services
CLUSTERS = [
    ClusterSpec("us-east-a", "us-east", 4),
    ClusterSpec("eu-west-a", "eu-west", 4),
    ClusterSpec("ap-south-a", "ap-south", 4),
]


def wait_for(
    settings: Settings, topics: Topics, what: Callable[[list[dict]], bool], timeout_s: float = 60
) -> list[dict]:
    decisions: list[dict] = []

    def seen() -> bool:
        decisions[:] = decisions_of(settings.kafka, topics)
        return what(decisions)

    wait_until(seen, timeout_s, what="the decisions", every_s=0.3)
    return decisions


def outcomes(decisions: list[dict], job: str) -> list[str]:
    return [d["outcome"] for d in decisions if d["job"] == job]


@contextmanager
def scheduling(
    settings: Settings, topics: Topics, processor: ViewProcessor, snapshots
) -> Iterator[SchedulerService]:
    service_ = SchedulerService(
        settings.kafka,
        topics,
        processor,
        lambda offsets: observe(rebuild(settings.kafka, topics, offsets, snapshots).view),
        tick_interval_s=0.3,
    )
    with running(service_):
        yield service_


def test_decisions_over_kafka_survive_a_restart_and_replay_byte_for_byte(settings):
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, scheduler_topics(topics))
    snapshots = snapshot_store(settings)
    processor = ViewProcessor(
        settings.kafka, topics, snapshots, group_id=f"v-{uuid.uuid4().hex}", snapshot_interval_s=0.5
    )
    produce(settings, topics, [("ClusterInfo", cluster_info(c, 1, BASE_MS)) for c in CLUSTERS])
    produce(settings, topics, scenario_events(seconds=6))
    with running(processor):
        caught_up(settings, topics, [processor])
        with scheduling(settings, topics, processor, snapshots):
            submit(
                settings.kafka,
                topics,
                [
                    new_request(
                        "TENANT_POLICY",
                        "acme",
                        "acme",
                        int(time.time() * 1000),
                        "p1",
                        spec_json=canonical_json({"tenant": "acme", "quota": {"gpus": 40}}),
                    )
                ],
            )
            submit(
                settings.kafka,
                topics,
                submits(
                    dataset("corpus", "20TB", ["eu-west-a"]),
                    training("pretrain", workers=2, dataset="corpus", priority="low"),
                    training("tp4", workers=2, per_worker=4, tensor=4, priority="low"),
                    service("chat", replicas=2, per_replica=2, regions=("eu-west", "us-east")),
                    training("toomuch", workers=2),
                ),
            )
            decisions = wait_for(
                settings,
                topics,
                lambda ds: (
                    {"acme/pretrain", "acme/tp4", "acme/chat", "acme/toomuch"}
                    <= {d["job"] for d in ds}
                ),
            )
            assert outcomes(decisions, "dataset:corpus") == ["ACCEPTED"]
            assert outcomes(decisions, "acme/pretrain") == ["PLACED"]
            pretrain = next(d for d in decisions if d["job"] == "acme/pretrain")
            assert pretrain["placements"][0]["cluster_id"] == "eu-west-a"
            assert pretrain["view_offsets"] and pretrain["view_version"] > 0
            toomuch = next(d for d in decisions if d["job"] == "acme/toomuch")
            assert toomuch["outcome"] == "QUEUED" and "quota: tenant acme" in toomuch["reason"]

        # The allocations reached the view through its own log (written in transactions, so
        # the topic's end is a commit marker the view never stands on).
        def bound() -> dict[str, int]:
            return {a["job_id"]: len(a["gpus"]) for a in processor.read(view_read.allocations)}

        # A service's GPUs are its replicas' (each a job of its own).
        wanted = {"acme/pretrain": 16, "acme/tp4": 8, "acme/chat.r0": 2, "acme/chat.r1": 2}
        wait_until(lambda: bound() == wanted, what=f"the view's allocations, now {bound()}")

        # A second scheduler process picks up the committed state and goes on.
        state = job_records(read_state(settings.kafka, topics))
        assert {j["key"]: j["phase"] for j in state} == {
            # Training jobs wait for a cluster agent to report them running (none runs here);
            # the service names no workload, so no agent reports on it.
            "acme/pretrain": "Starting",
            "acme/tp4": "Starting",
            "acme/chat": "Running",
            "acme/chat.r0": "Running",
            "acme/chat.r1": "Running",
            "acme/toomuch": "Queued",
        }
        with scheduling(settings, topics, processor, snapshots) as scheduler:
            submit(
                settings.kafka,
                topics,
                submits(training("urgent", workers=3, priority="critical", tenant="ops")),
            )
            decisions = wait_for(
                settings,
                topics,
                lambda ds: "ops/urgent" in {d["job"] for d in ds if d["outcome"] == "PLACED"},
            )
            assert "PREEMPTED" in outcomes(decisions, "acme/pretrain") + outcomes(
                decisions, "acme/tp4"
            )
            # A node of the urgent job goes down: it migrates from its checkpoint.
            (urgent,) = [j for j in scheduler.jobs("ops") if j["key"] == "ops/urgent"]
            node = sorted(n for nodes in urgent["allocation"].values() for n in nodes)[0]
            sim = scenario_fleet()
            down = sim.node_state(sim.node(node), BASE_MS + 7_000, "DOWN", "power supply")
            down["seq"] = 1_000
            produce(settings, topics, [("NodeState", down)])
            decisions = wait_for(
                settings,
                topics,
                lambda ds: any(
                    d["job"] == "ops/urgent" and d["reason"].startswith(f"fault: {node} is DOWN")
                    for d in ds
                ),
            )
    ids = [d["decision_id"] for d in decisions]
    assert len(ids) == len(set(ids))  # each decision once, across the restart

    # A job submitted after the scheduler stopped has no decision yet: the replay folds as far
    # as the scheduler committed, so it is not a difference.
    submit(settings.kafka, topics, submits(training("late", tenant="ops")))
    replayed = replay(settings, topics, snapshots)
    assert replayed.ok, replayed.first_difference
    assert replayed.matched == len(decisions_of(settings.kafka, topics)) > 10
    assert replayed.ticks > 5 and replayed.unprocessed == 1
    # The state the scheduler committed across its restart is the state the log folds to.
    assert replayed.state == "equal", replayed.state_difference
    assert replayed.state_records > 3

    # A replay that reads the decision log after a live scheduler decided past the offset
    # the replay stops at (its group committed further while the replay ran: here the group's
    # offset is set back to the last decision's request) compares like with like: the later
    # decisions are not "in the log but not re-made".
    last = decisions_of(settings.kafka, topics)[-1]
    rewind = kafka_clients.consumer(settings.kafka, f"{topics.prefix}.scheduler")
    try:
        rewind.commit(
            offsets=[TopicPartition(topics.scheduler_requests, 0, last["input_offset"])],
            asynchronous=False,
        )
    finally:
        rewind.close()
    behind = replay(settings, topics, snapshots)
    assert behind.ok, behind.first_difference
    assert behind.matched < replayed.matched and behind.unprocessed > replayed.unprocessed


def replay(settings: Settings, topics: Topics, snapshots) -> DecisionReplay:
    """`fleetline replay --decisions` as the tests call it: the view from its snapshots."""
    follower = ViewFollower(settings.kafka, topics, snapshots)
    try:
        return replay_decisions(settings.kafka, topics, follower.facts)
    finally:
        follower.close()


FOREIGN = [b"not avro at all", MAGIC + b"\xfe" * 8 + b"an unknown writer"]


def foreign_bytes(settings: Settings, topic: str, key: bytes = b"n1") -> None:
    """What a stranger might write to a topic: bytes that are not Avro, and Avro's header with
    a fingerprint no schema has."""
    producer = kafka_clients.producer(settings.kafka)
    for value in FOREIGN:
        producer.produce(topic, key=key, value=value)
    assert producer.flush(30) == 0


def test_a_replay_passes_over_what_the_live_processors_dead_lettered_with_the_same_reason(
    settings,
):
    topics = fresh_topics()
    kafka_clients.ensure_topics(
        settings.kafka,
        [*scheduler_topics(topics), ops_changelog(topics)],
    )
    snapshots = snapshot_store(settings)
    produce(settings, topics, [("ClusterInfo", cluster_info(c, 1, BASE_MS)) for c in CLUSTERS])
    view_inputs = [*topics.node_topics, *topics.fleet_topics]
    for topic in view_inputs:
        foreign_bytes(settings, topic)
    produce(settings, topics, scenario_events(seconds=4))
    processor = ViewProcessor(
        settings.kafka, topics, snapshots, group_id=f"v-{uuid.uuid4().hex}", snapshot_interval_s=0.5
    )
    requests_app = f"{topics.prefix}.scheduler"
    with running(processor):
        caught_up(settings, topics, [processor])
        with scheduling(settings, topics, processor, snapshots):
            submit(settings.kafka, topics, submits(training("before")))
            foreign_bytes(settings, topics.scheduler_requests, key=b"acme/x")
            submit(settings.kafka, topics, submits(training("after", workers=2)))
            wait_for(settings, topics, lambda ds: "acme/after" in {d["job"] for d in ds})
            wait_until(
                lambda: (
                    len(
                        live_dead_letters(
                            settings.kafka, topics, requests_app, topics.scheduler_requests
                        )
                    )
                    == 2
                ),
                30,
                "the live scheduler's two dead letters",
            )

    live = live_dead_letters(settings.kafka, topics, requests_app, topics.scheduler_requests)
    replayed = replay(settings, topics, snapshots)
    assert replayed.ok, replayed.first_difference
    assert replayed.dead_letters == live and len(live) == 2, (replayed.dead_letters, live)
    assert any("not Avro" in r for r in live.values())
    assert any("fingerprint" in r for r in live.values()), live
    assert replayed.matched >= 2 and replayed.state == "equal", replayed.state_difference

    # The view's replay passes over each foreign record of each of its inputs.
    _, end = log_bounds(settings.kafka, topics)
    view = rebuild(settings.kafka, topics, end)
    assert view.dead_letters == len(FOREIGN) * len(view_inputs), view.dead_letters

    # The operations fold: foreign events passed over, as its live loop did.
    ops = OpsService(settings.kafka, topics, StaticView(ResourceView()), tick_interval_s=0.2)
    ops_app = f"{topics.prefix}.{OPS_APP}"
    with running(ops):
        foreign_bytes(settings, topics.ops, key=b"ops")
        wait_until(
            lambda: len(live_dead_letters(settings.kafka, topics, ops_app, topics.ops)) == 2,
            30,
            "the live operations fold's two dead letters",
        )
    again = replay_operations(settings.kafka, topics)
    assert again.ok, again.first_difference
    assert again.dead_letters == live_dead_letters(settings.kafka, topics, ops_app, topics.ops)
    assert again.events > len(FOREIGN)  # its own OBSERVE events were folded too
