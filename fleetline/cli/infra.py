"""`fleetline infra`: the local Kafka broker and S3 server."""

from __future__ import annotations

import json

import typer

from fleetline.cli.common import settings
from fleetline.infra import LocalServices

infra = typer.Typer(
    help="Start, stop or inspect the local Kafka and S3 services.", no_args_is_help=True
)


def _status(services: LocalServices) -> None:
    for name, up in services.status().items():
        print(f"{name}: {'up' if up else 'down'}")


@infra.command()
def start() -> None:
    """Start the broker and the S3 server (fetching and building them the first time)."""
    services = LocalServices.from_settings(settings())
    print(json.dumps({k: round(v, 2) for k, v in services.start().items()}))
    _status(services)


@infra.command()
def stop() -> None:
    """Stop both services."""
    services = LocalServices.from_settings(settings())
    services.stop()
    _status(services)


@infra.command()
def status() -> None:
    """Whether each service answers."""
    _status(LocalServices.from_settings(settings()))


@infra.command()
def wipe() -> None:
    """Stop the services and delete their data."""
    services = LocalServices.from_settings(settings())
    services.broker.wipe()
    services.object_store.wipe()
    _status(services)


def register(app: typer.Typer) -> None:
    app.add_typer(infra, name="infra")
