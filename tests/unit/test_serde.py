"""Avro single-object encoding, the in-repo registry, and schema evolution (no services)."""

from __future__ import annotations

import contextlib
import io
import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastavro
import pytest
from fastavro.schema import fingerprint
from fastavro.utils import generate_many

from fleetline.errors import DecodeError, EncodeError, SchemaError, UnknownSchemaError
from fleetline.schemas import SCHEMA_DIR
from fleetline.streams.serde import (
    HEADER_LEN,
    MAGIC,
    AvroCodec,
    SchemaRegistry,
    default_codec,
)
from tests.support import BASE_MS, small_fleet

codec = default_codec()
V1_GPU_FIELDS = {f["name"] for f in codec.registry.version("GpuSample", 1).source["fields"]}


def test_registry_knows_the_shipped_schemas() -> None:
    assert codec.registry.names() == [
        "fleetline.audit.AuditEvent",
        "fleetline.audit.AuditRecord",
        "fleetline.cluster.ClusterHealth",
        "fleetline.cluster.ClusterSignal",
        "fleetline.cluster.WorkloadEvent",
        "fleetline.cluster.WorkloadOrder",
        "fleetline.commands.CommandResult",
        "fleetline.commands.NodeCommand",
        "fleetline.fleet.CapacitySummary",
        "fleetline.fleet.ClusterInfo",
        "fleetline.fleet.DatasetState",
        "fleetline.identity.IdentityEvent",
        "fleetline.observability.LogRecord",
        "fleetline.operations.OpsEvent",
        "fleetline.operations.RepairTicket",
        "fleetline.scheduling.Allocation",
        "fleetline.scheduling.DatasetPrewarm",
        "fleetline.scheduling.SchedulerRequest",
        "fleetline.scheduling.SchedulingDecision",
        "fleetline.serving.ReplicaEndpoint",
        "fleetline.telemetry.GpuSample",
        "fleetline.telemetry.NodeState",
        "fleetline.telemetry.NodeTelemetry",
    ]
    assert [s.version for s in codec.registry.versions("NodeTelemetry")] == [1, 2]


@pytest.mark.parametrize("name", default_codec().registry.names())
def test_every_schema_round_trips_generated_records(name: str) -> None:
    schema = codec.registry.latest(name)
    for record in generate_many(schema.writer, 25):
        data = codec.encode(name, record)
        assert data[:2] == MAGIC
        assert data[2:10] == schema.fingerprint
        decoded = codec.decode(data)
        assert decoded.schema.full_name == name
        # float32 fields lose precision once; after that the bytes are a fixed point.
        assert codec.encode(name, decoded.record) == data
        assert codec.decode(codec.encode(name, decoded.record)).record == decoded.record


def test_simulated_telemetry_round_trips_exactly() -> None:
    fleet = small_fleet()
    for record in fleet.telemetry(BASE_MS) + fleet.initial_states(BASE_MS):
        name = "NodeTelemetry" if "gpus" in record else "NodeState"
        decoded = codec.decode(codec.encode(name, record)).record
        assert decoded["node_id"] == record["node_id"]
        assert decoded["ts"] == record["ts"] == BASE_MS  # epoch ms, never a datetime
        if name == "NodeTelemetry":
            assert len(decoded["gpus"]) == 8
            assert decoded["gpus"][3]["fb_used_mib"] == record["gpus"][3]["fb_used_mib"]
            assert decoded["gpus"][3]["gpu_util_pct"] == pytest.approx(
                record["gpus"][3]["gpu_util_pct"], abs=1e-4
            )


def test_fingerprint_bytes_are_little_endian_as_the_spec_requires() -> None:
    # CRC-64-AVRO of the schema "int" is 0x7275d51a3f395c8f; the header carries it little-endian,
    # which is how the registry turns fastavro's hex into header bytes.
    assert bytes.fromhex(fingerprint('"int"', "CRC-64-AVRO")) == (0x7275D51A3F395C8F).to_bytes(
        8, "little"
    )
    schema = codec.registry.latest("NodeState")
    assert schema.fingerprint == bytes.fromhex(fingerprint(schema.canonical, "CRC-64-AVRO"))


@pytest.mark.parametrize("version", [1, 2])
def test_node_telemetry_embeds_the_gpu_sample_of_its_version(version: int) -> None:
    standalone = dict(codec.registry.version("GpuSample", version).source)
    standalone.pop("fleetline.version")
    embedded = next(
        f
        for f in codec.registry.version("NodeTelemetry", version).source["fields"]
        if f["name"] == "gpus"
    )["type"]["items"]
    assert embedded == standalone


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (None, "no value"),
        (b"", "not Avro single-object encoded"),
        (b'{"node_id": "n1"}', "not Avro single-object encoded"),
        (MAGIC + b"\x00" * 8 + b"\x02", "unknown writer schema fingerprint"),
    ],
)
def test_malformed_messages_raise_decode_errors_with_the_reason(data, reason) -> None:
    with pytest.raises(DecodeError, match=reason):
        codec.decode(data)


