"""The cluster control layer's part of `fleetline run`: one cluster agent per simulated cluster
running the jobs' workloads as real processes, then a cluster lost under a running training
job, the job resumed elsewhere from its last checkpoint, the lost cluster's copy fenced when it
returns, and the final parameters compared with a run never interrupted.
"""

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

from fleetline.agents.cluster.agent import ClusterAgent
from fleetline.agents.cluster.backends import Launcher, launcher_for
from fleetline.agents.workloads.train import workload_env
from fleetline.config import Settings
from fleetline.demo.verdict import last_word
from fleetline.errors import StoryStalled, StreamError
from fleetline.infra import ca as deployment_ca
from fleetline.infra.kubernetes import KwokCluster
from fleetline.infra.lab import Lab, LabHost, exec_argv
from fleetline.infra.slurm import SlurmCluster
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import CLUSTER_HEALTH, CLUSTER_SIGNAL, WORKLOAD_EVENT
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics


class Follower:
    """The workload, emergency and signal topics from their start, as they grow."""

    def __init__(self, settings: Settings, topics: Topics) -> None:
        self.codec = default_codec()
        self.consumer = kafka_clients.consumer(settings.kafka, f"story-{uuid.uuid4().hex}")
        self.consumer.assign(
            [
                TopicPartition(t, 0, OFFSET_BEGINNING)
                for t in (topics.workloads, topics.emergency, topics.cluster_signals)
            ]
        )
        self.workloads: list[dict[str, Any]] = []
        self.health: list[dict[str, Any]] = []
        self.heartbeats: dict[str, int] = {}  # cluster -> its last heartbeat's ts

    def poll(self, timeout_s: float = 0.2) -> None:
        for msg in self.consumer.consume(2000, timeout_s):
            error = msg.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    raise StreamError(f"following the cluster topics: {error.str()}")
                continue
            decoded = self.codec.decode(msg.value())
            record, name = decoded.record, decoded.schema.full_name
            if name == WORKLOAD_EVENT:
                self.workloads.append(record)
            elif name == CLUSTER_HEALTH:
                self.health.append(record)
            elif name == CLUSTER_SIGNAL and record["kind"] == "HEARTBEAT":
                self.heartbeats[record["cluster_id"]] = record["ts"]

    def events(self, job: str, kind: str | None = None) -> list[dict[str, Any]]:
        return [
            e for e in self.workloads if e["job"] == job and (kind is None or e["event"] == kind)
        ]

    def close(self) -> None:
        self.consumer.close()


