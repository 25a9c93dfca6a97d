"""The resource view against the real broker and S3 server: snapshots, the live processor, a
SIGKILL mid-stream, replay at a past time, instances sharing the load, dead letters."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import time
import uuid

import pytest

from fleetline.app import Options, build
from fleetline.errors import ObjectMissing
from fleetline.processors import replay as replay_module
from fleetline.processors.replay import ViewHistory, log_bounds, offsets_at, rebuild, walk
from fleetline.processors.view import codec as view_codec
from fleetline.processors.view.fold import compose
from fleetline.processors.view.folder import FLEET_PART, shard_part
from fleetline.processors.view.runtime import ViewProcessor
from fleetline.processors.view.snapshots import ViewSnapshots
from fleetline.storage.crypto import SealedObjectStore
from fleetline.storage.objects import ObjectStore
from fleetline.storage.snapshots import SnapshotStore
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import read_dead_letter
from fleetline.streams.serde import default_codec
from tests.fleet_events import allocation, scenario_events
from tests.services import (
    caught_up,
    produce,
    running,
    serve_command,
    service_env,
    serving_api,
    signed_in,
    snapshot_store,
    started,
)
from tests.support import BASE_MS, after_now_ms, fresh_topics, read_all, wait_until

pytestmark = pytest.mark.services
CODEC = default_codec()


def test_live_view_equals_replay_and_replay_at_a_past_time_matches_the_live_view(
    settings, monkeypatch
):
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    events = scenario_events(seconds=30)
    half = len(events) // 2
    snapshots = snapshot_store(settings)
    processor = ViewProcessor(
        settings.kafka, topics, snapshots, group_id=f"v-{uuid.uuid4().hex}", snapshot_interval_s=0.5
    )
    with running(processor):
        produce(settings, topics, events[:half])
        produce(settings, topics, [allocation("job-a", "ALLOCATED", [("us-east-a-n0002", 0)], 1)])
        caught_up(settings, topics, [processor])
        live_then = processor.read(view_codec.to_data)
        moment = after_now_ms()
        produce(settings, topics, events[half:])
        # A malformed message on the telemetry topic: dead-lettered, the fold goes on.
        producer = kafka_clients.producer(settings.kafka)
        producer.produce(topics.telemetry, key=b"us-east-a-n0000", value=b"\xc3\x01garbage")
        producer.flush(10)
        caught_up(settings, topics, [processor])
        live_now = processor.read(view_codec.to_data)
        # The view's offsets move as a batch is folded; the loop counts the batch (its dead
        # letter among it) once its transaction has committed, a moment later.
        wait_until(lambda: processor.loop.stats.dead_letters == 1, 30, "the dead letter counted")

    at_moment = rebuild(settings.kafka, topics, offsets_at(settings.kafka, topics, moment))
    assert view_codec.to_data(at_moment.view) == live_then
    assert at_moment.snapshot_positions == {}
    # The API's time travel: the same view, from the newest snapshots at or before the moment.
    history = ViewHistory(settings.kafka, topics, snapshots)
    then, as_of = history.at(moment)
    assert then.read(view_codec.to_data) == live_then
    assert as_of.offsets == offsets_at(settings.kafka, topics, moment)
    assert as_of.at_ms == moment and as_of.from_snapshots
    assert history.at(moment)[0].view is then.view  # a position's view is rebuilt once
    _, end = log_bounds(settings.kafka, topics)
    from_log = rebuild(settings.kafka, topics, end)
    assert view_codec.to_data(from_log.view) == live_now
    assert from_log.dead_letters == 1
    with_snapshots = rebuild(settings.kafka, topics, end, snapshots)
    assert view_codec.to_data(with_snapshots.view) == live_now
    assert with_snapshots.snapshot_positions  # started from snapshots, not the beginning
    assert with_snapshots.folded < from_log.folded
    # Folded in two processes, each its own partitions (the parts with a snapshot stay here).
    monkeypatch.setattr(replay_module, "PARALLEL_FROM", 0)
    in_parallel = rebuild(settings.kafka, topics, end, workers=2)
    assert view_codec.to_data(in_parallel.view) == live_now
    assert (in_parallel.folded, in_parallel.dead_letters) == (from_log.folded, 1)
    resumed = rebuild(settings.kafka, topics, end, snapshots, workers=2)
    assert view_codec.to_data(resumed.view) == live_now
    # Between the moment and the end, the node the scenario took down came back.
    _, changes = walk(settings.kafka, topics, offsets_at(settings.kafka, topics, moment), end)
    assert [(c.entity_id, c.before, c.after) for c in changes if c.entity == "node"] == [
        ("ap-south-a-n0003", "DOWN", "UP")
    ]
    (dead,) = read_all(settings, topics.dead_letter, 1)
    letter = read_dead_letter(dead)
    assert letter.topic == topics.telemetry and "fingerprint" in letter.reason


def test_two_instances_share_the_shards_and_compose_the_global_view(settings):
    topics = fresh_topics(partitions=4)
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    events = scenario_events(seconds=12)
    root = f"views/test-{uuid.uuid4().hex[:8]}"
    group = f"v-{uuid.uuid4().hex}"
    processors = [
        ViewProcessor(
            settings.kafka,
            topics,
            snapshot_store(settings, root),
            group_id=group,
            instance_id=str(i),
            snapshot_interval_s=0.5,
        )
        for i in range(2)
    ]
    with running(processors[0]), running(processors[1]):
        produce(settings, topics, events)

        def shared() -> bool:
            held = [
                set(p.read(lambda v: list(v.offsets.get(topics.telemetry, {})))) for p in processors
            ]
            return bool(
                held[0] and held[1] and not held[0] & held[1] and len(held[0] | held[1]) == 4
            )

        wait_until(shared, 60, what="the two instances to share the shards")
        caught_up(settings, topics, processors)
        shards = [set(p.parts) - {FLEET_PART} for p in processors]
        assert shards[0] and shards[1] and not shards[0] & shards[1]
        assert shards[0] | shards[1] == {shard_part(p) for p in range(4)}
        views = [p.read(lambda v: v) for p in processors]
        composed = view_codec.to_data(compose(views))
    _, end = log_bounds(settings.kafka, topics)
    assert composed == view_codec.to_data(rebuild(settings.kafka, topics, end).view)


def test_sigkill_mid_stream_then_restart_equals_a_clean_replay(settings, tmp_path):
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    group = f"v-{uuid.uuid4().hex[:10]}"
    root = f"views/{topics.prefix}/{group}"
    snapshots = snapshot_store(settings, root)
    env = {**os.environ, **service_env(settings, tmp_path / "chdb", killed_members=True)}
    command = serve_command(topics.prefix, group, "--snapshot-interval", "0.3")
    events = scenario_events(seconds=40)
    produce(settings, topics, events[: len(events) // 3])
    log = (tmp_path / "serve.log").open("w")
    first = subprocess.Popen(command, env=env, stdout=log, stderr=log)
    try:
        wait_until(lambda: snapshots.list(shard_part(0)), 60, what="the first snapshot")
        middle = events[len(events) // 3 : 2 * len(events) // 3]
        produce(settings, topics, middle)
        # Killed mid-stream: once it has folded some of the middle third, not all of it.
        first_snapshots = {p: snapshots.latest(shard_part(p)) for p in range(3)}
        wait_until(
            lambda: any(snapshots.latest(shard_part(p)) != first_snapshots[p] for p in range(3)),
            60,
            what="a snapshot of the middle third",
        )
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    produce(settings, topics, events[2 * len(events) // 3 :])
    _, end = log_bounds(settings.kafka, topics)
    second = subprocess.Popen(command, env=env, stdout=log, stderr=log)
    try:

        def at_the_end() -> bool:
            latest = [snapshots.latest(shard_part(p)) for p in range(3)]
            return all(
                info is not None
                and all(info.offsets.get(t, {}).get(p, 0) == end[t][p] for t in topics.node_topics)
                for p, info in enumerate(latest)
            )

        wait_until(at_the_end, 90, what="the restarted instance's snapshots at the log's end")
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(60)
    restored = compose(snapshots.load(snapshots.latest(shard_part(i))) for i in range(3))
    node_end = {t: ps for t, ps in end.items() if t in topics.node_topics}
    clean = rebuild(settings.kafka, topics, node_end)
    assert view_codec.to_data(restored) == view_codec.to_data(clean.view)
    assert clean.view.node_events == len(events)
    assert clean.view.watermark_ms > BASE_MS


def test_view_and_replay_commands(settings, monkeypatch, capsys, tmp_path):
    import json

    from fleetline.cli import main

    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    events = scenario_events(seconds=12)
    produce(settings, topics, events[: len(events) // 2])
    moment = after_now_ms()
    produce(settings, topics, events[len(events) // 2 :])
    for name, value in service_env(settings).items():
        monkeypatch.setenv(name, value)
    common = ["--topic-prefix", topics.prefix, "--group", f"g-{uuid.uuid4().hex[:6]}"]
    assert main(["view", "gpus", "--health", "failed", "--json", *common]) == 0
    failed = json.loads(capsys.readouterr().out)
    assert [(g["node_id"], g["gpu_index"], g["cause"]) for g in failed] == [
        ("eu-west-a-n0002", 5, "xid 79")
    ]
    assert main(["view", "nodes", "--status", "DOWN", *common]) == 0
    header, _, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["node", "cluster", "status"]
    assert [row.split()[:3] for row in rows] == [["ap-south-a-n0003", "ap-south-a", "DOWN"]]
    out = tmp_path / "view.json"
    assert main(["replay", "--at", str(moment), "--out", str(out), *common]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["folded"] < len(events)
    assert set(json.loads(out.read_text())["nodes"]) <= {r["node_id"] for _, r in events}
    assert (
        main(
            [
                "replay",
                "--from",
                str(moment),
                "--to",
                str(int(time.time() * 1000)),
                "--json",
                *common,
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines and all(line["ts"] >= BASE_MS for line in lines)
    assert main(["replay", "--at", "yesterday-ish", *common]) == 1
    assert "neither epoch milliseconds nor an ISO 8601 time" in capsys.readouterr().err
    assert main(["view", "clusters", "--topic-prefix", "no.such.prefix"]) == 1
    assert "does not exist" in capsys.readouterr().err


class PrunedAfterListing(ObjectStore):
    """`serve` pruning a part's snapshots between a reader's listing and its reads: the newest
    manifest of each listing, and the first blob read of each part, are gone when read."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner.client, inner.bucket)
        self.pruned_blobs: set[str] = set()

    def keys(self, prefix: str = "") -> list[str]:
        keys = super().keys(prefix)
        manifests = sorted(k for k in keys if k.endswith(".manifest.json"))
        if manifests:
            self.delete(manifests[-1])
        return keys

    def get(self, key: str) -> bytes:
        part = key.rsplit("/", 2)[-2]
        if key.endswith(".view.json.gz") and part not in self.pruned_blobs:
            self.pruned_blobs.add(part)
            self.delete(key)
        return super().get(key)


