"""A data-parallel job's gradient exchange: MPI inside a cluster, sealed channels between them.

Inside each cluster the part's workers are one MPI world (Open MPI through mpi4py: the cluster
agent starts them under `mpirun`, Slurm under `srun --mpi=pmix`): every worker's shard
gradients are gathered to the part's leader (its local rank 0). Across clusters the leaders
talk over `SealedChannel`s in a star: every other leader sends its part's shards to the root
(the part holding global rank 0), which sums all of them in shard order and sends the sum
back. Each leader then broadcasts the sum inside its cluster, so every worker applies the same
update to the same parameters. A single part skips the channels; a single worker skips MPI
(and does not load it).

A stop (SIGTERM on any worker) travels with the shards and comes back with the sum, so every
worker of every cluster stops after the same step; a part that goes silent or closes its
channel fails the whole exchange, and with it every worker: half a job never trains on.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fleetline.agents.dataplane.channel import (
    DataPlaneError,
    SealedChannel,
    publish_address,
    read_exact,
    wait_address,
)
from fleetline.agents.dataplane.shards import GRADIENT_SHARDS, Part, World, ordered_sum, shards_of
from fleetline.storage.objects import ObjectStore

Shards = dict[int, NDArray[np.float64]]
PEER_TIMEOUT_S = 60.0


def _encode(header: Mapping[str, Any], vectors: list[NDArray[np.float64]]) -> bytes:
    body = np.concatenate(vectors).astype(np.float64).tobytes() if vectors else b""
    return json.dumps(header, separators=(",", ":")).encode() + b"\n" + body


def _decode(payload: bytes) -> tuple[dict[str, Any], NDArray[np.float64]]:
    head, _, body = payload.partition(b"\n")
    return json.loads(head), np.frombuffer(body, dtype=np.float64)


def _split(flat: NDArray[np.float64], count: int) -> list[NDArray[np.float64]]:
    if count == 0:
        return []
    if len(flat) % count:
        raise DataPlaneError(f"{len(flat)} numbers do not make {count} equal shard gradients")
    return [np.array(v) for v in np.split(flat, count)]


def pack_state(parts: Mapping[str, bytes]) -> bytes:
    names = sorted(parts)
    head = json.dumps([[n, len(parts[n])] for n in names]).encode()
    return head + b"\n" + b"".join(parts[n] for n in names)


def unpack_state(blob: bytes) -> dict[str, bytes]:
    head, _, body = blob.partition(b"\n")
    parts, offset = {}, 0
    for name, length in json.loads(head):
        parts[str(name)] = body[offset : offset + int(length)]
        offset += int(length)
    return parts


@dataclass
class Rendezvous:
    """Where the root leader publishes its address and the others find it."""

    store: ObjectStore
    key: str
    run_key: bytes
    advertise_host: str
    timeout_s: float = PEER_TIMEOUT_S


@dataclass
class Collective:
    world: World
    cluster_id: str
    comm: Any | None  # the part's MPI world (mpi4py), None for a part of one worker
    local_rank: int
    channels: list[SealedChannel] = field(default_factory=list)  # the leader's, by peer
    shards: int = GRADIENT_SHARDS
    exchange_s: float = 0.0  # time spent exchanging, all steps
    steps: int = 0

    @property
    def part(self) -> Part:
        return self.world.part(self.cluster_id)

    @property
    def rank(self) -> int:
        """This worker's global rank."""
        return self.part.first_rank + self.local_rank

    @property
    def leader(self) -> bool:
        return self.local_rank == 0

    @property
    def root(self) -> bool:
        return self.rank == 0

    @property
    def my_shards(self) -> range:
        return shards_of(self.rank, self.world.size, self.shards)

    @property
    def channel_bytes(self) -> int:
        return sum(c.sent_bytes + c.received_bytes for c in self.channels)

    @classmethod
    def join(
        cls,
        world: World,
        cluster_id: str,
        rendezvous: Rendezvous | None,
        shards: int = GRADIENT_SHARDS,
    ) -> Collective:
        """This worker's place in the job's world: its part's MPI world when the part has
        several workers, and the leaders' channels when the job has several parts."""
        part = world.part(cluster_id)
        shards_of(world.size - 1, world.size, shards)  # a world too large fails here, clearly
        comm = None
        local_rank = 0
        if part.workers > 1:
            from mpi4py import MPI  # only where a part has several workers to talk to

            comm = MPI.COMM_WORLD
            if comm.Get_size() != part.workers:
                raise DataPlaneError(
                    f"{cluster_id}'s part has {part.workers} workers but its MPI world "
                    f"{comm.Get_size()} (start the workers under mpirun or srun --mpi=pmix)"
                )
            local_rank = comm.Get_rank()
        collective = cls(world, cluster_id, comm, local_rank, shards=shards)
        if len(world.parts) > 1 and collective.leader:
            if rendezvous is None:
                raise DataPlaneError("a job in several clusters needs its data plane's rendezvous")
            collective._connect(rendezvous)
        return collective

    def _connect(self, rendezvous: Rendezvous) -> None:
        index = self.world.parts.index(self.part)
        if index == 0:
            server = socket.create_server((rendezvous.advertise_host, 0))
            server.settimeout(rendezvous.timeout_s)
            port = server.getsockname()[1]
            publish_address(
                rendezvous.store,
                rendezvous.key,
                rendezvous.run_key,
                f"{rendezvous.advertise_host}:{port}",
            )
            peers: dict[int, SealedChannel] = {}
            try:
                while len(peers) < len(self.world.parts) - 1:
                    try:
                        sock, _ = server.accept()
                    except OSError as exc:
                        missing = [
                            p.cluster_id
                            for i, p in enumerate(self.world.parts)
                            if i and i not in peers
                        ]
                        raise DataPlaneError(
                            f"the parts in {', '.join(missing)} did not connect in "
                            f"{rendezvous.timeout_s:.0f} s ({exc})"
                        ) from exc
                    sock.settimeout(rendezvous.timeout_s)
                    try:
                        index_bytes = read_exact(sock, 4, "a new peer", "part index")
                        peer = int.from_bytes(index_bytes, "big")
                        channel = SealedChannel(sock, rendezvous.run_key, 0, peer)
                        hello = json.loads(channel.recv("hello"))
                        if not 0 < peer < len(self.world.parts) or peer in peers:
                            raise DataPlaneError(f"part {peer}: not expected")
                        if hello.get("cluster_id") != self.world.parts[peer].cluster_id:
                            raise DataPlaneError(f"part {peer} says it is {hello}")
                    except (DataPlaneError, OSError, ValueError):
                        sock.close()  # not of this run: refused, the others still awaited
                        continue
                    channel.send("welcome", b"{}")
                    peers[peer] = channel
            finally:
                server.close()
            self.channels = [peers[i] for i in sorted(peers)]
        else:
            address = wait_address(
                rendezvous.store, rendezvous.key, rendezvous.run_key, rendezvous.timeout_s
            )
            host, _, port = address.rpartition(":")
            try:
                sock = socket.create_connection((host, int(port)), rendezvous.timeout_s)
            except OSError as exc:
                raise DataPlaneError(f"the root part at {address} does not answer: {exc}") from exc
            sock.settimeout(rendezvous.timeout_s)
            sock.sendall(index.to_bytes(4, "big"))
            channel = SealedChannel(sock, rendezvous.run_key, index, 0)
            channel.send("hello", json.dumps({"cluster_id": self.cluster_id}).encode())
            channel.recv("welcome")
            self.channels = [channel]

    def exchange(self, step: int, mine: Shards, stop: bool) -> tuple[NDArray[np.float64], bool]:
        """Every shard's gradient summed in shard order, and whether any worker anywhere asked
        to stop; the same on every worker of the job."""
        began = time.perf_counter()
        if self.comm is not None:
            gathered = self.comm.gather((mine, stop), root=0)
        else:
            gathered = [(mine, stop)]
        total: NDArray[np.float64] | None = None
        if self.leader:
            assert gathered is not None
            part_shards: Shards = {}
            part_stop = False
            for shards, wants_stop in gathered:
                part_shards.update(shards)
                part_stop = part_stop or wants_stop
            total, stop = self._across(step, part_shards, part_stop)
        if self.comm is not None:
            size = len(next(iter(mine.values())))
            buffer = np.empty(size + 1) if total is None else np.append(total, float(stop))
            self.comm.Bcast(buffer, root=0)
            total, stop = buffer[:-1], bool(buffer[-1])
        assert total is not None
        self.exchange_s += time.perf_counter() - began
        self.steps += 1
        return total, stop

    def _across(self, step: int, shards: Shards, stop: bool) -> tuple[NDArray[np.float64], bool]:
        if not self.channels:
            return ordered_sum([shards[i] for i in range(self.shards)]), stop
        if not self.root:
            (channel,) = self.channels
            indices = sorted(shards)
            channel.send(
                "shards",
                _encode(
                    {"step": step, "stop": stop, "shards": indices},
                    [shards[i] for i in indices],
                ),
            )
            head, flat = _decode(channel.recv("sum"))
            if head.get("step") != step:
                raise DataPlaneError(f"the root summed step {head.get('step')}, not {step}")
            return flat, bool(head["stop"])
        everyone = dict(shards)
        for channel in self.channels:
            head, flat = _decode(channel.recv("shards"))
            if head.get("step") != step:
                raise DataPlaneError(
                    f"part {channel.peer} sent step {head.get('step')}'s shards at step {step}"
                )
            everyone.update(zip(head["shards"], _split(flat, len(head["shards"])), strict=True))
            stop = stop or bool(head["stop"])
        missing = [i for i in range(self.shards) if i not in everyone]
        if missing:
            raise DataPlaneError(f"no gradient for shards {missing} at step {step}")
        total = ordered_sum([everyone[i] for i in range(self.shards)])
        for channel in self.channels:
            channel.send("sum", _encode({"step": step, "stop": stop}, [total]))
        return total, stop

    def average(
        self, round_: int, params: NDArray[np.float64], weight: float, region: str, stop: bool
    ) -> tuple[NDArray[np.float64], bool, list[str]]:
        """Federated averaging: every participant's parameters weighted by its `weight` (its
        samples), summed in part order at the root (the same bits on every run), and the
        regions that contributed, in part order. Only these vectors cross: never data."""
        if self.comm is not None:
            raise DataPlaneError("a federated participant is one worker")
        began = time.perf_counter()
        if not self.channels:
            averaged, regions = params, [region]
        elif not self.root:
            (channel,) = self.channels
            update = {"round": round_, "stop": stop, "weight": weight, "region": region}
            channel.send("update", _encode(update, [params]))
            answer, averaged = _decode(channel.recv("aggregate"))
            if answer.get("round") != round_:
                raise DataPlaneError(
                    f"the root aggregated round {answer.get('round')}, not {round_}"
                )
            stop, regions = bool(answer["stop"]), list(answer["regions"])
        else:
            updates = [(weight, params)]
            regions = [region]
            for channel in self.channels:
                head, flat = _decode(channel.recv("update"))
                if head.get("round") != round_:
                    raise DataPlaneError(
                        f"part {channel.peer} sent round {head.get('round')}'s update in round "
                        f"{round_}"
                    )
                updates.append((float(head["weight"]), flat))
                regions.append(str(head["region"]))
                stop = stop or bool(head["stop"])
            total = sum(w for w, _ in updates)
            averaged = ordered_sum([p * (w / total) for w, p in updates])
            for channel in self.channels:
                channel.send(
                    "aggregate",
                    _encode({"round": round_, "stop": stop, "regions": regions}, [averaged]),
                )
        self.exchange_s += time.perf_counter() - began
        self.steps += 1
        return averaged, stop, regions

    def share_state(self, state: Mapping[str, bytes] | None) -> dict[str, bytes] | None:
        """Global rank 0's training state (what it resumed from, or None: a fresh start) on
        every worker: one checkpoint for the whole job."""
        blob: bytes | None = None
        if self.leader:
            if self.root:
                blob = b"" if state is None else pack_state(state)
                for channel in self.channels:
                    channel.send("state", blob)
            else:
                (channel,) = self.channels
                blob = channel.recv("state")
        if self.comm is not None:
            blob = self.comm.bcast(blob, root=0)
        assert blob is not None
        return unpack_state(blob) if blob else None

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def world_from_env(env: Mapping[str, str]) -> World:
    """The job's world as the cluster agent described it (FLEETLINE_PARTS), or, run anywhere
    else, this cluster's workers alone."""
    parts = env.get("FLEETLINE_PARTS")
    if parts:
        return World.from_json(parts)
    workers = int(env.get("FLEETLINE_LOCAL_WORKERS") or env.get("FLEETLINE_WORLD_SIZE") or 1)
    return World.one_part(env.get("FLEETLINE_CLUSTER", "local"), max(workers, 1))
