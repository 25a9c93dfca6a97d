"""`fleetline infra`: the local Kafka broker and S3 server."""

from __future__ import annotations

import json
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from fleetline.cli.common import TopicPrefix, settings
from fleetline.config import host_address
from fleetline.errors import ConfigError
from fleetline.infra import LocalServices
from fleetline.infra.kubernetes import KwokCluster
from fleetline.infra.kubernetes import found as kubernetes_found
from fleetline.infra.slurm import SlurmCluster

infra = typer.Typer(
    help="Start, stop or inspect the local Kafka and S3 services (and Slurm and Kubernetes "
    "clusters).",
    no_args_is_help=True,
)


def _status(services: LocalServices, cache_dir: Path) -> None:
    for name, up in services.status().items():
        print(f"{name}: {'up' if up else 'down'}")
    for cluster in SlurmCluster.found(cache_dir):
        print(
            f"slurm {cluster.cluster_id} ({len(cluster.nodes)} nodes, SLURM_CONF={cluster.conf}): "
            f"{'up' if cluster.running() else 'down'}"
        )
    for plane in kubernetes_found(cache_dir):
        print(
            f"kubernetes {plane.cluster_id} ({len(plane.nodes)} nodes, "
            f"kubeconfig {plane.kubeconfig}): {'up' if plane.running() else 'down'}"
        )


@infra.command()
def start(
    brokers: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Kafka brokers to run (each next one two ports up, all in the KRaft quorum); "
            "3 or more replicate every topic 3 times with min.insync.replicas=2. Default: as "
            "many as FLEETLINE_KAFKA_BOOTSTRAP lists.",
        ),
    ] = None,
    listen: Annotated[
        str | None,
        typer.Option(
            metavar="ADDR",
            help="the address Kafka (listeners and advertised listeners) and the S3 server "
            "listen on, for clients on other hosts (default: FLEETLINE_KAFKA_BOOTSTRAP's and "
            "FLEETLINE_S3_ENDPOINT's hosts, 127.0.0.1)",
        ),
    ] = None,
    slurm: Annotated[
        list[str] | None,
        typer.Option(
            metavar="CLUSTER[:NODES]",
            help="also run a Slurm cluster for fleetline cluster CLUSTER on this host "
            "(repeatable): munged, slurmctld and one slurmd per node (default 1), the nodes "
            "named as the simulator names CLUSTER's, 8 GPUs each, under .cache/slurm/CLUSTER; "
            "a cluster agent with `--backend slurm` finds its slurm.conf there",
        ),
    ] = None,
    kubernetes: Annotated[
        list[str] | None,
        typer.Option(
            metavar="CLUSTER[:NODES]",
            help="also run a Kubernetes control plane for fleetline cluster CLUSTER on this "
            "host (repeatable): kube-apiserver, kube-scheduler, kube-controller-manager and etcd "
            "built from their Go modules (about 20 minutes the first time, cached in "
            "~/.cache/fleetline/kubernetes), run by kwokctl on loopback, with NODES kwok "
            "nodes (default 1) "
            "named as the simulator names CLUSTER's, 8 nvidia.com/gpu each",
        ),
    ] = None,
    secure: Annotated[
        bool,
        typer.Option(
            "--secure",
            help="Kafka takes SASL/SCRAM clients only, under ACLs: one principal per kind of "
            "process (control-plane, node-agent, cluster-agent, router, data-mover, operator), "
            "each allowed exactly the topics of --topic-prefix its specs name "
            "(`fleetline infra credentials KIND` prints a kind's settings)",
        ),
    ] = False,
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """Start the broker(s) and the S3 server (fetching and building them the first time), and
    the Slurm and Kubernetes clusters asked for."""
    address = host_address(listen, "--listen") if listen is not None else None
    config = settings(kind=None)
    try:
        clusters = [SlurmCluster.parse(config.cache_dir, text) for text in slurm or []]
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--slurm") from exc
    try:
        planes = [KwokCluster.parse(config.cache_dir, text) for text in kubernetes or []]
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--kubernetes") from exc
    services = LocalServices.from_settings(config, brokers, address, secure or None)
    started = services.start()
    secrets = services.kafka.secrets
    if secrets is not None:
        from fleetline.app import deployment_topics
        from fleetline.infra.kafka_access import grant
        from fleetline.streams.topics import Topics

        specs = deployment_topics(Topics(topic_prefix))
        count = grant(services.kafka.bootstrap_servers, secrets, topic_prefix, specs)
        print(
            f"kafka: SASL/SCRAM with {count} ACLs for topics {topic_prefix}.*; "
            "`fleetline infra credentials KIND` prints each kind's settings"
        )
    for cluster in clusters:
        started[f"slurm {cluster.cluster_id}"] = cluster.start()
    for plane in planes:
        started[f"kubernetes {plane.cluster_id}"] = plane.start()
    print(json.dumps({k: round(v, 2) for k, v in started.items()}))
    _status(services, config.cache_dir)
    if len(services.kafka.brokers) > 1 or address is not None:
        # Clients bootstrap from every broker, so one that is down does not stop them starting.
        for name, value in services.client_env().items():
            print(f"export {name}={value}")


