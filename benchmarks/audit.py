"""Audit benchmark: append (chain + sign) and verify rates, pure and through Kafka and chdb.

.venv/bin/python benchmarks/audit.py [--events 20000] [--digest-every 100]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid

from _common import local_services, report
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fleetline.app import record_sink
from fleetline.config import Settings
from fleetline.processors.audit.chain import Signer, chain_event, export_entry, verify
from fleetline.processors.audit.runtime import (
    KafkaAuditEmitter,
    audit_chainer,
    new_event,
)
from fleetline.processors.audit.runtime import changelog as audit_changelog
from fleetline.storage.audit_store import AuditTable
from fleetline.storage.clickhouse import connect, migrate
from fleetline.storage.sinks import RecordSink
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.topics import Topics

BASE_MS = 1_796_000_000_000


def events(n: int) -> list[dict]:
    return [
        new_event(
            ts=BASE_MS + i,
            actor=f"user{i % 50}",
            actor_role="user",
            tenant=f"tenant{i % 8}",
            operation="api.GET /v1/nodes",
            target="/v1/nodes",
            outcome="SUCCEEDED",
            status=200,
            details={"query": f"cluster=c{i % 8}"},
        )
        for i in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--digest-every", type=int, default=100)
    args = parser.parse_args()
    signer = Signer(Ed25519PrivateKey.generate())
    keys = {signer.key_id: signer.private_key.public_key()}
    batch = events(args.events)
    figures: dict[str, object] = {"events": args.events, "digest_every": args.digest_every}

    began = time.perf_counter()
    head, records = None, []
    for e in batch:
        head, out = chain_event(head, 0, e, signer, args.digest_every)
        records.extend(out)
    figures["chain_pure_records_per_s"] = len(records) / (time.perf_counter() - began)
    entries = [export_entry(r, reveal_sensitive=True) for r in records]
    began = time.perf_counter()
    result = verify(entries, keys)
    assert result.ok
    figures["verify_pure_records_per_s"] = len(entries) / (time.perf_counter() - began)

    settings = Settings.from_env()
    with local_services(settings) as settings:
        topics = Topics(prefix=f"bench.audit.{uuid.uuid4().hex[:8]}")
        kafka_clients.ensure_topics(settings.kafka, [*topics.specs(), audit_changelog(topics)])
        emitter = KafkaAuditEmitter(settings.kafka, topics)
        began = time.perf_counter()
        for e in batch:
            emitter.emit(e)
        assert emitter.flush(60) == 0
        figures["emit_events_per_s"] = args.events / (time.perf_counter() - began)

        chainer = audit_chainer(settings.kafka, topics, signer, args.digest_every)
        chainer.max_messages = 2000
        stop = threading.Event()
        thread = threading.Thread(target=chainer.run, args=(stop,), daemon=True)
        began = time.perf_counter()
        thread.start()
        while chainer.stats.messages < args.events:
            time.sleep(0.05)
        figures["append_through_kafka_events_per_s"] = args.events / (time.perf_counter() - began)
        stop.set()
        thread.join(60)

        client = connect(f"chdb://{tempfile.mkdtemp(prefix='bench-audit-')}")
        migrate(client, "bench")
        table = AuditTable(client, "bench")
        sink = record_sink(settings, topics, "bench-sink", topics.audit_log, table)
        step = sink.step
        assert isinstance(step, RecordSink)
        stop = threading.Event()
        thread = threading.Thread(target=sink.run, args=(stop,), daemon=True)
        began = time.perf_counter()
        thread.start()
        last, last_change = -1, time.perf_counter()
        while step.stats.records < args.events or time.perf_counter() - last_change < 1.5:
            if step.stats.records != last:
                last, last_change = step.stats.records, time.perf_counter()
            time.sleep(0.05)
        figures["sink_to_chdb_records_per_s"] = step.stats.records / (last_change - began)
        stop.set()
        thread.join(60)
        began = time.perf_counter()
        stored = [export_entry(r, reveal_sensitive=True) for r in table.records()]
        result = verify(stored, keys)
        assert result.ok and result.checked == step.stats.records
        figures["verify_from_chdb_records_per_s"] = len(stored) / (time.perf_counter() - began)
    report("audit", figures)


if __name__ == "__main__":
    main()
