"""The Kubernetes backend on a real Kubernetes control plane: kube-apiserver, kube-scheduler,
kube-controller-manager and etcd built from their Go modules, nodes kept by kwok (started as
`fleetline infra start --kubernetes` starts them). Cluster `ka`, the only one, runs its
workloads as pods. kwok runs no container: a pod is scheduled by the real kube-scheduler and kwok
marks it Running; the tests end pods as a kubelet would, by writing their status.

In order: a job's pods are made on the placement's node with its GPU requests, scheduled, and
reported RUNNING; a pod that fails is reported with its exit code and the job retried, and pods
that succeed end the job; a cluster agent killed with SIGKILL re-adopts its pods and makes none
twice (its run directory without the record of its pods, as if killed between making and
recording them), and a deleted job's pods are deleted with a grace period; pods of a run no
order wants (left by an agent whose state directory is gone) are found by label and deleted; an
order for a node Kubernetes does not know fails with its message; an API server that refuses
the agent (401) is the cluster's control error in the server's words; a cordon in fleetline
cordons the Kubernetes node, and an operator's cordon there fences the node in fleetline.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from fleetline.agents.cluster.backends import RunRequest
from fleetline.agents.cluster.backends.kubernetes import KubernetesLauncher, label_value
from fleetline.app import Options
from fleetline.config import Settings
from fleetline.infra.kubernetes import KwokCluster
from fleetline.kube import KubeApi, KubeError
from fleetline.processors.health.fold import ClusterHealthPolicy
from fleetline.processors.scheduling.client import submit
from fleetline.processors.scheduling.codec import new_request
from tests.services import submits
from tests.stack import Stack, now_ms, running_stack, training
from tests.support import wait_until

pytestmark = pytest.mark.services
POLICY = ClusterHealthPolicy(
    suspect_after_ms=3_000, lost_after_ms=20_000, recover_after_ms=2_000, peer_report_fresh_ms=3_000
)
PODS = "/api/v1/namespaces/default/pods"


@pytest.fixture(scope="module")
def kube(services: Settings) -> Iterator[KwokCluster]:
    # The binaries are built once into the cache (about 20 minutes on two cores the first time).
    cluster = KwokCluster.parse(services.cache_dir, "ka:1")
    cluster.stop()  # one left by an interrupted run
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def stack(services: Settings, kube: KwokCluster) -> Iterator[Stack]:
    options = Options(tick_interval_s=0.3, health_policy=POLICY, clock_interval_s=0.25)
    agent_args = {"ka": ["--backend", "kubernetes", "--kubeconfig", str(kube.kubeconfig)]}
    with running_stack(
        services, ("ka",), options, "kube", commands=True, agent_args=agent_args
    ) as built:
        yield built


def pods(kube: KwokCluster, job: str) -> list[dict[str, Any]]:
    listed = kube.api().get(f"{PODS}?labelSelector=fleetline.io/job={label_value(job)}")
    return sorted(listed["items"], key=lambda p: p["metadata"]["name"])


def end_pod(kube: KwokCluster, pod: dict[str, Any], phase: str, exit_code: int) -> None:
    """What a kubelet writes when the container exits."""
    terminated = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error"}
    if exit_code:
        terminated["message"] = "loss is NaN at step 7"
    status = {
        "status": {
            "phase": phase,
            "containerStatuses": [
                {
                    "name": "worker",
                    "image": pod["spec"]["containers"][0]["image"],
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": terminated},
                }
            ],
        }
    }
    kube.api().ok(
        "PATCH",
        f"{PODS}/{pod['metadata']['name']}/status",
        status,
        content_type="application/merge-patch+json",
    )


# Nothing runs on kwok's nodes: a failed pod is retried at once.
RETRY = {"max_attempts": 3, "backoff_s": 0.1}


def running(stack: Stack, key: str) -> list[dict[str, Any]]:
    return [e for e in stack.events(key) if e["event"] == "RUNNING"]


def test_a_job_s_pods_run_on_its_placement_and_their_ends_are_reported(stack, kube):
    submit(
        stack.settings.kafka,
        stack.topics,
        submits(training("through-kubernetes", RETRY, steps=100)),
    )
    key = "acme/through-kubernetes"
    wait_until(lambda: running(stack, key), 60, "the pods to run")
    starting = next(e for e in stack.events(key) if e["event"] == "STARTING")
    assert starting["cluster_id"] == "ka"
    assert "Kubernetes Service fl-acme-through-kubernetes-e" in starting["detail"]
    made = pods(kube, key)
    assert [p["metadata"]["labels"]["fleetline.io/rank"] for p in made] == ["0"]
    for pod in made:
        labels = pod["metadata"]["labels"]
        assert (labels["fleetline.io/epoch"], labels["fleetline.io/attempt"]) == (
            str(starting["epoch"]),
            str(starting["attempt"]),
        )
        # Scheduled by kube-scheduler onto the node fleetline chose, with its GPUs requested.
        assert pod["spec"]["nodeName"] == "ka-n0000"
        assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
        term = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"][0]["matchExpressions"][0]
        assert term["values"] == ["ka-n0000"]
        assert pod["status"]["phase"] == "Running"
    secret = kube.api().get(f"/api/v1/namespaces/default/secrets/{made[0]['spec']['subdomain']}")
    assert "FLEETLINE_CHECKPOINT_BUCKET" in secret["data"]
    assert "PATH" not in secret["data"]  # the agent's own host environment stays out
    assert running(stack, key)[0]["detail"].endswith("on ka-n0000 (2 nvidia.com/gpu)")

    # The container fails: the run fails with its exit code, and is retried.
    end_pod(kube, made[0], "Failed", 3)

    def failed() -> list[dict[str, Any]]:
        return [e for e in stack.events(key) if e["event"] == "FAILED"]

    wait_until(failed, 30, "the failure to be reported")
    assert failed()[0]["exit_code"] == 3
    assert failed()[0]["detail"] == (
        f"Kubernetes: pod {made[0]['metadata']['name']} Failed (Error: loss is NaN at step 7)"
    )
    wait_until(lambda: len(running(stack, key)) == 2, 60, "the retry to run")
    # The failed run's pods are gone with it; the retry's are new.
    wait_until(
        lambda: {p["metadata"]["uid"] for p in pods(kube, key)}.isdisjoint(
            p["metadata"]["uid"] for p in made
        ),
        30,
        "the failed run's pods to be deleted",
    )
    retry = pods(kube, key)
    assert {p["metadata"]["labels"]["fleetline.io/attempt"] for p in retry} == {
        str(starting["attempt"] + 1)
    }
    for pod in retry:
        end_pod(kube, pod, "Succeeded", 0)
    wait_until(lambda: stack.phase(key) == "Succeeded", 30, "the job to succeed")
    exits = [e["exit_code"] for e in stack.events(key) if e["event"] == "EXITED"]
    assert exits == [3, 0]


def test_a_killed_agent_re_adopts_its_pods_and_a_deleted_job_s_pods_are_deleted(stack, kube):
    submit(stack.settings.kafka, stack.topics, submits(training("adopted", RETRY, steps=100)))
    key = "acme/adopted"
    wait_until(lambda: running(stack, key), 60, "the pod to run")
    before = [p["metadata"]["uid"] for p in pods(kube, key)]
    stack.kill_agent("ka")
    # As if killed between making the pods and recording them: found again by label.
    (record,) = (stack.state_dir / "agents" / "ka").glob("acme_adopted/*/kubernetes-run")
    record.unlink()
    stack.start_agent("ka")
    log = stack.state_dir / "agent-ka.log"
    wait_until(lambda: "adopted acme/adopted" in log.read_text(), 60, "the agent to adopt")
    # Not a sleep: passes of its loop after the adoption, each of which would have made the
    # pods again (reconcile) had it not adopted them.
    adopted_at = stack.agent_passes("ka")
    wait_until(lambda: stack.agent_passes("ka") >= adopted_at + 3, 30, "three passes of its loop")
    assert [p["metadata"]["uid"] for p in pods(kube, key)] == before
    assert len([e for e in stack.events(key) if e["event"] == "STARTING"]) == 1
    submit(
        stack.settings.kafka,
        stack.topics,
        [new_request("DELETE", key, "acme", now_ms(), "del-adopted")],
    )
    wait_until(lambda: not pods(kube, key), 60, "the pod to be deleted")
    wait_until(lambda: [e for e in stack.events(key) if e["event"] == "STOPPED"], 30, "STOPPED")
    stopped = [e for e in stack.events(key) if e["event"] == "STOPPED"]
    assert stopped[0]["cluster_id"] == "ka"


def test_pods_of_a_run_no_order_wants_are_found_by_label_and_deleted(stack, kube, tmp_path):
    # A run of an epoch long gone, left in Kubernetes by an agent whose state directory was lost.
    launcher = KubernetesLauncher("ka", kube.api(), grace_s=1)
    request = RunRequest(
        "ka", "acme/ghost", "acme", 1, 0, "ghost", "normal", (("ka-n0000", (0,)),),
        (sys.executable, "-c", "pass"), {"FLEETLINE_JOB": "acme/ghost"}, tmp_path,
    )  # fmt: skip
    launcher.start(request)
    wait_until(
        lambda: [p["status"].get("phase") for p in pods(kube, "acme/ghost")] == ["Running"],
        30,
        "the ghost to run",
    )
    stack.kill_agent("ka")
    stack.start_agent("ka")
    wait_until(lambda: not pods(kube, "acme/ghost"), 60, "the ghost's pod to be deleted")

    def fenced() -> list[dict[str, Any]]:
        return [e for e in stack.events("acme/ghost") if e["event"] == "FENCED"]

    wait_until(fenced, 30, "the ghost's end to be reported")
    assert [(e["cluster_id"], e["epoch"], e["attempt"]) for e in fenced()] == [("ka", 1, 0)]


def test_an_order_for_a_node_kubernetes_does_not_know_fails_with_its_message(kube, tmp_path):
    launcher = KubernetesLauncher("ka", kube.api())
    request = RunRequest(
        "ka", "acme/nowhere", "acme", 1, 0, "t", "normal", (("ka-n9999", (0,)),),
        ("true",), dict(os.environ), tmp_path,
    )  # fmt: skip
    with pytest.raises(KubeError, match=r'ka-n9999: .*nodes "ka-n9999" not found'):
        launcher.start(request)
    assert not pods(kube, "acme/nowhere")


def test_an_api_server_that_refuses_the_agent_is_its_control_error(kube, tmp_path):
    # A kubeconfig with the cluster's CA and a token the API server does not know.
    ca = next(
        line.split(":", 1)[1].strip()
        for line in kube.kubeconfig.read_text().splitlines()
        if line.strip().startswith("certificate-authority:")
    )
    config = tmp_path / "refused.kubeconfig"
    config.write_text(
        yaml.safe_dump(
            {
                "clusters": [
                    {
                        "name": "ka",
                        "cluster": {"server": kube.api().server, "certificate-authority": ca},
                    }
                ],
                "users": [{"name": "nobody", "user": {"token": "not-a-token"}}],
                "contexts": [{"name": "ka", "context": {"cluster": "ka", "user": "nobody"}}],
                "current-context": "ka",
            }
        )
    )
    launcher = KubernetesLauncher("ka", KubeApi.from_kubeconfig(config))
    launcher.refresh()
    wait_until(launcher.control_error, 15, "the refusal")
    assert launcher.control_error().startswith("Kubernetes: GET /api/v1/")
    assert "401 Unauthorized" in launcher.control_error()


def test_a_cordon_cordons_the_node_and_an_operator_s_cordon_fences_it(stack, kube, monkeypatch):
    from fleetline.cli import main
    from tests.services import signed_in

    def node() -> dict[str, Any]:
        return kube.api().get("/api/v1/nodes/ka-n0000")

    def fences() -> list[tuple[str, str]]:
        return [
            (r["kind"], r["detail"])
            for r in stack.records(stack.topics.scheduler_requests)
            if r["kind"] in ("FENCE", "UNFENCE") and r["key"] == "ka-n0000"
        ]

    signed_in(monkeypatch, stack.api_url, "ops")
    prefix = ["--cluster-id", "ka"]
    assert main(["command", "ka-n0000", "CORDON", *prefix]) == 0
    wait_until(lambda: node()["spec"].get("unschedulable"), 60, "the node to be cordoned")
    assert node()["metadata"]["annotations"]["fleetline.io/drained"] == "fleetline: cordoned"
    assert main(["command", "ka-n0000", "UNCORDON", *prefix]) == 0
    wait_until(lambda: not node()["spec"].get("unschedulable"), 60, "the node to be uncordoned")
    assert "fleetline.io/drained" not in node()["metadata"].get("annotations", {})
    assert fences() == []  # fleetline's own cordon is not an outage
    # `kubectl cordon` by the cluster's operator: out of service for fleetline too.
    patch = {"spec": {"unschedulable": True}}
    path = "/api/v1/nodes/ka-n0000"
    kube.api().ok("PATCH", path, patch, content_type="application/merge-patch+json")
    try:
        wait_until(fences, 30, "the node to be fenced")
        assert fences()[0] == ("FENCE", "Kubernetes: Ready,SchedulingDisabled")
    finally:
        patch = {"spec": {"unschedulable": False}}
        kube.api().ok("PATCH", path, patch, content_type="application/merge-patch+json")
    wait_until(lambda: len(fences()) == 2, 30, "the node to be unfenced")
    assert fences()[1] == ("UNFENCE", "Kubernetes returned it to service")
