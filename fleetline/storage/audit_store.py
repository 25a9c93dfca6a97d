"""Where the audit log is kept besides Kafka: a ClickHouse table (search) and gzipped JSON Lines
segments in object storage (archive), both fed by record sinks and both able to give the chain
back for `fleetline audit verify`. The table stores AuditRecords as the chainer wrote them; the
archive stores the export entries the audit domain makes of them (values and salts included)."""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from clickhouse_connect.driver.client import Client

from fleetline.errors import IntegrityError, QueryError, StorageError
from fleetline.storage.clickhouse import CLICKHOUSE_ERRORS
from fleetline.storage.crypto import SealedObjectStore
from fleetline.storage.sinks import Destination, Sourced, table_resume_offsets
from fleetline.streams.serde import SchemaRegistry

TABLE = "audit_log"
# The AuditEvent's fields as its newest schema declares them (the chain's fields, so the table
# follows the schema): `ts` is the ts_ms column, `details` and `salt` are written as a map and
# hex, the rest are one column each.
_EVENT_SCHEMA = SchemaRegistry.from_directory().latest("AuditEvent").source
_EVENT_COLUMNS = tuple(
    f["name"] for f in _EVENT_SCHEMA["fields"] if f["name"] not in ("ts", "details", "salt")
)
_COLUMNS = (
    "partition",
    "seq",
    "source_offset",
    "chained_at_ms",
    "kind",
    "prev_hash",
    "content_digest",
    "hash",
    "ts_ms",
    *_EVENT_COLUMNS,
    "details",
    "salt",
    "digest",
    "source_topic",
)
_DIGEST_BYTES = ("covers_hash", "signature")


def _blank(avro_type: Any) -> Any:
    """What a digest link's row holds in an event column of this Avro type."""
    if isinstance(avro_type, list):  # a union with null: the column is Nullable
        return None
    kind = avro_type["type"] if isinstance(avro_type, dict) else avro_type
    return {"int": 0, "long": 0, "map": {}, "fixed": b""}.get(kind, "")


_EMPTY_EVENT: dict[str, Any] = {f["name"]: _blank(f["type"]) for f in _EVENT_SCHEMA["fields"]}


def _row(item: Sourced) -> list[Any]:
    r = item.record
    event = r["event"] or _EMPTY_EVENT
    signed: dict[str, Any] | None = r["digest"]
    digest = (
        ""
        if signed is None
        else json.dumps(
            {k: v.hex() if k in _DIGEST_BYTES else v for k, v in signed.items()}, sort_keys=True
        )
    )
    return [
        r["partition"],
        r["seq"],
        item.offset,
        r["chained_at"],
        "event" if r["event"] is not None else "digest",
        r["prev_hash"].hex(),
        r["content_digest"].hex(),
        r["hash"].hex(),
        event["ts"],
        *(event[name] for name in _EVENT_COLUMNS),
        dict(event["details"]),
        event["salt"].hex(),
        digest,
        item.topic,
    ]


def record_from_row(row: Sequence[Any]) -> dict[str, Any]:
    """An AuditRecord as the chainer wrote it, from a table row."""
    d = dict(zip(_COLUMNS, row, strict=True))
    record: dict[str, Any] = {
        "partition": d["partition"],
        "seq": d["seq"],
        "prev_hash": bytes.fromhex(d["prev_hash"]),
        "content_digest": bytes.fromhex(d["content_digest"]),
        "hash": bytes.fromhex(d["hash"]),
        "chained_at": d["chained_at_ms"],
        "event": None,
        "digest": None,
    }
    if d["kind"] == "digest":
        g = json.loads(d["digest"])
        record["digest"] = {k: bytes.fromhex(v) if k in _DIGEST_BYTES else v for k, v in g.items()}
    else:
        event = {name: d[name] for name in _EVENT_COLUMNS}
        event["ts"] = d["ts_ms"]
        event["details"] = dict(d["details"])
        event["salt"] = bytes.fromhex(d["salt"])
        record["event"] = event
    return record


@dataclass(frozen=True)
class AuditQuery:
    tenant: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    operation: str | None = None
    actor: str | None = None
    limit: int = 1000


