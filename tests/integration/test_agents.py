"""Node agents against the real broker: partitioning, spool replay across a broker outage,
and the command round trip."""

from __future__ import annotations

from pathlib import Path

from confluent_kafka import KafkaError

from fleetline.agents.fleet import FleetAgent
from fleetline.agents.simulator import ClusterSpec, FleetSimulator
from fleetline.infra import LocalServices
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import read_dead_letter
from fleetline.streams.partitioner import partition_for
from fleetline.streams.serde import default_codec
from tests.support import BASE_MS, first_occurrences, fresh_topics, read_all, wait_until

codec = default_codec()


def fleet() -> FleetSimulator:
    return FleetSimulator(
        [ClusterSpec("c1", "eu-west", 2), ClusterSpec("c2", "us-east", 2)], seed=21
    )


def test_our_partitioner_matches_the_clients(settings) -> None:
    topics = fresh_topics(partitions=6)
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    producer = kafka_clients.producer(settings.kafka)
    seen: dict[bytes, int] = {}

    def report(err: KafkaError | None, msg) -> None:
        assert err is None
        seen[msg.key()] = msg.partition()

    keys = [f"node-{i}".encode() for i in range(200)] + [b"", b"a", b"ab", b"abc", b"abcd"]
    for key in keys:
        producer.produce(topics.telemetry, key=key, value=b"x", on_delivery=report)
    producer.flush(30)
    assert {key: partition_for(key, 6) for key in keys} == seen


def test_spool_replays_in_order_after_a_broker_outage(settings, tmp_path: Path) -> None:
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    agent = FleetAgent.create(
        settings, codec, topics, fleet(), tmp_path, commands=False, message_timeout_ms=3000
    )
    agent.start(BASE_MS)
    for tick in range(1, 4):
        agent.tick(BASE_MS + tick * 1000)
    agent.flush()

    broker = LocalServices.from_settings(settings).kafka
    broker.stop()
    try:
        for tick in range(4, 10):  # the broker is gone: collection goes on into the spool
            agent.tick(BASE_MS + tick * 1000)

        def timed_out() -> bool:  # the sends outlast message.timeout.ms and fail
            for publisher in agent.publishers.values():
                publisher.pump(0.05)
            return all(p.metrics.failed_deliveries for p in agent.publishers.values())

        wait_until(timed_out, 30, what="the sends to time out")
        metrics = agent.spool_metrics()
        assert sum(m["records"] for m in metrics.values()) >= 6 * 4
    finally:
        broker.start()
    for tick in range(10, 12):
        agent.tick(BASE_MS + tick * 1000)
    agent.flush(120)
    agent.close()

    by_node = first_occurrences(read_all(settings, topics.telemetry, 11 * 4, timeout_s=60))
    state_messages = read_all(settings, topics.node_state, 2 * 4)
    states = first_occurrences(state_messages)
    heartbeats = [
        r for r in (codec.decode(m.value()).record for m in state_messages) if r["ts"] > BASE_MS
    ]  # not the start states, sent before anything was spooled
    assert len({h["node_id"] for h in heartbeats}) == 4
    # The heartbeat after the outage reports the spool: it held records, and dropped none.
    assert all(h["agent_spool_dropped"] == 0 and h["agent_spool_bytes"] > 0 for h in heartbeats)
    # Every node's 11 telemetry records arrived, in the order collected (repeats, if any, come
    # after), and with its NodeStates (start, heartbeat) no seq is missing.
    assert sorted(by_node) == sorted(n.node_id for n in agent.simulator.nodes)
    for node_id, seqs in by_node.items():
        assert len(seqs) == 11 and seqs == sorted(seqs), (node_id, seqs)
        assert sorted(seqs + states[node_id]) == list(range(1, max(seqs) + 1)), node_id
    assert sum(p.metrics.rewinds for p in agent.publishers.values()) >= 1  # sends timed out
    metrics = agent.spool_metrics()
    assert metrics and all(m["records"] == 0 and m["dropped"] == 0 for m in metrics.values())


def test_a_cluster_link_loss_holds_that_cluster_in_its_spool(settings, tmp_path: Path) -> None:
    from fleetline.agents.simulator import Fault

    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    sim = FleetSimulator(
        [ClusterSpec("c1", "eu-west", 2), ClusterSpec("c2", "us-east", 2)],
        seed=3,
        faults=[Fault("cluster_link_loss", "c2", BASE_MS + 1000, BASE_MS + 4000)],
    )
    agent = FleetAgent.create(settings, codec, topics, sim, tmp_path, commands=False)
    agent.start(BASE_MS)
    for tick in range(1, 4):
        agent.tick(BASE_MS + tick * 1000)

    def held(cluster: str) -> int:
        return sum(
            e.topic == topics.telemetry for e in agent.publishers[cluster].spool.entries_from(0)
        )

    assert held("c2") == 3 * 2  # all of it held while the link is down
    assert agent.publishers["c2"].metrics.delivered <= 2  # at most the start states went out
    for tick in range(4, 6):
        agent.tick(BASE_MS + tick * 1000)
    agent.flush()
    by_node = first_occurrences(read_all(settings, topics.telemetry, 5 * 4))
    assert len(by_node) == 4, by_node
    assert all(seqs == list(range(2, 7)) for seqs in by_node.values()), by_node
    assert sum(len(p.spool) for p in agent.publishers.values()) == 0


