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


def _cmd_agent(args: argparse.Namespace, settings: Settings) -> int:
    import socket
    import threading
    from pathlib import Path

    from fleetline.streams import kafka as kafka_clients
    from fleetline.streams.serde import default_codec

    topics = Topics(args.topic_prefix)
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    state_dir = Path(args.state_dir or settings.cache_dir / "agent")
    stop = threading.Event()
    if args.collector == "nvml":
        from fleetline.agents.node import NodeAgent, NodeIdentity
        from fleetline.agents.nvml import NvmlCollector

        identity = NodeIdentity(args.cluster_id, args.region, args.node_id or socket.gethostname(),
                                leaf_switch=args.leaf_switch)
        agent = NodeAgent.create(settings, default_codec(), topics, identity,
                                 NvmlCollector().open(), state_dir, interval_ms=args.interval_ms)
        try:
            ticks = agent.run(stop, max_ticks=args.ticks)
        finally:
            agent.close()
        print(f"{identity.node_id}: {ticks} intervals sent to {topics.telemetry}")
        return 0

    from fleetline.agents.fleet import FleetAgent
    from fleetline.agents.simulator import FleetSimulator, load_faults

    start_ms = (int(time.time() * 1000) // args.interval_ms) * args.interval_ms
    faults = load_faults(Path(args.faults), start_ms) if args.faults else []
    simulator = FleetSimulator(default_clusters(args.nodes)[: args.clusters], seed=args.seed,
                               interval_ms=args.interval_ms, faults=faults)
    agent = FleetAgent.create(settings, default_codec(), topics, simulator, state_dir)
    try:
        agent.start(start_ms)
        tick = 0
        while args.ticks is None or tick < args.ticks:
            tick += 1
            agent.tick(start_ms + tick * args.interval_ms)
            time.sleep(max(0.0, start_ms / 1000 + tick * args.interval_ms / 1000 - time.time()))
        agent.flush()
    finally:
        agent.close()
    print(f"{len(simulator.nodes)} simulated nodes: {tick} intervals sent to {topics.telemetry}; "
          f"spools: {agent.spool_metrics()}")
    return 0


def _cmd_command(args: argparse.Namespace, settings: Settings) -> int:
    import uuid

    from fleetline.errors import ConfigError
    from fleetline.streams import kafka as kafka_clients
    from fleetline.streams.serde import default_codec

    config = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set takes key=value, got {item!r}")
        config[key] = value
    record = {
        "command_id": args.command_id or uuid.uuid4().hex, "cluster_id": args.cluster_id,
        "node_id": args.node_id, "ts": int(time.time() * 1000), "issued_by": args.issued_by,
        "kind": args.kind, "power_cap_w": args.power_cap_w,
        "config_version": args.config_version, "config": config,
    }
    topics = Topics(args.topic_prefix)
    producer = kafka_clients.producer(settings.kafka)
    producer.produce(topics.commands, key=args.node_id.encode(),
                     value=default_codec().encode("NodeCommand", record))
    if producer.flush(30):
        raise FleetlineError("the command was not delivered within 30 s")
    print(f"sent {args.kind} {record['command_id']} to {args.node_id} on {topics.commands}")
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

    agent = sub.add_parser(
        "agent", help="run a node agent: real GPUs through NVML, or a simulated fleet",
        description="Sends NodeTelemetry every interval and NodeState heartbeats through an "
                    "on-disk spool, and applies the node's commands.")
    agent.add_argument("collector", choices=["nvml", "simulator"])
    agent.add_argument("--topic-prefix", default="fleetline")
    agent.add_argument("--interval-ms", type=int, default=1000)
    agent.add_argument("--ticks", type=int, help="stop after this many intervals")
    agent.add_argument("--state-dir", help="spool and control state (default: .cache/agent)")
    agent.add_argument("--cluster-id", default="local", help="nvml: this node's cluster")
    agent.add_argument("--region", default="local", help="nvml: this node's region")
    agent.add_argument("--node-id", help="nvml: this node's id (default: the host name)")
    agent.add_argument("--leaf-switch", help="nvml: the node's leaf switch, if known")
    agent.add_argument("--clusters", type=int, default=3, choices=[1, 2, 3])
    agent.add_argument("--nodes", type=int, default=4, help="simulator: nodes per cluster")
    agent.add_argument("--seed", type=int, default=7)
    agent.add_argument("--faults", help="simulator: a YAML fault script (see tests/scenarios)")
    agent.set_defaults(func=_cmd_agent)

    command = sub.add_parser("command", help="send a command to a node agent")
    command.add_argument("node_id")
    command.add_argument("kind", choices=["DRAIN", "CORDON", "UNCORDON", "SET_POWER_CAP",
                                          "APPLY_CONFIG"])
    command.add_argument("--cluster-id", required=True)
    command.add_argument("--power-cap-w", type=float)
    command.add_argument("--config-version")
    command.add_argument("--set", action="append", metavar="KEY=VALUE",
                         help="APPLY_CONFIG setting, e.g. interval_ms=5000")
    command.add_argument("--command-id", help="default: a new random id")
    command.add_argument("--issued-by", default="cli")
    command.add_argument("--topic-prefix", default="fleetline")
    command.set_defaults(func=_cmd_command)

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
