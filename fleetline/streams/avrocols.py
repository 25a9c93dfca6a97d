"""Avro single-object messages -> Arrow columns, decoded in one native pass (`_avrocols.c`).

A writer schema is compiled once into a flat program; the native decoder runs it over a whole
batch and appends every value to its column, so no Python object is made per value. Each message
is decoded on its own and must end exactly where its record ends; one that does not (or whose
key differs, or that another writer schema wrote) is left out of every column, not allowed to
shift the values after it, and listed with the reason, so the caller can take its per-record
path for just that message.

Columns are grouped by level: the top record's scalar fields are one table with a row per
message, and each array of records is a table with a row per item plus the offsets that say
which message each item belongs to. An array of scalars is a list column of its level.
Schemas this cannot run (a union other than null-or-scalar, a map, an enum, a fixed) raise
`Unsupported` when compiled; the caller keeps its other path for them.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from fleetline.streams import _avrocols  # built by the install (`_avrocols.pyi`)

(
    OP_INT,
    OP_LONG,
    OP_FLOAT,
    OP_DOUBLE,
    OP_BOOL,
    OP_STRING,
    OP_NULL,
    OP_UNION,
    OP_ARRAY,
    OP_SKIP_INT,
    OP_SKIP_FLOAT,
    OP_SKIP_DOUBLE,
    OP_SKIP_BOOL,
    OP_SKIP_STRING,
) = range(1, 15)

_SCALARS: dict[str, tuple[int, int, int, pa.DataType]] = {
    # avro type: (read op, skip op, value width, Arrow type)
    "int": (OP_INT, OP_SKIP_INT, 4, pa.int32()),
    "long": (OP_LONG, OP_SKIP_INT, 8, pa.int64()),
    "float": (OP_FLOAT, OP_SKIP_FLOAT, 4, pa.float32()),
    "double": (OP_DOUBLE, OP_SKIP_DOUBLE, 8, pa.float64()),
    "boolean": (OP_BOOL, OP_SKIP_BOOL, 1, pa.bool_()),
    "string": (OP_STRING, OP_SKIP_STRING, 0, pa.string()),
    "bytes": (OP_STRING, OP_SKIP_STRING, 0, pa.binary()),
}


def avro_long(value: int) -> bytes:
    """Avro's binary encoding of an int or long: zigzag, then a base-128 varint."""
    value = (value << 1) ^ (value >> 63)
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


# The reason the native decoder gives for a message another writer schema wrote (or that is
# not single-object Avro at all): a caller may decode those with another program.
OTHER_WRITER = "another writer schema or not single-object Avro"


class Unsupported(Exception):
    """The writer schema uses a construct the native decoder does not run."""


@dataclass(frozen=True)
class _Column:
    name: str  # the field's name within its level
    level: str  # "" for the top record, else the array's dotted path
    type: pa.DataType
    width: int  # of one value in the native buffers; 0 for strings
    # "scalar"; "items" (the values of an array of scalars); "list" (an array of scalars: its
    # end offsets, and `ref` is its items column); "ends" (an array of records: the end offset
    # of each parent row's items; its items are the level `child`).
    kind: str = "scalar"
    ref: int = -1
    child: str = ""


@dataclass(frozen=True)
class Decoded:
    """A decoded batch: one table per level, for each array-of-records level the end offset of
    each parent row's items (row i's items are ends[i-1]:ends[i]), and the messages left out
    (their index in the batch, and why). The top level has a row per message decoded, in order."""

    tables: dict[str, pa.Table]
    ends: dict[str, np.ndarray]
    failed: dict[int, str]
    messages: int

    def indices(self) -> np.ndarray:
        """For each top-level row, the index in the batch of the message it was decoded from."""
        everything = np.arange(self.messages, dtype=np.uint32)
        return np.delete(everything, list(self.failed)) if self.failed else everything

    def parents(self, level: str) -> np.ndarray:
        """For each row of `level`, the index of the top-level row it belongs to."""
        ends = self.ends[level]
        lengths = np.diff(ends, prepend=0)
        return np.repeat(np.arange(len(ends), dtype=np.uint32), lengths)


