"""A running control plane for tests: the services of `fleetline serve` built in this process
(`app.build`), a simulated fleet of one-node clusters whose agents send telemetry every half
second, and one `fleetline cluster-agent` process per cluster running real workloads. Used by
the cluster control tests and the console's browser tests."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetline.agents.fleet import FleetAgent
from fleetline.agents.simulator import ClusterSpec, FleetSimulator
from fleetline.app import Fleetline, Options, build
from fleetline.config import Settings
from fleetline.infra.lab import Lab, exec_argv
from fleetline.processors.scheduling.client import submit
from fleetline.processors.scheduling.codec import canonical_json, new_request
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from tests.services import service_env, serving_api
from tests.support import fresh_topics, wait_until

codec = default_codec()


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Stack:
    settings: Settings
    fleet: Fleetline
    simulator: FleetSimulator | None  # None in a lab: each cluster's nodes run on its host
    state_dir: Path
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # In a lab, each cluster agent (and each cluster's node agents) runs on its cluster's host.
    lab: Lab | None = None
    node_agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # What one cluster's processes get besides the stack's settings (its host's certificate).
    cluster_env: dict[str, dict[str, str]] = field(default_factory=dict)
    # What one cluster's agent is started with besides the stack's flags (its backend).
    agent_args: dict[str, list[str]] = field(default_factory=dict)
    # The fleet's API (tests.services.PRINCIPALS sign in to it): where CLI writes go.
    api_url: str = ""

    @property
    def topics(self):
        return self.fleet.topics

    def chaos(self, cluster: str) -> Path:
        return self.state_dir / f"chaos-{cluster}"

    def metrics_url(self, cluster: str) -> str:
        """Where the agent (started with --metrics-port 0) serves /metrics, from its log."""
        log = (self.state_dir / f"agent-{cluster}.log").read_text()
        return log.rsplit("metrics at ", 1)[1].split()[0]  # the newest start's

    def agent_passes(self, cluster: str) -> int:
        """How many passes the agent's loop has made since it started (its /metrics)."""
        from urllib.request import urlopen

        with urlopen(self.metrics_url(cluster), timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("fleetline_cluster_agent_loop_passes{"):
                    return int(float(line.rsplit(" ", 1)[1]))
        raise AssertionError(f"{cluster}'s agent serves no loop passes")

    def _env(self) -> dict[str, str]:
        return {
            **os.environ,
            **service_env(self.settings),
            "FLEETLINE_OBJECT_ENCRYPTION_KEY": self.settings.object_encryption_key or "",
        }

    def _spawn(
        self,
        cluster: str,
        argv: list[str],
        log_name: str,
        extra_env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """A process of `cluster`'s: on its lab host when there is a lab."""
        env = {**self._env(), **self.cluster_env.get(cluster, {}), **(extra_env or {})}
        if self.lab is not None:
            argv = exec_argv(self.lab, cluster, argv, env)
        log = open(self.state_dir / log_name, "ab")  # noqa: SIM115
        return subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True)

    def start_nodes(self, cluster: str, part: int, parts: int) -> None:
        """The node agents of one simulated cluster (one node, every 500 ms) as their own
        process, on the cluster's host: `fleetline agent simulator --part`."""
        self.node_agents[cluster] = self._spawn(
            cluster,
            [
                sys.executable, "-m", "fleetline.cli", "agent", "simulator",
                "--clusters", str(parts), "--processes", str(parts), "--part", str(part),
                "--nodes", "1", "--interval-ms", "500", "--seed", "3",
                "--topic-prefix", self.topics.prefix,
                "--state-dir", str(self.state_dir / "nodes"),
            ],
            f"nodes-{cluster}.log",
        )  # fmt: skip

    def start_agent(self, cluster: str) -> None:
        self.agents[cluster] = self._spawn(
            cluster,
            [
                sys.executable,
                "-m",
                "fleetline.cli",
                # In a lab, at INFO: what it stops and why is the evidence of a cut; on a
                # cluster manager, what the manager was asked and said.
                *(["-v"] if self.lab is not None or cluster in self.agent_args else []),
                "cluster-agent",
                "--cluster-id",
                cluster,
                "--topic-prefix",
                self.topics.prefix,
                "--state-dir",
                str(self.state_dir / "agents"),
                "--stop-grace-s",
                "10",
                "--chaos-file",
                str(self.chaos(cluster)),
                "--metrics-port",
                "0",
                *self.agent_args.get(cluster, []),
            ],
            f"agent-{cluster}.log",
        )

    def kill_agent(self, cluster: str) -> None:
        agent = self.agents.pop(cluster)
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)

    def records(self, topic: str, partitions: int = 1) -> list[dict[str, Any]]:
        return [
            codec.decode(m.value()).record
            for m in kafka_clients.read_to_end(
                self.settings.kafka,
                topic,
                list(range(partitions)),
                f"stack-read-{uuid.uuid4().hex[:12]}",
                30,
            )
        ]

    def events(self, job: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.records(self.topics.workloads) if job is None or e["job"] == job]

    def replicas(self) -> dict[str, dict[str, Any]]:
        """The service registry: each replica's latest record (the newest run's newest)."""
        latest: dict[str, dict[str, Any]] = {}
        for r in self.records(self.topics.replicas):
            known = latest.get(r["replica"])
            if known is None or (r["epoch"], r["attempt"], r["ts"]) >= (
                known["epoch"],
                known["attempt"],
                known["ts"],
            ):
                latest[r["replica"]] = r
        return latest

    def health(self) -> list[dict[str, Any]]:
        return self.records(self.topics.emergency)

    def health_folded_to_ms(self) -> int:
        """How far the health fold's committed state has folded the control plane's clock:
        what it would have declared by then is on the emergency topic (one transaction)."""
        assert self.fleet.health is not None
        state = self.fleet.health.store.committed(0, b"fold")
        return int(state["now_ms"]) if state else 0

    def health_past(self, deadline_ms: int, timeout_s: float = 30.0) -> None:
        """Wait until the health fold has folded a clock tick past `deadline_ms`: a positive
        witness that whatever it would declare by then has been declared."""
        wait_until(
            lambda: self.health_folded_to_ms() > deadline_ms,
            timeout_s,
            f"the health fold past {deadline_ms} (at {self.health_folded_to_ms()})",
        )

    def job(self, key: str) -> dict[str, Any] | None:
        assert self.fleet.scheduler is not None
        return self.fleet.scheduler.store.committed(0, f"job:{key}".encode())

    def phase(self, key: str) -> str | None:
        job = self.job(key)
        return None if job is None else job["phase"]


