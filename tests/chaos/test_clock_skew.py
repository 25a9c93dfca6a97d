"""Agents with skewed clocks, on the live stack: one cluster's agents stamp their events ten
minutes ahead, another's ten minutes behind. The view holds the fast clock back to the broker's
(so the rest of the fleet does not look unheard-of), self-healing opens no ticket against a node
that is heard every second, and the live view equals a clean fold of the log."""

from __future__ import annotations

import time
import uuid

from fleetline.agents.fleet import FleetAgent
from fleetline.agents.simulator import ClusterSpec, FleetSimulator, cluster_info
from fleetline.app import view_snapshots
from fleetline.processors.operations.runtime import APPLICATION_ID as OPS_APP
from fleetline.processors.operations.runtime import tickets_from_log
from fleetline.processors.replay import log_bounds, rebuild
from fleetline.processors.scheduling.client import read_topic
from fleetline.processors.scheduling.runtime import scheduler_topics
from fleetline.processors.view import codec as view_codec
from fleetline.processors.view.fold import node_status
from fleetline.processors.view.model import NodeStatus
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from tests.chaos.faults import Child, wait_lag_drained
from tests.services import produce, serve_command, service_env
from tests.support import fresh_topics, wait_until

codec = default_codec()
SKEWS_MS = {"eu-west-a": 600_000, "us-east-a": -600_000, "ap-south-a": 0}


def operations_folded_since(settings, topics, since_ms: int) -> None:
    """Wait until the operations fold has committed past an OBSERVE stamped at `since_ms` or
    later (its ticker observes every second when loads change, every 10 s when quiet)."""
    application = f"{topics.prefix}.{OPS_APP}"

    def folded() -> bool:
        observed = [
            m.offset()
            for m in read_topic(settings.kafka, topics.ops)
            if (event := codec.decode(m.value()).record)["kind"] == "OBSERVE"
            and event["ts"] >= since_ms
        ]
        if not observed:
            return False
        committed = kafka_clients.committed_offsets(settings.kafka, application, topics.ops)
        return committed.get(0, -1) > observed[0]

    wait_until(folded, 60, "operations to fold an observation of the drained view", every_s=0.5)


def test_skewed_agent_clocks_neither_stall_nor_silence_the_fleet(replicated, tmp_path) -> None:
    settings = replicated
    topics = fresh_topics(partitions=6)
    kafka_clients.ensure_topics(settings.kafka, scheduler_topics(topics))
    clusters = [ClusterSpec(c, c.rsplit("-", 1)[0], 2) for c in SKEWS_MS]
    now_ms = int(time.time() * 1000)
    produce(settings, topics, [("ClusterInfo", cluster_info(c, 1, now_ms)) for c in clusters])
    group = f"v-{uuid.uuid4().hex[:8]}"
    serve = Child(
        serve_command(topics.prefix, group, "--snapshot-interval", "1"),
        service_env(settings, tmp_path / "chdb"),
        tmp_path / "serve.log",
    )
    agents = {
        c.cluster_id: FleetAgent.create(
            settings,
            codec,
            topics,
            FleetSimulator([c], seed=4),
            tmp_path / c.cluster_id,
            commands=False,
        )
        for c in clusters
    }
    try:
        for cluster_id, agent in agents.items():
            agent.start(now_ms + SKEWS_MS[cluster_id])
        # 20 s of one-second intervals, each agent on its own clock: twice the view's 10 s
        # before a node unheard is unreachable, which a clock carried ahead would trip at once.
        for _ in range(20):
            now_ms = int(time.time() * 1000)
            for cluster_id, agent in agents.items():
                agent.tick(now_ms + SKEWS_MS[cluster_id])
            time.sleep(max(0.0, 1.0 - (time.time() * 1000 - now_ms) / 1000))
        for agent in agents.values():
            agent.flush(60)
        wait_lag_drained(settings, f"{topics.prefix}.{group}", topics.node_topics)
        # Not a sleep: operations has folded an observation of the view made after it drained
        # (whatever ticket the skew would open is in the log by then).
        operations_folded_since(settings, topics, int(time.time() * 1000))
    finally:
        serve.stop()
        for agent in agents.values():
            agent.close()

    _, end = log_bounds(settings.kafka, topics)
    live = rebuild(settings.kafka, topics, end, view_snapshots(settings, topics.prefix, group))
    clean = rebuild(settings.kafka, topics, end)
    assert view_codec.to_data(live.view) == view_codec.to_data(clean.view)
    view = clean.view
    # The fast clock did not carry the view's time ten minutes ahead ...
    assert view.watermark_ms < int(time.time() * 1000) + 60_000
    # ... so the nodes on true and slow clocks, heard every second, are not unreachable; the
    # slow clock's own nodes are (their events say ten minutes old), and that names them.
    status = {n.node_id: node_status(view, n) for n in view.nodes.values()}
    assert len(status) == 6
    for node_id, state in status.items():
        if node_id.startswith("us-east-a"):
            assert state == NodeStatus.UNREACHABLE, (node_id, state)
        else:
            assert state == NodeStatus.UP, (node_id, state)
    # Self-healing opened no ticket against the nodes on true or fast clocks.
    tickets = tickets_from_log(settings.kafka, topics).values()
    assert not [t for t in tickets if not t["node_id"].startswith("us-east-a")], serve.log()