def send_commands(settings, topics, commands) -> None:
    producer = kafka_clients.producer(settings.kafka)
    for command in commands:
        value = command if isinstance(command, bytes) else codec.encode("NodeCommand", command)
        key = b"c1-n0000" if isinstance(command, bytes) else command["node_id"].encode()
        producer.produce(topics.commands, key=key, value=value)
    producer.flush(30)


def command(command_id: str, node: str, kind: str, **fields) -> dict:
    return {
        "command_id": command_id,
        "cluster_id": node.rsplit("-", 1)[0],
        "node_id": node,
        "ts": BASE_MS,
        "issued_by": "test",
        "kind": kind,
        "power_cap_w": None,
        "config_version": None,
        "config": {},
        **fields,
    }


def test_commands_round_trip_with_results(settings, tmp_path: Path) -> None:
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    send_commands(
        settings,
        topics,
        [
            command("cmd-1", "c1-n0000", "CORDON"),
            command("cmd-2", "c2-n0001", "SET_POWER_CAP", power_cap_w=300.0),
            command("cmd-3", "c1-n0000", "SET_POWER_CAP", power_cap_w=5000.0),
            command(
                "cmd-4", "c1-n0001", "APPLY_CONFIG", config_version="v7", config={"colour": "blue"}
            ),
            command("cmd-1", "c1-n0000", "CORDON"),
            b"not a command",
            command("cmd-5", "c1-n0001", "DRAIN"),
        ],
    )
    agent = FleetAgent.create(settings, codec, topics, fleet(), tmp_path)
    agent.start(BASE_MS)
    ticks = [0]

    def handled() -> bool:
        ticks[0] += 1
        agent.tick(BASE_MS + ticks[0] * 1000)
        assert agent.commands is not None
        return agent.commands.handled >= 6

    wait_until(handled, 60, what="the agent to handle its commands", every_s=0.2)
    tick = ticks[0]
    agent.tick(BASE_MS + (tick + 1) * 1000)
    agent.flush()
    agent.close()

    results = [
        codec.decode(m.value()).record for m in read_all(settings, topics.command_results, 6)
    ]
    outcomes = [(r["command_id"], r["outcome"]) for r in results]
    assert sorted(outcomes) == sorted(
        [
            ("cmd-1", "APPLIED"),
            ("cmd-2", "APPLIED"),
            ("cmd-3", "REJECTED"),
            ("cmd-4", "REJECTED"),
            ("cmd-1", "DUPLICATE"),
            ("cmd-5", "APPLIED"),
        ]
    )
    by_id = {(r["command_id"], r["outcome"]): r for r in results}
    assert "colour" in by_id[("cmd-4", "REJECTED")]["message"]
    assert by_id[("cmd-5", "APPLIED")]["node_state"] == "DRAINING"
    assert by_id[("cmd-1", "APPLIED")]["cordoned"] is True

    letters = [read_dead_letter(m) for m in read_all(settings, topics.dead_letter, 1)]
    assert letters[0].value == b"not a command"

    telemetry = [codec.decode(m.value()).record for m in read_all(settings, topics.telemetry, 4)]
    capped = [r for r in telemetry if r["node_id"] == "c2-n0001" and r["ts"] > BASE_MS + 1000]
    assert capped and all(
        g["power_limit_w"] == 300.0 and g["power_w"] <= 300.0
        for r in capped[-1:]
        for g in r["gpus"]
    )
    states = [codec.decode(m.value()).record for m in read_all(settings, topics.node_state, 4)]
    drained = [s for s in states if s["node_id"] == "c1-n0001"][-1]
    assert drained["state"] == "DRAINING"
    cordoned = [s for s in states if s["node_id"] == "c1-n0000"][-1]
    assert cordoned["labels"]["cordoned"] == "true"

    # A restarted agent resumes after the committed commands and keeps their effects: the
    # first command it handles is the one sent after the restart.
    again = FleetAgent.create(settings, codec, topics, fleet(), tmp_path)
    send_commands(settings, topics, [command("cmd-6", "c2-n0000", "CORDON")])
    ticks = iter(range(50, 10_000))

    def handled_one() -> bool:
        again.tick(BASE_MS + next(ticks) * 1000)
        assert again.commands is not None
        return again.commands.handled >= 1

    wait_until(handled_one, 60, what="the restarted agent's first command", every_s=0.2)
    assert again.commands is not None and again.commands.handled == 1
    assert again.controls.get("c2-n0000").cordoned
    assert again.controls.get("c1-n0000").cordoned
    assert again.simulator.power_limit("c2-n0001") == 300.0
    again.close()


