"""The scheduler's committed state: `get`, `describe`, `explain`, and `quota set`."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Annotated, Any
from urllib.parse import quote

import typer

from fleetline.cli.common import Json, TopicPrefix, console, now_ms, print_json, settings
from fleetline.cli.common import table as new_table
from fleetline.config import Settings
from fleetline.errors import ConfigError, FleetlineError
from fleetline.streams.store import ChangelogStore
from fleetline.streams.topics import Topics

Job = Annotated[str, typer.Argument(help="TENANT/NAME")]
get = typer.Typer(
    help="List jobs, datasets or tenants as the scheduler holds them.", no_args_is_help=True
)
quota = typer.Typer(
    help="Set a tenant's quotas, reservations and fair share.", no_args_is_help=True
)


def _age(ms: int | None) -> str:
    if not ms:
        return "-"
    seconds = max(0, (now_ms() - ms) // 1000)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _gpus(job: dict[str, Any]) -> int:
    return sum(
        bin(mask).count("1") for nodes in job["allocation"].values() for mask in nodes.values()
    )


def _state(config: Settings, topics: Topics) -> ChangelogStore[Any]:
    from fleetline.processors.scheduling.client import read_state

    return read_state(config.kafka, topics)


Tenant = Annotated[str | None, typer.Option(help="only this tenant's")]


@get.command(name="jobs")
def get_jobs(
    tenant: Tenant = None,
    all_: Annotated[bool, typer.Option("--all", help="include deleted jobs")] = False,
    json_: Json = False,
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """Jobs: phase (desired), what their cluster reports (actual), priority, GPUs, where."""
    from fleetline.processors.scheduling.client import job_records

    jobs = [
        j
        for j in job_records(_state(settings("kafka"), Topics(topic_prefix)), tenant)
        if all_ or j["phase"] != "Deleted"
    ]
    if json_:
        print_json(jobs)
        return
    out = new_table(
        "JOB", "KIND", "PHASE", "ACTUAL", "PRIO", "GPUS", "WHERE", "AGE", numeric=("PRIO", "GPUS")
    )
    for job in jobs:
        out.add_row(
            job["key"],
            job["kind"],
            job["phase"],
            actual_line(job, short=True),
            str(job["priority"]),
            str(_gpus(job)),
            ",".join(sorted(job["allocation"])) or "-",
            _age(job["submitted_ms"]),
        )
    console.print(out)


def _rows(prefix: str, tenant: str | None, topic_prefix: str) -> dict[str, Any]:
    store = _state(settings("kafka"), Topics(topic_prefix))
    rows = {
        key.decode(): value
        for key, value in store.items([0])
        if key.decode().startswith(prefix) and value is not None
    }
    if tenant:
        rows = {
            k: v
            for k, v in rows.items()
            if (v.get("tenant") if prefix == "dataset:" else k[len(prefix) :]) == tenant
        }
    return rows


@get.command(name="datasets")
def get_datasets(tenant: Tenant = None, topic_prefix: TopicPrefix = "fleetline") -> None:
    """Datasets the scheduler registered: size, replicas (JSON)."""
    print_json(_rows("dataset:", tenant, topic_prefix))


@get.command(name="tenants")
def get_tenants(tenant: Tenant = None, topic_prefix: TopicPrefix = "fleetline") -> None:
    """Tenants' policies and usage (JSON)."""
    print_json(_rows("tenant:", tenant, topic_prefix))


def actual_line(job: dict[str, Any], short: bool = False) -> str:
    """What the job's cluster last reported of it (the actual state beside the phase)."""
    actual = job.get("actual") or {}
    if not actual:
        return "-"
    where = f"{actual.get('state')} in {actual.get('cluster')}"
    if short:
        return where
    run = f"epoch {actual.get('epoch')}, attempt {actual.get('attempt')}"
    step = actual.get("checkpoint_step")
    detail = actual.get("detail")
    return (
        f"{where} ({run}, since {_age(actual.get('since_ms'))} ago)"
        + (f", last checkpoint at step {step}" if step is not None else "")
        + (f": {detail}" if detail else "")
    )


