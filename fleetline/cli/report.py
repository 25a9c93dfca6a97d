"""What `fleetline run` prints of a played scenario (`demo/play.py`): the story, stage by stage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from fleetline.cli.common import table
from fleetline.demo.play import SliceResult
from fleetline.demo.verdict import StoryStep, summary_lines
from fleetline.processors.scheduling.estimate import described_in

_CAPACITY = (
    "cluster",
    "region",
    "health",
    "GPUs",
    "idle",
    "alloc",
    "degr",
    "failed",
    "unavail",
    "nodes",
    "down",
    "unreach",
)


def capacity(clusters: Sequence[dict[str, Any]]) -> Table:
    out = table(*_CAPACITY, numeric=_CAPACITY[3:])
    for c in clusters:
        out.add_row(
            c["cluster_id"],
            c["region"],
            c["health"],
            *(
                str(c[k])
                for k in (
                    "gpus",
                    "idle",
                    "allocated",
                    "degraded",
                    "failed",
                    "unavailable",
                    "nodes",
                    "nodes_down",
                    "nodes_unreachable",
                )
            ),
        )
    return out


def print_result(console: Console, result: SliceResult, clickhouse_url: str, prefix: str) -> None:
    say = console.print
    say(
        f"\nagents sent {result.telemetry_sent} NodeTelemetry and {result.states_sent} "
        f"NodeState records, plus {result.malformed_sent} malformed message(s)"
    )
    say(
        f"dead-lettered: {result.processor_dead_letters} by the resource view, "
        f"{result.sink_dead_letters} by the sink (topic {prefix}.deadletter)"
    )
    say("\nresource view (Kafka -> fold of telemetry, node state and cluster facts):")
    say(capacity(result.clusters))
    say(f"\nunhealthy GPUs ({len(result.unhealthy_gpus)}):")
    gpus = table("GPU", "health", "cause", "since")
    for gpu in result.unhealthy_gpus[:20]:
        gpus.add_row(
            f"{gpu['node_id']}/{gpu['gpu_index']}",
            gpu["health"],
            gpu["cause"] or "",
            str(gpu["health_since_ms"]),
        )
    say(gpus)
    replay = result.half_way_replay
    say(
        f"\nreplay: the view as it stood half-way (at {replay['at_ms']} ms, version "
        f"{replay['view_version']}), rebuilt from snapshots {replay['from_snapshots'] or 'none'}"
        f" + {replay['folded']} events of log:"
    )
    say(capacity(result.half_way_clusters))
    say(
        f"\nClickHouse hot table ({clickhouse_url}): {result.sink_rows} GPU sample rows "
        "inserted; per cluster since the run started:"
    )
    samples = table(
        "cluster",
        "samples",
        "nodes",
        "avg util %",
        "max power W",
        numeric=("samples", "nodes", "avg util %", "max power W"),
    )
    for row in result.query_rows:
        samples.add_row(*(str(v) for v in row))
    say(samples)
    say("\nview snapshots in object storage (the newest per part):")
    for key in result.snapshots:
        say(f"  {key}")
    say(
        "\nHTTP API over TLS (a certificate from the deployment CA in .cache/ca), called as "
        "viewer@acme (and once with a made-up token):"
    )
    for path, status in result.api_calls:
        say(f"  GET {path:<34} -> {status}")
    audit = result.audit
    say(
        f"\naudit log: {audit['links']} links ({audit['digests']} signed digests, key "
        f"{audit['key_id']}) in ClickHouse, chain "
        f"{'verified' if audit['ok'] else 'BROKEN: ' + str(audit['first_broken'])}"
    )
    print_scheduling(console, result.scheduling)
    print_cluster_story(console, result.cluster_story)
    print_split_story(console, result.split_story)
    print_prewarm_story(console, result.prewarm_story)
    print_serving_day(console, result.serving_day)
    print_postmortem(console, result.postmortem)
    say("timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in result.timings.items()))


def _stopped(console: Console, part: dict[str, Any]) -> bool:
    """A story part that stopped on an error says so in place of its summary."""
    if "failed" in part:
        console.print(f"\n{part['failed']}")
        return True
    return False


def print_steps(console: Console, steps: Sequence[StoryStep]) -> None:
    """The run's last lines: each story step that did not happen, then how many did."""
    console.print()
    for line in summary_lines(steps):
        # One line each, whole (a cause is not wrapped, nor read as markup: "[Errno 2]").
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def print_scheduling(console: Console, scheduling: dict[str, Any]) -> None:
    say = console.print
    say(
        f"\nscheduler decisions ({len(scheduling['decisions'])}, every one an event on the "
        "decision log with its reasons and the view offsets it read):"
    )
    decisions = table("id", "job", "outcome", "where", "reason", numeric=("id",))
    for decision_id, job, outcome, where, reason in scheduling["decisions"]:
        decisions.add_row(decision_id, job, outcome, where, reason[:70])
    say(decisions)
    # The jobs that said their size: which chip the estimate chose, and why (the reason's
    # estimate, as `fleetline explain` shows it whole).
    estimated = [
        (job, where, found)
        for _, job, outcome, where, reason in scheduling["decisions"]
        if outcome == "PLACED" and (found := described_in(reason))
    ]
    if estimated:
        say("\nchips chosen by each sized job's estimate (the cheapest run meeting its deadline):")
        chosen = table("job", "where", "estimate")
        for job, where, text in estimated:
            chosen.add_row(job, where, text)
        say(chosen)
    say("\njobs as the scheduler holds them:")
    jobs = table("job", "phase", "GPUs", "where", numeric=("GPUs",))
    for key, phase, where, gpus in scheduling["jobs"]:
        jobs.add_row(key, phase, str(gpus), where)
    say(jobs)
    waiting = scheduling["waiting"]
    if waiting:
        say(f"\nwhy {waiting['job']} waits (fleetline explain): {waiting['reason'][:160]}")
        alternatives = table("cluster", "score or why not")
        for alt in waiting["alternatives"]:
            alternatives.add_row(alt["cluster_id"], str(alt["rejected"] or alt["total"]))
        say(alternatives)
    for name, (columns, rows) in scheduling.get("ready_queries", {}).items():
        say(f"\nfleetline query {name} (ClickHouse, from the sunk decisions and allocations):")
        query = table(*columns, numeric=columns[1:])
        for row in rows:
            query.add_row(*(str(v) for v in row))
        say(query)
    operations = scheduling.get("operations") or {}
    if operations.get("tickets"):
        say(
            "\nautomated operations: repair tickets (`fleetline tickets show ID`; the node is "
            "cordoned and drained until a burn-in returns it):"
        )
        tickets = table("ticket", "node", "rule", "state", "why")
        for ticket_id, node, rule, state, summary in operations["tickets"]:
            tickets.add_row(ticket_id, node, rule, state, summary[:60])
        say(tickets)
    if operations.get("capped_nodes"):
        say(f"power capped at low load: {', '.join(operations['capped_nodes'])}")
    replay = scheduling["replay"]
    say(
        f"\ndecision replay: {replay['requests']} requests ({replay['ticks']} ticks) refolded "
        f"in {replay['seconds']}s; {replay['matched']} of {replay['decisions']} decisions "
        "identical byte for byte"
        + ("" if replay["ok"] else f" - DIFFERENT: {replay['first_difference']}")
    )