def test_replay_goes_on_when_the_live_process_prunes_the_snapshot_it_picked(settings):
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    snapshots = snapshot_store(settings)
    processor = ViewProcessor(
        settings.kafka,
        topics,
        snapshots,
        group_id=f"v-{uuid.uuid4().hex}",
        snapshot_interval_s=3600,  # only the snapshots taken below
    )
    events = scenario_events(seconds=8)
    quarter = len(events) // 4
    with running(processor):
        for chunk in range(4):  # four snapshots of each shard, so older ones are there to use
            produce(settings, topics, events[chunk * quarter : (chunk + 1) * quarter])
            caught_up(settings, topics, [processor])
            processor.snapshot()
        live = processor.read(view_codec.to_data)
    shards = {part for part in processor.parts if len(snapshots.list(part)) >= 3}
    assert shards
    _, end = log_bounds(settings.kafka, topics)
    sealed = snapshots.blobs.store
    assert isinstance(sealed, SealedObjectStore)
    store = PrunedAfterListing(sealed.store)
    racing = ViewSnapshots(
        SnapshotStore(SealedObjectStore(store, sealed.cipher), snapshots.blobs.root)
    )
    replayed = rebuild(settings.kafka, topics, end, racing)
    assert view_codec.to_data(replayed.view) == live
    # The newest manifest went after the listing and the next snapshot's blob before its read:
    # each shard started from the one before those, and said so.
    assert shards <= set(replayed.snapshot_positions)
    assert store.pruned_blobs >= shards
    for part in shards:
        (note,) = [n for n in replayed.notes if n.startswith(f"{part}:")]
        assert "pruned while it was read; using an older one" in note