CLUSTER_SKEWS_MS = {"skew-ahead": 60_000, "skew-behind": -60_000, "skew-none": 0}


def test_cluster_agents_a_minute_off_change_no_health_decision(settings, tmp_path) -> None:
    """Three cluster agents (the real `ClusterAgent`, each under its own cluster identity),
    one whose clock runs a minute ahead, one a minute behind, one on time, beside the health
    fold and its clock: the fold, whose time is the broker's, judges none of them silent; and
    when the agent a minute ahead dies, its cluster is declared lost within the normal bound,
    not a minute late or early. (One heartbeat 40 s ahead used to make the fold evict every
    other cluster.)"""
    import threading

    from fleetline.agents.cluster.agent import ClusterAgent
    from fleetline.processors.health.fold import ClusterHealthPolicy
    from fleetline.processors.health.runtime import ClusterHealthService, health_topics
    from tests.services import running

    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, health_topics(topics))
    policy = ClusterHealthPolicy()
    health = ClusterHealthService(settings.kafka, topics, policy, tick_interval_s=0.3)
    stops = {cluster: threading.Event() for cluster in CLUSTER_SKEWS_MS}

    def skewed(offset_ms: int):
        return lambda: int(time.time() * 1000) + offset_ms

    agents = {
        cluster: ClusterAgent(
            settings, topics, cluster, tmp_path / cluster, clock=skewed(offset_ms)
        )
        for cluster, offset_ms in CLUSTER_SKEWS_MS.items()
    }
    threads = {
        cluster: threading.Thread(target=agent.run, args=(stops[cluster],), daemon=True)
        for cluster, agent in agents.items()
    }

    def states() -> list[dict]:
        return [
            codec.decode(m.value()).record for m in read_topic(settings.kafka, topics.emergency)
        ]

    def heartbeats_of(cluster: str) -> list[dict]:
        return [
            record
            for m in read_topic(settings.kafka, topics.cluster_signals)
            if (record := codec.decode(m.value()).record)["kind"] == "HEARTBEAT"
            and record["cluster_id"] == cluster
        ]

    with running(health):
        for thread in threads.values():
            thread.start()
        try:
            wait_until(
                lambda: all(len(heartbeats_of(c)) >= 8 for c in agents),
                60,
                "eight heartbeats from each agent",
            )
            judged = [h for h in states() if h["state"] != "HEALTHY"]
            assert not judged, judged
            ahead = heartbeats_of("skew-ahead")[-1]["ts"] - int(time.time() * 1000)
            assert ahead > 50_000, ahead  # its own stamps do run a minute ahead
            stops["skew-ahead"].set()
            threads["skew-ahead"].join(30)
            stopped_ms = int(time.time() * 1000)
            lost: list[dict] = []

            def declared() -> bool:
                lost[:] = [
                    h
                    for h in states()
                    if h["cluster_id"] == "skew-ahead" and h["state"] == "UNHEALTHY"
                ]
                return bool(lost)

            wait_until(declared, 30, "the dead agent's cluster declared lost", every_s=0.2)
        finally:
            for stop in stops.values():
                stop.set()
            for thread in threads.values():
                thread.join(30)
    # Declared (broker time) within the silence bound of its last heartbeat, give or take a
    # heartbeat interval and a tick: not a minute late (its last heartbeat's own stamp) or early.
    bound_ms = policy.lost_after_ms + 1_000
    assert lost[0]["silent_ms"] <= bound_ms, lost[0]
    assert lost[0]["ts"] - stopped_ms <= bound_ms, (lost[0]["ts"] - stopped_ms, lost[0])
    others = [h for h in states() if h["cluster_id"] != "skew-ahead" and h["state"] != "HEALTHY"]
    assert not others, others
