"""The scheduler in `fleetline serve`, driven by the CLI: apply, get, describe, explain, quota,
delete; a SIGKILL while jobs stream in loses and repeats no decision, and `replay --decisions`
reproduces the log byte for byte afterwards."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from fleetline.agents.simulator import ClusterSpec, cluster_info
from fleetline.cli import main
from fleetline.processors.scheduling.client import decisions_of, submit
from fleetline.processors.scheduling.codec import new_request
from fleetline.processors.scheduling.runtime import scheduler_topics
from fleetline.streams import kafka as kafka_clients
from tests.fleet_events import scenario_events
from tests.scheduling_support import training
from tests.services import auth_config, free_port, produce, serve_command, service_env, submits
from tests.support import BASE_MS, fresh_topics, wait_until

pytestmark = pytest.mark.services
SPECS = Path(__file__).parent.parent / "specs" / "llm-pretrain.yaml"
CLUSTERS = [
    ClusterSpec("us-east-a", "us-east", 4),
    ClusterSpec("eu-west-a", "eu-west", 4),
    ClusterSpec("ap-south-a", "ap-south", 4),
]


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def wait_decided(settings, topics, keys: set[str], timeout_s: float = 90) -> list[dict]:
    decisions: list[dict] = []

    def decided() -> bool:
        decisions[:] = decisions_of(settings.kafka, topics)
        return keys <= {d["job"] for d in decisions}

    wait_until(decided, timeout_s, what=f"decisions about {sorted(keys)}", every_s=0.3)
    return decisions


def test_serve_schedules_what_the_cli_applies_through_a_sigkill(
    settings, tmp_path, monkeypatch, capsys
):
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, scheduler_topics(topics))
    produce(settings, topics, [("ClusterInfo", cluster_info(c, 1, BASE_MS)) for c in CLUSTERS])
    produce(settings, topics, scenario_events(seconds=4))
    env = service_env(settings, tmp_path / "chdb", killed_members=True)
    auth = tmp_path / "auth.yaml"
    auth.write_text(yaml.safe_dump(auth_config()))
    env["FLEETLINE_AUTH_CONFIG"] = str(auth)
    env["FLEETLINE_CACHE_DIR"] = str(tmp_path / "cache")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FLEETLINE_CONTEXTS", str(tmp_path / "contexts.yaml"))
    group = f"v-{uuid.uuid4().hex[:8]}"
    common = ["--topic-prefix", topics.prefix]  # reads stay direct
    port = free_port()
    # serve's API speaks HTTPS by default, its certificate from the deployment CA it makes.
    url = f"https://127.0.0.1:{port}"
    ca = str(tmp_path / "cache" / "ca" / "ca.pem")
    policy = tmp_path / "policy.yaml"
    policy.write_text("cluster_preference: [eu-west-a]\nweights: {preference: 0.2}\n")
    command = serve_command(
        topics.prefix,
        group,
        "--tick-interval",
        "0.3",
        "--snapshot-interval",
        "0.5",
        "--scheduler-policy",
        str(policy),
        api_port=port,
    )
    log_path = tmp_path / "serve.log"
    log = log_path.open("w")
    serve = subprocess.Popen(command, env={**os.environ, **env}, stdout=log, stderr=log)
    try:
        wait_until(lambda: listening(port), 60, "the API to listen")
        # Two contexts: a platform admin's, and acme's user (current).
        assert "API over HTTPS at https://127.0.0.1" in log_path.read_text()
        signed_in = ["--server", url, "--ca", ca]
        assert main(["login", *signed_in, "--token", "fl_ops", "--name", "admin"]) == 0
        assert main(["login", *signed_in, "--token", "fl_uma", "--name", "acme"]) == 0
        assert "signed in to " + url + " as uma (user, tenant acme)" in capsys.readouterr().out
        assert main(["apply", "-f", str(SPECS), "--wait", "90"]) == 0, log_path.read_text()
        out = capsys.readouterr().out
        assert "dataset:web-corpus: ACCEPTED" in out
        # 8 workers of 8 GPUs do not fit on a 4-node cluster: elastic, 4 of them, where its
        # data must first be copied.
        (line,) = [x for x in out.splitlines() if x.startswith("acme/llm-pretrain: QUEUED")]
        assert "waiting for data in " in line and "elastic: 4 of 8 workers" in line, out
        assert "acme/chat: SCALED - 2 serving replica(s) (min 2, max 8)" in out
        # eu-west-a holds the data but a degraded GPU leaves it 3 clean nodes: the job waits,
        # holding no GPUs, for its data to be copied elsewhere; the data mover's report places it.
        assert main(["describe", "acme/llm-pretrain", *common]) == 0
        described = capsys.readouterr().out
        assert "Phase:      Queued" in described and "DataReady  False" in described
        assert "waiting for data in " in described
        ticket = described.split("Waiting for: ")[1].split()[0]
        assert main(["explain", "acme/llm-pretrain", *common]) == 0
        explained = capsys.readouterr().out
        assert "CLUSTER" in explained and "prewarm web-corpus eu-west-a -> " in explained
        (eu,) = [line for line in explained.splitlines() if line.strip().startswith("eu-west-a")]
        assert "needs 4 nodes with 8 free healthy h100 GPUs" in eu
        submit(
            settings.kafka,
            topics,
            [new_request("DATASET_READY", ticket, "acme", int(time.time() * 1000), "mover-1")],
        )
        described = ""

        def running() -> bool:
            nonlocal described
            assert main(["describe", "acme/llm-pretrain", *common]) == 0
            described = capsys.readouterr().out
            return "Phase:      Starting" in described

        wait_until(running, 30, what="acme/llm-pretrain to be started", every_s=0.3)
        assert "Actual:     Ordered in " + ticket.split("@")[1] in described
        assert "DataReady  True" in described
        assert main(["quota", "set", "globex", "--gpus", "16"]) == 77  # a user may not
        assert "role user may not write quotas" in capsys.readouterr().err
        assert main(["context", "use", "admin"]) == 0
        assert main(["quota", "set", "globex", "--gpus", "16"]) == 0
        # A stream of jobs; the server is killed while they arrive.
        keys = set()
        for i in range(30):
            doc = training(
                f"batch{i}",
                per_worker=2,
                tensor=2,
                tenant="globex",
                priority="low" if i % 2 else "normal",
            )
            submit(settings.kafka, topics, submits(doc))
            keys.add(f"globex/batch{i}")
            if i == 12:
                # Killed mid-stream: once it has decided some of the batch, not all of it.
                wait_until(
                    lambda: any(
                        d["job"].startswith("globex/batch")
                        for d in decisions_of(settings.kafka, topics)
                    ),
                    60,
                    what="the first batch decisions",
                    every_s=0.2,
                )
                serve.send_signal(signal.SIGKILL)
                serve.wait(30)
                serve = subprocess.Popen(command, env={**os.environ, **env}, stdout=log, stderr=log)
        decisions = wait_decided(settings, topics, keys)
        ids = [d["decision_id"] for d in decisions]
        assert len(ids) == len(set(ids)), "a decision was written twice"
        placed = {d["job"] for d in decisions if d["outcome"] == "PLACED"}
        assert len(placed & keys) == 8  # the globex quota: 16 GPUs, 2 a job
        assert {d["policy_digest"] for d in decisions if d["job"] in keys} and all(
            d["policy_digest"] == decisions[-1]["policy_digest"] for d in decisions[-5:]
        )

        capsys.readouterr()
        assert main(["get", "jobs", "--tenant", "globex", "--json", *common]) == 0, (
            capsys.readouterr().err
        )
        jobs = json.loads(capsys.readouterr().out)
        # Placed and ordered to their clusters; no cluster agent runs here to report them
        # running.
        assert sum(j["phase"] == "Starting" for j in jobs) == 8, [
            (j["key"], j["phase"]) for j in jobs
        ]
        queued = sorted(keys - placed)[0]
        assert main(["explain", queued, *common]) == 0
        explained = capsys.readouterr().out
        assert f"{queued} is Queued: quota: tenant globex holds 16 of its 16 GPUs" in explained
        # What would make each queued job fit: the quota binds, 2 GPUs more places it.
        assert main(["explain", "--queued", *common]) == 0
        said = capsys.readouterr().out
        assert f"{queued} (2 GPUs) is held by quota: quota: tenant globex holds 16" in said
        assert "  tenant globex quota +2 GPUs (16 -> 18): then placed in " in said
        assert main(["explain", "--queued", "--json", *common]) == 0
        fits = {f["job"]: f for f in json.loads(capsys.readouterr().out)}
        assert set(fits) == keys - placed
        assert {(f["binding"], f["checked"]) for f in fits.values()} == {("quota", True)}
        assert fits[queued]["change"] == "tenant globex quota +2 GPUs (16 -> 18)"
        wait_until(lambda: listening(port), 60, "the restarted API to listen")
        assert main(["context", "use", "acme"]) == 0
        capsys.readouterr()
        assert main(["delete", "globex/batch0"]) == 77  # another tenant's
        assert "uma may only reach tenant acme" in capsys.readouterr().err
        assert main(["context", "use", "admin"]) == 0
        assert main(["delete", "globex/batch0", "globex/batch2"]) == 0
        capsys.readouterr()
        wait_decided(settings, topics, keys)
        released: list[dict] = []

        def both_released() -> bool:
            released[:] = [
                d for d in decisions_of(settings.kafka, topics) if d["outcome"] == "RELEASED"
            ]
            return len(released) >= 2

        wait_until(both_released, 60, what="the deleted jobs' release", every_s=0.3)
        assert {d["job"] for d in released} == {"globex/batch0", "globex/batch2"}
        assert main(["get", "jobs", "--tenant", "nobody", *common]) == 0
        assert main(["describe", "acme/ghost", *common]) == 1
        assert "no job 'acme/ghost'" in capsys.readouterr().err
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
    capsys.readouterr()
    assert main(["replay", "--decisions", "--group", group, *common]) == 0, capsys.readouterr().out
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["matched"] == summary["decisions"] >= 35
    # What-if: the quota it had changes nothing; twice the quota places the rest of the batch.
    what_if = ["replay", "--decisions", "--group", group, *common, "--what-if"]
    assert main([*what_if, "quota=globex:16"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["baseline_matches_log"] and same["differences"] == 0, same["diff"][:3]
    assert main([*what_if, "quota=globex:32"]) == 0
    more = json.loads(capsys.readouterr().out)
    assert more["baseline_matches_log"] and more["differences"] > 0
    assert more["numbers"]["what_if"]["placed"] > more["numbers"]["baseline"]["placed"]
    assert more["deltas"]["queue_wait_p95_s tenant globex"] < 0, more["deltas"]
    bad_policy = tmp_path / "policy.yaml"
    bad_policy.write_text("weights: {no-such-scorer: 1}\n")
    assert main([*what_if, f"policy={bad_policy}"]) == 1
    assert "policy file" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: TrainingJob\nmetadata: {name: x, tenant: acme}\nspec: {workers: 0}\n")
    assert main(["apply", "-f", str(bad)]) == 1  # refused here, before any call
    assert "spec.workers: must be >= 1" in capsys.readouterr().err