def print_cluster_story(console: Console, story: dict[str, Any]) -> None:
    if not story or _stopped(console, story):
        return
    say = console.print
    say(
        f"\ncluster control: {story['lost']} went dark under {story['job']}; declared lost "
        f"{story['detected_s']}s after its last heartbeat; the job ran again in "
        f"{story['ran_in'][1]} {story['resumed_after_s']}s after that heartbeat"
        + (f", then in {', '.join(story['ran_in'][2:])}" if len(story["ran_in"]) > 2 else "")
        + f", from step {story['resumed_at']} (checkpoint copied: {story['copy_bytes']} bytes "
        f"in {story['copy_s']}s); {', '.join(story['ran_in'][:-1])}'s copies fenced when they "
        "returned; "
        f"{story['reported_steps']} loss reports up to step {story['last_step']}; final "
        "parameters "
        + ("bit-identical to an uninterrupted run" if story["identical"] else "DIFFERENT")
    )
    trace = story.get("trace")
    if trace:
        say(
            f"its trace {trace['trace_id']}: {trace['hops']} hops over {trace['span_s']:.1f}s "
            f"across {', '.join(trace['clusters'])} (`fleetline trace {trace['trace_id']}`)"
        )


def print_split_story(console: Console, story: dict[str, Any]) -> None:
    if not story or _stopped(console, story):
        return
    console.print(
        f"\ndata plane: {story['job']} split across {', '.join(story['clusters'])} "
        f"({story['world']}); {story['data_plane'] or 'no exchange reported'}; final "
        "parameters "
        + ("bit-identical to one process's" if story["identical"] else "DIFFERENT")
        + f" (`fleetline explain {story['job']}`)"
    )


