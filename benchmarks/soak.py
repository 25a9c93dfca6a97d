"""Soak: the control plane under steady load for a long while, watched over time.

`fleetline serve` (view, scheduler, sinks, audit linker and chainer, operations) and `fleetline
agent simulator` processes run against the local broker and S3 server while jobs arrive at a
steady rate (each deleted a while after it is decided, so the queue turns over). Every sample
interval it records each process's RSS, the view's and the scheduler's consumer lag, the
decisions made and submit-to-decision latency (the decision's append time less the moment the
job was submitted, both on this host's clock). At the end: each process's RSS slope over the
second half (a leak shows as a slope that does not flatten), lag, decisions/s and p99 per window;
all of it written to `benchmarks/results/soak.json`.

The issue's soak is 30 minutes at 80,000 GPUs at 1 Hz; the agents alone need about 5 cores for
that (see the agents benchmark), so on a small machine pass fewer nodes or a longer interval.

    .venv/bin/python benchmarks/soak.py [--minutes 30] [--nodes 1200] [--clusters 6] [--agents 2]
        [--interval-ms 1000] [--jobs-per-s 2] [--sample-s 10]
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from _common import children, local_services, report, rss_mib
from confluent_kafka import KafkaError, TopicPartition

from fleetline.agents.simulator import cluster_info, default_clusters
from fleetline.config import Settings
from fleetline.processors.scheduling.client import submit
from fleetline.processors.scheduling.codec import new_request, submit_request
from fleetline.processors.scheduling.runtime import scheduler_topics
from fleetline.processors.scheduling.specs import parse_spec
from fleetline.processors.view import APPLICATION_ID as VIEW_APP
from fleetline.processors.view.runtime import declare_clusters
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics

CODEC = default_codec()


def slope_mib_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def job(n: int) -> dict[str, Any]:
    gpus = (1, 2, 4, 8)[n % 4]
    return {
        "apiVersion": "fleetline/v1",
        "kind": "TrainingJob",
        "metadata": {"name": f"soak{n}", "tenant": f"t{n % 5}"},
        "spec": {
            "accelerator": "H100",
            "gpus_per_worker": gpus,
            "workers": 1 + n % 2,
            "parallelism": {"tensor": gpus, "pipeline": 1, "data": 1 + n % 2},
            "priority_class": ("normal", "low", "high")[n % 3],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--nodes", type=int, default=1200, help="nodes in all (8 GPUs each)")
    parser.add_argument("--clusters", type=int, default=6)
    parser.add_argument("--agents", type=int, default=2, help="agent processes")
    parser.add_argument("--interval-ms", type=int, default=1000)
    parser.add_argument("--jobs-per-s", type=float, default=2.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    args = parser.parse_args()
    settings = Settings.from_env()
    prefix = f"bench.soak.{uuid.uuid4().hex[:8]}"
    topics = Topics(prefix=prefix)
    work = Path(tempfile.mkdtemp(prefix="fleetline-soak-"))
    env = {
        **os.environ,
        "FLEETLINE_CLICKHOUSE_URL": f"chdb://{work / 'chdb'}",
        "FLEETLINE_AUDIT_SIGNING_KEY": str(work / "signing-key.pem"),
    }
    cli = [sys.executable, "-m", "fleetline.cli"]
    with local_services(settings) as settings:
        kafka_clients.ensure_topics(settings.kafka, scheduler_topics(topics))
        per_cluster = max(1, args.nodes // args.clusters)
        clusters = default_clusters(per_cluster, args.clusters)
        now_ms = int(time.time() * 1000)
        declare_clusters(settings.kafka, topics, [cluster_info(c, 1, now_ms) for c in clusters])
        logs = [open(work / name, "w") for name in ("serve.log", "agents.log")]  # noqa: SIM115
        processes: dict[str, subprocess.Popen[bytes]] = {
            "serve": subprocess.Popen(
                [
                    *cli,
                    "serve",
                    *("--no-api", "--tier-every", "0", "--snapshot-interval", "5"),
                    *("--topic-prefix", prefix),
                ],
                env=env,
                stdout=logs[0],
                stderr=logs[0],
            )
        }
        # One `agent simulator --processes N`: it runs its N children, each with every Nth
        # cluster (their RSS is read through the parent's children).
        agents = subprocess.Popen(
            [
                *cli,
                "agent",
                "simulator",
                *("--clusters", str(args.clusters), "--nodes", str(per_cluster)),
                *("--processes", str(args.agents), "--interval-ms", str(args.interval_ms)),
                *("--topic-prefix", prefix, "--state-dir", str(work / "agent")),
            ],
            env=env,
            stdout=logs[1],
            stderr=logs[1],
        )
        follower = kafka_clients.consumer(settings.kafka, f"soak-{uuid.uuid4().hex}")
        follower.assign([TopicPartition(topics.decisions, 0, 0)])
        submitted: dict[str, float] = {}
        decided: set[str] = set()
        samples: list[dict[str, Any]] = []
        latencies: list[float] = []
        began = time.time()
        next_sample = began + args.sample_s
        n = 0
        try:
            while time.time() - began < args.minutes * 60:
                due = int((time.time() - began) * args.jobs_per_s)
                requests = []
                while n < due:
                    n += 1
                    doc = job(n)
                    key = f"{doc['metadata']['tenant']}/soak{n}"
                    submitted[key] = time.time()
                    requests.append(
                        submit_request(
                            parse_spec(doc), doc, int(time.time() * 1000), uuid.uuid4().hex
                        )
                    )
                    old = n - int(60 * args.jobs_per_s)  # each job holds its GPUs about a minute
                    if old > 0:
                        old_key = f"t{old % 5}/soak{old}"
                        requests.append(
                            new_request(
                                "DELETE",
                                old_key,
                                f"t{old % 5}",
                                int(time.time() * 1000),
                                uuid.uuid4().hex,
                            )
                        )
                if requests:
                    submit(settings.kafka, topics, requests)
                for msg in follower.consume(1000, 0.2):
                    if msg.error() is not None:
                        if msg.error().code() == KafkaError._PARTITION_EOF:
                            continue
                        raise RuntimeError(msg.error().str())
                    record = CODEC.decode(msg.value()).record
                    if record["job"] in submitted and record["job"] not in decided:
                        decided.add(record["job"])
                        latencies.append(msg.timestamp()[1] / 1000 - submitted[record["job"]])
                if time.time() >= next_sample:
                    next_sample += args.sample_s
                    for name, proc in {**processes, "agents": agents}.items():
                        if proc.poll() is not None:
                            raise RuntimeError(f"{name} exited with {proc.returncode}")
                    window = sorted(latencies)
                    latencies.clear()
                    samples.append(
                        {
                            "t_s": round(time.time() - began, 1),
                            "rss_mib": {
                                **{k: rss_mib(p.pid) for k, p in processes.items()},
                                **{
                                    f"agents{i}": rss_mib(pid)
                                    for i, pid in enumerate(children(agents.pid))
                                },
                            },
                            "view_lag": kafka_clients.group_lag(
                                settings.kafka, f"{prefix}.{VIEW_APP}", topics.node_topics
                            ),
                            "scheduler_lag": kafka_clients.group_lag(
                                settings.kafka, f"{prefix}.scheduler", [topics.scheduler_requests]
                            ),
                            "submitted": n,
                            "decided": len(decided),
                            "p99_decision_ms": round(1000 * window[int(0.99 * (len(window) - 1))])
                            if window
                            else None,
                        }
                    )
                    print(samples[-1], flush=True)
        finally:
            follower.close()
            for proc in (agents, *processes.values()):
                proc.send_signal(signal.SIGTERM)
            for proc in (agents, *processes.values()):
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            for log in logs:
                log.close()
    half = [s for s in samples if s["t_s"] >= samples[-1]["t_s"] / 2] if samples else []
    slopes = (
        {
            name: round(
                slope_mib_per_min(
                    [(s["t_s"], s["rss_mib"][name]) for s in half if s["rss_mib"].get(name)]
                ),
                2,
            )
            for name in samples[-1]["rss_mib"]
        }
        if samples
        else {}
    )
    windows = [s["p99_decision_ms"] for s in samples if s["p99_decision_ms"] is not None]
    rates = [
        (b["decided"] - a["decided"]) / (b["t_s"] - a["t_s"])
        for a, b in itertools.pairwise(samples)
        if b["t_s"] > a["t_s"]
    ]
    report(
        "soak",
        {
            "minutes": args.minutes,
            "nodes": per_cluster * args.clusters,
            "gpus": per_cluster * args.clusters * 8,
            "agent_processes": args.agents,
            "interval_ms": args.interval_ms,
            "jobs_per_s": args.jobs_per_s,
            "rss_mib_last": samples[-1]["rss_mib"] if samples else {},
            "rss_slope_mib_per_min_second_half": slopes,
            "view_lag_max": max((s["view_lag"] for s in samples), default=0),
            "view_lag_last": samples[-1]["view_lag"] if samples else None,
            "scheduler_lag_max": max((s["scheduler_lag"] for s in samples), default=0),
            "jobs_decided_per_s_mean": round(statistics.fmean(rates), 2) if rates else 0,
            "p99_decision_ms_median_window": statistics.median(windows) if windows else None,
            "p99_decision_ms_worst_window": max(windows, default=None),
            "series": samples,
        },
    )


if __name__ == "__main__":
    main()
