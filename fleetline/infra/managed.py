"""A fleetline cluster that a local cluster manager (Slurm, Kubernetes) runs: its
`CLUSTER[:NODES]` flag and the names of its nodes, the simulator's node ids for that cluster."""

from __future__ import annotations


def node_names(cluster_id: str, count: int) -> tuple[str, ...]:
    """The simulator's node ids for a cluster of `count` nodes, which the manager's nodes are
    named."""
    return tuple(f"{cluster_id}-n{n:04d}" for n in range(count))


def cluster_nodes(text: str) -> tuple[str, tuple[str, ...]]:
    """`CLUSTER[:NODES]` (1 node when not said) -> (the cluster, its node names)."""
    cluster_id, _, count = text.partition(":")
    if not cluster_id or (count and not count.isdigit()) or count == "0":
        raise ValueError(f"{text!r}: expected CLUSTER or CLUSTER:NODES (NODES a count >= 1)")
    return cluster_id, node_names(cluster_id, int(count or 1))
