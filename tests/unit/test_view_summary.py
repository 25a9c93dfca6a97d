"""The view shards' capacity summaries: through Avro and back, whichever instances hold which
shards, they give the scheduler the facts a whole view gives it (`observe`), and the cache
makes an unchanged fleet's summaries equal to the last ones."""

from __future__ import annotations

from typing import Any

from confluent_kafka import Message

from fleetline.agents.simulator import cluster_info
from fleetline.config import KafkaSettings
from fleetline.processors.scheduling.capacity import FleetFacts, observe, observe_summaries
from fleetline.processors.view.fold import compose
from fleetline.processors.view.folder import FLEET_PART, PartFolder, shard_part
from fleetline.processors.view.model import CORDONED_LABEL, ResourceView
from fleetline.processors.view.summary import FLEET_PUBLISHER, owned_by, summarize
from fleetline.streams.events import CAPACITY_SUMMARY
from tests.fleet_events import CODEC, TOPICS, messages, scenario_events, scenario_fleet
from tests.support import BASE_MS


def fleet_messages() -> list[Message]:
    """Two clusters declared (one retired), a third cordoned by the health processor, and a
    dataset with a replica."""
    specs = scenario_fleet().clusters
    infos = [cluster_info(specs[0], 1, BASE_MS), cluster_info(specs[1], 1, BASE_MS)]
    infos[1]["retired"] = True
    health = {
        "event": "CORDON",
        "cluster_id": specs[2].cluster_id,
        "seq": 3,
        "ts": BASE_MS,
        "state": "HEALTHY",
        "previous": "HEALTHY",
        "since_ms": BASE_MS,
        "cordoned": True,
        "reason": "maintenance",
        "silent_ms": None,
        "peers_reaching": [],
        "peers_not_reaching": [],
        "peer": None,
        "link_up": None,
    }
    dataset = {
        "dataset_id": "t1/corpus",
        "tenant": "t1",
        "seq": 1,
        "ts": BASE_MS,
        "size_bytes": 10**12,
        "replicas": [specs[0].cluster_id],
        "deleted": False,
    }
    rows = [(TOPICS.clusters, i["cluster_id"], "ClusterInfo", i) for i in infos]
    rows += [(TOPICS.emergency, health["cluster_id"], "ClusterHealth", health)]
    rows += [(TOPICS.datasets, "t1/corpus", "DatasetState", dataset)]
    return [
        Message(topic=t, partition=0, offset=0, key=k.encode(), value=CODEC.encode(name, r))
        for t, k, name, r in rows
    ]


def folded(seconds: int) -> dict[str, ResourceView]:
    parts: dict[str, ResourceView] = {}
    assert (
        PartFolder(TOPICS).fold(parts, messages(scenario_events(seconds)) + fleet_messages()) == []
    )
    return parts


def through_avro(records: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        k: CODEC.decode(CODEC.encode(CAPACITY_SUMMARY, r), expect=CAPACITY_SUMMARY).record
        for k, r in records.items()
    }


def comparable(facts: FleetFacts) -> tuple[Any, ...]:
    return (
        facts.nodes,
        facts.lost,
        {n: facts.lost_reason(n) for n in facts.lost},
        facts.clusters,
        facts.datasets,
    )


def test_summaries_from_any_split_of_the_shards_give_the_facts_a_whole_view_gives() -> None:
    # 15 s: a node down, a GPU failed, GPUs degraded behind a leaf, a region out of reach.
    for seconds in (15, 40):
        parts = folded(seconds)
        whole = observe(compose(parts.values()))
        if seconds == 15:
            assert {n.status for n in whole.nodes.values()} == {"UP", "DOWN"}
            assert whole.lost  # the node down, the GPU that failed
        assert any(c.health == "retired" for c in whole.clusters.values())
        assert any(c.health == "cordoned" for c in whole.clusters.values())
        assert "t1/corpus" in whole.datasets
        watermark = max(p.watermark_ms for p in parts.values())
        # Two instances: one holds shard 0 (and publishes the fleet tables), the other the rest;
        # each instance has the fleet part, as each reads the fleet topics whole.
        first = {n: parts[n] for n in (shard_part(0), FLEET_PART)}
        second = {n: parts[n] for n in (shard_part(1), shard_part(2), FLEET_PART)}
        published = {**summarize(first, watermark), **summarize(second, watermark)}
        assert {k for k in published if not k.startswith("nodes/")} == {
            *(f"cluster/{c}" for c in whole.clusters),
            "dataset/t1/corpus",
        }
        facts = observe_summaries(through_avro(published), {TOPICS.summaries: {0: 42}})
        assert comparable(facts) == comparable(whole)
        assert facts.offsets == {TOPICS.summaries: {0: 42}}