class Program:
    """A writer schema compiled for the native decoder, keeping the fields `wanted` says."""

    def __init__(
        self,
        schema: dict[str, Any],
        header: bytes,
        wanted: Callable[[str], bool] = lambda path: True,
    ) -> None:
        self.header = header
        self._wanted = wanted
        self._named: dict[str, Any] = {}
        self._open: set[str] = set()  # records being compiled, to refuse recursive ones
        self._columns: list[_Column] = []
        self._code: list[tuple[int, int, int, int]] = []
        self._record(schema, "", "")
        code = [(op, col, a, self._extent(at)) for at, (op, col, a, _) in enumerate(self._code)]
        self._packed = array.array("i", [v for ins in code for v in ins]).tobytes()
        self._per_message = [(0.0, 0.0)] * len(self._columns)
        self._levels = [""] + [c.child for c in self._columns if c.kind == "ends"]

    def types(self, level: str) -> dict[str, pa.DataType]:
        """The Arrow type of each field of `level` that is decoded."""
        return {
            c.name: c.type
            for c in self._columns
            if c.level == level and c.kind in ("scalar", "list")
        }

    def _add(
        self,
        name: str,
        level: str,
        type_: pa.DataType,
        width: int,
        kind: str = "scalar",
        ref: int = -1,
        child: str = "",
    ) -> int:
        self._columns.append(_Column(name, level, type_, width, kind, ref, child))
        return len(self._columns) - 1

    def _resolve(self, node: Any) -> Any:
        if isinstance(node, str) and node in self._named:
            return self._named[node]
        if isinstance(node, dict) and node.get("type") in ("record", "enum", "fixed"):
            self._named[node["name"]] = node
            if "namespace" in node:
                self._named[f"{node['namespace']}.{node['name']}"] = node
        return node

    def _record(self, node: dict[str, Any], prefix: str, level: str) -> None:
        self._resolve(node)
        if node["name"] in self._open:
            raise Unsupported(f"{prefix or node['name']}: a record that contains itself")
        self._open.add(node["name"])
        for field in node["fields"]:
            self._field(field["type"], f"{prefix}{field['name']}", level)
        self._open.discard(node["name"])

    def _field(self, node: Any, path: str, level: str) -> None:
        node = self._resolve(node)
        kind = node["type"] if isinstance(node, dict) else node
        if isinstance(node, list):
            self._union(node, path, level)
        elif isinstance(kind, str) and kind in _SCALARS:
            self._scalar(kind, path, level)
        elif kind == "record":
            self._record(node, f"{path}.", level)
        elif kind == "array":
            self._array(node["items"], path, level)
        else:
            raise Unsupported(f"{path}: {kind!r}")

    def _name(self, path: str, level: str) -> str:
        return path[len(level) + 1 :] if level else path

    def _scalar(self, kind: str, path: str, level: str) -> None:
        read, skip, width, type_ = _SCALARS[kind]
        if self._wanted(path):
            self._code.append((read, self._add(self._name(path, level), level, type_, width), 0, 0))
        else:
            self._code.append((skip, -1, 0, 0))

    def _union(self, branches: list[Any], path: str, level: str) -> None:
        branches = [self._resolve(b) for b in branches]
        values = [b for b in branches if b != "null"]
        if (
            len(values) != 1
            or len(branches) != 2
            or not isinstance(values[0], str)
            or values[0] not in _SCALARS
        ):
            raise Unsupported(f"{path}: union {branches!r} is not null or one scalar")
        read, skip, width, type_ = _SCALARS[values[0]]
        col = self._add(self._name(path, level), level, type_, width) if self._wanted(path) else -1
        self._code.append((OP_UNION, -1, 2, 0))
        for branch in branches:
            if branch == "null":
                self._code.append((OP_NULL, col, 0, 0))
            else:
                self._code.append((read if col >= 0 else skip, col, 0, 0))

    def _array(self, items: Any, path: str, level: str) -> None:
        items = self._resolve(items)
        name = self._name(path, level)
        ends = self._add(name, level, pa.int32(), 4, "ends", child=path)
        at = len(self._code)
        self._code.append((OP_ARRAY, ends, 0, 0))
        first = len(self._code)
        if isinstance(items, dict) and items.get("type") == "record":
            self._record(items, f"{path}.", path)
        elif isinstance(items, str) and items in _SCALARS:
            read, _, width, type_ = _SCALARS[items]
            item = self._add(f"{name}[]", level, type_, width, "items")
            self._code.append((read, item, 0, 0))
            self._columns[ends] = _Column(name, level, pa.list_(type_), 4, "list", ref=item)
        else:
            raise Unsupported(f"{path}: array of {items!r}")
        # The body is the next top-level instructions up to here: count them for the decoder.
        body, index = 0, first
        while index < len(self._code):
            index += self._extent(index)
            body += 1
        self._code[at] = (OP_ARRAY, ends, body, 0)

    def _extent(self, at: int) -> int:
        op, _, a, _ = self._code[at]
        if op in (OP_UNION, OP_ARRAY):
            n = 1
            for _ in range(a):
                n += self._extent(at + n)
            return n
        return 1

    def decode(
        self,
        values: Sequence[bytes | None],
        keys: Sequence[bytes | None] | None = None,
        key_field: str | None = None,
    ) -> Decoded:
        """Every message that decodes, and which did not and why. With `key_field`, that
        top-level string field must equal each message's key."""
        key_column = -1
        if key_field is not None:
            key_column = next(
                i for i, c in enumerate(self._columns) if c.level == "" and c.name == key_field
            )
        # Each column's buffers are sized from the previous batch's, per message.
        hints = [
            (c.width, int(size * 1.1 * len(values)) + 64, int(count * 1.1 * len(values)) + 8)
            for c, (size, count) in zip(self._columns, self._per_message, strict=True)
        ]
        columns, failures = _avrocols.decode(
            self._packed, hints, self.header, values, keys, key_column
        )
        if len(values) > len(failures):
            self._per_message = [
                (len(data) / len(values), count / len(values)) for data, _, _, count, _ in columns
            ]
        arrays: dict[int, pa.Array] = {}
        ends: dict[str, np.ndarray] = {}  # by level, for the arrays of records
        list_ends: dict[int, np.ndarray] = {}  # by column, for the arrays of scalars
        for index, column in enumerate(self._columns):
            data, offsets, valid, count, nulls = columns[index]
            validity = None if valid is None else pa.py_buffer(valid)
            if column.kind == "ends":
                ends[column.child] = np.frombuffer(data, np.int32)
            elif column.kind == "list":
                list_ends[index] = np.frombuffer(data, np.int32)
            elif column.width == 0:
                arrays[index] = pa.Array.from_buffers(
                    column.type,
                    count,
                    [validity, pa.py_buffer(offsets), pa.py_buffer(data)],
                    null_count=nulls,
                )
            elif pa.types.is_boolean(column.type):  # a byte per value; Arrow's are bits
                arrays[index] = pa.Array.from_buffers(
                    pa.uint8(), count, [validity, pa.py_buffer(data)], null_count=nulls
                ).cast(pa.bool_())
            else:
                arrays[index] = pa.Array.from_buffers(
                    column.type, count, [validity, pa.py_buffer(data)], null_count=nulls
                )
        tables: dict[str, dict[str, pa.Array]] = {level: {} for level in self._levels}
        for index, column in enumerate(self._columns):
            if column.kind == "scalar":
                tables[column.level][column.name] = arrays[index]
            elif column.kind == "list":
                offsets = pa.array(np.concatenate(([0], list_ends[index])), pa.int32())
                tables[column.level][column.name] = pa.ListArray.from_arrays(
                    offsets, arrays[column.ref]
                )
        return Decoded(
            {level: pa.table(cols) for level, cols in tables.items()},
            ends,
            dict(failures),
            len(values),
        )
