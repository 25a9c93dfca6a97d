"""The native Avro column decoder (`_avrocols.c`); driven by `avrocols.py`."""

from collections.abc import Sequence

# A decoded column: (values, offsets, validity, count, null_count) as Arrow buffers.
Column = tuple[bytes, bytes | None, bytes | None, int, int]

def decode(
    program: bytes,
    columns: Sequence[tuple[int, int, int]],
    header: bytes,
    values: Sequence[bytes | None],
    keys: Sequence[bytes | None] | None,
    key_column: int,
) -> tuple[list[Column], list[tuple[int, str]]]: ...
