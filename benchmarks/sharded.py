"""Sharded view benchmark: a 200,000-GPU fleet in 25 clusters whose view is split into 12 shards
over 4 `serve --sharded` instances, and a scheduler that holds no view, only their summaries.

Each instance runs in a process of its own and folds only its shards' nodes (two intervals of
telemetry, as the scheduler benchmark's fleet): its RSS holding them, against the target of 1 GiB
per shard and an empty instance's RSS (the interpreter, the libraries, the simulator that makes
the fleet); the capacity summaries it publishes (records, Avro bytes, time to make them from
scratch and again over an unchanged fleet, which is what it does every second). The scheduler
side: the time to observe every summary (first and again), that the facts equal `observe` of the
whole view, and the scheduler core placing `--jobs` mixed jobs on those facts (decisions/s and
p99 against the same targets as at 80,000 GPUs).

    .venv/bin/python benchmarks/sharded.py [--nodes 25000] [--clusters 25] [--partitions 12]
        [--instances 4] [--jobs 10000]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import time
from typing import Any

from _common import report, rss_mib
from scheduler import build_view, core

from fleetline.processors.scheduling.capacity import FleetFacts, observe, observe_summaries
from fleetline.processors.view.folder import FLEET_PART, shard_part
from fleetline.processors.view.model import ResourceView
from fleetline.processors.view.runtime import tune_gc_for_large_state
from fleetline.processors.view.summary import summarize
from fleetline.streams.events import CAPACITY_SUMMARY
from fleetline.streams.partitioner import partition_for
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics

GIB = 1024.0


def shards_of(instance: int, instances: int, partitions: int) -> list[int]:
    """The range assignor's split: consecutive partitions per member."""
    per, extra = divmod(partitions, instances)
    start = instance * per + min(instance, extra)
    return list(range(start, start + per + (instance < extra)))


def split(view: ResourceView, partitions: int, shards: list[int]) -> dict[str, ResourceView]:
    """The view as an instance holding `shards` holds it: one part per shard (the nodes the
    node-id key sends there) and the fleet part (read whole by every instance)."""
    parts = {
        shard_part(p): ResourceView(policy=view.policy, watermark_ms=view.watermark_ms)
        for p in shards
    }
    for node_id, node in view.nodes.items():
        name = shard_part(partition_for(node_id.encode(), partitions))
        if name in parts:
            parts[name].nodes[node_id] = node
    fleet = ResourceView(policy=view.policy, watermark_ms=view.watermark_ms)
    fleet.clusters, fleet.datasets = view.clusters, view.datasets
    fleet.cluster_health, fleet.fleet_events = view.cluster_health, 1
    parts[FLEET_PART] = fleet
    return parts


def instance(nodes: int, clusters: int, partitions: int, shards: list[int], out: Any) -> None:
    """One view instance: fold its shards, summarise them, report its RSS and summaries."""
    tune_gc_for_large_state()
    held = set(shards)
    view = build_view(
        nodes,
        clusters_count=clusters,
        keep=lambda node_id: partition_for(node_id.encode(), partitions) in held,
    )
    parts = split(view, partitions, shards)
    del view
    gc.collect()
    rss = rss_mib() or 0.0
    cache: dict[str, Any] = {}
    began = time.perf_counter()
    records = summarize(parts, cache=cache)
    cold = time.perf_counter() - began
    began = time.perf_counter()
    again = summarize(parts, cache=cache)
    warm = time.perf_counter() - began
    assert again == records
    codec = default_codec()
    encoded = {k: codec.encode(CAPACITY_SUMMARY, r) for k, r in records.items()}
    out.send(
        {
            "rss_mib": rss,
            "nodes": sum(len(p.nodes) for p in parts.values()),
            "summarize_first_s": cold,
            "summarize_again_s": warm,
            "encoded": encoded,
        }
    )


def run_instances(nodes: int, clusters: int, partitions: int, instances: int) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    results = []
    # The last one holds nothing: what an instance costs before it folds a node.
    for shards in [shards_of(i, instances, partitions) for i in range(instances)] + [[]]:
        parent, child = context.Pipe(duplex=False)
        proc = context.Process(target=instance, args=(nodes, clusters, partitions, shards, child))
        proc.start()
        result = parent.recv()
        proc.join(60)
        result["shards"] = shards
        results.append(result)
    return results


def observe_sharded(partitions: int, instances: int) -> Any:
    """`observe` as a sharded deployment does it: each instance summarises its shards, the
    summaries go through Avro, the scheduler composes them."""
    codec = default_codec()

    def facts(view: ResourceView) -> FleetFacts:
        records: dict[str, Any] = {}
        for i in range(instances):
            parts = split(view, partitions, shards_of(i, instances, partitions))
            for key, record in summarize(parts).items():
                value = codec.encode(CAPACITY_SUMMARY, record)
                records[key] = codec.decode(value, expect=CAPACITY_SUMMARY).record
        return observe_summaries(records, {Topics().summaries: {0: len(records)}})

    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=25_000)
    parser.add_argument("--clusters", type=int, default=25)
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=10_000)
    args = parser.parse_args()
    shard_instances = run_instances(args.nodes, args.clusters, args.partitions, args.instances)
    *holding, empty = shard_instances
    codec = default_codec()
    records = {
        k: codec.decode(v, expect=CAPACITY_SUMMARY).record
        for r in holding
        for k, v in r["encoded"].items()
    }
    offsets = {Topics().summaries: {0: len(records)}}
    began = time.perf_counter()
    first = observe_summaries(records, offsets)
    observe_first = time.perf_counter() - began
    began = time.perf_counter()
    observe_summaries(records, offsets, first)
    observe_again = time.perf_counter() - began
    whole = observe(build_view(args.nodes, clusters_count=args.clusters))
    assert first.nodes == whole.nodes and first.clusters == whole.clusters, "summaries differ"
    figures: dict[str, object] = {
        "nodes": args.nodes,
        "gpus": args.nodes * 8,
        "clusters": args.clusters,
        "shards": args.partitions,
        "instances": args.instances,
        "instance_rss_mib": [round(r["rss_mib"], 1) for r in holding],
        "instance_nodes": [r["nodes"] for r in holding],
        "empty_instance_rss_mib": round(empty["rss_mib"], 1),
        "rss_mib_per_shard_max": round(max(r["rss_mib"] / len(r["shards"]) for r in holding), 1),
        "view_rss_mib_per_shard_max": round(
            max((r["rss_mib"] - empty["rss_mib"]) / len(r["shards"]) for r in holding), 1
        ),
        "view_rss_per_shard_target_mib": f"< {GIB:.0f}",
        "summaries": len(records),
        "summaries_bytes": sum(len(v) for r in holding for v in r["encoded"].values()),
        "summarize_first_s_max": round(max(r["summarize_first_s"] for r in holding), 3),
        "summarize_again_s_max": round(max(r["summarize_again_s"] for r in holding), 4),
        "observe_summaries_first_s": round(observe_first, 3),
        "observe_summaries_again_s": round(observe_again, 3),
        "summaries_equal_observe_of_the_whole_view": True,
    }
    del whole, records, first, shard_instances, holding
    gc.collect()
    scheduling = core(
        args.nodes,
        args.jobs,
        clusters=args.clusters,
        observe_with=observe_sharded(args.partitions, args.instances),
    )
    figures.update({f"scheduler_{k}": v for k, v in scheduling.items()})
    report("sharded", figures)


if __name__ == "__main__":
    main()
