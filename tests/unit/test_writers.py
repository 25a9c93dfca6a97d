"""Writer identities without a broker: the MAC binds a record's writer to its topic, key and
value; a revocation holds from the broker time it was appended; each kind of writer may write
only its own kinds of record; and no agent's clock moves a fold's time."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from fleetline.errors import ConfigError
from fleetline.identity.authority import node_refusal, request_refusal, signal_refusal
from fleetline.identity.writers import (
    CONTROL_PLANE_WRITER,
    Gate,
    Registry,
    Writer,
    WriterKind,
    WriterRefused,
)
from fleetline.processors.health.fold import HealthFold
from fleetline.processors.scheduling.codec import canonical_json, new_request
from fleetline.processors.scheduling.scheduler import Scheduler
from tests.scheduling_support import training
from tests.support import TEST_ROOT

NODE = Writer(WriterKind.NODE, "eu-west-a/eu-west-a-n0001")
CLUSTER = Writer(WriterKind.CLUSTER, "eu-west-a")


class Msg:
    def __init__(self, topic: str, key: bytes, value: bytes, headers: Any, ms: int = 1_000):
        self._topic, self._key, self._value, self._headers, self._ms = (
            topic,
            key,
            value,
            headers,
            ms,
        )

    def topic(self) -> str:
        return self._topic

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes:
        return self._value

    def headers(self) -> Any:
        return self._headers

    def timestamp(self) -> tuple[int, int]:
        return (2, self._ms)  # LogAppendTime


NONCES = itertools.count()


def signed(writer: Writer, topic: str = "p.state.node", key: bytes = b"k", value: bytes = b"v"):
    nonce = next(NONCES).to_bytes(12, "big")
    headers = Gate(TEST_ROOT).credential(writer).headers(topic, key, value, nonce)
    return Msg(topic, key, value, headers)


def test_a_signed_record_names_its_writer_and_any_change_to_it_is_refused() -> None:
    gate = Gate(TEST_ROOT)
    assert gate.writer_of(signed(NODE)) == NODE
    good = signed(NODE)
    for forged in (
        Msg("p.telemetry.node", good.key(), good.value(), good.headers()),  # moved topic
        Msg(good.topic(), b"other", good.value(), good.headers()),  # re-keyed
        Msg(good.topic(), good.key(), b"edited", good.headers()),  # edited
        Msg(good.topic(), good.key(), good.value(), None),  # no identity at all
    ):
        with pytest.raises(WriterRefused):
            gate.writer_of(forged)
    # Claiming another writer with one's own MAC does not verify.
    claimed = [("fleetline.writer", b"control-plane#1"), good.headers()[1]]
    with pytest.raises(WriterRefused, match="MAC does not verify"):
        gate.writer_of(Msg(good.topic(), good.key(), good.value(), claimed))
    # A key derived from another root is another deployment's.
    with pytest.raises(WriterRefused):
        Gate(bytes(32)).writer_of(good)


def test_a_revocation_holds_from_its_append_time_and_a_new_generation_is_accepted() -> None:
    registry = Registry()
    registry.apply({"action": "ENROL", "writer": CLUSTER.id, "generation": 1}, 100, 0)
    registry.apply(
        {"action": "REVOKE", "writer": CLUSTER.id, "generation": 1, "actor": "ops"}, 5_000, 1
    )
    gate = Gate(TEST_ROOT, registry)
    before, after = signed(CLUSTER), signed(CLUSTER)
    before._ms, after._ms = 4_999, 5_000
    assert gate.writer_of(before) == CLUSTER  # appended before: as the live fold took it
    with pytest.raises(WriterRefused, match="revoked"):
        gate.writer_of(after)
    assert registry.next_generation(CLUSTER.id) == 2
    renewed = Writer(WriterKind.CLUSTER, "eu-west-a", 2)
    fresh = signed(renewed)
    fresh._ms = 9_000
    assert gate.writer_of(fresh) == renewed


def test_writer_names_are_checked() -> None:
    for bad in ("robot:x", "node:no-cluster", "cluster:", "control-plane:x", "cluster:a#0"):
        with pytest.raises(ConfigError):
            Writer.parse(bad)
    assert Writer.parse("node:a/a-n1#3") == Writer(WriterKind.NODE, "a/a-n1", 3)
    assert (NODE.cluster, NODE.node) == ("eu-west-a", "eu-west-a-n0001")


def test_each_kind_of_writer_writes_only_its_own_kinds() -> None:
    mover, router = Writer(WriterKind.MOVER, "m"), Writer(WriterKind.ROUTER, "r")
    for writer in (NODE, CLUSTER, mover, router):
        for kind in ("SUBMIT", "DELETE", "TENANT_POLICY", "POLICY", "ENERGY", "TICK"):
            assert request_refusal(writer, kind) == f"may not {kind}"
    assert request_refusal(router, "FENCE") == "may not FENCE"
    assert request_refusal(router, "SERVICE_LOAD", is_service=True) is None
    assert "copy no mover" in (request_refusal(mover, "DATASET_READY") or "")
    assert request_refusal(mover, "DATASET_READY", copy_ordered=True) is None
    assert request_refusal(CLUSTER, "FENCE", node_cluster="eu-west-a") is None
    assert "us-east-a" in (request_refusal(CLUSTER, "FENCE", node_cluster="us-east-a") or "")
    ordered = {"eu-west-a"}
    assert (
        request_refusal(CLUSTER, "PROGRESS", cluster_id="eu-west-a", ordered_clusters=ordered)
        is None
    )
    assert "not ordered" in (
        request_refusal(CLUSTER, "PROGRESS", cluster_id="eu-west-a", ordered_clusters={"b"}) or ""
    )
    assert signal_refusal(CLUSTER, "HEARTBEAT", "eu-west-a") is None
    assert signal_refusal(CLUSTER, "HEARTBEAT", "us-east-a") is not None
    assert signal_refusal(CLUSTER, "TICK", "") is not None
    assert node_refusal(NODE, "NodeState", "eu-west-a", "eu-west-a-n0001") is None
    assert node_refusal(NODE, "NodeState", "eu-west-a", "eu-west-a-n0002") is not None
    assert node_refusal(CLUSTER, "NodeState", "eu-west-a", "eu-west-a-n0001") is not None
    for kind in ("SUBMIT", "TICK", "FENCE"):
        assert request_refusal(CONTROL_PLANE_WRITER, kind) is None


def heartbeat(cluster: str, ts: int) -> dict[str, Any]:
    return {"kind": "HEARTBEAT", "cluster_id": cluster, "ts": ts, "incarnation": "i", "peers": []}


def tick(ts: int) -> dict[str, Any]:
    return {"kind": "TICK", "cluster_id": "", "ts": ts}


def test_one_agent_forty_seconds_ahead_evicts_nobody() -> None:
    """The issue's case, in the pure fold: three clusters heartbeat, then one heartbeat from A
    stamped 40 s ahead and two control-plane ticks. B and C stay HEALTHY."""
    fold = HealthFold()
    writers = {c: Writer(WriterKind.CLUSTER, c) for c in "abc"}
    position = 0
    for second in range(5):
        ts = 100_000 + second * 1_000
        for c in "abc":
            fold.step(heartbeat(c, ts), position, writers[c], appended_ms=ts)
            position += 1
        fold.step(tick(ts), position, CONTROL_PLANE_WRITER, appended_ms=ts)
        position += 1
    for c in "bc":
        fold.step(heartbeat(c, 105_000), position, writers[c], appended_ms=105_000)
        position += 1
    out = fold.step(heartbeat("a", 145_000), position, writers["a"], appended_ms=105_100)
    out += fold.step(tick(105_300), position + 1, CONTROL_PLANE_WRITER, appended_ms=105_300)
    out += fold.step(tick(105_600), position + 2, CONTROL_PLANE_WRITER, appended_ms=105_600)
    assert {c: r.state.value for c, r in fold.clusters.items()} == {
        "a": "HEALTHY",
        "b": "HEALTHY",
        "c": "HEALTHY",
    }, out
    # Without broker time an agent's stamp still does not move the clock.
    fold.step(heartbeat("a", 999_999), position + 3, writers["a"])
    assert fold.now_ms == 105_600
    with pytest.raises(WriterRefused, match="heartbeat for cluster b"):
        fold.step(heartbeat("b", 106_000), position + 4, writers["a"], appended_ms=106_000)


def test_a_refused_request_changes_nothing_and_an_agent_s_clock_moves_no_deadline() -> None:
    scheduler = Scheduler()
    document = training("spree", tenant="globex")
    submit = new_request(
        "SUBMIT", "globex/spree", "globex", 50_000, "r1", spec_json=canonical_json(document)
    )
    before = scheduler.now_ms
    with pytest.raises(WriterRefused, match="cluster:eu-west-a#1 may not SUBMIT"):
        scheduler.step(submit, 0, writer=CLUSTER)
    assert "globex/spree" not in scheduler.jobs and scheduler.position != 0
    assert scheduler.now_ms == before
    report = new_request("PROGRESS", "acme/x", "acme", 10**13, "r2", phase="RUNNING")
    report = {**report, "cluster_id": "eu-west-a"}
    with pytest.raises(WriterRefused, match="not ordered"):
        scheduler.step(report, 1, writer=CLUSTER)
    assert scheduler.now_ms == before
