"""`fleetline lab`: a lab of hosts on this machine, one network namespace per cluster, with real
links to cut (see fleetline/infra/lab.py)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated

import typer

from fleetline.cli.common import console
from fleetline.config import Settings

if TYPE_CHECKING:
    from fleetline.infra.lab import LabHost

lab = typer.Typer(
    help="A lab of hosts on this machine: a network namespace per cluster on a bridge, real "
    "links between them to cut and heal (root)",
    no_args_is_help=True,
)

LabName = Annotated[
    str, typer.Option(help="the lab's name (1-6 letters or digits; prefixes its links)")
]


def _host(name: str) -> LabHost:
    from fleetline.infra.lab import LabHost

    return LabHost(Settings.from_env().cache_dir, name)


@lab.command()
def up(
    clusters: Annotated[
        int,
        typer.Option(min=1, max=78, help="clusters: eu-west-a, us-east-a, ap-south-a, ..."),
    ] = 3,
    subnet: Annotated[
        str, typer.Option(help="the lab's network; the control plane takes its .1")
    ] = "10.77.0.0/16",
    name: LabName = "fl",
) -> None:
    """Make a namespace per cluster, each with its address on the control bridge and a link to
    every other cluster; print the addresses and the settings that point at the lab. Nothing is
    left half made: a failure removes what was made."""
    from fleetline.agents.simulator import default_clusters
    from fleetline.infra.lab import Lab

    plan = Lab.plan([c.cluster_id for c in default_clusters(1, clusters)], subnet, name)
    made = _host(name).up(plan)
    console.print(f"lab {made.name}: control plane at {made.control} on bridge {made.bridge}")
    for c in made.clusters:
        console.print(f"  {c.cluster_id}: {c.address} (namespace {c.namespace})")
    console.print("start the control plane on the lab's address:")
    console.print(f"  fleetline infra start --listen {made.control}")
    console.print(f"  export FLEETLINE_ADVERTISE_HOST={made.control}")


@lab.command()
def status(name: LabName = "fl") -> None:
    """The lab's clusters, their addresses and which links are cut."""
    current = _host(name).current()
    if current is None:
        console.print(f"no lab named {name!r} is up")
        return
    console.print(f"lab {current.name}: control plane at {current.control}")
    for c in current.clusters:
        console.print(f"  {c.cluster_id}: {c.address} (namespace {c.namespace})")
    console.print(f"cut: {', '.join(current.cut_links) or 'nothing'}")


@lab.command(
    name="exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def exec_(
    ctx: typer.Context,
    cluster: Annotated[str, typer.Argument(help="the cluster whose host runs it")],
    name: LabName = "fl",
) -> None:
    """Run a command on a cluster's host: `fleetline lab exec eu-west-a -- fleetline
    cluster-agent --cluster-id eu-west-a`. It binds and advertises the cluster's address
    (FLEETLINE_ADVERTISE_HOST) and reaches Kafka and S3 on the control address."""
    from fleetline.errors import ConfigError
    from fleetline.infra.lab import LabError, exec_argv, require_root

    require_root()
    command = list(ctx.args)
    if not command:
        raise ConfigError("lab exec CLUSTER -- COMMAND [ARGS...]: no command given")
    current = _host(name).current()
    if current is None:
        raise LabError(f"no lab named {name!r} is up; `fleetline lab up` first")
    argv = exec_argv(current, cluster, command, dict(os.environ))
    os.execvp(argv[0], argv)


@lab.command()
def cut(
    cluster: Annotated[str, typer.Argument(help="the cluster whose links go down")],
    from_: Annotated[
        str | None,
        typer.Option("--from", help="only its link to this cluster (both still reach the rest)"),
    ] = None,
    name: LabName = "fl",
) -> None:
    """Cut a cluster off (its control link and every link to a peer go down), or only the link
    between it and one peer."""
    _host(name).cut(cluster, from_)
    console.print(f"cut: {cluster}" + (f" <-> {from_}" if from_ else " (every link)"))


@lab.command()
def heal(name: LabName = "fl") -> None:
    """Every link up again."""
    _host(name).heal()
    console.print("healed: every link is up")


@lab.command()
def down(name: LabName = "fl") -> None:
    """Stop every process in the lab's namespaces and every process of this host still using
    the lab (a `run --lab`, the broker and S3 server on its address, anything with a socket on
    a lab address), saying which, then remove every namespace, link and route it made."""
    removed = _host(name).down(say=console.print)
    console.print(f"removed {len(removed)}: {', '.join(removed) or 'nothing (no lab was up)'}")


def register(app: typer.Typer) -> None:
    app.add_typer(lab, name="lab")