def test_the_simulated_agents_serve_dcgm_metrics(settings, tmp_path) -> None:
    """`fleetline agent simulator --metrics-port 0`: /metrics shows each GPU under the DCGM
    exporter's names with a value the agent sent for it, and the spool's depth per cluster."""
    import os
    import subprocess
    import sys
    import uuid
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    from tests.services import service_env

    topics = fresh_topics()
    log = tmp_path / "agent.log"
    command = [sys.executable, "-m", "fleetline.cli", "agent", "simulator", "--clusters", "1"]
    command += ["--nodes", "2", "--ticks", "60", "--topic-prefix", topics.prefix]
    command += ["--state-dir", str(tmp_path / "state"), "--metrics-port", "0"]
    with open(log, "wb") as out:
        agent = subprocess.Popen(
            command, env={**os.environ, **service_env(settings)}, stdout=out, stderr=out
        )
    try:
        wait_until(lambda: "metrics at " in log.read_text(), 30, "the metrics endpoint")
        url = log.read_text().split("metrics at ", 1)[1].split()[0]

        def scrape() -> dict:
            with urlopen(url, timeout=10) as response:
                text = response.read().decode()
            return {f.name: f.samples for f in text_string_to_metric_families(text)}

        wait_until(lambda: scrape().get("DCGM_FI_DEV_GPU_UTIL"), 30, "GPU gauges")
        families = scrape()
        shown = {
            (s.labels["Hostname"], s.labels["gpu"]): s.value
            for s in families["DCGM_FI_DEV_GPU_UTIL"]
        }
        assert len(shown) == 16  # two nodes of eight GPUs
        sent: dict[tuple[str, str], list[float]] = {}

        def delivered() -> bool:
            sent.clear()
            every = kafka_clients.partitions_of(settings.kafka, topics.telemetry)
            reader = f"check-{uuid.uuid4().hex}"
            for message in kafka_clients.read_to_end(
                settings.kafka, topics.telemetry, every, reader, 30
            ):
                record = codec.decode(message.value()).record
                for g in record["gpus"]:
                    key = (record["node_id"], str(g["gpu_index"]))
                    sent.setdefault(key, []).append(g["gpu_util_pct"])
            # Avro floats are 32-bit: the gauge shows the reading before it was encoded.
            return all(
                any(abs(value - v) < 1e-3 for v in sent.get(gpu, ()))
                for gpu, value in shown.items()
            )

        # Each gauge shows a sample the agent sent for that GPU (delivered within seconds).
        wait_until(delivered, 30, "the samples shown to be on the telemetry topic", every_s=1)
        assert set(shown) == set(sent)
        clusters = {s.labels["cluster"] for s in families["DCGM_FI_DEV_GPU_UTIL"]}
        depth = families["fleetline_agent_spool_depth"]
        assert {s.labels["cluster"] for s in depth} == clusters and all(s.value >= 0 for s in depth)
    finally:
        agent.terminate()
        agent.wait(30)


def test_the_simulator_shares_its_clusters_among_processes(settings, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    topics = fresh_topics()
    command = [
        sys.executable,
        "-m",
        "fleetline.cli",
        "agent",
        "simulator",
        *("--clusters", "4", "--nodes", "2", "--processes", "2", "--ticks", "3"),
        *("--interval-ms", "100", "--topic-prefix", topics.prefix, "--state-dir", str(tmp_path)),
    ]
    env = {**os.environ, "FLEETLINE_KAFKA_BOOTSTRAP": settings.kafka.bootstrap_servers}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # Two processes, each with every other cluster and its own spool and state.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-0", "part-1"]
    assert done.stdout.count("4 simulated nodes: 3 intervals") == 2, done.stdout
    records = [codec.decode(m.value()).record for m in read_all(settings, topics.telemetry, 24)]
    by_cluster: dict[str, set[str]] = {}
    for record in records:
        by_cluster.setdefault(record["cluster_id"], set()).add(record["node_id"])
    assert sorted(by_cluster) == ["ap-south-a", "eu-west-a", "eu-west-b", "us-east-a"]
    assert all(len(nodes) == 2 for nodes in by_cluster.values())
    assert len(records) == 24  # 8 nodes x 3 intervals, each once
