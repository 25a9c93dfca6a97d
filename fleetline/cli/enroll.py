"""`fleetline enroll`: writer identities for agent hosts, on the control plane's host.

Like `fleetline auth token`, a tool of the host that holds the deployment's secrets: it derives
a writer's credential from the identity root (which never leaves that host), writes it to an
owner-only file for the agent's host (`FLEETLINE_IDENTITY_FILE` there), and appends the ENROL
to the identities topic; `revoke` appends a REVOKE, which every fold honours from the broker's
append time on (docs/security.md, "Who wrote this record").
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from fleetline.cli.common import TopicPrefix, settings
from fleetline.streams.topics import CONTROL_PLANE, Topics

if TYPE_CHECKING:  # a command imports what it runs inside its function (cli/__init__.py)
    from fleetline.config import Settings
    from fleetline.identity.writers import Gate, Writer

enroll = typer.Typer(
    help="Enrol writer identities (node, cluster, mover, router) and revoke them.",
    no_args_is_help=True,
)

KindArg = Annotated[str, typer.Argument(help="node, cluster, mover or router")]
NameArg = Annotated[
    list[str],
    typer.Argument(help="who: CLUSTER/NODE for a node, the cluster id, the mover or router name"),
]


def _writers(kind: str, names: list[str]) -> list[Writer]:
    from fleetline.identity.writers import Writer, WriterKind

    if kind not in ("node", "cluster", "mover", "router"):
        raise typer.BadParameter(f"{kind!r}: enrol a node, cluster, mover or router")
    return [Writer.parse(f"{WriterKind(kind).value}:{name}") for name in names]


def _read_identities(topic_prefix: str) -> tuple[Settings, Topics, Gate]:
    """The control plane's settings, the topics, and a gate whose registry is the identities
    topic as it stands now."""
    from fleetline.streams import kafka as kafka_clients
    from fleetline.streams.writers import replay_gate

    config = settings("kafka", kind=CONTROL_PLANE)
    topics = Topics(topic_prefix)
    kafka_clients.ensure_topics(config.kafka, topics.specs())
    return config, topics, replay_gate(config.kafka, topics)


@enroll.command(name="issue")
def issue(
    kind: KindArg,
    names: NameArg,
    out: Annotated[
        Path, typer.Option(help="the credential file for the agent's host (owner-only)")
    ],
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """Issue credentials: one file holding every named writer of `kind` at its next
    generation (past any revoked one), and an ENROL of each on the identities topic. Give the
    file to the agent's host as FLEETLINE_IDENTITY_FILE."""
    import getpass

    from fleetline.identity.keys import write_credentials
    from fleetline.identity.writers import Writer
    from fleetline.streams.writers import publish_identity_event

    config, topics, gate = _read_identities(topic_prefix)
    issued = []
    for first in _writers(kind, names):
        writer = Writer(first.kind, first.name, gate.registry.next_generation(first.id))
        publish_identity_event(config.kafka, topics, "ENROL", writer, getpass.getuser())
        issued.append(gate.credential(writer))
    write_credentials(out, issued)
    for credential in issued:
        print(f"enrolled {credential.writer.header}")
    print(f"credentials in {out} (owner-only): FLEETLINE_IDENTITY_FILE={out} on its host")


@enroll.command()
def revoke(
    kind: KindArg,
    names: NameArg,
    reason: Annotated[str, typer.Option(help="why, for the audit and the dead letters")] = "",
    topic_prefix: TopicPrefix = "fleetline",
) -> None:
    """Revoke writers: every generation issued so far is refused for each record the broker
    appends from now on, in the live folds and in every replay. Enrol again to issue a new
    generation."""
    import getpass

    from fleetline.identity.writers import Writer
    from fleetline.streams.writers import publish_identity_event

    config, topics, gate = _read_identities(topic_prefix)
    for first in _writers(kind, names):
        newest = max(gate.registry.next_generation(first.id) - 1, 1)
        writer = Writer(first.kind, first.name, newest)
        at = publish_identity_event(
            config.kafka, topics, "REVOKE", writer, getpass.getuser(), reason or None
        )
        print(f"revoked {writer.id} (generations 1-{newest}) from broker time {at}")


@enroll.command(name="list")
def list_(topic_prefix: TopicPrefix = "fleetline") -> None:
    """Every writer enrolled or revoked, with its newest generation."""
    _, _, gate = _read_identities(topic_prefix)
    registry = gate.registry
    for writer_id in sorted({*registry.enrolled, *registry.revoked}):
        revoked = registry.revoked.get(writer_id)
        line = f"{writer_id}  generation {registry.enrolled.get(writer_id, 0)}"
        if revoked is not None:
            line += f"  revoked up to {revoked.generation} from {revoked.from_ms}"
        print(line)


def register(app: typer.Typer) -> None:
    app.add_typer(enroll, name="enroll")
