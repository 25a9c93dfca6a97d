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


# --- the control plane's own actions in the chain ------------------------------------------


def decision_record(n: int, outcome: str = "PLACED") -> dict:
    return {
        "decision_id": f"d{n}",
        "job": f"acme/job{n}",
        "tenant": "acme",
        "kind": "TrainingJob",
        "outcome": outcome,
        "ts": BASE_MS + n,
        "input_offset": n,
        "view_version": 7,
        "view_offsets": [],
        "policy_digest": "p1",
        "priority": 100,
        "reason": "best score",
        "placements": [],
        "victims": ["acme/old"] if outcome == "PREEMPTED" else [],
    }


def test_decisions_orders_and_transitions_become_chained_events_once():
    import hashlib
    import os

    from fleetline.processors.audit.sources import (
        decision_event,
        order_event,
        unaudited_decisions,
        workload_event,
    )

    codec = default_codec()
    decisions = [decision_record(1), decision_record(2, "PREEMPTED"), decision_record(3)]
    values = [codec.encode("SchedulingDecision", d) for d in decisions]
    digests = {
        d["decision_id"]: hashlib.sha256(v).hexdigest()
        for d, v in zip(decisions, values, strict=True)
    }
    made = [decision_event(d, digests[d["decision_id"]]) for d in decisions]
    # Derived from the record: the same decision read twice is the same event.
    assert made[0] == decision_event(decisions[0], digests["d1"])
    assert [e["operation"] for e in made] == [
        "decision.PLACED",
        "decision.PREEMPTED",
        "decision.PLACED",
    ]
    assert made[1]["details"]["victims"] == "acme/old" and made[1]["actor"] == "scheduler"
    order = {
        "job": "acme/job1",
        "tenant": "acme",
        "kind": "TrainingJob",
        "action": "RUN",
        "cluster_id": "eu-west-a",
        "epoch": 3,
        "attempt": 1,
        "ts": BASE_MS,
        "decision_id": "d1",
        "reason": "placed",
        "trace_id": "t",
        "workers": [{"node_id": "n1", "gpus": [0, 1]}],
    }
    transition = {
        "job": "acme/job1",
        "tenant": "acme",
        "cluster_id": "eu-west-a",
        "epoch": 3,
        "attempt": 1,
        "ts": BASE_MS + 5,
        "event": "FAILED",
        "trace_id": "t",
        "exit_code": 137,
    }
    ordered = order_event(order, "x")
    failed = workload_event(transition, "y")
    assert ordered["operation"] == "order.RUN" and ordered["details"]["nodes"] == "n1"
    assert failed is not None and failed["outcome"] == "FAILED"
    assert failed["details"]["exit_code"] == "137" and failed["actor"] == "cluster-agent:eu-west-a"
    # Progress reports are not transitions: not chained.
    assert workload_event({**transition, "event": "PROGRESS"}, "z") is None
    # Every event encodes as an AuditEvent and chains; the chain verifies.
    events = [{**e, "salt": os.urandom(16)} for e in [*made, ordered, failed]]
    decoded = [codec.decode(codec.encode("AuditEvent", e)).record for e in events]
    assert verify(entries(chain(decoded)), KEYS).ok
    # The chain holds decisions 1 and 3 (2 was never chained) and 3 with other bytes.
    held = [decoded[0], {**decoded[2], "details": {**decoded[2]["details"], "record_sha256": "0"}}]
    assert unaudited_decisions(held, digests) == (["d2"], ["d3"])
    assert unaudited_decisions(decoded, digests) == ([], [])
