"""Signing in: `fleetline login`, `logout` and `context list|use` (see cli/client.py)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from fleetline.cli.client import Api, Context, contexts_path, read_contexts, write_contexts
from fleetline.cli.common import console, table
from fleetline.cli.oidc import sign_in
from fleetline.errors import ConfigError


def login(
    server: Annotated[str, typer.Option(help="the API, e.g. https://fleetline.example.com:8080")],
    token: Annotated[
        str | None,
        typer.Option(
            help="an API token or an SSO JWT; `-` reads it from stdin (kept out of the "
            "shell's history)"
        ),
    ] = None,
    oidc: Annotated[
        bool,
        typer.Option(
            "--oidc",
            help="sign in through the server's identity provider in a browser (authorization "
            "code + PKCE, a loopback redirect); the id token becomes the context's token",
        ),
    ] = False,
    name: Annotated[str, typer.Option("--name", help="the context's name")] = "default",
    ca: Annotated[
        str | None, typer.Option(help="the PEM of the CA that signed the server's certificate")
    ] = None,
) -> None:
    """Sign in to a fleetline server: the credentials are checked there (GET /v1/me) and kept
    in the contexts file as its current context. Every write command (apply, delete, quota,
    cluster cordon, command, tickets move, energy apply) then goes through the API with them."""
    if oidc == (token is not None):
        raise ConfigError("sign in with one of --token or --oidc")
    if oidc:
        token = sign_in(server, ca)
    elif token == "-":
        token = sys.stdin.readline().strip()
    if not token:
        raise ConfigError("an empty token")
    context = Context(name, server.rstrip("/"), token, ca)
    me = Api(context).call("GET", "/v1/me")
    path = contexts_path()
    _, contexts = read_contexts(path)
    write_contexts(path, name, {**contexts, name: context})
    tenant = f", tenant {me['tenant']}" if me.get("tenant") else ""
    console.print(
        f"signed in to {context.server} as {me['subject']} ({me['role']}{tenant}); "
        f"context {name} in {path}"
    )


def logout(
    name: Annotated[str | None, typer.Argument(help="default: the current context")] = None,
) -> None:
    """Forget a context's credentials."""
    path = contexts_path()
    current, contexts = read_contexts(path)
    name = name or current
    if name is None or name not in contexts:
        raise ConfigError(f"no context {name!r} in {path}")
    del contexts[name]
    write_contexts(path, None if name == current else current, contexts)
    console.print(f"context {name} removed")


context = typer.Typer(help="The servers this CLI signs in to.", no_args_is_help=True)


@context.command(name="list")
def list_contexts() -> None:
    """Every context (the current one starred); tokens are not shown."""
    current, contexts = read_contexts(contexts_path())
    out = table("", "NAME", "SERVER", "CA")
    for name, c in sorted(contexts.items()):
        out.add_row("*" if name == current else "", name, c.server, c.ca or "-")
    console.print(out)


@context.command(name="use")
def use(name: Annotated[str, typer.Argument()]) -> None:
    """Make a context the current one."""
    path = contexts_path()
    _, contexts = read_contexts(path)
    if name not in contexts:
        raise ConfigError(f"no context {name!r} in {path}; known: {sorted(contexts) or 'none'}")
    write_contexts(path, name, contexts)
    console.print(f"current context: {name} ({contexts[name].server})")


def register(app: typer.Typer) -> None:
    app.command(name="login")(login)
    app.command(name="logout")(logout)
    app.add_typer(context, name="context")
