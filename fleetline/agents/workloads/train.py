"""`fleetline workload train`: a small, deterministic training run under the workload contract.

A two-layer network (tanh hidden layer, softmax output) learns a teacher network's labels on a
data set generated from the job's seed, with Adam, in numpy. Every `checkpoint_every` steps it
writes a checkpoint to the cluster's object store (`storage/checkpoints.py`): parameters,
optimizer state (moments and step count), the random generator's state (which draws each
batch, so it is the data position too) and the step. On start it resumes from the newest
complete checkpoint of its own store, so a run stopped anywhere and resumed elsewhere ends
with parameters bit-identical to a run never stopped. SIGTERM: checkpoint, then exit 0. A
periodic checkpoint that cannot be written (the store unreachable: its host's links cut) is
reported and training goes on, to try again at the next, so a copy cut off from its store is
still running when the link returns (and is fenced then, if its job has moved); one on SIGTERM
or at the end that cannot be written is an exit 1.

Data-parallel: a run of several workers (one process each, under `mpirun` or `srun`) trains as
one: every worker draws the same global batch, computes its block of the batch's gradient
shards, and the data plane (`agents/dataplane/`) sums every shard in shard order and hands the
sum to every worker, within its cluster over MPI and across clusters over the leaders' sealed
channel, so the parameters stay bit-identical to one process's. Global rank 0 alone reads and
writes checkpoints; what it resumed from is handed to every worker. A SIGTERM on any worker
stops every worker after the same step; a part of the job that cannot be reached is an exit 75
(`peer_lost`), the whole job to be retried or moved.

The contract, which any other command can keep (a PyTorch job, say): environment in
(FLEETLINE_JOB, _TENANT, _CLUSTER, _EPOCH, _ATTEMPT, _TRACE_ID, _WORKERS, _RANK (global),
_LOCAL_RANK, _RANK_BASE, _LOCAL_WORKERS, _WORLD_SIZE, _PARTS and _DATAPLANE_BUCKET (a job split
across clusters), _MASTER_ADDR (where a backend starts one task per worker: the first one's node),
CUDA_VISIBLE_DEVICES, the S3 endpoint and credentials, FLEETLINE_CHECKPOINT_BUCKET and _PREFIX,
_CHECKPOINT_KEY when sealed, FLEETLINE_RESUME_CHECKPOINT (the checkpoint to resume from; empty:
start afresh; unset: the newest complete one), FLEETLINE_PROGRESS_FILE, FLEETLINE_CONTROL_FILE,
FLEETLINE_REGION; for a job with a dataset FLEETLINE_DATASET and where it is in this cluster's
store, _DATASET_BUCKET and _DATASET_PREFIX; for a federated job FLEETLINE_FEDERATED_ROUNDS and
_LOCAL_STEPS); out: JSON lines appended to the progress file (`resumed`, `world`, `progress`
(a federated one with `round` and `regions`), `checkpoint` (with a `detail` for the audit log),
`checkpoint_failed`, `tuned`, `done`, `stopped`, `peer_lost`, `dataplane_failed`) and
checkpoints with a manifest written last.

Federated (FLEETLINE_FEDERATED_ROUNDS set): each participant (one worker a region) trains
`local_steps` on its region's dataset objects, read from its own cluster's store, and the root
averages the participants' parameters each round (FedAvg, `Collective.average`), checkpointing
the aggregate with the regions that contributed; only parameters cross regions.

The control file (JSON, replaced whole by the cluster agent while the workload runs) says what
may change after the start: `checkpoint_interval_s`, the job spec's, which operations may tune.
The workload reads it at its start and after each checkpoint, and checkpoints when that many
seconds have passed since its last one or every `checkpoint_every` steps, whichever comes first;
a new interval read is reported as a `tuned` line.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fleetline.agents.dataplane.channel import DataPlaneError, run_key
from fleetline.agents.dataplane.collective import (
    PEER_TIMEOUT_S,
    Collective,
    Rendezvous,
    world_from_env,
)
from fleetline.agents.dataplane.prewarm import read_manifest
from fleetline.agents.dataplane.shards import (
    GRADIENT_SHARDS,
    World,
    describe,
    ordered_sum,
    shard_samples,
)
from fleetline.config import S3Settings
from fleetline.errors import FleetlineError
from fleetline.storage.checkpoints import Checkpoints, params_digest
from fleetline.storage.objects import ObjectStore

Arrays = dict[str, NDArray[np.float64]]
# The name of the checkpoint global rank 0 read, handed to every worker with its state.
CHECKPOINT_NAME = "checkpoint.name"
EXIT_PEER_LOST = 75  # EX_TEMPFAIL: a part of the job cannot be reached; the job resumes whole
# A Workload spec's fields (processors/scheduling/specs.py) and the variables they reach the
# workload in.
WORKLOAD_ENV = {
    "steps": "FLEETLINE_STEPS",
    "checkpoint_every_steps": "FLEETLINE_CHECKPOINT_EVERY",
    "report_every_steps": "FLEETLINE_REPORT_EVERY",
    "seed": "FLEETLINE_SEED",
    "step_delay_ms": "FLEETLINE_STEP_DELAY_MS",
}


def workload_env(workload: Mapping[str, Any]) -> dict[str, str]:
    """The contract variables of the fields a workload spec sets (the rest keep their
    defaults, which are the spec's)."""
    return {var: str(workload[name]) for name, var in WORKLOAD_ENV.items() if name in workload}


def federated_env(federated: Mapping[str, Any] | None) -> dict[str, str]:
    """The contract variables of a federated job (spec.federated): rounds and local steps."""
    if not federated:
        return {}
    return {
        "FLEETLINE_FEDERATED_ROUNDS": str(federated["rounds"]),
        "FLEETLINE_FEDERATED_LOCAL_STEPS": str(federated["local_steps"]),
    }


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    checkpoint_every: int = 200
    report_every: int = 10
    seed: int = 0
    step_delay_s: float = 0.0
    samples: int = 2048
    features: int = 16
    hidden: int = 32
    classes: int = 4
    batch: int = 64
    lr: float = 0.01

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TrainConfig:
        return cls(
            steps=int(env.get("FLEETLINE_STEPS", cls.steps)),
            checkpoint_every=int(env.get("FLEETLINE_CHECKPOINT_EVERY", cls.checkpoint_every)),
            report_every=int(env.get("FLEETLINE_REPORT_EVERY", cls.report_every)),
            seed=int(env.get("FLEETLINE_SEED", cls.seed)),
            step_delay_s=int(env.get("FLEETLINE_STEP_DELAY_MS", "0")) / 1000,
        )


def data(config: TrainConfig) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Inputs and a teacher network's labels, from the seed alone."""
    rng = np.random.default_rng([config.seed, 1])
    x = rng.standard_normal((config.samples, config.features))
    teacher = rng.standard_normal((config.features, config.classes))
    return x, np.argmax(
        np.tanh(x @ teacher) + 0.1 * rng.standard_normal((config.samples, config.classes)), axis=1
    )


def initial(config: TrainConfig) -> tuple[Arrays, Arrays, np.random.Generator]:
    """Parameters, Adam's state (zero moments, t = 0) and the batch generator."""
    rng = np.random.default_rng([config.seed, 2])
    params: Arrays = {
        "w1": rng.standard_normal((config.features, config.hidden)) * 0.3,
        "b1": np.zeros(config.hidden),
        "w2": rng.standard_normal((config.hidden, config.classes)) * 0.3,
        "b2": np.zeros(config.classes),
    }
    optimizer: Arrays = {f"m_{k}": np.zeros_like(v) for k, v in params.items()}
    optimizer |= {f"v_{k}": np.zeros_like(v) for k, v in params.items()}
    optimizer["t"] = np.zeros(1)
    return params, optimizer, np.random.default_rng([config.seed, 3])


PARAMETERS = ("w1", "b1", "w2", "b2")  # the order a gradient is flattened in


def batch_index(config: TrainConfig, rng: np.random.Generator) -> NDArray[np.int64]:
    """The samples of the next global batch (every worker draws the same: same generator)."""
    return rng.integers(0, config.samples, config.batch)


def shard_gradient(
    config: TrainConfig, params: Arrays, xb: NDArray[np.float64], yb: NDArray[np.int64]
) -> NDArray[np.float64]:
    """One gradient shard's part of the batch gradient (scaled by the whole batch, so the
    shards sum to it), flattened in PARAMETERS order, with the shard's summed loss last."""
    h = np.tanh(xb @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    loss_sum = float(-np.log(p[np.arange(len(yb)), yb] + 1e-12).sum())
    d_logits = p
    d_logits[np.arange(len(yb)), yb] -= 1
    d_logits /= config.batch
    grads = {"w2": h.T @ d_logits, "b2": d_logits.sum(axis=0)}
    dh = (d_logits @ params["w2"].T) * (1 - h**2)
    grads |= {"w1": xb.T @ dh, "b1": dh.sum(axis=0)}
    return np.concatenate([grads[k].ravel() for k in PARAMETERS] + [np.array([loss_sum])])


def my_shard_gradients(
    config: TrainConfig,
    params: Arrays,
    index: NDArray[np.int64],
    x: NDArray[np.float64],
    y: NDArray[np.int64],
    shards: range,
) -> dict[int, NDArray[np.float64]]:
    bounds = shard_samples(config.batch, GRADIENT_SHARDS)
    return {
        i: shard_gradient(config, params, x[index[a:b]], y[index[a:b]])
        for i, (a, b) in ((i, bounds[i]) for i in shards)
    }


def apply_gradient(
    config: TrainConfig, params: Arrays, optimizer: Arrays, total: NDArray[np.float64]
) -> float:
    """One Adam step with the summed gradient; the batch's mean loss before the step."""
    grads, offset = {}, 0
    for k in PARAMETERS:
        size = params[k].size
        grads[k] = total[offset : offset + size].reshape(params[k].shape)
        offset += size
    optimizer["t"] += 1
    t = optimizer["t"][0]
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for k, g in grads.items():
        m, v = optimizer[f"m_{k}"], optimizer[f"v_{k}"]
        m *= beta1
        m += (1 - beta1) * g
        v *= beta2
        v += (1 - beta2) * g * g
        params[k] -= config.lr * (m / (1 - beta1**t)) / (np.sqrt(v / (1 - beta2**t)) + eps)
    return float(total[offset]) / config.batch


def train_step(
    config: TrainConfig,
    params: Arrays,
    optimizer: Arrays,
    rng: np.random.Generator,
    x: NDArray[np.float64],
    y: NDArray[np.int64],
) -> float:
    """One step on one process (every shard here): the step a data-parallel world takes."""
    return step_on(config, params, optimizer, batch_index(config, rng), x, y)


def step_on(
    config: TrainConfig,
    params: Arrays,
    optimizer: Arrays,
    index: NDArray[np.int64],
    x: NDArray[np.float64],
    y: NDArray[np.int64],
) -> float:
    """One step over the batch `index` on one process: every shard's gradient, summed in
    shard order, and an Adam step; the batch's mean loss."""
    mine = my_shard_gradients(config, params, index, x, y, range(GRADIENT_SHARDS))
    total = ordered_sum([mine[i] for i in range(GRADIENT_SHARDS)])
    return apply_gradient(config, params, optimizer, total)


def _npz(arrays: Arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]  # numpy's stub types allow_pickle only
    return buffer.getvalue()


def _arrays(blob: bytes) -> Arrays:
    with np.load(io.BytesIO(blob), allow_pickle=False) as loaded:
        return {k: loaded[k] for k in loaded.files}


def state_parts(
    params: Arrays, optimizer: Arrays, rng: np.random.Generator, step: int
) -> dict[str, bytes]:
    return {
        "params.npz": _npz(params),
        "optimizer.npz": _npz(optimizer),
        "state.json": json.dumps(
            {"step": step, "rng": rng.bit_generator.state}, sort_keys=True
        ).encode(),
    }


def from_parts(
    parts: Mapping[str, bytes], config: TrainConfig
) -> tuple[Arrays, Arrays, np.random.Generator, int]:
    state = json.loads(parts["state.json"])
    rng = np.random.default_rng([config.seed, 3])
    rng.bit_generator.state = state["rng"]
    return _arrays(parts["params.npz"]), _arrays(parts["optimizer.npz"]), rng, int(state["step"])


class Progress:
    """The progress file: one JSON object per line, flushed as written."""

    def __init__(self, path: str | None) -> None:
        self._file = open(path, "a", buffering=1) if path else sys.stdout  # noqa: SIM115

    def write(self, **event: Any) -> None:
        self._file.write(json.dumps({"ts": int(time.time() * 1000), **event}) + "\n")
        self._file.flush()


def read_interval(control: str | None) -> float | None:
    """The checkpoint interval the control file says, or None (no file, none said, unreadable:
    the last one read stands)."""
    if not control:
        return None
    try:
        value = json.loads(Path(control).read_text()).get("checkpoint_interval_s")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) and value > 0 else None


def checkpoints_from_env(env: Mapping[str, str]) -> Checkpoints:
    s3 = S3Settings.from_env(env)
    store = ObjectStore.from_settings(s3, env["FLEETLINE_CHECKPOINT_BUCKET"])
    store.ensure_bucket()
    key = env.get("FLEETLINE_CHECKPOINT_KEY")
    return Checkpoints(
        store, env["FLEETLINE_CHECKPOINT_PREFIX"], base64.b64decode(key) if key else None
    )


def rendezvous_from_env(env: Mapping[str, str], world: World) -> Rendezvous | None:
    """Where the leaders of a job split across clusters find each other, and the key of their
    channel: None for a job in one cluster."""
    if len(world.parts) == 1:
        return None
    key = env.get("FLEETLINE_CHECKPOINT_KEY")
    if not key:
        raise DataPlaneError(
            "a job split across clusters exchanges its gradients sealed under the tenant's key, "
            "and none is set (FLEETLINE_OBJECT_ENCRYPTION_KEY of the deployment)"
        )
    epoch, attempt = int(env.get("FLEETLINE_EPOCH", "1")), int(env.get("FLEETLINE_ATTEMPT", "1"))
    bucket = env.get("FLEETLINE_DATAPLANE_BUCKET") or env["FLEETLINE_CHECKPOINT_BUCKET"]
    return Rendezvous(
        ObjectStore.from_settings(S3Settings.from_env(env), bucket),
        f"{env['FLEETLINE_CHECKPOINT_PREFIX']}/dataplane/e{epoch:010d}-a{attempt:06d}/root",
        run_key(base64.b64decode(key), env.get("FLEETLINE_JOB", ""), epoch, attempt),
        env.get("FLEETLINE_ADVERTISE_HOST") or "127.0.0.1",
        float(env.get("FLEETLINE_PEER_TIMEOUT_S") or PEER_TIMEOUT_S),
    )


def main(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    progress = Progress(env.get("FLEETLINE_PROGRESS_FILE"))
    config = TrainConfig.from_env(env)
    epoch = int(env.get("FLEETLINE_EPOCH", "1"))
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    try:
        world = world_from_env(env)
        collective = Collective.join(
            world, env.get("FLEETLINE_CLUSTER", "local"), rendezvous_from_env(env, world)
        )
    except (DataPlaneError, ValueError) as exc:
        progress.write(event="dataplane_failed", error=str(exc)[:500])
        print(f"train: {exc}", file=sys.stderr)
        return EXIT_PEER_LOST
    try:
        return _train(env, config, epoch, progress, collective, stopping)
    except DataPlaneError as exc:
        # A part of the job is gone: the whole job stops, to resume from one checkpoint.
        progress.write(event="peer_lost", error=str(exc)[:500])
        print(f"train: {exc}", file=sys.stderr)
        return EXIT_PEER_LOST
    finally:
        collective.close()


def save(
    store: Checkpoints,
    env: Mapping[str, str],
    progress: Progress,
    epoch: int,
    step: int,
    params: Arrays,
    parts: Mapping[str, bytes],
    required: bool,
    detail: str | None = None,
) -> bool:
    """Save a checkpoint; a periodic one that fails (the store unreachable: the host's links
    cut) is reported and training goes on, to try again at the next. A required one (on a
    stop, at the end) that fails stops the workload: what it did since its last checkpoint is
    not saved. `detail` goes with its CHECKPOINTED event (into the audit log)."""
    try:
        manifest, seconds = store.save(epoch, step, parts, {"params_sha256": params_digest(params)})
    except (FleetlineError, OSError) as exc:
        progress.write(event="checkpoint_failed", step=step, error=str(exc)[:500])
        if required:
            raise
        return False
    line: dict[str, Any] = {
        "event": "checkpoint",
        "step": step,
        "uri": f"s3://{env['FLEETLINE_CHECKPOINT_BUCKET']}/{store.prefix}/{manifest.name}",
        "bytes": manifest.bytes,
        "seconds": round(seconds, 4),
    }
    if detail is not None:
        line["detail"] = detail
    progress.write(**line)
    return True


def _train(
    env: Mapping[str, str],
    config: TrainConfig,
    epoch: int,
    progress: Progress,
    collective: Collective,
    stopping: list[int],
) -> int:
    # Global rank 0 reads and writes the checkpoints; every worker trains on what it read.
    store = checkpoints_from_env(env) if collective.root else None
    x, y = data(config)
    found = None
    if store is not None:
        chosen = env.get("FLEETLINE_RESUME_CHECKPOINT")
        if chosen is None:
            found = store.latest()  # run on its own: the newest complete checkpoint
        elif chosen:
            found = store.load(chosen)  # chosen by the cluster agent (and verified again here)
    shared = collective.share_state(
        {**found[1], CHECKPOINT_NAME: found[0].name.encode()} if found is not None else None
    )
    if shared is not None:
        params, optimizer, rng, step = from_parts(shared, config)
        resumed: dict[str, Any] = {
            "event": "resumed",
            "step": step,
            "checkpoint": shared[CHECKPOINT_NAME].decode(),
        }
        if store is not None:
            resumed["skipped"] = store.skipped
        progress.write(**resumed)
    else:
        params, optimizer, rng = initial(config)
        step = 0
    if collective.world.size > 1:
        progress.write(event="world", step=step, rank=collective.rank, **describe(collective.world))
    rounds = int(env.get("FLEETLINE_FEDERATED_ROUNDS") or 0)
    if rounds:
        local_steps = int(env.get("FLEETLINE_FEDERATED_LOCAL_STEPS") or 1)
        return _federate(
            env, config, epoch, progress, collective, stopping, store, params, step,
            rounds, local_steps,
        )  # fmt: skip
    began, done_before = time.perf_counter(), step
    control = env.get("FLEETLINE_CONTROL_FILE")
    interval_s: list[float | None] = [read_interval(control)]
    last_saved = [time.monotonic()]

    def retold() -> None:
        """The control file read again (after a checkpoint): a new interval counts from now."""
        now = read_interval(control)
        if now is not None and now != interval_s[0]:
            progress.write(
                event="tuned", step=step, checkpoint_interval_s=now, previous=interval_s[0]
            )
            interval_s[0] = now

    def checkpoint(required: bool) -> bool:
        assert store is not None
        saved = save(
            store,
            env,
            progress,
            epoch,
            step,
            params,
            state_parts(params, optimizer, rng, step),
            required,
        )
        last_saved[0] = time.monotonic()
        return saved

    while step < config.steps:
        before = rng.bit_generator.state
        index = batch_index(config, rng)
        mine = my_shard_gradients(config, params, index, x, y, collective.my_shards)
        total, stop = collective.exchange(step, mine, bool(stopping))
        if stop:  # asked anywhere in the job: every worker stops after the same step
            rng.bit_generator.state = before  # the batch not taken is the next one
            if store is not None:
                checkpoint(required=True)
            progress.write(event="stopped", step=step)
            return 0
        loss = apply_gradient(config, params, optimizer, total)
        step += 1
        if step % config.report_every == 0 or step == config.steps:
            elapsed = time.perf_counter() - began
            line: dict[str, Any] = {
                "event": "progress",
                "step": step,
                "loss": loss,
                "samples_per_s": round((step - done_before) * config.batch / elapsed, 1)
                if elapsed
                else None,
            }
            if collective.world.size > 1 and collective.steps:
                line["exchange_ms"] = round(1000 * collective.exchange_s / collective.steps, 3)
                line["cross_bytes_per_step"] = collective.channel_bytes // collective.steps
            progress.write(**line)
        interval = interval_s[0]
        if store is not None and (
            step % config.checkpoint_every == 0
            or step == config.steps
            or (interval is not None and time.monotonic() - last_saved[0] >= interval)
        ):
            checkpoint(required=step == config.steps)
            retold()
        if config.step_delay_s:
            time.sleep(config.step_delay_s)
    progress.write(event="done", step=step, params_sha256=params_digest(params))
    return 0


def flat(params: Arrays) -> NDArray[np.float64]:
    return np.concatenate([params[k].ravel() for k in PARAMETERS])


def unflat(vector: NDArray[np.float64], like: Arrays) -> Arrays:
    out, offset = {}, 0
    for k in PARAMETERS:
        size = like[k].size
        out[k] = vector[offset : offset + size].reshape(like[k].shape).copy()
        offset += size
    return out


def local_data(
    config: TrainConfig, part: int, parts: int, records: list[bytes] | None = None
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """A federated participant's own samples. From its region's dataset objects (`records`,
    in manifest order) where it has them: their bytes are the inputs (scaled to [-1, 1]),
    labelled by the job's teacher network (the task every region shares); else every
    `parts`-th sample of the synthetic data from its index on (no two regions share one)."""
    if not records:
        x, y = data(config)
        return x[part::parts], y[part::parts]
    raw = np.frombuffer(b"".join(records), dtype=np.uint8)
    rows = min(config.samples, len(raw) // config.features)
    if rows < config.batch:
        raise ValueError(f"the region's dataset holds {rows} samples, fewer than a batch")
    x = raw[: rows * config.features].reshape(rows, config.features) / 127.5 - 1.0
    teacher = np.random.default_rng([config.seed, 1]).standard_normal(
        (config.features, config.classes)
    )
    return x, np.argmax(np.tanh(x @ teacher), axis=1)


def region_records(env: Mapping[str, str]) -> list[bytes] | None:
    """The job's dataset as this region holds it (its objects, in manifest order), read from
    this cluster's own store: FLEETLINE_DATASET_BUCKET and _PREFIX; None when none is given
    or the store has no manifest there."""
    bucket, prefix = env.get("FLEETLINE_DATASET_BUCKET"), env.get("FLEETLINE_DATASET_PREFIX")
    if not bucket or not prefix:
        return None
    store = ObjectStore.from_settings(S3Settings.from_env(env), bucket)
    entries = read_manifest(store, prefix)
    return None if entries is None else [store.get(prefix + e.key) for e in entries]


def local_round(
    config: TrainConfig,
    params: Arrays,
    x: NDArray[np.float64],
    y: NDArray[np.int64],
    round_: int,
    part: int,
    steps: int,
) -> tuple[Arrays, float]:
    """One participant's round: `steps` Adam steps from the round's global parameters on its
    own samples (optimizer state fresh each round), the batches drawn from (seed, round, part);
    the local parameters and the last batch's loss."""
    local = {k: v.copy() for k, v in params.items()}
    _, optimizer, _ = initial(config)
    rng = np.random.default_rng([config.seed, 4, round_, part])
    loss = 0.0
    for _ in range(steps):
        loss = step_on(config, local, optimizer, rng.integers(0, len(x), config.batch), x, y)
    return local, loss


def _federate(
    env: Mapping[str, str],
    config: TrainConfig,
    epoch: int,
    progress: Progress,
    collective: Collective,
    stopping: list[int],
    store: Checkpoints | None,
    params: Arrays,
    step: int,
    rounds: int,
    local_steps: int,
) -> int:
    """Federated averaging: each participant trains `local_steps` on its own region's samples,
    the root averages the participants' parameters (weighted by their samples) and checkpoints
    the aggregate each round, naming the regions that contributed; only parameters cross."""
    parts = collective.world.parts
    part = parts.index(collective.part)
    records = region_records(env)
    x, y = local_data(config, part, len(parts), records)
    region = env.get("FLEETLINE_REGION") or collective.cluster_id
    progress.write(
        event="local_data",
        step=step,
        samples=len(x),
        source="the region's dataset objects" if records else "synthetic",
    )
    _, optimizer, rng = initial(config)  # a checkpoint's state: the aggregate and its round
    for round_ in range(step // local_steps, rounds):
        local, loss = local_round(config, params, x, y, round_, part, local_steps)
        averaged, stop, regions = collective.average(
            round_, flat(local), float(len(x)), region, bool(stopping)
        )
        if stop:  # asked anywhere: every participant stops at the same round's end
            if store is not None:
                save(store, env, progress, epoch, step, params,
                     state_parts(params, optimizer, rng, step), required=True)  # fmt: skip
            progress.write(event="stopped", step=step)
            return 0
        params = unflat(averaged, params)
        step = (round_ + 1) * local_steps
        progress.write(
            event="progress",
            step=step,
            loss=loss,
            round=round_ + 1,
            regions=regions,
            exchange_ms=round(1000 * collective.exchange_s / max(collective.steps, 1), 3),
            cross_bytes_per_step=collective.channel_bytes // max(step, 1),
        )
        if store is not None:
            save(
                store, env, progress, epoch, step, params,
                state_parts(params, optimizer, rng, step), required=round_ + 1 == rounds,
                detail=f"federated round {round_ + 1} of {rounds}: the aggregate of "
                f"{len(regions)} regions ({', '.join(regions)}); only model updates crossed",
            )  # fmt: skip
        if config.step_delay_s:
            time.sleep(config.step_delay_s)
    progress.write(event="done", step=step, params_sha256=params_digest(params))
    return 0


if __name__ == "__main__":
    sys.exit(main())