@dataclass
class ClusterAgents:
    """One in-process cluster agent per cluster, each stoppable on its own (a cluster going
    dark); the workloads they start are OS processes."""

    settings: Settings
    topics: Topics
    clusters: list[str]
    state_dir: Path = field(
        default_factory=lambda: Path(tempfile.mkdtemp(prefix="fleetline-clusters-"))
    )
    running: dict[str, tuple[ClusterAgent, threading.Event, threading.Thread]] = field(
        default_factory=dict
    )
    # The clusters under Slurm and under Kubernetes (the rest run processes): a Slurm cluster,
    # or a Kubernetes control plane with kwok nodes, of as many nodes as the simulator gives
    # each, started here and stopped at the end.
    slurm_nodes: dict[str, int] = field(default_factory=dict)
    kubernetes_nodes: dict[str, int] = field(default_factory=dict)
    managers: dict[str, SlurmCluster | KwokCluster] = field(default_factory=dict)
    # The deployment CA's directory, when the settings' TLS comes from it: each cluster's agent
    # gets a certificate of its own (its replicas serve with it and admit inference from the
    # router's identity only). Without it every agent shares the settings' certificate.
    authority: Path | None = None

    def __post_init__(self) -> None:
        # Checkpoints are sealed under the tenants' keys; a demo without a configured key gets
        # one for this run (the view's snapshots keep the operator's setting).
        if not self.settings.object_encryption_key:
            self.settings = dataclasses.replace(
                self.settings, object_encryption_key=base64.b64encode(os.urandom(32)).decode()
            )

    def _launcher(self, cluster_id: str) -> Launcher:
        manager = self.managers.get(cluster_id)
        if cluster_id in self.slurm_nodes:
            if manager is None:
                manager = SlurmCluster.of(
                    self.settings.cache_dir, cluster_id, self.slurm_nodes[cluster_id]
                )
                manager.start()
                self.managers[cluster_id] = manager
            assert isinstance(manager, SlurmCluster)
            return launcher_for("slurm", cluster_id, slurm_conf=manager.conf)
        if cluster_id in self.kubernetes_nodes:
            if manager is None:
                manager = KwokCluster.parse(
                    self.settings.cache_dir, f"{cluster_id}:{self.kubernetes_nodes[cluster_id]}"
                )
                manager.start()
                self.managers[cluster_id] = manager
            assert isinstance(manager, KwokCluster)
            return launcher_for("kubernetes", cluster_id, kubeconfig=manager.kubeconfig)
        return launcher_for("process", cluster_id)

    def settings_of(self, cluster_id: str, hosts: list[str]) -> Settings:
        """The settings a cluster's agent runs with: its own certificate, for the addresses
        its replicas are reached at, when there is a CA to issue it."""
        tls = self.settings.tls
        if tls is None or self.authority is None:
            return self.settings
        issued = deployment_ca.issue(self.authority, cluster_id, hosts)
        return dataclasses.replace(self.settings, tls=issued.settings(tls.router_identity))

    def runs_nothing(self, cluster: str) -> bool:
        """Its workloads are made but never run: a Kubernetes of kwok nodes."""
        return cluster in self.kubernetes_nodes

    def start(self, cluster: str | None = None) -> None:
        for cluster_id in [cluster] if cluster else self.clusters:
            agent = ClusterAgent(
                self.settings_of(cluster_id, ["127.0.0.1", "localhost"]),
                self.topics,
                cluster_id,
                self.state_dir,
                launcher=self._launcher(cluster_id),
            )
            stop = threading.Event()
            thread = threading.Thread(target=agent.run, args=(stop,), name=agent.name, daemon=True)
            thread.start()
            self.running[cluster_id] = (agent, stop, thread)
        for agent, _, _ in self.running.values():
            if not agent.ready.wait(60):
                raise StreamError(f"cluster agent {agent.cluster_id} did not start in 60s")

    def describe_dark(self, cluster: str) -> str:
        run = (
            "its Slurm job runs"
            if cluster in self.slurm_nodes
            else "its pod stays"
            if cluster in self.kubernetes_nodes
            else "its workload runs"
        )
        return f"its cluster agent stops, {run} on cut off"

    def go_dark(self, cluster: str) -> None:
        """Stop a cluster's agent as if its cluster vanished: its workloads run on, cut off."""
        _, stop, thread = self.running.pop(cluster)
        stop.set()
        thread.join(30)

    def close(self) -> None:
        for cluster in list(self.running):
            self.go_dark(cluster)
        for pid_file in self.state_dir.glob("*/*/*/pid"):
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.killpg(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        for manager in self.managers.values():
            manager.stop()  # its jobs cancelled, its daemons stopped


class LabClusterAgents(ClusterAgents):
    """One `fleetline cluster-agent` process per cluster, each on its cluster's host in the
    lab (`fleetline lab`); a cluster goes dark by a real cut of its links, and comes back when
    they are healed. The workloads run where their agent runs: inside its namespace."""

    def __init__(
        self,
        settings: Settings,
        topics: Topics,
        clusters: list[str],
        lab: Lab,
        authority: Path | None = None,
    ) -> None:
        super().__init__(settings, topics, clusters, authority=authority)
        self.lab = lab
        self.host = LabHost(settings.cache_dir, lab.name)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.dark: set[str] = set()

    def describe_dark(self, cluster: str) -> str:
        return f"its links are cut (`fleetline lab cut {cluster}`), its workload runs on cut off"

    def start(self, cluster: str | None = None) -> None:
        if cluster is not None and cluster in self.dark:
            self.host.heal()
            self.dark.discard(cluster)
            return
        env = {
            **os.environ,
            **self.settings.s3.as_env(),
            **self.settings.kafka.as_env(),
            "FLEETLINE_OBJECT_ENCRYPTION_KEY": self.settings.object_encryption_key or "",
        }
        for cluster_id in [cluster] if cluster else self.clusters:
            tls = self.settings_of(cluster_id, [self.lab.cluster(cluster_id).address]).tls
            command = [
                sys.executable, "-m", "fleetline.cli", "cluster-agent",
                "--cluster-id", cluster_id, "--topic-prefix", self.topics.prefix,
                "--state-dir", str(self.state_dir),
            ]  # fmt: skip
            log = (self.state_dir / f"{cluster_id}.log").open("ab")
            own_env = {**env, **(tls.as_env() if tls else {})}
            self.processes[cluster_id] = subprocess.Popen(
                exec_argv(self.lab, cluster_id, command, own_env),
                env=own_env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        follower = Follower(self.settings, self.topics)
        try:
            deadline = time.monotonic() + 60
            while not set(self.processes) <= set(follower.heartbeats):
                if time.monotonic() > deadline:
                    silent = sorted(set(self.processes) - set(follower.heartbeats))
                    raise StreamError(f"cluster agent(s) {silent} sent no heartbeat in 60s")
                follower.poll()
        finally:
            follower.close()

    def go_dark(self, cluster: str) -> None:
        self.host.cut(cluster)
        self.dark.add(cluster)

    def close(self) -> None:
        if self.dark:
            self.host.heal()
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        super().close()


def _reference(settings: Settings, workload: dict[str, Any]) -> tuple[str, float]:
    """The same training run, never interrupted: its parameters' digest and seconds."""
    progress = Path(tempfile.mkdtemp(prefix="fleetline-reference-")) / "progress.jsonl"
    env = {
        **os.environ,
        **settings.s3.as_env(),
        "FLEETLINE_CHECKPOINT_BUCKET": f"{settings.s3.bucket}-reference",
        "FLEETLINE_CHECKPOINT_PREFIX": f"reference/{uuid.uuid4().hex}",
        "FLEETLINE_PROGRESS_FILE": str(progress),
        # Its pace does not change what it computes: run it at full speed.
        **workload_env({k: v for k, v in workload.items() if k != "step_delay_ms"}),
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    }
    began = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "fleetline.agents.workloads.train"], env=env, check=True, timeout=300
    )
    done = json.loads(progress.read_text().splitlines()[-1])
    return str(done["params_sha256"]), time.monotonic() - began


