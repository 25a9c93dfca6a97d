"""How a cold archive is encoded: integral float columns as integers, each column's encoding
chosen on a sample of it (dictionary, plain, byte-stream-split, delta), zstd."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

ARCHIVE_GROUP_ROWS = 1_000_000
# Rows an archive's column encodings are chosen on.
ARCHIVE_SAMPLE_ROWS = 100_000


def _encodings_to_try(kind: pa.DataType) -> list[str]:
    if pa.types.is_nested(kind):
        return ["DICT"]
    tries = ["DICT", "PLAIN"]
    if pa.types.is_floating(kind) or pa.types.is_integer(kind):
        tries.append("BYTE_STREAM_SPLIT")  # exponent and high bytes compress apart from noise
    if pa.types.is_integer(kind) or pa.types.is_timestamp(kind):
        tries.append("DELTA_BINARY_PACKED")  # times, offsets, counters
    if pa.types.is_string(kind) or pa.types.is_binary(kind):
        tries.append("DELTA_BYTE_ARRAY")
    return tries


def _trial_size(column: pa.ChunkedArray | pa.Array, encoding: str) -> int:
    options: dict[str, Any] = {"use_dictionary": encoding == "DICT"}
    if encoding not in ("DICT", "PLAIN"):
        options["column_encoding"] = {"x": encoding}
    out = pa.BufferOutputStream()
    # A fast zstd level ranks the encodings as the archive's level would, in a fraction of the
    # time.
    pq.write_table(
        pa.table({"x": column}),
        out,
        compression="zstd",
        compression_level=3,
        write_statistics=False,
        **options,
    )
    size: int = out.getvalue().size
    return size


def archive_layout(
    table: pa.Table, integral: Iterable[str] = ()
) -> tuple[pa.Schema, dict[str, Any]]:
    """The schema and Parquet writer options of a cold archive of rows like `table`'s (its
    first hour, say). Float columns named in `integral` (every value of the archive a whole
    number, no -0.0) are stored as int64: readers that give the table's structure, as every
    fleetline query does, get the same floats back, and integers compress better (NVML reports
    throughput in KiB, utilisation and temperature in whole units). Each column then gets the
    encoding that makes a sample of it smallest, of dictionary, plain, byte-stream-split,
    delta-packed and delta strings."""
    whole = set(integral)
    schema = pa.schema(
        [
            pa.field(f.name, pa.int64(), f.nullable)
            if f.name in whole and pa.types.is_floating(f.type)
            else f
            for f in table.schema
        ]
    )
    sample = table.slice(0, ARCHIVE_SAMPLE_ROWS).cast(schema)
    encodings: dict[str, str] = {}
    for column in schema:
        tries = _encodings_to_try(column.type)
        if len(tries) > 1:
            sizes = {encoding: _trial_size(sample[column.name], encoding) for encoding in tries}
            encodings[column.name] = min(tries, key=lambda encoding: sizes[encoding])
        else:
            encodings[column.name] = tries[0]
    chosen = {name: e for name, e in encodings.items() if e not in ("DICT", "PLAIN")}
    return schema, {
        "use_dictionary": [n for n, e in encodings.items() if e == "DICT"],
        "column_encoding": chosen or None,
    }


def whole_numbers_sql(column: str) -> str:
    """ClickHouse: true when the float `column` holds a whole number that int64 keeps exactly
    and that is not -0.0 (or is null)."""
    return (
        f"({column} IS NULL OR (isFinite({column}) AND {column} = trunc({column}) AND "
        f"abs({column}) < 9007199254740992 AND NOT ({column} = 0 AND "
        f"reinterpretAsUInt64(toFloat64({column})) != 0)))"
    )


def write_archive(path: str, hours: Iterable[pa.Table], whole: Sequence[str]) -> None:
    """One Parquet archive at `path` of the tables `hours` yields (read one at a time, an hour
    each and sorted, so memory holds an hour, not a day), written here rather than by
    ClickHouse, whose writer picks no encodings: the float columns in `whole` (every value of
    the archive a whole number) are stored as integers, and each column gets the encoding that
    compresses a sample of it best (`archive_layout`); zstd 19."""
    writer: pq.ParquetWriter | None = None
    pending: list[pa.Table] = []

    def flush() -> None:
        nonlocal writer
        table = pa.concat_tables(pending)
        pending.clear()
        if writer is None:
            schema, options = archive_layout(table, whole)
            writer = pq.ParquetWriter(
                path,
                schema,
                compression="zstd",
                compression_level=19,
                write_page_index=False,
                **options,
            )
        # A safe cast: a float that is not whole would fail here, never be rounded.
        writer.write_table(table.cast(writer.schema), row_group_size=ARCHIVE_GROUP_ROWS)

    try:
        for table in hours:
            pending.append(table)
            # Small hours are gathered into row groups of a useful size.
            if sum(t.num_rows for t in pending) >= ARCHIVE_GROUP_ROWS:
                flush()
        if pending:
            flush()
    finally:
        if writer is not None:
            writer.close()
