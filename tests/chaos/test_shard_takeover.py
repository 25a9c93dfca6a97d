"""Two `fleetline serve --sharded` instances share the view's shards through their consumer
group, and the scheduler in one of them places jobs from the capacity summaries both publish.
The other is SIGKILLed while the node agents stream and jobs arrive, and the survivor takes its
shards over: it resumes each from the dead instance's snapshots, folds on to the end of the log
(the group's lag drains with a single member holding every partition), its snapshots then equal
a clean fold, the summaries it publishes give the facts a clean fold gives, and every decision
is re-made byte for byte from the summaries its TICK named (`replay --decisions`)."""

from __future__ import annotations

import dataclasses
import time
import uuid

from confluent_kafka import ConsumerGroupState, KafkaError, KafkaException

from fleetline.agents.fleet import FleetAgent
from fleetline.agents.simulator import ClusterSpec, FleetSimulator, cluster_info
from fleetline.app import view_snapshots
from fleetline.processors.audit.runtime import published_decisions
from fleetline.processors.decision_replay import replay_decisions
from fleetline.processors.replay import ViewFollower, log_bounds, rebuild
from fleetline.processors.scheduling.capacity import observe, observe_summaries
from fleetline.processors.scheduling.client import read_topic, submit
from fleetline.processors.scheduling.codec import offsets_of
from fleetline.processors.scheduling.runtime import scheduler_topics
from fleetline.processors.view import codec as view_codec
from fleetline.processors.view.folder import shard_part
from fleetline.processors.view.runtime import SummaryFollower
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import SCHEDULER_REQUEST
from fleetline.streams.serde import default_codec
from tests.chaos.faults import Child, wait_decided, wait_lag_drained
from tests.scheduling_support import training
from tests.services import produce, serve_command, service_env, submits
from tests.support import BASE_MS, fresh_topics, wait_until

codec = default_codec()
SETTLING = {
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
}
CLUSTERS = [ClusterSpec("us-east-a", "us-east", 6), ClusterSpec("eu-west-a", "eu-west", 6)]


def members(settings, group: str) -> list[set[tuple[str, int]]]:
    """The partitions each member of a stable consumer group holds."""
    admin = kafka_clients.admin_client(settings.kafka)
    try:
        described = admin.describe_consumer_groups([group])[group].result(timeout=30)
    except KafkaException as exc:
        if exc.args[0].code() in SETTLING:
            return []  # the group's coordinator is still being chosen: not stable yet
        raise
    if described.state != ConsumerGroupState.STABLE:
        return []
    return [
        {(tp.topic, tp.partition) for tp in m.assignment.topic_partitions}
        for m in described.members
    ]