class StoryClock:
    """A story's time: `until` a condition holds (polling the topics), within its deadline;
    `at` says how far into the story."""

    def __init__(
        self,
        follower: Follower,
        job: str,
        job_of: Callable[[str], dict[str, Any] | None],
        story: str,
        timeout_s: float,
    ) -> None:
        self.follower, self.job, self.job_of, self.story = follower, job, job_of, story
        self.began = time.monotonic()
        self.deadline = self.began + timeout_s

    def until(self, what: str, condition: Callable[[], Any]) -> Any:
        """What `condition` found once it found something; StoryStalled when the deadline
        passes first, or at once when the job ends Failed (its last failure is the cause)."""
        while time.monotonic() < self.deadline:
            self.follower.poll()
            found = condition()
            if found:
                return found
            record = self.job_of(self.job) or {}
            if record.get("phase") == "Failed":
                raise StoryStalled(
                    f"{self.story} stopped waiting for {what}: {self.job} failed: "
                    + last_word(record)
                )
        record = self.job_of(self.job) or {}
        conditions = {k: v["reason"] for k, v in (record.get("conditions") or {}).items()}
        raise StoryStalled(
            f"{self.story} timed out waiting for {what}: {self.job} is "
            f"{record.get('phase')} ({conditions})"
        )

    def at(self) -> str:
        return f"+{time.monotonic() - self.began:.1f}s"


