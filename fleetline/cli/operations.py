"""`fleetline tickets` (repair tickets: list, show, move), `fleetline forecast` (GPU demand
weeks ahead, its back-test, capacity requests) and `fleetline energy apply` (clusters'
electricity by the hour, for placement and deferrable jobs)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import typer

from fleetline.cli.common import TopicPrefix, analyst_query, console, now_ms, settings
from fleetline.cli.common import table as new_table
from fleetline.errors import ConfigError, FleetlineError

SIMULATED_MONDAY_H = 490_152  # 2025-12-01 00:00 UTC, a Monday, in hours since the epoch
tickets = typer.Typer(help="Repair tickets opened by self-healing", no_args_is_help=True)
energy = typer.Typer(
    help="Electricity prices and renewable share per cluster", no_args_is_help=True
)


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _tickets(prefix: str) -> dict[str, dict[str, Any]]:
    from fleetline.processors.operations.runtime import tickets_from_log
    from fleetline.streams.topics import Topics

    return tickets_from_log(settings("kafka").kafka, Topics(prefix))


@tickets.command(name="list")
def list_tickets(
    state: Annotated[str | None, typer.Option(help="only tickets in this state")] = None,
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """Every repair ticket: node, rule, severity, state, when it opened and why it stands."""
    out = new_table("TICKET", "NODE", "RULE", "SEVERITY", "STATE", "OPENED", "WHY")
    for t in sorted(_tickets(topic_prefix).values(), key=lambda t: t["opened_ms"]):
        if state is None or t["state"] == state:
            out.add_row(
                t["ticket_id"],
                t["node_id"],
                t["rule"],
                t["severity"],
                t["state"],
                _when(t["opened_ms"]),
                t["reason"],
            )
    console.print(out)


@tickets.command()
def show(ticket_id: str, topic_prefix: TopicPrefix = "fleetline") -> None:
    """One ticket: why the node was cordoned (the evidence: readings and events that tripped
    the rule) and every transition with who made it and why."""
    ticket = _tickets(topic_prefix).get(ticket_id)
    if ticket is None:
        raise FleetlineError(f"no ticket {ticket_id!r}; `fleetline tickets list` names them")
    print(
        f"{ticket['ticket_id']}: {ticket['node_id']} in {ticket['cluster_id']} is "
        f"{ticket['state']} ({ticket['severity']}, rule {ticket['rule']})"
    )
    print(f"  {ticket['reason']}")
    if ticket["burn_in_until_ms"]:
        print(f"  burn-in until {_when(ticket['burn_in_until_ms'])} UTC")
    print("\nEvidence:")
    for e in ticket["evidence"]:
        readings = {
            k: v
            for k, v in e["evidence"].items()
            if k not in ("gpu_uuid",) and v not in (None, [], "")
        }
        print(f"  {_when(e['ts'])}  {e['rule']:<13} {e['summary']}  {json.dumps(readings)}")
    print("\nHistory:")
    for h in ticket["history"]:
        print(f"  {_when(h['ts'])}  {h['from'] or '-'} -> {h['to']} by {h['by']}: {h['why']}")


def explain_node(node_id: str, prefix: str) -> None:
    """Why a node is out of the pool (or that operations never took it out)."""
    found = [t for t in _tickets(prefix).values() if t["node_id"] == node_id]
    if not found:
        print(f"{node_id}: no repair ticket; operations never cordoned it")
        return
    found.sort(key=lambda t: t["opened_ms"])
    for earlier in found[:-1]:
        print(f"earlier: {earlier['ticket_id']} {earlier['state']} - {earlier['summary']}")
    show(found[-1]["ticket_id"], prefix)


@tickets.command()
def move(
    ticket_id: str,
    state: Annotated[
        str, typer.Argument(help="IN_REPAIR, REPAIRED (starts the burn-in), ESCALATED")
    ],
    note: Annotated[str, typer.Option(help="what was done")] = "",
) -> None:
    """Move a ticket through the API (platform admins; moved by the signed-in caller, audited):
    a repaired node returns to the pool only after its burn-in."""
    from fleetline.cli.client import api

    answer = api().call(
        "POST", f"/v1/tickets/{quote(ticket_id, safe='')}", body={"state": state, "note": note}
    )
    print(f"{ticket_id}: {state} appended at offset {answer['ops_offset']}")


def forecast(
    cluster_id: Annotated[str | None, typer.Option(help="the cluster (with --model)")] = None,
    model: Annotated[str | None, typer.Option(help="GPU model, e.g. H100")] = None,
    weeks: Annotated[int, typer.Option(min=1, max=26, help="how far ahead")] = 4,
    lead_weeks: Annotated[
        int, typer.Option(min=0, help="how long adding capacity takes (a request is late after)")
    ] = 4,
    capacity_gpus: Annotated[int | None, typer.Option(help="default: GPUs seen lately")] = None,
    simulated_weeks: Annotated[
        int | None,
        typer.Option(help="forecast a simulated demand history of this many weeks instead"),
    ] = None,
    seed: Annotated[int, typer.Option(help="--simulated-weeks: the noise's seed")] = 7,
    request: Annotated[
        bool,
        typer.Option(
            help="have the server (`fleetline login`) forecast again and append a "
            "CAPACITY_REQUEST as you when it crosses capacity (not with --simulated-weeks)"
        ),
    ] = False,
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """GPU demand per cluster and model, weeks ahead, from ClickHouse history (daily and weekly
    cycles plus trend, 90 % intervals), back-tested on held-out weeks against the seasonal-naive
    baseline; says when demand crosses what the cluster has."""
    import numpy as np

    from fleetline.processors.operations.forecast import (
        HOURS_PER_WEEK,
        capacity_plan,
        simulated_demand,
    )

    if request and simulated_weeks is not None:
        raise ConfigError("--request asks from the fleet's own history, not a simulated one")
    if simulated_weeks is not None:
        series = simulated_demand(simulated_weeks, seed)
        # The simulated history starts on a Monday (its weekends fall on weekends) and ends
        # now, a whole number of weeks later.
        monday = (now_ms() // 3_600_000 - SIMULATED_MONDAY_H) // HOURS_PER_WEEK * HOURS_PER_WEEK
        start = SIMULATED_MONDAY_H + monday - len(series)
        hours = list(range(start, start + len(series)))
        demand = [float(v) for v in series]
        capacity = capacity_gpus or int(np.ceil(series[-HOURS_PER_WEEK:].max() * 1.05))
        cluster_id, model = cluster_id or "simulated", model or "H100"
    else:
        if cluster_id is None or model is None:
            raise ConfigError("name --cluster-id and --model (or use --simulated-weeks)")
        from fleetline.storage.queries import demand_sql

        config = settings("clickhouse")
        rows = analyst_query(config, demand_sql(cluster_id, model)).rows
        if not rows:
            raise FleetlineError(f"no demand history for {model} in {cluster_id}")
        hours = [int(r[0]) for r in rows]
        demand = [float(r[1]) for r in rows]
        capacity = capacity_gpus or int(rows[-1][2])
    try:
        plan = capacity_plan(hours, demand, capacity, weeks, lead_weeks * HOURS_PER_WEEK)
    except ValueError as exc:
        raise FleetlineError(f"forecast of {model} in {cluster_id}: {exc}") from None
    print(
        f"{model} in {cluster_id}: {plan['history_hours']} hours of history, "
        f"capacity {capacity} GPUs, {weeks} weeks ahead ({plan['coverage']:.0%} intervals)"
    )
    test = plan["back_test"]
    if isinstance(test, dict):
        verdict = "beats" if test["beats_baseline"] else "loses to"
        print(
            f"back-test ({test['folds']} folds x {test['weeks_held_out']} held-out weeks): "
            f"sMAPE {test['model_smape_pct']:.2f} % vs seasonal-naive "
            f"{test['seasonal_naive_smape_pct']:.2f} % ({verdict} the baseline); interval held "
            f"{test['interval_coverage']:.1%} of hours"
        )
    out = new_table("DAY", "PEAK", "PEAK (UPPER)", "LOW (LOWER)", numeric=("PEAK",))
    for day in plan["days"]:  # type: ignore[attr-defined]
        out.add_row(
            _when(day["day_start_hour"] * 3_600_000)[:10],
            f"{day['peak_mean']:.0f}",
            f"{day['peak_upper']:.0f}",
            f"{day['low_lower']:.0f}",
        )
    console.print(out)
    crossing = plan["crossing"]
    if not isinstance(crossing, dict):
        print(f"demand stays within {capacity} GPUs for {weeks} weeks")
        return
    print(
        f"demand may need {crossing['needed_gpus']:.0f} GPUs at "
        f"{_when(crossing['hour'] * 3_600_000)} UTC ({crossing['hours_ahead']} h ahead) > "
        f"{capacity}" + (" - inside the lead time: late already" if crossing["late"] else "")
    )
    if request:
        # Through the API, as the caller signed in (`fleetline login`): the server forecasts
        # again from the fleet's own history and appends the request, audited.
        from fleetline.cli.client import api

        answer = api().call(
            "POST",
            "/v1/forecast/requests",
            body={
                "cluster_id": cluster_id,
                "model": model,
                "weeks": weeks,
                "lead_weeks": lead_weeks,
                **({"capacity_gpus": capacity_gpus} if capacity_gpus is not None else {}),
            },
        )
        requested = answer.get("requested")
        if requested is None:
            print("the server's forecast does not cross capacity: no request made")
        else:
            print(f"capacity request appended to the operations log at {requested['ops_offset']}")


def tune(
    days: Annotated[int, typer.Option(min=1, help="how much history to learn from")] = 30,
    append: Annotated[
        bool,
        typer.Option(
            help="have the server (`fleetline login`) make them and append each to the "
            "operations log as you (audited; applied there when its policy says so)"
        ),
    ] = False,
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """Recommendations for the running training jobs, each with its inputs: the checkpoint
    interval from the measured failure rate of the GPUs it runs on and its measured checkpoint
    cost (Daly's optimum), and a batch-size factor from its GPUs' memory headroom. (`serve`'s
    operations processor makes the same every hour on its own; `--append` asks the server to
    make and append them now, as the caller signed in.)"""
    if append:
        from fleetline.cli.client import api

        answer = api().call("POST", "/v1/recommendations", body={"days": days})
        made = answer["recommendations"]
        for rec in made:
            print(f"{rec['job']}: {rec['summary']}")
        print(f"{len(made)} recommendations appended to the operations log by the server")
        return
    from fleetline.processors.operations.runtime import stored_recommendations
    from fleetline.processors.scheduling.client import job_records, read_state
    from fleetline.streams.topics import Topics

    config = settings("kafka", "clickhouse")
    found = stored_recommendations(
        lambda sql: analyst_query(config, sql).rows,
        job_records(read_state(config.kafka, Topics(topic_prefix))),
        days,
    )
    if not found:
        print("no recommendation: no running training job with measured checkpoints or memory")
        return
    for rec, _ in found:
        print(f"{rec.job}: {rec.summary}")
        print(f"    inputs: {json.dumps(rec.inputs, sort_keys=True)}")


@energy.command()
def apply(
    file: Annotated[
        Path,
        typer.Argument(
            help="YAML: a list of {cluster_id, price_per_kwh: [24], renewable_share: [24]}"
        ),
    ],
) -> None:
    """Give clusters their electricity by the hour (UTC), through the API (platform admins):
    placement's energy term and deferrable jobs price by it from the scheduler's next request
    on."""
    import yaml

    from fleetline.cli.client import api
    from fleetline.processors.scheduling.energy import EnergyProfile

    try:
        items = yaml.safe_load(file.read_text())
        profiles = [EnergyProfile.from_data(item) for item in items or []]
    except (OSError, yaml.YAMLError, TypeError, FleetlineError) as exc:
        raise ConfigError(f"{file}: {exc}") from None
    answer = api().call("PUT", "/v1/energy", body=[p.as_data() for p in profiles])
    print(f"{len(answer['profiles'])} energy profiles sent: {', '.join(answer['profiles'])}")


def register(app: typer.Typer) -> None:
    app.add_typer(tickets, name="tickets")
    app.add_typer(energy, name="energy")
    app.command(name="forecast")(forecast)
    app.command(name="tune")(tune)
