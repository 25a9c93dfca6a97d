"""Kafka -> ClickHouse sink for GPU samples: receive, batch, decode, to columns, store, commit.

Each sample row carries the Kafka partition and offset of its NodeTelemetry message. One batch is
one INSERT, so the table itself says how far the sink got: on (re)start it resumes after the
highest stored offset of each partition, and a crash between insert and offset commit neither
loses nor duplicates rows. Records an agent sent twice (it re-sends from its spool after an
outage) are dropped by their per-node seq, which the table also holds. Kafka offsets are
committed too, but only for lag monitoring.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import chdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from clickhouse_connect.driver._chdbclient import ChdbClient
from clickhouse_connect.driver.client import Client
from confluent_kafka import Message, TopicPartition

from fleetline.errors import FleetlineError, InvalidEventError, StorageError
from fleetline.observability import metrics
from fleetline.storage.clickhouse import CLICKHOUSE_ERRORS
from fleetline.storage.sinks import resume_positions, table_node_seqs, table_resume_offsets
from fleetline.streams.columnar import TelemetryBatchDecoder
from fleetline.streams.events import NODE_TELEMETRY, check_telemetry
from fleetline.streams.loop import Step, StepResult
from fleetline.streams.records import where
from fleetline.streams.serde import AvroCodec
from fleetline.streams.telemetry_rules import gpu_samples_broken

TABLE = "gpu_samples"
_GPU_FIELDS = (
    ("gpu_index", pa.uint8()),
    ("gpu_uuid", pa.string()),
    ("vendor", pa.string()),
    ("model", pa.string()),
    ("gpu_util_pct", pa.float32()),
    ("mem_copy_util_pct", pa.float32()),
    ("fb_used_mib", pa.uint32()),
    ("fb_total_mib", pa.uint32()),
    ("nvlink_tx_bytes_per_s", pa.float64()),
    ("nvlink_rx_bytes_per_s", pa.float64()),
    ("nvlink_errors_total", pa.uint64()),
    ("rdma_packet_loss_ratio", pa.float64()),
    ("temperature_c", pa.float32()),
    ("power_w", pa.float32()),
    ("ecc_sbe_total", pa.uint64()),
    ("ecc_dbe_total", pa.uint64()),
    ("xid_codes", pa.list_(pa.uint16())),
    ("pcie_tx_bytes_per_s", pa.float64()),
    ("pcie_rx_bytes_per_s", pa.float64()),
    ("sm_clock_mhz", pa.uint16()),
    ("mem_clock_mhz", pa.uint16()),
    ("power_limit_w", pa.float32()),
    ("nvlink_links_active", pa.uint8()),
)
_NODE_FIELDS = (
    ("cluster_id", pa.string()),
    ("region", pa.string()),
    ("node_id", pa.string()),
    ("seq", pa.uint64()),
)
_GPU_NAMES = tuple(name for name, _ in _GPU_FIELDS)
_SAMPLE_FIELDS = [("ts", pa.timestamp("ms", tz="UTC")), *_NODE_FIELDS, *_GPU_FIELDS]
SAMPLE_SCHEMA = pa.schema(
    [
        *_SAMPLE_FIELDS,
        ("source_partition", pa.uint16()),
        ("source_offset", pa.uint64()),
        ("source_topic", pa.string()),
    ]
)
# What the batch decoder gives, in the table's types: `_record` says which message a row is of.
_DECODED_SCHEMA = pa.schema([("_record", pa.uint32()), *_SAMPLE_FIELDS])


@dataclass(frozen=True)
class SourcedTelemetry:
    partition: int
    offset: int
    record: dict[str, Any]
    topic: str = ""


def to_columns(batch: Sequence[SourcedTelemetry]) -> pa.Table:
    """NodeTelemetry records -> one Arrow table of GPU sample rows (pure)."""
    columns: dict[str, list[Any]] = {name: [] for name in SAMPLE_SCHEMA.names}
    gpu_names = [name for name, _ in _GPU_FIELDS]
    for item in batch:
        record = item.record
        for gpu in record["gpus"]:
            columns["ts"].append(record["ts"])
            for name, _ in _NODE_FIELDS:
                columns[name].append(record[name])
            for name in gpu_names:
                columns[name].append(gpu[name])
            columns["source_partition"].append(item.partition)
            columns["source_offset"].append(item.offset)
            columns["source_topic"].append(item.topic)
    return pa.table(
        {
            name: pa.array(values, type=SAMPLE_SCHEMA.field(name).type)
            for name, values in columns.items()
        },
        schema=SAMPLE_SCHEMA,
    )


@dataclass
class HotSampleStore:
    """The gpu_samples table: store batches, say where each partition should resume."""

    client: Client
    database: str

    def resume_offsets(self, topic: str) -> dict[int, int]:
        # One database may hold the samples of several topic prefixes.
        return table_resume_offsets(self.client, f"{self.database}.{TABLE}", topic)

    def node_watermarks(self, topic: str) -> dict[str, int]:
        """The highest seq stored for each node from `topic` (`table_node_seqs`)."""
        return table_node_seqs(self.client, f"{self.database}.{TABLE}", topic)

    def store(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        try:
            if isinstance(self.client, ChdbClient) and not self.client.path.startswith(":"):
                self._store_in_place(self.client.path, table)
            else:
                # A batch an agent replays after a long outage can span many hourly partitions.
                self.client.insert_arrow(
                    f"{self.database}.{TABLE}",
                    table,
                    settings={"max_partitions_per_insert_block": 1000},
                )
        except CLICKHOUSE_ERRORS as exc:
            raise StorageError(f"inserting {table.num_rows} rows into {TABLE}: {exc}") from None

    def _store_in_place(self, path: str, table: pa.Table) -> None:
        """The embedded engine reads the Arrow batch where it lies (chdb's Python() table
        function) instead of from a temporary IPC file: about a third less CPU per row."""
        names = ", ".join(table.column_names)
        # Shares the engine the client has open (chdb admits one per process and folder).
        engine = chdb.connect(os.path.realpath(path))  # type: ignore[no-untyped-call]
        try:
            batch = table  # noqa: F841 -- Python(batch) finds it by name in this frame
            engine.query(
                f"INSERT INTO {self.database}.{TABLE} ({names}) SELECT {names} "
                "FROM Python(batch) SETTINGS max_partitions_per_insert_block = 1000"
            )
        finally:
            engine.close()


@dataclass
class SampleSinkStats:
    batches: int = 0
    messages: int = 0
    rows: int = 0
    dead_letters: int = 0
    repeats: int = 0  # records an agent sent again, already stored


Prepared = tuple[pa.Table, int]  # the batch's new sample rows, and how many messages it had


_ROWS = metrics.SINK_ROWS.labels("gpu_samples")


@dataclass
class HotSampleSink(Step[Prepared]):
    """NodeTelemetry -> GPU sample rows in ClickHouse (a stream-loop step; run it with
    `overlap`, so one batch is decoded while the previous one is inserted)."""

    codec: AvroCodec
    samples: HotSampleStore
    topic: str
    stats: SampleSinkStats = field(default_factory=SampleSinkStats)
    _seen: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._decoder = TelemetryBatchDecoder(self.codec, _GPU_NAMES, tuple)

    def assigned(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        # The table, not the group's committed offsets, says where to resume; it also holds
        # the highest seq per node, by which an agent's repeats are recognised.
        self._seen = self.samples.node_watermarks(self.topic)
        return resume_positions(partitions, self.samples.resume_offsets(self.topic))

    def process(self, messages: list[Message]) -> StepResult[Prepared]:
        dead: list[tuple[Message, FleetlineError]] = []
        table = self._rows(messages, dead)
        self.stats.dead_letters += len(dead)
        return StepResult(dead_letters=dead, payload=(table, len(messages)))

    def store(self, payload: Prepared) -> None:
        table, messages = payload
        self.samples.store(table)
        _ROWS.inc(table.num_rows)
        self.stats.batches += 1
        self.stats.messages += messages
        self.stats.rows += table.num_rows

    def _rows(
        self, messages: list[Message], dead: list[tuple[Message, FleetlineError]]
    ) -> pa.Table:
        """The batch's new GPU sample rows. The batch is decoded in native code; a message that
        path cannot read or vouch for (malformed, a value out of range, a schema it does not
        run) is decoded record by record instead, which names it (in `dead`) if it is bad.
        Repeats are dropped by seq in the batch's order, whichever path read the message."""
        batch = self._decoder.samples(
            [m.key() for m in messages], [m.value() for m in messages], _GPU_NAMES
        )
        singles = set(batch.failed)
        samples = batch.samples
        if samples.num_rows:
            bad = _out_of_range(samples)
            if bad is not None:
                singles.update(samples["_record"].filter(bad).to_pylist())
                samples = samples.filter(pc.invert(bad))
            samples = samples.select(_DECODED_SCHEMA.names).cast(_DECODED_SCHEMA)
        node_ids: list[str | None] = [None] * len(messages)
        seqs: list[int] = [0] * len(messages)
        if batch.records.num_rows:
            for at, node_id, seq in zip(
                *(batch.records[name].to_pylist() for name in ("_record", "node_id", "seq")),
                strict=True,
            ):
                node_ids[at], seqs[at] = node_id, seq
        kept = np.zeros(len(messages), dtype=bool)
        good: list[SourcedTelemetry] = []
        # A record without GPUs has no rows to range-check: its seq is checked here.
        singles.update(index for index, seq in enumerate(seqs) if seq < 0)
        for index, msg in enumerate(messages):
            record: dict[str, Any] | None = None
            if index in singles:
                record = self._decode_one(msg, dead)
                if record is None:
                    continue
                node_id, seq = record["node_id"], record["seq"]
            else:
                node_id, seq = node_ids[index], seqs[index]
            assert node_id is not None
            if seq <= self._seen.get(node_id, 0):
                self.stats.repeats += 1
                continue
            self._seen[node_id] = seq
            if record is not None:
                topic, partition, offset = where(msg)
                good.append(SourcedTelemetry(partition, offset, record, topic))
            else:
                kept[index] = True
        tables = [self._with_sources(samples, kept, messages)] if samples.num_rows else []
        if good:
            tables.append(to_columns(good))
        if not tables:
            return SAMPLE_SCHEMA.empty_table()
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables)

    @staticmethod
    def _with_sources(samples: pa.Table, kept: np.ndarray, messages: list[Message]) -> pa.Table:
        at = samples["_record"].to_numpy()
        if not kept[at].all():
            samples, at = samples.filter(kept[at]), at[kept[at]]
        sources = pa.table(
            {
                "source_partition": pa.array([m.partition() for m in messages], pa.uint16()),
                "source_offset": pa.array([m.offset() for m in messages], pa.uint64()),
                "source_topic": pa.array([m.topic() for m in messages], pa.string()),
            }
        ).take(at)
        return pa.table(
            [
                samples[name] if name in samples.column_names else sources[name]
                for name in SAMPLE_SCHEMA.names
            ],
            schema=SAMPLE_SCHEMA,
        )

    def _decode_one(
        self, msg: Message, dead: list[tuple[Message, FleetlineError]]
    ) -> dict[str, Any] | None:
        """One message the batch path left out: its record if it is good (another writer
        version, say), else None, with the reason in `dead`."""
        try:
            record = self.codec.decode(msg.value(), expect=NODE_TELEMETRY).record
            check_telemetry(record)
            check_ranges(record)
            return record
        except FleetlineError as exc:
            dead.append((msg, exc))
            return None


