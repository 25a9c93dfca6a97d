"""`fleetline run`: a scenario played on the real stack, then what every stage saw."""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING, Annotated

import typer

from fleetline.cli.common import console, settings
from fleetline.config import Settings
from fleetline.errors import ConfigError
from fleetline.infra import LocalServices
from fleetline.infra.ca import deployment_identity
from fleetline.streams.topics import Topics
from fleetline.tls import ROUTER_IDENTITY

if TYPE_CHECKING:
    from fleetline.infra.lab import Lab


def run(
    scenario: Annotated[
        str,
        typer.Option(
            help="a scenario in fleetline/demo/scenarios (default, managers, dataplane, "
            "heterogeneous) "
            "or a YAML file"
        ),
    ] = "default",
    clusters: Annotated[
        int | None, typer.Option(min=1, help="use only the scenario's first N clusters")
    ] = None,
    nodes: Annotated[
        int | None,
        typer.Option(min=1, help="nodes per cluster (8 GPUs each); default: the scenario's"),
    ] = None,
    ticks: Annotated[
        int | None,
        typer.Option(min=2, help="sampling intervals to simulate; default: the scenario's"),
    ] = None,
    interval_ms: Annotated[
        int | None, typer.Option(min=1, help="sampling interval; default: the scenario's")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="simulator seed")] = None,
    realtime: Annotated[
        bool,
        typer.Option(
            "--realtime/--no-realtime",
            help="pace the agents at the sampling interval (--no-realtime: at once)",
        ),
    ] = True,
    topic_prefix: Annotated[
        str | None, typer.Option(help="topic prefix (default: a fresh one per run)")
    ] = None,
    keep_services: Annotated[
        bool,
        typer.Option("--keep-services", help="leave Kafka and the S3 server running afterwards"),
    ] = False,
    external_services: Annotated[
        bool,
        typer.Option(
            "--external-services", help="use the Kafka and S3 named in the settings; start nothing"
        ),
    ] = False,
    lab: Annotated[
        bool,
        typer.Option(
            "--lab",
            help="play it in the lab (`sudo fleetline lab up` first; root): the control plane "
            "on the lab's address, each cluster's agent and workloads on its cluster's host, "
            "the cluster lost by a real link cut",
        ),
    ] = False,
    lab_name: Annotated[str, typer.Option(help="with --lab: the lab's name")] = "fl",
    plaintext_kafka: Annotated[
        bool,
        typer.Option(
            "--plaintext-kafka",
            help="run Kafka without SASL/SCRAM and ACLs (by default each process signs in as "
            "its kind and may reach only its topics)",
        ),
    ] = False,
) -> None:
    """Run a simulated fleet end to end from a scenario and print what it saw."""
    from dataclasses import replace

    from fleetline.cli import report
    from fleetline.demo import scenario as scenarios
    from fleetline.demo.play import play
    from fleetline.demo.verdict import StoryIncomplete, story_steps
    from fleetline.infra import needs
    from fleetline.infra.lab import LabHost

    config = settings("kafka", "s3", kind=None) if external_services else settings(kind=None)
    # The story plays the control plane, which holds the identity root; each agent it starts
    # writes under its own identity derived from it.
    config = config.with_identity_root(create=True)
    the_lab = None
    if lab:
        config, the_lab = _in_lab(config, lab_name)
    story = scenarios.load(scenario).sized(nodes=nodes, clusters=clusters, ticks=ticks)
    # Every tool the story plays is checked before anything starts (exit 69 in one line), not
    # met as a job's third failed attempt minutes later.
    needs.require(
        config.cache_dir,
        [*([] if external_services else needs.service_needs(config.cache_dir)), *story.needs()],
        f"fleetline run --scenario {scenario}",
    )
    if the_lab is not None:
        missing = [
            c.spec.cluster_id
            for c in story.clusters
            if c.spec.cluster_id not in {h.cluster_id for h in the_lab.clusters}
        ]
        if missing:
            raise ConfigError(
                f"the lab has no host for cluster(s) {missing}: `fleetline lab down` and "
                f"`fleetline lab up --clusters {len(story.clusters)}`"
            )
        for host in the_lab.clusters:
            console.print(f"lab: {host.cluster_id} on {host.address} ({host.namespace})")
    story = replace(
        story,
        interval_ms=interval_ms or story.interval_ms,
        seed=story.seed if seed is None else seed,
    )
    services = LocalServices.from_settings(config)
    already_up = all(services.status().values())
    if not external_services and not already_up:
        secure = not plaintext_kafka
        if services.kafka.secrets is None if secure else services.kafka.secrets is not None:
            # The broker's data is of the other kind (a demo's topics only): start afresh.
            services.kafka.wipe()
        services = LocalServices.from_settings(config, secure=secure)
    if not external_services:
        console.print(
            "starting Kafka and the S3 server (the first run downloads and builds them)..."
        )
        for step, seconds in services.start().items():
            console.print(f"  {step}: {seconds:.1f}s")
    prefix = topic_prefix or f"fleetline.run{int(time.time())}"
    # Given in the environment, or the deployment's own key (found here, or made now).
    key_from_env = bool(os.environ.get("FLEETLINE_OBJECT_ENCRYPTION_KEY"))
    config = config.with_deployment_key()
    # The router, the cluster agents' probes and the replicas speak mutual TLS with identities
    # from the deployment CA (the operator's own when FLEETLINE_TLS_* names them).
    tls_from_env = config.tls is not None
    authority = None if tls_from_env else config.deployment_ca_path()
    if authority is not None:
        router = deployment_identity(authority, ROUTER_IDENTITY, ["127.0.0.1", "localhost"])
        config = replace(config, tls=router.settings())
    acls = 0
    secrets = None if external_services else services.kafka.secrets
    if secrets is not None:
        from fleetline.app import deployment_topics
        from fleetline.infra.kafka_access import grant

        acls = grant(
            services.kafka.bootstrap_servers, secrets, prefix, deployment_topics(Topics(prefix))
        )
        config = replace(config, kafka=replace(config.kafka, principals=secrets.principals()))
    for line in security_summary(config, acls, prefix, key_from_env, tls_from_env):
        console.print(line)
    start_ms = (int(time.time() * 1000) // story.interval_ms) * story.interval_ms
    if not realtime:
        # Played at once, the story's intervals end where the clock is now, not in the future
        # (the view holds back event times too far ahead of the broker's).
        start_ms -= (story.ticks + 1) * story.interval_ms
    console.print(
        f"scenario {story.name}: {len(story.clusters)} clusters x "
        f"{story.clusters[0].spec.nodes} nodes x 8 GPUs for {story.ticks} intervals "
        f"of {story.interval_ms} ms (topics {prefix}.*)"
    )
    try:
        with contextlib.ExitStack() as using:
            if the_lab is not None:
                # `fleetline lab down` meanwhile stops this run first (and its services).
                using.enter_context(
                    LabHost(config.cache_dir, lab_name).used_by(f"fleetline run --lab {prefix}")
                )
            result = play(
                config,
                story,
                start_ms=start_ms,
                realtime=realtime,
                topics=Topics(prefix),
                progress=lambda line: console.print("  " + line),
                lab=the_lab,
                authority=authority,
            )
    finally:
        if not external_services and not keep_services and not already_up:
            services.stop()
    report.print_result(console, result, config.clickhouse_url, prefix)
    steps = story_steps(result, story)
    report.print_steps(console, steps)
    missed = [s.name for s in steps if not s.happened]
    if missed:
        raise StoryIncomplete(
            f"{len(missed)} of {len(steps)} story steps did not happen as scripted: "
            + "; ".join(missed)
        )


def security_summary(
    config: Settings, acls: int, prefix: str, key_from_env: bool, tls_from_env: bool
) -> list[str]:
    """What guards this run, one line each: on, or off and why."""
    key = "FLEETLINE_OBJECT_ENCRYPTION_KEY" if key_from_env else config.deployment_key_path()
    mutual = (
        "off (FLEETLINE_TLS_* unset)"
        if config.tls is None
        else f"on, certificates from {'FLEETLINE_TLS_*' if tls_from_env else config.tls.ca.parent}"
        " (a replica serves inference to the router's identity only)"
    )
    kafka = (
        f"on: SASL/SCRAM, {len(config.kafka.principals)} principals, {acls} ACLs on {prefix}.*"
        if config.kafka.principals
        else "off (--plaintext-kafka, or services started without --secure)"
    )
    return [
        "security:",
        f"  Kafka sign-in and ACLs per kind of process: {kafka}",
        f"  objects sealed (snapshots, checkpoints, audit archives, agent spools): on, key {key}",
        "  analyst SQL allow-list, audited data reads, API tokens and roles: on",
        "  TLS on the API: on (a certificate from the deployment CA in "
        f"{config.deployment_ca_path()}); the query service: TLS with a pinned certificate "
        "and a token",
        f"  mutual TLS between the router, the cluster agents and the replicas: {mutual}",
    ]


def _in_lab(config: Settings, name: str) -> tuple[Settings, Lab]:
    """The settings that put the control plane on the lab's address, and the lab."""
    from dataclasses import replace

    from fleetline.infra.lab import LabError, LabHost, require_root

    require_root()
    lab = LabHost(config.cache_dir, name).current()
    if lab is None:
        raise LabError(f"no lab named {name!r} is up: `sudo fleetline lab up --clusters 3` first")
    if any(LocalServices.from_settings(config).status().values()):
        raise ConfigError(
            "Kafka or the S3 server already runs on "
            f"{config.kafka.bootstrap_servers} / {config.s3.endpoint}; the lab's are started "
            "on the lab's address with the same data: `fleetline infra stop` first"
        )
    port = config.kafka.bootstrap_servers.split(",")[0].rsplit(":", 1)[1]
    s3_port = config.s3.endpoint.rsplit(":", 1)[1]
    return (
        replace(
            config,
            kafka=replace(config.kafka, bootstrap_servers=f"{lab.control}:{port}"),
            s3=replace(config.s3, endpoint=f"{lab.control}:{s3_port}"),
            advertise_host=lab.control,
        ),
        lab,
    )


def register(app: typer.Typer) -> None:
    app.command(name="run")(run)
