"""The `fleetline` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fleetline.agents.simulator import default_clusters
from fleetline.config import Settings
from fleetline.errors import ConfigError, FleetlineError
from fleetline.infra import LocalServices
from fleetline.streams.topics import Topics

if TYPE_CHECKING:
    from fleetline.storage.tiers import DataClass


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
    print(f"dead-lettered: {result.processor_dead_letters} by the resource view, "
          f"{result.sink_dead_letters} by the sink (topic {prefix}.deadletter)")
    print("\nresource view (Kafka -> fold of telemetry, node state and cluster facts):")
    _print_capacity(result.clusters)
    print(f"\nunhealthy GPUs ({len(result.unhealthy_gpus)}):")
    for gpu in result.unhealthy_gpus[:20]:
        print(f"  {gpu['node_id']}/{gpu['gpu_index']}  {gpu['health']:<9} {gpu['cause']:<10} "
              f"since {gpu['health_since_ms']}")
    replay = result.half_way_replay
    print(f"\nreplay: the view as it stood half-way (at {replay['at_ms']} ms, version "
          f"{replay['view_version']}), rebuilt from snapshots {replay['from_snapshots'] or 'none'}"
          f" + {replay['folded']} events of log:")
    _print_capacity(result.half_way_clusters)
    print(f"\nClickHouse hot table ({settings.clickhouse_url}): {result.sink_rows} GPU sample rows "
          "inserted; per cluster since the run started:")
    print(f"  {'cluster':<12}{'samples':>9}{'nodes':>7}{'avg util %':>12}{'max power W':>13}")
    for cluster_id, samples, nodes, util, power in result.query_rows:
        print(f"  {cluster_id:<12}{samples:>9}{nodes:>7}{util:>12}{power:>13}")
    print("\nview snapshots in object storage (the newest per part):")
    for key in result.snapshots:
        print(f"  {key}")
    print("\nHTTP API, called as viewer@acme (and once with a made-up token):")
    for path, status in result.api_calls:
        print(f"  GET {path:<34} -> {status}")
    audit = result.audit
    print(f"\naudit log: {audit['links']} links ({audit['digests']} signed digests, key "
          f"{audit['key_id']}) in ClickHouse, chain "
          f"{'verified' if audit['ok'] else 'BROKEN: ' + str(audit['first_broken'])}")
    _print_scheduling(result.scheduling)
    print("timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in result.timings.items()))
    return 0


def _print_scheduling(scheduling: dict) -> None:
    print(f"\nscheduler decisions ({len(scheduling['decisions'])}, every one an event on the "
          "decision log with its reasons and the view offsets it read):")
    for decision_id, job, outcome, where, reason in scheduling["decisions"]:
        print(f"  {decision_id:>6} {job:<22} {outcome:<9} {where:<22} {reason[:70]}")
    print("\njobs as the scheduler holds them:")
    for key, phase, where, gpus in scheduling["jobs"]:
        print(f"  {key:<22} {phase:<9} {gpus:>3} GPUs  {where}")
    waiting = scheduling["waiting"]
    if waiting:
        print(f"\nwhy {waiting['job']} waits (fleetline explain): {waiting['reason'][:160]}")
        for alt in waiting["alternatives"]:
            print(f"  {alt['cluster_id']:<14} {alt['rejected'] or alt['total']}")
    for name, (columns, rows) in scheduling.get("ready_queries", {}).items():
        print(f"\nfleetline query {name} (ClickHouse, from the sunk decisions and "
              "allocations):")
        print("  " + "  ".join(f"{c:>14}" for c in columns))
        for row in rows:
            print("  " + "  ".join(f"{v!s:>14}" for v in row))
    replay = scheduling["replay"]
    print(f"\ndecision replay: {replay['requests']} requests ({replay['ticks']} ticks) refolded "
          f"in {replay['seconds']}s; {replay['matched']} of {replay['decisions']} decisions "
          "identical byte for byte" + ("" if replay["ok"] else
                                      f" - DIFFERENT: {replay['first_difference']}"))


def _print_capacity(clusters: list[dict]) -> None:
    print(f"  {'cluster':<12}{'region':<10}{'health':<12}{'GPUs':>5}{'idle':>6}{'alloc':>6}"
          f"{'degr':>6}{'failed':>7}{'unavail':>8}{'nodes':>6}{'down':>5}{'unreach':>8}")
    for c in clusters:
        print(f"  {c['cluster_id']:<12}{c['region']:<10}{c['health']:<12}{c['gpus']:>5}"
              f"{c['idle']:>6}{c['allocated']:>6}{c['degraded']:>6}{c['failed']:>7}"
              f"{c['unavailable']:>8}{c['nodes']:>6}{c['nodes_down']:>5}"
              f"{c['nodes_unreachable']:>8}")


def parse_time_ms(text: str) -> int:
    """Epoch milliseconds, an ISO 8601 time (UTC when it names no zone), or -<n>s|m|h|d ago."""
    import time as _time

    from fleetline.storage.tiers import parse_moment

    return parse_moment(text, int(_time.time() * 1000))


def _snapshots(settings: Settings, prefix: str, group: str):
    from fleetline.storage.objects import ObjectStore
    from fleetline.storage.snapshots import S3ViewSnapshots

    store = ObjectStore.from_settings(settings.s3)
    store.ensure_bucket()
    return S3ViewSnapshots(store, f"views/{prefix}/{group}")


def _target(args: argparse.Namespace, settings: Settings, topics: Topics) -> dict:
    from fleetline.processors.replay import log_bounds, offsets_at

    if getattr(args, "offsets", None):
        try:
            raw = json.loads(args.offsets)
            return {t: {int(p): int(o) for p, o in ps.items()} for t, ps in raw.items()}
        except (ValueError, AttributeError) as exc:
            raise ConfigError(f"--offsets wants {{topic: {{partition: offset}}}}: {exc}") from None
    if getattr(args, "at", None):
        return offsets_at(settings.kafka, topics, parse_time_ms(args.at))
    return log_bounds(settings.kafka, topics)[1]


def _rebuild(args: argparse.Namespace, settings: Settings):
    from fleetline.processors.replay import rebuild
    from fleetline.processors.view.runtime import tune_gc_for_large_state

    tune_gc_for_large_state()
    topics = Topics(args.topic_prefix)
    snapshots = None if args.no_snapshots else _snapshots(settings, args.topic_prefix, args.group)
    return rebuild(settings.kafka, topics, _target(args, settings, topics), snapshots)


def _cmd_replay(args: argparse.Namespace, settings: Settings) -> int:
    from fleetline.processors.replay import offsets_at, walk
    from fleetline.processors.view import codec as view_codec
    from fleetline.processors.view import read as view_read

    topics = Topics(args.topic_prefix)
    if args.decisions:
        return _replay_decisions(args, settings, topics)
    if args.since or args.until:
        if not (args.since and args.until):
            raise ConfigError("--from and --to go together")
        snapshots = None if args.no_snapshots else _snapshots(settings, args.topic_prefix,
                                                              args.group)
        begin = offsets_at(settings.kafka, topics, parse_time_ms(args.since))
        end = offsets_at(settings.kafka, topics, parse_time_ms(args.until))
        result, changes = walk(settings.kafka, topics, begin, end, snapshots)
        for change in changes:
            line = {"ts": change.ts, "entity": change.entity, "id": change.entity_id,
                    "from": change.before, "to": change.after, "cause": change.cause}
            print(json.dumps(line) if args.json else
                  f"{change.ts}  {change.entity:<4} {change.entity_id:<24} "
                  f"{change.before:>11} -> {change.after:<11} {change.cause or ''}")
        print(f"{len(changes)} changes; {result.folded} events folded in {result.seconds:.2f}s",
              file=sys.stderr)
        return 0
    result = _rebuild(args, settings)
    for gap in result.gaps:
        print(f"warning: {gap}", file=sys.stderr)
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(json.dumps(view_codec.to_data(result.view), sort_keys=True))
    meta = view_read.view_meta(result.view)
    print(json.dumps({"folded": result.folded, "dead_letters": result.dead_letters,
                      "seconds": round(result.seconds, 3),
                      "from_snapshots": result.snapshot_positions, **meta}, indent=2))
    if not args.out:
        for cluster in view_read.cluster_capacity(result.view):
            cluster.pop("info")
            print(json.dumps(cluster))
    return 0


def _replay_decisions(args: argparse.Namespace, settings: Settings, topics: Topics) -> int:
    from fleetline.processors.replay import ViewFollower
    from fleetline.processors.scheduling.runtime import replay_decisions
    from fleetline.processors.view.runtime import tune_gc_for_large_state

    tune_gc_for_large_state()
    snapshots = None if args.no_snapshots else _snapshots(settings, args.topic_prefix,
                                                          args.group)
    follower = ViewFollower(settings.kafka, topics, snapshots)
    try:
        result = replay_decisions(settings.kafka, topics, follower.at)
    finally:
        follower.close()
    print(json.dumps({"ok": result.ok, "requests": result.requests, "ticks": result.ticks,
                      "decisions": result.decisions, "matched": result.matched,
                      "first_difference": result.first_difference,
                      "view_rebuilds": follower.rebuilds, "view_events_folded": follower.folded,
                      "seconds": round(result.seconds, 3)}, indent=2))
    return 0 if result.ok else 2


def _cmd_view(args: argparse.Namespace, settings: Settings) -> int:
    from fleetline.processors.view import read as view_read

    view = _rebuild(args, settings).view
    labels = dict(item.split("=", 1) for item in args.label or [] if "=" in item)
    if args.what == "clusters":
        items = view_read.cluster_capacity(view, args.region)
    elif args.what == "nodes":
        items = [view_read.node_data(view, n, with_gpus=False) for n in
                 view_read.select_nodes(view, args.cluster, args.status, labels)]
    elif args.what == "node":
        if not args.id or args.id not in view.nodes:
            raise ConfigError(f"no node {args.id!r} in the view")
        items = [view_read.node_data(view, view.nodes[args.id])]
    elif args.what == "gpus":
        items = view_read.select_gpus(view, args.cluster, args.health, args.capacity)
    else:
        cluster = args.id or args.cluster
        if not cluster:
            raise ConfigError("topology needs a cluster id")
        items = [view_read.topology(view, cluster)]
    if args.json:
        print(json.dumps(items, indent=2))
        return 0
    for item in items:
        if args.what == "clusters":
            print(f"{item['cluster_id']:<14}{item['region']:<10}{item['health']:<12}"
                  f"gpus {item['gpus']:>6}  idle {item['idle']:>6}  allocated "
                  f"{item['allocated']:>6}  degraded {item['degraded']:>4}  failed "
                  f"{item['failed']:>4}  unavailable {item['unavailable']:>5}")
        elif args.what == "nodes":
            print(f"{item['node_id']:<20}{item['cluster_id']:<14}{item['status']:<12}"
                  f"healthy GPUs {item['gpus_healthy']}/{item['gpu_count']}")
        elif args.what == "gpus":
            print(f"{item['node_id']}/{item['gpu_index']:<3} {item['health']:<9}"
                  f"{item['cause'] or '':<16}{item['capacity']:<12}util {item['gpu_util_pct']}")
        else:
            print(json.dumps(item, indent=2))
    return 0


def _verify_keys(settings: Settings) -> dict:
    from fleetline.processors.audit.runtime import load_public_keys

    paths = list(settings.audit_verify_keys)
    if not paths and settings.signing_key_path().exists():
        paths = [settings.signing_key_path()]
    return load_public_keys(paths)


def _sealed_store(settings: Settings):
    from fleetline.storage.crypto import ObjectCipher, SealedObjectStore
    from fleetline.storage.objects import ObjectStore

    store = ObjectStore.from_settings(settings.s3)
    store.ensure_bucket()
    cipher = (ObjectCipher.from_base64(settings.object_encryption_key)
              if settings.object_encryption_key else None)
    return SealedObjectStore(store, cipher)


def _cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    import signal
    import threading

    from fleetline.processors.audit.runtime import (
        APPLICATION_ID as AUDIT_APP,
    )
    from fleetline.processors.audit.runtime import (
        KafkaAuditEmitter,
        audit_chainer,
        load_signer,
    )
    from fleetline.processors.scheduling.runtime import (
        KafkaJobs,
        SchedulerService,
        load_policy,
        scheduler_topics,
    )
    from fleetline.processors.view.runtime import ViewProcessor
    from fleetline.storage.audit_store import AuditArchive, AuditTable
    from fleetline.storage.clickhouse import connect, migrate
    from fleetline.storage.hot_sink import HotSampleSink, HotSampleStore
    from fleetline.storage.objects import ObjectStore
    from fleetline.storage.offset_sink import OffsetSink
    from fleetline.storage.query_service import QueryService, query_client
    from fleetline.storage.scheduling_sink import AllocationTable, DecisionTable
    from fleetline.storage.state_sink import NodeStateTable
    from fleetline.storage.tiers import TieredStore
    from fleetline.streams import kafka as kafka_clients
    from fleetline.streams.events import (
        ALLOCATION,
        AUDIT_RECORD,
        NODE_STATE,
        SCHEDULING_DECISION,
    )
    from fleetline.streams.serde import default_codec

    if not args.no_api and settings.auth_config is None:
        raise ConfigError("the API needs FLEETLINE_AUTH_CONFIG (tokens and/or JWT settings; "
                          "see `fleetline auth token`), or run with --no-api")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    topics = Topics(args.topic_prefix)
    kafka_clients.ensure_topics(settings.kafka, [*scheduler_topics(topics),
                                                 topics.changelog_spec(AUDIT_APP, "chain")])
    snapshots = _snapshots(settings, args.topic_prefix, args.group)
    processor = ViewProcessor(settings.kafka, topics, snapshots,
                              group_id=args.group, instance_id=args.instance_id,
                              snapshot_interval_s=args.snapshot_interval)
    workers: list = [processor]
    scheduler = None
    if not args.no_scheduler:
        from fleetline.processors.replay import rebuild
        from fleetline.processors.scheduling.capacity import observe

        def facts_at(offsets: dict) -> object:
            return observe(rebuild(settings.kafka, topics, offsets, snapshots).view)

        scheduler = SchedulerService(settings.kafka, topics, processor, facts_at,
                                     load_policy(args.scheduler_policy),
                                     tick_interval_s=args.tick_interval,
                                     instance_id=args.instance_id)
        workers.append(scheduler)
    client = connect(settings.clickhouse_url)
    migrate(client, settings.clickhouse_database)
    codec = default_codec()
    db = settings.clickhouse_database
    workers.append(HotSampleSink(settings.kafka, codec, HotSampleStore(client, db),
                                 topics.telemetry, topics.dead_letter,
                                 group_id=f"{topics.prefix}.hot-sink"))
    workers.append(OffsetSink(settings.kafka, codec, topics.node_state, NODE_STATE,
                              NodeStateTable(client, db), topics.dead_letter,
                              f"{topics.prefix}.node-states"))
    for topic, record, table in (
            (topics.decisions, SCHEDULING_DECISION, DecisionTable(client, db)),
            (topics.allocations, ALLOCATION, AllocationTable(client, db))):
        workers.append(OffsetSink(settings.kafka, codec, topic, record, table,
                                  topics.dead_letter, f"{topics.prefix}.{table.name}-sink"))
    audit_table = None
    if not args.no_audit:
        signer = load_signer(settings.signing_key_path(), create=True)
        audit_table = AuditTable(client, settings.clickhouse_database)
        archive = AuditArchive(_sealed_store(settings), f"audit/{topics.prefix}")
        workers.append(audit_chainer(settings.kafka, topics, signer,
                                     instance_id=args.instance_id))
        for destination in (audit_table, archive):
            workers.append(OffsetSink(settings.kafka, codec, topics.audit_log,
                                      AUDIT_RECORD, destination, topics.dead_letter,
                                      f"{topics.prefix}.audit-{destination.name}"))
    stop = threading.Event()
    if args.tier_every:
        workers.append(_TierLoop(TieredStore(client, db, ObjectStore.from_settings(settings.s3),
                                             settings.s3, _tier_policy(args)),
                                 args.tier_every))
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    from fleetline.storage.tiers import expander

    queries = QueryService(client, settings.clickhouse_url, expand=expander(settings)).start()
    try:
        if args.no_api:
            while not stop.wait(1.0):
                pass
        else:
            import uvicorn

            from fleetline.api.auth import AuthConfig, Authenticator
            from fleetline.api.http import create_app

            emitter = KafkaAuditEmitter(settings.kafka, topics)

            def sql(query: str) -> dict:
                result = query_client(client, query, expander(settings))
                return {"columns": result.columns, "rows": result.rows}

            def ready(name: str, since: str, until: str | None) -> dict:
                from fleetline.storage.queries import ready_sql

                return sql(ready_sql(name, since, until))

            app = create_app(processor,
                             Authenticator(AuthConfig.from_file(settings.auth_config)),
                             emitter, audit_table, sql, ready,
                             jobs=KafkaJobs(settings.kafka, topics, scheduler))
            server = uvicorn.Server(uvicorn.Config(
                app, host=args.host, port=args.port, log_level="warning",
                ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key))
            server.run()
            emitter.flush()
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        queries.stop()
    return 0


class _TierLoop:
    """Runs the tiering pass every `every` seconds inside the process that owns the store."""

    def __init__(self, store, every: float) -> None:
        self.store = store
        self.every = every

    def run(self, stop) -> None:
        import logging as _logging

        from fleetline.errors import FleetlineError as _Error
        from fleetline.storage.tiers import wall_clock_ms

        while not stop.wait(self.every):
            try:
                self.store.run_once(wall_clock_ms())
            except _Error as exc:  # the next pass retries; every move is restartable
                _logging.getLogger("fleetline.tiers").warning("tiering pass failed: %s", exc)


def _audit_records(args: argparse.Namespace, settings: Settings) -> list:
    if args.source == "kafka":
        from fleetline.processors.audit.runtime import read_chain

        return read_chain(settings.kafka, Topics(args.topic_prefix))
    from fleetline.storage.audit_store import AuditTable
    from fleetline.storage.clickhouse import connect

    return list(AuditTable(connect(settings.clickhouse_url),
                           settings.clickhouse_database).records())


def _cmd_audit(args: argparse.Namespace, settings: Settings) -> int:
    from pathlib import Path

    from fleetline.processors.audit.chain import export_entry, masked_event, verify
    from fleetline.processors.audit.runtime import export_window
    from fleetline.storage import audit_export

    since = parse_time_ms(args.since) if getattr(args, "since", None) else None
    until = parse_time_ms(args.until) if getattr(args, "until", None) else None
    if args.action == "verify":
        keys = _verify_keys(settings)
        anchors = None
        if args.file:
            entries, named, anchors = audit_export.read(Path(args.file))
            if not keys:
                print("warning: no FLEETLINE_AUDIT_VERIFY_KEYS; trusting the keys the export "
                      "names", file=sys.stderr)
                keys = named
        elif args.source == "archive":
            from fleetline.storage.audit_store import AuditArchive

            entries = list(AuditArchive(_sealed_store(settings),
                                        f"audit/{args.topic_prefix}").entries())
        else:
            entries = [export_entry(r, reveal_sensitive=True)
                       for r in _audit_records(args, settings)]
        report = verify(entries, keys, anchors)
        print(json.dumps({"ok": report.ok, "checked": report.checked,
                          "digests": report.digests, "first_broken": report.first_broken,
                          "unsigned_tail": report.unsigned_tail}, indent=2))
        return 0 if report.ok else 2
    if args.action == "search":
        from fleetline.storage.audit_store import AuditQuery, AuditTable
        from fleetline.storage.clickhouse import connect

        table = AuditTable(connect(settings.clickhouse_url), settings.clickhouse_database)
        for record in table.search(AuditQuery(args.tenant, since, until, args.op, args.actor,
                                              args.limit)):
            print(json.dumps({"partition": record["partition"], "seq": record["seq"],
                              **masked_event(record["event"], args.reveal)}, sort_keys=True))
        return 0
    if not args.out:
        raise ConfigError("audit export needs --out FILE")
    records = _audit_records(args, settings)
    entries, anchors = export_window(records, args.tenant, since, until, args.reveal)
    out = Path(args.out)
    count = audit_export.write(out, args.format, entries, _verify_keys(settings), anchors)
    if args.to_s3:
        _sealed_store(settings).put(args.to_s3, out.read_bytes())
    print(f"{count} links written to {out}" + (f" and s3 {args.to_s3}" if args.to_s3 else ""))
    return 0


def _cmd_query(args: argparse.Namespace, settings: Settings) -> int:
    from fleetline.storage.queries import READY, ready_sql
    from fleetline.storage.query_service import run_query
    from fleetline.storage.tiers import expander

    if args.name == "list":
        for name, (doc, _) in sorted(READY.items()):
            print(f"{name:<30} {doc}")
        return 0
    if args.name not in READY:
        raise ConfigError(f"no ready query {args.name!r}; `fleetline query list` names them")
    sql = ready_sql(args.name, args.since, args.until)
    result = run_query(settings.clickhouse_url, sql, expand=expander(settings))
    print("\t".join(result.columns))
    for row in result.rows:
        print("\t".join(str(v) for v in row))
    return 0


def _cmd_tier(args: argparse.Namespace, settings: Settings) -> int:
    from fleetline.storage.clickhouse import connect, migrate
    from fleetline.storage.objects import ObjectStore
    from fleetline.storage.tiers import TieredStore, wall_clock_ms

    client = connect(settings.clickhouse_url)
    migrate(client, settings.clickhouse_database)
    objects = ObjectStore.from_settings(settings.s3)
    objects.ensure_bucket()
    data = _tier_policy(args)
    store = TieredStore(client, settings.clickhouse_database, objects, settings.s3, data)
    if args.action == "restore":
        if not (args.since and args.until):
            raise ConfigError("archive restore needs --from and --to")
        rows = store.restore(parse_time_ms(args.since), parse_time_ms(args.until))
        print(f"{rows} rows restored into {store.restored} (queryable in {store.union_view})")
        return 0
    while True:
        now = parse_time_ms(args.now) if args.now else wall_clock_ms()
        stats = store.run_once(now)
        print(json.dumps({"to_warm": stats.to_warm, "to_cold": stats.to_cold,
                          "completed_after_crash": stats.completed_after_crash,
                          "expired": stats.expired, "purged": stats.purged,
                          "rows_moved": stats.rows_moved,
                          "refused": stats.refused}))
        if not args.every:
            return 0
        time.sleep(args.every)


def _tier_policy(args: argparse.Namespace) -> DataClass:
    from fleetline.storage.tiers import DAY_MS, HOUR_MS, DataClass

    return DataClass("gpu_samples", hot_ms=int(args.hot_hours * HOUR_MS),
                     warm_ms=int(args.warm_days * DAY_MS),
                     cold_ms=None if args.cold_days is None else int(args.cold_days * DAY_MS),
                     tenant_cold_ms=_tenant_retention(args.tenant_cold_days, DAY_MS))


def _add_tier_policy(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hot-hours", type=float, default=24)
    parser.add_argument("--warm-days", type=float, default=7)
    parser.add_argument("--cold-days", type=float, help="delete cold archives older than "
                        "this (default: keep)")
    parser.add_argument("--tenant-cold-days", action="append", default=[],
                        metavar="TENANT=DAYS",
                        help="keep the GPU samples of a tenant's allocations in cold for "
                        "another time than --cold-days (DAYS or `forever`; repeatable): "
                        "archives are rewritten without the rows whose time is up")


def _tenant_retention(values: list[str], day_ms: int) -> tuple[tuple[str, int | None], ...]:
    """`TENANT=DAYS` (or `TENANT=forever`) flags as a DataClass's tenant_cold_ms."""
    out: dict[str, int | None] = {}
    for value in values:
        tenant, sep, days = value.partition("=")
        try:
            keep_ms = None if days == "forever" else int(float(days) * day_ms)
        except (ValueError, OverflowError):  # not a number, or inf
            keep_ms = -1
        if not (sep and tenant) or (keep_ms is not None and keep_ms < 0):
            raise ConfigError(f"--tenant-cold-days {value!r}: expected TENANT=DAYS or "
                              "TENANT=forever")
        out[tenant] = keep_ms
    return tuple(sorted(out.items()))


