"""Batch decoding of NodeTelemetry: many single-object messages at once, in native code.

fastavro decodes one 8-GPU record in ~150-200 us, which caps a fold near 45,000 GPU samples/s.
The native column decoder (streams/avrocols.py) reads a whole batch into Arrow columns at about
0.4 us per GPU sample. Each message is decoded on its own and must be consumed exactly, and every
record's node_id must equal its message key (telemetry is keyed by node). A batch that fails any
check, or mixes writer versions, is not used: the caller decodes it record by record, so a bad
message is named and dead-lettered exactly as the per-record path would.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from fleetline.errors import UnknownSchemaError
from fleetline.streams.avrocols import OTHER_WRITER, Decoded, Program, Unsupported
from fleetline.streams.events import NODE_TELEMETRY
from fleetline.streams.serde import HEADER_LEN, MAGIC, AvroCodec
from fleetline.streams.telemetry_rules import RULE_FIELDS, gpu_samples_broken

# Shared by every sample without XIDs; the fold never mutates a sample's lists.
_EMPTY: list[int] = []
_RECORD_FIELDS = ("cluster_id", "region", "node_id", "seq", "ts")

GpuRow = TypeVar("GpuRow")
# One decoded NodeTelemetry, reduced to what the view folds: (cluster_id, region, node_id, seq,
# ts, [one row of the requested GPU fields per GPU, made by the decoder's `gpu_row`]).
TelemetryRow = tuple[str, str, str, int, int, list[GpuRow]]


def _sparse_lists(column: pa.ChunkedArray | pa.Array) -> list[Any]:
    """A list column that is nearly always empty (XID events) as Python lists, building only
    the non-empty ones: converting every empty list costs more than the rest of the row."""
    out: list[Any] = [_EMPTY] * len(column)
    filled = np.flatnonzero(pc.list_value_length(column).to_numpy(zero_copy_only=False) > 0)
    if len(filled):
        for at, value in zip(filled.tolist(), column.take(filled).to_pylist(), strict=True):
            out[at] = value
    return out


def _vouched(arrays: Mapping[str, Any], ends: np.ndarray) -> list[bool]:
    """For each record (its GPU rows end at `ends`), whether every sample keeps the rules
    beyond the schema (`telemetry_rules`), judged on the whole batch at once; all True when the
    fields the rules read were not asked for (the reader checks them itself)."""
    if not arrays.keys() >= RULE_FIELDS:
        return [True] * len(ends)
    broken = pc.fill_null(gpu_samples_broken(arrays), False)
    counts = np.concatenate([[0], np.cumsum(broken.to_numpy(zero_copy_only=False))])
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    clean: list[bool] = (counts[ends.astype(np.int64)] - counts[starts] == 0).tolist()
    return clean


@dataclass(frozen=True)
class SampleBatch:
    """A batch decoded in native code. `records` has a row per message decoded: `_record` (its
    index in the batch), cluster_id, region, node_id, seq, ts; `samples` a row per GPU of those:
    `_record`, the record's fields, then the GPU fields asked for. `failed` names the messages
    the native path could not read (their index, and why): the per-record path's to name."""

    records: pa.Table
    samples: pa.Table
    failed: dict[int, str]


@dataclass(frozen=True)
class Repeats:
    """What makes a record a repeat of its node's previous record in the batch, which a reader
    may fold without its GPU rows: the same cluster, a higher seq, as many GPUs, the `same`
    GPU fields equal row for row, and every GPU row `quiet` (for the batch's GPU columns, a
    boolean per row: a reading the reader takes no action on)."""

    same: tuple[str, ...]
    quiet: Callable[[Mapping[str, Any]], np.ndarray]


class Deferred(Generic[GpuRow]):
    """A repeat's GPU rows, made when asked for (`rows()`)."""

    __slots__ = ("_arrays", "_decoder", "_end", "_start")

    def __init__(
        self,
        decoder: TelemetryBatchDecoder[GpuRow],
        arrays: Mapping[str, Any],
        start: int,
        end: int,
    ) -> None:
        self._decoder, self._arrays, self._start, self._end = decoder, arrays, start, end

    def rows(self) -> list[GpuRow]:
        length = self._end - self._start
        return self._decoder._gpu_rows(
            {n: c.slice(self._start, length) for n, c in self._arrays.items()}
        )


# A TelemetryRow whose GPU rows may be deferred (`TelemetryBatchDecoder.decode_repeats`).
FoldRow = tuple[str, str, str, int, int, "list[GpuRow] | Deferred[GpuRow]"]


