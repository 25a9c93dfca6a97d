"""The cluster agent's backends without a manager: node sync (pure), how Slurm's JSON is read,
and what a run's end is reported as."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fleetline.agents.cluster import workloads as procs
from fleetline.agents.cluster.backends import RunRequest
from fleetline.agents.cluster.backends.slurm import (
    SlurmJob,
    SlurmLauncher,
    SlurmRun,
    manager_node,
)
from fleetline.agents.cluster.nodes import (
    DRAIN_REASON,
    Drain,
    Fence,
    ManagerNode,
    Resume,
    Unfence,
    sync,
)


def node(name: str, usable: bool = True, why: str = "IDLE", ours: bool = False) -> ManagerNode:
    return ManagerNode(name, usable, why, ours)


def test_an_outage_of_the_manager_s_own_is_fenced_once_and_unfenced_when_it_returns() -> None:
    down = {"n1": node("n1", False, "DOWN (disk failure)"), "n2": node("n2")}
    assert sync(down, {"n1": False, "n2": False}, set(), "Slurm") == [
        Fence("n1", "Slurm: DOWN (disk failure)")
    ]
    assert sync(down, {"n1": False, "n2": False}, {"n1"}, "Slurm") == []  # told once
    back = {"n1": node("n1"), "n2": node("n2")}
    assert sync(back, {"n1": False, "n2": False}, {"n1"}, "Slurm") == [
        Unfence("n1", "Slurm returned it to service")
    ]


def test_a_fence_the_agent_did_not_make_is_never_lifted_by_the_manager() -> None:
    assert sync({"n1": node("n1")}, {"n1": False}, set(), "Slurm") == []


def test_a_cordon_drains_the_manager_s_node_and_an_uncordon_resumes_only_our_drain() -> None:
    assert sync({"n1": node("n1")}, {"n1": True}, set(), "Slurm") == [Drain("n1")]
    ours = {"n1": node("n1", False, f"IDLE+DRAIN ({DRAIN_REASON})", ours=True)}
    assert sync(ours, {"n1": True}, set(), "Slurm") == []  # drained by us: not an outage, not again
    assert sync(ours, {"n1": False}, set(), "Slurm") == [Resume("n1")]
    theirs = {"n1": node("n1", False, "IDLE+DRAIN (firmware update)")}
    assert sync(theirs, {"n1": False}, set(), "Slurm") == [
        Fence("n1", "Slurm: IDLE+DRAIN (firmware update)")
    ]


def test_a_node_fleetline_does_not_know_is_fenced_but_never_drained() -> None:
    assert sync({"n9": node("n9")}, {}, set(), "Slurm") == []
    assert sync({"n9": node("n9", False, "DOWN")}, {}, set(), "Slurm") == [
        Fence("n9", "Slurm: DOWN")
    ]


def test_sinfo_nodes_are_read_in_slurm_22_05_s_shape_and_the_newer_one() -> None:
    old = manager_node(
        {"name": "n1", "state": "idle", "state_flags": ["DRAIN"], "reason": DRAIN_REASON}
    )
    assert old == ManagerNode("n1", False, f"IDLE+DRAIN ({DRAIN_REASON})", True)
    assert manager_node({"name": "n2", "state": "mixed", "state_flags": []}).usable
    newer = manager_node({"name": "n3", "state": ["DOWN", "NOT_RESPONDING"], "reason": "x"})
    assert newer == ManagerNode("n3", False, "DOWN+NOT_RESPONDING (x)", False)
    # A missed ping alone does not take a node out: Slurm sets it DOWN if it stays silent.
    assert manager_node({"name": "n4", "state": "idle", "state_flags": ["NOT_RESPONDING"]}).usable


def test_squeue_jobs_are_read_in_slurm_22_05_s_shape_and_the_newer_one() -> None:
    comment = json.dumps({"fleetline": "sa", "job": "acme/a", "epoch": 2})
    old = SlurmJob.from_squeue(
        {
            "job_id": 7,
            "job_state": "RUNNING",
            "state_reason": "None",
            "nodes": "sa-n0000",
            "gres_detail": ["gpu:2(IDX:0-1)"],
            "exit_code": 0,
            "comment": comment,
        }
    )
    assert (old.job_id, old.state, old.live, old.gres, old.exit_code) == (
        7,
        "RUNNING",
        True,
        ("gpu:2(IDX:0-1)",),
        0,
    )
    assert old.comment["epoch"] == 2
    newer = SlurmJob.from_squeue(
        {"job_id": 8, "job_state": ["NODE_FAIL"], "exit_code": {"return_code": 3}, "comment": ""}
    )
    assert (newer.state, newer.live, newer.exit_code, newer.comment) == ("NODE_FAIL", False, 3, {})


def run_with(state: str | None, tmp_path: Path, exit_code: int | None = 0) -> SlurmRun:
    launcher = SlurmLauncher("sa")
    if state is not None:
        launcher.queue[5] = SlurmJob(5, state, "None", "sa-n0000", (), exit_code, {})
    return SlurmRun(launcher, tmp_path, 5)


def test_a_node_failure_is_a_failure_even_when_the_tasks_exited_0(tmp_path) -> None:
    assert run_with("NODE_FAIL", tmp_path).ended(0) == (1, "Slurm: Slurm job 5 NODE_FAIL")
    assert run_with("COMPLETED", tmp_path).ended(0) is None  # the exit code tells
    assert run_with("CANCELLED", tmp_path).ended(None) == (137, "Slurm: Slurm job 5 CANCELLED")
    assert run_with(None, tmp_path).ended(None) == (1, "Slurm no longer knows Slurm job 5")
    assert run_with(None, tmp_path).ended(0) is None


def test_a_job_just_submitted_is_alive_until_the_queue_is_read_again(tmp_path) -> None:
    run = run_with(None, tmp_path)
    run.launcher.unseen.add(5)
    assert run.alive()
    run.launcher.unseen.clear()
    assert not run.alive()
    run.launcher.error = "squeue: Unable to contact slurm controller"
    assert run.alive()  # the controller does not answer: nothing is known to have ended


def test_a_stopped_line_marks_a_run_interrupted(tmp_path) -> None:
    directory, files = procs.prepare(
        tmp_path, {"job": "acme/a", "tenant": "acme", "epoch": 1, "attempt": 0, "trace_id": "t"}
    )
    workload = procs.Workload("acme/a", "acme", 1, 0, "t", directory)
    assert workload.interrupted() is None
    Path(files["FLEETLINE_PROGRESS_FILE"]).write_text(
        '{"event": "progress", "step": 10}\n{"event": "stopped", "step": 12}\n'
    )
    assert workload.interrupted() == {"event": "stopped", "step": 12}


def test_a_json_answer_with_errors_is_an_error_in_the_plain_command_s_words(monkeypatch) -> None:
    from fleetline.agents.cluster.backends.slurm import SlurmClient, SlurmError

    down = '{"errors": [{"description": "Failed while looking for jobs"}], "jobs": []}'
    asked: list[list[str]] = []

    def run(self, argv, env=None):
        asked.append(list(argv))
        if "--json" in argv:
            return down  # exit 0, no jobs: not "nothing runs"
        raise SlurmError("squeue: Unable to contact slurm controller (connect failure)")

    monkeypatch.setattr(SlurmClient, "run", run)
    # An answer with errors is not an empty queue.
    with pytest.raises(SlurmError, match="Unable to contact slurm controller"):
        SlurmClient().jobs()
    assert asked == [["squeue", "--json"], ["squeue", "--noheader"]]


def test_progress_lines_say_their_events_and_reports_in_order() -> None:
    from fleetline.agents.cluster.reports import Event, Report, said

    assert said({"event": "progress", "step": 10, "loss": 0.5, "samples_per_s": 3.0}) == [
        Event("PROGRESS", {"step": 10, "loss": 0.5, "samples_per_s": 3.0})
    ]
    checkpoint = {"event": "checkpoint", "step": 50, "uri": "s3://b/k", "bytes": 9, "ts": 7}
    fields = {"step": 50, "checkpoint_uri": "s3://b/k", "bytes": 9, "seconds": None}
    assert said(checkpoint) == [
        Event("CHECKPOINTED", {**fields, "detail": None}),
        Report("CHECKPOINT", {"step": 50, "checkpoint_ms": 7, "detail": "s3://b/k"}),
    ]
    # A federated round's checkpoint names the regions that contributed (into the audit log).
    round_detail = "federated round 2 of 3: the aggregate of 2 regions (eu, us)"
    assert said({**checkpoint, "detail": round_detail})[0] == Event(
        "CHECKPOINTED", {**fields, "detail": round_detail}
    )
    line = {"event": "progress", "step": 20, "round": 2, "regions": ["eu", "us"]}
    (event,) = said({**line, "loss": 0.1, "exchange_ms": 1.5, "cross_bytes_per_step": 70})
    assert event.fields["detail"] == (
        "federated round 2: eu, us contributed; 1.5 ms a round averaging, 70 bytes a step "
        "across regions (model updates only)"
    )
    resumed = said({"event": "resumed", "step": 50, "checkpoint": "ckpt-50"})
    assert resumed == [Event("RESTORED", {"step": 50, "detail": "resumed from ckpt-50"})]
    for quiet in ("done", "stopped", "listening", "idle", "unreadable"):
        assert said({"event": quiet}) == []


def test_a_replica_s_state_follows_its_run_and_its_own_word() -> None:
    from fleetline.agents.cluster.reconcile import Order
    from fleetline.agents.cluster.registry import replica_state
    from fleetline.processors.scheduling.services import ROLE_LABEL

    def order(role: str | None) -> Order:
        spec = {"metadata": {"labels": {ROLE_LABEL: role} if role else {}}}
        return Order(
            "acme/r", "acme", "Replica", "RUN", "c", 1, 0, 0, "", "t", spec, (), (), None, False
        )

    ready = {"ready": True}
    assert replica_state(order(None), False, False, True, ready) == "GONE"
    assert replica_state(order(None), True, True, True, ready) == "DRAINING"
    assert replica_state(order(None), True, False, True, {"draining": True}) == "DRAINING"
    assert replica_state(order(None), True, False, False, ready) == "STARTING"
    assert replica_state(order(None), True, False, True, ready) == "READY"
    assert replica_state(order("standby"), True, False, True, ready) == "WARM"


def test_a_cluster_refuses_a_run_over_its_tenant_s_quota_there() -> None:
    from fleetline.agents.cluster.reconcile import Order, quota_refusal
    from fleetline.processors.scheduling.tenancy import TenantPolicy

    def order(job: str, tenant: str, gpus: int) -> Order:
        workers = (("ca-n0000", tuple(range(gpus))),)
        return Order(
            job, tenant, "TrainingJob", "RUN", "ca", 1, 0, 0, "", "t", {}, workers, (), None, False
        )

    policy = TenantPolicy.from_data({"tenant": "acme", "quota": {"cluster_gpus": {"ca": 4}}})
    running = [order("acme/a", "acme", 2), order("other/b", "other", 8)]
    assert quota_refusal("ca", order("acme/c", "acme", 2), policy, running) is None
    refusal = quota_refusal("ca", order("acme/c", "acme", 4), policy, running)
    assert refusal == "quota: tenant acme holds 2 of its 4 GPUs in ca, this needs 4 more"
    # Its own earlier run is not counted against it; no policy, no limit.
    assert quota_refusal("ca", order("acme/a", "acme", 4), policy, running) is None
    assert quota_refusal("ca", order("acme/c", "acme", 64), None, running) is None


def test_the_managers_scenario_puts_a_cluster_under_each_manager() -> None:
    from fleetline.demo import scenario
    from fleetline.errors import ConfigError

    story = scenario.load("managers")
    assert {c.spec.cluster_id: c.manager for c in story.clusters} == {
        "eu-west-a": "slurm",
        "us-east-a": "kubernetes",
        "ap-south-a": "process",
    }
    assert story.lose_cluster_of == "acme/story"
    bad = {"name": "x", "seed": 1, "clusters": [{"id": "c", "region": "r", "manager": "lsf"}]}
    with pytest.raises(
        ConfigError, match="manager must be one of process, slurm, kubernetes, got 'lsf'"
    ):
        scenario.parse(bad)


def test_a_slurm_cluster_is_named_and_configured_for_its_fleetline_cluster(tmp_path) -> None:
    from fleetline.infra.slurm import SlurmCluster

    cluster = SlurmCluster.parse(tmp_path, "sa:2")
    assert cluster.nodes == ("sa-n0000", "sa-n0001")  # the simulator's node ids
    assert SlurmCluster.parse(tmp_path, "sb").nodes == ("sb-n0000",)
    for bad in ("", "sa:0", "sa:two", ":3"):
        with pytest.raises(ValueError, match="expected CLUSTER or CLUSTER:NODES"):
            SlurmCluster.parse(tmp_path, bad)
    cluster._configure()
    conf = cluster.conf.read_text()
    assert "ReturnToService=1" in conf and "SelectType=select/cons_tres" in conf
    ports = [line for line in conf.splitlines() if line.startswith("NodeName=")]
    assert len({line.split("Port=")[1].split()[0] for line in ports}) == 2  # a port each
    assert SlurmCluster.found(tmp_path) == [cluster]
    assert (cluster.directory / "munge" / "munge.key").stat().st_mode & 0o077 == 0


def test_a_slurm_cluster_told_its_fabric_knows_its_leaves_and_nvlink_islands(tmp_path) -> None:
    from fleetline.infra.slurm import SlurmCluster

    nodes = ("sa-n0000", "sa-n0001", "sa-n0002")
    cluster = SlurmCluster(
        "sa",
        nodes,
        tmp_path / "sa",
        leaves=(("leaf0", nodes[:2]), ("leaf1", nodes[2:])),
        nvlink_islands=((0, 1, 2, 3), (4, 5, 6, 7)),
    )
    cluster._configure()
    assert "TopologyPlugin=topology/tree" in cluster.conf.read_text()
    assert (cluster.directory / "topology.conf").read_text().splitlines() == [
        "SwitchName=leaf0 Nodes=sa-n0000,sa-n0001",
        "SwitchName=leaf1 Nodes=sa-n0002",
        "SwitchName=spine Switches=leaf0,leaf1",
    ]
    gres = (cluster.directory / "gres.conf").read_text().splitlines()
    links = {line.split(" File=")[1].split()[0][-1]: line.split("Links=")[1] for line in gres[1:]}
    assert links["0"] == "-1,1,1,1,0,0,0,0"  # linked to its own island only
    assert links["6"] == "0,0,0,0,1,1,-1,1"
    # Told nothing, Slurm knows no fabric: no topology, the GPUs in one line.
    plain = SlurmCluster.parse(tmp_path / "plain", "sb:1")
    plain._configure()
    assert "TopologyPlugin" not in plain.conf.read_text()
    assert "Links=" not in (plain.directory / "gres.conf").read_text()


def test_a_slurm_cluster_s_orphaned_job_processes_are_killed_and_nothing_else(tmp_path) -> None:
    import subprocess
    import time

    from fleetline.infra.slurm import SlurmCluster

    cluster = SlurmCluster.parse(tmp_path, "sa:1")
    job = cluster.directory / "spool" / "sa-n0000" / "job00001"
    job.mkdir(parents=True)
    (job / "slurm_script").write_text("sleep 60\n")
    # A batch script left running, its child, and an unrelated process of the same command.
    orphan = subprocess.Popen(["sh", str(job / "slurm_script")])
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.2)
        assert cluster.kill_orphaned_jobs() == 2  # the script and its sleep
        assert orphan.wait(5) == -9
        assert bystander.poll() is None
        assert cluster.kill_orphaned_jobs() == 0
    finally:
        bystander.kill()
        orphan.kill()


def test_kubernetes_is_built_in_a_module_that_takes_its_staging_modules_as_releases(
    tmp_path,
) -> None:
    from fleetline.errors import ServiceError
    from fleetline.infra.kubernetes import KwokCluster, build_go_mod, gpu_node

    upstream = (
        "module k8s.io/kubernetes\n\ngo 1.26.0\n\nreplace (\n"
        "\tk8s.io/api => ./staging/src/k8s.io/api\n"
        "\tk8s.io/client-go => ./staging/src/k8s.io/client-go\n)\n"
    )
    go_mod = build_go_mod(upstream)
    assert "require k8s.io/kubernetes v1.37.2" in go_mod
    assert "\tk8s.io/api => k8s.io/api v0.37.2\n" in go_mod
    assert "\tk8s.io/client-go => k8s.io/client-go v0.37.2\n" in go_mod
    with pytest.raises(ServiceError, match="replaces no staging module"):
        build_go_mod("module example.com/other\n")
    plane = KwokCluster.parse(tmp_path, "kc:2")
    assert plane.nodes == ("kc-n0000", "kc-n0001")
    with pytest.raises(ValueError, match="expected CLUSTER or CLUSTER:NODES"):
        KwokCluster.parse(tmp_path, "kc:0")
    node = gpu_node("kc-n0000")
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"


# -- Kubernetes --------------------------------------------------------------------------------


def kube_request(directory: Path, workers: tuple[tuple[str, tuple[int, ...]], ...]) -> Any:
    from fleetline.agents.cluster.backends import RunRequest

    return RunRequest(
        "eu-west-a", "acme/Big_Train.v2", "acme", 7, 2, "trace", "normal", workers,
        (sys.executable, "-m", "fleetline.agents.workloads.train"),
        {"FLEETLINE_PROGRESS_FILE": str(directory / "progress.jsonl"), "PATH": os.environ["PATH"]},
        directory,
    )  # fmt: skip


def test_a_kubernetes_run_is_one_pod_per_worker_with_its_rank_node_and_gpus(tmp_path):
    from fleetline.agents.cluster.backends.kubernetes import pods_for, run_name

    request = kube_request(tmp_path, (("n1", (0, 1, 2, 3)), ("n2", (4, 5, 6, 7)), ("n3", ())))
    name = run_name("eu-west-a", "acme/Big_Train.v2", 7, 2)
    assert re.fullmatch(r"fl-acme-big-train-v2-e7-a2-[0-9a-f]{6}", name)
    pods = pods_for(request, "ml", "registry.local/fleetline:1", 30, {"fleetline.io/run": name})
    assert [p["metadata"]["name"] for p in pods] == [f"{name}-r0", f"{name}-r1", f"{name}-r2"]
    nodes = [
        p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ][0]["matchExpressions"][0]["values"]
        for p in pods
    ]
    assert nodes == [["n1"], ["n2"], ["n3"]]
    limits = [p["spec"]["containers"][0].get("resources", {}).get("limits") for p in pods]
    assert limits == [{"nvidia.com/gpu": "4"}, {"nvidia.com/gpu": "4"}, None]
    envs = [{e["name"]: e["value"] for e in p["spec"]["containers"][0]["env"]} for p in pods]
    assert [e["FLEETLINE_RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["FLEETLINE_MASTER_ADDR"] for e in envs} == {f"{name}-r0.{name}.ml.svc"}
    # Rank 0 writes the progress file the agent reads; the others write beside it.
    assert "FLEETLINE_PROGRESS_FILE" not in envs[0]
    assert envs[2]["FLEETLINE_PROGRESS_FILE"] == str(tmp_path / "progress.jsonl.rank2")
    assert {p["spec"]["subdomain"] for p in pods} == {name}
    assert pods[0]["spec"]["hostname"] == f"{name}-r0"
    assert pods[0]["spec"]["restartPolicy"] == "Never"
    assert pods[0]["spec"]["terminationGracePeriodSeconds"] == 30
    assert pods[0]["spec"]["containers"][0]["command"][:2] == ["python", "-m"]
    assert json.loads(pods[0]["metadata"]["annotations"]["fleetline.io/meta"]) == {
        "job": "acme/Big_Train.v2", "tenant": "acme", "epoch": 7, "attempt": 2,
        "trace_id": "trace", "dir": str(tmp_path),
    }  # fmt: skip


def test_kubernetes_names_and_labels_are_valid_whatever_the_job_is_called():
    from fleetline.agents.cluster.backends.kubernetes import label_value, run_name

    long = run_name("c", "t/" + "X" * 200, 123456, 99)
    assert len(long) + len("-r99") <= 63 and re.fullmatch(r"[a-z0-9-]+", long)
    assert run_name("c", "t/a", 1, 1) != run_name("c2", "t/a", 1, 1)
    assert label_value("acme/train 1") == "acme-train-1"
    assert label_value("-" * 80 + "a") == "x"
    assert len(label_value("a" * 80)) == 63


def test_a_pod_gets_what_fleetline_set_not_the_agent_s_host_environment():
    from fleetline.agents.cluster.backends.kubernetes import pod_env

    env = {
        "PATH": os.environ["PATH"],
        "FLEETLINE_JOB": "acme/a",
        "OMP_NUM_THREADS": "1",
        "FLEETLINE_S3_ENDPOINT": os.environ.get("FLEETLINE_S3_ENDPOINT", "s3:9000"),
    }
    assert set(pod_env(env)) == {"FLEETLINE_JOB", "OMP_NUM_THREADS", "FLEETLINE_S3_ENDPOINT"} - (
        {"OMP_NUM_THREADS"} if os.environ.get("OMP_NUM_THREADS") == "1" else set()
    )


@pytest.mark.parametrize(
    ("node", "usable", "why", "ours"),
    [
        ({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}, True, "Ready", False),
        (
            {"status": {"conditions": [
                {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"}
            ]}},
            False, "NotReady (NodeStatusUnknown)", False,
        ),
        (
            {
                "spec": {"unschedulable": True},
                "metadata": {"annotations": {"fleetline.io/drained": DRAIN_REASON}},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            },
            False, f"Ready,SchedulingDisabled ({DRAIN_REASON})", True,
        ),
        (
            {"spec": {"unschedulable": True}},
            False, "NotReady (no Ready condition),SchedulingDisabled", False,
        ),
    ],
)  # fmt: skip
def test_a_kubernetes_node_is_usable_when_ready_and_not_cordoned(node, usable, why, ours):
    from fleetline.agents.cluster.backends.kubernetes import manager_node as kube_node

    node = {**node, "metadata": {"name": "n1", **node.get("metadata", {})}}
    assert kube_node(node) == ManagerNode("n1", usable, why, ours)


def test_a_kubeconfig_with_embedded_credentials_or_a_token_is_read(tmp_path):
    import base64

    from fleetline.kube import KubeApi, KubeError

    config = tmp_path / "config"
    config.write_text(
        json.dumps(  # YAML is a superset of JSON
            {
                "clusters": [{"name": "c", "cluster": {"server": "https://10.0.0.1:6443/"}}],
                "users": [{"name": "u", "user": {"token": "s3cret"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    api = KubeApi.from_kubeconfig(config)
    assert (api.server, api.token) == ("https://10.0.0.1:6443", "s3cret")
    broken = tmp_path / "broken"
    broken.write_text(json.dumps({"clusters": [], "contexts": []}))
    with pytest.raises(KubeError, match="no usable context"):
        KubeApi.from_kubeconfig(broken)
    with pytest.raises(KubeError, match="no kubeconfig at"):
        KubeApi.from_kubeconfig(tmp_path / "missing")
    bad_ca = tmp_path / "bad-ca"
    bad_ca.write_text(
        json.dumps(
            {
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": "https://h",
                            "certificate-authority-data": base64.b64encode(b"not a cert").decode(),
                        },
                    }
                ],
                "contexts": [{"name": "x", "context": {"cluster": "c"}}],
            }
        )
    )
    with pytest.raises(KubeError, match="certificate"):
        KubeApi.from_kubeconfig(bad_ca)


class _NoApi:
    """An API server that is never reached: the run's verdicts read the watch's cache only
    (deleting the ended run's Service is the one call, and its refusal is only logged)."""

    server = "https://nowhere"

    def call(self, method: str, path: str, *args: Any, **kwargs: Any) -> tuple[int, Any]:
        self.calls = [*getattr(self, "calls", []), (method, path)]
        return 200, {}


def _pod(name: str, phase: str, exit_code: int | None = None, message: str = "") -> dict:
    status: dict[str, Any] = {"phase": phase}
    if exit_code is not None:
        terminated = {"exitCode": exit_code, "reason": "Error", "message": message}
        status["containerStatuses"] = [{"state": {"terminated": terminated}}]
    return {"metadata": {"name": name}, "status": status, "spec": {"containers": [{}]}}


def test_a_kubernetes_run_ends_as_its_pods_say(tmp_path):
    from fleetline.agents.cluster.backends.kubernetes import KubernetesLauncher, KubernetesRun

    api = _NoApi()
    launcher = KubernetesLauncher("ka", api)  # type: ignore[arg-type]
    launcher.pods.listed.set()
    launcher.pods.began = launcher.pods.read = 1
    run = KubernetesRun(launcher, tmp_path, "fl-r", ("fl-r-r0", "fl-r-r1"), made_after=1)
    # Made since the last list: a pod the watch has not shown yet is not gone.
    assert run.alive()
    launcher.pods.began = launcher.pods.read = 2
    assert not run.alive()  # listed since, and missing: gone
    assert run.ended(None) == (137, "Kubernetes: pod fl-r-r0 was deleted")
    assert ("DELETE", "/api/v1/namespaces/default/services/fl-r?gracePeriodSeconds=0"
            "&propagationPolicy=Background") in api.calls  # fmt: skip
    launcher.pods.objects = {
        "fl-r-r0": _pod("fl-r-r0", "Running"),
        "fl-r-r1": _pod("fl-r-r1", "Running"),
    }
    assert run.alive()
    launcher.pods.objects["fl-r-r1"] = _pod("fl-r-r1", "Failed", 3, "loss is NaN")
    assert not run.alive()  # one worker failed: the run has
    assert run.ended(None) == (3, "Kubernetes: pod fl-r-r1 Failed (Error: loss is NaN)")
    launcher.pods.objects = {n: _pod(n, "Succeeded", 0) for n in ("fl-r-r0", "fl-r-r1")}
    assert not run.alive()
    assert run.ended(None) == (0, "Kubernetes pods fl-r-r* Succeeded")
    # The API server does not answer: nothing is known to have ended.
    launcher.pods.error = "the Kubernetes API at https://nowhere does not answer"
    launcher.pods.objects = {}
    assert run.alive()
    assert launcher.control_error() == (
        "Kubernetes: the Kubernetes API at https://nowhere does not answer"
    )


class _WatchedApi:
    """A list, then the given watch events, then a watch that stays quiet."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events
        self.shown = threading.Event()

    def ok(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        return {"items": [], "metadata": {"resourceVersion": "5"}}

    def watch(self, collection: str, query: Any, version: str, timeout_s: int) -> Any:
        yield from self.events
        self.events = []
        self.shown.set()
        time.sleep(0.05)


def _versioned(name: str, phase: str, version: int) -> dict[str, Any]:
    pod = _pod(name, phase)
    pod["metadata"]["resourceVersion"] = str(version)
    return pod


def test_a_created_pod_s_late_answer_never_hides_what_the_watch_showed_since():
    from fleetline.agents.cluster.backends.kubernetes import Informer

    # The watch shows the pod created, scheduled and running (and another made and deleted)
    # before the creating calls' answers are read.
    api = _WatchedApi(
        [
            {"type": "ADDED", "object": _versioned("fl-r-r0", "Pending", 6)},
            {"type": "MODIFIED", "object": _versioned("fl-r-r0", "Running", 8)},
            {"type": "ADDED", "object": _versioned("fl-r-r1", "Pending", 7)},
            {"type": "DELETED", "object": _versioned("fl-r-r1", "Pending", 9)},
        ]
    )
    informer = Informer(api, "/api/v1/namespaces/default/pods")  # type: ignore[arg-type]
    informer.start()
    try:
        assert api.shown.wait(5)
        informer.put(_versioned("fl-r-r0", "Pending", 6))
        informer.put(_versioned("fl-r-r1", "Pending", 7))
        assert informer.get("fl-r-r0")["status"]["phase"] == "Running"  # type: ignore[index]
        assert informer.get("fl-r-r1") is None
        informer.put(_versioned("fl-r-r2", "Pending", 10))  # one the watch has not shown yet
        assert informer.get("fl-r-r2") is not None
    finally:
        informer.close()


def test_a_slurm_run_of_several_workers_is_one_mpi_world_of_tasks(tmp_path):
    launcher = SlurmLauncher("sa")
    submitted: list[tuple[list[str], Path]] = []
    launcher.client.submit = lambda argv, script, env: submitted.append((argv, script)) or 9  # type: ignore[method-assign,func-returns-value]
    launcher.stale = lambda: None  # type: ignore[method-assign]
    workers = (("sa-n0000", (0, 1)), ("sa-n0001", (0, 1)))
    for count in (1, 2):
        request = RunRequest(
            "sa", "acme/dp", "acme", 1, 1, "t" * 32, "normal", workers[:count],
            ("trainer",), {}, tmp_path,
        )  # fmt: skip
        launcher.start(request)
        script = submitted[-1][1].read_text()
        assert "-m fleetline.agents.cluster.rank trainer" in script
        assert ("--mpi=pmix" in script) == (count == 2)
        assert f"--ntasks={count}" in script
