"""The cluster control layer: `cluster-agent` (one per cluster), `workload train` and
`workload serve` (the built-in training workload and inference replica) and
`cluster cordon|uncordon|health` for operators."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import quote

import typer

from fleetline.cli.common import (
    MetricsHost,
    MetricsPort,
    TopicPrefix,
    console,
    expose_metrics,
    settings,
    ship_logs,
)
from fleetline.config import Settings
from fleetline.infra.slurm import slurm_conf_path
from fleetline.streams.topics import CLUSTER_AGENT

cluster = typer.Typer(help="Operate whole clusters: cordon, uncordon, health", no_args_is_help=True)
workload = typer.Typer(help="Workloads a cluster agent runs", no_args_is_help=True)

ClusterId = Annotated[str, typer.Argument(help="the cluster's id")]


class Backend(StrEnum):
    """How a cluster agent runs workloads (agents/cluster/backends)."""

    process = "process"
    slurm = "slurm"
    kubernetes = "kubernetes"


def _slurm_conf(given: Path | None, config: Settings, cluster_id: str) -> Path | None:
    """The Slurm configuration a cluster agent uses: the flag's, SLURM_CONF (None: Slurm's
    own default applies), or the one `fleetline infra start --slurm` wrote for the cluster."""
    if given is not None or "SLURM_CONF" in os.environ:
        return given
    made = slurm_conf_path(config.cache_dir, cluster_id)
    return made if made.exists() else None


def _kubeconfig(given: Path | None, config: Settings, cluster_id: str) -> Path:
    """The kubeconfig a cluster agent uses: the flag's, KUBECONFIG, the one `fleetline infra
    start --kubernetes` made for the cluster, else ~/.kube/config."""
    from fleetline.infra.kubernetes import KwokCluster

    if given is not None:
        return given
    if os.environ.get("KUBECONFIG"):
        return Path(os.environ["KUBECONFIG"].split(os.pathsep)[0])
    made = KwokCluster.parse(config.cache_dir, cluster_id).kubeconfig
    return made if made.exists() else Path.home() / ".kube" / "config"


def cluster_agent(
    cluster_id: Annotated[str, typer.Option(help="the cluster this agent runs")],
    topic_prefix: TopicPrefix = "fleetline",
    state_dir: Annotated[
        Path | None,
        typer.Option(help="run directories of its workloads (default: .cache/cluster-agent)"),
    ] = None,
    stop_grace_s: Annotated[
        float, typer.Option(min=0.0, help="how long a stopping workload may checkpoint")
    ] = 20.0,
    chaos_file: Annotated[
        Path | None,
        typer.Option(help="fault injection: peers (one per line) this agent cannot reach"),
    ] = None,
    backend: Annotated[
        Backend,
        typer.Option(
            help="how workloads run: `process` (OS processes on this host), `slurm` (batch "
            "jobs of the cluster's Slurm), `kubernetes` (a pod per worker in the cluster's "
            "Kubernetes); a manager's node names are fleetline's node ids, and the state "
            "directory must be on the cluster's shared filesystem"
        ),
    ] = Backend.process,
    slurm_conf: Annotated[
        Path | None,
        typer.Option(
            help="the Slurm cluster's slurm.conf (default: SLURM_CONF, else "
            ".cache/slurm/CLUSTER/slurm.conf when `fleetline infra start --slurm` made one, "
            "else the host's)"
        ),
    ] = None,
    kubeconfig: Annotated[
        Path | None,
        typer.Option(
            help="the Kubernetes cluster's kubeconfig (default: KUBECONFIG, else the one "
            "`fleetline infra start --kubernetes` made for CLUSTER, else ~/.kube/config)"
        ),
    ] = None,
    namespace: Annotated[
        str, typer.Option(help="the Kubernetes namespace the runs' pods go in")
    ] = "default",
    image: Annotated[
        str | None,
        typer.Option(help="the container image of a Kubernetes run (fleetline installed in it)"),
    ] = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
) -> None:
    """Run the cluster agent: reconcile the scheduler's workload orders for this cluster with
    the workloads it runs (OS processes, jobs of the cluster's Slurm, or pods of its
    Kubernetes), report their transitions and the cluster's status every second, move
    checkpoints in from other clusters, probe the peers (until interrupted)."""
    from fleetline.agents.cluster.agent import ClusterAgent
    from fleetline.agents.cluster.backends import launcher_for
    from fleetline.observability import logs, metrics
    from fleetline.processors.health.runtime import health_topics
    from fleetline.streams import kafka as kafka_clients
    from fleetline.streams.topics import Topics

    config = settings("kafka", "s3", kind=CLUSTER_AGENT)
    topics = Topics(topic_prefix)
    kafka_clients.ensure_topics(config.kafka, health_topics(topics))
    agent = ClusterAgent(
        config,
        topics,
        cluster_id,
        state_dir or config.cache_dir / "cluster-agent",
        stop_grace_s=stop_grace_s,
        chaos_file=chaos_file,
        launcher=launcher_for(
            backend.value,
            cluster_id,
            slurm_conf=_slurm_conf(slurm_conf, config, cluster_id)
            if backend is Backend.slurm
            else None,
            kubeconfig=_kubeconfig(kubeconfig, config, cluster_id)
            if backend is Backend.kubernetes
            else None,
            namespace=namespace,
            image=image,
            grace_s=stop_grace_s,
        ),
    )
    expose_metrics(
        metrics_host,
        metrics_port,
        f"cluster-agent/{cluster_id}",
        # Its status (what its heartbeats carry) and the passes of its loop.
        metrics.cluster_agent_collector(
            cluster_id, lambda: {**agent.status(), "passes": agent.passes}
        ),
    )
    shipped = ship_logs(config, topics, f"cluster-agent/{cluster_id}", cluster_id)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with contextlib.suppress(KeyboardInterrupt):
            agent.run(stop)
    finally:
        logs.unship(shipped)


@workload.command()
def train() -> None:
    """The built-in training workload (a two-layer network with Adam in numpy), under the
    workload contract: FLEETLINE_* environment in, progress lines and checkpoints out (see
    fleetline/agents/workloads/train.py). A cluster agent starts it for a TrainingJob whose
    spec names no command."""
    from fleetline.agents.workloads.train import main

    raise typer.Exit(main())


@workload.command()
def serve() -> None:
    """The built-in inference replica: an HTTP model server on loopback that loads its model
    from the cluster's object store, answers POST /v1/infer and reports its load on /v1/load
    (see fleetline/agents/workloads/serve.py). A cluster agent starts it for an
    InferenceService replica whose spec names no command."""
    from fleetline.agents.workloads.serve import main

    raise typer.Exit(main())


def _signal(kind: Literal["cordon", "uncordon"], cluster_id: str, reason: str | None) -> None:
    """A CORDON or UNCORDON through the API (platform admins), which appends it to the signal
    log and audits the call."""
    from fleetline.cli.client import api

    answer = api().call(
        "POST", f"/v1/clusters/{quote(cluster_id, safe='')}/{kind}", body={"reason": reason}
    )
    console.print(f"{cluster_id}: {kind} sent (offset {answer['offset']})")


@cluster.command()
def cordon(
    cluster_id: ClusterId,
    reason: Annotated[str | None, typer.Option(help="why, for the audit trail")] = None,
) -> None:
    """Take a whole cluster out of placement: what runs there stays, nothing new lands."""
    _signal("cordon", cluster_id, reason)


@cluster.command()
def uncordon(
    cluster_id: ClusterId,
    reason: Annotated[str | None, typer.Option(help="why, for the audit trail")] = None,
) -> None:
    """Return a cordoned cluster to placement."""
    _signal("uncordon", cluster_id, reason)


@cluster.command()
def health(
    topic_prefix: TopicPrefix = "fleetline",
    json_: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Each cluster's health as the emergency topic last declared it, and broken links."""
    from fleetline.processors.scheduling.client import read_topic
    from fleetline.streams.events import CLUSTER_HEALTH
    from fleetline.streams.serde import default_codec
    from fleetline.streams.topics import Topics

    config = settings("kafka")
    codec = default_codec()
    latest: dict[str, dict[str, object]] = {}
    links: dict[tuple[str, str], bool] = {}
    for msg in read_topic(config.kafka, Topics(topic_prefix).emergency):
        record = codec.decode(msg.value(), expect=CLUSTER_HEALTH).record
        if record["event"] == "PARTITION":
            links[(record["cluster_id"], record["peer"])] = bool(record["link_up"])
        latest[record["cluster_id"]] = record
    broken = sorted(f"{a}<->{b}" for (a, b), up in links.items() if not up and a < b)
    if json_:
        print(json.dumps({"clusters": latest, "broken_links": broken}, default=str))
        return
    for cluster_id, r in sorted(latest.items()):
        cordoned = " (cordoned)" if r["cordoned"] else ""
        console.print(f"{cluster_id}: {r['state']}{cordoned} since {r['since_ms']}: {r['reason']}")
    for link in broken:
        console.print(f"link down: {link}")


def register(app: typer.Typer) -> None:
    app.command(name="cluster-agent")(cluster_agent)
    app.add_typer(cluster, name="cluster")
    app.add_typer(workload, name="workload")
