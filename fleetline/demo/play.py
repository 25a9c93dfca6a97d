"""A scenario played on the real stack: simulated agents -> Kafka -> the services of
`fleetline serve` (built by the composition root) -> ClickHouse and S3; then what each stage
saw, a replay of the half-way view, a call of the API and a replay of every decision.

`fleetline run` prints the result (`demo/report.py`); the end-to-end tests assert on it.
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import ssl
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetline.agents.fleet import FleetAgent
from fleetline.agents.simulator import FleetSimulator
from fleetline.api.auth import AuthConfig, Authenticator, token_digest
from fleetline.app import Fleetline, Options, api_server, build
from fleetline.config import Settings
from fleetline.demo.cluster_story import (
    ClusterAgents,
    LabClusterAgents,
    follow_a_split_job,
    lose_a_cluster,
)
from fleetline.demo.prewarm_story import follow_a_prewarm, seed_dataset
from fleetline.demo.scenario import Scenario
from fleetline.demo.serving_story import serving_day
from fleetline.demo.verdict import SCRIPTED_API_CALLS, last_word
from fleetline.errors import FleetlineError, StoryStalled, StreamError
from fleetline.infra import ca as deployment_ca
from fleetline.infra.lab import Lab
from fleetline.processors.audit.chain import export_entry, verify
from fleetline.processors.audit.runtime import KafkaAuditEmitter, published_decisions
from fleetline.processors.audit.sources import unaudited_decisions
from fleetline.processors.decision_replay import replay_decisions
from fleetline.processors.replay import ViewFollower, offsets_at, rebuild
from fleetline.processors.scheduling.client import (
    DecisionFollower,
    decisions_of,
    submit,
    submit_specs,
)
from fleetline.processors.scheduling.codec import (
    canonical_json,
    new_request,
)
from fleetline.processors.scheduling.specs import parse_spec
from fleetline.processors.scheduling.state import spec_key
from fleetline.processors.view import read as view_read
from fleetline.processors.view.runtime import declare_clusters
from fleetline.storage.queries import ready_sql, trace_sql
from fleetline.storage.tiering.macros import expander
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import CLUSTER_AGENT, CONTROL_PLANE, NODE_AGENT, ROUTER, Topics


@dataclass
class SliceResult:
    telemetry_sent: int
    states_sent: int
    malformed_sent: int
    clusters: list[dict[str, Any]]
    unhealthy_gpus: list[dict[str, Any]]
    half_way_clusters: list[dict[str, Any]]
    half_way_replay: dict[str, Any]
    processor_dead_letters: int
    sink_rows: int
    sink_dead_letters: int
    query_rows: list[tuple[Any, ...]]
    snapshots: list[str]
    api_calls: list[tuple[str, int]]
    audit: dict[str, Any]
    scheduling: dict[str, Any] = field(default_factory=dict)
    cluster_story: dict[str, Any] = field(default_factory=dict)
    split_story: dict[str, Any] = field(default_factory=dict)
    prewarm_story: dict[str, Any] = field(default_factory=dict)
    serving_day: dict[str, Any] = field(default_factory=dict)
    # The postmortem of the run's own window (`fleetline postmortem`), as written.
    postmortem: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


def demo_options(topics: Topics) -> Options:
    """`serve`'s services, tuned for a run of seconds: frequent snapshots and ticks, a digest
    every 10 audit links, and the data mover carrying out prewarms."""
    return Options(
        topics=topics,
        snapshot_interval_s=5.0,
        tick_interval_s=0.5,
        audit_digest_every=10,
        data_mover=True,
    )


def _now_ms() -> int:
    return int(time.time() * 1000)


def set_policies(
    settings: Settings,
    topics: Topics,
    policies: Sequence[Mapping[str, Any]],
    actor: str = "fleetline-run",
) -> list[int]:
    return submit(
        settings.kafka,
        topics,
        [
            new_request(
                "TENANT_POLICY",
                str(p["tenant"]),
                str(p["tenant"]),
                _now_ms(),
                uuid.uuid4().hex,
                actor=actor,
                spec_json=canonical_json(dict(p)),
            )
            for p in policies
        ],
    )


def settle(fleet: Fleetline, keys: set[str], timeout_s: float = 60.0) -> None:
    """Wait until every key has a decision and the view has folded the allocations the
    scheduler holds (its own records reach the view through the log, a moment later)."""
    assert fleet.scheduler is not None
    deadline = time.monotonic() + timeout_s
    decided: set[str] = set()
    follower = DecisionFollower(fleet.settings.kafka, fleet.topics)
    try:
        while time.monotonic() < deadline:
            fleet.raise_errors()
            decided |= {d["job"] for d in follower.poll(0.2)}
            held = {j["key"]: _gpus(j) for j in fleet.scheduler.jobs()}
            seen = {a["job_id"]: len(a["gpus"]) for a in fleet.view.read(view_read.allocations)}
            if keys <= decided and {k: v for k, v in held.items() if v} == seen:
                return
    finally:
        follower.close()
    raise StreamError(f"the scheduler did not settle within {timeout_s:.0f}s")


def _gpus(job: Mapping[str, Any]) -> int:
    return sum(
        bin(mask).count("1") for nodes in job["allocation"].values() for mask in nodes.values()
    )


def wait_drained(
    fleet: Fleetline, processed: int, telemetry: int, timeout_s: float = 120.0
) -> None:
    """Until the view has handled `processed` messages and the sample sink `telemetry`."""
    deadline = time.monotonic() + timeout_s
    view, sink = fleet.view.loop.stats, fleet.samples.stats
    while time.monotonic() < deadline:
        fleet.raise_errors()
        if view.messages >= processed and sink.messages >= telemetry:
            return
        time.sleep(0.1)
    raise StreamError(
        f"timed out: the view handled {view.messages}/{processed}, the sample "
        f"sink {sink.messages}/{telemetry} messages"
    )


def call_api(fleet: Fleetline) -> list[tuple[str, int]]:
    """Serve the HTTP API over TLS (a certificate from the deployment CA this run keeps in its
    cache) on a loopback port for a moment and call it as a tenant's viewer would, plus two
    calls that must be refused; every call lands in the audit log."""
    token = "fl_" + secrets.token_urlsafe(24)
    auth = Authenticator(
        AuthConfig.from_data(
            {
                "tokens": [
                    {
                        "name": "viewer@acme",
                        "sha256": token_digest(token),
                        "role": "viewer",
                        "tenant": "acme",
                    }
                ]
            }
        )
    )
    emitter = KafkaAuditEmitter(fleet.settings.kafka, fleet.topics)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    issued = deployment_ca.deployment_identity(
        fleet.settings.deployment_ca_path(), "api", ["127.0.0.1"]
    )
    tls = ssl.create_default_context(cafile=str(issued.ca))
    server = api_server(
        fleet.api(auth, emitter), "127.0.0.1", port, str(issued.cert), str(issued.key)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    calls = []
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        for path, caller, _ in SCRIPTED_API_CALLS:
            bearer = token if caller == "viewer" else "fl_guess"
            request = urllib.request.Request(
                f"https://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {bearer}"}
            )
            try:
                with urllib.request.urlopen(request, timeout=10, context=tls) as response:
                    json.loads(response.read())
                    calls.append((path, response.status))
            except urllib.error.HTTPError as exc:
                calls.append((path, exc.code))
    finally:
        server.should_exit = True
        thread.join(10)
        emitter.flush()
    return calls


def verify_audit(fleet: Fleetline, events: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait for `events` audit events in ClickHouse, then verify the whole chain there."""
    assert fleet.audit_table is not None and fleet.signer is not None
    keys = {fleet.signer.key_id: fleet.signer.private_key.public_key()}
    deadline = time.monotonic() + timeout_s
    records: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        records = list(fleet.audit_table.records(topic=fleet.topics.audit_log))
        if sum(1 for r in records if r["event"]) >= events:
            break
        time.sleep(0.2)
    report = verify([export_entry(r, reveal_sensitive=True) for r in records], keys)
    return {
        "links": report.checked,
        "digests": report.digests,
        "ok": report.ok,
        "first_broken": report.first_broken,
        "unsigned_tail": report.unsigned_tail,
        "key_id": fleet.signer.key_id,
    }