def test_operators_declare_clusters_with_apply_and_the_view_folds_them(
    settings, monkeypatch, capsys
):
    from fleetline.cli import main
    from fleetline.processors.scheduling.capacity import observe

    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    for name, value in service_env(settings).items():
        monkeypatch.setenv(name, value)
    clusters = "tests/specs/clusters.yaml"
    assert main(["validate", "-f", clusters]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "Cluster eu-west-a: valid",
        "Cluster us-east-a: valid",
    ]
    # Declared through the API by a platform admin, refused to anyone else.
    fleet = build(settings, Options(topics=topics, scheduler=False, audit=False, data_mover=False))
    with started(fleet), serving_api(fleet) as url:
        signed_in(monkeypatch, url, "ana")
        assert main(["apply", "-f", clusters]) == 77
        assert "role tenant-admin may not write fleet" in capsys.readouterr().err
        signed_in(monkeypatch, url, "ops")
        assert main(["apply", "-f", clusters]) == 0
        assert "cluster:eu-west-a: declared" in capsys.readouterr().out
        _, end = log_bounds(settings.kafka, topics)
        facts = observe(rebuild(settings.kafka, topics, end).view).clusters
        assert (facts["eu-west-a"].kind, facts["eu-west-a"].pue) == ("ON_PREMISES", 1.25)
        assert facts["us-east-a"].price_per_gpu_hour == 2.10
        assert facts["us-east-a"].link_latency_ms == {
            "us-east": 0.5,
            "eu-west": 75,
            "ap-south": 190,
        }
        # A later declaration replaces the earlier one; a cluster is never deleted, only retired.
        retired = "apiVersion: fleetline/v1\nkind: Cluster\nmetadata: {name: us-east-a}\n"
        retired += "spec: {region: us-east, retired: true}\n"
        monkeypatch.setattr("sys.stdin", io.StringIO(retired))
        assert main(["apply", "-f", "-"]) == 0
        _, end = log_bounds(settings.kafka, topics)
        assert observe(rebuild(settings.kafka, topics, end).view).clusters["us-east-a"].health == (
            "retired"
        )
        assert main(["delete", "-f", clusters]) == 1
        assert "applying it with `retired: true`" in capsys.readouterr().err