def _deferred(
    repeats: Repeats,
    arrays: Mapping[str, Any],
    starts: np.ndarray,
    ends: np.ndarray,
    vouched: list[bool],
    clusters: list[str],
    node_ids: list[str],
    seqs: list[int],
) -> np.ndarray:
    """For each record, whether its GPU rows need not be made: it repeats its node's previous
    (vouched) record in the batch, and so does the node's next record."""
    count = len(ends)
    previous = np.full(count, -1, dtype=np.int64)
    last: dict[str, int] = {}
    for i, node_id in enumerate(node_ids):
        if not vouched[i]:
            continue
        before = last.get(node_id)
        if before is not None and clusters[before] == clusters[i] and seqs[i] > seqs[before]:
            previous[i] = before
        last[node_id] = i
    lengths = ends.astype(np.int64) - starts
    candidate = previous >= 0
    candidate[candidate] &= lengths[candidate] == lengths[previous[candidate]]
    repeat = np.zeros(count, dtype=bool)
    if candidate.any():
        which = np.flatnonzero(candidate)
        sizes = lengths[which]
        # Each candidate's GPU rows beside its previous record's, row for row.
        offsets = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        mine = np.repeat(starts[which], sizes) + offsets
        theirs = np.repeat(starts[previous[which]], sizes) + offsets
        good = np.asarray(repeats.quiet(arrays), dtype=bool)[mine]
        for name in repeats.same:
            column = arrays[name]
            a, b = column.take(pa.array(mine)), column.take(pa.array(theirs))
            equal = pc.fill_null(pc.equal(a, b), False)
            both_null = pc.and_(pc.is_null(a), pc.is_null(b))
            good &= pc.or_(equal, both_null).to_numpy(zero_copy_only=False)
        bad = np.concatenate([[0], np.cumsum(~good)])
        ends_at = np.cumsum(sizes)
        repeat[which] = bad[ends_at] - bad[ends_at - sizes] == 0
    # The last repeat of a row keeps its GPU rows: the reader folds it whole.
    followed = np.zeros(count, dtype=bool)  # the node's next record repeats this one
    followed[previous[repeat]] = True  # (a repeat always has a previous record)
    return repeat & followed


