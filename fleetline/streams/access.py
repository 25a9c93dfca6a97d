"""Who may write and read which topic, as ACLs for a secured broker: derived from the topics'
specs (`TopicSpec.writers` / `readers` in topics.py, the same source as the AsyncAPI contract),
so a new topic cannot be reachable by a kind of process its spec does not name.

Pure: the grants as data; `infra/kafka_access.py` turns them into SCRAM users and ACLs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fleetline.streams.topics import CONTROL_PLANE, OPERATOR, SERVICE_KINDS, TopicSpec

# Kinds that read every topic under the prefix: the control plane folds or sinks each of them,
# and the operator's read-only commands (get, describe, replay, audit verify) may look at any.
READ_EVERYTHING = frozenset({CONTROL_PLANE, OPERATOR})


@dataclass(frozen=True)
class Grant:
    """What one kind of process may do: append to `writes`, read `reads` (exact topic names),
    or, with `reads_prefix`, read every topic under the deployment's prefix; only the control
    plane creates topics and runs transactions."""

    kind: str
    writes: frozenset[str]
    reads: frozenset[str]
    reads_prefix: bool
    creates_topics: bool
    transactional: bool


def grants(specs: Iterable[TopicSpec]) -> dict[str, Grant]:
    """Each kind of process's grant over `specs` (every topic of a deployment, changelogs
    included)."""
    specs = list(specs)
    return {
        kind: Grant(
            kind,
            frozenset(s.name for s in specs if kind in s.writers),
            frozenset(s.name for s in specs if kind in s.readers or kind in s.writers)
            if kind not in READ_EVERYTHING
            else frozenset(),
            kind in READ_EVERYTHING,
            kind == CONTROL_PLANE,
            kind == CONTROL_PLANE,
        )
        for kind in SERVICE_KINDS
    }
