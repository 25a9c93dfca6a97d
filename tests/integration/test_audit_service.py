"""The audit log against the real broker, chdb and the S3 server: chaining with exactly-once
effect, the ClickHouse and archive sinks, tampering caught by `audit verify`, search and export
through the CLI, tenant-scoped search through the API."""

from __future__ import annotations

import base64
import json
import os
import threading
from contextlib import contextmanager

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.testclient import TestClient

from fleetline.api.app import create_app
from fleetline.api.auth import AuthConfig, Authenticator, token_digest
from fleetline.app import record_sink
from fleetline.cli import main
from fleetline.processors.audit.chain import Signer, export_entry, verify
from fleetline.processors.audit.runtime import (
    AUDIT_EVENT,
    KafkaAuditEmitter,
    audit_chainer,
    new_event,
    read_chain,
)
from fleetline.processors.audit.runtime import changelog as audit_changelog
from fleetline.processors.view.read import StaticView
from fleetline.storage.audit_store import AuditArchive, AuditTable
from fleetline.storage.clickhouse import migrate
from fleetline.storage.crypto import ObjectCipher, SealedObjectStore
from fleetline.storage.objects import ObjectStore
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from tests.fleet_events import fold
from tests.support import BASE_MS, fresh_topics, read_all, wait_until

pytestmark = pytest.mark.services
TENANTS = ("acme", "globex")


@contextmanager
def running(*workers):
    stop = threading.Event()
    threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    try:
        for worker in workers:
            assert worker.ready.wait(60)
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


def events(n: int, start: int = 0) -> list[dict]:
    return [
        new_event(
            ts=BASE_MS + i * 1000,
            actor=f"user{i % 3}",
            actor_role="user",
            tenant=TENANTS[i % 2],
            operation="api.GET /v1/allocations",
            target="/v1/allocations",
            outcome="SUCCEEDED",
            status=200,
            details={"query": f"page={i}", "api_token": f"tok-{i}-secret"},
        )
        for i in range(start, start + n)
    ]


def wait_rows(
    table: AuditTable, count: int, archive: AuditArchive | None = None, timeout_s: float = 60
) -> None:
    """Until `count` event links are stored in the table (and the archive, if given): a
    digest lands with the event that triggers it."""

    def events_in(entries) -> int:
        return sum(1 for e in entries if e.get("event"))

    wait_until(
        lambda: (
            sum(1 for r in table.records() if r["event"]) >= count
            and (archive is None or events_in(archive.entries()) >= count)
        ),
        timeout_s,
        what=f"{count} audit events in every store",
    )


@pytest.fixture
def audit_env(settings, clickhouse, tmp_path, monkeypatch):
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, [*topics.specs(), audit_changelog(topics)])
    migrate(clickhouse, settings.clickhouse_database)
    key_path = tmp_path / "signing-key.pem"
    from fleetline.processors.audit.runtime import load_signer

    signer = load_signer(key_path, create=True)
    secret = base64.b64encode(os.urandom(32)).decode()
    for name, value in {
        "FLEETLINE_KAFKA_BOOTSTRAP": settings.kafka.bootstrap_servers,
        "FLEETLINE_S3_ENDPOINT": settings.s3.endpoint,
        "FLEETLINE_S3_BUCKET": settings.s3.bucket,
        "FLEETLINE_CLICKHOUSE_URL": settings.clickhouse_url,
        "FLEETLINE_CLICKHOUSE_DATABASE": settings.clickhouse_database,
        "FLEETLINE_AUDIT_SIGNING_KEY": str(key_path),
        "FLEETLINE_OBJECT_ENCRYPTION_KEY": secret,
    }.items():
        monkeypatch.setenv(name, value)
    store = ObjectStore.from_settings(settings.s3)
    store.ensure_bucket()
    archive = AuditArchive(
        SealedObjectStore(store, ObjectCipher.from_base64(secret)), f"audit/{topics.prefix}"
    )
    table = AuditTable(clickhouse, settings.clickhouse_database)
    return topics, signer, table, archive


def sinks(settings, topics, table, archive):
    return [
        record_sink(settings, topics, f"audit-{d.name}", topics.audit_log, d, convert)
        for d, convert in (
            (table, None),
            (archive, lambda r: export_entry(r, reveal_sensitive=True)),
        )
    ]


