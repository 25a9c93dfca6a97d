"""Inference that serves and breathes, on the real stack: the services of `fleetline serve`,
one `fleetline cluster-agent` process per one-node cluster (eu-west and us-east, 8 GPUs
each) running real replicas (`fleetline workload serve`) and training, a `fleetline router`
process and a `fleetline load` process.

One compressed day: training fills the clusters; a service starts with one serving replica
and a warm standby in its home region; a morning ramp of requests makes it scale out, the
standby first, then in eu-west up to that cluster's inference pool (preempting the training
there through a checkpoint), then in us-east; a replica is killed mid-load and the router
retries its requests elsewhere; p95 settles under the target; at night the replicas drain one
by one (us-east first) and the training gets its GPUs back and resumes from its checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from fleetline.app import Options
from fleetline.cli import main
from fleetline.config import Settings
from fleetline.processors.scheduling.client import decisions_of, submit
from fleetline.processors.scheduling.codec import canonical_json, new_request
from tests.services import service_env, submits
from tests.stack import Stack, now_ms, running_stack
from tests.support import wait_until

pytestmark = pytest.mark.services
CLUSTERS = ("sa", "sb")
REGIONS = {"sa": "eu-west", "sb": "us-east"}
LATENCY_TARGET_MS = 400
CHECKPOINT_EVERY = 100
# What the test measured, for the closing note's figures (printed with -s).
FIGURES: dict[str, Any] = {}


@pytest.fixture(scope="module")
def stack(services: Settings) -> Iterator[Stack]:
    options = Options(tick_interval_s=1.0, clock_interval_s=0.25)
    with running_stack(services, CLUSTERS, options, "serving", regions=REGIONS) as built:
        yield built
    print("serving figures:", json.dumps(FIGURES))


def training(name: str, gpus: int, tensor: int) -> dict[str, Any]:
    return {
        "kind": "TrainingJob",
        "metadata": {"name": name, "tenant": "acme"},
        "spec": {
            "accelerator": "H100",
            "gpus_per_worker": gpus,
            "workers": 1,
            "parallelism": {"tensor": tensor},
            "priority_class": "low",
            "checkpoint_interval_s": 60,
            "workload": {
                "steps": 1_000_000,
                "step_delay_ms": 20,
                "checkpoint_every_steps": CHECKPOINT_EVERY,
            },
        },
    }


CHAT = {
    "kind": "InferenceService",
    "metadata": {"name": "chat", "tenant": "acme"},
    "spec": {
        "model": "tiny",
        "accelerator": "H100",
        "gpus_per_replica": 1,
        "replicas": {"min": 1, "max": 6},
        "latency_target_ms": LATENCY_TARGET_MS,
        "regions": ["eu-west", "us-east"],
        "workload": {},
        "serving": {"concurrency": 2, "compute_ms": 100},
        "autoscaling": {
            "target_utilisation": 0.5,
            "scale_out_cooldown": 2,
            "scale_in_cooldown": 4,
            "hysteresis": 0.3,
            "warm_standby": 1,
        },
    },
}


def endpoints(stack: Stack) -> list[dict[str, Any]]:
    return stack.records(stack.topics.replicas)


def serving_jobs(stack: Stack) -> dict[str, dict[str, Any]]:
    """The service's live replicas, as the scheduler committed them."""
    assert stack.fleet.scheduler is not None
    return {
        j["key"]: j
        for j in stack.fleet.scheduler.jobs("acme")
        if j.get("service") == "acme/chat" and j["phase"] not in ("Deleted", "Failed", "Succeeded")
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fleetline(stack: Stack, *args: str, **kwargs: Any) -> subprocess.Popen[bytes]:
    env = {**os.environ, **service_env(stack.settings)}
    return subprocess.Popen(
        [sys.executable, "-m", "fleetline.cli", *args], env=env, start_new_session=True, **kwargs
    )


def routes_of(url: str, region: str) -> dict[str, Any]:
    return json.loads(
        subprocess.run(
            ["curl", "-s", f"{url}/v1/routes?region={region}"], capture_output=True, check=True
        ).stdout
    )


def kill_the_preferred_replica(stack: Stack, url: str) -> str:
    """SIGKILL the ready replica the router ranks first for eu-west clients: the one the next
    requests go to, so its death is met by the router (a replica it seldom picks might see no
    request before the registry learns it is gone)."""
    ready = {k for k, r in stack.replicas().items() if r["state"] == "READY"}
    ranked = [
        w["replica"]
        for w in routes_of(url, "eu-west")["services"]["acme/chat"]["weights"]
        if w["replica"] in ready
    ]
    assert ranked, (ready, "the router ranks no ready replica")
    victim = ranked[0]
    record = stack.replicas()[victim]
    run = (
        stack.state_dir
        / "agents"
        / record["cluster_id"]
        / victim.replace("/", "_")
        / f"e{record['epoch']:010d}-a{record['attempt']:04d}"
    )
    os.kill(int((run / "child.pid").read_text()), signal.SIGKILL)
    return victim


def test_a_compressed_day_scales_out_by_region_fails_over_and_gives_training_back(stack):
    submit(
        stack.settings.kafka,
        stack.topics,
        [
            new_request(
                "POLICY",
                "",
                "",
                now_ms(),
                "pools",
                spec_json=canonical_json(
                    {
                        "cluster_preference": list(CLUSTERS),
                        "weights": {"preference": 100},
                        "inference_pools": {"*": {"max_share": 0.5}},
                    }
                ),
            )
        ],
    )
    submit(stack.settings.kafka, stack.topics, submits(training("train", 6, 2)))
    wait_until(lambda: stack.phase("acme/train") == "Running", 60, "train running")
    submit(stack.settings.kafka, stack.topics, submits(training("other", 4, 4)))
    wait_until(lambda: stack.phase("acme/other") == "Running", 60, "other running")
    assert stack.job("acme/train")["allocation"].keys() == {"sa"}
    assert stack.job("acme/other")["allocation"].keys() == {"sb"}

    submit(stack.settings.kafka, stack.topics, submits(CHAT))
    wait_until(
        lambda: {r["state"] for r in stack.replicas().values()} == {"READY", "WARM"},
        60,
        "a serving replica ready and a warm standby loaded",
    )
    assert {r["cluster_id"] for r in stack.replicas().values()} == {"sa"}  # home region

    port = free_port()
    router_log = open(stack.state_dir / "router.log", "wb")  # noqa: SIM115
    router = fleetline(
        stack,
        "router",
        "--open",
        "--port",
        str(port),
        "--topic-prefix",
        stack.topics.prefix,
        stdout=router_log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: b"listening" in (stack.state_dir / "router.log").read_bytes(), 60)
        url = f"http://127.0.0.1:{port}"
        began = time.monotonic()
        load = fleetline(
            stack,
            "load",
            "acme/chat",
            "--router",
            url,
            "--region",
            "eu-west=1",
            "--steps",
            "0:4,6:60,42:2",
            "--duration-s",
            "80",
            "--json",
            stdout=subprocess.PIPE,
        )
        # Mid-morning, at full load: a replica dies under the router's feet.
        wait_until(lambda: time.monotonic() - began > 26, 40)
        killed = kill_the_preferred_replica(stack, url)
        out, _ = load.communicate(timeout=150)
        summary = json.loads(out)
        routes = routes_of(url, "eu-west")
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(20)

    # Scale-out: the home region's cluster up to its inference pool (4 of its 8 GPUs), then
    # us-east; the standby promoted first.
    decisions = [d for d in decisions_of(stack.settings.kafka, stack.topics)]
    placed = [
        d for d in decisions if d["job"].startswith("acme/chat.r") and d["outcome"] == "PLACED"
    ]
    first = [d["placements"][0]["cluster_id"] for d in placed]
    assert "sb" in first and first.index("sb") > 0
    assert all(c == "sa" for c in first[: first.index("sb")]), first
    scaled = [d for d in decisions if d["job"] == "acme/chat" and d["outcome"] == "SCALED"]
    outs = [d["reason"] for d in scaled if d["reason"].startswith("scale out")]
    assert "promoted acme/chat.r1 from warm standby" in outs[0]
    assert max(int(r.split(" -> ")[1].split()[0]) for r in outs) == 6, outs  # max_replicas reached
    preempted = [d for d in decisions if d["job"] == "acme/train" and d["outcome"] == "PREEMPTED"]
    assert preempted and "preempted by acme/chat.r" in preempted[0]["reason"]

    # The killed replica cost no request: the router tried another.
    assert summary["failed"] == 0, (killed, summary)
    assert routes["counters"]["retries"] >= 1 and routes["counters"]["budget_exhausted"] == 0
    # No request ever reached a replica before it was ready; standbys served only their probe.
    records = endpoints(stack)
    assert max(r["refused"] for r in records) == 0
    warm = [r for r in records if r["state"] == "WARM"]
    assert warm and all(r["served"] <= 1 for r in warm), warm

    # After the scale-out settles (the last third of the day's peak), p95 is under target.
    settled = [b for b in summary["buckets"] if 28 <= b["from_s"] < 42 and b["ok"]]
    assert settled and all(b["p95_ms"] < LATENCY_TARGET_MS for b in settled), summary["buckets"]

    # Night: drained back to the minimum, us-east first; the training resumed from its
    # checkpoint in eu-west.
    wait_until(
        lambda: sum(1 for j in serving_jobs(stack).values() if j["role"] == "serving") == 1,
        60,
        "the service drained to its minimum",
    )
    ins = [d["reason"] for d in scaled if d["reason"].startswith("scale in")]
    drained = [r.rsplit("draining ", 1)[1] for r in ins]
    assert len(drained) >= 5
    wait_until(lambda: stack.phase("acme/train") == "Running", 60, "train running again")
    assert stack.job("acme/train")["allocation"].keys() == {"sa"}
    events = stack.events("acme/train")
    stops = [e for e in events if e["event"] == "CHECKPOINTED"]
    resumed = [e for e in events if e["event"] == "RESTORED" and e["step"] is not None]
    assert resumed, "the training resumed from a checkpoint"
    progress_before = max(
        e["step"] for e in events if e["event"] == "PROGRESS" and e["ts"] < resumed[-1]["ts"]
    )
    assert progress_before - resumed[-1]["step"] <= CHECKPOINT_EVERY
    assert stops

    FIGURES.update(
        {
            "requests": summary["requests"],
            "retried": summary["retried"],
            "failed": summary["failed"],
            "router_retries": routes["counters"]["retries"],
            "p95_settled_ms": max(b["p95_ms"] for b in settled),
            "max_serving": 6,
            "killed": killed,
        }
    )
    FIGURES.update(start_times(decisions, records))


def start_times(decisions: list[dict[str, Any]], records: list[dict[str, Any]]) -> dict[str, Any]:
    """Cold start (a new replica: its scale-out decision to its first READY record) and warm
    (a standby promoted: the decision to its READY record)."""
    ready_at: dict[str, int] = {}
    for r in records:
        if r["state"] == "READY":
            ready_at.setdefault(r["replica"], r["ts"])
    cold, warm = [], []
    for d in decisions:
        if d["job"] != "acme/chat" or not d["reason"].startswith("scale out"):
            continue
        for part in d["reason"].split("; ")[1:]:
            if part.startswith("promoted "):
                replica = part.split()[1]
                if replica in ready_at:
                    warm.append(ready_at[replica] - d["ts"])
            elif part.startswith("new "):
                replica = part.split()[1]
                if replica in ready_at:
                    cold.append(ready_at[replica] - d["ts"])
    return {"cold_start_ms": sorted(cold), "warm_start_ms": sorted(warm)}


def test_small_replicas_share_one_gpu_and_each_serves(stack):
    small = {
        "kind": "InferenceService",
        "metadata": {"name": "small", "tenant": "acme"},
        "spec": {
            "model": "tiny",
            "accelerator": "H100",
            "gpus_per_replica": 0.5,
            "replicas": {"min": 2, "max": 2},
            "latency_target_ms": LATENCY_TARGET_MS,
            "regions": ["eu-west", "us-east"],
            "workload": {},
            "serving": {"concurrency": 2, "compute_ms": 5},
        },
    }
    submit(stack.settings.kafka, stack.topics, submits(small))

    def ready() -> list[dict[str, Any]]:
        return [
            r
            for r in stack.replicas().values()
            if r["service"] == "acme/small" and r["state"] == "READY"
        ]

    wait_until(lambda: len(ready()) == 2, 60, "both small replicas ready")
    jobs = {j["key"]: j for j in stack.fleet.scheduler.jobs("acme")}
    gpus = {
        (cluster, node, mask)
        for key in ("acme/small.r0", "acme/small.r1")
        for cluster, nodes in jobs[key]["allocation"].items()
        for node, mask in nodes.items()
    }
    assert len(gpus) == 1, gpus  # two halves of one GPU
    started = [
        e
        for e in stack.events()
        if e["job"].startswith("acme/small.r") and e["event"] == "STARTING"
    ]
    assert len(started) == 2
    assert all("GPU share 0.5 of" in e["detail"] for e in started), started[0]["detail"]
    assert all("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in e["detail"] for e in started)
    # Each half answers (called directly: the router has gone with the first test).
    for r in ready():
        out = subprocess.run(
            ["curl", "-s", "-XPOST", f"{r['address']}/v1/infer", "-d", '{"inputs": null}'],
            capture_output=True,
            check=True,
        )
        assert json.loads(out.stdout)["replica"] == r["replica"]


def test_explain_on_a_service_shows_replicas_registry_load_and_weights(stack, monkeypatch, capsys):
    for name, value in service_env(stack.settings).items():
        monkeypatch.setenv(name, value)
    # The operator's key: the view's snapshots are sealed under it.
    monkeypatch.setenv("FLEETLINE_OBJECT_ENCRYPTION_KEY", stack.settings.object_encryption_key)
    capsys.readouterr()
    assert main(["explain", "acme/chat", "--topic-prefix", stack.topics.prefix]) == 0
    out = capsys.readouterr().out
    assert "Replicas (the scheduler's):" in out and "acme/chat.r0" in out
    assert "The registry (each replica's latest record):" in out and "READY" in out
    assert "The autoscaler last saw (router-" in out
    assert "The router's weights for clients in eu-west (best first):" in out
    assert "expected" in out and "link" in out
    # The scaling decisions replay byte for byte with the rest of the log.
    assert main(["replay", "--decisions", "--topic-prefix", stack.topics.prefix]) == 0