def lose_a_cluster(
    agents: ClusterAgents,
    job: str,
    workload: dict[str, Any],
    job_of: Callable[[str], dict[str, Any] | None],
    say: Callable[[str], None],
    timeout_s: float = 180.0,
) -> dict[str, Any]:
    """Wait for `job` to checkpoint, take its cluster dark, and follow it to the end; what
    happened, with the seconds each step took."""
    follower = Follower(agents.settings, agents.topics)
    story: dict[str, Any] = {"job": job}
    clock = StoryClock(follower, job, job_of, "the cluster story", timeout_s)
    until, at = clock.until, clock.at

    try:

        def checkpointed() -> list[tuple[dict[str, Any], dict[str, Any]]]:
            """The job's latest run once it has checkpointed: a job moved before that (off a
            GPU that failed, say) is followed to where it runs now."""
            runs = follower.events(job, "RUNNING")
            if not runs:
                return []
            latest = runs[-1]
            saved = [
                c
                for c in follower.events(job, "CHECKPOINTED")
                if (c["cluster_id"], c["epoch"]) == (latest["cluster_id"], latest["epoch"])
            ]
            return [(latest, saved[-1])] if saved else []

        first, checkpoint = until("the job to run and checkpoint", checkpointed)[0]
        lost = first["cluster_id"]
        where = f"pid {first['pid']}" if first["pid"] else first["detail"]
        say(
            f"{at()}: {job} runs in {lost} (epoch {first['epoch']}, {where}); "
            f"checkpoint at step {checkpoint['step']} ({checkpoint['bytes']} bytes in "
            f"{checkpoint['seconds']:.3f}s)"
        )

        def move_off(gone: str) -> tuple[dict[str, Any], dict[str, Any] | None, float, float]:
            """Take `gone` dark and follow the job to the cluster it runs in next: (that run,
            the checkpoint copied out of `gone`, seconds from its last heartbeat to its loss,
            its last heartbeat's ts)."""
            agents.go_dark(gone)
            dark = time.monotonic()
            say(f"{at()}: {gone} goes dark: {agents.describe_dark(gone)}")
            down = until(
                f"{gone} to be lost",
                lambda: [
                    h
                    for h in follower.health
                    if h["event"] == "CLUSTER_DOWN" and h["cluster_id"] == gone
                ],
            )[-1]
            last_beat = follower.heartbeats[gone]
            detected = (down["ts"] - last_beat) / 1000
            say(
                f"{at()}: {gone} declared lost {detected:.1f}s after its last heartbeat: "
                + down["reason"]
            )

            def moved() -> list[dict[str, Any]]:
                return [e for e in follower.events(job, "RUNNING") if e["ts"] > down["ts"]]

            running = until("the job to run elsewhere", moved)[0]
            restored = [
                e
                for e in follower.events(job, "RESTORED")
                if e["from_cluster"] == gone and e["bytes"]
            ]
            resumed = [
                e
                for e in follower.events(job, "RESTORED")
                if e["cluster_id"] == running["cluster_id"]
                and e["epoch"] == running["epoch"]
                and e["step"] is not None
            ]
            copy = restored[-1] if restored else None
            if copy is not None:
                say(
                    f"{at()}: checkpoint at step {copy['step']} copied {gone} -> "
                    f"{copy['cluster_id']}: {copy['bytes']} bytes in {copy['seconds']:.3f}s "
                    f"({copy['detail']})"
                )
            resumed_at = resumed[-1]["step"] if resumed else None
            say(
                f"{at()}: {job} runs in {running['cluster_id']} (epoch {running['epoch']}) from "
                f"step {resumed_at}, {time.monotonic() - dark:.1f}s after {gone} went dark"
                + (f": {running['detail']}" if agents.runs_nothing(running["cluster_id"]) else "")
            )
            return {**running, "resumed_at": resumed_at}, copy, detected, last_beat

        running, copy, detected, last_beat = move_off(lost)
        first_move = running
        ran_in = [lost, running["cluster_id"]]
        while agents.runs_nothing(running["cluster_id"]):
            # kwok's nodes run no container: the job holds its place there and goes no further,
            # so that cluster goes dark in turn and the job moves on from the same checkpoint.
            say(
                f"{at()}: {running['cluster_id']}'s nodes are kwok's: its pods run no container; "
                "it goes dark in turn"
            )
            running = move_off(running["cluster_id"])[0]
            ran_in.append(running["cluster_id"])
        for cluster in ran_in[:-1]:
            agents.start(cluster)
            fenced = until(
                f"{cluster}'s stale copy to be fenced",
                lambda cluster=cluster: [  # type: ignore[misc]
                    e for e in follower.events(job, "FENCED") if e["cluster_id"] == cluster
                ],
            )[0]
            say(
                f"{at()}: {cluster} is back; its copy of {job} is fenced and stopped: "
                f"{fenced['detail']}"
            )
        done = until(
            "the job to finish",
            lambda: (
                (job_of(job) or {}).get("phase") == "Succeeded"
                # The run it moved to: the copy left behind may have exited 0 too, fenced.
                and [
                    e
                    for e in follower.events(job, "EXITED")
                    if e["exit_code"] == 0 and e["epoch"] == running["epoch"]
                ]
            ),
        )[0]
        digest, reference_s = _reference(agents.settings, workload)
        identical = done["detail"] == f"params sha256 {digest}"
        say(
            f"{at()}: {job} finished in {done['cluster_id']}; its parameters are "
            + ("bit-identical to" if identical else "DIFFERENT from")
            + f" an uninterrupted run ({reference_s:.1f}s)"
        )
        steps = sorted({e["step"] for e in follower.events(job, "PROGRESS")})
        story.update(
            lost=lost,
            resumed_in=running["cluster_id"],
            ran_in=ran_in,
            checkpoint_step=checkpoint["step"],
            resumed_at=running["resumed_at"],
            detected_s=round(detected, 2),
            resumed_after_s=round((first_move["ts"] - last_beat) / 1000, 2),
            copy_bytes=copy["bytes"] if copy else None,
            copy_s=copy["seconds"] if copy else None,
            fenced=True,
            identical=identical,
            reported_steps=len(steps),
            last_step=steps[-1] if steps else None,
        )
        return story
    finally:
        follower.close()


