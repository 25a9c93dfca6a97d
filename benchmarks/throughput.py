"""Foundation benchmarks: NodeTelemetry produce throughput and the ClickHouse sink's insert rate.

Runs against the real local broker (started if it is not running) and an embedded chdb store in
a scratch folder. Prints the figures and writes them to benchmarks/results/throughput.json.

    .venv/bin/python benchmarks/throughput.py [--nodes 1000] [--ticks 30]
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
import uuid
from pathlib import Path

from _common import local_services, report, running_sample_sink

from fleetline.agents.runtime import TelemetryPublisher
from fleetline.agents.simulator import ClusterSpec, FleetSimulator
from fleetline.agents.spool import DiskSpool
from fleetline.config import Settings
from fleetline.storage.clickhouse import connect, migrate
from fleetline.storage.hot_sink import HotSampleStore, SourcedTelemetry, to_columns
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics

BASE_MS = 1_796_000_000_000


def fleet(nodes: int) -> FleetSimulator:
    per = nodes // 4
    return FleetSimulator([ClusterSpec(f"c{i}", f"r{i}", per) for i in range(4)], seed=1)


def bench(nodes: int, ticks: int) -> dict[str, float]:
    settings = Settings.from_env()
    codec = default_codec()
    sim = fleet(nodes)
    figures: dict[str, float] = {"nodes": nodes, "ticks": ticks, "gpus_per_node": 8}

    began = time.perf_counter()
    batches = [sim.telemetry(BASE_MS + t * 1000) for t in range(ticks)]
    figures["simulate_records_per_s"] = nodes * ticks / (time.perf_counter() - began)
    records = [r for batch in batches for r in batch]

    began = time.perf_counter()
    encoded = [codec.encode("NodeTelemetry", r) for r in records]
    figures["encode_records_per_s"] = len(records) / (time.perf_counter() - began)
    figures["bytes_per_record"] = sum(map(len, encoded)) / len(encoded)

    began = time.perf_counter()
    for data in encoded:
        codec.decode(data)
    figures["decode_records_per_s"] = len(records) / (time.perf_counter() - began)

    topics = Topics(prefix=f"bench.{uuid.uuid4().hex[:8]}")
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    spool_dir = tempfile.mkdtemp(prefix="bench-spool-")
    publisher = TelemetryPublisher(
        kafka_clients.producer(settings.kafka),
        codec,
        topics,
        DiskSpool(Path(spool_dir), max_bytes=2**31),
    )
    cpu0 = time.process_time()
    began = time.perf_counter()
    publisher.publish_telemetry(records)
    publisher.flush(120)
    elapsed = time.perf_counter() - began
    cpu = time.process_time() - cpu0
    figures["produce_records_per_s"] = len(records) / elapsed
    figures["produce_gpu_samples_per_s"] = 8 * len(records) / elapsed
    # Encode + produce CPU per node per 1 s interval: the agent's cost at 1 Hz.
    figures["produce_cpu_ms_per_node_interval"] = 1000 * cpu / len(records)

    with tempfile.TemporaryDirectory() as scratch:
        client = connect(f"chdb://{scratch}/chdb")
        migrate(client, "bench")
        store = HotSampleStore(client, "bench")
        decoded = [SourcedTelemetry(0, i, codec.decode(d).record) for i, d in enumerate(encoded)]
        began = time.perf_counter()
        table = to_columns(decoded)
        figures["to_columns_rows_per_s"] = table.num_rows / (time.perf_counter() - began)
        began = time.perf_counter()
        for start in range(0, table.num_rows, 200_000):
            store.store(table.slice(start, 200_000))
        figures["chdb_insert_arrow_rows_per_s"] = table.num_rows / (time.perf_counter() - began)
        client.command("TRUNCATE TABLE bench.gpu_samples")

        with running_sample_sink(settings, store, topics, 5000) as step:
            began = time.perf_counter()
            while step.stats.messages < len(records):
                time.sleep(0.05)
            elapsed = time.perf_counter() - began
        figures["sink_kafka_to_chdb_rows_per_s"] = step.stats.rows / elapsed
        rows = client.query("SELECT count() FROM bench.gpu_samples").result_rows[0][0]
        assert rows == 8 * len(records), (rows, len(records))
    figures["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--ticks", type=int, default=30)
    args = parser.parse_args()
    settings = Settings.from_env()
    with local_services(settings) as settings:
        figures = bench(args.nodes, args.ticks)
    report("throughput", figures)


if __name__ == "__main__":
    main()