UTILISATION_QUERY = """
SELECT cluster_id, count() AS samples, uniqExact(node_id) AS nodes,
       round(avg(toFloat64(gpu_util_pct)), 2) AS avg_util_pct,
       round(toFloat64(max(power_w)), 1) AS max_power_w
FROM {db:Identifier}.gpu_samples
WHERE ts >= fromUnixTimestamp64Milli({start_ms:Int64}, 'UTC')
GROUP BY cluster_id ORDER BY cluster_id
"""


def audited_decisions(fleet: Fleetline, timeout_s: float = 60.0) -> dict[str, Any]:
    """Whether every decision on its topic is in the audit chain (ClickHouse's copy) with the
    digest of its exact bytes, waiting for the linker and the chainer to catch up."""
    assert fleet.audit_table is not None
    published = {
        record["decision_id"]: digest
        for record, digest in published_decisions(fleet.settings.kafka, fleet.topics)
    }
    deadline = time.monotonic() + timeout_s
    while True:
        events = [
            r["event"]
            for r in fleet.audit_table.records(topic=fleet.topics.audit_log)
            if r["event"]
        ]
        missing, changed = unaudited_decisions(events, published)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    return {"decisions": len(published), "missing": missing, "changed": changed}


def scheduling_summary(fleet: Fleetline) -> dict[str, Any]:
    """Every decision, each job's phase, why the last queued job waits, and a replay of the
    request log checked against the decisions byte for byte."""
    assert fleet.scheduler is not None
    settings, topics = fleet.settings, fleet.topics
    decisions = decisions_of(settings.kafka, topics)
    jobs = fleet.scheduler.jobs()
    waiting = next((j for j in reversed(jobs) if j["phase"] == "Queued"), None)
    follower = ViewFollower(settings.kafka, topics, fleet.snapshots)
    try:
        replayed = replay_decisions(settings.kafka, topics, follower.facts)
    finally:
        follower.close()
    return {
        "decisions": [
            (
                d["decision_id"],
                d["job"],
                d["outcome"],
                ",".join(p["cluster_id"] for p in d["placements"]) or "-",
                d["reason"],
            )
            for d in decisions
        ],
        "jobs": [
            (j["key"], j["phase"], ",".join(sorted(j["allocation"])) or "-", _gpus(j)) for j in jobs
        ],
        # The jobs that ended Failed, each with its last failure (the phases are in "jobs").
        "failures": {j["key"]: last_word(j) for j in jobs if j["phase"] == "Failed"},
        "waiting": None if waiting is None else waiting.get("explanation"),
        "replay": {
            "ok": replayed.ok,
            "requests": replayed.requests,
            "ticks": replayed.ticks,
            "matched": replayed.matched,
            "decisions": replayed.decisions,
            "first_difference": replayed.first_difference,
            "seconds": round(replayed.seconds, 2),
        },
    }