def data_plane_lines(config: Settings, topics: Topics, record: dict[str, Any]) -> list[str]:
    """What the job's workers say of their data plane in its current epoch (its world and what
    a step's exchange costs), from the workload events of its clusters: empty for a job of one
    worker. Read from the one partition that holds the job's events."""
    from fleetline.streams import kafka as kafka_clients
    from fleetline.streams.partitioner import partition_for
    from fleetline.streams.serde import default_codec

    if int(record["document"]["spec"].get("workers") or 1) < 2:
        return []
    partitions = kafka_clients.partitions_of(config.kafka, topics.workloads)
    partition = partition_for(record["key"].encode(), len(partitions))
    codec = default_codec()
    latest: dict[tuple[str, str], str] = {}
    for message in kafka_clients.read_to_end(
        config.kafka, topics.workloads, [partition], f"explain-{uuid.uuid4().hex[:12]}", 30
    ):
        event = codec.decode(message.value()).record
        detail = event.get("detail") or ""
        if event["job"] != record["key"] or event["epoch"] != record["epoch"]:
            continue
        for kind in ("a world", "data plane:"):
            if detail.startswith(kind):
                latest[(event["cluster_id"], kind)] = detail
    rows = [f"  {cluster}: {detail}" for (cluster, _), detail in sorted(latest.items())]
    return ["its workers' data plane (epoch " + str(record["epoch"]) + "):", *rows] if rows else []


def _job_or_fail(config: Settings, topics: Topics, key: str) -> dict[str, Any]:
    value = _state(config, topics).committed(0, f"job:{key}".encode())
    if not isinstance(value, dict):
        raise ConfigError(f"no job {key!r} in the scheduler's state")
    return value


def describe(job: Job, json_: Json = False, topic_prefix: TopicPrefix = "fleetline") -> None:
    """One job: phase (desired), what its cluster reports (actual), conditions, GPUs."""
    record = _job_or_fail(settings("kafka"), Topics(topic_prefix), job)
    if json_:
        print_json(record)
        return
    spec = record["document"]["spec"]
    print(f"Job:        {record['key']} ({record['kind']})")
    print(
        f"Phase:      {record['phase']}   priority {record['priority']}   submitted "
        f"{_age(record['submitted_ms'])} ago   preempted {record['preemptions']} time(s)"
    )
    print(f"Spec:       {json.dumps(spec, sort_keys=True)}")
    print(f"Actual:     {actual_line(record)}")
    if record.get("stale_reports"):
        print(f"            {record['stale_reports']} report(s) of fenced epochs ignored")
    print("Conditions:")
    for name, cond in sorted(record["conditions"].items()):
        print(f"  {name:<10} {cond['status']!s:<6} {cond['reason']}")
    print("Allocation:")
    for cluster, nodes in sorted(record["allocation"].items()):
        for node, mask in sorted(nodes.items()):
            gpus = [i for i in range(64) if mask >> i & 1]
            print(f"  {cluster:<14} {node:<22} GPUs {gpus}")
    if not record["allocation"]:
        print("  (none)")
    if record["waiting_for"]:
        print(f"Waiting for: {', '.join(record['waiting_for'])}")
    print(f"Last decision: {record['last_decision'] or '-'} (`fleetline explain {record['key']}`)")