class TelemetryBatchDecoder(Generic[GpuRow]):
    """Decodes lists of NodeTelemetry messages into Arrow columns or TelemetryRows, whose GPU
    rows `gpu_row` makes from a tuple of the `gpu_fields` (a reader's record type)."""

    def __init__(
        self,
        codec: AvroCodec,
        gpu_fields: Sequence[str],
        gpu_row: Callable[[tuple[Any, ...]], GpuRow],
    ) -> None:
        self.codec = codec
        self.gpu_fields = tuple(gpu_fields)
        self.gpu_row = gpu_row
        newest = codec.registry.latest(NODE_TELEMETRY)
        gpu_schema = next(f for f in newest.source["fields"] if f["name"] == "gpus")
        self._defaults = {
            f["name"]: f.get("default") for f in gpu_schema["type"]["items"]["fields"]
        }
        self._programs: dict[bytes, Program | None] = {}
        # An older writer's missing GPU fields get the newest schema's default, in its type.
        newest_program = self._program(newest.fingerprint)
        assert newest_program is not None, "the newest NodeTelemetry must be natively decodable"
        self._types = newest_program.types("gpus")

    def _program(self, fingerprint: bytes) -> Program | None:
        if fingerprint not in self._programs:
            try:
                writer = self.codec.registry.by_fingerprint(fingerprint)
            except UnknownSchemaError:
                writer = None
            program = None
            if writer is not None and writer.full_name == NODE_TELEMETRY:
                wanted = {*_RECORD_FIELDS, *(f"gpus.{name}" for name in self.gpu_fields)}
                try:
                    program = Program(
                        json.loads(writer.canonical),
                        MAGIC + fingerprint,
                        lambda path: path in wanted,
                    )
                except Unsupported:
                    program = None
            self._programs[fingerprint] = program
        return self._programs[fingerprint]

    def _parts(
        self, keys: Sequence[bytes | None], values: Sequence[bytes | None]
    ) -> tuple[list[tuple[np.ndarray, Decoded]], dict[int, str]]:
        """The batch decoded by writer schema: each part with the batch index of each of its
        top-level rows; and the messages not decoded, with the reason."""
        parts: list[tuple[np.ndarray, Decoded]] = []
        failed: dict[int, str] = {}
        # Nearly always one writer wrote the whole batch: try that first, then group the rest.
        pending = [np.arange(len(values))]
        while pending:
            at = pending.pop()
            head = values[int(at[0])]
            program = None
            if head is not None and len(head) >= HEADER_LEN and head[:2] == MAGIC:
                program = self._program(head[2:HEADER_LEN])
            if program is None:
                failed[int(at[0])] = "not a NodeTelemetry the batch decoder reads"
                if len(at) > 1:
                    pending.append(at[1:])
                continue
            whole = len(at) == len(values)
            decoded = program.decode(
                values if whole else [values[int(i)] for i in at],
                keys if whole else [keys[int(i)] for i in at],
                "node_id",
            )
            parts.append((at[decoded.indices()], decoded))
            others = [i for i, why in decoded.failed.items() if why == OTHER_WRITER]
            failed.update(
                (int(at[i]), why) for i, why in decoded.failed.items() if why != OTHER_WRITER
            )
            if others:
                pending.append(at[others])
        return parts, failed

    def _gpu_columns(self, decoded: Decoded, gpu_fields: Sequence[str]) -> dict[str, Any]:
        """The requested GPU fields, an older writer's missing ones as the newest schema's
        defaults (as Avro schema resolution gives)."""
        gpus = decoded.tables["gpus"]
        columns: dict[str, Any] = {}
        for name in gpu_fields:
            if name in gpus.column_names:
                columns[name] = gpus[name]
            else:
                default = self._defaults[name]
                columns[name] = (
                    pa.nulls(gpus.num_rows, self._types[name])
                    if default is None
                    else pa.array([default] * gpus.num_rows, self._types[name])
                )
        return columns

    def decode(
        self, keys: Sequence[bytes | None], values: Sequence[bytes | None]
    ) -> list[TelemetryRow[GpuRow] | None]:
        """A row for each message, in order; None for a message the batch path could not read
        (malformed, another record, a schema it does not run), which the caller reads record
        by record, naming it if it is bad."""
        return self._rows(keys, values, None)  # type: ignore[return-value]  # no repeats asked

    def decode_repeats(
        self, keys: Sequence[bytes | None], values: Sequence[bytes | None], repeats: Repeats
    ) -> list[FoldRow[GpuRow] | None]:
        """As `decode`, but a record that repeats its node's previous record in the batch (as
        `repeats` says) carries a `Deferred` in place of its GPU rows, unless it is the last of
        its node's repeats in a row: its rows are then made only if the reader asks."""
        return self._rows(keys, values, repeats)

    def _rows(
        self,
        keys: Sequence[bytes | None],
        values: Sequence[bytes | None],
        repeats: Repeats | None,
    ) -> list[FoldRow[GpuRow] | None]:
        out: list[FoldRow[GpuRow] | None] = [None] * len(values)
        parts, _ = self._parts(keys, values) if values else ([], {})
        for indices, decoded in parts:
            arrays = self._gpu_columns(decoded, self.gpu_fields)
            ends = decoded.ends["gpus"]
            vouched = _vouched(arrays, ends)
            top = decoded.tables[""]
            clusters, regions, node_ids, seqs, stamps = (
                top[name].to_pylist() for name in _RECORD_FIELDS
            )
            starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
            deferred = (
                _deferred(repeats, arrays, starts, ends, vouched, clusters, node_ids, seqs)
                if repeats is not None and len(parts) == 1
                else None
            )
            if deferred is not None and deferred.any():
                wanted = np.flatnonzero(~np.repeat(deferred, ends - starts))
                rows = self._gpu_rows({n: c.take(wanted) for n, c in arrays.items()})
                # Where each kept record's rows begin among the rows made.
                kept = np.concatenate([[0], np.cumsum(np.where(deferred, 0, ends - starts))])
                made_at = kept[:-1].tolist()
            else:
                rows = self._gpu_rows(arrays)
                made_at = starts.tolist()
            flags = deferred.tolist() if deferred is not None else [False] * len(ends)
            for i, (index, start, end) in enumerate(
                zip(indices.tolist(), starts.tolist(), ends.tolist(), strict=True)
            ):
                if not vouched[i]:  # a sample breaks a rule: the per-record path names it
                    continue
                gpus: list[GpuRow] | Deferred[GpuRow]
                if flags[i]:
                    gpus = Deferred(self, arrays, start, end)
                else:
                    at = made_at[i]
                    gpus = rows[at : at + end - start]
                out[index] = (clusters[i], regions[i], node_ids[i], seqs[i], stamps[i], gpus)
        return out

    def _gpu_rows(self, arrays: Mapping[str, Any]) -> list[GpuRow]:
        columns: list[list[Any]] = []
        for column in arrays.values():
            if pa.types.is_list(column.type):
                columns.append(_sparse_lists(column))
            else:
                columns.append(column.to_pylist())
        return list(map(self.gpu_row, zip(*columns, strict=True)))

    def samples(
        self,
        keys: Sequence[bytes | None],
        values: Sequence[bytes | None],
        gpu_fields: Sequence[str],
    ) -> SampleBatch:
        """The batch as records and GPU samples (see SampleBatch)."""
        records, samples = [], []
        parts, failed = self._parts(keys, values) if values else ([], {})
        for indices, decoded in parts:
            top = decoded.tables[""].select(list(_RECORD_FIELDS))
            records.append(top.add_column(0, "_record", pa.array(indices)))
            parents = decoded.parents("gpus")
            per_gpu = top.take(parents)
            samples.append(
                pa.table(
                    {
                        "_record": pa.array(indices[parents]),
                        **{name: per_gpu[name] for name in _RECORD_FIELDS},
                        **self._gpu_columns(decoded, gpu_fields),
                    }
                )
            )
        if not parts:
            return SampleBatch(pa.table({}), pa.table({}), failed)
        return SampleBatch(pa.concat_tables(records), pa.concat_tables(samples), failed)
