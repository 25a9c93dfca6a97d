"""Ready queries for the common questions, over all tiers (`$samples` macros, see tiers.py).

Each takes a time range; the tiered store reads only the tiers that overlap it ($decisions,
$allocations and the other record tables too: `LIFETIMES`; the allocations' cold archives are
read in place, as the allocation in force may be months old). Utilisation by tenant joins each
sample with the allocation in force on its GPU at that moment (ASOF JOIN on event time, then
log position: the scheduler is the allocation topic's only writer and its clock never goes
back, so within one millisecond the later record is the later change), job wait times go from
a job's first decision (its submission) to its first placement.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from fleetline.errors import ConfigError


def with_allocation(samples: str, allocations: str, ts: str = "ts") -> str:
    """`samples` (as s) ASOF-joined with the allocation record in force on each sample's GPU
    (as a; a.kind is '' where none was): the latest at or before the sample by event time,
    then log position (a sample sorts after every record of its millisecond)."""
    return (
        f"(SELECT *, toUInt128(toUnixTimestamp64Milli({ts})) * 1099511627776 + "
        f"1099511627775 AS _at FROM {samples}) AS s ASOF LEFT JOIN (SELECT node_id, "
        "gpu_index, toUInt128(ts_ms) * 1099511627776 + source_offset AS _at, tenant, kind "
        f"FROM {allocations}) AS a ON s.node_id = a.node_id AND s.gpu_index = a.gpu_index "
        "AND s._at >= a._at"
    )


_BUCKETS = (("hour", "toStartOfHour"), ("minute", "toStartOfMinute"))
READY: dict[str, tuple[str, str]] = {
    "utilisation-by-cluster-hour": (
        "GPU utilisation per cluster per hour",
        "SELECT cluster_id, toStartOfHour(ts) AS hour, round(avg(gpu_util_pct), 2) AS "
        "avg_util_pct, uniqExact(gpu_uuid) AS gpus, count() AS samples FROM $samples "
        "GROUP BY cluster_id, hour ORDER BY cluster_id, hour",
    ),
    "utilisation-by-cluster": (
        "GPU utilisation per cluster over the range",
        "SELECT cluster_id, round(avg(gpu_util_pct), 2) AS avg_util_pct, count() AS samples "
        "FROM $samples GROUP BY cluster_id ORDER BY cluster_id",
    ),
    "degraded-gpu-history": (
        "GPUs per hour with RDMA loss >= 0.1%, NVLink errors rising, or XID events",
        "SELECT toStartOfHour(ts) AS hour, cluster_id, node_id, gpu_index, "
        "round(max(rdma_packet_loss_ratio), 6) AS max_rdma_loss, "
        "max(nvlink_errors_total) - min(nvlink_errors_total) AS nvlink_errors, "
        "arrayDistinct(arrayFlatten(groupArray(xid_codes))) AS xids FROM $samples "
        "GROUP BY hour, cluster_id, node_id, gpu_index "
        "HAVING max_rdma_loss >= 0.001 OR nvlink_errors > 0 OR length(xids) > 0 "
        "ORDER BY hour, cluster_id, node_id, gpu_index",
    ),
    "utilisation-by-tenant": (
        "GPU utilisation of the GPUs each tenant held, per tenant (samples on unallocated GPUs "
        "count as idle capacity)",
        "SELECT if(a.kind = 'ALLOCATED', a.tenant, '(unallocated)') AS tenant, "
        "round(avg(s.gpu_util_pct), 2) AS avg_util_pct, uniqExact(s.node_id, s.gpu_index) AS "
        "gpus, count() AS samples, round(count() * 1.0 / 3600, 3) AS gpu_hours_at_1hz "
        f"FROM {with_allocation('$samples', '$allocations')} GROUP BY tenant ORDER BY tenant",
    ),
    "job-wait-times": (
        "Submission to placement per tenant and priority: jobs placed, waiting now, wait "
        "percentiles (s)",
        "SELECT tenant, priority, countIf(placed_ms > 0) AS placed, "
        "countIf(placed_ms = 0) AS still_waiting, "
        "round(quantileIf(0.5)((placed_ms - first_ms) / 1000, placed_ms > 0), 3) AS p50_s, "
        "round(quantileIf(0.95)((placed_ms - first_ms) / 1000, placed_ms > 0), 3) AS p95_s, "
        "round(maxIf((placed_ms - first_ms) / 1000, placed_ms > 0), 3) AS max_s FROM ("
        "SELECT tenant, job, max(priority) AS priority, min(ts_ms) AS first_ms, "
        "minIf(ts_ms, outcome = 'PLACED') AS placed_ms FROM $decisions "
        "WHERE kind != 'Dataset' GROUP BY tenant, job) "
        "GROUP BY tenant, priority ORDER BY tenant, priority DESC",
    ),
    "preemptions": (
        "Jobs preempted per tenant and cause (a higher priority, or a fault), with the work lost",
        "SELECT tenant, if(startsWith(reason, 'fault:'), 'fault', 'priority') AS cause, "
        "count() AS preemptions, round(sum(lost_gpu_s) / 3600, 3) AS lost_gpu_hours "
        "FROM $decisions WHERE outcome = 'PREEMPTED' GROUP BY tenant, cause "
        "ORDER BY tenant, cause",
    ),
    "job-wait-by-hour": (
        "Jobs placed per hour (by their first placement) and their wait from submission: "
        "p50 and p95 (s)",
        "SELECT toStartOfHour(fromUnixTimestamp64Milli(placed_ms, 'UTC')) AS hour, count() AS "
        "placed, round(quantile(0.5)((placed_ms - first_ms) / 1000), 3) AS p50_s, "
        "round(quantile(0.95)((placed_ms - first_ms) / 1000), 3) AS p95_s FROM ("
        "SELECT job, min(ts_ms) AS first_ms, minIf(ts_ms, outcome = 'PLACED') AS placed_ms "
        "FROM $decisions WHERE kind != 'Dataset' GROUP BY job HAVING placed_ms > 0) "
        "GROUP BY hour ORDER BY hour",
    ),
    **{
        f"energy-by-cluster-{unit}": (
            f"Energy drawn per cluster per {unit} (kWh, GPUs only: mean power x GPUs x the "
            f"{unit} covered)",
            "SELECT cluster_id, at, round(sum(kwh), 4) AS kwh FROM (SELECT cluster_id, "
            f"{bucket}(ts) AS at, node_id, gpu_index, avg(power_w) * "
            "(dateDiff('second', min(ts), max(ts)) + 1) / 3.6e6 AS kwh FROM $samples "
            "GROUP BY cluster_id, at, node_id, gpu_index) GROUP BY cluster_id, at "
            "ORDER BY cluster_id, at",
        )
        for unit, bucket in _BUCKETS
    },
    "utilisation-by-cluster-minute": (
        "GPU utilisation per cluster per minute",
        "SELECT cluster_id, toStartOfMinute(ts) AS minute, round(avg(gpu_util_pct), 2) AS "
        "avg_util_pct, uniqExact(gpu_uuid) AS gpus, count() AS samples FROM $samples "
        "GROUP BY cluster_id, minute ORDER BY cluster_id, minute",
    ),
    "top-energy-consumers": (
        "Nodes by energy drawn in the range (kWh, from mean power x time covered)",
        "SELECT cluster_id, node_id, round(avg(power_w) * uniqExact(gpu_index) * "
        "(dateDiff('second', min(ts), max(ts)) + 1) / 3.6e6, 3) AS kwh, "
        "round(avg(power_w), 1) AS avg_gpu_power_w FROM $samples "
        "GROUP BY cluster_id, node_id ORDER BY kwh DESC LIMIT 20",
    ),
    **{
        f"energy-by-{who}": (
            f"Energy and its cost per {who} in the range: GPU kWh (each sample's GPU counted "
            "for the job its allocation names), facility kWh (x the profile's PUE, 1 without), "
            "cost at the cluster's hourly price, and the renewable share of it",
            "WITH prices AS (SELECT cluster_id, hour, argMax(price_per_kwh, ts_ms) AS price, "
            "argMax(renewable_share, ts_ms) AS renewable, argMax(pue, ts_ms) AS pue FROM "
            "$energy_prices GROUP BY cluster_id, hour), per AS (SELECT a.job_id AS job, "
            "a.tenant AS tenant, s.cluster_id AS cluster_id, toHour(s.at) AS hour, "
            "avg(s.power_w) * (dateDiff('second', min(s.ts), max(s.ts)) + 1) / 3.6e6 AS kwh "
            "FROM (SELECT cluster_id, node_id, gpu_index, ts, toStartOfHour(ts) AS at, "
            "toUnixTimestamp64Milli(ts) AS ts_ms, power_w FROM $samples) AS s ASOF INNER JOIN "
            "(SELECT node_id, gpu_index, ts_ms, job_id, tenant, kind FROM $allocations) AS a "
            "ON s.node_id = a.node_id AND s.gpu_index = a.gpu_index AND s.ts_ms >= a.ts_ms "
            "WHERE a.kind = 'ALLOCATED' GROUP BY job, tenant, cluster_id, s.at, hour, "
            "s.node_id, s.gpu_index) "
            f"SELECT {key}, round(sum(kwh), 4) AS gpu_kwh, "
            "round(sum(kwh * if(p.pue > 0, p.pue, 1)), 4) AS facility_kwh, "
            "round(sum(kwh * if(p.pue > 0, p.pue, 1) * p.price), 4) AS energy_cost, "
            "round(sum(kwh * p.renewable) / greatest(sum(kwh), 1e-9), 4) AS renewable_share "
            f"FROM per LEFT JOIN prices AS p ON per.cluster_id = p.cluster_id AND per.hour = "
            f"p.hour GROUP BY {key} ORDER BY energy_cost DESC, gpu_kwh DESC",
        )
        for who, key in (("job", "job, tenant"), ("tenant", "tenant"))
    },
}


def ready_sql(name: str, since: str, until: str | None) -> str:
    """The ready query `name` over [since, until) (times as `fleetline query` takes them)."""
    span = f"({since}, {until or ''})"
    return (
        READY[name][1]
        .replace("$samples", f"$samples{span}")
        .replace("$decisions", f"$decisions{span}")
    )


_TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
TRACE_COLUMNS = ("ts_ms", "hop", "cluster_id", "what", "job", "tenant", "detail")


def demand_sql(cluster_id: str, model: str) -> str:
    """GPU demand of one cluster and GPU model per hour (GPUs busy: the sum over its GPUs of
    their mean utilisation that hour), and the GPUs it had, over every tier."""
    return (
        "SELECT toUnixTimestamp(at) DIV 3600 AS hour, round(sum(busy), 3) AS demand, "
        "count() AS gpus FROM (SELECT toStartOfHour(ts) AS at, gpu_uuid, "
        "avg(gpu_util_pct) / 100 AS busy FROM $samples WHERE cluster_id = "
        f"{literal(cluster_id)} AND positionCaseInsensitive(model, {literal(model)}) > 0 "
        "GROUP BY at, gpu_uuid) GROUP BY at ORDER BY at"
    )


# NVIDIA's XIDs that take a GPU out (the view's HealthPolicy.fail_xids by default).
FATAL_XIDS = (48, 61, 62, 79, 95, 119, 120)


def failure_history_sql(days: int, fatal_xids: Sequence[int] = FATAL_XIDS) -> str:
    """Per cluster and GPU model: fatal XIDs seen and GPU-hours of service in the last `days`
    (GPUs x the time they reported), the inputs of a failure rate."""
    xids = ", ".join(str(int(x)) for x in fatal_xids)
    return (
        "SELECT cluster_id, model, sum(failures) AS failures, round(sum(hours), 3) AS "
        "gpu_hours FROM (SELECT cluster_id, model, gpu_uuid, "
        f"countIf(hasAny(xid_codes, [{xids}])) AS failures, "
        "(dateDiff('second', min(ts), max(ts)) + 1) / 3600 AS hours "
        f"FROM $samples(-{int(days)}d) GROUP BY cluster_id, model, gpu_uuid) "
        "GROUP BY cluster_id, model ORDER BY cluster_id, model"
    )


def checkpoint_costs_sql(days: int) -> str:
    """Per job: the seconds each checkpoint took, as its cluster agent measured them."""
    return (
        "SELECT job, groupArray(seconds) AS checkpoint_seconds FROM $workloads "
        f"WHERE event = 'CHECKPOINTED' AND seconds IS NOT NULL AND ts_ms >= "
        f"toUnixTimestamp64Milli(now64(3)) - {int(days) * 86_400_000} GROUP BY job ORDER BY job"
    )


def memory_by_job_sql(days: int) -> str:
    """Per job: the 95th percentile of the GPU memory its GPUs used and their size, each
    sample counted for the job its GPU's allocation named at the time."""
    return (
        "SELECT a.job_id AS job, quantile(0.95)(s.fb_used_mib) AS fb_used_p95_mib, "
        "max(s.fb_total_mib) AS fb_total_mib FROM (SELECT node_id, gpu_index, fb_used_mib, "
        f"fb_total_mib, toUnixTimestamp64Milli(ts) AS ts_ms FROM $samples(-{int(days)}d)) AS s "
        "ASOF INNER JOIN (SELECT node_id, gpu_index, ts_ms, job_id, kind FROM $allocations) "
        "AS a ON s.node_id = a.node_id AND s.gpu_index = a.gpu_index AND s.ts_ms >= a.ts_ms "
        "WHERE a.kind = 'ALLOCATED' GROUP BY job ORDER BY job"
    )