class AuditTable(Destination):
    name = "clickhouse"

    def __init__(self, client: Client, database: str) -> None:
        self.client = client
        self.database = database

    def resume_offsets(self, topic: str) -> dict[int, int]:
        return table_resume_offsets(self.client, f"{self.database}.{TABLE}", topic, "partition")

    def store(self, batch: Sequence[Sourced]) -> None:
        try:
            self.client.insert(
                f"{self.database}.{TABLE}",
                [_row(item) for item in batch],
                column_names=list(_COLUMNS),
            )
        except CLICKHOUSE_ERRORS as exc:
            raise StorageError(f"inserting {len(batch)} audit records: {exc}") from None

    def records(
        self,
        partition: int | None = None,
        from_seq: int = 0,
        to_seq: int | None = None,
        topic: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """The chain(s) in order: partition by partition, seq by seq; with `topic`, only the
        chains of that audit log (deployments or runs sharing a database each have their own)."""
        where = ["seq >= {from_seq:UInt64}"]
        params: dict[str, Any] = {"from_seq": from_seq}
        if topic is not None:
            where.append("source_topic = {topic:String}")
            params["topic"] = topic
        if partition is not None:
            where.append("partition = {partition:UInt16}")
            params["partition"] = partition
        if to_seq is not None:
            where.append("seq <= {to_seq:UInt64}")
            params["to_seq"] = to_seq
        sql = (
            f"SELECT {', '.join(_COLUMNS)} FROM {self.database}.{TABLE} "
            f"WHERE {' AND '.join(where)} ORDER BY partition, seq"
        )
        try:
            rows = self.client.query(sql, parameters=params).result_rows
        except CLICKHOUSE_ERRORS as exc:
            raise QueryError(f"reading the audit chain: {exc}") from None
        for row in rows:
            yield record_from_row(row)

    def search(self, query: AuditQuery) -> list[dict[str, Any]]:
        """Events (not digests) matching the query, newest first, as AuditRecords."""
        where, params = _conditions(query)
        params["limit"] = query.limit
        sql = (
            f"SELECT {', '.join(_COLUMNS)} FROM {self.database}.{TABLE} "
            f"WHERE {where} ORDER BY ts_ms DESC, partition, seq LIMIT {{limit:UInt32}}"
        )
        try:
            rows = self.client.query(sql, parameters=params).result_rows
        except CLICKHOUSE_ERRORS as exc:
            raise QueryError(f"searching the audit log: {exc}") from None
        return [record_from_row(row) for row in rows]

    def activity(self, tenant: str | None, since_ms: int, until_ms: int) -> list[dict[str, Any]]:
        """A ready, tenant-scoped query: calls per operation and outcome in a time range."""
        where, params = _conditions(AuditQuery(tenant, since_ms, until_ms))
        sql = (
            f"SELECT operation, outcome, count() AS calls FROM {self.database}.{TABLE} "
            f"WHERE {where} GROUP BY operation, outcome ORDER BY operation, outcome"
        )
        try:
            rows = self.client.query(sql, parameters=params).result_rows
        except CLICKHOUSE_ERRORS as exc:
            raise QueryError(f"audit activity: {exc}") from None
        return [{"operation": o, "outcome": r, "calls": int(c)} for o, r, c in rows]


def _conditions(query: AuditQuery) -> tuple[str, dict[str, Any]]:
    """The WHERE clause selecting the query's events, with its bound parameters."""
    clauses = ["kind = 'event'"]
    params: dict[str, Any] = {}
    for value, clause, name in (
        (query.tenant, "tenant = {tenant:String}", "tenant"),
        (query.since_ms, "ts_ms >= {since:Int64}", "since"),
        (query.until_ms, "ts_ms <= {until:Int64}", "until"),
        (query.operation, "operation = {op:String}", "op"),
        (query.actor, "actor = {actor:String}", "actor"),
    ):
        if value is not None:
            clauses.append(clause)
            params[name] = value
    return " AND ".join(clauses), params


_SEGMENT = re.compile(r"/p(?P<partition>\d{3})/(?P<first>\d{20})-(?P<last>\d{20})\.jsonl\.gz$")


class AuditArchive(Destination):
    """Segments of export entries (values and salts included: the sink hands entries, not
    records) per partition, encrypted when a key is configured; keys are deterministic, so a
    re-stored batch overwrites itself."""

    name = "object-storage"

    def __init__(self, objects: SealedObjectStore, root: str) -> None:
        self.objects = objects
        self.root = root.strip("/")

    def _segments(self) -> list[tuple[int, int, int, str]]:
        out = []
        for key in self.objects.keys(f"{self.root}/"):
            match = _SEGMENT.search(key)
            if match:
                out.append((int(match["partition"]), int(match["first"]), int(match["last"]), key))
        return sorted(out)

    def resume_offsets(self, topic: str) -> dict[int, int]:
        # The archive's root is per topic prefix already.
        resume: dict[int, int] = {}
        for partition, _, last, _ in self._segments():
            resume[partition] = max(resume.get(partition, 0), last + 1)
        return resume

    def store(self, batch: Sequence[Sourced]) -> None:
        by_partition: dict[int, list[Sourced]] = {}
        for item in batch:
            by_partition.setdefault(item.partition, []).append(item)
        for partition, items in by_partition.items():
            lines = [json.dumps({"offset": i.offset, **i.record}, sort_keys=True) for i in items]
            key = (
                f"{self.root}/p{partition:03d}/{items[0].offset:020d}-"
                f"{items[-1].offset:020d}.jsonl.gz"
            )
            self.objects.put(key, gzip.compress("\n".join(lines).encode() + b"\n", mtime=0))

    def entries(self) -> Iterator[dict[str, Any]]:
        """Every archived entry, partition by partition in log order."""
        for _, _, _, key in self._segments():
            try:
                text = gzip.decompress(self.objects.get(key)).decode()
            except (OSError, EOFError, UnicodeDecodeError) as exc:
                raise IntegrityError(f"archive segment {key} is unreadable: {exc}") from None
            for line in text.splitlines():
                entry = json.loads(line)
                entry.pop("offset", None)
                yield entry
