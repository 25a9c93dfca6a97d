"""SIGKILL loops on the processes while node agents stream and jobs arrive, on the replicated
cluster: `fleetline serve` (the view, the scheduler, the ClickHouse sinks, the audit linker and
chainer, automated operations) and the node agents' process. Afterwards nothing the agents
collected is missing, no row is in ClickHouse twice by its natural key, the view the killed
processors left (their snapshots plus the log) equals a clean fold of the whole log, every
decision is re-made byte for byte and is in the verified audit chain."""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid

from fleetline.agents.simulator import cluster_info, default_clusters
from fleetline.app import view_snapshots
from fleetline.cli import main
from fleetline.processors.audit.chain import export_entry, verify
from fleetline.processors.audit.runtime import load_signer, read_chain
from fleetline.processors.audit.sources import unaudited_decisions
from fleetline.processors.replay import log_bounds, rebuild
from fleetline.processors.scheduling.client import submit
from fleetline.processors.scheduling.runtime import scheduler_topics
from fleetline.processors.view import codec as view_codec
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from tests.chaos.conftest import rounds
from tests.chaos.faults import Child, scalars_from_clickhouse, wait_decided, wait_lag_drained
from tests.scheduling_support import training
from tests.services import produce, serve_command, service_env, submits
from tests.support import BASE_MS, fresh_topics, read_all, wait_until

codec = default_codec()
CLUSTERS = default_clusters(3)[:2]
NODES = 6


def node_agents(prefix: str, state_dir) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fleetline.cli",
        "agent",
        "simulator",
        "--clusters",
        "2",
        "--nodes",
        "3",
        "--interval-ms",
        "200",
        "--topic-prefix",
        prefix,
        "--state-dir",
        str(state_dir),
    ]


