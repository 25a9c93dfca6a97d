"""Tiered-storage benchmark: sink insert rate from Kafka, last-hour query latency over a large
hot table, export rate to warm, and bytes per GPU sample in each tier.

    .venv/bin/python benchmarks/tiers.py [--hot-rows 100000000] [--sim-nodes 50] [--days 9]

Bytes per sample come from simulated telemetry (`--sim-nodes` 8-GPU nodes, one record a minute
for `--days`), tiered with the real policy (24 h hot, 7 days warm, then cold). The query figure
uses a synthetic hot table of `--hot-rows` rows over 24 hours for 80,000 GPUs, generated inside
ClickHouse, since producing 100 million rows through Python would take most of an hour here.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid

from _common import local_services, report, running_sample_sink

from fleetline.agents.simulator import ClusterSpec, FleetSimulator
from fleetline.config import Settings
from fleetline.storage.clickhouse import connect, migrate
from fleetline.storage.hot_sink import HotSampleStore, SourcedTelemetry, to_columns
from fleetline.storage.objects import ObjectStore
from fleetline.storage.tiering.policy import COLD, DAY_MS, WARM
from fleetline.storage.tiering.store import TieredStore
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics


def sink_rate(settings: Settings, client, db: str, records: int) -> dict[str, float]:
    codec = default_codec()
    sim = FleetSimulator([ClusterSpec(f"c{i}", "r", 125) for i in range(8)], seed=3)
    topics = Topics(prefix=f"bench.tiers.{uuid.uuid4().hex[:8]}")
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    producer = kafka_clients.producer(settings.kafka, {"linger.ms": 50})
    sent, tick = 0, 0
    while sent < records:
        tick += 1
        for record in sim.telemetry(1_796_000_000_000 + tick * 1000):
            producer.produce(
                topics.telemetry,
                key=record["node_id"].encode(),
                value=codec.encode("NodeTelemetry", record),
            )
            producer.poll(0)
            sent += 1
    producer.flush(60)
    # Sustained rate: from the partitions' assignment until the last record is stored.
    with running_sample_sink(settings, HotSampleStore(client, db), topics, 50_000) as step:
        began, cpu_began = time.perf_counter(), time.process_time()
        while step.stats.messages < sent:
            time.sleep(0.01)
        seconds = time.perf_counter() - began
        cpu_s = time.process_time() - cpu_began  # every thread of this process, chdb's included
    return {
        "sink_rows_per_s": step.stats.rows / seconds,
        "sink_process_cpu_us_per_row": cpu_s / step.stats.rows * 1e6,
        "sink_rows": step.stats.rows,
    }


def hot_query(client, db: str, rows: int) -> dict[str, float]:
    end = 1_796_083_200  # seconds; a day of synthetic samples ending here
    client.command(f"CREATE TABLE {db}.big AS {db}.gpu_samples")
    began = time.perf_counter()
    client.command(
        f"INSERT INTO {db}.big (ts, cluster_id, region, node_id, gpu_index, gpu_uuid, vendor, "
        "model, gpu_util_pct, fb_used_mib, fb_total_mib, temperature_c, power_w, ecc_sbe_total, "
        "ecc_dbe_total, xid_codes, seq, source_partition, source_offset) "
        "SELECT fromUnixTimestamp64Milli(toInt64("
        f"({end} - 86400 + intDiv(number, 80000) * (86400 / {rows // 80000})) * 1000), 'UTC'), "
        "concat('c', toString(number % 8)), 'r', concat('n', toString(intDiv(number % 80000, 8))), "
        "number % 8, concat('GPU-', toString(number % 80000)), 'nvidia', 'H100', "
        "(cityHash64(number) % 10000) / 100, 40000, 81559, 60, 400 + cityHash64(number) % 300, "
        "0, 0, [], intDiv(number, 80000), 0, number "
        f"FROM numbers({rows}) SETTINGS max_insert_threads = 2"
    )
    load_s = time.perf_counter() - began
    query = (
        f"SELECT cluster_id, avg(gpu_util_pct), count() FROM {db}.big WHERE ts >= "
        f"fromUnixTimestamp64Milli({(end - 3600) * 1000}, 'UTC') GROUP BY cluster_id"
    )
    timings = []
    for _ in range(5):
        began = time.perf_counter()
        result = client.query(query).result_rows
        timings.append(time.perf_counter() - began)
    assert len(result) == 8
    return {
        "hot_rows": rows,
        "hot_load_rows_per_s": rows / load_s,
        "last_hour_query_s_best": min(timings),
        "last_hour_query_s_median": sorted(timings)[len(timings) // 2],
    }


def tier_bytes(settings: Settings, client, db: str, nodes: int, days: int) -> dict[str, float]:
    sim = FleetSimulator(
        [
            ClusterSpec("c1", "eu-west", nodes // 2),
            ClusterSpec("c2", "us-east", nodes - nodes // 2),
        ],
        seed=9,
        interval_ms=60_000,
    )
    now = 1_796_083_200_000
    start = now - days * DAY_MS
    store = HotSampleStore(client, db)
    batch: list[SourcedTelemetry] = []
    offset = 0
    codec = default_codec()
    avro_bytes = avro_samples = 0
    for t in range(days * DAY_MS // 60_000):
        for record in sim.telemetry(start + t * 60_000):
            batch.append(SourcedTelemetry(0, offset, record))
            offset += 1
            if t % 60 == 0:  # the raw size: records as agents send them, single-object Avro
                avro_bytes += len(codec.encode("NodeTelemetry", record))
                avro_samples += len(record["gpus"])
        if len(batch) >= 20_000:
            store.store(to_columns(batch))
            batch = []
    if batch:
        store.store(to_columns(batch))
    client.command(f"OPTIMIZE TABLE {db}.gpu_samples FINAL")
    ((rows, hot_bytes),) = client.query(
        f"SELECT sum(rows), sum(data_compressed_bytes) FROM system.parts WHERE database = "
        f"'{db}' AND table = 'gpu_samples' AND active"
    ).result_rows
    objects = ObjectStore.from_settings(settings.s3)
    objects.ensure_bucket()
    tiers = TieredStore(
        client, db, objects, settings.s3, root=f"bench-tiers-{uuid.uuid4().hex[:8]}"
    )
    began = time.perf_counter()
    tiers.run_once(now)
    tier_s = time.perf_counter() - began
    warm, cold = tiers.manifests(WARM), tiers.manifests(COLD)
    warm_rows = sum(m.rows for m in warm)
    cold_rows = sum(m.rows for m in cold)
    avro_per_sample = avro_bytes / avro_samples
    return {
        "sim_rows": int(rows),
        "hot_bytes_per_sample": hot_bytes / rows,
        "warm_bytes_per_sample": sum(m.bytes for m in warm) / max(warm_rows, 1),
        "cold_bytes_per_sample": sum(m.bytes for m in cold) / max(cold_rows, 1),
        "raw_avro_bytes_per_sample": avro_per_sample,
        "cold_vs_avro_ratio": avro_per_sample / (sum(m.bytes for m in cold) / max(cold_rows, 1)),
        "tiering_pass_rows_per_s": tiers.stats.rows_moved / tier_s,
        "tiering_pass_s": tier_s,
        "warm_objects": len(warm),
        "cold_objects": len(cold),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hot-rows", type=int, default=100_000_000)
    parser.add_argument("--sim-nodes", type=int, default=50)
    parser.add_argument("--days", type=int, default=9)
    parser.add_argument("--sink-records", type=int, default=300_000)
    parser.add_argument(
        "--only",
        choices=["sink", "bytes", "query"],
        help="run one part (the figures file then holds that part only)",
    )
    args = parser.parse_args()
    if args.only in (None, "bytes") and args.days < 9:
        # A day goes cold once it is past the 7 warm days and closed: 9 days give at least one.
        parser.error("--days must be at least 9 for the tiering pass to write a cold archive")
    settings = Settings.from_env()
    client = connect(f"chdb://{tempfile.mkdtemp(prefix='bench-tiers-')}")
    figures: dict[str, object] = {}
    with local_services(settings) as settings:
        if args.only in (None, "sink"):
            migrate(client, "sink")
            figures.update(sink_rate(settings, client, "sink", args.sink_records))
        if args.only in (None, "bytes"):
            migrate(client, "tiers")
            figures.update(tier_bytes(settings, client, "tiers", args.sim_nodes, args.days))
        if args.only in (None, "query"):
            migrate(client, "big")
            figures.update(hot_query(client, "big", args.hot_rows))
    report("tiers" if args.only is None else f"tiers-{args.only}", figures)


if __name__ == "__main__":
    main()
