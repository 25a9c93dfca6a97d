"""Decision replay benchmark: `fleetline replay --decisions` re-making a scheduler's whole log.

A log is made first the way the live scheduler makes it, on the real broker: a simulated fleet's
node telemetry on the view topics every interval, then submissions and deletions, then a TICK
carrying the view topics' end offsets; the scheduler steps each request (a TICK over the view
folded to its offsets) and its decisions, allocations and orders are published. Then a fresh
view follower and scheduler re-make every decision from the log and compare it byte for byte;
that part is timed. Target: >= 1,000 decisions/s re-made.

With `--sharded` the log is the one a sharded deployment (`serve --sharded`) makes: after each
interval the view's shards publish their capacity summaries where they changed, and the TICK
names the summaries topic's end, so the replay reads summaries instead of folding telemetry.

    .venv/bin/python benchmarks/replay.py [--nodes 48] [--ticks 300] [--jobs-per-tick 4]
        [--sharded]
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

from _common import local_services, report

from fleetline.agents.simulator import ClusterSpec, FleetSimulator, cluster_info
from fleetline.config import Settings
from fleetline.processors.decision_replay import replay_decisions
from fleetline.processors.replay import ViewFollower
from fleetline.processors.scheduling.capacity import FleetFacts, observe, observe_summaries
from fleetline.processors.scheduling.codec import effect_record, new_request, submit_request
from fleetline.processors.scheduling.runtime import scheduler_topics
from fleetline.processors.scheduling.scheduler import Scheduler
from fleetline.processors.scheduling.specs import parse_spec
from fleetline.processors.view.summary import summarize
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import (
    ALLOCATION,
    CAPACITY_SUMMARY,
    DATASET_PREWARM,
    DATASET_STATE,
    SCHEDULING_DECISION,
    WORKLOAD_ORDER,
)
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics

BASE_MS = 1_796_000_000_000
CODEC = default_codec()
TARGET_DECISIONS_PER_S = 1_000


def job(name: str, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "fleetline/v1",
        "kind": "TrainingJob",
        "metadata": {"name": name, "tenant": "acme"},
        "spec": {
            "accelerator": "H100",
            "gpus_per_worker": gpus,
            "workers": 1,
            "parallelism": {"tensor": gpus, "pipeline": 1, "data": 1},
            "communication": "heavy",
            "priority_class": "normal",
        },
    }


class Log:
    """A producer that knows the end offset of every partition it wrote to."""

    def __init__(self, settings: Settings, topics: Topics) -> None:
        self.topics = topics
        self.producer = kafka_clients.producer(settings.kafka, {"linger.ms": 5})
        self.ends: dict[str, dict[int, int]] = {}
        self.requests = 0

    def _delivered(self, err: Any, msg: Any) -> None:
        assert err is None, err
        ends = self.ends.setdefault(msg.topic(), {})
        ends[msg.partition()] = max(ends.get(msg.partition(), 0), msg.offset() + 1)

    def send(self, topic: str, key: str, name: str, record: dict[str, Any]) -> None:
        self.producer.produce(
            topic, key=key.encode(), value=CODEC.encode(name, record), on_delivery=self._delivered
        )
        self.producer.poll(0)

    def flush(self) -> None:
        assert self.producer.flush(30) == 0

    def view_offsets(self) -> dict[str, dict[int, int]]:
        view = (*self.topics.node_topics, *self.topics.fleet_topics)
        return {t: dict(self.ends[t]) for t in view if t in self.ends}


def make_log(
    settings: Settings,
    topics: Topics,
    nodes: int,
    ticks: int,
    jobs_per_tick: int,
    sharded: bool = False,
) -> tuple[int, float]:
    """Write the log; the decisions made and the seconds it took."""
    clusters = [ClusterSpec(f"c{i}", f"region-{i}", nodes // 4) for i in range(4)]
    fleet = FleetSimulator(clusters, seed=3)
    log = Log(settings, topics)
    for cluster in clusters:
        log.send(
            topics.clusters, cluster.cluster_id, "ClusterInfo", cluster_info(cluster, 1, BASE_MS)
        )
    for node in fleet.nodes:
        log.send(topics.node_state, node.node_id, "NodeState", fleet.node_state(node, BASE_MS))
    scheduler = Scheduler()
    follower = ViewFollower(settings.kafka, topics)
    last: FleetFacts | None = None
    decisions = 0
    published: dict[str, dict[str, Any]] = {}  # the summaries topic's latest, by key
    began = time.perf_counter()

    def step(request: dict[str, Any], facts: FleetFacts | None = None) -> None:
        nonlocal decisions
        log.send(topics.scheduler_requests, request["key"], "SchedulerRequest", request)
        offset, log.requests = log.requests, log.requests + 1
        for effect in scheduler.step(request, offset, facts):
            name, key, record = effect_record(effect)
            topic = {
                SCHEDULING_DECISION: topics.decisions,
                ALLOCATION: topics.allocations,
                DATASET_PREWARM: topics.prewarms,
                DATASET_STATE: topics.datasets,
                WORKLOAD_ORDER: topics.orders,
            }[name]
            decisions += topic == topics.decisions
            log.send(topic, key, name.rsplit(".", 1)[1], record)

    try:
        for tick in range(1, ticks + 1):
            ts = BASE_MS + tick * 1000
            for record in fleet.telemetry(ts):
                log.send(topics.telemetry, record["node_id"], "NodeTelemetry", record)
            for i in range(jobs_per_tick):
                n = tick * jobs_per_tick + i
                doc = job(f"j{n}", (1, 2, 4, 8)[n % 4])
                step(submit_request(parse_spec(doc), doc, ts, f"r{n}", "bench"))
                old = n - 6 * jobs_per_tick  # each job runs about six intervals
                if old > 0:
                    step(new_request("DELETE", f"acme/j{old}", "acme", ts, f"d{old}"))
            log.flush()
            offsets = log.view_offsets()
            view = follower.at(offsets)
            if sharded:
                assert follower.parts is not None
                for key, record in summarize(follower.parts).items():
                    if published.get(key) != record:
                        published[key] = record
                        log.send(topics.summaries, key, CAPACITY_SUMMARY, record)
                log.flush()
                offsets = {topics.summaries: dict(log.ends.get(topics.summaries, {0: 0}))}
                last = observe_summaries(published, offsets, last)
            else:
                last = observe(view, last)
            step(new_request("TICK", "", "", ts, f"t{tick}", view_offsets=offsets), last)
        log.flush()
    finally:
        follower.close()
    return decisions, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=48)
    parser.add_argument("--ticks", type=int, default=300)
    parser.add_argument("--jobs-per-tick", type=int, default=4)
    parser.add_argument("--sharded", action="store_true", help="TICKs name shard summaries")
    args = parser.parse_args()
    settings = Settings.from_env()
    with local_services(settings) as settings:
        topics = Topics(prefix=f"bench.replay.{uuid.uuid4().hex[:8]}")
        kafka_clients.ensure_topics(settings.kafka, scheduler_topics(topics))
        made, make_s = make_log(
            settings, topics, args.nodes, args.ticks, args.jobs_per_tick, args.sharded
        )
        follower = ViewFollower(settings.kafka, topics)
        try:
            replayed = replay_decisions(settings.kafka, topics, follower.facts, compare_state=False)
        finally:
            follower.close()
    assert replayed.ok, replayed.first_difference
    assert replayed.matched == made
    rate = replayed.decisions / replayed.seconds
    report(
        "replay-sharded" if args.sharded else "replay",
        {
            "nodes": args.nodes,
            "ticks_observe": "shard summaries" if args.sharded else "the view",
            "requests": replayed.requests,
            "ticks": replayed.ticks,
            "decisions": replayed.decisions,
            "view_events_folded": follower.folded,
            "log_made_s": round(make_s, 2),
            "replay_s": round(replayed.seconds, 2),
            "decisions_per_s": round(rate),
            "requests_per_s": round(replayed.requests / replayed.seconds),
            "target_decisions_per_s": TARGET_DECISIONS_PER_S,
            "meets_target": rate >= TARGET_DECISIONS_PER_S,
        },
    )


if __name__ == "__main__":
    main()
