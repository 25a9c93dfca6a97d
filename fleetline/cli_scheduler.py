"""The scheduler's commands: apply, get, describe, delete, explain, quota."""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fleetline.config import Settings
from fleetline.errors import ConfigError, FleetlineError
from fleetline.streams.topics import Topics


def _now_ms() -> int:
    return int(time.time() * 1000)


def _documents(path: str) -> tuple[list[Any], list[dict[str, Any]]]:
    """The specs of a file (or stdin), validated, with their documents; exit 1 on field errors."""
    import yaml

    from fleetline.processors.scheduling.specs import SpecError, parse_specs

    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        specs = parse_specs(text)
    except SpecError as exc:
        for error in exc.errors:
            print(f"{path}: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    documents = [d for d in yaml.safe_load_all(text) if d is not None]
    return specs, documents


def _audit(settings: Settings, topics: Topics, actor: str, operation: str, targets: list[str],
           request_ids: list[str], tenant: str | None = None) -> None:
    from fleetline.processors.audit.runtime import KafkaAuditEmitter, new_event

    emitter = KafkaAuditEmitter(settings.kafka, topics)
    for target, request_id in zip(targets, request_ids, strict=True):
        emitter.emit(new_event(ts=_now_ms(), actor=actor, actor_role="operator",
                               operation=operation, target=target, outcome="SUCCEEDED",
                               request_id=request_id, source="cli",
                               tenant=tenant or target.split("/")[0].removeprefix("dataset:")))
    if emitter.flush(30):
        raise FleetlineError("the requests were sent but their audit events were not delivered")


def _wait_for_decisions(settings: Settings, topics: Topics, keys: list[str], offsets: list[int],
                        timeout_s: float) -> dict[str, dict[str, Any]]:
    """The latest decision about each key made at or after its request's log offset, once each
    is settled (placed, accepted or rejected) or the time is up (then it may be QUEUED)."""
    from fleetline.processors.scheduling.runtime import DecisionFollower

    wanted = dict(zip(keys, offsets, strict=True))
    latest: dict[str, dict[str, Any]] = {}
    follower = DecisionFollower(settings.kafka, topics)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            for decision in follower.poll():
                key = decision["job"]
                if key in wanted and decision["input_offset"] >= wanted[key]:
                    latest[key] = decision
            settled = [k for k, d in latest.items() if d["outcome"] != "QUEUED"]
            if len(settled) == len(wanted) or time.monotonic() > deadline:
                return latest
    finally:
        follower.close()


def cmd_apply(args: argparse.Namespace, settings: Settings) -> int:
    from fleetline.processors.scheduling.codec import datasets_first, submit_request
    from fleetline.processors.scheduling.runtime import submit

    specs, documents = _documents(args.file)
    topics = Topics(args.topic_prefix)
    requests = [submit_request(spec, doc, _now_ms(), uuid.uuid4().hex, args.actor)
                for spec, doc in datasets_first(specs, documents)]
    offsets = submit(settings.kafka, topics, requests)
    _audit(settings, topics, args.actor, "job.apply", [r["key"] for r in requests],
           [r["request_id"] for r in requests])
    for request, offset in zip(requests, offsets, strict=True):
        print(f"{request['key']}: submitted (request {offset})")
    if not args.wait:
        return 0
    decided = _wait_for_decisions(settings, topics, [r["key"] for r in requests], offsets,
                                  args.wait)
    missing = 0
    for request in requests:
        decision = decided.get(request["key"])
        if decision is None:
            print(f"{request['key']}: no decision within {args.wait:g}s (is the scheduler "
                  "running? `fleetline serve` runs it)")
            missing += 1
        else:
            print(f"{request['key']}: {decision['outcome']} - {decision['reason']}")
    return 3 if missing else 0


def cmd_delete(args: argparse.Namespace, settings: Settings) -> int:
    from fleetline.processors.scheduling.codec import new_request
    from fleetline.processors.scheduling.runtime import submit

    keys: list[tuple[str, str]] = []  # (request key, tenant)
    if args.file:
        specs, _ = _documents(args.file)
        for spec in specs:
            tenant, name = spec.metadata.tenant, spec.metadata.name
            keys.append((f"dataset:{name}", tenant) if spec.kind == "Dataset"
                        else (f"{tenant}/{name}", tenant))
    for item in args.jobs:
        dataset = item.startswith("dataset:")
        tenant, sep, name = item.removeprefix("dataset:").partition("/")
        if not sep or not tenant or not name:
            raise ConfigError(f"{item!r}: name jobs as TENANT/NAME and datasets as "
                              "dataset:TENANT/NAME")
        keys.append((f"dataset:{name}", tenant) if dataset else (f"{tenant}/{name}", tenant))
    if not keys:
        raise ConfigError("delete needs TENANT/NAME arguments or -f FILE")
    topics = Topics(args.topic_prefix)
    requests = [new_request("DELETE", key, tenant, _now_ms(), uuid.uuid4().hex,
                            actor=args.actor) for key, tenant in keys]
    offsets = submit(settings.kafka, topics, requests)
    _audit(settings, topics, args.actor, "job.delete", [k for k, _ in keys],
           [r["request_id"] for r in requests])
    for (key, _), offset in zip(keys, offsets, strict=True):
        print(f"{key}: delete requested (request {offset})")
    return 0


def _age(ms: int | None) -> str:
    if not ms:
        return "-"
    seconds = max(0, (_now_ms() - ms) // 1000)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _state(settings: Settings, topics: Topics):
    from fleetline.processors.scheduling.runtime import read_state

    return read_state(settings.kafka, topics)


def cmd_get(args: argparse.Namespace, settings: Settings) -> int:
    from fleetline.processors.scheduling.runtime import job_records

    store = _state(settings, Topics(args.topic_prefix))
    if args.what == "jobs":
        jobs = [j for j in job_records(store, args.tenant)
                if args.all or j["phase"] not in ("Deleted",)]
        if args.json:
            print(json.dumps(jobs, indent=2, sort_keys=True))
            return 0
        print(f"{'JOB':<34}{'KIND':<18}{'PHASE':<11}{'PRIO':>5}{'GPUS':>6}  {'WHERE':<24}AGE")
        for job in jobs:
            gpus = sum(bin(m).count("1") for nodes in job["allocation"].values()
                       for m in nodes.values())
            where = ",".join(sorted(job["allocation"])) or "-"
            print(f"{job['key']:<34}{job['kind']:<18}{job['phase']:<11}{job['priority']:>5}"
                  f"{gpus:>6}  {where:<24}{_age(job['submitted_ms'])}")
        return 0
    prefix = "dataset:" if args.what == "datasets" else "tenant:"
    rows = {key.decode(): value for key, value in store.items([0])
            if key.decode().startswith(prefix) and value is not None}
    if args.tenant:
        rows = {k: v for k, v in rows.items()
                if (v.get("tenant") if prefix == "dataset:" else k[len(prefix):]) == args.tenant}
    print(json.dumps(rows, indent=2, sort_keys=True))
    return 0


def _job_or_fail(settings: Settings, topics: Topics, key: str) -> dict[str, Any]:
    value = _state(settings, topics).committed(0, f"job:{key}".encode())
    if value is None:
        raise ConfigError(f"no job {key!r} in the scheduler's state")
    return value


def cmd_describe(args: argparse.Namespace, settings: Settings) -> int:
    job = _job_or_fail(settings, Topics(args.topic_prefix), args.job)
    if args.json:
        print(json.dumps(job, indent=2, sort_keys=True))
        return 0
    spec = job["document"]["spec"]
    print(f"Job:        {job['key']} ({job['kind']})")
    print(f"Phase:      {job['phase']}   priority {job['priority']}   submitted "
          f"{_age(job['submitted_ms'])} ago   preempted {job['preemptions']} time(s)")
    print(f"Spec:       {json.dumps(spec, sort_keys=True)}")
    print("Conditions:")
    for name, cond in sorted(job["conditions"].items()):
        print(f"  {name:<10} {cond['status']!s:<6} {cond['reason']}")
    print("Allocation:")
    for cluster, nodes in sorted(job["allocation"].items()):
        for node, mask in sorted(nodes.items()):
            gpus = [i for i in range(64) if mask >> i & 1]
            print(f"  {cluster:<14} {node:<22} GPUs {gpus}")
    if not job["allocation"]:
        print("  (none)")
    if job["waiting_for"]:
        print(f"Waiting for: {', '.join(job['waiting_for'])}")
    print(f"Last decision: {job['last_decision'] or '-'} (`fleetline explain {job['key']}`)")
    return 0


def _print_decision(decision: dict[str, Any]) -> None:
    print(f"{decision['decision_id']:>10}  {decision['outcome']:<9} priority "
          f"{decision['priority']}  at {decision['ts']}  (request {decision['input_offset']}, "
          f"view version {decision['view_version']}, policy {decision['policy_digest']})")
    print(f"            {decision['reason']}")
    for placement in decision["placements"]:
        workers = "; ".join(f"{w['node_id']} {w['gpus']}" for w in placement["workers"])
        print(f"            placed in {placement['cluster_id']} under "
              f"{', '.join(placement['leaves'])}: {workers}")
    for prewarm in decision["prewarms"]:
        print(f"            prewarm {prewarm['dataset_id']} {prewarm['from_cluster']} -> "
              f"{prewarm['to_cluster']}: {prewarm['size_bytes']} bytes, "
              f"~{prewarm['estimated_s']:.0f}s at {prewarm['rate_gbps']:g} Gbit/s")
    if decision["preempted_by"]:
        print(f"            preempted by {decision['preempted_by']}; lost "
              f"{decision['lost_gpu_s']} GPU-seconds; resumes from "
              f"{decision['resume_from_checkpoint_ms']}")
    if decision["victims"]:
        print(f"            preempted {', '.join(decision['victims'])}")


def _print_alternatives(alternatives: Iterable[dict[str, Any]]) -> None:
    rows = list(alternatives)
    if not rows:
        return
    print(f"\n  {'CLUSTER':<16}{'SCORE':>8}  PARTS / WHY NOT")
    for alt in rows:
        if alt["rejected"]:
            print(f"  {alt['cluster_id']:<16}{'-':>8}  {alt['rejected']}")
        else:
            parts = ", ".join(f"{k} {v:g}" for k, v in sorted(alt["parts"].items()))
            print(f"  {alt['cluster_id']:<16}{alt['total']:>8.3f}  {parts}")


def cmd_explain(args: argparse.Namespace, settings: Settings) -> int:
    from fleetline.processors.scheduling.runtime import decisions_of

    topics = Topics(args.topic_prefix)
    job = _job_or_fail(settings, topics, args.job)
    latest = job.get("explanation")
    print(f"{job['key']} is {job['phase']}"
          + (f": {job['conditions']['Placed']['reason']}" if job["phase"] == "Queued"
             and "Placed" in job["conditions"] else ""))
    if args.history:
        print("\nEvery decision about it:")
        for decision in decisions_of(settings.kafka, topics, args.job):
            _print_decision(decision)
        return 0
    if latest is None:
        print("no decision yet")
        return 0
    print("\nThe latest decision:")
    _print_decision(latest)
    _print_alternatives(latest["alternatives"])
    offsets = ", ".join(f"{o['topic']}[{o['partition']}]@{o['offset']}"
                        for o in latest["view_offsets"])
    print(f"\n  decided on the resource view at {offsets or '(empty view)'}")
    return 0


def _pairs(items: list[str] | None, what: str) -> dict[str, int]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not value.isdigit():
            raise ConfigError(f"{what} wants CLUSTER=GPUS, got {item!r}")
        out[key] = int(value)
    return out


def cmd_quota(args: argparse.Namespace, settings: Settings) -> int:
    from fleetline.processors.scheduling.codec import canonical_json, new_request
    from fleetline.processors.scheduling.runtime import submit
    from fleetline.processors.scheduling.tenancy import TenantPolicy

    policy = {"tenant": args.tenant, "share": args.share,
              "reserved": _pairs(args.reserve, "--reserve"),
              "quota": {"gpus": args.gpus, "cluster_gpus": _pairs(args.cluster_gpus,
                                                                  "--cluster-gpus"),
                        "gpu_hours": args.gpu_hours, "storage_bytes": args.storage,
                        "bandwidth_gbps": args.bandwidth_gbps}}
    try:
        TenantPolicy.from_data(policy)  # refuse here what the scheduler would dead-letter
    except FleetlineError as exc:
        raise ConfigError(str(exc)) from None
    topics = Topics(args.topic_prefix)
    request = new_request("TENANT_POLICY", args.tenant, args.tenant, _now_ms(),
                          uuid.uuid4().hex, actor=args.actor, spec_json=canonical_json(policy))
    (offset,) = submit(settings.kafka, topics, [request])
    _audit(settings, topics, args.actor, "tenant.policy", [args.tenant],
           [request["request_id"]], tenant=args.tenant)
    print(f"tenant {args.tenant}: policy set (request {offset}): {canonical_json(policy)}")
    return 0


def register(sub: Any) -> None:
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--topic-prefix", default="fleetline")

    apply = sub.add_parser(
        "apply", help="submit TrainingJob / InferenceService / Dataset specs to the scheduler",
        description="Validates every document (exit 1 with each bad field named), then appends "
                    "the desired state to the scheduler's request log. The scheduler runs in "
                    "`fleetline serve`.")
    apply.add_argument("-f", "--file", required=True, help="a spec file, or - for stdin")
    apply.add_argument("--wait", type=float, metavar="SECONDS",
                       help="wait up to this long for each spec to be placed, accepted or "
                            "rejected, then print the latest decision about it (a job still "
                            "queued shows why); exit 3 if one has no decision at all")
    apply.add_argument("--actor", default="cli", help="who is applying (for the audit log)")
    common(apply)
    apply.set_defaults(func=cmd_apply)

    delete = sub.add_parser("delete", help="delete jobs (TENANT/NAME), datasets "
                            "(dataset:TENANT/NAME), or what a spec file declares")
    delete.add_argument("jobs", nargs="*")
    delete.add_argument("-f", "--file")
    delete.add_argument("--actor", default="cli")
    common(delete)
    delete.set_defaults(func=cmd_delete)

    get = sub.add_parser("get", help="list jobs, datasets or tenants as the scheduler holds them")
    get.add_argument("what", choices=["jobs", "datasets", "tenants"])
    get.add_argument("--tenant")
    get.add_argument("--all", action="store_true", help="jobs: include deleted ones")
    get.add_argument("--json", action="store_true")
    common(get)
    get.set_defaults(func=cmd_get)

    describe = sub.add_parser("describe", help="one job: phase, conditions, GPUs")
    describe.add_argument("job", help="TENANT/NAME")
    describe.add_argument("--json", action="store_true")
    common(describe)
    describe.set_defaults(func=cmd_describe)

    explain = sub.add_parser(
        "explain", help="why a job is where it is, or why it is waiting",
        description="Prints the latest decision about the job: its reason, where it placed the "
                    "job, every cluster's score or the reason it was ruled out, the view "
                    "version and offsets it read and the policy digest. --history lists every "
                    "decision about the job from the decision log.")
    explain.add_argument("job", help="TENANT/NAME")
    explain.add_argument("--history", action="store_true")
    common(explain)
    explain.set_defaults(func=cmd_explain)

    quota = sub.add_parser("quota", help="set a tenant's quotas, reservations and fair share")
    quota.add_argument("action", choices=["set"])
    quota.add_argument("tenant")
    quota.add_argument("--gpus", type=int, help="GPUs held at once, fleet-wide")
    quota.add_argument("--cluster-gpus", action="append", metavar="CLUSTER=GPUS")
    quota.add_argument("--gpu-hours", type=float,
                       help="budget; a training job reserves GPUs x its max runtime")
    quota.add_argument("--storage", help="dataset bytes x replicas, e.g. 500TB")
    quota.add_argument("--bandwidth-gbps", type=float,
                       help="cross-cluster dataset moves at once")
    quota.add_argument("--reserve", action="append", metavar="CLUSTER=GPUS",
                       help="GPUs held back for this tenant in a cluster")
    quota.add_argument("--share", type=float, default=1.0, help="fair-share weight")
    quota.add_argument("--actor", default="cli")
    common(quota)
    quota.set_defaults(func=cmd_quota)
