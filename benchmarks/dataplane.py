"""Data plane benchmark: what a data-parallel step costs when its workers talk, in one cluster
and across clusters, with the built-in trainer as the cluster agents start it.

Four runs of the same job (same seed, same global batch of 64, `--steps` steps, no step delay,
one BLAS thread each, checkpoints every 100 steps to the S3 server): one process; two workers
in one cluster (one MPI world under `mpirun`); two workers split over two clusters (an MPI world
of one each, their leaders over the sealed channel on loopback); three workers split 1 + 2.
Measured from each run's rank-0 progress lines: steps a second, the time a step spends
exchanging (gather, the channel, the broadcast) and the bytes a step sends and receives across
clusters; and that every run ends with the one-process run's parameters. Two cores here: the
workers share them, so more workers are slower, not faster; the figures say what talking costs,
not what scaling gains. Then a prewarm: 48 MiB of objects copied between two clusters' stores
(every object's digest checked on the way and read back) at a 0.256 Gbit/s quota and unpaced.

    .venv/bin/python benchmarks/dataplane.py [--steps 1000]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from _common import local_services, report

from fleetline.agents.cluster.backends.process import MPI_ENV
from fleetline.agents.dataplane.prewarm import copy_dataset, upload
from fleetline.agents.dataplane.shards import Part, World
from fleetline.config import Settings
from fleetline.demo.prewarm_story import dataset_objects
from fleetline.storage.checkpoints import cluster_bucket
from fleetline.storage.objects import ObjectStore

TRAINER = [sys.executable, "-m", "fleetline.agents.workloads.train"]
RANK = [sys.executable, "-m", "fleetline.agents.cluster.rank"]


def run_part(
    env: dict[str, str], cluster: str, workers: int, world: World | None, out: Path
) -> subprocess.Popen[bytes]:
    part = world.part(cluster) if world is not None else Part(cluster, 0, workers)
    child = {
        **env,
        "FLEETLINE_CLUSTER": cluster,
        "FLEETLINE_LOCAL_WORKERS": str(workers),
        "FLEETLINE_RANK_BASE": str(part.first_rank),
        "FLEETLINE_WORLD_SIZE": str(world.size if world else workers),
        "FLEETLINE_PROGRESS_FILE": str(out / f"{cluster}.jsonl"),
    }
    if world is not None:
        child["FLEETLINE_PARTS"] = world.to_json()
    command = TRAINER if workers == 1 else ["mpirun", "-np", str(workers), *RANK, *TRAINER]
    return subprocess.Popen(command, env={**child, **(MPI_ENV if workers > 1 else {})})


def measure(settings: Settings, steps: int, layout: list[tuple[str, int]]) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="dataplane-"))
    run = uuid.uuid4().hex[:8]
    env = {
        **os.environ,
        **settings.s3.as_env(),
        "FLEETLINE_JOB": f"bench/{run}",
        "FLEETLINE_CHECKPOINT_BUCKET": cluster_bucket(settings.s3.bucket, layout[0][0]),
        "FLEETLINE_DATAPLANE_BUCKET": cluster_bucket(settings.s3.bucket, layout[0][0]),
        "FLEETLINE_CHECKPOINT_PREFIX": f"checkpoints/bench/{run}",
        "FLEETLINE_CHECKPOINT_KEY": base64.b64encode(os.urandom(32)).decode(),
        "FLEETLINE_RESUME_CHECKPOINT": "",
        "FLEETLINE_STEPS": str(steps),
        "FLEETLINE_CHECKPOINT_EVERY": "100",
        "FLEETLINE_REPORT_EVERY": str(steps),
        "FLEETLINE_SEED": "3",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    }
    world = None
    if len(layout) > 1:
        parts, first = [], 0
        for cluster, workers in layout:
            parts.append(Part(cluster, first, workers))
            first += workers
        world = World(tuple(parts))
    began = time.perf_counter()
    children = [run_part(env, c, w, world, out) for c, w in layout]
    codes = [child.wait(600) for child in children]
    wall = time.perf_counter() - began
    if any(codes):
        raise SystemExit(f"{layout}: exit codes {codes}")
    lines = [json.loads(x) for x in (out / f"{layout[0][0]}.jsonl").read_text().splitlines()]
    last = [x for x in lines if x["event"] == "progress"][-1]
    done = next(x for x in lines if x["event"] == "done")
    return {
        "steps_per_s": last["samples_per_s"] / 64,
        "exchange_ms": last.get("exchange_ms", 0.0),
        "cross_bytes_per_step": last.get("cross_bytes_per_step", 0),
        "wall_s": wall,
        "params": done["params_sha256"],
    }


PREWARM_MIB = 48
PREWARM_QUOTA_GBPS = 0.256


def prewarm(settings: Settings) -> dict[str, float]:
    """A dataset of PREWARM_MIB MiB (4 MiB objects) copied between two clusters' stores by the
    data mover's copy, at a tenant quota of PREWARM_QUOTA_GBPS and unpaced (what the store and
    the digest checks allow); the rate each reached."""
    prefix = f"datasets/bench/prewarm-{uuid.uuid4().hex[:8]}/"
    objects = dataset_objects(prefix, PREWARM_MIB // 4, 4)

    def store(cluster: str) -> ObjectStore:
        return ObjectStore.from_settings(settings.s3, cluster_bucket(settings.s3.bucket, cluster))

    upload(store("ca"), prefix, objects)
    rates = {}
    for name, gbps, target in (("paced", PREWARM_QUOTA_GBPS, "cb"), ("unpaced", 0.0, "cc")):
        report = copy_dataset(store("ca"), store(target), prefix, gbps * 1e9 / 8, threading.Event())
        assert report is not None and report.copied_bytes == PREWARM_MIB << 20
        rates[name] = report.rate_bps / 1e9
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    settings = Settings.from_env()
    layouts = {
        "one_process": [("ca", 1)],
        "two_workers_one_cluster": [("ca", 2)],
        "two_workers_two_clusters": [("ca", 1), ("cb", 1)],
        "three_workers_split_1_2": [("ca", 1), ("cb", 2)],
    }
    with local_services(settings) as settings:
        results = {name: measure(settings, args.steps, layout) for name, layout in layouts.items()}
        copies = prewarm(settings)
    reference = results["one_process"]["params"]
    figures: dict[str, object] = {"steps": args.steps}
    for name, result in results.items():
        figures[f"{name}_steps_per_s"] = result["steps_per_s"]
        figures[f"{name}_ms_per_step"] = 1000 / result["steps_per_s"]
        figures[f"{name}_exchange_ms_per_step"] = result["exchange_ms"]
        figures[f"{name}_cross_cluster_bytes_per_step"] = result["cross_bytes_per_step"]
        figures[f"{name}_same_parameters_as_one_process"] = result["params"] == reference
    one = figures["two_workers_one_cluster_ms_per_step"]
    split = figures["two_workers_two_clusters_ms_per_step"]
    assert isinstance(one, float) and isinstance(split, float)
    figures["split_vs_one_cluster_step_time"] = split / one
    figures["prewarm_bytes"] = PREWARM_MIB << 20
    figures["prewarm_quota_gbps"] = PREWARM_QUOTA_GBPS
    figures["prewarm_paced_gbps"] = copies["paced"]
    figures["prewarm_paced_of_quota"] = copies["paced"] / PREWARM_QUOTA_GBPS
    figures["prewarm_unpaced_gbps"] = copies["unpaced"]
    figures["target"] = (
        "bit-identical parameters in every layout; split costs stated, no target; a prewarm "
        "within 0.9-1.1 of its quota"
    )
    report("dataplane", figures)
    if not all(r["params"] == reference for r in results.values()):
        raise SystemExit("a layout ended with other parameters than one process")
    if not 0.9 <= copies["paced"] / PREWARM_QUOTA_GBPS <= 1.1:
        raise SystemExit("the prewarm's rate is not within 10 % of its quota")


if __name__ == "__main__":
    main()