def ready_queries(fleet: Fleetline, decisions: int, since_ms: int) -> dict[str, Any]:
    """Job wait times and utilisation by tenant from ClickHouse, once the decision sink holds
    every decision (the two ready queries the scheduler's tables make possible)."""
    from fleetline.storage.sinks import RecordSink

    step = fleet.sinks["decisions"].step
    assert isinstance(step, RecordSink)
    deadline = time.monotonic() + 30
    while step.stats.records < decisions and time.monotonic() < deadline:
        time.sleep(0.1)
    expand = expander(fleet.settings)
    out = {}
    for name in ("job-wait-times", "utilisation-by-tenant"):
        sql = expand(fleet.clickhouse, ready_sql(name, str(since_ms), None))
        result = fleet.clickhouse.query(sql)
        out[name] = (list(result.column_names), [list(r) for r in result.result_rows])
    return out


def job_trace(fleet: Fleetline, key: str, clusters: int, timeout_s: float = 20.0) -> dict[str, Any]:
    """The trace of a job's submission as ClickHouse holds it (what `fleetline trace` prints),
    once its rows from `clusters` clusters have been sunk."""
    from fleetline.processors.scheduling.state import Job

    job = _job(fleet, key)
    assert job is not None
    trace_id = Job.from_data(job).trace_id
    sql = expander(fleet.settings)(fleet.clickhouse, trace_sql(trace_id))
    deadline = time.monotonic() + timeout_s
    while True:
        rows = [list(r) for r in fleet.clickhouse.query(sql).result_rows]
        seen = sorted({r[2] for r in rows if r[2] and "," not in r[2]})
        if len(seen) >= clusters or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    span_s = (rows[-1][0] - rows[0][0]) / 1000 if rows else 0.0
    return {"trace_id": trace_id, "hops": len(rows), "clusters": seen, "span_s": span_s}


