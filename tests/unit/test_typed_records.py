"""The TypedDicts in fleetline/schemas/records.py are the schemas' own: generated from the .avsc
files (`fleetline contract records`), current, and shaped as the codec reads records."""

from __future__ import annotations

import typing
from pathlib import Path

from fleetline.schemas import records
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics
from fleetline.streams.typed_records import typed_records


def test_the_checked_in_records_are_what_the_schemas_generate() -> None:
    generated = typed_records(default_codec().registry)
    assert Path(records.__file__).read_text() == generated


def test_every_record_is_typed_with_defaults_optional_and_enums_as_literals() -> None:
    registry = default_codec().registry
    for full_name in registry.names():
        source = registry.latest(full_name).source
        typed = getattr(records, str(source["name"]))
        hints = typing.get_type_hints(typed, include_extras=True)
        assert set(hints) == {f["name"] for f in source["fields"]}, full_name
        optional = {f["name"] for f in source["fields"] if "default" in f}
        assert typed.__optional_keys__ == optional, full_name
    assert typing.get_args(records.OrderAction) == ("RUN", "STOP", "UNKNOWN")
    event = typing.get_type_hints(records.WorkloadEvent)["event"]
    assert "FENCED" in typing.get_args(event)


def test_every_avro_topic_names_a_record_the_types_have() -> None:
    topics = Topics("t")
    named = [spec for spec in topics.specs() if spec.record is not None]
    assert named
    for spec in named:
        record = topics.record_of(spec.name)
        assert hasattr(records, record.rpartition(".")[2]), record
