"""`fleetline serve`: the view, the scheduler, the sinks, the audit chain and the HTTP API."""

from __future__ import annotations

import signal
import threading
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from fleetline.cli.common import ListenHost, TopicPrefix, listen_host, settings, ship_logs
from fleetline.cli.data import TierPolicy, lifetimes
from fleetline.config import Settings
from fleetline.errors import ConfigError
from fleetline.processors.view import APPLICATION_ID as VIEW_APP
from fleetline.streams.topics import CONTROL_PLANE, Topics

HELP = (
    "Folds the fleet's topics into the resource view, snapshots it to object storage, runs "
    "the scheduler over it (and the cluster health fold with its clock), sinks telemetry, "
    "node states, decisions, allocations, workload events, logs and the audit log to "
    "ClickHouse, tiers them, and serves it all over HTTP: the API (OpenAPI at /openapi.json), "
    "the operators' console at /ui and Prometheus metrics at /metrics. Start several with the "
    "same --group, different --instance-id and --sharded to share the view: each publishes its "
    "shards' capacity summaries and the one scheduler (--no-scheduler on all but one) "
    "observes those."
)


def serve(
    topic_prefix: TopicPrefix = "fleetline",
    group: Annotated[str, typer.Option(help="the view's instances (and snapshots)")] = VIEW_APP,
    instance_id: Annotated[str, typer.Option()] = "0",
    host: ListenHost = None,
    port: Annotated[int, typer.Option()] = 8080,
    snapshot_interval: Annotated[float, typer.Option(metavar="SECONDS")] = 30.0,
    no_api: Annotated[bool, typer.Option("--no-api", help="no HTTP API")] = False,
    no_audit: Annotated[
        bool, typer.Option("--no-audit", help="no audit chainer or audit sinks in this process")
    ] = False,
    tier_every: Annotated[
        float,
        typer.Option(
            metavar="SECONDS",
            help="run the tiering pass this often (0: never); the embedded "
            "store can only be tiered by the process that owns it",
        ),
    ] = 300.0,
    hot_hours: TierPolicy.HotHours = 24,
    warm_days: TierPolicy.WarmDays = 7,
    cold_days: TierPolicy.ColdDays = None,
    tenant_cold_days: TierPolicy.TenantColdDays = None,
    keep: TierPolicy.Keep = None,
    no_scheduler: Annotated[
        bool,
        typer.Option(
            "--no-scheduler",
            help="no scheduler and no cluster health fold in this process (run them in "
            "one instance: the one that holds every shard of the view, or any with --sharded)",
        ),
    ] = False,
    sharded: Annotated[
        bool,
        typer.Option(
            "--sharded",
            help="the view is split over several instances: publish this instance's shards' "
            "capacity summaries, and let its scheduler observe the summaries of every shard "
            "instead of its own view (give every instance of the group this flag)",
        ),
    ] = False,
    scheduler_policy: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="the scheduling pipeline (filters, weights, cluster preference; "
            "YAML or JSON); appended to the request log when it differs",
        ),
    ] = None,
    ops_policy: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="automated operations: OpsPolicy fields (self_healing, power_capping, "
            "auto_tune_checkpoints, burn_in_ms, low_cap_w, ...) and `rules:` (healing "
            "thresholds), YAML or JSON; appended to the operations log at start",
        ),
    ] = None,
    tick_interval: Annotated[
        float,
        typer.Option(
            metavar="SECONDS", help="how often the scheduler observes the view and reconciles"
        ),
    ] = 1.0,
    data_mover: Annotated[
        bool,
        typer.Option(
            "--data-mover/--no-data-mover",
            help="also carry out the scheduler's dataset prewarms: copy each dataset's objects "
            "between the clusters' stores (`fleetline agent data-mover` runs it on its own)",
        ),
    ] = True,
    tls_cert: Annotated[
        Path | None,
        typer.Option(
            help="serve HTTPS with this certificate (PEM); by default one from the deployment "
            "CA made on first start (FLEETLINE_CACHE_DIR/ca)"
        ),
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="... and this private key (PEM)")] = None,
    plaintext_http: Annotated[
        bool,
        typer.Option(
            "--plaintext-http",
            help="serve the API over plain HTTP (only behind a proxy that terminates TLS)",
        ),
    ] = False,
    plaintext_objects: Annotated[
        bool,
        typer.Option(
            "--plaintext-objects",
            help="store snapshots, checkpoints, models and audit archives unsealed (only where "
            "the object store encrypts at rest itself); by default they are sealed with "
            "FLEETLINE_OBJECT_ENCRYPTION_KEY or the deployment key made on first start",
        ),
    ] = False,
    router_port: Annotated[
        int | None,
        typer.Option(
            help="also host the inference router (`fleetline router`) on this port, at "
            "FLEETLINE_ADVERTISE_HOST; its callers need tokens from FLEETLINE_AUTH_CONFIG "
            "(with --no-api and none set, it is open)"
        ),
    ] = None,
) -> None:
    """Run the resource-view processor, the scheduler, the sinks and the HTTP API."""
    from fleetline.app import Options, api_server, build
    from fleetline.observability import logs
    from fleetline.processors.operations.runtime import load_ops_policy
    from fleetline.processors.scheduling.client import load_policy

    config = settings("kafka", "s3", "clickhouse", kind=CONTROL_PLANE)
    if not no_api and config.auth_config is None:
        raise ConfigError(
            "the API needs FLEETLINE_AUTH_CONFIG (tokens and/or JWT settings; "
            "see `fleetline auth token`), or run with --no-api"
        )
    if bool(tls_cert) != bool(tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    if plaintext_http and tls_cert:
        raise ConfigError("--plaintext-http and --tls-cert/--tls-key exclude each other")
    if plaintext_objects:
        config = replace(config, object_encryption_key=None)
    elif not config.object_encryption_key:
        config = config.with_deployment_key()
        typer.echo(
            f"objects sealed with the deployment key {config.deployment_key_path()} (give "
            "other hosts' processes its contents as FLEETLINE_OBJECT_ENCRYPTION_KEY)",
            err=True,
        )
    ops, rules = load_ops_policy(str(ops_policy) if ops_policy else None)
    options = Options(
        topics=Topics(topic_prefix),
        group=group,
        instance_id=instance_id,
        snapshot_interval_s=snapshot_interval,
        scheduler=not no_scheduler,
        sharded=sharded,
        # The cluster health fold and its clock run beside the one active scheduler.
        cluster_health=not no_scheduler,
        # Operations act on the whole fleet: beside the one scheduler, like health.
        operations=not no_scheduler,
        ops_policy=ops,
        healing_rules=rules,
        scheduler_policy=load_policy(str(scheduler_policy) if scheduler_policy else None),
        tick_interval_s=tick_interval,
        audit=not no_audit,
        tier_every_s=tier_every,
        lifetimes=lifetimes(hot_hours, warm_days, cold_days, tenant_cold_days, keep),
        data_mover=data_mover,
    )
    fleet = build(config, options)
    fleet.register_metrics()
    shipped = ship_logs(config, options.topics, f"serve/{instance_id}")
    signal.signal(signal.SIGTERM, lambda *_: fleet.stop.set())
    fleet.start(ready_timeout_s=None)  # the API answers while the loops join their groups
    router_stop = threading.Event()
    if router_port is not None:
        from fleetline.agents.router.server import Router
        from fleetline.cli.serving import inference_admission

        router = Router(config, options.topics, admit=inference_admission(config, no_api))
        threading.Thread(
            target=router.run, args=(config.advertise_host, router_port, router_stop), daemon=True
        ).start()
    try:
        if no_api:
            while not fleet.stop.wait(1.0):
                pass
        else:
            from fleetline.api.auth import AuthConfig, Authenticator
            from fleetline.processors.audit.runtime import KafkaAuditEmitter

            assert config.auth_config is not None
            emitter = KafkaAuditEmitter(config.kafka, options.topics)
            app = fleet.api(Authenticator(AuthConfig.from_file(config.auth_config)), emitter)
            bound = listen_host(host)
            if not tls_cert and not plaintext_http:
                tls_cert, tls_key = _deployment_certificate(config, bound, port)
            server = api_server(
                app,
                bound,
                port,
                str(tls_cert) if tls_cert else None,
                str(tls_key) if tls_key else None,
            )
            server.run()
            emitter.flush()
    except KeyboardInterrupt:
        pass
    finally:
        router_stop.set()
        fleet.close()
        logs.unship(shipped)


def _deployment_certificate(config: Settings, bound: str, port: int) -> tuple[Path, Path]:
    """The API's certificate from the deployment CA, for every address it is reached at (the
    advertised one, the one it listens on unless a wildcard, loopback), issued at each start."""
    from fleetline.infra.ca import deployment_identity

    hosts = [config.advertise_host, "127.0.0.1", "localhost"]
    if bound not in ("0.0.0.0", "::", ""):
        hosts.insert(0, bound)
    issued = deployment_identity(config.deployment_ca_path(), "api", list(dict.fromkeys(hosts)))
    typer.echo(
        f"API over HTTPS at https://{config.advertise_host}:{port} with a certificate from the "
        f"deployment CA {issued.ca} (clients: `fleetline login --server ... --ca {issued.ca}`; "
        "--tls-cert/--tls-key for your own, --plaintext-http behind a TLS proxy)",
        err=True,
    )
    return issued.cert, issued.key


def register(app: typer.Typer) -> None:
    app.command(
        name="serve",
        help=HELP,
        short_help="Run the view, the scheduler, the sinks and the HTTP API.",
    )(serve)
