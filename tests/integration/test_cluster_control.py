"""The cluster control layer on the real stack: the services of `fleetline serve` (view,
scheduler, cluster health), a simulated fleet of three one-node clusters, and one
`fleetline cluster-agent` process per cluster running real workload processes.

In order: a broken link between two clusters evicts neither; a failing start is retried then
reported Failed (and a flaky one succeeds on its second attempt); and a lost cluster's training job
resumes on another cluster from its last complete checkpoint and ends with parameters
bit-identical to a run never interrupted, while the copy left on the lost cluster is fenced
when the cluster comes back.

A cluster agent killed with SIGKILL and started again is tested in
tests/chaos/test_cluster_agent_kills.py, under a health policy that leaves a restart the
seconds it takes on a loaded host; here a cluster is lost after 4 s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from fleetline.agents.dataplane.prewarm import upload
from fleetline.agents.dataplane.shards import ordered_sum
from fleetline.agents.simulator import Fault
from fleetline.agents.workloads.train import (
    TrainConfig,
    flat,
    initial,
    local_data,
    local_round,
    unflat,
    workload_env,
)
from fleetline.app import Options
from fleetline.cli import main
from fleetline.config import Settings
from fleetline.demo.prewarm_story import dataset_objects
from fleetline.errors import ObjectMissing
from fleetline.processors.health.fold import ClusterHealthPolicy
from fleetline.processors.operations.runtime import append, ops_event
from fleetline.processors.scheduling.client import read_topic, submit
from fleetline.processors.scheduling.codec import new_request
from fleetline.processors.scheduling.specs import dataset_prefix
from fleetline.processors.view import read as view_read
from fleetline.storage.checkpoints import cluster_bucket, params_digest
from fleetline.storage.objects import ObjectStore
from tests.services import service_env, signed_in, submits
from tests.stack import Stack, now_ms, reference_run, running_stack, training
from tests.support import wait_until

pytestmark = pytest.mark.services
CLUSTERS = ("ca", "cb", "cc")
POLICY = ClusterHealthPolicy(
    suspect_after_ms=1_500, lost_after_ms=4_000, recover_after_ms=2_000, peer_report_fresh_ms=3_000
)


@pytest.fixture(scope="module")
def stack(services: Settings) -> Iterator[Stack]:
    options = Options(tick_interval_s=0.3, health_policy=POLICY, clock_interval_s=0.25)
    # cc has two nodes: a job of two workers fits it (one worker a node), and no other cluster.
    with running_stack(
        services, CLUSTERS, options, "cluster-control", cluster_nodes={"cc": 2}
    ) as built:
        yield built


def test_one_broken_link_between_two_clusters_evicts_neither(stack):
    stack.chaos("ca").write_text("cb\n")
    stack.chaos("cb").write_text("ca\n")
    wait_until(
        lambda: any(h["event"] == "PARTITION" and not h["link_up"] for h in stack.health()),
        30,
        "the broken link to be seen",
    )
    seen = min(h["ts"] for h in stack.health() if h["event"] == "PARTITION" and not h["link_up"])
    # Not a sleep: the fold has folded the clock past the moment a loss would be declared.
    stack.health_past(seen + POLICY.lost_after_ms + 1_000)
    health = stack.health()
    assert not [h for h in health if h["event"] in ("CLUSTER_DOWN", "FENCE")]
    latest = {h["cluster_id"]: h["state"] for h in health}
    assert latest == dict.fromkeys(CLUSTERS, "HEALTHY")
    broken = {(h["cluster_id"], h["peer"]) for h in health if h["event"] == "PARTITION"}
    assert {("ca", "cb"), ("cb", "ca")} <= broken
    stack.chaos("ca").write_text("")
    stack.chaos("cb").write_text("")
    wait_until(
        lambda: any(h["event"] == "PARTITION" and h["link_up"] for h in stack.health()),
        30,
        "the link to heal",
    )


def test_an_operator_cordons_a_whole_cluster_through_the_cli(stack, monkeypatch, capsys):
    for name, value in service_env(stack.settings).items():
        monkeypatch.setenv(name, value)
    prefix = ["--topic-prefix", stack.topics.prefix]
    # Through the API, as the signed-in caller: a tenant's admin may not, a platform admin may.
    signed_in(monkeypatch, stack.api_url, "ana")
    assert main(["cluster", "cordon", "cc", "--reason", "maintenance"]) == 77
    assert "role tenant-admin may not write fleet" in capsys.readouterr().err
    signed_in(monkeypatch, stack.api_url, "ops")
    assert main(["cluster", "cordon", "cc", "--reason", "maintenance"]) == 0

    def cordoned() -> dict[str, Any]:
        clusters = {c["cluster_id"]: c for c in stack.fleet.view.read(view_read.cluster_capacity)}
        return clusters["cc"]

    wait_until(lambda: cordoned()["health"] == "cordoned", 30, "cc to be cordoned in the view")
    assert "cordoned by ops: maintenance" in cordoned()["control"]["reason"]
    audit = stack.records(stack.topics.audit_requests, stack.topics.audit_partitions)
    # (Keyed by tenant: the refusal is on acme's partition, the cordon on the fleet's.)
    calls = {
        (a["operation"], a["actor"], a["outcome"])
        for a in audit
        if a["target"].endswith("/cc/cordon")
    }
    assert calls == {
        ("api.POST /v1/clusters/{cluster_id}/cordon", "ana", "DENIED"),
        ("api.POST /v1/clusters/{cluster_id}/cordon", "ops", "SUCCEEDED"),
    }
    capsys.readouterr()
    assert main(["cluster", "health", "--json", *prefix]) == 0
    health = json.loads(capsys.readouterr().out)
    assert health["clusters"]["cc"]["cordoned"] is True
    assert main(["cluster", "uncordon", "cc"]) == 0
    wait_until(lambda: cordoned()["health"] == "healthy", 30, "cc to take work again")


def test_one_apply_is_traced_from_the_cli_through_the_decision_to_the_workload(
    stack, monkeypatch, capsys
):
    """`fleetline apply` starts a trace; its id rides the request, the decision, the order and
    the workload events, lands beside each row in ClickHouse, and `fleetline trace` prints
    the chain with timings."""
    for name, value in service_env(stack.settings).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FLEETLINE_CLICKHOUSE_URL", stack.settings.clickhouse_url)
    monkeypatch.setenv("FLEETLINE_CLICKHOUSE_DATABASE", stack.settings.clickhouse_database)
    signed_in(monkeypatch, stack.api_url, "uma")
    spec = stack.state_dir / "traced.yaml"
    spec.write_text(json.dumps(training("traced", steps=20, checkpoint_every_steps=10)))
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    monkeypatch.setenv("TRACEPARENT", f"00-{trace_id}-b7ad6b7169203331-01")
    capsys.readouterr()
    assert main(["apply", "-f", str(spec)]) == 0
    assert f"trace {trace_id}" in capsys.readouterr().out
    wait_until(lambda: stack.phase("acme/traced") == "Succeeded", 90, "traced to finish")
    # The trace travels in the Kafka headers of what the submission caused.
    for topic in (stack.topics.decisions, stack.topics.orders, stack.topics.workloads):
        traced = [m for m in read_topic(stack.settings.kafka, topic) if m.key() == b"acme/traced"]
        assert traced and all(
            dict(m.headers() or [])["traceparent"].decode().split("-")[1] == trace_id
            for m in traced
        ), topic
    # Entered, decided, started (with the cluster agent's log line, shipped through the logs
    # topic; in the same millisecond as STARTING, after it by name), running.
    hops = ("POST /v1/jobs", "decision PLACED", "STARTING", "started acme/traced", "RUNNING")
    lines: list[str] = []

    def traced() -> bool:
        capsys.readouterr()
        code = main(["trace", trace_id, "--topic-prefix", stack.topics.prefix])
        lines[:] = capsys.readouterr().out.splitlines() if code == 0 else []
        return all(any(hop in line for line in lines) for hop in hops)

    wait_until(traced, 60, "every hop of the trace in ClickHouse", every_s=1.0)
    assert lines[0].startswith(f"trace {trace_id}:") and "across ca" in lines[0]
    order = [next(i for i, line in enumerate(lines) if word in line) for word in hops]
    assert order == sorted(order), "\n".join(lines)
    assert all(line.startswith("+") for line in lines[1:])


def test_a_cluster_agent_serves_prometheus_metrics(stack):
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(stack.metrics_url("ca"), timeout=10) as response:
        text = response.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    reserved = families["fleetline_cluster_agent_gpus_reserved"].samples
    assert [s.labels for s in reserved] == [{"cluster": "ca"}]
    assert "fleetline_cluster_agent_peer_reachable" in families
    assert "fleetline_cluster_agent_workloads" in families


def test_a_failing_start_is_retried_then_reported_failed(stack):
    python = sys.executable
    flaky = (
        'test "$FLEETLINE_ATTEMPT" -ge 2 || { echo not yet >&2; exit 3; }; '
        f"exec {python} -m fleetline.agents.workloads.train"
    )
    submit(
        stack.settings.kafka,
        stack.topics,
        submits(
            training(
                "crash",
                command=["sh", "-c", "echo boom: no such dataset >&2; exit 3"],
                retry={"max_attempts": 2, "backoff_s": 0.2},
            ),
            training(
                "flaky",
                command=["sh", "-c", flaky],
                steps=30,
                checkpoint_every_steps=10,
                retry={"max_attempts": 3, "backoff_s": 0.2, "exit_codes": [3]},
            ),
        ),
    )
    wait_until(
        lambda: stack.phase("acme/crash") == "Failed" and stack.phase("acme/flaky") == "Succeeded",
        90,
        "crash to fail and flaky to succeed",
    )
    crash = stack.job("acme/crash")
    assert crash is not None
    finished = crash["conditions"]["Finished"]["reason"]
    assert "attempt 2 failed with exit code 3" in finished and "boom" in finished
    assert "no retry left" in finished
    failed = [e for e in stack.events("acme/crash") if e["event"] == "FAILED"]
    assert [(e["attempt"], e["exit_code"]) for e in failed] == [(1, 3), (2, 3)]
    starts = [e["attempt"] for e in stack.events("acme/flaky") if e["event"] == "STARTING"]
    assert starts == [1, 2]
    isolation = next(e for e in stack.events("acme/flaky") if e["event"] == "STARTING")["detail"]
    cgroup_v2 = host_cgroup_v2()
    if cgroup_v2 is None:
        assert "not isolated: no cgroup v2 hierarchy is mounted" in isolation, isolation
    elif not can_create_group(cgroup_v2):
        assert "not isolated: cannot create" in isolation, isolation
    else:
        assert f"cgroup v2 {cgroup_v2}/fleetline/" in isolation, isolation


def host_cgroup_v2() -> str | None:
    """Where this host mounts cgroup v2, read from /proc/mounts here, not by the agent's code."""
    with open("/proc/mounts") as mounts:
        found = [line.split()[1] for line in mounts if line.split()[2:3] == ["cgroup2"]]
    return found[0] if found else None


