"""The tamper-evident audit log's pure core: field commitments, chain links, signed digests,
verification and masking.

Each partition of the audit topic is one hash chain. A link's `content_digest` is SHA-256 over
the commitments of its fields, each field's commitment keyed by a salt derived from the event's
random salt, and `hash = SHA-256(prev_hash || content_digest)`. Every so many links the chainer
appends a digest link whose Ed25519 signature covers (partition, seq, hash). So:

- editing a field breaks its commitment (or, if recomputed, the link's hash);
- deleting, inserting or reordering links breaks `seq` continuity or `prev_hash`;
- rewriting the whole tail consistently is caught by the next signed digest, which needs the
  private key;
- a masked export keeps the commitment of each hidden field and drops its value and salt, so it
  still verifies end to end while revealing nothing of what was hidden.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

EVENT_FIELDS = (
    "event_id",
    "ts",
    "actor",
    "actor_role",
    "tenant",
    "operation",
    "target",
    "outcome",
    "status",
    "request_id",
    "trace_id",
    "source",
)
DIGEST_FIELDS = ("covers_seq", "covers_hash", "key_id", "algorithm", "signature")
# Keys in `details` whose values only privileged roles may see (exports, responses, logs).
SENSITIVE_MARKERS = (
    "token",
    "secret",
    "password",
    "credential",
    "authorization",
    "api_key",
    "apikey",
    "private",
    "email",
    "phone",
    "ssn",
)


def is_sensitive(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in SENSITIVE_MARKERS)


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def genesis(partition: int) -> bytes:
    """The prev_hash of a partition's first link: chains cannot be moved between partitions."""
    return hashlib.sha256(f"fleetline.audit/genesis/{partition}".encode()).digest()


def field_salt(salt: bytes, name: str) -> bytes:
    return hmac.new(salt, name.encode(), hashlib.sha256).digest()


def commitment(salt: bytes, name: str, value: Any) -> str:
    return hashlib.sha256(field_salt(salt, name) + _canonical(value)).hexdigest()


def event_fields(event: Mapping[str, Any]) -> dict[str, Any]:
    """The committed fields of an event: the top-level ones and one per `details` entry."""
    out = {name: event[name] for name in EVENT_FIELDS}
    for key, value in event["details"].items():
        out[f"details.{key}"] = value
    return out


def event_commitments(event: Mapping[str, Any]) -> dict[str, str]:
    salt = event["salt"]
    return {name: commitment(salt, name, value) for name, value in event_fields(event).items()}


def digest_content(digest: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "covers_seq": digest["covers_seq"],
        "covers_hash": digest["covers_hash"].hex(),
        "key_id": digest["key_id"],
        "algorithm": digest["algorithm"],
        "signature": digest["signature"].hex(),
    }


def content_digest_of(
    commitments: Mapping[str, str] | None = None, digest: Mapping[str, Any] | None = None
) -> bytes:
    payload = {"event": commitments} if commitments is not None else {"digest": digest}
    return hashlib.sha256(_canonical(payload)).digest()


def link_hash(prev_hash: bytes, content_digest: bytes) -> bytes:
    return hashlib.sha256(prev_hash + content_digest).digest()


def signed_message(partition: int, seq: int, chain_hash: bytes) -> bytes:
    return f"fleetline.audit.digest/v1|{partition}|{seq}|{chain_hash.hex()}".encode()


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class Signer:
    private_key: Ed25519PrivateKey

    @property
    def key_id(self) -> str:
        return key_id(self.private_key.public_key())

    def sign(self, partition: int, seq: int, chain_hash: bytes) -> bytes:
        return self.private_key.sign(signed_message(partition, seq, chain_hash))


