"""The batch (columnar) decode paths agree exactly with the per-record ones."""

from __future__ import annotations

import pytest
from confluent_kafka import Message

from fleetline.agents.simulator import ClusterSpec, FleetSimulator
from fleetline.config import KafkaSettings
from fleetline.storage.hot_sink import HotSampleSink, SourcedTelemetry, to_columns
from fleetline.streams.serde import default_codec
from tests.support import BASE_MS

CODEC = default_codec()


def messages(version: int) -> list[Message]:
    sim = FleetSimulator([ClusterSpec("c0", "r0", 6)], seed=1)
    records = [r for t in range(3) for r in sim.telemetry(BASE_MS + t * 1000)]
    records[4]["gpus"][3]["xid_codes"] = [79, 48]
    return [Message(topic="t", partition=i % 3, offset=i, key=r["node_id"].encode(),
                    value=CODEC.encode("NodeTelemetry", r, version=version))
            for i, r in enumerate(records)]


def sink() -> HotSampleSink:
    return HotSampleSink(KafkaSettings(), CODEC, None, "t", "dlq")  # type: ignore[arg-type]


@pytest.mark.parametrize("version", [1, 2])
def test_the_columnar_sink_path_builds_the_same_rows_as_the_per_record_one(version):
    msgs = messages(version)
    table = sink()._columnar(msgs)
    reference = to_columns([SourcedTelemetry(m.partition(), m.offset(),
                                             CODEC.decode(m.value()).record, m.topic())
                            for m in msgs])
    assert table is not None and table.equals(reference)


def test_the_columnar_sink_path_hands_bad_batches_to_the_per_record_one():
    msgs = messages(2)
    record = CODEC.decode(msgs[2].value()).record
    record["gpus"][0]["gpu_util_pct"] = 130.0
    bad = Message(topic="t", partition=0, offset=2, key=msgs[2].key(),
                  value=CODEC.encode("NodeTelemetry", record))
    assert sink()._columnar([*msgs[:2], bad, *msgs[3:]]) is None
    truncated = Message(topic="t", partition=0, offset=2, key=msgs[2].key(),
                        value=msgs[2].value()[:-5])
    assert sink()._columnar([*msgs[:2], truncated]) is None


def test_repeats_are_dropped_by_seq_on_the_columnar_path():
    msgs = messages(2)
    s = sink()
    first = s._columnar(msgs)
    again = s._columnar(msgs)
    assert first is not None and first.num_rows == len(msgs) * 8
    assert again is not None and again.num_rows == 0 and s.stats.repeats == len(msgs)