def _cmd_validate(args: argparse.Namespace, settings: Settings) -> int:
    from pathlib import Path

    from fleetline.processors.scheduling.specs import SpecError, parse_specs

    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    try:
        specs = parse_specs(text)
    except SpecError as exc:
        for error in exc.errors:
            print(f"{args.file}: {error}", file=sys.stderr)
        return 1
    for spec in specs:
        print(f"{spec.kind} {spec.metadata.tenant}/{spec.metadata.name}: valid")
    return 0


def _cmd_auth(args: argparse.Namespace, settings: Settings) -> int:
    import secrets

    from fleetline.api.auth import token_digest

    token = "fl_" + secrets.token_urlsafe(32)
    entry = {"name": args.name, "sha256": token_digest(token), "role": args.role,
             "tenant": args.tenant}
    print(f"token (shown once; give it to {args.name}): {token}")
    print("add to the tokens list in FLEETLINE_AUTH_CONFIG:")
    print("  - " + json.dumps(entry))
    return 0


def _cmd_sql(args: argparse.Namespace, settings: Settings) -> int:
    from fleetline.storage.query_service import run_query
    from fleetline.storage.tiers import expander

    result = run_query(settings.clickhouse_url, args.query, expand=expander(settings))
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
    from fleetline.processors.audit.runtime import KafkaAuditEmitter, new_event

    emitter = KafkaAuditEmitter(settings.kafka, topics)
    emitter.emit(new_event(ts=record["ts"], actor=args.issued_by, actor_role="operator",
                           operation=f"command.{args.kind}", target=args.node_id,
                           outcome="SUCCEEDED", request_id=record["command_id"], source="cli",
                           details={k: str(v) for k, v in config.items()}))
    if emitter.flush(30):
        raise FleetlineError("the command was sent but its audit event was not delivered")
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

    def view_source(p: argparse.ArgumentParser) -> None:
        p.add_argument("--topic-prefix", default="fleetline")
        p.add_argument("--group", default="resource-view",
                       help="the view processors' group; its snapshots are used")
        p.add_argument("--at", help="the view as it was at this time (ISO 8601 or epoch ms)")
        p.add_argument("--offsets", help='exact log position: {"topic": {"partition": offset}}')
        p.add_argument("--no-snapshots", action="store_true",
                       help="fold from the start of the log, ignoring snapshots")
        p.add_argument("--json", action="store_true")

    serve = sub.add_parser(
        "serve", help="run the resource-view processor, the scheduler and the HTTP API",
        description="Folds the fleet's topics into the resource view, snapshots it to object "
                    "storage, runs the scheduler over it, sinks telemetry, node states and "
                    "the audit log to ClickHouse, and serves it all over HTTP (OpenAPI at "
                    "/openapi.json). Start several with the same --group and different "
                    "--instance-id to share the view (and --no-scheduler on all but one).")
    serve.add_argument("--topic-prefix", default="fleetline")
    serve.add_argument("--group", default="resource-view")
    serve.add_argument("--instance-id", default="0")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--snapshot-interval", type=float, default=30.0, metavar="SECONDS")
    serve.add_argument("--no-api", action="store_true", help="no HTTP API")
    serve.add_argument("--no-audit", action="store_true",
                       help="no audit chainer or audit sinks in this process")
    serve.add_argument("--tier-every", type=float, default=300.0, metavar="SECONDS",
                       help="run the tiering pass this often (0: never); the embedded store "
                            "can only be tiered by the process that owns it")
    _add_tier_policy(serve)
    serve.add_argument("--no-scheduler", action="store_true",
                       help="no scheduler in this process (run it in the one instance that "
                            "holds every shard of the view)")
    serve.add_argument("--scheduler-policy", metavar="FILE",
                       help="the scheduling pipeline (filters, weights, cluster preference; "
                            "YAML or JSON); appended to the request log when it differs")
    serve.add_argument("--tick-interval", type=float, default=1.0, metavar="SECONDS",
                       help="how often the scheduler observes the view and reconciles")
    serve.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    serve.add_argument("--tls-key", help="... and this private key (PEM)")
    serve.set_defaults(func=_cmd_serve)

    audit = sub.add_parser(
        "audit", help="verify, search and export the tamper-evident audit log",
        description="verify checks hash links, seq continuity and signed digests and names the "
                    "first broken link (exit 2); search and export read ClickHouse (or Kafka).")
    audit.add_argument("action", choices=["verify", "search", "export"])
    audit.add_argument("--topic-prefix", default="fleetline")
    audit.add_argument("--source", choices=["kafka", "clickhouse", "archive"], default="kafka",
                       help="where the chain is read from (archive: verify only)")
    audit.add_argument("--file", help="verify: an export file instead of a source")
    audit.add_argument("--tenant")
    audit.add_argument("--from", dest="since", help="ISO 8601 or epoch ms")
    audit.add_argument("--to", dest="until")
    audit.add_argument("--op", help="search: operation, e.g. 'api.GET /v1/nodes'")
    audit.add_argument("--actor")
    audit.add_argument("--limit", type=int, default=100)
    audit.add_argument("--format", choices=["jsonl", "csv", "parquet"], default="jsonl")
    audit.add_argument("--out", help="export: the file to write")
    audit.add_argument("--to-s3", metavar="KEY", help="export: also upload (encrypted when "
                       "FLEETLINE_OBJECT_ENCRYPTION_KEY is set)")
    audit.add_argument("--reveal", action="store_true",
                       help="include sensitive fields unmasked (platform admins)")
    audit.set_defaults(func=_cmd_audit)

    query = sub.add_parser("query", help="run a ready query over all storage tiers")
    query.add_argument("name", help="a ready query, or `list`")
    query.add_argument("--from", dest="since", default="-1h",
                       help="-<n>h / -<n>d, epoch ms or ISO 8601 (default -1h)")
    query.add_argument("--to", dest="until", help="default: now")
    query.set_defaults(func=_cmd_query)

    for name, text in (("tier", "move closed data hot -> warm -> cold, by policy"),
                       ("archive", "rehydrate a cold range into ClickHouse")):
        tier = sub.add_parser(name, help=text)
        tier.add_argument("action", choices=["run"] if name == "tier" else ["restore"])
        tier.add_argument("--now", help="tier: the moment the policy is applied at (default: "
                          "the clock)")
        tier.add_argument("--every", type=float, metavar="SECONDS", help="tier: run repeatedly")
        tier.add_argument("--from", dest="since")
        tier.add_argument("--to", dest="until")
        _add_tier_policy(tier)
        tier.set_defaults(func=_cmd_tier)

    validate = sub.add_parser("validate", help="check TrainingJob / InferenceService / Dataset "
                              "specs (YAML or JSON) and name every bad field")
    validate.add_argument("-f", "--file", required=True, help="a spec file, or - for stdin")
    validate.set_defaults(func=_cmd_validate)

    auth = sub.add_parser("auth", help="mint an API token")
    auth.add_argument("action", choices=["token"])
    auth.add_argument("--name", required=True)
    auth.add_argument("--role", required=True,
                      choices=["platform-admin", "tenant-admin", "user", "viewer", "auditor"])
    auth.add_argument("--tenant")
    auth.set_defaults(func=_cmd_auth)

    replay = sub.add_parser(
        "replay", help="rebuild the view as it was, or list what changed between two times",
        description="With --at or --offsets (default: now), rebuilds the view from the newest "
                    "snapshot at or before that point plus the log after it. With --from and "
                    "--to, lists the GPU health and node transitions in between.")
    view_source(replay)
    replay.add_argument("--from", dest="since", help="start of a range to walk")
    replay.add_argument("--to", dest="until", help="end of the range")
    replay.add_argument("--out", help="write the whole view as JSON to this file")
    replay.add_argument("--decisions", action="store_true",
                        help="refold the scheduler's request log, observing the view at every "
                             "TICK's offsets, and check each decision against the log byte for "
                             "byte (exit 2 at the first difference)")
    replay.set_defaults(func=_cmd_replay)

    view = sub.add_parser("view", help="show the resource view (rebuilt from snapshot + log)")
    view.add_argument("what", choices=["clusters", "nodes", "node", "gpus", "topology"])
    view.add_argument("id", nargs="?", help="node: the node id; topology: the cluster id")
    view_source(view)
    view.add_argument("--cluster")
    view.add_argument("--region")
    view.add_argument("--status", choices=["UP", "DRAINING", "DOWN", "UNREACHABLE"])
    view.add_argument("--health", choices=["healthy", "degraded", "failed"])
    view.add_argument("--capacity",
                      choices=["idle", "allocated", "degraded", "failed", "unavailable"])
    view.add_argument("--label", action="append", metavar="KEY=VALUE")
    view.set_defaults(func=_cmd_view)

    from fleetline.cli_scheduler import register as register_scheduler

    register_scheduler(sub)

    sql = sub.add_parser(
        "sql", help="run a read-only ClickHouse SQL query on the configured store",
        description="Runs one read-only query. With the embedded chdb store, a running "
                    "`fleetline run` owns it and answers the query; otherwise it is opened here. "
                    "$samples stands for GPU samples across hot, warm and restored tiers; "
                    "$samples(-1h) or $samples(FROM, TO) reads only the tiers that range needs.")
    sql.add_argument("query")
    sql.set_defaults(func=_cmd_sql)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from fleetline.api.auth import CredentialFilter

    for handler in logging.getLogger().handlers:
        handler.addFilter(CredentialFilter())
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
