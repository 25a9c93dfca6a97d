"""Scenarios played end to end on the real services (the README's story and its stages):
agents -> Kafka -> the resource view and ClickHouse, snapshots in S3, a replay of the half-way
view, the API, the audit chain, and the scheduler's decisions replayed byte for byte."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fleetline.app import sealed_objects
from fleetline.cli import main
from fleetline.demo import scenario
from fleetline.demo.play import play
from fleetline.demo.verdict import story_steps
from fleetline.processors.view import codec as view_codec
from fleetline.streams import kafka as kafka_clients
from tests.services import service_env
from tests.support import after_now_ms, fresh_topics

pytestmark = pytest.mark.services


def test_the_default_scenario_flows_end_to_end(settings) -> None:
    topics = fresh_topics()
    played = scenario.load("default").sized(nodes=2, ticks=6)
    # Event time ends now, as `fleetline run` plays it: the scheduler's and the operations
    # rules' detections are then on one clock with the faults (the postmortem's delays).
    start_ms = (after_now_ms() // 1000 - played.ticks - 1) * 1000
    result = play(settings, played, start_ms=start_ms, realtime=False, topics=topics)
    # 3 clusters x 2 nodes; the last node goes down at tick 4 and reports no more.
    assert result.states_sent == 7
    assert result.telemetry_sent == 6 * 6 - 3
    assert result.processor_dead_letters == 1 and result.sink_dead_letters == 1
    assert result.sink_rows == result.telemetry_sent * 8
    now = {c["cluster_id"]: c for c in result.clusters}
    # RDMA loss behind eu-west-a's leaf switch, XID 79 on one us-east-a GPU, a node down;
    # the jobs the slice submitted hold some of the rest (communication-heavy ones never on
    # the degraded GPUs).
    assert (now["eu-west-a"]["degraded"], now["eu-west-a"]["idle"]) == (16, 0)
    assert now["us-east-a"]["failed"] == 1
    assert now["us-east-a"]["idle"] + now["us-east-a"]["allocated"] == 15
    assert (now["ap-south-a"]["nodes_down"], now["ap-south-a"]["unavailable"]) == (1, 8)
    assert now["eu-west-a"]["info"]["price_per_gpu_hour"] == 2.40
    assert sorted(
        (g["node_id"], g["gpu_index"], g["cause"])
        for g in result.unhealthy_gpus
        if g["health"] == "failed"
    ) == [("us-east-a-n0000", 3, "xid 79")]
    # Half-way, before the node went down, replayed from snapshots and the log.
    then = {c["cluster_id"]: c for c in result.half_way_clusters}
    assert then["ap-south-a"]["nodes_down"] == 0
    assert then["ap-south-a"]["idle"] + then["ap-south-a"]["allocated"] == 16
    # eu-west-a's 16 GPUs are all behind the lossy leaf: degraded, unless a job that tolerates
    # a lossy fabric (acme/story, communication light) holds some of them by then.
    assert then["eu-west-a"]["degraded"] + then["eu-west-a"]["allocated"] == 16
    assert then["eu-west-a"]["idle"] == 0
    assert {r[0]: r[1] for r in result.query_rows} == {
        "ap-south-a": (6 + 3) * 8,
        "eu-west-a": 12 * 8,
        "us-east-a": 12 * 8,
    }
    assert len(result.snapshots) == 4  # three shards and the fleet part
    parts = []
    for url in result.snapshots:
        bucket, key = url.removeprefix("s3://").split("/", 1)
        assert bucket == settings.s3.bucket
        # Sealed with the deployment's key, as `serve` seals them.
        parts.append(view_codec.decode(sealed_objects(settings).get(key)))
    assert sum(p.node_events for p in parts) == result.states_sent + result.telemetry_sent
    # One ClusterInfo per cluster, the scheduler's dataset record and its allocation records.
    assert sum(p.fleet_events for p in parts) >= 3 + 1 + 1
    # Every job the slice submitted was decided, and the decision log replays byte for byte.
    decided = {d[1] for d in result.scheduling["decisions"]}
    assert {"acme/pretrain", "acme/chat", "ops/urgent", "dataset:web-corpus"} <= decided
    # Self-healing: the GPU that fell off the bus and the node that lost power each opened a
    # repair ticket (the node is cordoned and drained until a burn-in returns it).
    tickets = {(t[1], t[2]) for t in result.scheduling["operations"]["tickets"]}
    assert ("us-east-a-n0000", "gpu_failed") in tickets, tickets
    assert ("ap-south-a-n0001", "node_silent") in tickets, tickets
    replay = result.scheduling["replay"]
    assert replay["ok"] and replay["matched"] == replay["decisions"] == len(
        result.scheduling["decisions"]
    )
    # The cluster running acme/story went dark: it was declared lost within seconds, the job
    # resumed elsewhere from its last checkpoint, the copy left behind was fenced when the
    # cluster returned, and the final parameters equal an uninterrupted run's.
    story = result.cluster_story
    assert story["identical"] and story["fenced"], story
    assert story["resumed_in"] != story["lost"]
    assert story["resumed_at"] >= story["checkpoint_step"] > 0
    assert story["detected_s"] <= 5.0 and story["resumed_after_s"] <= 15.0, story
    assert story["last_step"] == 600 and story["reported_steps"] == 60
    # One trace id follows the job from its submission through both clusters, in ClickHouse.
    assert set(story["trace"]["clusters"]) >= {story["lost"], story["resumed_in"]}
    assert story["trace"]["hops"] >= 8
    # The API, called as a tenant's viewer, and every call in a verified audit chain.
    assert result.api_calls == [
        ("/v1/clusters", 200),
        ("/v1/allocations?tenant=globex", 403),
        ("/v1/clusters", 401),
    ]
    assert result.audit["ok"] and result.audit["links"] >= 3
    # Every decision is in the chain too, with the digest of its bytes on the decisions topic.
    audited = result.scheduling["audited"]
    assert audited["decisions"] == len(result.scheduling["decisions"])
    assert audited["missing"] == audited["changed"] == [], audited
    # The run's postmortem, from the log and the tiers alone, tells what the scenario did:
    # the GPU that fell off the bus at tick 3 and the rule that caught it, the node that lost
    # power, the cluster lost under acme/story and how long its detection took, the job's
    # move from its checkpoint, and the audit chain verified with the digests signing it.
    report = result.postmortem["report"]
    faults = {(f["kind"], f["subject"]): f for f in report["faults"]}
    xid = faults[("xid", "us-east-a-n0000/3")]
    assert xid["at_ms"] == start_ms + 3 * 1000, xid
    assert "us-east-a-n0000" in xid["detected_by"] or "gpu_failed" in xid["detected_by"], xid
    # (Played faster than real time, the scheduler decides seconds of wall time after the
    # telemetry's event time: the delay is what the log says, not the GPU's.)
    assert xid["detection_s"] == (xid["detected_ms"] - xid["at_ms"]) / 1000 >= 0, xid
    assert xid["detection_s"] <= 60, xid
    assert ("node_down", "ap-south-a-n0001") in faults, sorted(faults)
    lost = faults[("cluster_lost", story["lost"])]
    assert lost["detected_by"].startswith("cluster health fold"), lost
    assert abs(lost["detection_s"] - story["detected_s"]) <= 1.0, (lost, story["detected_s"])
    (moved,) = [j for j in report["impact"]["jobs"] if j["job"] == "acme/story"]
    assert moved["ran_in"][-2:] == [story["lost"], story["resumed_in"]], moved
    (move,) = [m for m in moved["moves"] if m["fault"] == f"cluster_lost {story['lost']}"]
    assert (move["from"], move["to"]) == (story["lost"], story["resumed_in"]), move
    assert move["resumed_at_step"] == story["resumed_at"], move
    assert move["steps_redone"] == move["last_step_before"] - story["resumed_at"] >= 0, move
    assert move["checkpoint"], move
    assert abs(move["recovery_s"] - story["resumed_after_s"]) <= 2.0, (move, story)
    assert report["audit"]["ok"] and report["audit"]["digests_named"], report["audit"]
    assert any(
        a["operation"] == "decision.PREEMPTED" and a["target"] == "acme/story"
        for a in report["actions"]
    )
    for kind in ("json", "md", "html"):
        assert Path(result.postmortem["files"][kind]).stat().st_size > 0
    assert json.loads(Path(result.postmortem["files"]["json"]).read_text()) == report
    # The compressed serving day needs 3 whole nodes for its training: on 2-node clusters it
    # says why it is skipped (tests/e2e/test_serving.py plays serving on the real stack).
    assert "acme/tidal does not fit" in result.serving_day["skipped"], result.serving_day
    # So of the story's steps, the serving day alone did not happen, and says why.
    missed = [s for s in story_steps(result, played) if not s.happened]
    assert [s.name for s in missed] == [
        "the serving day scaled its service out and in, and lost no request"
    ], missed
    assert "acme/tidal does not fit" in missed[0].cause


def test_cli_sql_and_bad_input(settings, monkeypatch, capsys) -> None:
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    monkeypatch.setenv("FLEETLINE_CLICKHOUSE_URL", settings.clickhouse_url)
    monkeypatch.setenv("FLEETLINE_KAFKA_BOOTSTRAP", settings.kafka.bootstrap_servers)
    prefix = ["--topic-prefix", topics.prefix]
    assert main(["sql", "SELECT 40 + 2 AS answer", *prefix]) == 0
    assert capsys.readouterr().out.splitlines() == ["answer", "42"]
    assert main(["sql", "SELECT no_such_column FROM (SELECT 1 AS a)", *prefix]) == 1
    assert "fleetline: error:" in capsys.readouterr().err
    # A prefix nothing ran under is said as such, not as a minute's wait for a topic's end.
    assert main(["get", "jobs", "--topic-prefix", f"{topics.prefix}-never"]) == 1
    assert "scheduler.state.changelog does not exist" in capsys.readouterr().err


def test_another_process_queries_the_embedded_store_through_its_owner(settings) -> None:
    import os
    import subprocess
    import sys

    from fleetline.storage.clickhouse import connect
    from fleetline.storage.query_service import DISCOVERY_FILE, QueryService
    from fleetline.tls import pinned_client

    owner = connect(settings.clickhouse_url)
    db = settings.clickhouse_database
    owner.command(f"CREATE DATABASE {db}")
    owner.command(f"CREATE TABLE {db}.kept (v UInt8) ENGINE = MergeTree ORDER BY v")
    service = QueryService(
        owner, settings.clickhouse_url, database=settings.clickhouse_database
    ).start()
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    env = {
        **os.environ,
        "FLEETLINE_CLICKHOUSE_URL": settings.clickhouse_url,
        "FLEETLINE_KAFKA_BOOTSTRAP": settings.kafka.bootstrap_servers,
    }
    prefix = ["--topic-prefix", topics.prefix]
    try:
        ok = subprocess.run(
            [sys.executable, "-m", "fleetline.cli", "sql", "SELECT 6 * 7 AS x", *prefix],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        bad = subprocess.run(
            [sys.executable, "-m", "fleetline.cli", "sql", f"DROP TABLE {db}.kept", *prefix],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        # Reaching the address is not enough: the token is in the owner-only discovery file.
        discovery = Path(settings.clickhouse_url.removeprefix("chdb://")) / DISCOVERY_FILE
        assert discovery.stat().st_mode & 0o777 == 0o600
        anonymous = urllib.request.Request(
            f"{service.address}/query", data=b"SELECT 1", method="POST"
        )
        pinned = pinned_client(json.loads(discovery.read_text())["certificate"])
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(anonymous, timeout=10, context=pinned)
        assert refused.value.code == 401
        # TLS, with the certificate of this start: unknown to anyone without the file, and
        # plain HTTP gets no answer.
        assert service.address.startswith("https://")
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(anonymous, timeout=10)
        plain = service.address.replace("https://", "http://")
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"{plain}/query", data=b"SELECT 1", timeout=10)
    finally:
        service.stop()
    assert (ok.returncode, ok.stdout.splitlines()) == (0, ["x", "42"]), ok.stderr
    assert bad.returncode == 1 and "only SELECT" in bad.stderr, bad.stderr
    assert owner.query(f"EXISTS TABLE {db}.kept").result_rows == [(1,)]


def test_a_story_step_that_did_not_happen_makes_fleetline_run_exit_non_zero_naming_it(
    settings, monkeypatch, capsys
) -> None:
    """`fleetline run` tells the truth: a scenario whose job cannot start ends with the steps
    that did not happen, each with its real cause (the job's last failure), then "N of M story
    steps as scripted", and exits 1 after its whole summary."""
    topics = fresh_topics()
    env = {
        **service_env(settings),
        "FLEETLINE_CLICKHOUSE_URL": settings.clickhouse_url,
        "FLEETLINE_CLICKHOUSE_DATABASE": settings.clickhouse_database,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    story = Path(__file__).parent.parent / "scenarios" / "a-job-that-cannot-start.yaml"
    argv = ["run", "--scenario", str(story), "--external-services", "--no-realtime"]
    code = main([*argv, "--topic-prefix", topics.prefix])
    out, err = capsys.readouterr()
    assert code == 1, (out[-3000:], err[-2000:])
    tail = out.strip().splitlines()[-3:]
    assert tail[0].startswith(
        "NOT AS SCRIPTED: every job ran without exhausting its attempts: acme/broken failed: "
    ), tail
    assert "/nonexistent/trainer" in tail[0], tail
    assert tail[1].startswith("NOT AS SCRIPTED: the cluster running acme/broken was lost"), tail
    assert "acme/broken failed:" in tail[1], tail
    assert tail[2] == "5 of 7 story steps as scripted", tail
    # The rest of the story (the API, the audit chain, the decision replay) still ran and
    # printed, and the one line on stderr says why the exit is not 0.
    assert "decision replay:" in out and "audit log:" in out
    assert "2 of 7 story steps did not happen as scripted" in err, err