def story_part(
    progress: Callable[[str], None], part: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """Play one part of the story; one that stops on an error it names is kept as
    `{"failed": why}`, so the run goes on to its summary and says which step did not happen
    (an error of the services themselves still ends the run)."""
    try:
        return part()
    except StoryStalled as exc:
        progress(f"this part of the story stopped: {exc}")
        return {"failed": str(exc)}


def _fault_note(kind: str, target: str, value: float) -> str:
    return {
        "node_down": f"{target} went DOWN",
        "rdma_loss": f"leaf switch {target} drops {value:.0%} of RDMA packets",
        "xid": f"GPU {target} raised XID {value:g}",
        "ecc_dbe": f"GPU {target} had a double-bit ECC error",
        "nvlink_errors": f"GPU {target}'s NVLink errors rise by {value:g} an interval",
        "cluster_link_loss": f"cluster {target} lost its link to the control plane",
    }[kind]


def play(
    settings: Settings,
    scenario: Scenario,
    *,
    start_ms: int,
    realtime: bool,
    topics: Topics | None = None,
    progress: Callable[[str], None] = lambda line: None,
    lab: Lab | None = None,
    authority: Path | None = None,
) -> SliceResult:
    """Run the scenario for its intervals of event time and return what every stage saw. With a
    `lab`, each cluster's agent (and so its workloads) runs on its cluster's host in the lab,
    and the cluster is lost by a real cut of its links. With the deployment CA's directory
    (`authority`) and the settings' TLS from it, each cluster's agent gets its own certificate
    (see ClusterAgents)."""
    topics = topics or Topics()
    interval = scenario.interval_ms
    timings: dict[str, float] = {}
    began = time.monotonic()
    wall_began_ms = _now_ms()
    # On a secured broker each process signs in as its kind; the story itself (declarations,
    # submissions, reads) acts as the control plane.
    kinds, settings = settings, settings.as_kind(CONTROL_PLANE)
    fleet = build(settings, demo_options(topics)).start()
    # One cluster agent per cluster: the training jobs run as processes, reported back.
    cluster_ids = [c.spec.cluster_id for c in scenario.clusters]
    agents = (
        LabClusterAgents(kinds.as_kind(CLUSTER_AGENT), topics, cluster_ids, lab, authority)
        if lab is not None
        else ClusterAgents(
            kinds.as_kind(CLUSTER_AGENT),
            topics,
            cluster_ids,
            authority=authority,
            slurm_nodes={
                c.spec.cluster_id: c.spec.nodes for c in scenario.clusters if c.manager == "slurm"
            },
            kubernetes_nodes={
                c.spec.cluster_id: c.spec.nodes
                for c in scenario.clusters
                if c.manager == "kubernetes"
            },
        )
    )
    agents.start()
    timings["pipeline_start_s"] = time.monotonic() - began
    simulator = FleetSimulator(
        [p.spec for p in scenario.clusters], seed=scenario.seed, interval_ms=interval
    )
    for fault in scenario.faults_in(simulator, start_ms):
        simulator.add_fault(fault)
    state_dir = Path(tempfile.mkdtemp(prefix="fleetline-agents-"))
    codec = default_codec()
    nodes = kinds.as_kind(NODE_AGENT)
    agent = FleetAgent.create(nodes, codec, topics, simulator, state_dir, commands=False)
    injector = kafka_clients.producer(nodes.kafka)  # a node agent gone wrong
    events = {scenario.tick_of(e.at): e for e in scenario.events}
    half = scenario.ticks // 2
    try:
        began = time.monotonic()
        # The operators' declarations, as `fleetline apply -f clusters.yaml` makes them.
        declare_clusters(
            settings.kafka, topics, [c.record(1, start_ms) for c in scenario.cluster_documents()]
        )
        states = agent.start(start_ms)
        telemetry = malformed = 0
        submitted: set[str] = set()
        half_way_ms = 0
        for tick in range(1, scenario.ticks + 1):
            ts = start_ms + tick * interval
            sent = agent.tick(ts)
            states += sent["states"]
            telemetry += sent["telemetry"]
            for fault in simulator.faults:
                if fault.start_ms == ts:
                    progress(
                        f"t+{tick * interval / 1000:.0f}s: "
                        + _fault_note(fault.kind, fault.target, fault.value)
                    )
            event = events.get(tick)
            if event is not None:
                for bad in event.malformed:
                    topic = getattr(topics, str(bad.get("topic", "telemetry")))
                    injector.produce(
                        topic,
                        key=str(bad.get("key", "")).encode(),
                        value=str(bad.get("value", "")).encode("latin-1"),
                    )
                    malformed += 1
                injector.flush(30)
                if event.tenant_policies:
                    set_policies(settings, topics, event.tenant_policies)
                if event.apply:
                    for document in event.apply:
                        if document.get("kind") == "Dataset":
                            seed_dataset(settings, document)
                    submit_specs(settings.kafka, topics, event.apply, "fleetline-run", _now_ms())
                    submitted |= {spec_key(parse_spec(d)) for d in event.apply}
                if event.note:
                    progress(f"t+{tick * interval / 1000:.0f}s: {event.note}")
            if tick == half:
                agent.flush()
                half_way_ms = _now_ms()
                time.sleep(0.01)  # the next append is stamped after this moment
            if realtime:
                time.sleep(interval / 1000)
                if tick % 5 == 0:
                    progress(_view_line(fleet.view.read(view_read.cluster_capacity)))
        agent.flush()
        injector.flush(30)
        timings["produce_s"] = time.monotonic() - began
        began = time.monotonic()
        telemetry_malformed = sum(
            1
            for e in scenario.events
            for bad in e.malformed
            if bad.get("topic", "telemetry") == "telemetry"
        )
        wait_drained(
            fleet,
            processed=states + telemetry + malformed + len(scenario.clusters),
            telemetry=telemetry + telemetry_malformed,
        )
        settle(fleet, submitted)
        timings["drain_s"] = time.monotonic() - began
        story: dict[str, Any] = {}
        lost_job, split_job, prewarm = (
            scenario.lose_cluster_of,
            scenario.split_job,
            scenario.prewarm,
        )
        if lost_job:
            began = time.monotonic()
            story = story_part(
                progress,
                lambda: lose_a_cluster(
                    agents,
                    lost_job,
                    _workload_of(scenario, lost_job),
                    lambda key: _job(fleet, key),
                    progress,
                ),
            )
            timings["cluster_story_s"] = time.monotonic() - began
            if "failed" not in story:
                clusters = len(set(story["ran_in"]))
                story["trace"] = job_trace(fleet, lost_job, clusters)
        split: dict[str, Any] = {}
        if split_job:
            began = time.monotonic()
            split = story_part(
                progress,
                lambda: follow_a_split_job(
                    agents,
                    split_job,
                    _workload_of(scenario, split_job),
                    lambda key: _job(fleet, key),
                    progress,
                ),
            )
            timings["split_story_s"] = time.monotonic() - began
        prewarmed: dict[str, Any] = {}
        if prewarm:
            began = time.monotonic()
            if prewarm.get("tenant_policies"):
                set_policies(settings, topics, list(prewarm["tenant_policies"]))
            prewarmed = story_part(
                progress,
                lambda: follow_a_prewarm(
                    settings,
                    topics,
                    fleet.mover,
                    prewarm,
                    cluster_ids,
                    lambda key: _job(fleet, key),
                    progress,
                ),
            )
            timings["prewarm_story_s"] = time.monotonic() - began
        serving: dict[str, Any] = {}
        day = scenario.serving_day
        if day:
            began = time.monotonic()
            serving = story_part(
                progress,
                lambda: serving_day(fleet, settings, topics, day, progress, kinds.as_kind(ROUTER)),
            )
            timings["serving_day_s"] = time.monotonic() - began
        now = fleet.view.read(view_read.cluster_capacity)
        unhealthy = fleet.view.read(
            lambda v: [g for g in view_read.select_gpus(v) if g["health"] != "healthy"]
        )
        rows = fleet.clickhouse.query(
            UTILISATION_QUERY, parameters={"db": settings.clickhouse_database, "start_ms": start_ms}
        ).result_rows
        fleet.view.snapshot()
        snapshots = fleet.snapshots
        keys = [
            info.blob_key for part in sorted(fleet.view.parts) for info in snapshots.list(part)[-1:]
        ]
        # Time travel: the view as it stood half-way, from the newest snapshots before that
        # moment plus the log after them.
        began = time.monotonic()
        replayed = rebuild(
            settings.kafka, topics, offsets_at(settings.kafka, topics, half_way_ms), snapshots
        )
        timings["replay_s"] = time.monotonic() - began
        api_calls = call_api(fleet)
        audit = verify_audit(fleet, len(api_calls))
        began = time.monotonic()
        scheduling = scheduling_summary(fleet)
        scheduling["ready_queries"] = ready_queries(fleet, len(scheduling["decisions"]), start_ms)
        timings["decision_replay_s"] = time.monotonic() - began
        scheduling["operations"] = operations_summary(fleet)
        scheduling["audited"] = audited_decisions(fleet)
        began = time.monotonic()
        incident = story_part(
            progress, lambda: write_postmortem(fleet, min(start_ms, wall_began_ms), topics)
        )
        timings["postmortem_s"] = time.monotonic() - began
    finally:
        agents.close()
        agent.close()
        shutil.rmtree(state_dir, ignore_errors=True)
        fleet.close()
    return SliceResult(
        telemetry_sent=telemetry,
        states_sent=states,
        malformed_sent=malformed,
        clusters=now,
        unhealthy_gpus=unhealthy,
        half_way_clusters=view_read.cluster_capacity(replayed.view),
        half_way_replay={
            "at_ms": half_way_ms,
            "folded": replayed.folded,
            "from_snapshots": replayed.snapshot_positions,
            "view_version": replayed.view.version,
        },
        processor_dead_letters=fleet.view.loop.stats.dead_letters,
        sink_rows=fleet.sample_sink.stats.rows,
        sink_dead_letters=fleet.sample_sink.stats.dead_letters,
        query_rows=[tuple(row) for row in rows],
        snapshots=[f"s3://{settings.s3.bucket}/{key}" for key in keys],
        api_calls=api_calls,
        audit=audit,
        scheduling=scheduling,
        cluster_story=story,
        split_story=split,
        prewarm_story=prewarmed,
        serving_day=serving,
        postmortem=incident,
        timings=timings,
    )


def write_postmortem(fleet: Fleetline, from_ms: int, topics: Topics) -> dict[str, Any]:
    """The run's own incident report (`fleetline postmortem` over its window, the whole
    fleet), written under .cache/postmortem/; what it found, and where it lies."""
    from fleetline.processors.postmortem.files import write
    from fleetline.processors.postmortem.report import Scope

    try:
        report = fleet.postmortem(from_ms, _now_ms() + 1000, Scope())
    except StreamError:
        raise  # the services' own failure ends the run
    except FleetlineError as exc:
        raise StoryStalled(f"the postmortem could not be written: {exc}") from None
    out = fleet.settings.cache_dir / "postmortem" / topics.prefix
    files = write(report, out, f"Postmortem of fleetline run ({topics.prefix})")
    return {"report": report, "files": {k: str(v) for k, v in files.items()}}


def operations_summary(fleet: Fleetline) -> dict[str, Any]:
    """What automated operations did during the run: its repair tickets and power caps."""
    if fleet.operations is None:
        return {}
    fold = fleet.operations.fold()
    return {
        "tickets": [
            (t.ticket_id, t.node_id, t.rule, t.state.value, t.summary)
            for t in sorted(fold.tickets.values(), key=lambda t: (t.opened_ms, t.ticket_id))
        ],
        "capped_nodes": sorted(n for n, node in fold.nodes.items() if node.capped),
    }


def _job(fleet: Fleetline, key: str) -> dict[str, Any] | None:
    assert fleet.scheduler is not None
    job = fleet.scheduler.store.committed(0, f"job:{key}".encode())
    return job if isinstance(job, dict) else None


def _workload_of(scenario: Scenario, key: str) -> dict[str, Any]:
    """The workload section of the scenario's job `key` (tenant/name)."""
    for event in scenario.events:
        for document in event.apply:
            meta = document.get("metadata", {})
            if f"{meta.get('tenant')}/{meta.get('name')}" == key:
                return dict(document.get("spec", {}).get("workload") or {})
    raise StreamError(f"the scenario submits no job {key}")


def _view_line(clusters: list[dict[str, Any]]) -> str:
    return "  ".join(
        f"{c['cluster_id']}: {c['gpus']} GPUs, {c['idle']} idle, {c['degraded']} degraded, "
        f"{c['nodes_down']} nodes down"
        for c in clusters
    )
