"""The resource view rebuilt from snapshots and the log: `view ...`, and `replay` (a past
moment, a range of changes, or every scheduling decision made again)."""

from __future__ import annotations

import json
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from fleetline.cli.common import (
    At,
    AtOffsets,
    Json,
    NoSnapshots,
    Since,
    TopicPrefix,
    Until,
    ViewGroup,
    console,
    exit_with,
    pairs,
    parse_time_ms,
    settings,
    table,
)
from fleetline.config import Settings
from fleetline.errors import ConfigError
from fleetline.processors.view import APPLICATION_ID as VIEW_APP
from fleetline.streams.records import Offsets
from fleetline.streams.topics import Topics

if TYPE_CHECKING:
    from fleetline.processors.replay import Replay

view = typer.Typer(
    help="Show the resource view (rebuilt from the newest snapshots + the log).",
    no_args_is_help=True,
)


class Status(StrEnum):
    UP = "UP"
    DRAINING = "DRAINING"
    DOWN = "DOWN"
    UNREACHABLE = "UNREACHABLE"


class HealthChoice(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    FAILED = "failed"


class CapacityChoice(StrEnum):
    IDLE = "idle"
    ALLOCATED = "allocated"
    DEGRADED = "degraded"
    FAILED = "failed"
    UNAVAILABLE = "unavailable"


def _target(config: Settings, topics: Topics, at: str | None, offsets: str | None) -> Offsets:
    from fleetline.processors.replay import log_bounds, offsets_at

    if offsets:
        try:
            raw = json.loads(offsets)
            return {t: {int(p): int(o) for p, o in ps.items()} for t, ps in raw.items()}
        except (ValueError, AttributeError) as exc:
            raise ConfigError(f"--offsets wants {{topic: {{partition: offset}}}}: {exc}") from None
    if at:
        return offsets_at(config.kafka, topics, parse_time_ms(at))
    return log_bounds(config.kafka, topics)[1]


def _rebuild(
    topic_prefix: str, group: str, at: str | None, offsets: str | None, no_snapshots: bool
) -> Replay:
    """The view at the target, from the newest snapshots + the log; what it could not use (a
    snapshot pruned while read, events removed by retention) is said on stderr."""
    from fleetline.app import view_snapshots
    from fleetline.processors.replay import rebuild
    from fleetline.processors.view.runtime import tune_gc_for_large_state

    tune_gc_for_large_state()
    config = settings("kafka") if no_snapshots else settings("kafka", "s3")
    topics = Topics(topic_prefix)
    snapshots = None if no_snapshots else view_snapshots(config, topic_prefix, group)
    result = rebuild(
        config.kafka,
        topics,
        _target(config, topics, at, offsets),
        snapshots,
        workers=os.cpu_count() or 1,  # a long log folds its partitions in parallel
    )
    for warning in [*result.notes, *result.gaps]:
        print(f"warning: {warning}", file=sys.stderr)
    return result


def _show(
    items: list[dict[str, Any]],
    json_: bool,
    columns: tuple[str, ...],
    row: Any,
    numeric: tuple[str, ...] = (),
) -> None:
    if json_:
        print(json.dumps(items, indent=2))
        return
    out = table(*columns, numeric=numeric)
    for item in items:
        out.add_row(*(str(v) for v in row(item)))
    console.print(out)


@view.command()
def clusters(
    region: Annotated[str | None, typer.Option()] = None,
    topic_prefix: TopicPrefix = "fleetline",
    group: ViewGroup = VIEW_APP,
    at: At = None,
    offsets: AtOffsets = None,
    no_snapshots: NoSnapshots = False,
    json_: Json = False,
) -> None:
    """Per cluster: GPUs idle, allocated, degraded, failed, unavailable."""
    from fleetline.processors.view import read as view_read

    items = view_read.cluster_capacity(
        _rebuild(topic_prefix, group, at, offsets, no_snapshots).view, region
    )
    counts = ("gpus", "idle", "allocated", "degraded", "failed", "unavailable")
    _show(
        items,
        json_,
        ("cluster", "region", "health", *counts),
        lambda c: (c["cluster_id"], c["region"], c["health"], *(c[k] for k in counts)),
        counts,
    )


@view.command()
def nodes(
    cluster: Annotated[str | None, typer.Option()] = None,
    status: Annotated[Status | None, typer.Option()] = None,
    label: Annotated[list[str] | None, typer.Option(metavar="KEY=VALUE")] = None,
    topic_prefix: TopicPrefix = "fleetline",
    group: ViewGroup = VIEW_APP,
    at: At = None,
    offsets: AtOffsets = None,
    no_snapshots: NoSnapshots = False,
    json_: Json = False,
) -> None:
    """Nodes, filtered by cluster, status and labels."""
    from fleetline.processors.view import read as view_read

    state = _rebuild(topic_prefix, group, at, offsets, no_snapshots).view
    items = [
        view_read.node_data(state, n, with_gpus=False)
        for n in view_read.select_nodes(
            state, cluster, str(status) if status else None, pairs(label, "--label")
        )
    ]
    _show(
        items,
        json_,
        ("node", "cluster", "status", "healthy GPUs", "GPU model", "GPU memory"),
        lambda n: (
            n["node_id"],
            n["cluster_id"],
            n["status"],
            f"{n['gpus_healthy']}/{n['gpu_count']}",
            f"{n['accelerator']['vendor']} {n['accelerator']['model']}",
            f"{n['accelerator']['memory_mib'] / 1024:.0f} GiB"
            if n["accelerator"]["memory_mib"]
            else "-",
        ),
    )


@view.command()
def node(
    node_id: Annotated[str, typer.Argument(help="the node")],
    topic_prefix: TopicPrefix = "fleetline",
    group: ViewGroup = VIEW_APP,
    at: At = None,
    offsets: AtOffsets = None,
    no_snapshots: NoSnapshots = False,
    json_: Json = False,
) -> None:
    """One node with its GPUs (JSON)."""
    from fleetline.processors.view import read as view_read

    state = _rebuild(topic_prefix, group, at, offsets, no_snapshots).view
    if node_id not in state.nodes:
        raise ConfigError(f"no node {node_id!r} in the view")
    print(json.dumps([view_read.node_data(state, state.nodes[node_id])], indent=2))


@view.command()
def gpus(
    cluster: Annotated[str | None, typer.Option()] = None,
    health: Annotated[HealthChoice | None, typer.Option()] = None,
    capacity: Annotated[CapacityChoice | None, typer.Option()] = None,
    topic_prefix: TopicPrefix = "fleetline",
    group: ViewGroup = VIEW_APP,
    at: At = None,
    offsets: AtOffsets = None,
    no_snapshots: NoSnapshots = False,
    json_: Json = False,
) -> None:
    """GPUs, filtered by cluster, health and capacity state."""
    from fleetline.processors.view import read as view_read

    items = view_read.select_gpus(
        _rebuild(topic_prefix, group, at, offsets, no_snapshots).view,
        cluster,
        str(health) if health else None,
        str(capacity) if capacity else None,
    )
    _show(
        items,
        json_,
        ("GPU", "health", "cause", "capacity", "util %"),
        lambda g: (
            f"{g['node_id']}/{g['gpu_index']}",
            g["health"],
            g["cause"] or "",
            g["capacity"],
            g["gpu_util_pct"],
        ),
        ("util %",),
    )


@view.command()
def topology(
    cluster_id: Annotated[str, typer.Argument(help="the cluster")],
    topic_prefix: TopicPrefix = "fleetline",
    group: ViewGroup = VIEW_APP,
    at: At = None,
    offsets: AtOffsets = None,
    no_snapshots: NoSnapshots = False,
    json_: Json = False,
) -> None:
    """The cluster as a tree: spines, leaves, nodes, NVLink islands (JSON)."""
    from fleetline.processors.view import read as view_read

    state = _rebuild(topic_prefix, group, at, offsets, no_snapshots).view
    print(json.dumps([view_read.topology(state, cluster_id)], indent=2))


def replay(
    since: Since = None,
    until: Until = None,
    out: Annotated[
        Path | None, typer.Option(help="write the whole view as JSON to this file")
    ] = None,
    decisions: Annotated[
        bool,
        typer.Option(
            help="refold the scheduler's request log, observing the view at every TICK's "
            "offsets, and check each decision against the log byte for byte, then the "
            "scheduler's committed state against the refolded one record by record (exit 2 at "
            "the first difference)"
        ),
    ] = False,
    what_if: Annotated[
        str | None,
        typer.Option(
            "--what-if",
            help="with --decisions: refold the request log beside this change and report "
            "the per-decision diff and the deltas (queue wait p50/p95 per tenant and priority, "
            "GPU-hours, utilisation, preemptions, deadline misses, energy cost) over "
            "--from/--to: policy=FILE, without-cluster=C, add-gpus=C:N or quota=TENANT:N",
        ),
    ] = None,
    operations: Annotated[
        bool,
        typer.Option(
            help="refold the operations log and check every repair-ticket change and node "
            "command it issued against what was published, byte for byte (exit 2 at the first "
            "difference)"
        ),
    ] = False,
    topic_prefix: TopicPrefix = "fleetline",
    group: ViewGroup = VIEW_APP,
    at: At = None,
    offsets: AtOffsets = None,
    no_snapshots: NoSnapshots = False,
    json_: Json = False,
) -> None:
    """Rebuild the view as it was, or list what changed between two times.

    With --at or --offsets (default: now), rebuilds the view from the newest snapshot at or
    before that point plus the log after it. With --from and --to, lists the GPU health and
    node transitions in between.
    """
    from fleetline.app import view_snapshots
    from fleetline.processors.replay import offsets_at, walk
    from fleetline.processors.view import codec as view_codec
    from fleetline.processors.view import read as view_read

    config = settings("kafka") if no_snapshots else settings("kafka", "s3")
    topics = Topics(topic_prefix)
    if what_if is not None and not decisions:
        raise ConfigError("--what-if goes with --decisions")
    if decisions and what_if is not None:
        _what_if(config, topics, group, no_snapshots, what_if, since, until)
        return
    if decisions:
        exit_with(_replay_decisions(config, topics, group, no_snapshots))
        return
    if operations:
        from fleetline.processors.decision_replay import replay_operations

        again = replay_operations(config.kafka, topics)
        print(
            json.dumps(
                {
                    "ok": again.ok,
                    "events": again.events,
                    "ticket_changes": again.tickets,
                    "commands": again.commands,
                    "dead_lettered": {str(o): r for o, r in sorted(again.dead_letters.items())},
                    "first_difference": again.first_difference,
                    "seconds": round(again.seconds, 3),
                },
                indent=2,
            )
        )
        exit_with(0 if again.ok else 2)
        return
    if since or until:
        if not (since and until):
            raise ConfigError("--from and --to go together")
        snapshots = None if no_snapshots else view_snapshots(config, topic_prefix, group)
        result, changes = walk(
            config.kafka,
            topics,
            offsets_at(config.kafka, topics, parse_time_ms(since)),
            offsets_at(config.kafka, topics, parse_time_ms(until)),
            snapshots,
        )
        for change in changes:
            line = {
                "ts": change.ts,
                "entity": change.entity,
                "id": change.entity_id,
                "from": change.before,
                "to": change.after,
                "cause": change.cause,
            }
            print(
                json.dumps(line)
                if json_
                else f"{change.ts}  {change.entity:<4} {change.entity_id:<24} "
                f"{change.before:>11} -> {change.after:<11} {change.cause or ''}"
            )
        print(
            f"{len(changes)} changes; {result.folded} events folded in {result.seconds:.2f}s",
            file=sys.stderr,
        )
        return
    result = _rebuild(topic_prefix, group, at, offsets, no_snapshots)
    if out:
        out.write_text(json.dumps(view_codec.to_data(result.view), sort_keys=True))
    meta = view_read.view_meta(result.view)
    print(
        json.dumps(
            {
                "folded": result.folded,
                "dead_letters": result.dead_letters,
                "seconds": round(result.seconds, 3),
                "from_snapshots": result.snapshot_positions,
                **meta,
            },
            indent=2,
        )
    )
    if not out:
        for cluster in view_read.cluster_capacity(result.view):
            cluster.pop("info")
            print(json.dumps(cluster))


def _replay_decisions(config: Settings, topics: Topics, group: str, no_snapshots: bool) -> int:
    from fleetline.app import view_snapshots
    from fleetline.processors.decision_replay import replay_decisions
    from fleetline.processors.replay import ViewFollower
    from fleetline.processors.view.runtime import tune_gc_for_large_state

    tune_gc_for_large_state()
    snapshots = None if no_snapshots else view_snapshots(config, topics.prefix, group)
    follower = ViewFollower(config.kafka, topics, snapshots)
    try:
        result = replay_decisions(config.kafka, topics, follower.facts)
    finally:
        follower.close()
    print(
        json.dumps(
            {
                "ok": result.ok,
                "requests": result.requests,
                "ticks": result.ticks,
                "decisions": result.decisions,
                "matched": result.matched,
                "first_difference": result.first_difference,
                "requests_not_yet_decided": result.unprocessed,
                # Passed over as the live scheduler dead-lettered them (offset: reason).
                "dead_lettered": {str(o): r for o, r in sorted(result.dead_letters.items())},
                "state": result.state,
                "state_records": result.state_records,
                "state_difference": result.state_difference,
                "view_rebuilds": follower.rebuilds,
                "view_events_folded": follower.folded,
                "seconds": round(result.seconds, 3),
            },
            indent=2,
        )
    )
    return 0 if result.ok else 2


def _what_if(
    config: Settings,
    topics: Topics,
    group: str,
    no_snapshots: bool,
    text: str,
    since: str | None,
    until: str | None,
) -> None:
    from fleetline.app import view_snapshots
    from fleetline.config import mapping_file
    from fleetline.processors.decision_replay import what_if_decisions
    from fleetline.processors.postmortem.whatif import Change
    from fleetline.processors.replay import ViewFollower
    from fleetline.processors.view.runtime import tune_gc_for_large_state

    kind, _, value = text.partition("=")
    data = mapping_file(value, "scheduling policy") if kind == "policy" and value else None
    change = Change.parse(text, data)
    tune_gc_for_large_state()
    snapshots = None if no_snapshots else view_snapshots(config, topics.prefix, group)
    follower = ViewFollower(config.kafka, topics, snapshots)
    try:
        report = what_if_decisions(
            config.kafka,
            topics,
            follower.facts,
            change,
            parse_time_ms(since) if since else None,
            parse_time_ms(until) if until else None,
        )
    finally:
        follower.close()
    print(json.dumps(report, indent=2, sort_keys=True))
    print(
        f"what if {report['change']}: {report['differences']} decisions differ of "
        f"{report['decisions']['baseline']}; "
        + ", ".join(f"{k} {v:+g}" for k, v in report["deltas"].items() if v),
        file=sys.stderr,
    )


def register(app: typer.Typer) -> None:
    app.add_typer(view, name="view")
    app.command(name="replay")(replay)