def trace_sql(trace_id: str) -> str:
    """Every row stored under one trace id, in time order: the request entering (the audit
    log), the scheduler's decisions and GPU bindings, the cluster agents' workload events (not
    each PROGRESS report) and log lines; columns TRACE_COLUMNS."""
    if not _TRACE_ID.match(trace_id):
        raise ConfigError(f"{trace_id!r} is not a trace id (32 lowercase hex digits)")
    t = f"'{trace_id}'"
    return (
        "SELECT ts_ms, hop, cluster_id, what, job, tenant, detail FROM ("
        "SELECT ts_ms, toString(source) AS hop, '' AS cluster_id, toString(operation) AS what, "
        "target AS job, ifNull(tenant, '') AS tenant, concat(actor, ' ', toString(outcome), ' ', "
        f"toString(status)) AS detail FROM $audit WHERE trace_id = {t} "
        "UNION ALL SELECT ts_ms, 'scheduler', arrayStringConcat(clusters, ','), "
        "concat('decision ', toString(outcome)), job, toString(tenant), reason FROM $decisions "
        f"WHERE trace_id = {t} "
        "UNION ALL SELECT min(ts_ms), 'scheduler', toString(cluster_id), "
        "concat('allocation ', toString(kind)), job_id, toString(tenant), "
        f"concat(toString(count()), ' GPUs') FROM $allocations WHERE trace_id = {t} "
        "GROUP BY cluster_id, kind, seq, job_id, tenant "
        "UNION ALL SELECT ts_ms, 'cluster-agent', toString(cluster_id), toString(event), job, "
        "toString(tenant), concat('epoch ', toString(epoch), ' attempt ', toString(attempt), "
        "if(isNull(detail), '', concat(': ', assumeNotNull(detail)))) FROM $workloads "
        f"WHERE trace_id = {t} AND event != 'PROGRESS' "
        "UNION ALL SELECT ts_ms, toString(process), toString(cluster_id), toString(level), '', '', "
        f"message FROM $logs WHERE trace_id = {t}"
        ") ORDER BY ts_ms, hop"
    )