def test_a_killed_view_instance_s_shards_are_taken_over(replicated, tmp_path) -> None:
    settings = dataclasses.replace(replicated)
    topics = fresh_topics(partitions=6)
    kafka_clients.ensure_topics(settings.kafka, scheduler_topics(topics))
    produce(settings, topics, [("ClusterInfo", cluster_info(c, 1, BASE_MS)) for c in CLUSTERS])
    group = f"v-{uuid.uuid4().hex[:8]}"
    consumer_group = f"{topics.prefix}.{group}"
    # Each instance has a ClickHouse of its own (chdb admits one process per folder). The
    # scheduler runs in the one that lives; it holds only some shards until the other dies.
    roles = [("--no-scheduler",), ("--tick-interval", "0.5")]
    instances = [
        Child(
            serve_command(
                topics.prefix,
                group,
                *("--sharded", "--instance-id", str(i), "--snapshot-interval", "1", *roles[i]),
            ),
            service_env(settings, tmp_path / f"chdb{i}", killed_members=True),
            tmp_path / f"serve{i}.log",
        )
        for i in range(2)
    ]
    jobs: set[str] = set()

    def arrive(count: int) -> None:
        for _ in range(count):
            name = f"j{len(jobs) + 1}"
            jobs.add(f"globex/{name}")
            submit(
                settings.kafka,
                topics,
                submits(training(name, per_worker=2, tensor=2, tenant="globex")),
            )

    agent = FleetAgent.create(
        settings,
        codec,
        topics,
        FleetSimulator(CLUSTERS, seed=9),
        tmp_path / "agent",
        commands=False,
    )
    agent.start(BASE_MS)
    shards = {(t, p) for t in topics.node_topics for p in range(6)}
    tick = 0

    def stream(ticks: int) -> None:
        nonlocal tick
        for _ in range(ticks):
            tick += 1
            agent.tick(BASE_MS + tick * 1000)
            time.sleep(0.05)
        agent.flush(60)

    try:
        # Both instances hold shards: the group splits the node topics' partitions between them.
        def split() -> bool:
            held = members(settings, consumer_group)
            return len(held) == 2 and all(held) and set().union(*held) == shards

        stream(10)
        wait_until(split, 90, what="two members sharing the shards", every_s=1)
        stream(10)
        arrive(3)
        stream(10)
        instances[0].proc.kill()
        instances[0].proc.wait(30)
        arrive(3)
        stream(30)  # the survivor takes over while the agents go on

        def taken_over() -> bool:
            held = members(settings, consumer_group)
            return len(held) == 1 and held[0] == shards

        wait_until(taken_over, 90, what="the survivor holding every shard", every_s=1)
        wait_lag_drained(settings, consumer_group, topics.node_topics)
        decided = wait_decided(settings, topics, jobs)
        # Placed from summaries alone: before the kill this scheduler folded only its shards.
        placed = {
            r["job"]
            for r, _ in published_decisions(settings.kafka, topics)
            if r["outcome"] == "PLACED"
        }
        assert placed == jobs, instances[1].log()

        # The summaries the survivor publishes, composed, are what a clean fold of the whole
        # log gives the scheduler: every node, in the shard that holds it, with its capacity.
        summaries = SummaryFollower(settings.kafka, topics)

        def summaries_agree() -> bool:
            _, end = log_bounds(settings.kafka, topics)
            summaries.to_end()
            facts = observe_summaries(summaries.records, summaries.offsets)
            whole = observe(rebuild(settings.kafka, topics, end).view)
            return facts.nodes == whole.nodes and facts.clusters == whole.clusters

        try:
            wait_until(summaries_agree, 60, what="the summaries equal to a clean fold", every_s=2)
            held = {r["part"] for k, r in summaries.records.items() if k.startswith("nodes/")}
        finally:
            summaries.close()
        assert len(held) >= 3  # the nodes' keys spread over most shards
        assert instances[1].alive(), instances[1].log()
    finally:
        for instance in instances:
            instance.stop()
        agent.close()

    # Every shard's newest snapshot is at the log's end (the survivor's, from where the dead
    # instance's left off), and they compose to the view a clean fold of the log makes.
    _, end = log_bounds(settings.kafka, topics)
    snapshots = view_snapshots(settings, topics.prefix, group)
    busy = [p for p in range(6) if any(end[t][p] for t in topics.node_topics)]
    assert len(busy) >= 3  # the nodes' keys spread over most shards
    for partition in busy:
        newest = snapshots.list(shard_part(partition))[-1]
        assert all(
            newest.offsets.get(t, {}).get(partition, 0) == end[t][partition]
            for t in topics.node_topics
        ), (partition, newest.offsets)
    from_snapshots = rebuild(settings.kafka, topics, end, snapshots)
    assert from_snapshots.folded < sum(sum(ps.values()) for ps in end.values())
    clean = rebuild(settings.kafka, topics, end)
    assert view_codec.to_data(from_snapshots.view) == view_codec.to_data(clean.view)

    # Every TICK named the summaries topic, and the replay re-makes every decision from them.
    ticks = [
        offsets_of(r)
        for r in (
            codec.decode(m.value(), expect=SCHEDULER_REQUEST).record
            for m in read_topic(settings.kafka, topics.scheduler_requests)
        )
        if r["kind"] == "TICK"
    ]
    assert ticks and all(set(t) == {topics.summaries} for t in ticks)
    follower = ViewFollower(settings.kafka, topics)
    try:
        replayed = replay_decisions(settings.kafka, topics, follower.facts)
    finally:
        follower.close()
    assert replayed.ok, replayed.first_difference
    # Every decision published, to the last one the instances made before they stopped (a
    # queued job placed after `decided` was read is one more).
    published = wait_decided(settings, topics, jobs)
    assert published.items() >= decided.items()
    assert replayed.matched == len(published)
    assert replayed.ticks > 0 and replayed.ticks + replayed.unprocessed >= len(ticks)