@dataclass
class ChainHead:
    """Where a partition's chain stands: the chainer's whole state for that partition."""

    next_seq: int
    last_hash: bytes
    since_digest: int = 0
    chained_at: int = 0

    def as_data(self) -> dict[str, Any]:
        return {
            "next_seq": self.next_seq,
            "last_hash": self.last_hash.hex(),
            "since_digest": self.since_digest,
            "chained_at": self.chained_at,
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> ChainHead:
        return cls(
            data["next_seq"],
            bytes.fromhex(data["last_hash"]),
            data["since_digest"],
            data["chained_at"],
        )


def chain_event(
    head: ChainHead | None,
    partition: int,
    event: Mapping[str, Any],
    signer: Signer,
    digest_every: int,
) -> tuple[ChainHead, list[dict[str, Any]]]:
    """Link one event into the partition's chain: the new head and the AuditRecords to append
    (the event's link and, every `digest_every` links, a signed digest after it)."""
    head = head or ChainHead(0, genesis(partition))
    chained_at = max(head.chained_at, event["ts"])
    content = content_digest_of(event_commitments(event))
    record = {
        "partition": partition,
        "seq": head.next_seq,
        "prev_hash": head.last_hash,
        "content_digest": content,
        "hash": link_hash(head.last_hash, content),
        "chained_at": chained_at,
        "event": dict(event),
        "digest": None,
    }
    head = ChainHead(head.next_seq + 1, record["hash"], head.since_digest + 1, chained_at)
    records = [record]
    if head.since_digest >= digest_every:
        covers = head.next_seq - 1
        digest = {
            "covers_seq": covers,
            "covers_hash": head.last_hash,
            "key_id": signer.key_id,
            "algorithm": "Ed25519",
            "signature": signer.sign(partition, covers, head.last_hash),
        }
        content = content_digest_of(digest=digest_content(digest))
        link = {
            "partition": partition,
            "seq": head.next_seq,
            "prev_hash": head.last_hash,
            "content_digest": content,
            "hash": link_hash(head.last_hash, content),
            "chained_at": chained_at,
            "event": None,
            "digest": digest,
        }
        records.append(link)
        head = ChainHead(head.next_seq + 1, link["hash"], 0, chained_at)
    return head, records


# --- exports -------------------------------------------------------------------------------


def export_entry(record: Mapping[str, Any], reveal_sensitive: bool) -> dict[str, Any]:
    """A record as plain JSON data with what a verifier needs: every field's commitment, and
    the value and field salt of each field the reader may see."""
    entry: dict[str, Any] = {
        "partition": record["partition"],
        "seq": record["seq"],
        "prev_hash": record["prev_hash"].hex(),
        "content_digest": record["content_digest"].hex(),
        "hash": record["hash"].hex(),
        "chained_at": record["chained_at"],
    }
    if record["digest"] is not None:
        entry["digest"] = digest_content(record["digest"])
        return entry
    event = record["event"]
    fields = event_fields(event)
    commitments = event_commitments(event)
    values: dict[str, Any] = {}
    salts: dict[str, str] = {}
    for name, value in fields.items():
        hidden = name.startswith("details.") and is_sensitive(name) and not reveal_sensitive
        if hidden:
            continue
        values[name] = value
        salts[name] = field_salt(event["salt"], name).hex()
    entry["event"] = {
        "values": values,
        "field_salts": salts,
        "commitments": commitments,
        "masked": sorted(set(fields) - set(values)),
    }
    return entry


def stub_entry(record: Mapping[str, Any]) -> dict[str, Any]:
    """A link the reader may not see (another tenant's event): enough to keep the chain
    checkable, nothing of its content."""
    return {
        "partition": record["partition"],
        "seq": record["seq"],
        "prev_hash": record["prev_hash"].hex(),
        "content_digest": record["content_digest"].hex(),
        "hash": record["hash"].hex(),
        "stub": True,
    }


def masked_event(event: Mapping[str, Any], reveal_sensitive: bool) -> dict[str, Any]:
    """An event for display (search results, API): sensitive details shown as ***."""
    out = {name: event[name] for name in EVENT_FIELDS}
    out["details"] = {
        k: (v if reveal_sensitive or not is_sensitive(k) else "***")
        for k, v in event["details"].items()
    }
    return out


# --- verification --------------------------------------------------------------------------


@dataclass
class VerifyReport:
    checked: int = 0
    digests: int = 0
    partitions: dict[int, int] = field(default_factory=dict)  # partition -> last seq seen
    first_broken: str | None = None
    unsigned_tail: dict[int, int] = field(default_factory=dict)  # partition -> links after
    #   the last verified digest

    @property
    def ok(self) -> bool:
        return self.first_broken is None


class _Broken(Exception):
    pass


def _entry_content_digest(entry: Mapping[str, Any]) -> bytes:
    if entry.get("stub"):
        return bytes.fromhex(entry["content_digest"])
    if "digest" in entry:
        return content_digest_of(digest=entry["digest"])
    event = entry["event"]
    commitments = event["commitments"]
    for name, value in event["values"].items():
        salt = bytes.fromhex(event["field_salts"][name])
        if commitments.get(name) != hashlib.sha256(salt + _canonical(value)).hexdigest():
            raise _Broken(f"field {name} does not match its commitment (edited)")
    if set(commitments) != set(event["values"]) | set(event["masked"]):
        raise _Broken("the committed field names differ from the fields present")
    return content_digest_of(commitments)


def verify(
    entries: Iterable[Mapping[str, Any]],
    public_keys: Mapping[str, Ed25519PublicKey],
    anchors: Mapping[int, tuple[int, bytes]] | None = None,
) -> VerifyReport:
    """Check export entries (`export_entry` form) in log order per partition.

    Each partition starts at its genesis, or at `anchors[p] = (seq, prev_hash)` for a range
    that begins mid-chain. The first broken link is named; links after the last digest that
    verified are counted as an unsigned tail (intact as far as hashes go, not yet signed).
    """
    report = VerifyReport()
    expect: dict[int, tuple[int, bytes]] = dict(anchors or {})
    signed_up_to: dict[int, int] = {}
    for entry in entries:
        p, seq = entry["partition"], entry["seq"]
        where = f"partition {p} seq {seq}"
        try:
            next_seq, prev = expect.get(p, (0, genesis(p)))
            if seq != next_seq:
                if seq > next_seq:
                    raise _Broken(
                        f"expected seq {next_seq}: {seq - next_seq} link(s) missing (deleted)"
                    )
                raise _Broken(f"expected seq {next_seq}: a link was inserted or reordered")
            if bytes.fromhex(entry["prev_hash"]) != prev:
                raise _Broken(
                    "prev_hash is not the previous link's hash (inserted, deleted or reordered)"
                )
            content = _entry_content_digest(entry)
            if content.hex() != entry["content_digest"]:
                raise _Broken("content does not match content_digest (edited)")
            chain_hash = link_hash(prev, content)
            if chain_hash.hex() != entry["hash"]:
                raise _Broken("hash is not SHA-256(prev_hash || content_digest)")
            if "digest" in entry:
                d = entry["digest"]
                key = public_keys.get(d["key_id"])
                if key is None:
                    raise _Broken(f"digest signed by unknown key {d['key_id']}")
                if d["covers_seq"] != seq - 1 or d["covers_hash"] != prev.hex():
                    raise _Broken("digest does not cover the link before it")
                try:
                    key.verify(
                        bytes.fromhex(d["signature"]), signed_message(p, d["covers_seq"], prev)
                    )
                except InvalidSignature:
                    raise _Broken(
                        "digest signature does not verify (forged or altered chain)"
                    ) from None
                report.digests += 1
                signed_up_to[p] = seq
        except _Broken as exc:
            report.first_broken = f"{where}: {exc}"
            return report
        expect[p] = (seq + 1, chain_hash)
        report.checked += 1
        report.partitions[p] = seq
    for p, last in report.partitions.items():
        tail = last - signed_up_to.get(p, -1)
        if tail:
            report.unsigned_tail[p] = tail
    return report


def export_window(
    records: list[dict[str, Any]],
    tenant: str | None,
    since_ms: int | None,
    until_ms: int | None,
    reveal_sensitive: bool,
) -> tuple[list[dict[str, Any]], dict[int, tuple[int, bytes]]]:
    """The export entries for a tenant (None: all) and time range, and the anchors where a
    partition's window starts mid-chain. Within each partition's window, from the first
    matching event to the last, links the reader may not see are stubs and digests are kept,
    so the window verifies as a whole."""
    by_partition: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        by_partition.setdefault(record["partition"], []).append(record)
    entries: list[dict[str, Any]] = []
    anchors: dict[int, tuple[int, bytes]] = {}

    def matches(record: dict[str, Any]) -> bool:
        event = record["event"]
        return (
            event is not None
            and (tenant is None or event["tenant"] == tenant)
            and (since_ms is None or event["ts"] >= since_ms)
            and (until_ms is None or event["ts"] <= until_ms)
        )

    for partition in sorted(by_partition):
        chain = by_partition[partition]
        hits = [i for i, r in enumerate(chain) if matches(r)]
        if not hits:
            continue
        first, last = hits[0], hits[-1]
        # Carry on to the next digest, so the window ends signed where the chain allows.
        while last + 1 < len(chain) and chain[last]["digest"] is None:
            last += 1
        if chain[first]["seq"] != 0:
            anchors[partition] = (chain[first]["seq"], chain[first]["prev_hash"])
        for record in chain[first : last + 1]:
            visible = record["event"] is None or (
                tenant is None or record["event"]["tenant"] == tenant
            )
            entries.append(
                export_entry(record, reveal_sensitive) if visible else stub_entry(record)
            )
    return entries, anchors
