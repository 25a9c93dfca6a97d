"""The Slurm backend on a real Slurm cluster: `slurmctld` and `slurmd` from the host's packages
(started as `fleetline infra start --slurm` starts them), munge, fake GPU gres. Cluster `sa`
runs its workloads as Slurm batch jobs, `sb` as processes.

In order: a job runs through Slurm (its nodes and GPUs as Slurm bound them reported) and ends
with the parameters of an uninterrupted run; a cluster agent killed with SIGKILL re-adopts its
Slurm job and starts nothing twice; a Slurm job of a run no order wants (left by an agent whose
state directory is gone) is found with squeue and cancelled; an order for a node Slurm does not
know fails with Slurm's own message; an order over its tenant's quota in a cluster is refused
by that cluster's agent (the quota's second level); a cordon in fleetline drains the Slurm
node and an uncordon resumes it; with Slurm's controller down the agent's heartbeat carries
Slurm's own error and the cluster is cordoned (a new job goes to the other cluster) until
Slurm answers again; a Slurm node set
DOWN under a running job is fenced in fleetline and the job resumes in the other cluster from
its checkpoint, bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetline.app import Options
from fleetline.config import Settings
from fleetline.infra.slurm import SlurmCluster
from fleetline.processors.health.fold import ClusterHealthPolicy
from fleetline.processors.scheduling.client import submit
from fleetline.processors.scheduling.codec import canonical_json, new_request
from fleetline.streams import kafka as kafka_clients
from tests.services import submits
from tests.stack import Stack, codec, now_ms, reference_run, running_stack, training
from tests.support import wait_until

pytestmark = pytest.mark.services
# A restarted agent must not be taken for a lost cluster: these tests are not about loss.
POLICY = ClusterHealthPolicy(
    suspect_after_ms=3_000, lost_after_ms=20_000, recover_after_ms=2_000, peer_report_fresh_ms=3_000
)


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    cluster = SlurmCluster.parse(Path(tempfile.mkdtemp(prefix="slurm-")), "sa:1")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.wipe()


@pytest.fixture(scope="module")
def stack(services: Settings, slurm: SlurmCluster) -> Iterator[Stack]:
    options = Options(tick_interval_s=0.3, health_policy=POLICY, clock_interval_s=0.25)
    agent_args = {"sa": ["--backend", "slurm", "--slurm-conf", str(slurm.conf)]}
    with running_stack(
        services, ("sa", "sb"), options, "slurm", commands=True, agent_args=agent_args
    ) as built:
        yield built


def squeue(slurm: SlurmCluster) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["squeue", "--json"], env={**os.environ, **slurm.env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["jobs"]


def slurm_jobs(slurm: SlurmCluster, name: str) -> list[dict[str, Any]]:
    return [j for j in squeue(slurm) if j["name"].startswith(f"{name}.")]


def node(slurm: SlurmCluster, name: str) -> dict[str, Any]:
    out = subprocess.run(
        ["sinfo", "--json"], env={**os.environ, **slurm.env}, capture_output=True, text=True
    )
    return next(n for n in json.loads(out.stdout)["nodes"] if n["name"] == name)


def scontrol(slurm: SlurmCluster, *args: str) -> None:
    subprocess.run(["scontrol", *args], env={**os.environ, **slurm.env}, check=True)


def fence_requests(stack: Stack, node_id: str) -> list[tuple[str, str]]:
    return [
        (r["kind"], r["detail"])
        for r in stack.records(stack.topics.scheduler_requests)
        if r["kind"] in ("FENCE", "UNFENCE") and r["key"] == node_id
    ]


def test_a_job_runs_through_slurm_and_ends_with_an_uninterrupted_run_s_parameters(
    stack, slurm, tmp_path
):
    # Long enough (2.4 s) to be seen running: squeue is read once a second.
    workload = {
        "steps": 120,
        "checkpoint_every_steps": 40,
        "report_every_steps": 10,
        "seed": 5,
        "step_delay_ms": 20,
    }
    submit(stack.settings.kafka, stack.topics, submits(training("through-slurm", **workload)))
    key = "acme/through-slurm"
    wait_until(lambda: stack.phase(key) == "Succeeded", 120, "the job to succeed through Slurm")
    events = stack.events(key)
    starting = next(e for e in events if e["event"] == "STARTING")
    assert starting["cluster_id"] == "sa"
    assert "Slurm job " in starting["detail"] and "--gres=gpu:2" in starting["detail"]
    assert "--nodelist=sa-n0000" in starting["detail"]
    running = next(e for e in events if e["event"] == "RUNNING")
    # Slurm's own binding: the node and the GPU indices it gave.
    assert "on sa-n0000" in running["detail"] and "sa-n0000 GPU 0-1" in running["detail"]
    jobs = slurm_jobs(slurm, key)
    assert [j["job_state"] for j in jobs] == ["COMPLETED"]
    assert json.loads(jobs[0]["comment"])["epoch"] == starting["epoch"]
    exits = [e for e in events if e["event"] == "EXITED"]
    reference = reference_run(stack, tmp_path, **workload)
    assert [e["exit_code"] for e in exits] == [0]
    assert exits[0]["detail"] == f"params sha256 {reference[-1]['params_sha256']}"
    expected = {x["step"]: x["loss"] for x in reference if x["event"] == "progress"}
    assert {e["step"]: e["loss"] for e in events if e["event"] == "PROGRESS"} == expected


def test_a_cluster_agent_killed_with_sigkill_re_adopts_its_slurm_job(stack, slurm):
    workload = {"steps": 150, "checkpoint_every_steps": 50, "step_delay_ms": 40}
    submit(stack.settings.kafka, stack.topics, submits(training("adopted", **workload)))
    key = "acme/adopted"
    wait_until(
        lambda: any(e["event"] == "RUNNING" for e in stack.events(key)), 90, "adopted to run"
    )
    stack.kill_agent("sa")
    stack.start_agent("sa")
    wait_until(lambda: stack.phase(key) == "Succeeded", 120, "adopted to succeed")
    events = stack.events(key)
    assert len([e for e in events if e["event"] == "STARTING"]) == 1
    assert len(slurm_jobs(slurm, key)) == 1  # submitted to Slurm once
    assert [e["exit_code"] for e in events if e["event"] == "EXITED"] == [0]
    steps = [e["step"] for e in events if e["event"] == "PROGRESS"]
    assert steps == sorted(set(steps)) and steps[-1] == 150


def test_a_slurm_job_no_order_wants_is_found_with_squeue_and_cancelled(stack, slurm, tmp_path):
    # A run of an epoch long gone, left in Slurm by an agent whose state directory was lost.
    meta = {"fleetline": "sa", "job": "acme/ghost", "tenant": "acme", "epoch": 1, "attempt": 0}
    script = tmp_path / "ghost.sh"
    script.write_text(f"#!/bin/bash\nexec {sys.executable} -c 'import time; time.sleep(600)'\n")
    submitted = subprocess.run(
        [
            "sbatch", "--parsable", "--job-name=acme/ghost.e1-a0", "--nodelist=sa-n0000",
            "--gres=gpu:1", f"--output={tmp_path / 'ghost.out'}",
            f"--comment={json.dumps({**meta, 'trace_id': 'ghost'})}", str(script),
        ],
        env={**os.environ, **slurm.env}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    job_id = int(submitted.stdout.strip())

    def state() -> str:
        return next(j["job_state"] for j in squeue(slurm) if j["job_id"] == job_id)

    wait_until(lambda: state() == "RUNNING", 30, "the ghost to run in Slurm")
    stack.kill_agent("sa")
    stack.start_agent("sa")
    wait_until(lambda: state() == "CANCELLED", 60, "the ghost to be cancelled")

    def fenced() -> list[dict[str, Any]]:
        return [e for e in stack.events("acme/ghost") if e["event"] == "FENCED"]

    wait_until(fenced, 30, "the ghost's end to be reported")
    assert [(e["cluster_id"], e["epoch"], e["attempt"]) for e in fenced()] == [("sa", 1, 0)]


def test_an_order_for_a_node_slurm_does_not_know_fails_with_slurm_s_message(stack, slurm):
    from fleetline.agents.cluster.backends import RunRequest
    from fleetline.agents.cluster.backends.slurm import SlurmError, SlurmLauncher

    launcher = SlurmLauncher("sa", slurm.conf)
    directory = stack.state_dir / "unknown-node"
    directory.mkdir()
    request = RunRequest(
        "sa", "acme/nowhere", "acme", 1, 0, "t", "normal", (("sa-n9999", (0,)),),
        ("true",), dict(os.environ), directory,
    )  # fmt: skip
    with pytest.raises(SlurmError, match=r"sbatch: .*[Ii]nvalid node name"):
        launcher.start(request)
    assert not slurm_jobs(slurm, "acme/nowhere")


def test_a_cordon_in_fleetline_drains_the_slurm_node_and_an_uncordon_resumes_it(
    stack, slurm, monkeypatch
):
    from fleetline.cli import main
    from tests.services import signed_in

    signed_in(monkeypatch, stack.api_url, "ops")
    prefix = ["--cluster-id", "sa"]
    assert main(["command", "sa-n0000", "CORDON", *prefix]) == 0
    wait_until(lambda: "DRAIN" in node(slurm, "sa-n0000")["state_flags"], 60, "Slurm to drain")
    assert node(slurm, "sa-n0000")["reason"] == "fleetline: cordoned"
    assert main(["command", "sa-n0000", "UNCORDON", *prefix]) == 0
    wait_until(lambda: "DRAIN" not in node(slurm, "sa-n0000")["state_flags"], 60, "Slurm to resume")
    # fleetline's own drain is not taken for an outage of Slurm's: nothing was fenced.
    assert fence_requests(stack, "sa-n0000") == []


def test_a_cluster_refuses_an_order_over_its_tenant_s_quota_there(stack):
    # The second level of the quota: the scheduler holds tenant `lean` to 2 GPUs in sb, and an
    # order for 4 reaches sb's agent anyway (as from a scheduler whose count lagged).
    policy = canonical_json({"tenant": "lean", "quota": {"cluster_gpus": {"sb": 2}}})
    submit(
        stack.settings.kafka,
        stack.topics,
        [new_request("TENANT_POLICY", "lean", "lean", now_ms(), "lean-p", spec_json=policy)],
    )
    order = {
        "job": "lean/greedy", "tenant": "lean", "kind": "TrainingJob", "action": "RUN",
        "cluster_id": "sb", "epoch": 1, "attempt": 1, "ts": now_ms(), "decision_id": "d",
        "reason": "placed", "trace_id": "0" * 32,
        "spec_json": json.dumps(training("greedy", steps=10)),
        "workers": [{"node_id": "sb-n0000", "gpus": [0, 1, 2, 3]}], "resume_from": [],
        "resume_step": None, "final_checkpoint": False,
    }  # fmt: skip
    # The tenant's terms reach the agent through the scheduler's state first.
    wait_until(lambda: stack.fleet.scheduler.store.committed(0, b"tenant:lean"), 30, "the policy")
    producer = kafka_clients.producer(stack.settings.kafka)
    producer.produce(
        stack.topics.orders,
        key=b"lean/greedy",
        value=codec.encode(stack.topics.record_of(stack.topics.orders), order),
    )
    producer.flush(10)

    def failed() -> list[dict[str, Any]]:
        return [e for e in stack.events("lean/greedy") if e["event"] == "FAILED"]

    wait_until(failed, 30, "the order to be refused")
    assert failed()[0]["cluster_id"] == "sb"
    assert failed()[0]["detail"] == (
        "could not start: refused by cluster sb: quota: tenant lean holds 0 of its 2 GPUs in "
        "sb, this needs 4 more"
    )
    assert not [e for e in stack.events("lean/greedy") if e["event"] == "STARTING"]


def test_with_slurm_s_controller_down_its_cluster_takes_no_new_work_and_says_why(stack, slurm):
    def reason() -> str | None:
        beats = [
            s
            for s in stack.records(stack.topics.cluster_signals)
            if s["kind"] == "HEARTBEAT" and s["cluster_id"] == "sa"
        ]
        return beats[-1]["reason"] if beats else None

    def cordons() -> list[str]:
        return [
            h["reason"]
            for h in stack.health()
            if h["event"] == "CORDON" and h["cluster_id"] == "sa"
        ]

    key = "acme/while-slurm-is-down"
    slurm.kill_controller()
    try:
        wait_until(
            lambda: "Unable to contact slurm controller" in (reason() or ""),
            60,
            "the heartbeat to carry Slurm's error",
        )
        wait_until(cordons, 30, "sa to be cordoned")
        # Whichever of the agent's reads met the dead controller first (jobs or nodes).
        cordon = cordons()[0]
        assert cordon.startswith(
            ("control unavailable: Slurm: squeue: ", "control unavailable: Slurm: sinfo: ")
        )
        assert "Unable to contact slurm controller" in cordon
        # sa keeps what it runs and takes nothing new: the job goes to sb.
        workload = {"steps": 40, "checkpoint_every_steps": 20}
        submit(
            stack.settings.kafka,
            stack.topics,
            submits(training("while-slurm-is-down", **workload)),
        )
        wait_until(lambda: stack.phase(key) == "Succeeded", 120, "the job to run in sb")
        assert [e["cluster_id"] for e in stack.events(key) if e["event"] == "STARTING"] == ["sb"]
    finally:
        slurm.start()
    # While the controller comes back Slurm's error may change (a CORDON event says each new
    # one), so the lift is the last cordon event, and the only one.
    lifted = "control answers again: takes new work"
    wait_until(lambda: cordons()[-1] == lifted, 60, "sa's cordon to be lifted")
    said = cordons()
    assert said.count(lifted) == 1, said
    assert all(c.startswith("control unavailable: Slurm: ") for c in said[:-1]), said
    assert reason() is None


def test_a_slurm_node_down_under_a_running_job_moves_it_from_its_checkpoint(stack, slurm, tmp_path):
    workload = {
        "steps": 300,
        "checkpoint_every_steps": 50,
        "report_every_steps": 10,
        "seed": 11,
        "step_delay_ms": 30,
    }
    submit(stack.settings.kafka, stack.topics, submits(training("node-lost", **workload)))
    key = "acme/node-lost"
    wait_until(
        lambda: any(e["event"] == "CHECKPOINTED" and e["step"] >= 100 for e in stack.events(key)),
        90,
        "two checkpoints through Slurm",
    )
    assert {e["cluster_id"] for e in stack.events(key)} == {"sa"}
    scontrol(slurm, "update", "nodename=sa-n0000", "state=down", "reason=disk failure")
    try:
        wait_until(lambda: stack.phase(key) == "Succeeded", 180, "the job to finish elsewhere")
        events = stack.events(key)
        moved = [e for e in events if e["event"] == "RUNNING" and e["cluster_id"] == "sb"]
        assert moved
        restored = [e for e in events if e["event"] == "RESTORED" and e["bytes"]]
        assert restored and restored[0]["from_cluster"] == "sa"
        assert restored[0]["step"] >= 100
        done = [e for e in events if e["event"] == "EXITED" and e["exit_code"] == 0]
        assert [e["cluster_id"] for e in done] == ["sb"]
        reference = reference_run(stack, tmp_path, **workload)
        assert done[0]["detail"] == f"params sha256 {reference[-1]['params_sha256']}"
        fences = fence_requests(stack, "sa-n0000")
        assert fences[0][0] == "FENCE" and "Slurm: DOWN" in fences[0][1]
        assert "disk failure" in fences[0][1]
    finally:
        scontrol(slurm, "update", "nodename=sa-n0000", "state=resume")
    wait_until(
        lambda: [k for k, _ in fence_requests(stack, "sa-n0000")] == ["FENCE", "UNFENCE"],
        60,
        "the node to be unfenced once Slurm returns it",
    )