def test_truncated_and_padded_payloads_are_rejected() -> None:
    data = codec.encode("NodeTelemetry", small_fleet().telemetry(BASE_MS)[0])
    with pytest.raises(DecodeError, match="payload does not decode"):
        codec.decode(data[: len(data) // 2])
    with pytest.raises(DecodeError, match="bytes left after the record"):
        codec.decode(data + b"\x00\x00")


def test_random_corruption_never_escapes_as_a_foreign_exception() -> None:
    data = bytearray(codec.encode("NodeTelemetry", small_fleet().telemetry(BASE_MS)[0]))
    rng = random.Random(5)
    for _ in range(300):
        corrupt = bytearray(data)
        for _ in range(3):
            corrupt[rng.randrange(len(corrupt))] = rng.randrange(256)
        # Either it still decodes (a flipped value byte) or it is a DecodeError; nothing else.
        with contextlib.suppress(DecodeError):
            codec.decode(bytes(corrupt))


def test_unknown_fingerprint_is_its_own_error() -> None:
    with pytest.raises(UnknownSchemaError):
        codec.decode(MAGIC + b"\xff" * 8)


def test_expecting_another_record_type_is_a_decode_error() -> None:
    data = codec.encode("NodeState", small_fleet().initial_states(BASE_MS)[0])
    with pytest.raises(DecodeError, match="expected NodeTelemetry"):
        codec.decode(data, expect="NodeTelemetry")


def test_encode_names_the_offending_field() -> None:
    record = small_fleet().telemetry(BASE_MS)[0]
    record["gpus"][0]["fb_used_mib"] = "lots"
    with pytest.raises(EncodeError, match="fb_used_mib"):
        codec.encode("NodeTelemetry", record)


def _v1_registry(tmp_path: Path) -> SchemaRegistry:
    """What an agent released before any v2 schema knew."""
    for path in SCHEMA_DIR.glob("*.v1.avsc"):
        (tmp_path / path.name).write_text(path.read_text())
    return SchemaRegistry.from_directory(tmp_path)


# Every (record, older version) pair: each case decodes something (a schema with one version has
# nothing older to read, and is not a case at all).
OLDER = [
    (name, old.version)
    for name in default_codec().registry.names()
    for old in default_codec().registry.versions(name)[:-1]
]


def test_there_are_older_versions_to_read() -> None:
    assert {name.rpartition(".")[2] for name, _ in OLDER} >= {
        "GpuSample",
        "NodeTelemetry",
        "NodeState",
    }


@pytest.mark.parametrize(("name", "version"), OLDER)
def test_every_older_version_is_readable_by_the_newest(name: str, version: int) -> None:
    newest = codec.registry.latest(name)
    old = codec.registry.version(name, version)
    old_fields = dict(_fields(old.source))
    added = {path: f.get("default") for path, f in _fields(newest.source) if path not in old_fields}
    # A version adds a field with a default (at any depth), or symbols to an enum (old records
    # read as before).
    assert added or _symbols(newest.source) > _symbols(old.source), (
        f"{name} v{newest.version} adds no field or top-level enum symbol to v{version}"
    )
    records = list(generate_many(old.writer, 25))
    assert records
    seen: Counter[tuple[str, ...]] = Counter()
    for record in records:
        data = codec.encode(name, record, version=old.version)
        # What the old version itself reads back (floats rounded to their width, say).
        as_written = fastavro.schemaless_reader(io.BytesIO(data[HEADER_LEN:]), old.reader)
        decoded = codec.decode(data)
        assert (decoded.schema.version, decoded.writer_version) == (newest.version, old.version)
        # The fields the old writer had keep their values; the new ones take their default.
        assert _keeps(decoded.record, as_written)
        for path, default in added.items():
            values = list(_values(decoded.record, path))
            assert all(v == default for v in values), path
            seen[path] += len(values)
    # A field added to a record the old version had is read somewhere (an empty array in every
    # generated record would check nothing); one inside a record that is itself new is not.
    assert all(seen[p] for p in added if len(p) == 1 or p[:-1] in old_fields), seen


def _fields(schema: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, field) of every field of a record schema and of the records nested in it (through
    arrays, maps and unions; named references are not followed)."""
    if isinstance(schema, list):
        for branch in schema:
            yield from _fields(branch, path)
    elif isinstance(schema, dict):
        if schema.get("type") == "record":
            for f in schema["fields"]:
                yield (*path, f["name"]), f
                yield from _fields(f["type"], (*path, f["name"]))
        elif schema.get("type") == "array":
            yield from _fields(schema["items"], path)
        elif schema.get("type") == "map":
            yield from _fields(schema["values"], path)


def _values(record: Any, path: tuple[str, ...]) -> Iterator[Any]:
    """The values at `path` in a decoded record, through lists and nulls."""
    if isinstance(record, list):
        for item in record:
            yield from _values(item, path)
    elif isinstance(record, dict):
        if len(path) == 1:
            yield record[path[0]]
        elif record.get(path[0]) is not None:
            yield from _values(record[path[0]], path[1:])


def _symbols(schema: dict[str, Any]) -> set[str]:
    """Every top-level enum field's symbols, as field.symbol."""
    return {
        f"{f['name']}.{symbol}"
        for f in schema["fields"]
        if isinstance(f["type"], dict) and f["type"].get("type") == "enum"
        for symbol in f["type"]["symbols"]
    }


def _keeps(newer: object, older: object) -> bool:
    """True when `newer` holds every value `older` does (records may have gained fields)."""
    if isinstance(older, dict):
        return isinstance(newer, dict) and all(
            k in newer and _keeps(newer[k], v) for k, v in older.items()
        )
    if isinstance(older, list):
        return (
            isinstance(newer, list)
            and len(newer) == len(older)
            and all(_keeps(n, o) for n, o in zip(newer, older, strict=True))
        )
    return newer == older


def test_old_writer_new_reader(tmp_path: Path) -> None:
    old_agent = AvroCodec(_v1_registry(tmp_path))
    record = small_fleet().telemetry(BASE_MS)[0]
    v1_record = {k: v for k, v in record.items() if k not in ("agent_version", "collector")}
    v1_record["gpus"] = [{k: v for k, v in g.items() if k in V1_GPU_FIELDS} for g in record["gpus"]]
    decoded = codec.decode(old_agent.encode("NodeTelemetry", v1_record))
    assert decoded.schema.version == 2 and decoded.writer_version == 1
    assert decoded.record["agent_version"] == "unknown"
    assert decoded.record["gpus"]
    assert all(gpu["sm_clock_mhz"] is None for gpu in decoded.record["gpus"])
    assert decoded.record["seq"] == record["seq"]


def test_old_and_new_writers_share_a_topic(tmp_path: Path) -> None:
    old_agent = AvroCodec(_v1_registry(tmp_path))
    record = small_fleet().telemetry(BASE_MS)[0]
    old = {k: v for k, v in record.items() if k not in ("agent_version", "collector")}
    old["gpus"] = [{k: v for k, v in g.items() if k in V1_GPU_FIELDS} for g in record["gpus"]]
    messages = [old_agent.encode("NodeTelemetry", old), codec.encode("NodeTelemetry", record)]
    decoded = [codec.decode(m) for m in messages]
    assert [d.writer_version for d in decoded] == [1, 2]
    assert [d.record["collector"] for d in decoded] == ["unknown", "simulator"]
    # An agent that predates v2 names the problem instead of misreading the bytes.
    with pytest.raises(UnknownSchemaError):
        old_agent.decode(messages[1])


def test_schema_file_names_must_match_their_contents(tmp_path: Path) -> None:
    source = json.loads((SCHEMA_DIR / "NodeState.v1.avsc").read_text())
    (tmp_path / "NodeState.v2.avsc").write_text(json.dumps(source))
    with pytest.raises(SchemaError, match="file name says NodeState v2"):
        SchemaRegistry.from_directory(tmp_path)


def test_a_new_version_must_change_the_schema(tmp_path: Path) -> None:
    source = json.loads((SCHEMA_DIR / "NodeState.v1.avsc").read_text())
    (tmp_path / "NodeState.v1.avsc").write_text(json.dumps(source))
    source["fleetline.version"] = 2
    (tmp_path / "NodeState.v2.avsc").write_text(json.dumps(source))
    with pytest.raises(SchemaError, match="same canonical form"):
        SchemaRegistry.from_directory(tmp_path)


def test_invalid_schema_is_a_schema_error(tmp_path: Path) -> None:
    (tmp_path / "Broken.v1.avsc").write_text(
        json.dumps(
            {
                "type": "record",
                "name": "Broken",
                "fleetline.version": 1,
                "fields": [{"name": "x", "type": "no-such-type"}],
            }
        )
    )
    with pytest.raises(SchemaError, match="Broken v1"):
        SchemaRegistry.from_directory(tmp_path)


def test_audit_record_embeds_the_audit_event_schema() -> None:
    standalone = dict(codec.registry.latest("AuditEvent").source)
    embedded = next(
        f for f in codec.registry.latest("AuditRecord").source["fields"] if f["name"] == "event"
    )["type"][1]
    assert [(f["name"], json.dumps(f["type"], sort_keys=True)) for f in embedded["fields"]] == [
        (f["name"], json.dumps(f["type"], sort_keys=True)) for f in standalone["fields"]
    ]
