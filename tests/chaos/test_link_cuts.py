"""Faults on real links: the lab's namespaces (`fleetline lab`), each cluster's agent and node
agents on its own host, the control plane on the lab's address, and links cut with `ip link set
... down` (no process is frozen or killed).

- A cluster's links cut for 30 s mid-training: it is declared lost, its job resumes elsewhere
  from its last checkpoint, once; the copy left running there, cut off, is fenced when the link
  returns; the node agents' telemetry spooled during the cut arrives late, is folded, and moves
  nothing back; the parameters are bit-identical to a run never interrupted.
- One pair's link cut: the two report each other unreachable (PARTITION), both still heartbeat
  through the control plane, and nobody is evicted.
- The router on one host, a service's replicas on two others, all over mutual TLS with the
  deployment's CA and the router asking callers for a token: when the host of the replica
  nearest the clients is cut off mid-load, the router's tries there time out and go to the
  other; no request is lost beyond the retry budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from fleetline.agents.router.routing import percentile
from fleetline.agents.simulator import cluster_info, default_clusters
from fleetline.api.auth import token_digest
from fleetline.app import Options
from fleetline.demo.load import LoadPlan, run_load
from fleetline.infra import ca
from fleetline.processors.health.fold import ClusterHealthPolicy
from fleetline.processors.scheduling.client import submit
from fleetline.processors.view.model import NodeStatus
from tests.chaos.conftest import FULL, LabServices
from tests.chaos.faults import dump_threads
from tests.services import produce, submits
from tests.stack import Stack, now_ms, reference_run, running_stack
from tests.support import wait_until

CLUSTERS = ("eu-west-a", "us-east-a", "ap-south-a")  # the lab's, in the simulator's order
CUT_S = 30
ROUTER_HOST = "ap-south-a"  # where the router runs: its H200s serve none of the H100 replicas
POLICY = ClusterHealthPolicy(
    suspect_after_ms=1_500, lost_after_ms=4_000, recover_after_ms=2_000, peer_report_fresh_ms=3_000
)


@pytest.fixture(scope="module")
def pki(lab: LabServices, tmp_path_factory: pytest.TempPathFactory) -> dict[str, ca.Issued]:
    """The deployment's CA, a certificate for each cluster's host (its agent and replicas) at
    its lab address, and the router's, on the host it runs on (ap-south-a's)."""
    directory = tmp_path_factory.mktemp("tls")
    ca.init(directory)
    issued = {c: ca.issue(directory, c, [lab.lab.cluster(c).address]) for c in CLUSTERS}
    issued["router"] = ca.issue(directory, "router", [lab.lab.cluster(ROUTER_HOST).address])
    return issued


@pytest.fixture(scope="module")
def stack(lab: LabServices, pki: dict[str, ca.Issued]) -> Iterator[Stack]:
    options = Options(tick_interval_s=0.3, health_policy=POLICY, clock_interval_s=0.25)
    with running_stack(
        lab.settings,
        CLUSTERS,
        options,
        "link-cuts",
        lab=lab.lab,
        cluster_env={c: pki[c].env() for c in CLUSTERS},
    ) as built:
        yield built


def training(name: str, **workload) -> dict:
    # ap-south-a has H200s: an H100 job runs in eu-west-a (preferred) or moves to us-east-a.
    return {
        "kind": "TrainingJob",
        "metadata": {"name": name, "tenant": "acme"},
        "spec": {"accelerator": "H100", "gpus_per_worker": 2, "workers": 1, "workload": workload},
    }


def test_a_cluster_cut_for_30_s_mid_training_is_lost_resumed_once_and_fenced(
    stack: Stack, lab: LabServices, tmp_path
) -> None:
    workload = {
        # Long enough that the copy left in the cut cluster is still running when it returns
        # (at step ~850, fenced by ~1100; one found exited is fenced all the same).
        "steps": 2000 if FULL else 1200,
        "checkpoint_every_steps": 50,
        "report_every_steps": 10,
        "seed": 11,
        "step_delay_ms": 40,
    }
    key = "acme/cut"
    submit(stack.settings.kafka, stack.topics, submits(training("cut", **workload)))
    wait_until(
        lambda: any(e["event"] == "CHECKPOINTED" and e["step"] >= 100 for e in stack.events(key)),
        120,
        "two checkpoints in eu-west-a",
    )
    first = next(e for e in stack.events(key) if e["event"] == "STARTING")
    assert first["cluster_id"] == "eu-west-a"
    node = "eu-west-a-n0000"
    lab.host.cut("eu-west-a")
    cut_ms = now_ms()
    try:
        wait_until(
            lambda: any(
                h["event"] == "CLUSTER_DOWN" and h["cluster_id"] == "eu-west-a"
                for h in stack.health()
            ),
            30,
            "eu-west-a to be lost",
        )
        wait_until(
            lambda: any(
                e["event"] == "RUNNING" and e["cluster_id"] != "eu-west-a"
                for e in stack.events(key)
            ),
            60,
            "the job to run elsewhere",
        )
        # The stale copy runs on, cut off: its agent cannot tell anyone yet.
        assert not any(e["event"] == "FENCED" for e in stack.events(key))
        time.sleep(max(0.0, cut_ms / 1000 + CUT_S - time.time()))
    finally:
        lab.host.heal()
    healed_ms = now_ms()
    moved = next(
        e for e in stack.events(key) if e["event"] == "RUNNING" and e["cluster_id"] != "eu-west-a"
    )
    assert moved["epoch"] > first["epoch"]
    try:
        wait_until(
            lambda: any(
                e["event"] == "FENCED" and e["cluster_id"] == "eu-west-a" for e in stack.events(key)
            ),
            # A connection that went silent under the cut is given up within 10 s
            # (`ACROSS_LINKS`), then the agent reconnects and reads the orders.
            90,
            "the stale copy in eu-west-a to be fenced",
        )
    except AssertionError:
        log = stack.state_dir / "agent-eu-west-a.log"
        dump_threads(stack.agents["eu-west-a"].pid, log)
        seen = [(e["event"], e["cluster_id"], e["epoch"]) for e in stack.events(key)]
        raise AssertionError(
            f"not fenced; events {seen}; health {[h['event'] for h in stack.health()]}; "
            f"agent log: {log.read_text(errors='replace')[-6000:]}"
        ) from None
    wait_until(lambda: stack.phase(key) == "Succeeded", 180, "the job to finish")
    events = stack.events(key)
    # Resumed once: two runs, the first in eu-west-a, the second where it moved.
    runs = sorted({(e["epoch"], e["cluster_id"]) for e in events if e["event"] == "RUNNING"})
    assert runs == [(first["epoch"], "eu-west-a"), (moved["epoch"], moved["cluster_id"])], runs
    done = [e for e in events if e["event"] == "EXITED" and e["epoch"] == moved["epoch"]]
    assert len(done) == 1 and done[0]["exit_code"] == 0
    reference = reference_run(stack, tmp_path, **workload)
    assert done[0]["detail"] == f"params sha256 {reference[-1]['params_sha256']}"
    job = stack.job(key)
    assert job is not None and job["epoch"] == moved["epoch"]
    # The node's telemetry from the cut was spooled on its host and arrives late, in order,
    # with no gap; the view folds it and the node is UP again, and nothing moved back.

    def caught_up() -> bool:
        view = stack.fleet.view.read(lambda v: v.nodes.get(node))
        return view is not None and view.telemetry_ts > healed_ms

    wait_until(caught_up, 60, "the cut node's spooled telemetry")
    samples = [
        r for r in stack.records(stack.topics.telemetry, partitions=2) if r["node_id"] == node
    ]
    during = [r for r in samples if cut_ms + 2_000 < r["ts"] < healed_ms - 2_000]
    assert len(during) >= (CUT_S - 6) * 2, len(during)  # every 500 ms of the cut
    # In the order the node made them, none missing (its NodeStates take seq numbers too). No
    # send times out (`agents/runtime.SENDS`): one whose acknowledgement the cut swallowed is
    # retried in order, and a repeat that reaches the topic is folded once by its seq.
    seqs = [r["seq"] for r in samples]
    firsts = list(dict.fromkeys(seqs))
    assert firsts == sorted(firsts), "telemetry out of order"
    repeats = len(seqs) - len(firsts)
    assert repeats <= len(during) // 10, f"{repeats} repeats"
    states = {
        r["seq"]
        for r in stack.records(stack.topics.node_state, partitions=2)
        if r["node_id"] == node
    }
    made = set(firsts) | states
    assert made >= set(range(firsts[0], firsts[-1] + 1)), "telemetry missing"
    status = stack.fleet.view.read(lambda v: v.nodes[node].state)
    assert status == NodeStatus.UP
    assert stack.job(key)["epoch"] == moved["epoch"]
    assert not [
        e for e in stack.events(key) if e["event"] == "RUNNING" and e["epoch"] > moved["epoch"]
    ]


def test_one_pair_s_link_cut_evicts_nobody(stack: Stack, lab: LabServices) -> None:
    wait_until(
        lambda: (
            {h["cluster_id"]: h["state"] for h in stack.health()}
            == dict.fromkeys(CLUSTERS, "HEALTHY")
        ),
        60,
        "every cluster healthy",
    )
    before = len(stack.health())
    lab.host.cut("eu-west-a", "us-east-a")
    try:
        wait_until(
            lambda: (
                {
                    (h["cluster_id"], h["peer"])
                    for h in stack.health()[before:]
                    if h["event"] == "PARTITION" and not h["link_up"]
                }
                >= {("eu-west-a", "us-east-a"), ("us-east-a", "eu-west-a")}
            ),
            30,
            "both ends of the cut link to be reported",
        )
        cut = min(
            h["ts"]
            for h in stack.health()[before:]
            if h["event"] == "PARTITION" and not h["link_up"]
        )
        # Not a sleep: the fold has folded the clock past the moment a loss would be declared.
        stack.health_past(cut + POLICY.lost_after_ms + 1_000)
        after = stack.health()[before:]
        assert not [h for h in after if h["event"] in ("CLUSTER_DOWN", "FENCE")], after
        latest = {h["cluster_id"]: h["state"] for h in stack.health()}
        assert latest == dict.fromkeys(CLUSTERS, "HEALTHY")
        # Neither lost the third cluster.
        assert not [
            h
            for h in after
            if h["event"] == "PARTITION" and "ap-south-a" in (h["cluster_id"], h["peer"])
        ]
    finally:
        lab.host.heal()
    wait_until(
        lambda: any(h["event"] == "PARTITION" and h["link_up"] for h in stack.health()[before:]),
        30,
        "the link to heal",
    )


CHAT = {
    "kind": "InferenceService",
    "metadata": {"name": "chat", "tenant": "acme"},
    "spec": {
        "model": "tiny",
        "accelerator": "H100",
        # A whole node each: one replica in eu-west-a, the other in us-east-a.
        "gpus_per_replica": 8,
        "replicas": {"min": 2, "max": 2},
        "latency_target_ms": 500,
        "regions": ["eu-west", "us-east"],
        "workload": {},
        "serving": {"concurrency": 4, "compute_ms": 5},
    },
}
TOKEN = "fl_acme_load"
# Inference answers in milliseconds here: a try that hears nothing for a second is given up.
ROUTER_POLICY = {"timeout_ms": 1000, "retry_budget_min": 20}
WARM_S, LOAD_S, CUT_AT_S, RPS = 3.0, 24.0, 8.0, 10.0


def serving_replicas(stack: Stack) -> dict[str, dict[str, Any]]:
    """The service's replicas that the registry has READY, by cluster."""
    return {r["cluster_id"]: r for r in stack.replicas().values() if r["state"] == "READY"}


