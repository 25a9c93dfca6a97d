"""The `fleetline` command: one module per command group, composed here.

A new command goes in the module of its group (or a new module, added to `_GROUPS`); its
`--help` comes from its signature and docstring. A command imports what it runs inside its
function: every `fleetline` process, an agent's too, imports every group module.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated

import typer

from fleetline.cli import (
    agents,
    audit,
    cluster,
    contract,
    data,
    doctor,
    enroll,
    infra,
    jobs,
    lab,
    operations,
    postmortem,
    run,
    serve,
    serving,
    session,
    specs,
    view,
)
from fleetline.errors import (
    EXIT_NOPERM,
    EXIT_UNAVAILABLE,
    AuthError,
    FleetlineError,
    NotPermitted,
    ServiceUnavailable,
)


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


app = typer.Typer(
    name="fleetline",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Event-sourced control plane for multi-cluster GPU fleets. Settings come from "
    "FLEETLINE_* environment variables (see docs/configuration.md).",
)
_GROUPS = (
    session,
    doctor,
    enroll,
    infra,
    lab,
    run,
    agents,
    cluster,
    serve,
    serving,
    audit,
    data,
    specs,
    jobs,
    operations,
    postmortem,
    view,
    contract,
)


@app.callback()
def _root(
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="log at INFO level")] = False,
    log_format: Annotated[
        LogFormat,
        typer.Option(
            envvar="FLEETLINE_LOG_FORMAT",
            help="text, or json: one JSON object a line with the trace id (what the logs "
            "topic and ClickHouse's logs table hold)",
        ),
    ] = LogFormat.TEXT,
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    from fleetline.api.auth import CredentialFilter
    from fleetline.observability import crashes, logs

    if not faulthandler.is_enabled():  # enabled already: pytest's, when a test calls main()
        crashes.report_fatal_signals(sys.stderr)

    logs.configure(" ".join(sys.argv[1:3]) or "fleetline", log_format is LogFormat.JSON)
    for handler in logging.getLogger().handlers:
        handler.addFilter(CredentialFilter())
    if not verbose:
        # librdkafka warns while a fresh broker loads its coordinators; it retries by itself.
        logging.getLogger("fleetline.librdkafka").setLevel(logging.ERROR)


for _group in _GROUPS:
    _group.register(app)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code (1: an error fleetline names, 2: a usage error,
    69: a service the command needs is not answering, 77: refused: not signed in, or not
    allowed)."""
    try:
        app(args=list(argv) if argv is not None else None, prog_name="fleetline")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
    except ServiceUnavailable as exc:
        print(f"fleetline: unavailable: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except NotPermitted as exc:
        print(f"fleetline: not permitted: {exc}", file=sys.stderr)
        return EXIT_NOPERM
    except AuthError as exc:  # the server refused who we are, or what we may do
        print(f"fleetline: refused: {exc}", file=sys.stderr)
        return EXIT_NOPERM
    except FleetlineError as exc:
        print(f"fleetline: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
