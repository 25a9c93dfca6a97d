"""The `fleetline` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence

from fleetline.agents.simulator import default_clusters
from fleetline.config import Settings
from fleetline.errors import FleetlineError
from fleetline.infra import LocalServices
from fleetline.streams.topics import Topics


def _cmd_infra(args: argparse.Namespace, settings: Settings) -> int:
    services = LocalServices.from_settings(settings)
    if args.action == "start":
        timings = services.start()
        print(json.dumps({k: round(v, 2) for k, v in timings.items()}))
    elif args.action == "stop":
        services.stop()
    elif args.action == "wipe":
        services.broker.wipe()
        services.object_store.wipe()
    for name, up in services.status().items():
        print(f"{name}: {'up' if up else 'down'}")
    return 0


def _cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    from fleetline.pipeline import run_slice

    services = LocalServices.from_settings(settings)
    already_up = all(services.status().values())
    if not args.external_services:
        print("starting Kafka and the S3 server (the first run downloads and builds them)...")
        for step, seconds in services.start().items():
            print(f"  {step}: {seconds:.1f}s")
    clusters = default_clusters(args.nodes)[: args.clusters]
    prefix = args.topic_prefix or f"fleetline.run{int(time.time())}"
    start_ms = (int(time.time() * 1000) // args.interval_ms) * args.interval_ms
    print(f"running {len(clusters)} clusters x {args.nodes} nodes x 8 GPUs for {args.ticks} "
          f"intervals of {args.interval_ms} ms (topics {prefix}.*)")
    try:
        result = run_slice(
            settings, clusters, ticks=args.ticks, interval_ms=args.interval_ms, seed=args.seed,
            start_ms=start_ms, realtime=args.realtime, topics=Topics(prefix),
            progress=lambda line: print("  " + line),
        )
    finally:
        if not args.external_services and not args.keep_services and not already_up:
            services.stop()
    print(f"\nagents sent {result.telemetry_sent} NodeTelemetry and {result.states_sent} "
          f"NodeState records, plus {result.malformed_sent} malformed message")
    print(f"dead-lettered: {result.processor_dead_letters} by the live view, "
          f"{result.sink_dead_letters} by the sink (topic {prefix}.deadletter)")
    print("\nlive view (Kafka -> transactional processor, state in a changelog-backed store):")
    print(f"  {'cluster':<12}{'region':<10}{'nodes':>6}{'down':>6}{'GPUs':>6}{'avg util %':>12}")
    for c in result.view:
        print(f"  {c.cluster_id:<12}{c.region:<10}{c.nodes:>6}{c.nodes_down:>6}{c.gpus:>6}"
              f"{c.avg_gpu_util_pct if c.avg_gpu_util_pct is not None else '-':>12}")
    print(f"\nClickHouse hot table ({settings.clickhouse_url}): {result.sink_rows} GPU sample rows "
          "inserted; per cluster since the run started:")
    print(f"  {'cluster':<12}{'samples':>9}{'nodes':>7}{'avg util %':>12}{'max power W':>13}")
    for cluster_id, samples, nodes, util, power in result.query_rows:
        print(f"  {cluster_id:<12}{samples:>9}{nodes:>7}{util:>12}{power:>13}")
    print(f"\nview snapshot written to and read back from {result.snapshot_key}")
    print("timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in result.timings.items()))
    return 0


def _cmd_sql(args: argparse.Namespace, settings: Settings) -> int:
    from fleetline.storage.query_service import run_query

    result = run_query(settings.clickhouse_url, args.query)
    print("\t".join(result.columns))
    for row in result.rows:
        print("\t".join(str(v) for v in row))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetline",
        description="Event-sourced control plane for multi-cluster GPU fleets. Settings come "
                    "from FLEETLINE_* environment variables (see README).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    infra = sub.add_parser("infra", help="start, stop or inspect the local Kafka and S3 services")
    infra.add_argument("action", choices=["start", "stop", "status", "wipe"],
                       help="wipe stops the services and deletes their data")
    infra.set_defaults(func=_cmd_infra)

    run = sub.add_parser("run", help="run the simulated fleet end to end and print what it saw")
    run.add_argument("--clusters", type=int, default=3, choices=[1, 2, 3])
    run.add_argument("--nodes", type=int, default=4, help="nodes per cluster (8 GPUs each)")
    run.add_argument("--ticks", type=int, default=20, help="sampling intervals to simulate")
    run.add_argument("--interval-ms", type=int, default=1000, help="sampling interval")
    run.add_argument("--seed", type=int, default=7, help="simulator seed")
    run.add_argument("--realtime", action=argparse.BooleanOptionalAction, default=True,
                     help="pace the agents at the sampling interval (--no-realtime: at once)")
    run.add_argument("--topic-prefix", help="topic prefix (default: a fresh one per run)")
    run.add_argument("--keep-services", action="store_true",
                     help="leave Kafka and the S3 server running afterwards")
    run.add_argument("--external-services", action="store_true",
                     help="use the Kafka and S3 named in the settings; start nothing")
    run.set_defaults(func=_cmd_run)

    sql = sub.add_parser(
        "sql", help="run a read-only ClickHouse SQL query on the configured store",
        description="Runs one read-only query. With the embedded chdb store, a running "
                    "`fleetline run` owns it and answers the query; otherwise it is opened here.")
    sql.add_argument("query")
    sql.set_defaults(func=_cmd_sql)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # librdkafka warns while a fresh broker loads its coordinators; it retries by itself.
        logging.getLogger("fleetline.librdkafka").setLevel(logging.ERROR)
    try:
        return args.func(args, Settings.from_env())
    except FleetlineError as exc:
        print(f"fleetline: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
