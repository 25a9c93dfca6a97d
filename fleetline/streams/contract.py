"""The published contract of fleetline's topics: an AsyncAPI 3.0 document generated from the
code (the topics' specs in `topics.py` and every schema version in `schemas/`), so it cannot
drift from what the processors read and write. `fleetline contract asyncapi` writes it to
contract/asyncapi.yaml; `make lint` checks the file is current and validates it with the
AsyncAPI CLI."""

from __future__ import annotations

from typing import Any

from fleetline.streams.deadletter import H_APP, H_ERROR, H_OFFSET, H_PARTITION, H_REASON, H_TOPIC
from fleetline.streams.serde import MAGIC, AvroCodec, default_codec
from fleetline.streams.topics import Topics, TopicSpec

AVRO = "application/vnd.apache.avro;version=1.9.0"
KAFKA_BINDINGS = "0.5.0"
PREFIX = "fleetline"

COMPATIBILITY = (
    "Every message is Avro in single-object encoding: the two bytes C3 01, the 8-byte "
    "little-endian CRC-64-AVRO fingerprint of the writer schema's parsing canonical form, then "
    "the Avro binary body. The payload schema of each message below is the newest version, "
    "which producers write; `x-fleetline-versions` lists every version with its fingerprint "
    "(the .avsc files are in fleetline/schemas/, named <Record>.v<N>.avsc). The promise: "
    "schemas change only by a new version that a reader of it can use to read every older "
    "version (fields are added with defaults, enums end in a default symbol, nothing is "
    "removed or renamed: backward compatible, transitively), and old versions stay in the "
    "repository for ever, so a consumer that knows the fingerprints decodes the whole log. "
    "A message caused by a request carries the W3C `traceparent` header of that request."
)


def _address(spec: TopicSpec, topics: Topics) -> str:
    return "{prefix}" + spec.name.removeprefix(topics.prefix)


def _topic_configuration(config: dict[str, str]) -> dict[str, Any]:
    """The settings the Kafka bindings define, typed as they define them."""
    out: dict[str, Any] = {}
    if "cleanup.policy" in config:
        out["cleanup.policy"] = config["cleanup.policy"].split(",")
    for name in ("retention.ms", "retention.bytes"):
        if name in config:
            out[name] = int(config[name])
    return out


def _message(spec: TopicSpec, codec: AvroCodec) -> dict[str, Any]:
    headers = {
        "type": "object",
        "properties": {
            "traceparent": {
                "type": "string",
                "description": "W3C trace context of the request this message follows from",
                "pattern": "^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$",
            }
        },
    }
    bindings = {
        "kafka": {
            "key": {"type": "string", "description": spec.key},
            "bindingVersion": KAFKA_BINDINGS,
        }
    }
    if spec.record is None:
        return {
            "name": "DeadLetter",
            "title": "A message no processor could handle",
            "summary": spec.doc,
            "contentType": "application/octet-stream",
            "headers": {
                "type": "object",
                "properties": {
                    name: {"type": "string"}
                    for name in (H_REASON, H_ERROR, H_APP, H_TOPIC, H_PARTITION, H_OFFSET)
                },
            },
            "payload": {"type": "string", "format": "binary", "description": "the bytes as sent"},
            "bindings": bindings,
        }
    versions = codec.registry.versions(spec.record)
    latest = versions[-1]
    return {
        "name": latest.name,
        "title": latest.full_name,
        "summary": spec.doc,
        "contentType": "application/vnd.apache.avro+binary",
        "headers": headers,
        "payload": {"schemaFormat": AVRO, "schema": dict(latest.source)},
        "bindings": bindings,
        "x-fleetline-versions": [
            {
                "version": v.version,
                "fingerprint": v.fingerprint.hex(),
                "file": f"fleetline/schemas/{v.name}.v{v.version}.avsc",
            }
            for v in versions
        ],
    }


def asyncapi(version: str, codec: AvroCodec | None = None) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of every public topic."""
    codec = codec or default_codec()
    topics = Topics(PREFIX)
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    components: dict[str, Any] = {}
    for spec in topics.specs():
        channel_id = spec.name.removeprefix(f"{PREFIX}.").replace(".", "-")
        message = _message(spec, codec)
        message_id = message["name"]
        components[message_id] = message
        channels[channel_id] = {
            "address": _address(spec, topics),
            "title": spec.name,
            "description": spec.doc,
            "parameters": {"prefix": {"$ref": "#/components/parameters/prefix"}},
            "messages": {message_id: {"$ref": f"#/components/messages/{message_id}"}},
            "bindings": {
                "kafka": {
                    "partitions": spec.partitions,
                    "topicConfiguration": _topic_configuration(spec.config),
                    "bindingVersion": KAFKA_BINDINGS,
                }
            },
            "x-fleetline-topic-config": dict(sorted(spec.config.items())),
            # Who may append and read besides the control plane and the operator: the ACLs of
            # a secured broker (`fleetline infra start --secure`, streams/access.py).
            "x-fleetline-writers": list(spec.writers),
            "x-fleetline-readers": list(spec.readers),
        }
        operations[f"consume-{channel_id}"] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "summary": f"Read {spec.name} (any consumer group; keys: {spec.key})",
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{message_id}"}],
        }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "fleetline event topics",
            "version": version,
            "description": COMPATIBILITY,
            "license": {"name": "Apache-2.0"},
        },
        "defaultContentType": "application/vnd.apache.avro+binary",
        "servers": {
            "local": {
                "host": "127.0.0.1:9092",
                "protocol": "kafka",
                "description": "`fleetline infra start` (FLEETLINE_KAFKA_BOOTSTRAP elsewhere)",
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {
            "parameters": {
                "prefix": {
                    "default": PREFIX,
                    "description": "the deployment's topic prefix (`--topic-prefix`)",
                }
            },
            "messages": components,
        },
        "x-fleetline-single-object-magic": MAGIC.hex(),
    }
