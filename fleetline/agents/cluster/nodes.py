"""A cluster manager's nodes against fleetline's, pure: what each side must be told.

A node its manager takes out of service (Slurm: DOWN, DRAIN, FAIL, NOT_RESPONDING) for a
reason of its own is fenced in fleetline (a FENCE request: the scheduler places nothing there
and moves what runs there from its last checkpoint), and unfenced when the manager returns it;
a node fleetline cordons is drained in the manager (its reason names fleetline, which tells it
apart from the manager's own drains), and resumed when fleetline uncordons it. The agent
remembers which fences are its own, so an operator's fence is never lifted by the manager's
word.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass

# The reason fleetline gives the nodes it drains in a manager: its prefix marks them as ours.
DRAIN_REASON = "fleetline: cordoned"


@dataclass(frozen=True)
class ManagerNode:
    """One node as its cluster's manager reports it."""

    name: str
    usable: bool  # takes jobs (idle, allocated, mixed, ...)
    why: str  # the manager's state and reason: "DOWN (Not responding)"
    drained_by_fleetline: bool


@dataclass(frozen=True)
class Fence:
    node: str
    reason: str


@dataclass(frozen=True)
class Unfence:
    node: str
    reason: str


@dataclass(frozen=True)
class Drain:
    node: str


@dataclass(frozen=True)
class Resume:
    node: str


NodeAction = Fence | Unfence | Drain | Resume


def sync(
    manager: Mapping[str, ManagerNode],
    cordoned: Mapping[str, bool],
    fenced_here: Set[str],
    manager_name: str,
) -> list[NodeAction]:
    """The actions that bring the two sides together, node by node in name order.
    `cordoned`: fleetline's cordon of each node it knows (the view's NodeStates); `fenced_here`:
    the nodes this agent fenced."""
    actions: list[NodeAction] = []
    for name in sorted(manager):
        node = manager[name]
        if not node.usable and not node.drained_by_fleetline and name not in fenced_here:
            actions.append(Fence(name, f"{manager_name}: {node.why}"))
        elif node.usable and name in fenced_here:
            actions.append(Unfence(name, f"{manager_name} returned it to service"))
        if name not in cordoned:
            continue  # fleetline does not know the node (yet): nothing to carry over
        if cordoned[name] and node.usable:
            actions.append(Drain(name))
        elif not cordoned[name] and node.drained_by_fleetline:
            actions.append(Resume(name))
    return actions
