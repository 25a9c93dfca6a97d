"""The native column decoder reads what fastavro writes, and refuses what it must not read."""

from __future__ import annotations

import io
import json
import random

import fastavro
import pytest

from fleetline.streams.avrocols import OTHER_WRITER, Program, Unsupported
from fleetline.streams.avrocols import avro_long as _zigzag

SCHEMA = {
    "type": "record",
    "name": "Outer",
    "fields": [
        {"name": "id", "type": "string"},
        {"name": "flag", "type": "boolean"},
        {"name": "blob", "type": "bytes"},
        {"name": "skipped", "type": "string"},
        {
            "name": "where",
            "type": {
                "type": "record",
                "name": "Where",
                "fields": [{"name": "x", "type": "double"}, {"name": "n", "type": ["int", "null"]}],
            },
        },
        {
            "name": "items",
            "type": {
                "type": "array",
                "items": {
                    "type": "record",
                    "name": "Item",
                    "fields": [
                        {"name": "f", "type": "float"},
                        {"name": "l", "type": ["null", "long"]},
                        {"name": "s", "type": ["null", "string"]},
                        {"name": "tags", "type": {"type": "array", "items": "int"}},
                        {"name": "gone", "type": ["null", "double"]},
                    ],
                },
            },
        },
        {"name": "last", "type": "long"},
    ],
}
HEADER = b"\xc3\x01" + bytes(8)


def _write(schema: dict, record: dict) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return out.getvalue()


def body(record: dict, block_size: bool = False) -> bytes:
    if not block_size:
        return HEADER + _write(SCHEMA, record)
    # The item array as one block with its byte size (a negative count, then the length), as
    # Avro writers may write it.
    fields = SCHEMA["fields"]
    before = _write({**SCHEMA, "fields": fields[:5]}, record)
    after = _write({**SCHEMA, "name": "After", "fields": fields[6:]}, record)
    item_schema = fields[5]["type"]["items"]
    items = b"".join(_write(item_schema, item) for item in record["items"])
    return (
        HEADER
        + before
        + _zigzag(-len(record["items"]))
        + _zigzag(len(items))
        + items
        + b"\x00"
        + after
    )


def records() -> list[dict]:
    return [
        {
            "id": "a",
            "flag": True,
            "blob": b"\x00\xff",
            "skipped": "zzz",
            "where": {"x": 1.5, "n": 7},
            "items": [
                {"f": 0.25, "l": None, "s": "s1", "tags": [1, -2], "gone": 1.0},
                {"f": -1.0, "l": 2**40, "s": None, "tags": [], "gone": None},
            ],
            "last": 2**62,
        },
        {
            "id": "bb",
            "flag": False,
            "blob": b"",
            "skipped": "",
            "where": {"x": -0.0, "n": None},
            "items": [],
            "last": -(2**62),
        },
        {
            "id": "ccc",
            "flag": True,
            "blob": b"x",
            "skipped": "q",
            "where": {"x": 3e300, "n": -1},
            "items": [{"f": 3.0, "l": -5, "s": "", "tags": [2**31 - 1], "gone": None}],
            "last": 0,
        },
    ]


def program() -> Program:
    return Program(
        json.loads(json.dumps(SCHEMA)),
        HEADER,
        wanted=lambda path: path not in ("skipped", "items.gone"),
    )


def test_decodes_every_type_as_fastavro_reads_it():
    recs = records()
    values = [body(r, block_size=(i == 0)) for i, r in enumerate(recs)]
    decoded = program().decode(values, [r["id"].encode() for r in recs], key_field="id")
    assert decoded.failed == {}
    top = decoded.tables[""]
    assert top.column_names == ["id", "flag", "blob", "where.x", "where.n", "last"]
    assert top.to_pylist() == [
        {
            "id": r["id"],
            "flag": r["flag"],
            "blob": r["blob"],
            "where.x": r["where"]["x"],
            "where.n": r["where"]["n"],
            "last": r["last"],
        }
        for r in recs
    ]
    items = decoded.tables["items"]
    assert items.column_names == ["f", "l", "s", "tags"]
    assert items.to_pylist() == [
        {k: v for k, v in item.items() if k != "gone"} for r in recs for item in r["items"]
    ]
    assert decoded.ends["items"].tolist() == [2, 2, 3]
    assert decoded.parents("items").tolist() == [0, 0, 2]