def chain_and_sink(
    settings, audit_env, count: int, digest_every: int = 4, signer: Signer | None = None
) -> None:
    """Emit `count` events, chain them and sink them until all are in the table."""
    topics, real_signer, table, archive = audit_env
    emitter = KafkaAuditEmitter(settings.kafka, topics)
    for event in events(count):
        emitter.emit(event)
    assert emitter.flush() == 0
    with running(
        audit_chainer(settings.kafka, topics, signer or real_signer, digest_every=digest_every),
        *sinks(settings, topics, table, archive),
    ):
        wait_rows(table, count, archive)


def test_chained_exactly_once_across_a_restart_and_sunk_everywhere(settings, audit_env):
    topics, signer, table, archive = audit_env
    keys = {signer.key_id: signer.private_key.public_key()}
    emitter = KafkaAuditEmitter(settings.kafka, topics)
    for event in events(30):
        emitter.emit(event)
    assert emitter.flush() == 0
    with running(
        audit_chainer(settings.kafka, topics, signer, digest_every=5),
        *sinks(settings, topics, table, archive),
    ):
        wait_rows(table, 30)
    # The chainer restarts (a new instance, its head restored from the changelog) and goes on.
    for event in events(20, start=30):
        emitter.emit(event)
    assert emitter.flush() == 0
    with running(
        audit_chainer(settings.kafka, topics, signer, digest_every=5),
        *sinks(settings, topics, table, archive),
    ):
        wait_rows(table, 50, archive)
    chain = read_chain(settings.kafka, topics)
    assert sum(1 for r in chain if r["event"]) == 50
    assert len(list(table.records())) == len(chain)
    for source in (chain, list(table.records())):
        report = verify([export_entry(r, True) for r in source], keys)
        assert report.ok and report.checked == len(chain), report.first_broken
        assert report.digests >= 6
    archived = list(archive.entries())
    assert len(archived) == len(chain) and verify(archived, keys).ok
    # The archive is encrypted at rest: no plaintext in the stored objects.
    raw = archive.objects.store
    blobs = b"".join(raw.get(k) for k in raw.keys(f"{archive.root}/"))
    assert b"tok-" not in blobs and b"user1" not in blobs


