"""Who wrote this record: against the real broker, every kind of credential tries the records it
may not write, and none is applied; each is dead-lettered with its writer and the reason, the
audit chain names the true writer, and `replay --decisions` refuses the same records (a revoked
writer's later ones too) and re-makes every decision byte for byte."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from confluent_kafka import KafkaError, Message

from fleetline.agents.simulator import cluster_info
from fleetline.config import Settings
from fleetline.identity.writers import Writer, WriterKind, WriterRefused
from fleetline.processors.audit.runtime import audit_linker
from fleetline.processors.decision_replay import live_dead_letters
from fleetline.processors.health.runtime import (
    ClusterHealthService,
    health_topics,
    signal,
)
from fleetline.processors.health.runtime import (
    changelog as health_changelog,
)
from fleetline.processors.scheduling.client import job_records, read_state, read_topic, submit
from fleetline.processors.scheduling.codec import canonical_json, new_request
from fleetline.processors.scheduling.runtime import scheduler_topics
from fleetline.processors.view.runtime import ViewProcessor
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import read_dead_letter
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics
from fleetline.streams.writers import publish_identity_event
from tests.fleet_events import scenario_events
from tests.integration.test_scheduler_service import CLUSTERS, replay, scheduling, wait_for
from tests.scheduling_support import training
from tests.services import caught_up, produce, running, snapshot_store, submits
from tests.support import BASE_MS, fresh_topics, wait_until

pytestmark = pytest.mark.services
codec = default_codec()


def now_ms() -> int:
    return int(time.time() * 1000)


class Forger:
    """Writes one record at a time as `writer` (None: with no credential at all) and says
    where it landed."""

    def __init__(self, settings: Settings, writer: Writer | None) -> None:
        kafka = (
            settings.kafka.writing_as(writer)
            if writer is not None
            else dataclasses.replace(settings.kafka, signer=None)
        )
        self.producer = kafka_clients.producer(kafka, {"linger.ms": 0})

    def write(self, topic: str, key: str, record_name: str, record: dict[str, Any]) -> int:
        landed: list[int] = []

        def delivered(error: KafkaError | None, msg: Message) -> None:
            assert error is None, error
            landed.append(msg.offset() or 0)

        self.producer.produce(
            topic, codec.encode(record_name, record), key.encode(), on_delivery=delivered
        )
        assert self.producer.flush(30) == 0 and landed
        return landed[0]


@contextmanager
def control_plane(settings: Settings, topics: Topics) -> Iterator[None]:
    """The view, the scheduler, cluster health and the audit linker, as `serve` runs them."""
    snapshots = snapshot_store(settings)
    view = ViewProcessor(
        settings.kafka, topics, snapshots, group_id=f"v-{uuid.uuid4().hex}", snapshot_interval_s=1
    )
    health = ClusterHealthService(settings.kafka, topics, tick_interval_s=0.3)
    linker = audit_linker(settings.kafka, topics)
    with running(view):
        caught_up(settings, topics, [view])
        with running(health), running(linker), scheduling(settings, topics, view, snapshots):
            yield


def request(kind: str, key: str, tenant: str, **fields: Any) -> dict[str, Any]:
    return new_request(kind, key, tenant, now_ms(), uuid.uuid4().hex, **fields)


def test_no_credential_writes_what_it_may_not_and_the_replay_refuses_the_same(settings):
    topics = fresh_topics()
    kafka_clients.ensure_topics(
        settings.kafka, [*scheduler_topics(topics), health_changelog(topics)]
    )
    assert {s.name for s in health_topics(topics)} >= {topics.identities}
    produce(settings, topics, [("ClusterInfo", cluster_info(c, 1, BASE_MS)) for c in CLUSTERS])
    events = scenario_events(seconds=3)
    produce(settings, topics, events)
    home, other = CLUSTERS[0].cluster_id, CLUSTERS[1].cluster_id
    other_state = next(r for n, r in events if n == "NodeState" and r["cluster_id"] == other)
    home_node = next(r for n, r in events if n == "NodeState" and r["cluster_id"] == home)
    as_cluster = Forger(settings, Writer(WriterKind.CLUSTER, home))
    as_other_cluster = Forger(settings, Writer(WriterKind.CLUSTER, other))
    as_mover = Forger(settings, Writer(WriterKind.MOVER, "mover"))
    as_node = Forger(settings, Writer(WriterKind.NODE, f"{home}/{home_node['node_id']}"))
    as_router = Forger(settings, Writer(WriterKind.ROUTER, "edge"))
    revoked_router = Writer(WriterKind.ROUTER, "retired")
    as_revoked = Forger(settings, revoked_router)
    anonymous = Forger(settings, None)
    policy_before = None

    with control_plane(settings, topics):
        # A job the control plane submits, placed in one cluster: a witness that the folds
        # run, and the run the other cluster will claim.
        submit(settings.kafka, topics, submits(training("placed", workers=1, per_worker=8)))
        placed = wait_for(
            settings,
            topics,
            lambda ds: any(d["job"] == "acme/placed" and d["outcome"] == "PLACED" for d in ds),
        )
        cluster_of_run = next(
            d["placements"][0]["cluster_id"] for d in placed if d["job"] == "acme/placed"
        )
        stranger = other if cluster_of_run == home else home
        as_stranger = as_other_cluster if stranger == other else as_cluster
        policy_before = read_state(settings.kafka, topics).committed(0, b"tenant:acme")
        revoked_at = publish_identity_event(
            settings.kafka, topics, "REVOKE", revoked_router, "tester", "host decommissioned"
        )

        globex = training("spree", tenant="globex")
        forged: dict[tuple[str, int], str] = {
            (
                topics.scheduler_requests,
                as_cluster.write(
                    topics.scheduler_requests,
                    "globex/spree",
                    "SchedulerRequest",
                    request(
                        "SUBMIT",
                        "globex/spree",
                        "globex",
                        spec_json=canonical_json(globex),
                        actor="alice",
                    ),
                ),
            ): f"cluster:{home}#1 may not SUBMIT",
            (
                topics.scheduler_requests,
                as_mover.write(
                    topics.scheduler_requests,
                    "acme",
                    "SchedulerRequest",
                    request(
                        "TENANT_POLICY",
                        "acme",
                        "acme",
                        spec_json=canonical_json({"tenant": "acme", "gpu_quota": 100000}),
                    ),
                ),
            ): "mover:mover#1 may not TENANT_POLICY",
            (
                topics.scheduler_requests,
                as_mover.write(
                    topics.scheduler_requests,
                    "",
                    "SchedulerRequest",
                    request("POLICY", "", "", spec_json=canonical_json({"weights": {}})),
                ),
            ): "mover:mover#1 may not POLICY",
            (
                topics.scheduler_requests,
                as_router.write(
                    topics.scheduler_requests,
                    other_state["node_id"],
                    "SchedulerRequest",
                    request("FENCE", other_state["node_id"], "", detail="drain it"),
                ),
            ): "router:edge#1 may not FENCE",
            (
                topics.scheduler_requests,
                as_stranger.write(
                    topics.scheduler_requests,
                    "acme/placed",
                    "SchedulerRequest",
                    request(
                        "PROGRESS",
                        "acme/placed",
                        "acme",
                        phase="SUCCEEDED",
                        cluster_id=stranger,
                    ),
                ),
            ): f"cluster:{stranger}#1 may not report PROGRESS for a run not ordered to it",
            (
                topics.scheduler_requests,
                anonymous.write(
                    topics.scheduler_requests,
                    "globex/spree",
                    "SchedulerRequest",
                    request("SUBMIT", "globex/spree", "globex", spec_json=canonical_json(globex)),
                ),
            ): "wrote a record with no writer MAC",
            (
                topics.scheduler_requests,
                as_revoked.write(
                    topics.scheduler_requests,
                    "acme/placed",
                    "SchedulerRequest",
                    request("SERVICE_LOAD", "acme/placed", "acme", spec_json="{}"),
                ),
            ): "router:retired#1 was revoked",
            (
                topics.node_state,
                as_node.write(
                    topics.node_state,
                    other_state["node_id"],
                    "NodeState",
                    {**other_state, "seq": other_state["seq"] + 1000, "state": "DOWN"},
                ),
            ): f"may not publish NodeState for node {other_state['node_id']} of cluster {other}",
            (
                topics.cluster_signals,
                as_cluster.write(
                    topics.cluster_signals,
                    other,
                    "ClusterSignal",
                    signal("HEARTBEAT", other, now_ms(), incarnation="forged"),
                ),
            ): f"cluster:{home}#1 may not heartbeat for cluster {other}",
            (
                topics.cluster_signals,
                as_cluster.write(
                    topics.cluster_signals,
                    home,
                    "ClusterSignal",
                    signal("CORDON", home, now_ms(), actor="alice", reason="forged"),
                ),
            ): f"cluster:{home}#1 may not send a CORDON signal",
            (
                topics.workloads,
                as_stranger.write(
                    topics.workloads,
                    "acme/placed",
                    "WorkloadEvent",
                    {
                        "job": "acme/placed",
                        "tenant": "acme",
                        "cluster_id": cluster_of_run,
                        "epoch": 1,
                        "attempt": 1,
                        "ts": now_ms(),
                        "event": "FAILED",
                        "trace_id": "",
                    },
                ),
            ): f"may not report workload events for cluster {cluster_of_run}",
        }

        def refused() -> dict[tuple[str, int], Any]:
            letters = {}
            for msg in read_topic(settings.kafka, topics.dead_letter):
                letter = read_dead_letter(msg)
                letters[(letter.topic, letter.offset)] = letter
            return letters

        letters: dict[tuple[str, int], Any] = {}

        def all_refused() -> bool:
            letters.update(refused())
            return set(forged) <= set(letters)

        wait_until(all_refused, 60, "every forged record dead-lettered")
        for where, reason in forged.items():
            letter = letters[where]
            assert letter.error == "WriterRefused", (where, letter)
            assert reason in letter.reason, (where, letter.reason)
        assert letters[next(iter(forged))].writer == f"cluster:{home}#1"

        # Nothing applied: no globex job, the quota and the policy as they were, the run not
        # ended by a stranger, no node fenced, the other cluster's node not DOWN, nobody cordoned.
        state = read_state(settings.kafka, topics)
        jobs = {j["key"]: j for j in job_records(state)}
        assert "globex/spree" not in jobs
        assert jobs["acme/placed"]["phase"].upper() in ("STARTING", "RUNNING"), jobs["acme/placed"]
        assert state.committed(0, b"tenant:acme") == policy_before
        assert not [
            h
            for h in [
                codec.decode(m.value()).record for m in read_topic(settings.kafka, topics.emergency)
            ]
            if h["kind"] == "CORDON" or (h["cluster_id"] == other and "forged" in str(h))
        ]

        # The audit chain's input names the true writer of each refused record.
        def refusals() -> dict[str, dict[str, Any]]:
            out = {}
            for partition in range(topics.audit_partitions):
                for msg in kafka_clients.read_to_end(
                    settings.kafka, topics.audit_requests, [partition], f"a-{uuid.uuid4().hex}"
                ):
                    event = codec.decode(msg.value()).record
                    if event["operation"] == "record.REFUSED":
                        out[event["target"]] = event
            return out

        audited: dict[str, dict[str, Any]] = {}
        expected_targets = {f"{t}/0/{o}" for t, o in forged}

        def all_audited() -> bool:
            audited.update(refusals())
            return expected_targets <= set(audited)

        wait_until(all_audited, 60, "every refusal in the audit log")
        submit_target = next(f"{t}/0/{o}" for (t, o), r in forged.items() if "SUBMIT" in r)
        assert audited[submit_target]["actor"] == f"cluster:{home}#1"
        assert audited[submit_target]["details"]["claimed_actor"] == "alice"

    live = live_dead_letters(
        settings.kafka, topics, f"{topics.prefix}.scheduler", topics.scheduler_requests
    )
    replayed = replay(settings, topics, snapshot_store(settings))
    assert replayed.ok, replayed.first_difference
    assert replayed.dead_letters == live, (replayed.dead_letters, live)
    refused_requests = {o for t, o in forged if t == topics.scheduler_requests}
    assert refused_requests <= set(replayed.dead_letters)
    assert revoked_at > 0


def test_enrol_revoke_and_enrol_again_as_an_operator_would(settings, tmp_path) -> None:
    """`fleetline enroll issue` hands a host its credentials (owner-only, never the root);
    `revoke` refuses them from then on; issuing again gives the next generation."""
    import json
    import os
    import subprocess
    import sys

    from fleetline.identity.keys import read_credentials
    from fleetline.streams.writers import replay_gate
    from tests.services import service_env

    topics = fresh_topics()
    env = {**os.environ, **service_env(settings)}

    def fleetline(*args: str) -> str:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "fleetline.cli",
                "enroll",
                *args,
                "--topic-prefix",
                topics.prefix,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    first = tmp_path / "edge.json"
    assert "enrolled cluster:edge-a#1" in fleetline(
        "issue", "cluster", "edge-a", "--out", str(first)
    )
    assert first.stat().st_mode & 0o777 == 0o600
    held = json.loads(first.read_text())
    assert [c["writer"] for c in held] == ["cluster:edge-a#1"] and "root" not in first.read_text()
    old = read_credentials(first).credentials[0]
    assert "revoked cluster:edge-a" in fleetline(
        "revoke", "cluster", "edge-a", "--reason", "stolen"
    )
    second = tmp_path / "edge2.json"
    assert "enrolled cluster:edge-a#2" in fleetline(
        "issue", "cluster", "edge-a", "--out", str(second)
    )
    listed = fleetline("list")
    assert "cluster:edge-a  generation 2  revoked up to 1" in listed, listed
    new = read_credentials(second).credentials[0]

    # Both write now: the revoked generation's record is refused, the new one's accepted.
    stale = Forger(settings, old.writer)
    fresh = Forger(settings, new.writer)
    signal_record = signal("HEARTBEAT", "edge-a", now_ms())
    at_old = stale.write(topics.cluster_signals, "edge-a", "ClusterSignal", signal_record)
    at_new = fresh.write(topics.cluster_signals, "edge-a", "ClusterSignal", signal_record)
    gate = replay_gate(settings.kafka, topics)
    messages = {m.offset(): m for m in read_topic(settings.kafka, topics.cluster_signals)}
    with pytest.raises(WriterRefused, match=r"revoked.*stolen"):
        gate.writer_of(messages[at_old])
    assert gate.writer_of(messages[at_new]) == new.writer