def follow_a_split_job(
    agents: ClusterAgents,
    job: str,
    workload: dict[str, Any],
    job_of: Callable[[str], dict[str, Any] | None],
    say: Callable[[str], None],
    timeout_s: float = 180.0,
) -> dict[str, Any]:
    """Follow `job`, split across clusters, to its end: the clusters its parts ran in, its world,
    what its gradient exchange cost and whether its parameters are one process's."""
    follower = Follower(agents.settings, agents.topics)
    clock = StoryClock(follower, job, job_of, "the data-plane story", timeout_s)
    until, at = clock.until, clock.at

    try:
        world = until(
            "its workers to meet",
            lambda: [
                e
                for e in follower.events(job, "PROGRESS")
                if (e["detail"] or "").startswith("a world")
            ],
        )[0]
        parts = sorted({e["cluster_id"] for e in follower.events(job, "RUNNING")})
        say(f"{at()}: {job} runs in {', '.join(parts)}: {world['detail']}")
        done = until(
            "the job to finish",
            lambda: (
                (job_of(job) or {}).get("phase") == "Succeeded"
                and [
                    e
                    for e in follower.events(job, "EXITED")
                    if e["exit_code"] == 0 and (e["detail"] or "").startswith("params")
                ]
            ),
        )[0]
        costs = [
            e
            for e in follower.events(job, "PROGRESS")
            if e["cluster_id"] == done["cluster_id"]
            and (e["detail"] or "").startswith("data plane:")
        ]
        last = costs[-1] if costs else None
        digest, reference_s = _reference(agents.settings, workload)
        identical = done["detail"] == f"params sha256 {digest}"
        say(
            f"{at()}: {job} finished; "
            + (f"{last['detail']}; " if last else "")
            + "its parameters are "
            + ("bit-identical to" if identical else "DIFFERENT from")
            + f" one process's on the same batches ({reference_s:.1f}s)"
        )
        return {
            "job": job,
            "clusters": parts,
            "world": world["detail"],
            "data_plane": last["detail"] if last else None,
            "samples_per_s": last["samples_per_s"] if last else None,
            "identical": identical,
        }
    finally:
        follower.close()