@pytest.mark.parametrize("tamper", ["edit", "delete", "insert", "reorder"])
def test_tampering_with_the_clickhouse_copy_is_caught_by_audit_verify(
    settings, audit_env, clickhouse, capsys, tamper
):
    table = audit_env[2]
    chain_and_sink(settings, audit_env, 12)
    prefix = ["--topic-prefix", audit_env[0].prefix]
    assert main(["audit", "verify", "--source", "clickhouse", *prefix]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    db = f"{settings.clickhouse_database}.audit_log"
    victim = next(r for r in table.records() if r["event"] and r["seq"] == 2)
    p = victim["partition"]
    sync = "SETTINGS mutations_sync = 1"
    if tamper == "edit":
        clickhouse.command(
            f"ALTER TABLE {db} UPDATE actor = 'mallory' WHERE partition = {p} AND seq = 2 {sync}"
        )
    elif tamper == "delete":
        clickhouse.command(f"ALTER TABLE {db} DELETE WHERE partition = {p} AND seq = 2 {sync}")
    elif tamper == "insert":
        clickhouse.command(f"INSERT INTO {db} SELECT * FROM {db} WHERE partition = {p} AND seq = 2")
    else:  # seq is a sorting key column and cannot be updated in place: move the rows
        tmp = f"{settings.clickhouse_database}.swapped"
        clickhouse.command(f"CREATE TABLE {tmp} AS {db}")
        clickhouse.command(
            f"INSERT INTO {tmp} SELECT * REPLACE (if(seq = 1, 2, 1) AS seq) "
            f"FROM {db} WHERE partition = {p} AND seq IN (1, 2)"
        )
        clickhouse.command(
            f"ALTER TABLE {db} DELETE WHERE partition = {p} AND seq IN (1, 2) {sync}"
        )
        clickhouse.command(f"INSERT INTO {db} SELECT * FROM {tmp}")
    assert main(["audit", "verify", "--source", "clickhouse", *prefix]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert report["first_broken"].startswith(f"partition {p} seq ")
    expected = {
        "edit": "edited",
        "delete": "missing (deleted)",
        "insert": "inserted or reordered",
        "reorder": "prev_hash",
    }[tamper]
    assert expected in report["first_broken"]


def test_search_and_exports_are_tenant_scoped_and_masked(settings, audit_env, tmp_path, capsys):
    topics, table = audit_env[0], audit_env[2]
    chain_and_sink(settings, audit_env, 16)
    assert main(["audit", "search", "--tenant", "acme", "--source", "clickhouse"]) == 0
    found = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(found) == 8 and {f["tenant"] for f in found} == {"acme"}
    assert all(f["details"]["api_token"] == "***" for f in found)
    for fmt in ("jsonl", "csv", "parquet"):
        out = tmp_path / f"acme.{fmt}"
        assert (
            main(
                [
                    "audit",
                    "export",
                    "--tenant",
                    "acme",
                    "--format",
                    fmt,
                    "--out",
                    str(out),
                    "--source",
                    "clickhouse",
                    "--topic-prefix",
                    topics.prefix,
                    "--to-s3",
                    f"exports/{topics.prefix}/a.{fmt}",
                ]
            )
            == 0
        )
        capsys.readouterr()
        body = out.read_bytes()
        assert b"secret" not in body and b"globex" not in body
        assert main(["audit", "verify", "--file", str(out)]) == 0, capsys.readouterr()
        assert json.loads(capsys.readouterr().out)["ok"] is True
    uploaded = ObjectStore.from_settings(settings.s3).get(f"exports/{topics.prefix}/a.parquet")
    assert uploaded.startswith(b"FLC1")  # client-side AES-GCM
    # Each export is itself audited: who took how much of whose records, and where to.
    codec = default_codec()
    requests = [
        codec.decode(m.value(), expect=AUDIT_EVENT).record
        for m in read_all(settings, topics.audit_requests, 16 + 3)
    ]
    exports = [r for r in requests if r["operation"] == "audit.export"]
    assert [e["target"] for e in exports] == [
        f"exports/{topics.prefix}/a.{fmt}" for fmt in ("jsonl", "csv", "parquet")
    ]
    assert {(e["tenant"], e["source"], e["details"]["revealed"]) for e in exports} == {
        ("acme", "cli", "false")
    }
    assert all(int(e["details"]["links"]) >= 8 for e in exports)
    # The API's search holds each tenant to its own records.
    tokens = [
        {"name": "u", "sha256": token_digest("fl_u"), "role": "user", "tenant": "acme"},
        {"name": "ta", "sha256": token_digest("fl_ta"), "role": "tenant-admin", "tenant": "acme"},
        {"name": "aud", "sha256": token_digest("fl_aud"), "role": "auditor"},
    ]
    app = create_app(
        StaticView(fold([])),
        Authenticator(AuthConfig.from_data({"tokens": tokens})),
        KafkaAuditEmitter(settings.kafka, topics),
        table,
    )

    def get(token: str, **params):
        return TestClient(app, headers={"Authorization": f"Bearer {token}"}).get(
            "/v1/audit", params=params
        )

    assert get("fl_u").status_code == 403  # users do not read audit records
    mine = get("fl_ta").json()["items"]
    assert {r["tenant"] for r in mine} == {"acme"} and len(mine) == 8
    assert get("fl_ta", tenant="globex").status_code == 403
    everyone = get("fl_aud", limit=100).json()["items"]
    assert {r["tenant"] for r in everyone} == {"acme", "globex"}
    assert "tok-" not in json.dumps(everyone)


def test_a_forged_chain_without_the_key_fails_against_the_pinned_key(
    settings, audit_env, monkeypatch, tmp_path, capsys
):
    topics = audit_env[0]
    chain_and_sink(
        settings, audit_env, 6, digest_every=3, signer=Signer(Ed25519PrivateKey.generate())
    )
    # Signed by a key this verifier does not trust (the pinned one is the real signer's).
    assert main(["audit", "verify", "--topic-prefix", topics.prefix]) == 2
    assert "unknown key" in json.loads(capsys.readouterr().out)["first_broken"]


def test_chains_of_another_deployment_in_the_same_table_are_kept_apart(
    settings, audit_env, clickhouse, capsys
):
    topics, _, table, _ = audit_env
    chain_and_sink(settings, audit_env, 6)
    db = f"{settings.clickhouse_database}.audit_log"
    # Another run's chain with the same partitions and seqs (as `fleetline run` leaves them).
    clickhouse.command(
        f"INSERT INTO {db} SELECT * REPLACE ('fleetline.other.audit.log' AS source_topic) FROM {db}"
    )
    assert len(list(table.records())) == 2 * len(list(table.records(topic=topics.audit_log)))
    assert main(["audit", "verify", "--source", "clickhouse", "--topic-prefix", topics.prefix]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