@contextlib.contextmanager
def running_stack(
    services: Settings,
    clusters: Sequence[str],
    options: Options,
    prefix: str = "stack",
    commands: bool = False,
    regions: Mapping[str, str] | None = None,
    lab: Lab | None = None,
    cluster_env: Mapping[str, dict[str, str]] | None = None,
    agent_args: Mapping[str, list[str]] | None = None,
    cluster_nodes: Mapping[str, int] | None = None,
) -> Iterator[Stack]:
    """The stack up, every cluster's first heartbeat seen; jobs go to the clusters in the
    order given while they are in the pool (the preference scorer outweighs the others).
    With `commands` the simulated node agents apply node commands (cordons, power caps);
    `regions` names a cluster's region (default: one of its own, region-<cluster>). In a `lab`,
    `clusters` are the simulator's first clusters by name (eu-west-a, us-east-a, ...), and
    each one's cluster agent and node agents run on its host there (`settings` must point at
    Kafka and S3 on the lab's control address). `cluster_env` adds to one cluster's processes'
    environment, `agent_args` to its agent's flags; `cluster_nodes` gives a cluster more than
    one node."""
    settings = dataclasses.replace(
        services,
        clickhouse_database=f"t_{uuid.uuid4().hex[:12]}",
        object_encryption_key=base64.b64encode(os.urandom(32)).decode(),
    )
    topics = fresh_topics(partitions=2)
    fleet = build(settings, dataclasses.replace(options, topics=topics)).start()
    state_dir = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    stop = threading.Event()
    simulator: FleetSimulator | None = None
    nodes: FleetAgent | None = None
    pumping: threading.Thread | None = None
    if lab is None:
        simulator = FleetSimulator(
            [
                ClusterSpec(
                    c, (regions or {}).get(c, f"region-{c}"), (cluster_nodes or {}).get(c, 1)
                )
                for c in clusters
            ],
            seed=3,
            interval_ms=500,
        )
        nodes = FleetAgent.create(
            settings, codec, topics, simulator, state_dir / "nodes", commands=commands
        )

        def pump(agent: FleetAgent = nodes) -> None:
            agent.start(now_ms())
            while not stop.is_set():
                agent.tick(now_ms())
                stop.wait(0.5)

        pumping = threading.Thread(target=pump, daemon=True)
        pumping.start()
    submit(
        settings.kafka,
        topics,
        [
            new_request(
                "POLICY",
                "",
                "",
                now_ms(),
                uuid.uuid4().hex,
                spec_json=canonical_json(
                    {"cluster_preference": list(clusters), "weights": {"preference": 100}}
                ),
            )
        ],
    )
    built = Stack(
        settings,
        fleet,
        simulator,
        state_dir,
        lab=lab,
        cluster_env=dict(cluster_env or {}),
        agent_args=dict(agent_args or {}),
    )
    api = contextlib.ExitStack()
    try:
        built.api_url = api.enter_context(serving_api(fleet))
        for part, cluster in enumerate(clusters):
            built.chaos(cluster).write_text("")
            built.start_agent(cluster)
            if lab is not None:
                built.start_nodes(cluster, part, len(clusters))
        wait_until(
            lambda: (
                {h["cluster_id"] for h in built.health() if h["state"] == "HEALTHY"}
                >= set(clusters)
            ),
            60,
            "every cluster's first heartbeat",
        )
        yield built
    finally:
        for cluster in list(built.agents):
            built.kill_agent(cluster)
        for process in built.node_agents.values():
            process.terminate()  # what it spooled is sent first
        for process in built.node_agents.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        for pid_file in (state_dir / "agents").glob("*/*/*/pid"):
            pid = int(pid_file.read_text().split()[0])
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        stop.set()
        if pumping is not None and nodes is not None:
            pumping.join(10)
            nodes.close()
        api.close()
        fleet.close()