class Buildable(StrEnum):
    KAFKA = "kafka"
    S3 = "s3"
    KUBERNETES = "kubernetes"


@infra.command()
def build(
    what: Annotated[
        list[Buildable],
        typer.Argument(
            help="kafka (the broker's jars, with Maven), s3 (versitygw, with Go) or kubernetes "
            "(the control plane and kwok, with Go, into ~/.cache/fleetline: about 20 minutes "
            "on two cores the first time)"
        ),
    ],
) -> None:
    """Fetch or build what the services run, once: what `infra start` would do on first use
    (`make kubernetes` runs this for Kubernetes, which `infra start` never builds unasked
    for long)."""
    from fleetline.infra.kubernetes import KubernetesBinaries

    config = settings(kind=None)
    services = LocalServices.from_settings(config)
    for item in dict.fromkeys(what):
        began = time.monotonic()
        if item is Buildable.KAFKA:
            done = services.kafka.fetch()
        elif item is Buildable.S3:
            done = services.object_store.build()
        else:
            done = KubernetesBinaries(config.cache_dir).build() > 0
        state = f"built in {time.monotonic() - began:.1f}s" if done else "already here"
        print(f"{item.value}: {state}")


class CredentialFormat(StrEnum):
    env = "env"
    librdkafka = "librdkafka"


@infra.command()
def credentials(
    kind: Annotated[
        str,
        typer.Argument(
            help="control-plane, node-agent, cluster-agent, router, data-mover, operator or admin"
        ),
    ],
    format_: Annotated[
        CredentialFormat,
        typer.Option(
            "--format",
            help="env: FLEETLINE_KAFKA_* exports to `eval`; librdkafka: a client properties "
            "file (`kcat -F FILE`; kcat needs librdkafka 2.6.1 or newer, see docs/security.md)",
        ),
    ] = CredentialFormat.env,
) -> None:
    """The settings a process of KIND signs in to the secured broker with (they hold a
    password)."""
    services = LocalServices.from_settings(settings(kind=None))
    if services.kafka.secrets is None:
        raise ConfigError("Kafka here is not secured: `fleetline infra start --secure`")
    if format_ is CredentialFormat.librdkafka:
        conf = {"bootstrap.servers": services.kafka.bootstrap_servers}
        conf.update(services.kafka.secrets.client_conf(kind))
        for name, value in conf.items():
            print(f"{name}={value}")
        return
    env = {"FLEETLINE_KAFKA_BOOTSTRAP": services.kafka.bootstrap_servers}
    env.update(services.kafka.secrets.client_env(kind))
    for name, value in env.items():
        print(f"export {name}={value}")


@infra.command()
def stop() -> None:
    """Stop the broker(s), the S3 server and every Slurm cluster started here (cancelling
    their jobs)."""
    config = settings(kind=None)
    services = LocalServices.from_settings(config)
    services.stop()
    for cluster in SlurmCluster.found(config.cache_dir):
        cluster.stop()
    for plane in kubernetes_found(config.cache_dir):
        plane.stop()
    _status(services, config.cache_dir)


@infra.command()
def status() -> None:
    """Whether each service answers."""
    config = settings(kind=None)
    _status(LocalServices.from_settings(config), config.cache_dir)


@infra.command()
def wipe() -> None:
    """Stop the services and delete their data."""
    config = settings(kind=None)
    services = LocalServices.from_settings(config)
    services.kafka.wipe()
    services.object_store.wipe()
    for cluster in SlurmCluster.found(config.cache_dir):
        cluster.wipe()
    for plane in kubernetes_found(config.cache_dir):
        plane.stop()
    _status(services, config.cache_dir)


ca = typer.Typer(
    help="A deployment CA for a lab or a test: the certificates the router and the inference "
    "replicas speak mutual TLS with (FLEETLINE_TLS_CA, _CERT, _KEY).",
    no_args_is_help=True,
)
CaDir = Annotated[
    Path | None,
    typer.Option("--dir", help="where the CA and the certificates live (default: .cache/tls)"),
]


def _ca_dir(directory: Path | None) -> Path:
    return directory or settings(kind=None).cache_dir / "tls"


@ca.command("init")
def ca_init(directory: CaDir = None) -> None:
    """Make the CA (kept when there is one already)."""
    from fleetline.infra import ca as authority

    print(authority.init(_ca_dir(directory)))


@ca.command("issue")
def ca_issue(
    identity: Annotated[
        str,
        typer.Argument(
            help="who holds it: `router` for a router, a cluster's name for its host "
            "(its agent and replicas)"
        ),
    ],
    host: Annotated[
        list[str],
        typer.Option(help="an address or host name it is reached at (repeatable, at least one)"),
    ],
    directory: CaDir = None,
) -> None:
    """Issue IDENTITY a certificate from the CA and print the variables that hand it to a
    process on that host."""
    from fleetline.infra import ca as authority

    issued = authority.issue(_ca_dir(directory), identity, host)
    for name, value in issued.env().items():
        print(f"export {name}={value}")


infra.add_typer(ca, name="ca")


def register(app: typer.Typer) -> None:
    app.add_typer(infra, name="infra")