def _print_decision(decision: dict[str, Any]) -> None:
    print(
        f"{decision['decision_id']:>10}  {decision['outcome']:<9} priority "
        f"{decision['priority']}  at {decision['ts']}  (request {decision['input_offset']}, "
        f"view version {decision['view_version']}, policy {decision['policy_digest']})"
    )
    print(f"            {decision['reason']}")
    for placement in decision["placements"]:
        workers = "; ".join(f"{w['node_id']} {w['gpus']}" for w in placement["workers"])
        print(
            f"            placed in {placement['cluster_id']} under "
            f"{', '.join(placement['leaves'])}: {workers}"
        )
    for prewarm in decision["prewarms"]:
        print(
            f"            prewarm {prewarm['dataset_id']} {prewarm['from_cluster']} -> "
            f"{prewarm['to_cluster']}: {prewarm['size_bytes']} bytes, "
            f"~{prewarm['estimated_s']:.0f}s at {prewarm['rate_gbps']:g} Gbit/s"
        )
    if decision["preempted_by"]:
        print(
            f"            preempted by {decision['preempted_by']}; lost "
            f"{decision['lost_gpu_s']} GPU-seconds; resumes from "
            f"{decision['resume_from_checkpoint_ms']}"
        )
    if decision["victims"]:
        print(f"            preempted {', '.join(decision['victims'])}")


def _print_alternatives(alternatives: Iterable[dict[str, Any]]) -> None:
    rows = list(alternatives)
    if not rows:
        return
    print()
    out = new_table("CLUSTER", "SCORE", "PARTS / WHY NOT", numeric=("SCORE",))
    for alt in rows:
        if alt["rejected"]:
            out.add_row(alt["cluster_id"], "-", alt["rejected"])
        else:
            parts = ", ".join(f"{k} {v:g}" for k, v in sorted(alt["parts"].items()))
            out.add_row(alt["cluster_id"], f"{alt['total']:.3f}", parts)
    console.print(out)


def _explain_queue(topic_prefix: str, json_: bool) -> None:
    from fleetline.processors.postmortem.queue import committed_fits
    from fleetline.processors.replay import observe_at

    config = settings("kafka")
    topics = Topics(topic_prefix)
    store = _state(config, topics)
    records = {key.decode(): value for key, value in store.items([0])}
    fits = committed_fits(records, lambda offsets: observe_at(config.kafka, topics, offsets))
    if json_:
        print_json([f.as_data() for f in fits])
        return
    if not fits:
        print("no job is queued")
        return
    for line in fit_lines(fits):
        print(line)


def fit_lines(fits: list[Any]) -> list[str]:
    """Two lines a queued job: what binds it, then what would place it (or that nothing
    found would)."""
    out = []
    for f in fits:
        out.append(f"{f.job} ({f.gpus} GPUs) is held by {f.binding}: {f.why}")
        if f.change is None:
            out.append("  nothing tried places it")
        else:
            checked = "" if f.checked else " (not checked)"
            out.append(f"  {f.change}: then placed in {f.places_in}{checked}")
    return out