def training(
    name: str,
    retry: Mapping[str, Any] | None = None,
    *,
    workers: int = 1,
    per_worker: int = 2,
    split: bool = False,
    **workload: Any,
) -> dict[str, Any]:
    """A TrainingJob of tenant acme: `workers` data-parallel workers (one by default) of
    `per_worker` H100s running the built-in trainer with `workload`, under `retry` when given,
    split across clusters (by whole workers) when `split` allows it and no cluster holds it."""
    return {
        "kind": "TrainingJob",
        "metadata": {"name": name, "tenant": "acme"},
        "spec": {
            "accelerator": "H100",
            "gpus_per_worker": per_worker,
            "workers": workers,
            "workload": workload,
            **({"retry": dict(retry)} if retry else {}),
            **({"allow_split_across_clusters": True} if split else {}),
        },
    }


def reference_run(stack: Stack, tmp: Path, **workload: Any) -> list[dict[str, Any]]:
    """The built-in trainer run once, never interrupted, with `workload`: its progress lines
    (the last one has the final parameters' digest)."""
    progress = tmp / "reference.jsonl"
    env = {
        **os.environ,
        **service_env(stack.settings),
        "FLEETLINE_CHECKPOINT_BUCKET": f"reference-{uuid.uuid4().hex[:8]}",
        "FLEETLINE_CHECKPOINT_PREFIX": "checkpoints/reference",
        "FLEETLINE_PROGRESS_FILE": str(progress),
        "FLEETLINE_STEPS": str(workload["steps"]),
        "FLEETLINE_CHECKPOINT_EVERY": str(workload["checkpoint_every_steps"]),
        "FLEETLINE_REPORT_EVERY": str(workload["report_every_steps"]),
        "FLEETLINE_SEED": str(workload["seed"]),
        "OPENBLAS_NUM_THREADS": "1",
    }
    subprocess.run([sys.executable, "-m", "fleetline.agents.workloads.train"], env=env, check=True)
    return [json.loads(line) for line in progress.read_text().splitlines()]