def test_only_the_holder_of_shard_zero_publishes_the_fleet_tables_and_removes_its_own_keys() -> (
    None
):
    parts = folded(5)
    second = {n: parts[n] for n in (shard_part(1), FLEET_PART)}
    published = summarize(second)
    assert published and all(
        k.startswith("nodes/") and k.endswith(shard_part(1)) for k in published
    ), published
    assert owned_by("nodes/c1/shard-001", second) and not owned_by("nodes/c1/shard-002", second)
    assert not owned_by("cluster/c1", second) and owned_by("dataset/x", [FLEET_PUBLISHER])


def test_an_unchanged_fleet_summarises_to_the_same_records_and_a_change_shows() -> None:
    parts = folded(20)
    cache: dict[str, Any] = {}
    before = summarize(parts, cache=cache)
    again = summarize(parts, cache=cache)
    assert again == before
    kept = [
        (a, b) for k in before for a, b in zip(again[k]["nodes"], before[k]["nodes"], strict=True)
    ]
    assert kept and all(a is b for a, b in kept)
    node = next(iter(parts[shard_part(0)].nodes.values()))
    node.labels[CORDONED_LABEL] = "true"
    node.epoch += 1
    changed = {k for k, r in summarize(parts, cache=cache).items() if r != before[k]}
    assert changed == {f"nodes/{node.cluster_id}/{shard_part(0)}"}
    # Later event time: nodes not heard from go UNREACHABLE, and their summaries say so.
    late = summarize(parts, watermark_ms=BASE_MS + 10**6, cache=cache)
    statuses = {n["status"] for r in late.values() for n in r["nodes"]}
    assert "UNREACHABLE" in statuses and statuses <= {"UNREACHABLE", "DOWN"}


class _Log:
    """A one-partition topic as a consumer reads it: batches in order, the end it reports
    taken when asked (what `to_end` aims at), and records appended in between."""

    def __init__(self, messages: list[Message], end: int) -> None:
        self.messages, self.end, self.next = messages, end, 0

    def assign(self, partitions: Any) -> None:
        self.next = 0

    def consume(self, count: int, timeout: float) -> list[Message]:
        batch = self.messages[self.next : self.next + count]
        self.next += len(batch)
        return batch

    def seek(self, partition: Any) -> None:
        self.next = partition.offset

    def get_watermark_offsets(self, partition: Any, timeout: float) -> tuple[int, int]:
        return 0, self.end

    def close(self) -> None: ...


def test_a_summary_appended_while_the_ticker_reads_to_the_end_is_not_lost(monkeypatch) -> None:
    """`to_end` asks for the end, then reads: a record appended in between comes in the same
    batch, past the end it aimed at. The follower holds it back for `to_end`, and the next
    `poll` must apply it: the consumer has moved on, so skipped there it would be lost, the
    ticker's facts would lack it while a replay at the same offset has it."""
    from fleetline.processors.view import runtime as view_runtime

    summaries = summarize(folded(2))
    keys = sorted(summaries)[:3]
    assert len(keys) == 3
    log = _Log(
        [
            Message(
                topic=TOPICS.summaries,
                partition=0,
                offset=offset,
                key=key.encode(),
                value=CODEC.encode(CAPACITY_SUMMARY, summaries[key]),
            )
            for offset, key in enumerate(keys)
        ],
        end=2,  # the third record was appended after the end was asked for
    )
    monkeypatch.setattr(view_runtime.kafka_clients, "consumer", lambda *args, **kwargs: log)
    follower = view_runtime.SummaryFollower(KafkaSettings(), TOPICS)
    follower.to_end()
    assert (sorted(follower.records), follower.position) == (keys[:2], 2)
    log.end = 3
    assert follower.poll() == 1
    assert (sorted(follower.records), follower.position) == (keys, 3)
    # What a replay reads at that position: the same records.
    again = view_runtime.SummaryFollower(KafkaSettings(), TOPICS)
    assert again.at(3) == follower.records
