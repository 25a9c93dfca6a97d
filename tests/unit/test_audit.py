"""The audit chain's pure core: linking, signed digests, tamper detection, masked exports."""

from __future__ import annotations

import copy
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fleetline.processors.audit.chain import (
    Signer,
    chain_event,
    content_digest_of,
    export_entry,
    link_hash,
    stub_entry,
    verify,
)
from fleetline.processors.audit.runtime import new_event
from fleetline.storage import audit_export
from fleetline.streams.serde import default_codec
from tests.support import BASE_MS

SIGNER = Signer(Ed25519PrivateKey.generate())
KEYS = {SIGNER.key_id: SIGNER.private_key.public_key()}


def event(i: int, tenant: str = "acme", **details: str) -> dict:
    return new_event(
        ts=BASE_MS + i,
        actor=f"user{i % 3}",
        actor_role="user",
        tenant=tenant,
        operation="api.GET /v1/nodes",
        target="/v1/nodes",
        outcome="SUCCEEDED",
        status=200,
        request_id=f"r{i}",
        details=details,
    )


def chain(events, partition: int = 0, digest_every: int = 4) -> list[dict]:
    head, out = None, []
    for e in events:
        head, records = chain_event(head, partition, e, SIGNER, digest_every)
        out.extend(records)
    return out


def entries(records, reveal: bool = True) -> list[dict]:
    return [export_entry(r, reveal_sensitive=reveal) for r in records]


def test_an_untouched_chain_verifies_with_digests_and_an_unsigned_tail():
    records = chain([event(i) for i in range(10)])
    assert [r["seq"] for r in records] == list(range(12))  # 10 events + 2 digests
    assert [r["seq"] for r in records if r["digest"]] == [4, 9]
    report = verify(entries(records), KEYS)
    assert report.ok and report.checked == 12 and report.digests == 2
    assert report.unsigned_tail == {0: 2}


def test_records_survive_avro_round_trip_and_still_verify():
    codec = default_codec()
    records = chain([event(i, token="s3cr3t") for i in range(6)])
    again = [codec.decode(codec.encode("AuditRecord", r)).record for r in records]
    assert verify(entries(again), KEYS).ok


def rehash(rows: list[dict]) -> None:
    """What a forger without the signing key can do: make every hash consistent again."""
    prev = bytes.fromhex(rows[0]["prev_hash"])
    for row in rows:
        row["prev_hash"] = prev.hex()
        content = (
            content_digest_of(digest=row["digest"])
            if "digest" in row
            else bytes.fromhex(row["content_digest"])
        )
        row["content_digest"] = content.hex()
        prev = link_hash(prev, content)
        row["hash"] = prev.hex()


@pytest.mark.parametrize(
    "tamper, expected",
    [
        ("edit", "field actor does not match its commitment (edited)"),
        ("edit-and-rehash", "digest signature does not verify"),
        ("delete", "link(s) missing (deleted)"),
        ("insert", "a link was inserted or reordered"),
        ("reorder", "expected seq 2"),
        ("forge-digest", "digest signature does not verify"),
    ],
)
def test_tampering_is_detected_and_the_first_broken_link_named(tamper, expected):
    records = chain([event(i) for i in range(10)])
    rows = entries(records)
    if tamper == "edit":
        rows[2]["event"]["values"]["actor"] = "mallory"
    elif tamper == "edit-and-rehash":
        # Rewrite a value *and* every commitment and hash after it: only the signature catches it.
        forged = copy.deepcopy(records)
        forged[1]["event"]["actor"] = "mallory"
        head, rewritten = None, []
        other = Signer(Ed25519PrivateKey.generate())
        for r in forged:
            if r["event"] is not None:
                head, out = chain_event(head, 0, r["event"], other, 4)
                rewritten.extend(out)
        rows = entries(rewritten)
        for row in rows:  # claim the real key signed it
            if "digest" in row:
                row["digest"]["key_id"] = SIGNER.key_id
        rehash(rows)
    elif tamper == "delete":
        del rows[3]
    elif tamper == "insert":
        rows.insert(3, copy.deepcopy(rows[2]))
    elif tamper == "reorder":
        rows[2], rows[3] = rows[3], rows[2]
    elif tamper == "forge-digest":
        digest = next(r for r in rows if "digest" in r)
        digest["digest"]["signature"] = "00" * 64
        rehash(rows)
    report = verify(rows, KEYS)
    assert not report.ok
    assert expected in report.first_broken
    assert report.first_broken.startswith("partition 0 seq ")


def test_a_masked_export_hides_sensitive_values_and_still_verifies():
    records = chain(
        [
            event(i, api_token=f"tok-{i}", user_email=f"u{i}@corp.example", reason="quota")
            for i in range(6)
        ]
    )
    masked = entries(records, reveal=False)
    text = json.dumps(masked)
    assert "tok-" not in text and "@corp.example" not in text
    assert "quota" in text
    assert masked[0]["event"]["masked"] == ["details.api_token", "details.user_email"]
    assert verify(masked, KEYS).ok
    full = entries(records, reveal=True)
    assert "tok-0" in json.dumps(full) and verify(full, KEYS).ok


def test_other_tenants_links_are_stubs_and_the_chain_still_verifies():
    records = chain([event(i, tenant="acme" if i % 2 else "globex") for i in range(8)])
    mine = [
        export_entry(r, reveal_sensitive=False)
        if r["event"] is None or r["event"]["tenant"] == "acme"
        else stub_entry(r)
        for r in records
    ]
    assert "globex" not in json.dumps(mine)
    assert verify(mine, KEYS).ok


@pytest.mark.parametrize("fmt", audit_export.FORMATS)
def test_exports_in_every_format_verify_on_their_own(tmp_path, fmt):
    records = chain([event(i, password="hunter2") for i in range(7)])
    path = tmp_path / f"audit.{fmt}"
    assert audit_export.write(path, fmt, entries(records, reveal=False), KEYS) == len(records)
    assert "hunter2" not in path.read_bytes().decode(errors="replace")
    back, keys, anchors = audit_export.read(path)
    assert anchors == {}
    assert verify(back, keys).ok
    back[1]["event"]["values"]["operation"] = "api.DELETE /v1/everything"
    assert "edited" in verify(back, keys).first_broken


def test_an_unknown_signing_key_is_named():
    records = chain([event(i) for i in range(5)])
    report = verify(entries(records), {})
    assert "unknown key" in report.first_broken
