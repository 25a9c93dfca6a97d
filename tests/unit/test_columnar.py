"""The batch (columnar) decode paths agree exactly with the per-record ones."""

from __future__ import annotations

import pyarrow as pa
import pytest
from confluent_kafka import Message

from fleetline.agents.simulator import ClusterSpec, FleetSimulator
from fleetline.errors import FleetlineError
from fleetline.storage.hot_sink import HotSampleSink, SourcedTelemetry, to_columns
from fleetline.streams.serde import default_codec
from tests.support import BASE_MS

CODEC = default_codec()


def messages(version: int) -> list[Message]:
    sim = FleetSimulator([ClusterSpec("c0", "r0", 6)], seed=1)
    records = [r for t in range(3) for r in sim.telemetry(BASE_MS + t * 1000)]
    records[4]["gpus"][3]["xid_codes"] = [79, 48]
    return [
        Message(
            topic="t",
            partition=i % 3,
            offset=i,
            key=r["node_id"].encode(),
            value=CODEC.encode("NodeTelemetry", r, version=version),
        )
        for i, r in enumerate(records)
    ]


def sink() -> HotSampleSink:
    # The step alone: `process` decodes and checks, the table is only written by `store`.
    return HotSampleSink(CODEC, None, "t")  # type: ignore[arg-type]


def rows_of(
    step: HotSampleSink, msgs: list[Message]
) -> tuple[pa.Table, list[tuple[Message, FleetlineError]]]:
    """The rows the step would store, and the messages it dead-letters (with why)."""
    result = step.process(msgs)
    assert result.payload is not None and result.payload[1] == len(msgs)
    return result.payload[0], result.dead_letters


def per_record(msgs: list[Message]) -> pa.Table:
    return to_columns(
        [
            SourcedTelemetry(m.partition(), m.offset(), CODEC.decode(m.value()).record, m.topic())
            for m in msgs
        ]
    )


def same_rows(a: pa.Table, b: pa.Table) -> bool:
    order = [
        ("source_partition", "ascending"),
        ("source_offset", "ascending"),
        ("gpu_index", "ascending"),
    ]
    return a.sort_by(order).equals(b.sort_by(order))


@pytest.mark.parametrize("version", [1, 2])
def test_the_columnar_sink_path_builds_the_same_rows_as_the_per_record_one(version):
    msgs = messages(version)
    rows, dead = rows_of(sink(), msgs)
    assert rows.equals(per_record(msgs)) and not dead


def test_a_batch_of_both_writer_versions_is_read_whole():
    v1, v2 = messages(1), messages(2)
    mixed = [v1[i] if i % 3 == 0 else v2[i] for i in range(len(v1))]
    assert same_rows(rows_of(sink(), mixed)[0], per_record(mixed))


def bad_value(msgs: list[Message], at: int, **changes) -> list[Message]:
    record = CODEC.decode(msgs[at].value()).record
    record["gpus"][0].update(changes)
    bad = Message(
        topic="t",
        partition=msgs[at].partition(),
        offset=msgs[at].offset(),
        key=msgs[at].key(),
        value=CODEC.encode("NodeTelemetry", record),
    )
    return [*msgs[:at], bad, *msgs[at + 1 :]]


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"gpu_util_pct": 130.0}, "outside 0-100"),
        ({"gpu_util_pct": float("nan")}, "gpu_util_pct nan is outside 0-100"),
        ({"fb_used_mib": 10**6, "fb_total_mib": 1000}, "exceeds fb_total_mib 1000"),
        ({"gpu_index": 300}, "gpu_index 300 does not fit 0-255"),
        ({"ecc_sbe_total": -1}, "ecc_sbe_total -1 does not fit"),
        ({"xid_codes": [79, 70000]}, "xid_codes 70000 does not fit 0-65535"),
        ({"seq": -4}, "seq -4 is negative"),
        (None, "not Avro"),
        ("truncated", "decod"),
    ],
)
def test_a_bad_message_is_dead_lettered_and_the_rest_of_its_batch_stored(changes, reason):
    msgs = messages(2)
    if changes is None:
        msgs[5] = Message(topic="t", partition=2, offset=5, key=msgs[5].key(), value=b"junk")
    elif changes == "truncated":
        msgs[5] = Message(
            topic="t", partition=2, offset=5, key=msgs[5].key(), value=msgs[5].value()[:-5]
        )
    elif "seq" in changes:
        record = CODEC.decode(msgs[5].value()).record
        record.update(changes, gpus=[])  # no GPU rows: only the record's seq can tell
        msgs[5] = Message(
            topic="t",
            partition=2,
            offset=5,
            key=msgs[5].key(),
            value=CODEC.encode("NodeTelemetry", record),
        )
    else:
        msgs = bad_value(msgs, 5, **changes)
    rows, dead = rows_of(sink(), msgs)
    assert same_rows(rows, per_record([m for i, m in enumerate(msgs) if i != 5]))
    assert len(dead) == 1 and dead[0][0].value() == msgs[5].value()
    assert reason in str(dead[0][1])


def test_repeats_are_dropped_by_seq_on_the_columnar_path():
    msgs = messages(2)
    s = sink()
    first, _ = rows_of(s, msgs)
    again, _ = rows_of(s, msgs)
    assert first.num_rows == len(msgs) * 8
    assert again.num_rows == 0 and s.stats.repeats == len(msgs)


def test_repeats_are_dropped_in_batch_order_whichever_path_read_them():
    # A node's record read record by record (another schema version) and its repeat read by the
    # batch path: the first is kept and the second dropped, by the order they came in.
    v1, v2 = messages(1), messages(2)
    batch = [v1[0], v2[0], v2[1]]
    s = sink()
    rows, _ = rows_of(s, batch)
    assert s.stats.repeats == 1
    assert sorted(set(rows["source_offset"].to_pylist())) == [0, 1]