def _out_of_range(samples: pa.Table) -> pa.ChunkedArray | None:
    """Rows that break a rule Avro cannot express (check_telemetry's) or that do not fit their
    column (check_ranges'), or None when there are none."""
    bad = gpu_samples_broken({name: samples[name] for name in samples.column_names})
    for name, (low, high) in _INTEGER_RANGES.items():
        column = samples[name]
        wrong = pc.less(column, low)
        if high < 2**63 - 1:  # Avro's long can't exceed the wider ones
            wrong = pc.or_(wrong, pc.greater(column, high))
        bad = pc.or_(bad, pc.fill_null(wrong, False))
    bad = pc.fill_null(bad, False).combine_chunks()
    xids = samples["xid_codes"].combine_chunks()
    codes = pc.list_flatten(xids)
    wrong = pc.or_(pc.less(codes, 0), pc.greater(codes, _XID_MAX))
    if pc.any(wrong).as_py():
        rows = np.zeros(len(bad), dtype=bool)
        rows[pc.list_parent_indices(xids).filter(wrong).to_numpy()] = True
        bad = pc.or_(bad, pa.array(rows))
    return bad if pc.any(bad).as_py() else None


# The integer fields whose table column is narrower or unsigned than Avro's, and what fits.
_INTEGER_RANGES = {
    "seq": (0, 2**63 - 1),
    **{
        name: (0, 2**type_.bit_width - 1)
        for name, type_ in _GPU_FIELDS
        if pa.types.is_unsigned_integer(type_)
    },
}
_XID_MAX = 2**16 - 1


def check_ranges(record: dict[str, Any]) -> None:
    """Raise InvalidEventError if a GPU value does not fit its gpu_samples column (a negative
    counter, a GPU index over 255): Avro's int and long are wider than the table's columns."""
    if record["seq"] < 0:
        raise InvalidEventError(f"{record['node_id']} seq {record['seq']} is negative")
    for gpu in record["gpus"]:
        values = [
            (name, gpu.get(name), low, high)
            for name, (low, high) in _INTEGER_RANGES.items()
            if name != "seq"
        ]
        values += [("xid_codes", code, 0, _XID_MAX) for code in gpu.get("xid_codes") or ()]
        for name, value, low, high in values:
            if value is not None and not low <= value <= high:
                raise InvalidEventError(
                    f"{record['node_id']} seq {record['seq']} gpu {gpu.get('gpu_index')}: "
                    f"{name} {value} does not fit {low}-{high}"
                )
