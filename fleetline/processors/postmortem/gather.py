"""Reading one window of the log and the tiers for a postmortem (`report.py` builds it).

From Kafka: the clusters' health (the emergency topic), the dead letters, the routers' load
reports (the scheduler's requests) and the whole audit chain, verified from its genesis. From
the tiers, through the query macros (`$samples`, `$node_states`, ...: hot, warm or cold, as the
window's rows now lie): GPU faults, node states, repair tickets, decisions, workload events and
utilisation. Nothing is read from a process's memory, so a postmortem written a month later
says what one written the same day says.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from clickhouse_connect.driver.client import Client

from fleetline.config import KafkaSettings, Settings
from fleetline.errors import ConfigError, DecodeError
from fleetline.processors.audit.chain import export_entry, verify
from fleetline.processors.audit.runtime import read_chain
from fleetline.processors.postmortem.report import IncidentLog, Scope, build, check
from fleetline.storage.objects import ObjectStore
from fleetline.storage.query_service import QueryResult
from fleetline.storage.tiering.loop import tiered_stores
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import read_dead_letter
from fleetline.streams.events import CLUSTER_HEALTH, SCHEDULER_REQUEST
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics

# An analyst query: SQL with tier macros in, its columns and rows out.
Query = Callable[[str], QueryResult]
# Points per utilisation line over the window.
POINTS = 60


def _rows(sql: Query, query: str) -> list[dict[str, Any]]:
    result = sql(query)
    return [dict(zip(result.columns, row, strict=True)) for row in result.rows]


def incident_report(
    kafka: KafkaSettings,
    topics: Topics,
    sql: Query,
    from_ms: int,
    to_ms: int,
    scope: Scope,
    public_keys: Mapping[str, Any],
) -> dict[str, Any]:
    """The report of the window (`report.build`), or ConfigError for a window it could say
    nothing true of (`report.check`)."""
    log = gather(kafka, topics, sql, from_ms, to_ms, scope, public_keys)
    check(log)
    return build(log)


def unread_cold(client: Client, settings: Settings, from_ms: int, to_ms: int) -> None:
    """ConfigError, naming them, when cold archives of the window are not restored: a
    postmortem must not say nothing happened where the rows are only out of reach."""
    stores = tiered_stores(
        client, settings.clickhouse_database, ObjectStore.from_settings(settings.s3), settings.s3
    )
    missing = sorted(
        f"{name} {m.partition}"
        for name, store in stores.items()
        for m in store.unrestored(from_ms, to_ms)
    )
    if missing:
        raise ConfigError(
            f"the window's rows in {len(missing)} cold archive(s) ({', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}) are not restored: `fleetline archive restore "
            f"--from {from_ms} --to {to_ms} --table NAME` for each, then ask again"
        )


def gather(
    kafka: KafkaSettings,
    topics: Topics,
    sql: Query,
    from_ms: int,
    to_ms: int,
    scope: Scope,
    public_keys: Mapping[str, Any],
) -> IncidentLog:
    if to_ms <= from_ms:
        raise ConfigError(f"the window ends ({to_ms}) before it begins ({from_ms})")
    log = IncidentLog(from_ms, to_ms, scope)
    r = f"{from_ms}, {to_ms}"
    step = max((to_ms - from_ms) // POINTS, 1000)
    log.xids = _rows(
        sql,
        f"SELECT cluster_id, node_id, gpu_index, xid, min(t) AS first_ms FROM ("
        f" SELECT cluster_id, node_id, gpu_index, arrayJoin(xid_codes) AS xid,"
        f" toUnixTimestamp64Milli(ts) AS t FROM $samples({r}) WHERE length(xid_codes) > 0)"
        " GROUP BY cluster_id, node_id, gpu_index, xid ORDER BY first_ms, node_id, gpu_index",
    )
    log.utilisation = _rows(
        sql,
        f"SELECT intDiv(toUnixTimestamp64Milli(ts), {step}) * {step} AS t_ms, cluster_id,"
        " avg(gpu_util_pct) AS util, uniqExact(node_id, gpu_index) AS gpus,"
        " uniqExact(if(length(xid_codes) > 0, concat(node_id, '/', toString(gpu_index)), ''))"
        " - 1 AS bad"
        f" FROM $samples({r}) GROUP BY t_ms, cluster_id ORDER BY t_ms, cluster_id",
    )
    for row in log.utilisation:
        row["bad"] = max(int(row["bad"]), 0)
    log.node_states = _rows(
        sql,
        f"SELECT ts_ms, cluster_id, node_id, seq, state, reason FROM $node_states({r})"
        " ORDER BY ts_ms, node_id, seq",
    )
    # Tickets opened before the window may close in it: read from its start, all states.
    log.tickets = _rows(
        sql,
        f"SELECT ts_ms, ticket_id, node_id, cluster_id, rule, state, opened_ms, summary"
        f" FROM $tickets({r}) ORDER BY ts_ms, ticket_id, seq",
    )
    log.decisions = _rows(
        sql,
        f"SELECT ts_ms, decision_id, job, tenant, kind, outcome, reason, clusters, gpus,"
        f" lost_gpu_s, resume_from_checkpoint_ms FROM $decisions({r}) ORDER BY ts_ms, decision_id",
    )
    log.workloads = _rows(
        sql,
        f"SELECT ts_ms, job, tenant, cluster_id, epoch, attempt, event, step, checkpoint_uri,"
        f" from_cluster, detail FROM $workloads({r}) ORDER BY ts_ms, job, epoch, attempt",
    )
    log.tiers = ["tiered SQL ($samples, $node_states, $tickets, $decisions, $workloads)"]
    _from_kafka(kafka, topics, log, public_keys)
    return log


def _from_kafka(
    kafka: KafkaSettings, topics: Topics, log: IncidentLog, public_keys: Mapping[str, Any]
) -> None:
    codec = default_codec()
    group = f"fleetline-postmortem-{uuid.uuid4().hex[:12]}"
    inside = range(log.from_ms, log.to_ms + 1)
    for msg in kafka_clients.read_to_end(
        kafka, topics.emergency, kafka_clients.partitions_of(kafka, topics.emergency), group
    ):
        try:
            decoded = codec.decode(msg.value())
        except DecodeError:
            continue
        if decoded.schema.full_name == CLUSTER_HEALTH and decoded.record["ts"] in inside:
            log.health.append(decoded.record)
    for msg in kafka_clients.read_to_end(
        kafka, topics.dead_letter, kafka_clients.partitions_of(kafka, topics.dead_letter), group
    ):
        ts = msg.timestamp()[1]
        if ts in inside:
            letter = read_dead_letter(msg)
            log.dead_letters.append(
                {
                    "ts_ms": ts,
                    "application": letter.application,
                    "topic": letter.topic,
                    "offset": letter.offset,
                    "reason": letter.reason,
                }
            )
    for msg in kafka_clients.read_to_end(kafka, topics.scheduler_requests, [0], group):
        try:
            request = codec.decode(msg.value(), expect=SCHEDULER_REQUEST).record
        except DecodeError:
            continue
        if request["kind"] == "SERVICE_LOAD" and request["ts"] in inside:
            try:
                load = json.loads(request.get("spec_json") or "{}")
            except ValueError:
                continue
            log.services.append({"key": request["key"], "ts": request["ts"], **load})
    records = read_chain(kafka, topics)
    log.audit = audit_over(records, public_keys, log.from_ms, log.to_ms)
    log.audit_events = [
        r["event"] for r in records if r.get("event") is not None and r["event"]["ts"] in inside
    ]
    log.tiers.append("Kafka (emergency, dead letters, scheduler requests, audit log)")


def audit_over(
    records: Sequence[Mapping[str, Any]], public_keys: Mapping[str, Any], from_ms: int, to_ms: int
) -> dict[str, Any]:
    """The chain verified from its genesis to the window's end (the links chained by then: so
    the verdict is the window's, however the chain has grown since), and what of it covers the
    window: its events and the signed digests chained in it (a digest signs every link before
    it)."""
    records = [r for r in records if (r.get("chained_at") or 0) <= to_ms]
    report = verify([export_entry(r, reveal_sensitive=True) for r in records], public_keys)
    named = [
        {
            "partition": r["partition"],
            "covers_seq": r["digest"]["covers_seq"],
            "key_id": r["digest"]["key_id"],
            "chained_at_ms": r.get("chained_at"),
        }
        for r in records
        if r.get("digest") is not None and from_ms <= (r.get("chained_at") or 0) <= to_ms
    ]
    return {
        "ok": report.ok,
        "checked": report.checked,
        "digests": report.digests,
        "first_broken": report.first_broken,
        "unsigned_tail": report.unsigned_tail,
        "window_links": sum(
            1
            for r in records
            if r.get("event") is not None and from_ms <= r["event"]["ts"] <= to_ms
        ),
        "digests_named": named,
    }