def test_sigkill_loops_lose_repeat_and_change_nothing(replicated, tmp_path, monkeypatch) -> None:
    settings = dataclasses.replace(replicated, clickhouse_url=f"chdb://{tmp_path / 'chdb'}")
    topics = fresh_topics(partitions=6)
    kafka_clients.ensure_topics(settings.kafka, scheduler_topics(topics))
    produce(settings, topics, [("ClusterInfo", cluster_info(c, 1, BASE_MS)) for c in CLUSTERS])
    env = {
        **service_env(settings, tmp_path / "chdb", killed_members=True),
        "FLEETLINE_AUDIT_SIGNING_KEY": str(tmp_path / "signing-key.pem"),
        "FLEETLINE_CLICKHOUSE_DATABASE": settings.clickhouse_database,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    group = f"v-{uuid.uuid4().hex[:8]}"
    serve = Child(
        serve_command(
            topics.prefix, group, "--tick-interval", "0.3", "--snapshot-interval", "1", audit=True
        ),
        env,
        tmp_path / "serve.log",
    )
    agents = Child(node_agents(topics.prefix, tmp_path / "agent"), env, tmp_path / "agents.log")
    spool = tmp_path / "agent" / "spool"
    submitted = 0
    try:
        for victim in [serve, agents] * rounds(1, 4):
            for _ in range(4):  # jobs keep arriving, a few seconds apart
                submitted += 1
                doc = training(f"j{submitted}", per_worker=2, tensor=2, tenant="globex")
                submit(settings.kafka, topics, submits(doc))
                time.sleep(1.5)
            victim.kill_and_restart()
        time.sleep(3)
        # The restarted agents have sent something (a SIGTERM before they set their handler,
        # still importing under load, would end them as the signal's default does).
        restarted = time.time()
        wait_until(
            lambda: any(a.stat().st_mtime > restarted for a in spool.glob("*/acked")),
            60,
            what="the restarted agents to send",
        )
        agents.stop()  # collection ends; the agents' spool has been handed over on the way
        assert agents.proc.returncode == 0, agents.log()
        wait_lag_drained(settings, f"{topics.prefix}.{group}", topics.node_topics)
        decided = wait_decided(settings, topics, {f"globex/j{i}" for i in range(1, submitted + 1)})

        def chained() -> bool:
            events = [r["event"] for r in read_chain(settings.kafka, topics) if r["event"]]
            return unaudited_decisions(events, decided) == ([], [])

        wait_until(chained, 120, what="every decision in the audit chain", every_s=1)
    finally:
        agents.stop()
        serve.stop()
    assert serve.kills == agents.kills == rounds(1, 4)

    # Nothing the agents collected is missing: a node's telemetry and states share one
    # sequence, and it has no gap (a record sent again after a kill repeats a number).
    _, end = log_bounds(settings.kafka, topics)
    by_node: dict[str, set[int]] = {}
    logged: dict[str, set[tuple[str, int]]] = {}  # the records each table stores, by key
    for topic, table in ((topics.telemetry, "gpu_samples"), (topics.node_state, "node_states")):
        for msg in read_all(settings, topic, sum(end[topic].values()), timeout_s=90):
            record = codec.decode(msg.value()).record
            by_node.setdefault(record["node_id"], set()).add(record["seq"])
            keys = logged.setdefault(table, set())
            if table == "node_states":
                keys.add((record["node_id"], record["seq"]))
            else:
                keys |= {
                    (f"{record['node_id']}/{g['gpu_index']}", record["seq"]) for g in record["gpus"]
                }
    assert len(by_node) == NODES
    for node_id, seqs in by_node.items():
        assert seqs == set(range(1, max(seqs) + 1)), (node_id, set(range(1, max(seqs))) - seqs)

    # The view the killed processors left (newest snapshots plus the log after them) is the
    # view a clean fold of the whole log makes.
    snapshots = view_snapshots(settings, topics.prefix, group)
    from_snapshots = rebuild(settings.kafka, topics, end, snapshots)
    clean = rebuild(settings.kafka, topics, end)
    assert from_snapshots.snapshot_positions, "the processors left no snapshot"
    assert view_codec.to_data(from_snapshots.view) == view_codec.to_data(clean.view)

    # No row twice in ClickHouse by its natural key, once every sink has stored every record
    # of its log (a positive witness that it reached the log's end: a record stored twice
    # after a kill is stored again on the way there, never after).
    db = settings.clickhouse_database
    natural_keys = {
        "gpu_samples": "node_id, gpu_index, seq",
        "scheduling_decisions": "decision_id",
        "audit_log": "partition, seq",
        "node_states": "node_id, seq",
    }
    expected = {
        "gpu_samples": len(logged["gpu_samples"]),
        "scheduling_decisions": len(decided),
        "audit_log": len(read_chain(settings.kafka, topics)),
        "node_states": len(logged["node_states"]),
    }

    def stored() -> dict[str, int]:
        figures = scalars_from_clickhouse(
            settings.clickhouse_url,
            [f"SELECT uniqExact({key}) FROM {db}.{table}" for table, key in natural_keys.items()],
        )
        return dict(zip(natural_keys, figures, strict=True))

    wait_until(lambda: stored() == expected, 60, f"every record stored: {expected}", every_s=1)
    figures = scalars_from_clickhouse(
        settings.clickhouse_url,
        [
            f"SELECT count() - uniqExact({key}) FROM {db}.{table}"
            for table, key in natural_keys.items()
        ]
        + [f"SELECT count() FROM {db}.{table}" for table in natural_keys],
    )
    duplicated = dict(zip(natural_keys, figures[: len(natural_keys)], strict=True))
    assert duplicated == dict.fromkeys(natural_keys, 0)
    count = dict(zip(natural_keys, figures[len(natural_keys) :], strict=True))
    assert count["scheduling_decisions"] == len(decided)
    assert count["gpu_samples"] >= 8 * len(by_node) and count["audit_log"] >= len(decided)

    # Every decision re-made byte for byte; the audit chain verifies with the signing key.
    prefix = ["--topic-prefix", topics.prefix]
    assert main(["replay", "--decisions", "--group", group, *prefix]) == 0
    signer = load_signer(tmp_path / "signing-key.pem")
    report = verify(
        [export_entry(r, reveal_sensitive=True) for r in read_chain(settings.kafka, topics)],
        {signer.key_id: signer.private_key.public_key()},
    )
    assert report.ok, report.first_broken