def explain(
    job: Annotated[str | None, typer.Argument(help="TENANT/NAME of a job, or a node id")] = None,
    queued: Annotated[
        bool,
        typer.Option(
            "--queued",
            help="every queued job: the constraint that binds it and the smallest change "
            "that would place it now (checked by placing it again with the change)",
        ),
    ] = False,
    json_: Json = False,
    history: Annotated[
        bool, typer.Option(help="every decision about the job, from the decision log")
    ] = False,
    region: Annotated[
        str | None,
        typer.Option(help="a service: the client region to show the router's weights for"),
    ] = None,
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """Why a job is where it is, or why it is waiting: the latest decision, where it placed
    the job, every cluster's score or the reason it was ruled out, the view version and
    offsets it read and the policy digest (a deferrable job says which cheaper window it waits
    for). Given a service: its replicas, their load in the registry, the load the autoscaler
    last saw and the router's weights for clients in each of its regions. Given a node: why
    operations cordoned it, from its repair tickets' evidence. With --queued: what would
    make each queued job fit."""
    from fleetline.processors.scheduling.client import decisions_of

    if queued:
        _explain_queue(topic_prefix, json_)
        return
    if job is None:
        raise typer.BadParameter("name a job or a node, or give --queued")

    if "/" not in job:
        from fleetline.cli.operations import explain_node

        explain_node(job, topic_prefix)
        return

    config = settings("kafka")
    topics = Topics(topic_prefix)
    record = _job_or_fail(config, topics, job)
    latest = record.get("explanation")
    print(
        f"{record['key']} is {record['phase']}"
        + (
            f": {record['conditions']['Placed']['reason']}"
            if record["phase"] == "Queued" and "Placed" in record["conditions"]
            else ""
        )
    )
    print(f"its cluster reports: {actual_line(record)}")
    if record["kind"] == "TrainingJob" and not history:
        for line in data_plane_lines(config, topics, record):
            print(line)
    if record["kind"] == "InferenceService" and not history:
        from fleetline.cli.serving import explain_service

        explain_service(config, topics, record, _state(config, topics), region)
    if history:
        print("\nEvery decision about it:")
        for decision in decisions_of(config.kafka, topics, job):
            _print_decision(decision)
        return
    if latest is None:
        print("no decision yet")
        return
    print("\nThe latest decision:")
    _print_decision(latest)
    _print_alternatives(latest["alternatives"])
    offsets = ", ".join(
        f"{o['topic']}[{o['partition']}]@{o['offset']}" for o in latest["view_offsets"]
    )
    print(f"\n  decided on the resource view at {offsets or '(empty view)'}")


def _counts(items: list[str] | None, what: str) -> dict[str, int]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not value.isdigit():
            raise ConfigError(f"{what} wants CLUSTER=GPUS, got {item!r}")
        out[key] = int(value)
    return out


@quota.command(name="set")
def quota_set(
    tenant: Annotated[str, typer.Argument()],
    gpus: Annotated[int | None, typer.Option(help="GPUs held at once, fleet-wide")] = None,
    cluster_gpus: Annotated[list[str] | None, typer.Option(metavar="CLUSTER=GPUS")] = None,
    gpu_hours: Annotated[
        float | None, typer.Option(help="budget; a training job reserves GPUs x its max runtime")
    ] = None,
    storage: Annotated[
        str | None, typer.Option(help="dataset bytes x replicas, e.g. 500TB")
    ] = None,
    bandwidth_gbps: Annotated[
        float | None, typer.Option(help="cross-cluster dataset moves at once")
    ] = None,
    reserve: Annotated[
        list[str] | None,
        typer.Option(metavar="CLUSTER=GPUS", help="GPUs held back for this tenant in a cluster"),
    ] = None,
    share: Annotated[float, typer.Option(help="fair-share weight")] = 1.0,
) -> None:
    """A tenant's quotas, reserved capacity and fair-share weight (platform admins, through
    the API)."""
    from fleetline.cli.client import api
    from fleetline.processors.scheduling.codec import canonical_json
    from fleetline.processors.scheduling.tenancy import TenantPolicy

    terms = {
        "share": share,
        "reserved": _counts(reserve, "--reserve"),
        "quota": {
            "gpus": gpus,
            "cluster_gpus": _counts(cluster_gpus, "--cluster-gpus"),
            "gpu_hours": gpu_hours,
            "storage_bytes": storage,
            "bandwidth_gbps": bandwidth_gbps,
        },
    }
    try:
        TenantPolicy.from_data({"tenant": tenant, **terms})  # refused here with the field named
    except FleetlineError as exc:
        raise ConfigError(str(exc)) from None
    answer = api().call("PUT", f"/v1/tenants/{quote(tenant, safe='')}/policy", body=terms)
    print(
        f"tenant {tenant}: policy set (request {answer['request_offset']}): "
        f"{canonical_json(answer['policy'])}"
    )


def register(app: typer.Typer) -> None:
    app.add_typer(get, name="get")
    app.command(name="describe")(describe)
    app.command(name="explain")(explain)
    app.add_typer(quota, name="quota")