_JOB_KEY = re.compile(r"^[A-Za-z0-9._-]+/[A-Za-z0-9._-]+$")


def progress_sql(job: str) -> str:
    """A job's PROGRESS and CHECKPOINTED workload events in time order (the loss curve and the
    checkpoints of every placement)."""
    if not _JOB_KEY.match(job):
        raise ConfigError(f"{job!r} is not a job key (tenant/name)")
    return (
        "SELECT ts_ms, cluster_id, epoch, attempt, toString(event) AS event, step, loss, "
        "samples_per_s, bytes, seconds, checkpoint_uri FROM $workloads "
        f"WHERE job = '{job}' AND event IN ('PROGRESS', 'CHECKPOINTED', 'RESTORED') "
        "ORDER BY ts_ms"
    )


def literal(text: str) -> str:
    """`text` as a ClickHouse string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def logs_sql(
    since: str,
    until: str | None = None,
    text: str | None = None,
    level: str | None = None,
    process: str | None = None,
    trace_id: str | None = None,
    limit: int = 200,
) -> str:
    """The newest log lines of every process in a range, filtered by words in the message,
    level, process and trace id."""
    where = ["1"]
    if text:
        where.append(f"positionCaseInsensitive(message, {literal(text)}) > 0")
    if level:
        where.append(f"level = {literal(level.upper())}")
    if process:
        where.append(f"startsWith(process, {literal(process)})")
    if trace_id:
        where.append(f"trace_id = {literal(trace_id)}")
    return (
        "SELECT ts_ms, level, process, cluster_id, logger, message, trace_id "
        f"FROM $logs({since}, {until or ''}) WHERE {' AND '.join(where)} "
        f"ORDER BY ts_ms DESC LIMIT {int(limit)}"
    )