def can_create_group(root: str) -> bool:
    probe = os.path.join(root, f"fleetline-probe-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    os.rmdir(probe)
    return True


def test_a_deleted_job_checkpoints_on_its_way_out(stack):
    submit(
        stack.settings.kafka,
        stack.topics,
        submits(training("doomed", steps=5000, checkpoint_every_steps=4000, step_delay_ms=10)),
    )
    key = "acme/doomed"
    wait_until(
        lambda: any(e["event"] == "PROGRESS" and e["step"] >= 50 for e in stack.events(key)),
        60,
        "doomed to make progress",
    )
    submit(
        stack.settings.kafka,
        stack.topics,
        [new_request("DELETE", key, "acme", now_ms(), uuid.uuid4().hex, actor="tester")],
    )
    wait_until(
        lambda: any(e["event"] == "STOPPED" for e in stack.events(key)), 60, "doomed to stop"
    )
    events = stack.events(key)
    final = [e for e in events if e["event"] == "CHECKPOINTED"]
    assert len(final) == 1 and 50 <= final[0]["step"] < 4000  # written on SIGTERM, not by period
    stopped = next(e for e in events if e["event"] == "STOPPED")
    assert "deleted by tester" in stopped["detail"]
    assert [e["exit_code"] for e in events if e["event"] == "EXITED"] == [0]
    assert stack.phase(key) == "Deleted"


def test_a_lost_cluster_s_job_resumes_elsewhere_bit_identical_and_its_copy_is_fenced(
    stack, tmp_path
):
    workload = {
        "steps": 600,
        "checkpoint_every_steps": 50,
        "report_every_steps": 10,
        "seed": 9,
        "step_delay_ms": 40,
    }
    submit(stack.settings.kafka, stack.topics, submits(training("pretrain", **workload)))
    key = "acme/pretrain"
    wait_until(
        lambda: any(e["event"] == "CHECKPOINTED" and e["step"] >= 100 for e in stack.events(key)),
        90,
        "two checkpoints in ca",
    )
    first = next(e for e in stack.events(key) if e["event"] == "STARTING")
    assert first["cluster_id"] == "ca"
    # ca goes dark: its cluster agent is killed (its workload runs on, cut off) and its node
    # agents lose their link to the control plane.
    stack.kill_agent("ca")
    cut_ms = now_ms()
    link_loss = Fault("cluster_link_loss", "ca", cut_ms)
    stack.simulator.add_fault(link_loss)
    wait_until(
        lambda: any(h["event"] == "CLUSTER_DOWN" for h in stack.health()), 30, "ca to be lost"
    )
    down = next(h for h in stack.health() if h["event"] == "CLUSTER_DOWN")
    assert down["cluster_id"] == "ca"
    beats = [
        s["ts"]
        for s in stack.records(stack.topics.cluster_signals)
        if s["kind"] == "HEARTBEAT" and s["cluster_id"] == "ca"
    ]
    removal_s = (down["ts"] - max(beats)) / 1000
    assert removal_s <= (POLICY.lost_after_ms + 1_500) / 1000, removal_s
    wait_until(
        lambda: any(e["event"] == "RUNNING" and e["cluster_id"] != "ca" for e in stack.events(key)),
        60,
        "the job to run elsewhere",
    )
    events = stack.events(key)
    moved = next(e for e in events if e["event"] == "RUNNING" and e["cluster_id"] != "ca")
    assert moved["epoch"] > first["epoch"]
    restored = [
        e for e in events if e["event"] == "RESTORED" and e["from_cluster"] == "ca" and e["bytes"]
    ]
    assert restored and restored[0]["cluster_id"] == moved["cluster_id"]
    assert "sealed" in restored[0]["detail"]
    # Checkpoints live under the deployment's topic prefix and the submission's trace id.
    assert (
        f"/{stack.topics.prefix}/acme/pretrain/{first['trace_id']}/"
        in restored[0]["checkpoint_uri"]
    )
    resumed_at = restored[0]["step"]
    last_checkpoint_in_ca = max(
        e["step"] for e in events if e["event"] == "CHECKPOINTED" and e["cluster_id"] == "ca"
    )
    assert resumed_at == last_checkpoint_in_ca
    # ca comes back: its agent sees the job has moved on and stops the stale copy.
    stale_pid = first["pid"]
    assert os.path.exists(f"/proc/{stale_pid}")
    link_loss_end = dataclasses.replace(link_loss, end_ms=now_ms())
    stack.simulator.faults[stack.simulator.faults.index(link_loss)] = link_loss_end
    stack.start_agent("ca")
    wait_until(
        lambda: any(e["event"] == "FENCED" and e["cluster_id"] == "ca" for e in stack.events(key)),
        60,
        "the stale copy in ca to be fenced",
    )
    wait_until(lambda: not os.path.exists(f"/proc/{stale_pid}"), 10, "the stale copy to die")
    assert any(h["event"] == "FENCE" and h["cluster_id"] == "ca" for h in stack.health())
    wait_until(lambda: stack.phase(key) == "Succeeded", 120, "the job to finish")
    events = stack.events(key)
    # The copy left in ca may have run to its end while cut off: its exit is not the job's.
    done = [e for e in events if e["event"] == "EXITED" and e["epoch"] == moved["epoch"]]
    assert len(done) == 1 and done[0]["cluster_id"] == moved["cluster_id"]
    assert done[0]["exit_code"] == 0
    reference = reference_run(stack, tmp_path, **workload)
    assert done[0]["detail"] == f"params sha256 {reference[-1]['params_sha256']}"
    # The loss curve has no gap and is the uninterrupted run's, step for step; the stale copy
    # published nothing after ca was lost.
    expected = {x["step"]: x["loss"] for x in reference if x["event"] == "progress"}
    seen: dict[int, float] = {}
    for e in events:
        if e["event"] == "PROGRESS":
            assert seen.setdefault(e["step"], e["loss"]) == e["loss"]
    assert seen == expected
    assert not [
        e
        for e in events
        if e["cluster_id"] == "ca" and e["event"] == "PROGRESS" and e["ts"] > cut_ms
    ]
    job = stack.job(key)
    assert job is not None and job["epoch"] == moved["epoch"]


def test_a_tuned_checkpoint_interval_reaches_the_running_workload(stack):
    """Recommendation -> the job's spec -> the running workload's own interval: operations
    resubmits the tuned spec, the scheduler tells the job's run again, its cluster agent
    rewrites the run's control file, and the workload takes it at its next checkpoint."""
    # 50 steps a second; a checkpoint every 100 steps (2 s) until the interval is tuned.
    document = training("tuned", steps=100_000, checkpoint_every_steps=100, step_delay_ms=20)
    submit(stack.settings.kafka, stack.topics, submits(document))
    wait_until(lambda: stack.phase("acme/tuned") == "Running", 60, "tuned running")

    def checkpoints() -> list[dict[str, Any]]:
        return [e for e in stack.events("acme/tuned") if e["event"] == "CHECKPOINTED"]

    wait_until(lambda: checkpoints(), 60, "a first checkpoint")
    assert all(e["step"] % 100 == 0 for e in checkpoints())  # by steps alone so far
    recommendation = {
        "job": "acme/tuned",
        "kind": "checkpoint_interval",
        "recommended": 1.0,
        "current": 1800,
        "summary": "tuned checkpoint interval: 1800 s -> 1 s (Daly)",
        "document": document,
    }
    append(
        stack.settings.kafka,
        stack.topics,
        [
            ops_event("OPS_POLICY", now_ms(), {"auto_tune_checkpoints": True}),
            ops_event("RECOMMENDATION", now_ms(), recommendation, key="acme/tuned"),
        ],
    )
    wait_until(
        lambda: (
            (stack.job("acme/tuned") or {})
            .get("document", {})
            .get("spec", {})
            .get("checkpoint_interval_s")
            == 1
        ),
        60,
        "the tuned spec in the scheduler",
    )

    def told() -> list[int]:
        events = stack.events("acme/tuned")
        at = [i for i, e in enumerate(events) if "checkpoint interval 1.0 s" in (e["detail"] or "")]
        return (
            [e["step"] for e in events[at[0] + 1 :] if e["event"] == "CHECKPOINTED"] if at else []
        )

    wait_until(lambda: len(told()) >= 3, 60, "checkpoints after the workload took the interval")
    # Every second (about 50 steps), no longer on the 100-step boundaries.
    assert any(step % 100 for step in told()), told()
    (job,) = [j for j in [stack.job("acme/tuned")] if j is not None]
    assert job["phase"] == "Running" and job["epoch"] == 1 and job["attempt"] == 1
    submit(
        stack.settings.kafka,
        stack.topics,
        [new_request("DELETE", "acme/tuned", "acme", now_ms(), uuid.uuid4().hex)],
    )


def exited(stack: Stack, key: str) -> list[dict[str, Any]]:
    return [e for e in stack.events(key) if e["event"] == "EXITED" and e["exit_code"] == 0]


def test_a_two_worker_job_and_a_split_job_train_as_one_process_does(
    stack, tmp_path, monkeypatch, capsys
):
    """Two workers in one cluster (one MPI world under mpirun) and two workers split across
    two clusters (an MPI world each, their leaders over the sealed channel) end with the
    parameters, bit for bit, of one process training on the same global batches."""
    workload = {"steps": 300, "checkpoint_every_steps": 100, "report_every_steps": 50, "seed": 11}
    reference = reference_run(stack, tmp_path, **workload)
    expected = f"params sha256 {reference[-1]['params_sha256']}"

    def cc_nodes() -> int:
        capacity = stack.fleet.view.read(view_read.cluster_capacity)
        return next(c["nodes"] for c in capacity if c["cluster_id"] == "cc")

    wait_until(lambda: cc_nodes() == 2, 30, "both of cc's nodes in the view")
    # Two workers of 2 GPUs fit cc, the cluster of two nodes; two of 8 GPUs fit in one cluster
    # only there, and cc is taken: the second job is split across two one-node clusters.
    submit(
        stack.settings.kafka,
        stack.topics,
        submits(
            training("dp-one", workers=2, per_worker=2, split=True, **workload),
            training("dp-split", workers=2, per_worker=8, split=True, **workload),
        ),
    )
    for key in ("acme/dp-one", "acme/dp-split"):
        wait_until(lambda key=key: stack.phase(key) == "Succeeded", 120, f"{key} to finish")
    one = stack.events("acme/dp-one")
    (started,) = [e for e in one if e["event"] == "STARTING"]
    assert started["cluster_id"] == "cc"  # the one cluster with two nodes
    assert [e["detail"] for e in exited(stack, "acme/dp-one")] == [expected]

    split = stack.events("acme/dp-split")
    starting = {e["cluster_id"]: e for e in split if e["event"] == "STARTING"}
    assert len(starting) == 2, split  # one part in each of two clusters
    assert len({(e["epoch"], e["attempt"]) for e in starting.values()}) == 1
    # Rank 0's part (the first cluster by name) ends with one process's parameters; the other
    # exited with it, or was still exiting when the job's end (rank 0's) had it stopped.
    ends = {e["cluster_id"]: e for e in split if e["event"] == "EXITED"}
    root, other = sorted(starting)
    assert (ends[root]["exit_code"], ends[root]["detail"]) == (0, expected)
    assert ends[other]["exit_code"] == 0 or "the job succeeded" in ends[other]["detail"], ends
    # What crossing clusters costs, as every part reports it and `explain` shows it.
    crossing = [e for e in split if "bytes a step across clusters" in (e["detail"] or "")]
    assert {e["cluster_id"] for e in crossing} == set(starting)
    for name, value in service_env(stack.settings).items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert main(["explain", "acme/dp-split", "--topic-prefix", stack.topics.prefix]) == 0
    explained = capsys.readouterr().out
    assert "its workers' data plane" in explained
    assert "a world of 2 workers" in explained and "bytes a step across clusters" in explained


def test_losing_one_cluster_of_a_split_job_resumes_all_of_it_from_one_checkpoint(stack, tmp_path):
    """A job of three workers split over ca (rank 0, the checkpoints), cb and cc; cb is lost.
    The whole job moves to a new epoch in ca and cc (never half of it training on), resumes
    from one checkpoint of ca's, and ends with the parameters of one process never stopped."""
    workload = {"steps": 1200, "checkpoint_every_steps": 100, "report_every_steps": 100, "seed": 5}
    key = "acme/dp-lost"
    submit(
        stack.settings.kafka,
        stack.topics,
        submits(
            training("dp-lost", workers=3, per_worker=8, split=True, step_delay_ms=8, **workload)
        ),
    )

    def running_in(epoch: int | None = None) -> set[str]:
        return {
            e["cluster_id"]
            for e in stack.events(key)
            if e["event"] == "RUNNING" and (epoch is None or e["epoch"] == epoch)
        }

    wait_until(lambda: running_in() == set(CLUSTERS), 60, "a part in each cluster")
    first = next(e for e in stack.events(key) if e["event"] == "STARTING")
    wait_until(
        lambda: any(e["event"] == "CHECKPOINTED" and e["step"] >= 200 for e in stack.events(key)),
        60,
        "two checkpoints in ca",
    )
    assert {e["cluster_id"] for e in stack.events(key) if e["event"] == "CHECKPOINTED"} == {"ca"}
    # cb goes dark: its agent is killed and its nodes lose their link to the control plane.
    stack.kill_agent("cb")
    link_loss = Fault("cluster_link_loss", "cb", now_ms())
    stack.simulator.add_fault(link_loss)
    try:
        wait_until(
            lambda: (
                {e["epoch"] for e in stack.events(key) if e["event"] == "RUNNING"}
                != {first["epoch"]}
            ),
            60,
            "the job to move to a new epoch",
        )
        moved = max(e["epoch"] for e in stack.events(key) if e["event"] == "RUNNING")
        wait_until(lambda: running_in(moved) == {"ca", "cc"}, 30, "the whole job in ca and cc")

        def world() -> list[str]:
            return [
                e["detail"]
                for e in stack.events(key)
                if e["epoch"] == moved and (e["detail"] or "").startswith("a world")
            ]

        wait_until(world, 30, "the new world's workers to meet")
        assert world()[0] == "a world of 3 workers: ca ranks 0-0, cc ranks 1-2"
        events = stack.events(key)
        restored = [
            e for e in events if e["event"] == "RESTORED" and e["epoch"] == moved and e["step"]
        ]
        # One checkpoint, read by rank 0 in ca and handed to every worker.
        assert {e["cluster_id"] for e in restored} == {"ca", "cc"}
        assert len({(e["step"], e["detail"]) for e in restored}) == 1, restored
        checkpointed = {
            e["step"] for e in events if e["event"] == "CHECKPOINTED" and e["epoch"] < moved
        }
        assert restored[0]["step"] in checkpointed
        wait_until(lambda: stack.phase(key) == "Succeeded", 120, "the job to finish")
    finally:
        ended = dataclasses.replace(link_loss, end_ms=now_ms())
        stack.simulator.faults[stack.simulator.faults.index(link_loss)] = ended
        stack.start_agent("cb")
    reference = reference_run(stack, tmp_path, **workload)
    ends = {
        e["cluster_id"]: e
        for e in stack.events(key)
        if e["event"] == "EXITED" and e["epoch"] == moved
    }
    assert ends["ca"]["detail"] == f"params sha256 {reference[-1]['params_sha256']}"
    # cc's part ended with ca's: it exited, or was still exiting when the job's end (ca's)
    # had it stopped.
    assert ends["cc"]["exit_code"] == 0 or "the job succeeded" in ends["cc"]["detail"], ends
    # Nothing of the new epoch ran in cb; its old part stopped with the rest of the old world.
    assert not [e for e in stack.events(key) if e["cluster_id"] == "cb" and e["epoch"] == moved]


def test_a_federated_job_trains_where_its_data_lives_and_only_model_updates_cross(stack):
    """A restricted dataset lives in two regions (each its own records, in its cluster's store);
    a federated job runs one participant in each, averages their models each round (FedAvg,
    sealed), checkpoints the aggregate and audits which regions contributed; no object of the
    dataset is copied anywhere, and the result is the FedAvg of the two participants, bit for
    bit."""
    name = f"patients-{uuid.uuid4().hex[:8]}"
    prefix = dataset_prefix("acme", name)

    def store(cluster: str) -> ObjectStore:
        bucket = cluster_bucket(stack.settings.s3.bucket, cluster)
        return ObjectStore.from_settings(stack.settings.s3, bucket)

    records = {c: dataset_objects(f"{name}-{c}", 2, 1) for c in ("ca", "cb")}
    for cluster, objects in records.items():
        upload(store(cluster), prefix, objects)
    rounds, local_steps, seed = 4, 25, 19
    job = training("fed", per_worker=2, seed=seed, step_delay_ms=5)
    job["spec"] |= {"dataset": name, "federated": {"rounds": rounds, "local_steps": local_steps}}
    dataset = {
        "kind": "Dataset",
        "metadata": {"name": name, "tenant": "acme"},
        "spec": {
            "size": 2 << 20,
            "replicas": ["ca", "cb"],
            "residency": ["region-ca", "region-cb"],
            "sensitivity": "restricted",
        },
    }
    submit(stack.settings.kafka, stack.topics, submits(dataset, job))
    wait_until(lambda: stack.phase("acme/fed") == "Succeeded", 120, "the federated job to end")
    events = stack.events("acme/fed")
    assert {e["cluster_id"] for e in events if e["event"] == "STARTING"} == {"ca", "cb"}
    # The FedAvg of the two participants (each on its own samples), bit for bit.
    config = TrainConfig.from_env(workload_env({"seed": seed}))
    params, _, _ = initial(config)
    # Each participant's samples are its own region's objects, read from its cluster's store.
    shares = [
        local_data(config, part, 2, [records[c][k] for k in sorted(records[c])])
        for part, c in enumerate(("ca", "cb"))
    ]
    samples = sum(len(x) for x, _ in shares)
    for r in range(rounds):
        updates = [
            local_round(config, params, x, y, r, part, local_steps)[0]
            for part, (x, y) in enumerate(shares)
        ]
        params = unflat(
            ordered_sum(
                [flat(u) * (len(x) / samples) for u, (x, _) in zip(updates, shares, strict=True)]
            ),
            params,
        )
    assert f"params sha256 {params_digest(params)}" in [
        e["detail"] for e in exited(stack, "acme/fed")
    ]
    # Every round's aggregate checkpointed in the root's store, and audited with its regions.
    checkpoints = [e for e in events if e["event"] == "CHECKPOINTED"]
    assert [e["step"] for e in checkpoints] == [local_steps * (r + 1) for r in range(rounds)]
    assert all(e["checkpoint_uri"].startswith(f"s3://{store('ca').bucket}/") for e in checkpoints)
    audited = sorted(
        r["event"]["details"].get("detail", "")
        for r in stack.records(stack.topics.audit_log, stack.topics.audit_partitions)
        if r.get("event")
        and r["event"]["target"] == "acme/fed"
        and r["event"]["operation"] == "workload.CHECKPOINTED"
    )
    assert audited == [
        f"federated round {r + 1} of {rounds}: the aggregate of 2 regions (region-ca, "
        "region-cb); only model updates crossed"
        for r in range(rounds)
    ]

    # No byte of the dataset left its region: each store holds its own records and nothing
    # of the other's, and no prewarm was ordered.
    def keys(held: ObjectStore, under: str) -> list[str]:
        try:
            return held.keys(under)
        except ObjectMissing:
            return []  # the cluster's store was never written

    for cluster, other in (("ca", "cb"), ("cb", "ca"), ("cc", "ca")):
        held = store(cluster)
        digests = {
            hashlib.sha256(held.get(key)).hexdigest()
            for key in keys(held, "datasets/") + keys(held, f"checkpoints/{stack.topics.prefix}/")
        }
        theirs = {hashlib.sha256(b).hexdigest() for b in records[other].values()}
        assert not digests & theirs, f"{other}'s records in {cluster}'s store"
    assert not keys(store("cc"), prefix)
    assert not stack.records(stack.topics.prewarms)
