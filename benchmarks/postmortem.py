"""Postmortem benchmark: an incident report of a 1-hour window of an 80,000-GPU fleet's
telemetry and decisions; what-if replay of the scheduler benchmark's 10,000-job log; and "what
would make it fit" for the queued jobs on that fleet.

    .venv/bin/python benchmarks/postmortem.py [--gpus 80000] [--interval-s 10] [--nodes 10000]
        [--jobs 10000] [--fit-jobs 1000] [--no-postmortem]

The window's telemetry (one sample per GPU every `--interval-s`, 28.8 million rows at the
defaults, a few GPUs with XIDs), its decisions, workload events, node states and tickets are
generated inside ClickHouse, as benchmarks/tiers.py does, since producing them through Python
would take most of the time measured; the report is then built as `fleetline postmortem` builds
it (every query through the tier macros, the log's topics read, the JSON, Markdown and HTML
rendered). The what-if folds the scheduler benchmark's log (benchmarks/scheduler.py: 10,000
nodes, 10,000 jobs, each started job reported running) twice in lockstep, with nothing changed
and with another cluster preferred. The fit is asked for the first `--fit-jobs` queued jobs.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
import uuid
from dataclasses import replace

from _common import local_services, report
from scheduler import (
    BASE_MS,
    build_view,
    percentile,
    running_report,
    submit_requests,
    tenant_policies,
    workload,
)

from fleetline.config import Settings
from fleetline.identity.writers import CONTROL_PLANE_WRITER, Writer, WriterKind
from fleetline.processors.postmortem.fit import fit_of, what_would_fit
from fleetline.processors.postmortem.gather import incident_report
from fleetline.processors.postmortem.render import markdown, page
from fleetline.processors.postmortem.report import Scope, canonical
from fleetline.processors.postmortem.whatif import Change, WhatIf, logged_runs
from fleetline.processors.scheduling.capacity import observe
from fleetline.processors.scheduling.codec import canonical_json, new_request
from fleetline.processors.scheduling.effects import WorkloadOrder
from fleetline.processors.scheduling.scheduler import Scheduler
from fleetline.processors.view.runtime import tune_gc_for_large_state
from fleetline.storage.clickhouse import connect, migrate
from fleetline.storage.objects import ObjectStore
from fleetline.storage.query_service import QueryResult
from fleetline.storage.tiering.macros import tiered_sql
from fleetline.storage.tiering.store import TieredStore
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.topics import Topics

HOUR_S = 3600


def postmortem(settings: Settings, gpus: int, interval_s: int) -> dict[str, object]:
    client = connect(settings.clickhouse_url)
    db = f"bench_pm_{uuid.uuid4().hex[:8]}"
    client.command(f"CREATE DATABASE {db}")
    migrate(client, db)
    end = (BASE_MS // 1000 // HOUR_S + 1) * HOUR_S  # a whole hour, in seconds
    start = end - HOUR_S
    samples = gpus * HOUR_S // interval_s
    nodes = gpus // 8
    began = time.perf_counter()
    # One row per GPU per interval; every 10,000th GPU has an XID from half-way on.
    client.command(
        f"INSERT INTO {db}.gpu_samples (ts, cluster_id, region, node_id, gpu_index, gpu_uuid, "
        "vendor, model, gpu_util_pct, fb_used_mib, fb_total_mib, temperature_c, power_w, "
        "ecc_sbe_total, ecc_dbe_total, xid_codes, seq, source_partition, source_offset) "
        f"SELECT fromUnixTimestamp64Milli(toInt64(({start} + intDiv(number, {gpus}) * "
        f"{interval_s}) * 1000), 'UTC'), concat('c', toString(intDiv(number % {gpus}, 8) % 8)), "
        "'r', concat('n', toString(intDiv(number % "
        f"{gpus}, 8))), number % 8, concat('GPU-', toString(number % {gpus})), 'nvidia', 'H100', "
        "(cityHash64(number) % 10000) / 100, 40000, 81559, 60, 400 + cityHash64(number) % 300, "
        f"0, 0, if(number % {gpus} % 10000 = 7 AND intDiv(number, {gpus}) * {interval_s} >= 1800,"
        f" [79], []), intDiv(number, {gpus}), 0, number FROM numbers({samples}) "
        "SETTINGS max_insert_threads = 2"
    )
    # 10,000 decisions over the hour (a tenth moves off a fault), their jobs' workload events
    # (running, progress every minute, restored after a move), node states and tickets.
    client.command(
        f"INSERT INTO {db}.scheduling_decisions (ts_ms, decision_id, job, tenant, kind, "
        "outcome, reason, priority, source_offset, source_topic) "
        f"SELECT ({start} + number * {HOUR_S} / 10000) * 1000, toString(number), "
        "concat('t/j', toString(number % 2000)), 't', 'TrainingJob', "
        "if(number % 10 = 9, 'PREEMPTED', 'PLACED'), "
        "if(number % 10 = 9, concat('fault: n', toString(number % "
        f"{nodes}), ' GPU(s) [0] failed (xid 79)'), 'fits'), 2, number, 'decisions' "
        "FROM numbers(10000)"
    )
    client.command(
        f"INSERT INTO {db}.workload_events (ts_ms, job, tenant, cluster_id, epoch, attempt, "
        "event, step, source_partition, source_offset, source_topic, trace_id) "
        f"SELECT ({start} + intDiv(number, 2000) * 60) * 1000, "
        "concat('t/j', toString(number % 2000)), 't', "
        "concat('c', toString(number % 8 + if(intDiv(number, 2000) >= 30, 1, 0))), "
        "if(intDiv(number, 2000) >= 30, 2, 1), 0, "
        "multiIf(intDiv(number, 2000) = 0 OR intDiv(number, 2000) = 30, 'RUNNING', "
        "intDiv(number, 2000) = 31, 'RESTORED', 'PROGRESS'), intDiv(number, 2000) * 10, 0, "
        "number, 'workloads', '' FROM numbers(120000)"
    )
    client.command(
        f"INSERT INTO {db}.node_states (ts_ms, cluster_id, region, node_id, seq, state, "
        "gpu_count, agent_version, source_partition, source_offset) "
        f"SELECT ({start} + 600 + number) * 1000, 'c1', 'r', concat('n', toString(number * 97)), "
        "2, 'DOWN', 8, 'bench', 0, number FROM numbers(50)"
    )
    client.command(
        f"INSERT INTO {db}.repair_tickets (ts_ms, ticket_id, node_id, cluster_id, rule, "
        "severity, state, seq, opened_ms, summary, reason, evidence, source_partition, "
        "source_offset, source_topic) "
        f"SELECT ({start} + 1805 + number) * 1000, concat('T', toString(number)), "
        "concat('n', toString(intDiv(number * 10000 + 7, 8))), 'c0', 'gpu_failed', 'high', "
        f"'OPEN', 1, ({start} + 1805 + number) * 1000, 'xid 79', 'xid 79', '', 0, number, "
        f"'tickets' FROM numbers({gpus // 10000})"
    )
    load_s = time.perf_counter() - began
    topics = Topics(prefix=f"bench.pm.{uuid.uuid4().hex[:8]}")
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    objects = ObjectStore.from_settings(settings.s3)
    store = TieredStore(client, db, objects, settings.s3, root=f"bench-{db}")
    store.ensure_tables()

    def sql(query: str) -> QueryResult:
        result = client.query(tiered_sql(store, query, now_ms=end * 1000))
        return QueryResult(list(result.column_names), [list(r) for r in result.result_rows])

    timings = []
    sizes: dict[str, int] = {}
    report_json = ""
    for _ in range(2):
        began = time.perf_counter()
        built = incident_report(settings.kafka, topics, sql, start * 1000, end * 1000, Scope(), {})
        report_json = canonical(built)
        sizes = {
            "json_bytes": len(report_json),
            "markdown_bytes": len(markdown(built)),
            "html_bytes": len(page(built)),
        }
        timings.append(time.perf_counter() - began)
    client.command(f"DROP DATABASE {db}")
    faults = report_json.count('"kind": "xid"')
    return {
        "postmortem_gpus": gpus,
        "postmortem_window_samples": samples,
        "postmortem_load_s": round(load_s, 1),
        "postmortem_s": round(min(timings), 2),
        "postmortem_s_target": "<= 60 (1 hour of 80,000 GPUs)",
        "postmortem_faults_found": faults,
        **{f"postmortem_{k}": v for k, v in sizes.items()},
    }


def scheduler_log(nodes: int, jobs: int) -> tuple[list[tuple[dict, Writer, object]], Scheduler]:
    """The scheduler benchmark's run as a log: (request, writer, facts for a TICK), and the
    scheduler that folded it."""
    view = build_view(nodes)
    facts = observe(view)
    scheduler = Scheduler()
    start = BASE_MS + 10_000
    log: list[tuple[dict, Writer, object]] = []

    def step(request: dict, writer: Writer, seen: object = None) -> list[object]:
        log.append((request, writer, seen))
        return list(scheduler.step(request, len(log) - 1, seen, writer))  # type: ignore[arg-type]

    step(
        new_request("TICK", "", "", start, "tick-0", view_offsets=facts.offsets),
        CONTROL_PLANE_WRITER,
        facts,
    )
    for policy in tenant_policies():
        step(
            new_request(
                "TENANT_POLICY",
                policy["tenant"],
                policy["tenant"],
                start,
                f"p-{policy['tenant']}",
                spec_json=canonical_json(policy),
            ),
            CONTROL_PLANE_WRITER,
        )
    for request in submit_requests(workload(jobs), start + 1000):
        for effect in step(request, CONTROL_PLANE_WRITER):
            if isinstance(effect, WorkloadOrder) and effect.action == "RUN":
                report = running_report(effect, request["ts"])
                step(report, Writer(WriterKind.CLUSTER, effect.cluster_id))
    step(
        new_request("TICK", "", "", start + 60_000, "tick-1", view_offsets=facts.offsets),
        CONTROL_PLANE_WRITER,
        facts,
    )
    return log, scheduler


def what_if(log: list[tuple[dict, Writer, object]], change: Change) -> dict[str, object]:
    requests = [r for r, _, _ in log]
    began = time.perf_counter()
    whatif = WhatIf(change, logged_runs(requests))
    for position, (request, writer, facts) in enumerate(log):
        whatif.step(request, position, writer, facts)  # type: ignore[arg-type]
    result = whatif.report()
    seconds = time.perf_counter() - began
    decisions = result["decisions"]["baseline"]
    return {"seconds": seconds, "decisions": decisions, "differences": result["differences"]}


def fits(scheduler: Scheduler, count: int) -> dict[str, object]:
    """Each of the first `count` queued jobs asked alone (no answer shared between jobs of one
    shape: the worst case), then the whole queue as `explain --queued` asks it."""
    queued = scheduler.queue()
    latencies = []
    changes = 0
    bindings: dict[str, int] = {}
    for job in queued[:count]:
        began = time.perf_counter()
        fit = fit_of(scheduler, job)
        latencies.append(time.perf_counter() - began)
        changes += fit.checked
        bindings[fit.binding] = bindings.get(fit.binding, 0) + 1
    began = time.perf_counter()
    whole = what_would_fit(scheduler)
    whole_s = time.perf_counter() - began
    return {
        "fit_queued_jobs": len(queued),
        "fit_asked_alone": len(latencies),
        "fit_alone_p50_ms": round(statistics.median(latencies) * 1000, 2) if latencies else None,
        "fit_alone_p99_ms": round(percentile(latencies, 0.99) * 1000, 2) if latencies else None,
        "fit_p99_ms_target": "<= 100 per queued job (80,000 GPUs)",
        "fit_alone_with_a_checked_change": changes,
        **{f"fit_binding_{k}": v for k, v in sorted(bindings.items())},
        "fit_whole_queue_s": round(whole_s, 2),
        "fit_whole_queue_ms_per_job": round(whole_s * 1000 / max(len(whole), 1), 2),
        "fit_whole_queue_with_a_checked_change": sum(f.checked for f in whole),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=80_000)
    parser.add_argument("--interval-s", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--fit-jobs", type=int, default=1_000)
    parser.add_argument("--no-postmortem", action="store_true", help="skip the ClickHouse part")
    args = parser.parse_args()
    figures: dict[str, object] = {}
    if not args.no_postmortem:
        base = Settings.from_env()
        with tempfile.TemporaryDirectory(prefix="bench-pm-") as folder:
            settings = replace(base, clickhouse_url=f"chdb://{folder}")
            with local_services(settings) as running:
                figures.update(postmortem(running, args.gpus, args.interval_s))
    tune_gc_for_large_state()
    log, scheduler = scheduler_log(args.nodes, args.jobs)
    gc.collect()
    gc.freeze()
    same = what_if(log, Change.none())
    other = what_if(
        log,
        Change.parse(
            "policy=prefer-us-west",
            {"cluster_preference": ["us-west-a"], "weights": {"preference": 100}},
        ),
    )
    decided = sum(1 for r, _, _ in log if r["kind"] != "PROGRESS")
    figures.update(
        {
            "what_if_log_requests": len(log),
            "what_if_log_requests_not_reports": decided,
            "what_if_decisions": same["decisions"],
            "what_if_unchanged_differences": same["differences"],
            "what_if_unchanged_decisions_per_s": round(same["decisions"] / same["seconds"], 1),
            "what_if_other_policy_differences": other["differences"],
            "what_if_other_policy_decisions_per_s": round(other["decisions"] / other["seconds"], 1),
            "what_if_decisions_per_s_target": ">= 1000 (the 10,000-job log)",
        }
    )
    figures.update(fits(scheduler, args.fit_jobs))
    report("postmortem", figures)


if __name__ == "__main__":
    main()