def print_prewarm_story(console: Console, story: dict[str, Any]) -> None:
    if not story or _stopped(console, story):
        return
    rate = (
        f" in {story['copy_s']} s, {story['rate_gbps']} Gbit/s against the tenant's "
        f"{story['quota_gbps']} Gbit/s quota"
        if story["copy_s"] is not None
        else ""
    )
    console.print(
        f"\nprewarm: {story['dataset']} ({story['objects']} objects, {story['bytes']} bytes) "
        f"copied {story['from']} -> {story['to']}{rate}, every object "
        + ("verified against the source" if story["identical"] else "NOT matching the source")
        + f"; {story['job']} held no GPUs while it waited ({len(story['progress'])} progress "
        f"reports), then was placed in {story['to']} (`fleetline explain {story['job']}`)"
    )


def print_serving_day(console: Console, day: dict[str, Any]) -> None:
    if not day or _stopped(console, day):
        return
    if "skipped" in day:
        console.print(f"\nserving day skipped: {day['skipped']}")
        return
    load, router = day["load"], day["router"]
    outs = sum(r.startswith("scale out") for r in day["scaled"])
    ins = sum(r.startswith("scale in") for r in day["scaled"])
    peak = max((sum(t["serving"].values()) for t in day["timeline"]), default=0)
    console.print(
        f"\nserving day: {day['service']} scaled out {outs}x and in {ins}x (at most {peak} "
        f"serving replicas); {day['training']} paused {day['paused']}x for them and resumed "
        f"{day['resumed']}x from its checkpoint; {load.get('requests')} requests, "
        f"{load.get('failed')} failed, {router.get('retries')} retried by the router, p95 "
        f"{load.get('p95_ms')} ms (`fleetline explain {day['service']}`)"
    )


def print_postmortem(console: Console, part: dict[str, Any]) -> None:
    if not part or _stopped(console, part):
        return
    from fleetline.processors.postmortem.render import when

    report = part["report"]
    say = console.print
    say(f"\npostmortem of this run (`fleetline postmortem`): {report['summary']}")
    faults = table("fault at", "kind", "what failed", "detected after", "by")
    for f in report["faults"]:
        faults.add_row(
            when(f["at_ms"])[11:23],
            f["kind"],
            f["subject"],
            "never" if f["detection_s"] is None else f"{f['detection_s']:g}s",
            (f["detected_by"] or "NOT DETECTED")[:70],
        )
    say(faults)

    def shown(value: Any, unit: str = "") -> str:
        return "-" if value is None else f"{value:g}{unit}"

    for j in report["impact"]["jobs"]:
        for m in j["moves"]:
            say(
                f"  {j['job']}: {m['from']} -> {m['to']} ({m['fault'] or 'moved by decision'}),"
                f" {shown(m['steps_redone'])} steps redone, running again "
                f"{shown(m['recovery_s'], 's')} after, from "
                f"{m['checkpoint'] or 'no checkpoint'}",
                soft_wrap=True,
                markup=False,
            )
    say("written: " + ", ".join(part["files"].values()), soft_wrap=True)