def test_an_empty_batch_and_a_batch_after_a_large_one_decode():
    prog = program()
    big = [body(records()[0])] * 5000
    assert prog.decode(big).tables["items"].num_rows == 10000
    small = prog.decode([body(records()[1])])
    assert small.tables[""]["id"].to_pylist() == ["bb"]
    empty = prog.decode([])
    assert empty.tables[""].num_rows == 0 and empty.failed == {}


@pytest.mark.parametrize(
    ("mangle", "reason"),
    [
        (lambda v: v[:-1], "message ends inside a number"),
        (lambda v: v + b"\x00", "bytes left after the record"),
        (lambda v: b"\xc3\x01" + b"\x01" * 8 + v[10:], "another writer schema"),
        (lambda v: v[:10] + b"\x7f" + v[11:], "string length past the message"),
        (lambda v: v[:10] + b"\x02a\x05" + v[13:], "boolean is neither 0 nor 1"),
        (lambda v: v[:10] + b"\xff" * 11, "varint longer than 10 bytes"),
    ],
)
def test_a_malformed_message_is_left_out_named_and_shifts_nothing(mangle, reason):
    recs = records()
    values = [body(r) for r in recs]
    values[1] = mangle(values[1])
    decoded = program().decode(values)
    assert list(decoded.failed) == [1] and decoded.failed[1].startswith(reason)
    assert decoded.indices().tolist() == [0, 2]
    # The records either side are whole: nothing of the bad one is left in any column.
    assert decoded.tables[""]["id"].to_pylist() == ["a", "ccc"]
    assert decoded.tables[""]["where.n"].to_pylist() == [7, -1]
    assert decoded.tables["items"]["tags"].to_pylist() == [[1, -2], [], [2**31 - 1]]
    assert decoded.ends["items"].tolist() == [2, 3]


def test_another_writers_message_is_named_so_callers_can_tell_it_from_a_bad_one():
    other = b"\xc3\x01" + b"\x01" * 8 + body(records()[0])[10:]
    assert program().decode([other, b"junk"]).failed == {0: OTHER_WRITER, 1: OTHER_WRITER}


def test_a_record_whose_key_differs_is_left_out():
    recs = records()
    decoded = program().decode([body(r) for r in recs], [b"a", b"bb", b"cc"], key_field="id")
    assert decoded.failed == {2: "key differs from the record"}
    assert decoded.tables[""]["id"].to_pylist() == ["a", "bb"]
    assert program().decode([body(recs[0])], [None], key_field="id").failed == {
        0: "key differs from the record"
    }


def test_a_bad_union_branch_is_left_out():
    value = bytearray(body(records()[1]))
    # `where.n` is null here: its branch index (1, zigzag 02) sits just before `items` (00).
    assert value[-11:-9] == b"\x02\x00"
    value[-11] = 0x04
    assert program().decode([bytes(value)]).failed == {0: "union branch out of range"}


@pytest.mark.parametrize(
    "field_type",
    [
        {"type": "map", "values": "int"},
        ["null", "int", "string"],
        {"type": "enum", "name": "E", "symbols": ["A"]},
        {"type": "fixed", "name": "F", "size": 2},
        {"type": "array", "items": {"type": "array", "items": "int"}},
        {"type": "array", "items": "R"},  # a record that contains itself
    ],
)
def test_a_schema_the_decoder_cannot_run_is_refused_when_compiled(field_type):
    with pytest.raises(Unsupported):
        Program(
            {"type": "record", "name": "R", "fields": [{"name": "x", "type": field_type}]}, HEADER
        )


def test_every_truncation_and_random_corruption_is_refused_or_read_never_crashes():
    prog = program()
    value = body(records()[0])
    cuts = [value[:cut] for cut in range(len(value))]
    assert sorted(prog.decode(cuts).failed) == list(range(len(value)))
    rng = random.Random(5)
    mangled = []
    for _ in range(3000):
        one = bytearray(value)
        for _ in range(rng.randint(1, 4)):
            one[rng.randrange(10, len(one))] = rng.randrange(256)
        mangled.append(bytes(one))
    decoded = prog.decode([value, *mangled, value])
    assert 0 < len(decoded.failed) < len(mangled)
    # Whatever the corrupt ones left behind, the last (intact) message reads back whole.
    assert decoded.tables[""].slice(decoded.tables[""].num_rows - 1).to_pylist() == [
        decoded.tables[""].slice(0, 1).to_pylist()[0]
    ]
    assert decoded.ends["items"][-1] - decoded.ends["items"][-2] == 2
