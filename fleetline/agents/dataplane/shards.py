"""How a data-parallel step is cut and summed, the same whatever the number of workers. Pure.

A global batch is cut into a fixed number of gradient shards (`GRADIENT_SHARDS`, contiguous
runs of samples); each worker computes the gradients of a contiguous block of shards, and the
step's gradient is the sum of every shard's gradient taken in shard order, one addition after
another (`ordered_sum`). Floating-point addition is not associative, so a sum's bits depend on
its order: fixing the order, not the number of workers, is what makes a run on one process, on
two workers of one cluster and on workers split across clusters end with bit-identical
parameters. The cost is that whoever sums receives every shard's gradient rather than a
partial sum (GRADIENT_SHARDS vectors a step instead of one per worker).

A job's workers in several clusters form one world of global ranks: each cluster's part holds
a contiguous run of them (`Part`), and its first worker is the part's leader, which speaks for
the part across clusters; the part holding global rank 0 is the root, where every part's
shards are summed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

GRADIENT_SHARDS = 8


def shard_samples(batch: int, shards: int = GRADIENT_SHARDS) -> list[tuple[int, int]]:
    """The samples of each shard as [start, end) of the batch (the first shards one longer
    when the batch does not divide)."""
    if batch < shards:
        raise ValueError(f"a batch of {batch} samples cannot be cut into {shards} shards")
    size, extra = divmod(batch, shards)
    bounds, start = [], 0
    for index in range(shards):
        end = start + size + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def shards_of(rank: int, world: int, shards: int = GRADIENT_SHARDS) -> range:
    """The contiguous block of shards a global rank computes."""
    if not 0 < world <= shards:
        raise ValueError(
            f"a data-parallel world of {world} workers: from 1 to {shards} "
            f"(one gradient shard or more each)"
        )
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    return range(rank * shards // world, (rank + 1) * shards // world)


def ordered_sum(vectors: Sequence[NDArray[np.float64]]) -> NDArray[np.float64]:
    """((v0 + v1) + v2) + ...: the one order every worker count sums in."""
    if not vectors:
        raise ValueError("nothing to sum")
    total = np.array(vectors[0], dtype=np.float64, copy=True)
    for vector in vectors[1:]:
        total += vector
    return total


@dataclass(frozen=True)
class Part:
    """One cluster's part of a job's world: its workers hold global ranks
    [first_rank, first_rank + workers)."""

    cluster_id: str
    first_rank: int
    workers: int


@dataclass(frozen=True)
class World:
    """A job's workers across the clusters it runs in, in global rank order."""

    parts: tuple[Part, ...]

    @classmethod
    def one_part(cls, cluster_id: str, workers: int) -> World:
        return cls((Part(cluster_id, 0, workers),))

    @classmethod
    def from_json(cls, text: str) -> World:
        """The FLEETLINE_PARTS variable: [{"cluster_id", "first_rank", "workers"}, ...]."""
        try:
            items = json.loads(text)
            parts = tuple(
                Part(str(p["cluster_id"]), int(p["first_rank"]), int(p["workers"])) for p in items
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"FLEETLINE_PARTS is not a list of parts: {exc}") from None
        world = cls(parts)
        world.check()
        return world

    def to_json(self) -> str:
        return json.dumps(
            [
                {"cluster_id": p.cluster_id, "first_rank": p.first_rank, "workers": p.workers}
                for p in self.parts
            ],
            separators=(",", ":"),
        )

    def check(self) -> None:
        expected = 0
        for part in self.parts:
            if part.first_rank != expected or part.workers < 1:
                raise ValueError(
                    f"the parts' ranks must follow each other from 0: {part.cluster_id} "
                    f"starts at {part.first_rank}, expected {expected}"
                )
            expected += part.workers
        if not self.parts:
            raise ValueError("a world of no parts")

    @property
    def size(self) -> int:
        return sum(p.workers for p in self.parts)

    @property
    def root(self) -> Part:
        return self.parts[0]

    def part(self, cluster_id: str) -> Part:
        for part in self.parts:
            if part.cluster_id == cluster_id:
                return part
        raise ValueError(f"{cluster_id} holds no part of this world")

    def shards_of_part(self, part: Part, shards: int = GRADIENT_SHARDS) -> range:
        """The shards a part's workers compute, together (contiguous: their ranks are)."""
        first = shards_of(part.first_rank, self.size, shards)
        last = shards_of(part.first_rank + part.workers - 1, self.size, shards)
        return range(first.start, last.stop)


def describe(world: World) -> Mapping[str, Any]:
    """What a run reports of its world (a progress line's fields)."""
    return {
        "world_size": world.size,
        "parts": [
            {"cluster_id": p.cluster_id, "first_rank": p.first_rank, "workers": p.workers}
            for p in world.parts
        ],
    }
