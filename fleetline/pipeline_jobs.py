"""The slice's scheduling act: tenants, a dataset, jobs and a service submitted while the fleet
runs; a critical job that preempts; a node that dies under a job; then the decision log replayed
and compared byte for byte. `pipeline.run_slice` calls these at the right intervals."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fleetline.config import Settings
from fleetline.processors.replay import ViewFollower
from fleetline.processors.scheduling.codec import (
    canonical_json,
    datasets_first,
    new_request,
    submit_request,
)
from fleetline.processors.scheduling.runtime import (
    DecisionFollower,
    SchedulerService,
    decisions_of,
    replay_decisions,
    submit,
)
from fleetline.processors.scheduling.scheduler import spec_key
from fleetline.processors.scheduling.specs import parse_spec
from fleetline.storage.snapshots import ViewSnapshots
from fleetline.streams.topics import Topics


def _training(name: str, tenant: str, workers: int, per_worker: int, priority: str,
              accelerator: str = "H100", **extra: Any) -> dict[str, Any]:
    tensor = min(per_worker, 8)
    return {"apiVersion": "fleetline/v1", "kind": "TrainingJob",
            "metadata": {"name": name, "tenant": tenant},
            "spec": {"accelerator": accelerator, "gpus_per_worker": per_worker,
                     "workers": workers, "parallelism": {"tensor": tensor, "pipeline": 1},
                     "communication": "heavy", "priority_class": priority,
                     "checkpoint_interval_s": 60, **extra}}


def first_wave(clusters: list[str]) -> list[dict[str, Any]]:
    """What the tenants submit once the fleet is up."""
    data_home = clusters[0]
    docs: list[dict[str, Any]] = [
        {"apiVersion": "fleetline/v1", "kind": "Dataset",
         "metadata": {"name": "web-corpus", "tenant": "acme"},
         "spec": {"size": "20TB", "replicas": [data_home]}},
        _training("pretrain", "acme", 2, 8, "low", dataset="web-corpus"),
        _training("pretrain-b", "acme", 1, 8, "normal", dataset="web-corpus"),
        {"apiVersion": "fleetline/v1", "kind": "InferenceService",
         "metadata": {"name": "chat", "tenant": "acme"},
         "spec": {"model": "llama-70b", "accelerator": "H100", "gpus_per_replica": 2,
                  "replicas": {"min": 2, "max": 4}, "latency_target_ms": 150,
                  "regions": ["eu-west", "us-east"]}},
        _training("finetune", "globex", 1, 4, "normal"),
        _training("embed", "globex", 2, 8, "normal", accelerator="H200"),
    ]
    docs += [_training(f"sweep-{i}", "globex", 1, 8, "low") for i in range(4)]
    return docs


def submit_documents(settings: Settings, topics: Topics, documents: list[dict[str, Any]],
                     actor: str = "fleetline-run") -> list[int]:
    specs = [parse_spec(d) for d in documents]
    return submit(settings.kafka, topics, [
        submit_request(spec, doc, int(time.time() * 1000), uuid.uuid4().hex, actor)
        for spec, doc in datasets_first(specs, documents)])


def set_tenants(settings: Settings, topics: Topics) -> None:
    policies = [{"tenant": "acme", "quota": {"gpus": 64, "storage_bytes": "100TB"}},
                {"tenant": "globex", "quota": {"gpus": 48}, "share": 1}]
    submit(settings.kafka, topics, [
        new_request("TENANT_POLICY", p["tenant"], p["tenant"], int(time.time() * 1000),
                    uuid.uuid4().hex, actor="fleetline-run", spec_json=canonical_json(p))
        for p in policies])


def urgent() -> list[dict[str, Any]]:
    return [_training("urgent", "ops", 2, 8, "critical")]


def settle(settings: Settings, topics: Topics, scheduler: SchedulerService, view: Any,
           keys: set[str], timeout_s: float = 60.0) -> None:
    """Wait until every key has a decision and the view has folded the allocations the
    scheduler holds (its own records reach the view through the log, a moment later)."""
    from fleetline.processors.view import read as view_read

    deadline = time.monotonic() + timeout_s
    decided: set[str] = set()
    follower = DecisionFollower(settings.kafka, topics)
    try:
        while time.monotonic() < deadline:
            decided |= {d["job"] for d in follower.poll(0.2)}
            held = {j["key"]: sum(bin(m).count("1") for n in j["allocation"].values()
                                  for m in n.values()) for j in scheduler.jobs()}
            seen = {a["job_id"]: len(a["gpus"]) for a in view.read(view_read.allocations)}
            if keys <= decided and {k: v for k, v in held.items() if v} == seen:
                return
    finally:
        follower.close()
    raise TimeoutError(f"the scheduler did not settle within {timeout_s:.0f}s")


def keys_of(documents: list[dict[str, Any]]) -> set[str]:
    return {spec_key(parse_spec(d)) for d in documents}


def summarize(settings: Settings, topics: Topics, scheduler: SchedulerService,
              snapshots: ViewSnapshots) -> dict[str, Any]:
    """Every decision, each job's phase, why the last queued job waits, and a replay of the
    request log checked against the decisions byte for byte."""
    decisions = decisions_of(settings.kafka, topics)
    jobs = scheduler.jobs()
    waiting = next((j for j in reversed(jobs) if j["phase"] == "Queued"), None)
    follower = ViewFollower(settings.kafka, topics, snapshots)
    try:
        replayed = replay_decisions(settings.kafka, topics, follower.at)
    finally:
        follower.close()
    return {
        "decisions": [(d["decision_id"], d["job"], d["outcome"],
                       ",".join(p["cluster_id"] for p in d["placements"]) or "-", d["reason"])
                      for d in decisions],
        "jobs": [(j["key"], j["phase"], ",".join(sorted(j["allocation"])) or "-",
                  sum(bin(m).count("1") for n in j["allocation"].values() for m in n.values()))
                 for j in jobs],
        "waiting": None if waiting is None else waiting.get("explanation"),
        "replay": {"ok": replayed.ok, "requests": replayed.requests, "ticks": replayed.ticks,
                   "matched": replayed.matched, "decisions": replayed.decisions,
                   "first_difference": replayed.first_difference,
                   "seconds": round(replayed.seconds, 2)},
    }


def ready_queries(settings: Settings, client: Any, sinks: list[Any], decisions: int,
                  since_ms: int) -> dict[str, Any]:
    """Job wait times and utilisation by tenant from ClickHouse, once the decision sink holds
    every decision (the two ready queries the scheduler's tables make possible)."""
    from fleetline.storage.objects import ObjectStore
    from fleetline.storage.queries import ready_sql
    from fleetline.storage.tiers import TieredStore

    deadline = time.monotonic() + 30
    while sinks[0].stats.records < decisions and time.monotonic() < deadline:
        time.sleep(0.1)
    store = TieredStore(client, settings.clickhouse_database,
                        ObjectStore.from_settings(settings.s3), settings.s3)
    out = {}
    for name in ("job-wait-times", "utilisation-by-tenant"):
        result = client.query(store.tiered_sql(ready_sql(name, str(since_ms), None)))
        out[name] = (list(result.column_names), [list(r) for r in result.result_rows])
    return out