def test_with_an_encryption_key_the_view_snapshots_are_sealed(settings):
    import base64
    import dataclasses

    from fleetline.app import view_snapshots
    from fleetline.storage.crypto import MAGIC
    from tests.fleet_events import fold

    key = base64.b64encode(os.urandom(32)).decode()
    sealed = dataclasses.replace(settings, object_encryption_key=key)
    prefix = f"sealed-{uuid.uuid4().hex[:8]}"
    snapshots = view_snapshots(sealed, prefix)
    view = fold(scenario_events(seconds=2))
    view.advance("t", 0, 9)
    info = snapshots.save("shard-000", view)
    raw = ObjectStore.from_settings(settings.s3)
    stored = [raw.get(k) for k in raw.keys(f"views/{prefix}/")]
    assert len(stored) == 2 and all(blob.startswith(MAGIC) for blob in stored)
    assert view_codec.to_data(snapshots.load(info)) == view_codec.to_data(view)


def test_serve_seals_its_snapshots_with_the_deployment_key_it_makes_on_first_start(
    settings, tmp_path
):
    import dataclasses

    from fleetline.app import view_snapshots
    from fleetline.storage.crypto import MAGIC

    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    group = f"v-{uuid.uuid4().hex[:10]}"
    produce(settings, topics, scenario_events(seconds=2))
    env = {**os.environ, **service_env(settings, tmp_path / "chdb")}
    del env["FLEETLINE_OBJECT_ENCRYPTION_KEY"]  # a deployment given no key: serve makes one
    env["FLEETLINE_CACHE_DIR"] = str(tmp_path / "cache")
    raw = ObjectStore.from_settings(settings.s3)
    command = serve_command(topics.prefix, group, "--snapshot-interval", "0.3")
    with (tmp_path / "serve.log").open("w") as log:
        serve = subprocess.Popen(command, env=env, stdout=log, stderr=log)
        try:
            # Shard 0's own snapshot, whole (its manifest): another shard's may come first.
            shard = f"views/{topics.prefix}/{group}/{shard_part(0)}/"

            def snapshot_made() -> bool:
                try:
                    return any(k.endswith(".manifest.json") for k in raw.keys(shard))
                except ObjectMissing:  # the bucket, until serve makes it
                    return False

            wait_until(snapshot_made, 60, what="shard 0's snapshot")
        finally:
            serve.send_signal(signal.SIGTERM)
            serve.wait(60)
    assert "objects sealed with the deployment key" in (tmp_path / "serve.log").read_text()
    made = dataclasses.replace(settings, cache_dir=tmp_path / "cache", object_encryption_key=None)
    key_file = made.deployment_key_path()
    assert key_file.stat().st_mode & 0o777 == 0o600
    stored = [raw.get(k) for k in raw.keys(f"views/{topics.prefix}/{group}/")]
    assert stored and all(blob.startswith(MAGIC) for blob in stored)
    # Opened with the key serve made, the snapshots hold the view of the events it folded.
    snapshots = view_snapshots(made.with_deployment_key(create=False), topics.prefix, group)
    latest = snapshots.latest(shard_part(0))
    assert latest is not None and snapshots.load(latest).node_events > 0
