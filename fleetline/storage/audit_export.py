"""Audit exports: JSON Lines, CSV or Parquet files that verify on their own.

An export holds the chain links of the range in log order: the reader's events with every
field's commitment (and value and field salt where the reader may see it), other tenants' links
as content-free stubs, and the signed digests, plus the public keys that signed them. `read` turns
any of the three formats back into the entries `processors.audit.verify` checks.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from fleetline.errors import ConfigError, IntegrityError

FORMATS = ("jsonl", "csv", "parquet")
_COLUMNS = ("partition", "seq", "kind", "prev_hash", "content_digest", "hash", "body")


def _keys_data(keys: Mapping[str, Ed25519PublicKey]) -> dict[str, str]:
    return {
        kid: key.public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
        for kid, key in sorted(keys.items())
    }


def _kind(entry: Mapping[str, Any]) -> str:
    return "stub" if entry.get("stub") else "digest" if "digest" in entry else "event"


def _flat(entry: Mapping[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in entry.items() if k not in _COLUMNS[:6] and k != "stub"}
    return {
        "partition": entry["partition"],
        "seq": entry["seq"],
        "kind": _kind(entry),
        "prev_hash": entry["prev_hash"],
        "content_digest": entry["content_digest"],
        "hash": entry["hash"],
        "body": json.dumps(body, sort_keys=True),
    }


def _unflat(row: Mapping[str, Any]) -> dict[str, Any]:
    entry = {
        "partition": int(row["partition"]),
        "seq": int(row["seq"]),
        "prev_hash": row["prev_hash"],
        "content_digest": row["content_digest"],
        "hash": row["hash"],
        **json.loads(row["body"]),
    }
    if row["kind"] == "stub":
        entry["stub"] = True
    return entry


Anchors = dict[int, tuple[int, bytes]]  # partition -> (first seq, its prev_hash)


def write(
    path: Path,
    fmt: str,
    entries: Iterable[Mapping[str, Any]],
    keys: Mapping[str, Ed25519PublicKey],
    anchors: Anchors | None = None,
) -> int:
    """Write an export; `anchors` says where each partition's range starts when it does not
    start at the chain's beginning (a signed digest later in the range vouches for it)."""
    if fmt not in FORMATS:
        raise ConfigError(f"export format {fmt!r}: choose one of {', '.join(FORMATS)}")
    rows = list(entries)
    header = {
        "fleetline_audit_export": 1,
        "public_keys": _keys_data(keys),
        "anchors": {
            str(p): [seq, prev.hex()] for p, (seq, prev) in sorted((anchors or {}).items())
        },
    }
    if fmt == "jsonl":
        with path.open("w") as out:
            out.write(json.dumps(header) + "\n")
            for entry in rows:
                out.write(json.dumps(entry, sort_keys=True) + "\n")
    elif fmt == "csv":
        with path.open("w", newline="") as out:
            out.write("# " + json.dumps(header) + "\n")
            writer = csv.DictWriter(out, fieldnames=list(_COLUMNS))
            writer.writeheader()
            writer.writerows(_flat(entry) for entry in rows)
    else:
        flat = [_flat(entry) for entry in rows]
        table = pa.table({name: [r[name] for r in flat] for name in _COLUMNS})
        table = table.replace_schema_metadata({"fleetline_audit_export": json.dumps(header)})
        pq.write_table(table, path, compression="zstd")
    return len(rows)


def read(path: Path) -> tuple[list[dict[str, Any]], dict[str, Ed25519PublicKey], Anchors]:
    """The entries of an export, the public keys it names, and its range anchors."""
    try:
        if path.suffix == ".parquet":
            table = pq.read_table(path)
            header = json.loads((table.schema.metadata or {})[b"fleetline_audit_export"])
            entries = [_unflat(row) for row in table.to_pylist()]
        elif path.suffix == ".csv":
            with path.open(newline="") as src:
                header = json.loads(src.readline().removeprefix("# "))
                entries = [_unflat(row) for row in csv.DictReader(src)]
        else:
            with path.open() as src:
                header = json.loads(src.readline())
                entries = [json.loads(line) for line in src if line.strip()]
    except (OSError, ValueError, KeyError) as exc:
        raise IntegrityError(f"{path}: not a readable audit export: {exc}") from None
    keys = {
        kid: Ed25519PublicKey.from_public_bytes(bytes.fromhex(raw))
        for kid, raw in header.get("public_keys", {}).items()
    }
    anchors = {
        int(p): (int(seq), bytes.fromhex(prev))
        for p, (seq, prev) in header.get("anchors", {}).items()
    }
    return entries, keys, anchors
