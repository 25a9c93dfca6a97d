"""Cluster control benchmark: how fast a lost cluster leaves the pool and its jobs are placed
again, on 80,000 GPUs in 10 clusters with 1,000 running jobs; and checkpoint save and restore
throughput against raw S3 PUT and GET of the same bytes on the same server.

Loss (pure cores, no services): the health fold gets a heartbeat from each cluster every second
and a clock tick every 250 ms; one cluster stops. Measured: event time from its last heartbeat
to CLUSTER_DOWN (the policy's thresholds plus the tick it is judged at), the fold's CPU per
signal, then the view folding the CLUSTER_DOWN, the scheduler observing it and the one TICK
that releases every job of that cluster and places each elsewhere (decisions and RUN orders
published), all timed. What the live stack adds (Kafka hops, a process start, a checkpoint
copy) is what `fleetline run` prints for its lost cluster.

    .venv/bin/python benchmarks/cluster_control.py [--nodes 10000] [--jobs 1000]
        [--checkpoint-mb 64] [--no-s3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import tracemalloc
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from _common import local_services, report, simulated_view

from fleetline.agents.simulator import ClusterSpec
from fleetline.config import Settings
from fleetline.processors.health.fold import ClusterHealthPolicy, HealthFold
from fleetline.processors.health.runtime import signal
from fleetline.processors.scheduling.capacity import observe
from fleetline.processors.scheduling.codec import canonical_json, new_request
from fleetline.processors.scheduling.effects import Decision, WorkloadOrder
from fleetline.processors.scheduling.scheduler import Scheduler
from fleetline.processors.view.fold import apply
from fleetline.processors.view.model import ResourceView
from fleetline.storage.checkpoints import Checkpoints, in_parallel, tenant_key
from fleetline.storage.objects import ObjectStore
from fleetline.streams.serde import default_codec

BASE_MS = 1_796_000_000_000
CODEC = default_codec()


def fleet(nodes: int) -> tuple[ResourceView, list[str]]:
    per_cluster = nodes // 10
    clusters = [
        ClusterSpec(f"c{i:02d}", f"region-{i % 5}", per_cluster, nodes_per_leaf=16)
        for i in range(10)
    ]
    return simulated_view(clusters, BASE_MS), [c.cluster_id for c in clusters]


def job(n: int) -> dict:
    workers, per = [(1, 8), (1, 4), (2, 8), (4, 8)][n % 4]
    return {
        "kind": "TrainingJob",
        "metadata": {"name": f"job{n:04d}", "tenant": f"tenant{n % 10}"},
        "spec": {
            "accelerator": "H100",
            "gpus_per_worker": per,
            "workers": workers,
            "parallelism": {"tensor": per},
        },
    }


def loss(nodes: int, jobs: int) -> dict[str, object]:
    began = time.perf_counter()
    view, clusters = fleet(nodes)
    built_s = time.perf_counter() - began
    scheduler = Scheduler()
    position = 0
    now = BASE_MS + 2000

    def step(request: dict, facts=None) -> list:
        nonlocal position
        effects = scheduler.step(request, position, facts)
        position += 1
        # The cluster agents' answers: every RUN order reported running.
        for e in list(effects):
            if isinstance(e, WorkloadOrder) and e.action == "RUN":
                scheduler.step(
                    new_request(
                        "PROGRESS",
                        e.job,
                        e.tenant,
                        now,
                        "r",
                        phase="RUNNING",
                        cluster_id=e.cluster_id,
                        epoch=e.epoch,
                        attempt=e.attempt,
                    ),
                    position,
                )
                position += 1
        return effects

    facts = observe(view)
    step(new_request("TICK", "", "", now, "t", view_offsets=facts.offsets), facts)
    for n in range(jobs):
        doc = job(n)
        key = f"{doc['metadata']['tenant']}/{doc['metadata']['name']}"
        step(
            new_request(
                "SUBMIT",
                key,
                doc["metadata"]["tenant"],
                now,
                f"s{n}",
                spec_json=canonical_json(doc),
            )
        )
    running = {k for k, j in scheduler.jobs.items() if j.phase == "Running"}
    per_cluster = Counter(next(iter(scheduler.jobs[k].allocation)) for k in running)
    lost, affected = per_cluster.most_common(1)[0]

    # The health fold: heartbeats every second, ticks every 250 ms; `lost` stops at 10 s.
    fold = HealthFold(ClusterHealthPolicy())
    signals = 0
    fold_s = 0.0
    down_at = last_beat = None
    for ms in range(0, 20_000, 250):
        ts = now + ms
        batch = [signal("TICK", "", ts)]
        if ms % 1000 == 0:
            batch += [
                signal(
                    "HEARTBEAT",
                    c,
                    ts,
                    peers=[
                        {"cluster_id": p, "reachable": p != lost or ms < 10_000}
                        for p in clusters
                        if p != c
                    ],
                )
                for c in clusters
                if c != lost or ms < 10_000
            ]
            if ms < 10_000:
                last_beat = ts
        for record in batch:
            t0 = time.perf_counter()
            out = fold.step(record, signals)
            fold_s += time.perf_counter() - t0
            signals += 1
            for event in out:
                if event["event"] == "CLUSTER_DOWN" and down_at is None:
                    down_at, down = event["ts"], event
    assert down_at is not None and last_beat is not None
    # The view folds CLUSTER_DOWN; the scheduler observes and ticks once.
    t0 = time.perf_counter()
    apply(view, CODEC.decode(CODEC.encode("ClusterHealth", down)))
    view_fold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    facts = observe(view, facts)
    observe_s = time.perf_counter() - t0
    now = down_at
    effects: list = []
    ticks = 0
    tick_s = 0.0
    moved: set[str] = set()

    def ordered() -> set[str]:
        return {e.job for e in effects if isinstance(e, WorkloadOrder) and e.action == "RUN"}

    # TICKs (one a second, as `serve` runs them) until every released job has a RUN order.
    while ticks == 0 or (moved - ordered() and ticks < 30):
        request = new_request("TICK", "", "", now, f"t{ticks}", view_offsets=facts.offsets)
        t0 = time.perf_counter()
        effects += scheduler.step(request, position, facts)
        tick_s += time.perf_counter() - t0
        position += 1
        ticks += 1
        now += 1000
        moved |= {e.job for e in effects if isinstance(e, Decision) and e.outcome == "PREEMPTED"}
    placed = {e.job for e in effects if isinstance(e, Decision) and e.outcome == "PLACED"}
    runs = ordered()
    return {
        "fleet_gpus": sum(len(n.gpus) for n in view.nodes.values()),
        "clusters": len(clusters),
        "running_jobs": len(running),
        "fleet_build_s": built_s,
        "lost_cluster_jobs": affected,
        "heartbeat_to_cluster_down_s (event time)": (down_at - last_beat) / 1000,
        "health_fold_us_per_signal": fold_s / signals * 1e6,
        "view_fold_cluster_down_ms": view_fold_s * 1000,
        "scheduler_observe_ms": observe_s * 1000,
        "scheduler_ticks_to_replace_all": ticks,
        "scheduler_tick_replace_all_ms": tick_s * 1000,
        "jobs_released": len(moved),
        "jobs_replaced_with_run_orders": len(moved & placed & runs),
        "cluster_down_to_all_replaced_s (pure cores; +1 s a further TICK)": view_fold_s
        + observe_s
        + tick_s
        + (ticks - 1),
        "target_s (Karmada marks unhealthy after)": 40,
    }


def checkpoints(settings: Settings, megabytes: int, rounds: int = 5) -> dict[str, object]:
    """Save and restore of a checkpoint of 4 parts against raw S3 of the same bytes (PUT and
    GET one part after another, and GET of the parts in parallel as a restore reads them),
    each the median of `rounds` rounds taken in turn (this machine's speed drifts; single
    runs mislead); then a checkpoint 4x larger saved from and restored to files, with the
    most Python memory either held."""
    store = ObjectStore.from_settings(
        settings.s3, f"{settings.s3.bucket}-bench-{uuid.uuid4().hex[:6]}"
    )
    store.ensure_bucket()
    parts = {f"part{i}.bin": os.urandom(megabytes * 2**20 // 4) for i in range(4)}
    names = sorted(parts)
    size_mb = sum(len(p) for p in parts.values()) / 2**20
    labels = (("unsealed", None), ("sealed", tenant_key(os.urandom(32), "acme")))
    took: dict[str, list[float]] = {}

    @contextmanager
    def timing(label: str) -> Iterator[None]:
        began = time.perf_counter()
        yield
        took.setdefault(label, []).append(time.perf_counter() - began)

    for n in range(rounds):
        with timing("raw_put"):
            for name in names:
                store.put(f"raw/{name}", parts[name])
        with timing("raw_get"):
            for name in names:
                store.get(f"raw/{name}")
        with timing("raw_get_parallel"):
            in_parallel(lambda name: store.get(f"raw/{name}"), names)
        for label, key in labels:
            ckpt = Checkpoints(store, f"ckpt-{label}", key)
            with timing(f"{label}_save"):
                manifest, _ = ckpt.save(1, n, parts, {})
            with timing(f"{label}_restore"):
                loaded = ckpt.load(manifest.name)
            assert loaded[1] == parts
    median = {label: statistics.median(seconds) for label, seconds in took.items()}
    figures: dict[str, object] = {"checkpoint_mb": size_mb, "rounds (medians)": rounds}
    for label in ("raw_put", "raw_get", "raw_get_parallel"):
        figures[f"{label}_mb_s"] = size_mb / median[label]
    for label, _ in labels:
        figures[f"{label}_save_mb_s"] = size_mb / median[f"{label}_save"]
        figures[f"{label}_restore_mb_s (digests or tags verified)"] = (
            size_mb / median[f"{label}_restore"]
        )
        figures[f"{label}_save_vs_raw_put"] = median["raw_put"] / median[f"{label}_save"]
        figures[f"{label}_restore_vs_raw_get"] = median["raw_get"] / median[f"{label}_restore"]
        figures[f"{label}_restore_vs_raw_parallel_get"] = (
            median["raw_get_parallel"] / median[f"{label}_restore"]
        )
    figures["target sealed_restore_vs_raw_get"] = 0.8
    figures |= checkpoint_files(store, megabytes * 4)
    return figures


def checkpoint_files(store: ObjectStore, megabytes: int) -> dict[str, object]:
    """A sealed checkpoint of one large part saved from a file and restored to one, streamed
    in 16 MiB multipart pieces: its speed and the most Python memory held (tracemalloc)."""
    ckpt = Checkpoints(store, "ckpt-files", tenant_key(os.urandom(32), "acme"))
    with tempfile.TemporaryDirectory() as work:
        source = Path(work) / "weights.bin"
        with source.open("wb") as out:
            for _ in range(megabytes // 16):
                out.write(os.urandom(16 * 2**20))
        tracemalloc.start()
        began = time.perf_counter()
        manifest, _ = ckpt.save_files(1, 1, {"weights.bin": source}, {})
        save_s = time.perf_counter() - began
        began = time.perf_counter()
        ckpt.restore_files(manifest.name, Path(work) / "restored")
        restore_s = time.perf_counter() - began
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        with source.open("rb") as a, (Path(work) / "restored" / "weights.bin").open("rb") as b:
            while chunk := a.read(16 * 2**20):
                assert chunk == b.read(16 * 2**20)
    return {
        "file_checkpoint_mb (sealed, one part)": megabytes,
        "file_save_mb_s (tracemalloc on)": megabytes / save_s,
        "file_restore_mb_s (tracemalloc on)": megabytes / restore_s,
        "file_peak_python_memory_mb": peak / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=1_000)
    parser.add_argument("--checkpoint-mb", type=int, default=64)
    parser.add_argument("--no-s3", action="store_true")
    args = parser.parse_args()
    figures = loss(args.nodes, args.jobs)
    if not args.no_s3:
        settings = Settings.from_env()
        with local_services(settings) as settings:
            figures |= checkpoints(settings, args.checkpoint_mb)
    report("cluster_control", figures)


if __name__ == "__main__":
    main()
