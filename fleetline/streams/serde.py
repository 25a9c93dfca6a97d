"""Avro single-object encoding over an in-repo registry of every schema version.

A message is `C3 01`, the 8-byte little-endian CRC-64-AVRO fingerprint of the writer schema's
parsing canonical form, then the Avro binary payload. Decoding looks the writer schema up by
fingerprint and resolves it to the newest version of the same record (schema evolution), so an
old agent's messages are readable by a new processor.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import SchemaParseException, to_parsing_canonical_form
from fastavro.schema import fingerprint as _fingerprint
from fastavro.validation import ValidationError, validate

from fleetline.errors import DecodeError, EncodeError, SchemaError, UnknownSchemaError
from fleetline.schemas import SCHEMA_DIR

MAGIC = b"\xc3\x01"
HEADER_LEN = len(MAGIC) + 8
_FILE_NAME = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)\.v(?P<version>[0-9]+)\.avsc$")
# What fastavro raises on a truncated or corrupt payload (a fuzzer of 50,000 corruptions saw
# EOFError, UnicodeDecodeError and IndexError; lengths and unions can give the others).
_CORRUPT = (EOFError, ValueError, IndexError, KeyError, OverflowError, MemoryError)
_TIME_LOGICAL = {
    "timestamp-millis",
    "timestamp-micros",
    "local-timestamp-millis",
    "local-timestamp-micros",
}


@dataclass(frozen=True)
class RegisteredSchema:
    full_name: str
    version: int
    source: Mapping[str, Any]
    canonical: str
    fingerprint: bytes
    # Parsed for writing (as declared) and for reading (time logical types read as plain ints,
    # since the pure core works in epoch milliseconds and never in datetime objects).
    writer: Any
    reader: Any

    @property
    def name(self) -> str:
        return self.full_name.rpartition(".")[2]


def _without_time_logical_types(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            key: _without_time_logical_types(value)
            for key, value in node.items()
            if not (key == "logicalType" and value in _TIME_LOGICAL)
        }
    if isinstance(node, list):
        return [_without_time_logical_types(item) for item in node]
    return node


def register(source: Mapping[str, Any], version: int) -> RegisteredSchema:
    """Parse one schema version; raise SchemaError with the reason if it is not valid Avro."""
    try:
        writer = fastavro.parse_schema(dict(source), _force=True)
        reader = fastavro.parse_schema(_without_time_logical_types(dict(source)), _force=True)
        canonical = to_parsing_canonical_form(writer)
    except (SchemaParseException, ValueError, KeyError, TypeError) as exc:
        # fastavro names a bad schema with its own error, or with whatever a lookup raised.
        raise SchemaError(f"{source.get('name', '?')} v{version}: {exc}") from None
    assert isinstance(writer, dict), "a record schema parses to a mapping"
    full_name = str(writer["name"])
    return RegisteredSchema(
        full_name=full_name,
        version=version,
        source=source,
        canonical=canonical,
        fingerprint=bytes.fromhex(_fingerprint(canonical, "CRC-64-AVRO")),
        writer=writer,
        reader=reader,
    )


class SchemaRegistry:
    """Every known version of every record schema, by name and by fingerprint."""

    def __init__(self, schemas: Iterable[RegisteredSchema]) -> None:
        self._by_fingerprint: dict[bytes, RegisteredSchema] = {}
        self._versions: dict[str, dict[int, RegisteredSchema]] = {}
        for schema in schemas:
            self.add(schema)

    def add(self, schema: RegisteredSchema) -> None:
        versions = self._versions.setdefault(schema.full_name, {})
        if schema.version in versions:
            raise SchemaError(f"{schema.full_name} v{schema.version} is registered twice")
        clash = self._by_fingerprint.get(schema.fingerprint)
        if clash is not None:
            raise SchemaError(
                f"{schema.full_name} v{schema.version} has the same canonical form as "
                f"{clash.full_name} v{clash.version}; a new version must change the schema"
            )
        versions[schema.version] = schema
        self._by_fingerprint[schema.fingerprint] = schema

    @classmethod
    def from_directory(cls, directory: Path = SCHEMA_DIR) -> SchemaRegistry:
        schemas = []
        for path in sorted(directory.glob("*.avsc")):
            match = _FILE_NAME.match(path.name)
            if match is None:
                raise SchemaError(f"{path.name}: schema files are named <Name>.v<N>.avsc")
            try:
                source = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise SchemaError(f"{path.name}: not JSON: {exc}") from None
            version = int(match["version"])
            if source.get("name") != match["name"] or source.get("fleetline.version") != version:
                raise SchemaError(
                    f"{path.name}: file name says {match['name']} v{version}, the schema says "
                    f"{source.get('name')} v{source.get('fleetline.version')}"
                )
            schemas.append(register(source, version))
        return cls(schemas)

    def _resolve_name(self, name: str) -> str:
        if name in self._versions:
            return name
        matches = [full for full in self._versions if full.rpartition(".")[2] == name]
        if len(matches) != 1:
            raise SchemaError(f"no single schema named {name!r}; known: {sorted(self._versions)}")
        return matches[0]

    def latest(self, name: str) -> RegisteredSchema:
        versions = self._versions[self._resolve_name(name)]
        return versions[max(versions)]

    def version(self, name: str, version: int) -> RegisteredSchema:
        try:
            return self._versions[self._resolve_name(name)][version]
        except KeyError:
            raise SchemaError(f"{name} has no version {version}") from None

    def versions(self, name: str) -> list[RegisteredSchema]:
        versions = self._versions[self._resolve_name(name)]
        return [versions[v] for v in sorted(versions)]

    def names(self) -> list[str]:
        return sorted(self._versions)

    def by_fingerprint(self, fingerprint: bytes) -> RegisteredSchema:
        try:
            return self._by_fingerprint[fingerprint]
        except KeyError:
            raise UnknownSchemaError(
                f"unknown writer schema fingerprint {fingerprint.hex()}"
            ) from None


@dataclass(frozen=True)
class Decoded:
    schema: RegisteredSchema
    writer_version: int
    record: dict[str, Any]


class AvroCodec:
    """Single-object Avro encoding of records with the registry's schemas."""

    def __init__(self, registry: SchemaRegistry) -> None:
        self.registry = registry

    def encode(self, name: str, record: Mapping[str, Any], version: int | None = None) -> bytes:
        schema = (
            self.registry.latest(name) if version is None else self.registry.version(name, version)
        )
        buffer = io.BytesIO()
        buffer.write(MAGIC)
        buffer.write(schema.fingerprint)
        try:
            fastavro.schemaless_writer(buffer, schema.writer, record)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError):
            # The writer's own errors rarely name the field; the validator does.
            try:
                validate(record, schema.writer, raise_errors=True)
            except ValidationError as exc:
                raise EncodeError(f"{schema.full_name} v{schema.version}: {exc}") from None
            raise
        return buffer.getvalue()

    def decode(self, data: bytes | None, expect: str | None = None) -> Decoded:
        """Decode one message to the newest version of its record; DecodeError says why not."""
        if data is None:
            raise DecodeError("message has no value")
        if len(data) < HEADER_LEN or data[:2] != MAGIC:
            raise DecodeError(
                f"not Avro single-object encoded (need {MAGIC.hex()} + 8-byte fingerprint, "
                f"got {len(data)} bytes starting {data[:4].hex() or 'nothing'})"
            )
        writer = self.registry.by_fingerprint(data[2:HEADER_LEN])
        reader = self.registry.latest(writer.full_name)
        if expect is not None and reader.full_name != self.registry.latest(expect).full_name:
            raise DecodeError(f"expected {expect}, got {writer.full_name} v{writer.version}")
        buffer = io.BytesIO(data)
        buffer.seek(HEADER_LEN)
        # Resolution costs ~20% of a decode; skip it when the writer is the newest version.
        resolve_to = None if reader is writer else reader.reader
        try:
            record = fastavro.schemaless_reader(buffer, writer.reader, resolve_to)
        except _CORRUPT as exc:
            raise DecodeError(
                f"{writer.full_name} v{writer.version}: payload does not decode: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        if buffer.tell() != len(data):
            raise DecodeError(
                f"{writer.full_name} v{writer.version}: {len(data) - buffer.tell()} bytes "
                f"left after the record"
            )
        if not isinstance(record, dict):
            raise DecodeError(f"{writer.full_name} v{writer.version}: not a record")
        return Decoded(schema=reader, writer_version=writer.version, record=record)


_default_codec: AvroCodec | None = None


def default_codec() -> AvroCodec:
    """The codec over the schemas shipped in `fleetline/schemas`, loaded once."""
    global _default_codec
    if _default_codec is None:
        _default_codec = AvroCodec(SchemaRegistry.from_directory())
    return _default_codec