def where_the_replicas_stand(stack: Stack) -> str:
    jobs = [stack.job(f"acme/chat.r{i}") for i in range(2)]
    facts = [
        {
            k: j.get(k)
            for k in ("key", "phase", "queued_reason", "allocation", "ordered_cluster", "actual")
        }
        for j in jobs
        if j is not None
    ]
    latest = {h["cluster_id"]: h["state"] for h in stack.health()}
    registry = {k: (r["cluster_id"], r["state"]) for k, r in stack.replicas().items()}
    return json.dumps(
        {"replicas": facts, "health": latest, "registry": registry}, default=str, sort_keys=True
    )


def test_the_router_fails_over_when_a_replicas_host_is_cut_off(
    stack: Stack, lab: LabServices, pki: dict[str, ca.Issued], tmp_path
) -> None:
    # The clusters as an operator declares them: eu-west's clients are 0.5 ms from eu-west-a
    # and 75 ms from us-east-a, so the router sends them to eu-west-a while it answers.
    produce(
        stack.settings,
        stack.topics,
        [("ClusterInfo", cluster_info(c, 1, now_ms())) for c in default_clusters(1, 3)],
    )
    submit(stack.settings.kafka, stack.topics, submits(CHAT))
    try:
        wait_until(
            lambda: set(serving_replicas(stack)) == {"eu-west-a", "us-east-a"},
            120,
            "a ready replica in eu-west-a and one in us-east-a",
        )
    except AssertionError as exc:
        # What the scheduler and the registry say, so a failure here can be read.
        raise AssertionError(f"{exc}: {where_the_replicas_stand(stack)}") from None
    replicas = serving_replicas(stack)
    for cluster, record in replicas.items():
        assert record["address"].startswith(f"https://{lab.lab.cluster(cluster).address}:")
    auth = tmp_path / "auth.yaml"
    auth.write_text(
        json.dumps(
            {"tokens": [{"name": "acme-load", "sha256": token_digest(TOKEN), "role": "user",
                         "tenant": "acme"}]}
        )
    )  # fmt: skip
    policy = tmp_path / "routing.json"
    policy.write_text(json.dumps(ROUTER_POLICY))
    address = lab.lab.cluster(ROUTER_HOST).address
    port = 8443
    router = stack._spawn(
        ROUTER_HOST,
        [
            sys.executable, "-m", "fleetline.cli", "router", "--port", str(port), "--no-report",
            "--policy", str(policy), "--topic-prefix", stack.topics.prefix,
        ],
        "router.log",
        {**pki["router"].env(), "FLEETLINE_AUTH_CONFIG": str(auth)},
    )  # fmt: skip
    url = f"https://{address}:{port}"
    trust = ssl.create_default_context(cafile=str(pki["router"].ca))

    def routes() -> dict[str, Any]:
        with urllib.request.urlopen(f"{url}/v1/routes", timeout=5, context=trust) as answer:
            return json.loads(answer.read())

    def routed() -> bool:
        try:
            services = routes()["services"]
        except OSError:
            return False
        return len(services.get("acme/chat", {}).get("weights", [])) == 2

    try:
        wait_until(routed, 60, "the router to route to both replicas")
        # No token: refused before any replica is tried.
        request = urllib.request.Request(
            f"{url}/v1/services/acme/chat/infer", data=b"{}", method="POST"
        )
        try:
            urllib.request.urlopen(request, timeout=5, context=trust)
            raise AssertionError("a request without a token was served")
        except urllib.error.HTTPError as refused:
            assert refused.code == 401
        plan = LoadPlan(
            url,
            "acme/chat",
            {"eu-west": 1.0},
            steps=[(0.0, RPS)],
            duration_s=WARM_S,
            timeout_s=10.0,
            labs=(str(lab.lab.subnet),),
            token=TOKEN,
            ca_file=str(pki["router"].ca),
        )
        warm = Counter(o.replica for o in asyncio.run(run_load(plan)).outcomes)
        near, far = replicas["eu-west-a"]["replica"], replicas["us-east-a"]["replica"]
        assert warm.most_common(1)[0][0] == near, warm
        cut_at: list[float] = []

        def cut_mid_load() -> None:
            time.sleep(CUT_AT_S)
            lab.host.cut("eu-west-a")
            cut_at.append(CUT_AT_S)

        cutter = threading.Thread(target=cut_mid_load, daemon=True)
        cutter.start()
        try:
            result = asyncio.run(run_load(dataclasses.replace(plan, duration_s=LOAD_S)))
        finally:
            cutter.join()
            counters = routes()["counters"]
            lab.host.heal()
    finally:
        router.terminate()
        router.wait(10)
    outcomes = result.outcomes
    assert cut_at and len(outcomes) >= LOAD_S * RPS * 0.9, len(outcomes)
    failed = [o for o in outcomes if o.status != 200]
    # Served in eu-west-a until the cut, in us-east-a alone after it.
    before = Counter(o.replica for o in outcomes if o.at_s < CUT_AT_S - 1 and o.status == 200)
    after = {o.replica for o in outcomes if o.at_s > CUT_AT_S + 6 and o.status == 200}
    assert before.most_common(1)[0][0] == near, before
    assert after == {far}, after
    # The tries that went to the cut host timed out and were retried elsewhere: nothing lost
    # but what the retry budget refused.
    assert counters["retries"] > 0, counters
    assert len(failed) == counters["budget_exhausted"] == counters["failed"], (failed, counters)
    assert counters["unauthenticated"] == 1 and counters["forbidden"] == 0
    retried = [o for o in outcomes if o.tries > 1]
    print(
        "router failover:",
        json.dumps(
            {
                "requests": len(outcomes),
                "failed": len(failed),
                "retried": len(retried),
                "retried_p50_ms": round(percentile(sorted(o.ms for o in retried), 50), 1)
                if retried
                else None,
                "counters": counters,
            }
        ),
    )
