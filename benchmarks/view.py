"""Resource-view benchmark: fold throughput from Kafka, rebuild time with and without a
snapshot, and process RSS with the whole fleet in the view.

Produces `--ticks` intervals of NodeTelemetry for `--nodes` 8-GPU nodes (default 10,000 nodes =
80,000 GPUs) to fresh topics on the local broker, then rebuilds the view from the log the way
`fleetline replay` does (same PartFolder as the live processor). Records are built from a few
encoded templates per node with the seq and ts rewritten, so producing 10 million events does not
take hours of Avro encoding; the fold decodes and checks every one in full.

    .venv/bin/python benchmarks/view.py [--nodes 10000] [--ticks 125]
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import uuid

from _common import local_services, report, rss_mib

from fleetline.agents.simulator import ClusterSpec, FleetSimulator
from fleetline.config import Settings
from fleetline.processors.replay import log_bounds, rebuild
from fleetline.processors.view.read import cluster_capacity
from fleetline.processors.view.runtime import tune_gc_for_large_state
from fleetline.processors.view.snapshots import ViewSnapshots
from fleetline.storage.objects import ObjectStore
from fleetline.storage.snapshots import SnapshotStore
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.avrocols import avro_long as _zigzag
from fleetline.streams.serde import HEADER_LEN, default_codec
from fleetline.streams.topics import Topics

BASE_MS = 1_796_000_000_000
TEMPLATES = 4


def _string(value: str) -> bytes:
    data = value.encode()
    return _zigzag(len(data)) + data


def _skip_varint(data: bytes, at: int) -> int:
    while data[at] & 0x80:
        at += 1
    return at + 1


def templates(nodes: int) -> list[tuple[bytes, str, list[bytes]]]:
    """Per node: (header + the three leading strings, node id, [bytes after seq and ts])."""
    sim = FleetSimulator([ClusterSpec(f"c{i}", f"r{i % 4}", nodes // 8) for i in range(8)], seed=1)
    codec = default_codec()
    per_node: dict[str, list[bytes]] = {}
    prefixes: dict[str, bytes] = {}
    for t in range(TEMPLATES):
        for record in sim.telemetry(BASE_MS + t * 1000):
            data = codec.encode("NodeTelemetry", record)
            prefix = data[:HEADER_LEN] + b"".join(
                _string(record[k]) for k in ("cluster_id", "region", "node_id")
            )
            assert data.startswith(prefix)
            rest_at = _skip_varint(data, _skip_varint(data, len(prefix)))
            prefixes[record["node_id"]] = prefix
            per_node.setdefault(record["node_id"], []).append(data[rest_at:])
    return [(prefixes[n], n, per_node[n]) for n in sorted(per_node)]


def produce(settings: Settings, topics: Topics, nodes: int, ticks: int) -> tuple[int, float]:
    shapes = templates(nodes)
    producer = kafka_clients.producer(settings.kafka, {"linger.ms": 50, "batch.size": 1_000_000})
    began = time.perf_counter()
    sent = 0
    for tick in range(ticks):
        ts = _zigzag(BASE_MS + tick * 1000)
        seq = _zigzag(tick + 1)
        for prefix, node_id, rests in shapes:
            value = prefix + seq + ts + rests[tick % TEMPLATES]
            while True:
                try:
                    producer.produce(topics.telemetry, key=node_id.encode(), value=value)
                    break
                except BufferError:
                    producer.poll(0.05)
            sent += 1
        producer.poll(0)
    assert producer.flush(120) == 0
    return sent, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--ticks", type=int, default=125)
    args = parser.parse_args()
    settings = Settings.from_env()
    tune_gc_for_large_state()  # as `fleetline serve` and `fleetline replay` do
    figures: dict[str, object] = {"nodes": args.nodes, "gpus": args.nodes * 8, "ticks": args.ticks}
    with local_services(settings) as settings:
        topics = Topics(prefix=f"bench.view.{uuid.uuid4().hex[:8]}")
        kafka_clients.ensure_topics(settings.kafka, topics.specs())
        sent, seconds = produce(settings, topics, args.nodes, args.ticks)
        figures["events"] = sent
        figures["gpu_samples"] = sent * 8
        figures["produce_events_per_s"] = sent / seconds
        _, end = log_bounds(settings.kafka, topics)

        gc.collect()
        figures["rss_mib_before_rebuild"] = rss_mib()
        workers = os.cpu_count() or 1
        figures["rebuild_workers"] = workers
        cpu, wall = _cpu_s(), time.perf_counter()
        full = rebuild(settings.kafka, topics, end, workers=workers)
        cpu, wall = _cpu_s() - cpu, time.perf_counter() - wall
        assert full.view.node_events == sent and full.dead_letters == 0
        figures["rebuild_from_log_s"] = wall
        figures["rebuild_from_log_s_target"] = "< 60 for 10 M events, no snapshot"
        figures["fold_events_per_s"] = sent / wall
        figures["fold_gpu_samples_per_s"] = sent * 8 / wall
        figures["fold_cpu_s"] = cpu
        figures["fold_gpu_samples_per_cpu_s"] = sent * 8 / cpu
        capacity = cluster_capacity(full.view)
        figures["view_gpus"] = sum(c["gpus"] for c in capacity)
        gc.collect()
        figures["rss_mib_holding_the_view"] = rss_mib()
        del full
        gc.collect()

        # A snapshot at 90% of the log, then the rebuild that starts from it.
        store = ObjectStore.from_settings(settings.s3)
        store.ensure_bucket()
        snapshots = ViewSnapshots(SnapshotStore(store, f"views/{topics.prefix}/bench"))
        at_90 = {t: {p: (o * 9) // 10 for p, o in ps.items()} for t, ps in end.items()}
        partial = rebuild(settings.kafka, topics, at_90)
        began = time.perf_counter()
        saved = 0
        for name, part in partial.parts.items():
            if part.node_events:
                info = snapshots.save(name, part)
                saved += len(store.get(info.blob_key))
        figures["snapshot_save_s"] = time.perf_counter() - began
        figures["snapshot_mib"] = saved / 2**20
        del partial
        gc.collect()
        began = time.perf_counter()
        resumed = rebuild(settings.kafka, topics, end, snapshots)
        figures["rebuild_with_snapshot_at_90pct_s"] = time.perf_counter() - began
        figures["rebuild_with_snapshot_folded_events"] = resumed.folded
        assert resumed.view.node_events == sent
        figures["rss_mib_peak"] = _peak_rss_mib()
    report("view", figures)


def _cpu_s() -> float:
    """CPU seconds of this process and of its ended children (the rebuild's workers)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    main()
