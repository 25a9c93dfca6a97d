"""Serving: the router's throughput and the latency it adds, a replica's cold and warm start,
and GPU utilisation over a simulated day with tidal pools against a fixed split.

- Router: replicas of `fleetline workload serve` (no simulated accelerator time, so only the
  HTTP path is measured) called directly and through `fleetline router`, closed-loop at a fixed
  number of requests in flight; requests/s and p50/p99 latency each way, and the difference.
  Target: the router adds under 2 ms at p50. Then `fleetline router --processes N` (1 and 2)
  on one port, the registry read from Kafka, at twice the requests in flight. Target: 5,000
  requests/s, p99 < 20 ms.
- Start: cold, a replica process from exec to ready (model loaded from S3, probe answered);
  warm, a loaded standby promoted: from its READY record on the registry topic to the first
  request the router sends it. Target: warm under 1 s, cold under 10 s.
- Tidal day: the scheduler's fold (the real autoscaler, pools and preemption) over 24 hours of
  one-minute steps on 64 GPUs: a service whose demand follows a day (2 GPUs' worth at night,
  32 at noon) and a backlog of 8-GPU training jobs. Fixed: the service holds 32 replicas all
  day, training the other 32 GPUs. Tidal: 2 to 32 replicas by the autoscaler, training
  everything else, preempted through a checkpoint when the service grows (each restart
  charged `RESTART_S` of its GPUs). Utilisation counts a training GPU as busy and a replica's
  GPU by its slots' utilisation; requests are "served" up to 80 % of the running replicas'
  capacity. Published systems report about +25 % GPU usage from lending inference GPUs to
  training (Lyra, EuroSys '23).

    python benchmarks/serving.py [--requests N] [--inflight N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from _common import cpu_s, local_services, progress_report, report, simulated_view
from aiohttp import ClientSession, TCPConnector

from fleetline.agents.router.routing import RoutingPolicy, percentile
from fleetline.agents.router.server import Router
from fleetline.agents.simulator import ClusterSpec
from fleetline.config import Settings
from fleetline.processors.scheduling.capacity import observe
from fleetline.processors.scheduling.codec import canonical_json, new_request
from fleetline.processors.scheduling.effects import WorkloadOrder
from fleetline.processors.scheduling.scheduler import Scheduler
from fleetline.streams.topics import Topics

BASE_MS = 1_796_000_000_000
REPLICA_RPS = 20.0  # one replica: 2 slots x 100 ms
RESTART_S = 120.0  # a preempted training job's restart: its GPUs idle this long


def start_replica(settings: Settings, name: str, compute_ms: float) -> tuple[Any, str, float]:
    """(process, address, seconds from exec to ready)."""
    progress = Path(tempfile.mkdtemp(prefix="bench-serve-")) / "progress.jsonl"
    env = {
        **os.environ,
        **settings.s3.as_env(),
        "FLEETLINE_CHECKPOINT_BUCKET": f"{settings.s3.bucket}-bench",
        "FLEETLINE_MODEL": "bench",
        "FLEETLINE_MODEL_PREFIX": f"models/bench/{uuid.uuid4().hex}",
        "FLEETLINE_PROGRESS_FILE": str(progress),
        "FLEETLINE_JOB": name,
        "FLEETLINE_SERVE_CONCURRENCY": "256",
        "FLEETLINE_SERVE_COMPUTE_MS": str(compute_ms),
    }
    began = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "fleetline.agents.workloads.serve"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while True:
        lines = progress.read_text().splitlines() if progress.exists() else []
        ready = [json.loads(x) for x in lines if '"ready"' in x]
        if ready:
            return process, ready[0]["address"], time.perf_counter() - began
        if process.poll() is not None:
            raise RuntimeError("the replica exited before it was ready")
        time.sleep(0.005)


async def closed_loop(url: str, requests: int, inflight: int) -> dict[str, float]:
    body = json.dumps({"inputs": [[0.1] * 16]}).encode()
    latencies: list[float] = []
    left = requests

    async def worker(session: ClientSession) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            began = time.perf_counter()
            async with session.post(
                url, data=body, headers={"Content-Type": "application/json"}
            ) as answer:
                await answer.read()
                assert answer.status == 200, answer.status
            latencies.append((time.perf_counter() - began) * 1000)

    async with ClientSession(connector=TCPConnector(limit=0)) as session:
        began = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(inflight)))
        seconds = time.perf_counter() - began
    latencies.sort()
    return {
        "rps": len(latencies) / seconds,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
    }


def client(url: str, requests: int, inflight: int) -> dict[str, float]:
    """`closed_loop` in a process of its own, so the client does not share the router's
    interpreter (on 2 cores the three processes still share the CPUs)."""
    out = subprocess.run(
        [sys.executable, __file__, "--client", url, str(requests), str(inflight)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent,
    ).stdout
    return dict(json.loads(out))


def endpoint(replica: str, address: str, state: str = "READY") -> dict[str, Any]:
    return {
        "replica": replica,
        "service": "bench/svc",
        "tenant": "bench",
        "cluster_id": "c",
        "region": "r",
        "epoch": 1,
        "attempt": 1,
        "ts": int(time.time() * 1000) + 3_600_000,  # fresh for the whole run
        "state": state,
        "address": address,
        "heartbeat_ms": 500,
        "concurrency": 256,
        "inflight": 0,
        "queue": 0,
        "latency_p50_ms": None,
    }


def router_figures(settings: Settings, requests: int, inflight: int) -> dict[str, Any]:
    replica, address, cold_s = start_replica(settings, "bench/svc.r0", 0.0)
    standby, standby_address, _ = start_replica(settings, "bench/svc.r1", 0.0)
    try:
        topics = Topics(f"bench-{uuid.uuid4().hex[:8]}")
        router = Router(settings, topics, RoutingPolicy(), report=False)
        router.registry.apply(endpoint("bench/svc.r0", address))
        router.registry.apply(endpoint("bench/svc.r1", standby_address, "WARM"))
        stop = threading.Event()
        thread = threading.Thread(
            target=lambda: asyncio.run(router.serve("127.0.0.1", 0, stop)), daemon=True
        )
        thread.start()
        while router.address is None:
            time.sleep(0.01)
        client(f"{address}/v1/infer", 500, inflight)  # warm up
        routed_url = f"{router.address}/v1/services/bench/svc/infer"
        client(routed_url, 500, inflight)
        direct = client(f"{address}/v1/infer", requests, inflight)
        routed = client(routed_url, requests, inflight)
        single = client(routed_url, 2000, 1)
        alone = client(f"{address}/v1/infer", 2000, 1)
        # Warm: the standby's READY record reaches the router; its first routed request.
        router.registry.apply(endpoint("bench/svc.r0", address, "DRAINING"))
        promoted = time.perf_counter()
        router.registry.apply(endpoint("bench/svc.r1", standby_address))
        asyncio.run(closed_loop(f"{router.address}/v1/services/bench/svc/infer", 1, 1))
        warm_ms = (time.perf_counter() - promoted) * 1000
        stop.set()
        thread.join(5)
    finally:
        replica.terminate()
        standby.terminate()
    colds = []
    for i in range(3):
        process, _, seconds = start_replica(settings, f"bench/cold.r{i}", 0.0)
        colds.append(seconds)
        process.terminate()
    return {
        "inflight": inflight,
        "direct_rps": direct["rps"],
        "router_rps": routed["rps"],
        "direct_p50_ms": direct["p50_ms"],
        "router_p50_ms": routed["p50_ms"],
        "direct_p99_ms": direct["p99_ms"],
        "router_p99_ms": routed["p99_ms"],
        "added_p50_ms_one_in_flight": single["p50_ms"] - alone["p50_ms"],
        "added_p99_ms_one_in_flight": single["p99_ms"] - alone["p99_ms"],
        "target_added_p50_ms": 2.0,
        "cold_start_first_s": cold_s,
        "cold_start_s": sorted(colds)[1],
        "warm_promotion_to_first_request_ms": warm_ms,
        "target_cold_s": 10.0,
        "target_warm_s": 1.0,
    }


def demand_rps(minute: int) -> float:
    """A service's requests/s over a day: 2 replicas' worth at night, 32 at noon."""
    hour = minute / 60
    daylight = max(0.0, math.sin(math.pi * (hour - 6) / 12))
    return REPLICA_RPS * 0.5 * (2 + 30 * daylight)


def tidal_day(tidal: bool) -> dict[str, float]:
    clusters = [ClusterSpec("eu-a", "eu-west", 4), ClusterSpec("us-a", "us-east", 4)]
    view = simulated_view(clusters, BASE_MS)
    facts = observe(view)
    scheduler = Scheduler()
    position = 0
    start = BASE_MS
    running: dict[str, WorkloadOrder] = {}
    restarts = 0

    def feed(request: dict[str, Any]) -> None:
        nonlocal position, restarts
        pending = [request]
        while pending:
            r = pending.pop(0)
            effects = scheduler.step(r, position, facts if r["kind"] == "TICK" else None)
            position += 1
            for e in effects:
                if isinstance(e, WorkloadOrder) and e.action == "RUN":
                    if e.job.startswith("acme/train") and e.job in stopped:
                        restarts += 1
                    running[e.job] = e
                    pending.append(progress_report(e, "RUNNING", r["ts"]))
                elif isinstance(e, WorkloadOrder) and e.action == "STOP":
                    running.pop(e.job, None)
                    stopped.add(e.job)

    stopped: set[str] = set()
    policy = {"cluster_preference": ["eu-a", "us-a"], "weights": {"preference": 10}}
    feed(new_request("POLICY", "", "", start, "p", spec_json=canonical_json(policy)))
    feed(new_request("TICK", "", "", start, "t0", view_offsets=facts.offsets))
    replicas = {"min": 2, "max": 32} if tidal else {"min": 32, "max": 32}
    service = {
        "kind": "InferenceService",
        "metadata": {"name": "chat", "tenant": "acme"},
        "spec": {
            "model": "m",
            "accelerator": "H100",
            "gpus_per_replica": 1,
            "replicas": replicas,
            "latency_target_ms": 300,
            "regions": ["eu-west", "us-east"],
            "workload": {},
            "autoscaling": {
                "target_utilisation": 0.5,
                "scale_out_cooldown": 60,
                "scale_in_cooldown": 600,
                "hysteresis": 0.3,
            },
        },
    }
    feed(new_request("SUBMIT", "acme/chat", "acme", start, "s", spec_json=canonical_json(service)))
    for i in range(8):
        job = {
            "kind": "TrainingJob",
            "metadata": {"name": f"train-{i}", "tenant": "acme"},
            "spec": {
                "accelerator": "H100",
                "gpus_per_worker": 8,
                "workers": 1,
                "parallelism": {"tensor": 8},
                "priority_class": "low",
                "max_runtime": "48h",
                "workload": {},
            },
        }
        feed(
            new_request(
                "SUBMIT", f"acme/train-{i}", "acme", start, f"s{i}", spec_json=canonical_json(job)
            )
        )
    total_gpus = 64
    busy = held = served = demanded = 0.0
    for minute in range(24 * 60):
        now = start + minute * 60_000
        feed(new_request("TICK", "", "", now, f"t{now}", view_offsets=facts.offsets))
        jobs = scheduler.jobs
        serving = [
            k
            for k, j in jobs.items()
            if j.service == "acme/chat" and j.role == "serving" and j.phase.value == "Running"
        ]
        rps = demand_rps(minute)
        capacity = len(serving) * REPLICA_RPS
        utilisation = min(1.0, rps / capacity) if capacity else 1.0
        latency = 100 / max(1e-3, 1 - min(utilisation, 0.99))
        feed(
            new_request(
                "SERVICE_LOAD",
                "acme/chat",
                "acme",
                now,
                f"l{now}",
                spec_json=canonical_json(
                    {
                        "window_ms": 60_000,
                        "requests": int(rps * 60),
                        "by_region": {"eu-west": int(rps * 60)},
                        "latency_ms": {"p95": latency},
                        "utilisation": utilisation,
                        "queue": 0,
                    }
                ),
            )
        )
        demanded += rps * 60
        served += min(rps, capacity * 0.8) * 60
        training_gpus = sum(
            j.gpus
            for k, j in jobs.items()
            if k.startswith("acme/train") and j.phase.value == "Running"
        )
        replica_gpus = sum(jobs[k].gpus for k in serving)
        busy += training_gpus + replica_gpus * utilisation
        held += training_gpus + replica_gpus
    minutes = 24 * 60
    busy -= restarts * 8 * RESTART_S / 60  # GPU-minutes a restart idles
    return {
        "utilisation": busy / (total_gpus * minutes),
        "allocated": held / (total_gpus * minutes),
        "served_share": served / demanded,
        "training_restarts": restarts,
    }


def router_processes_figures(
    settings: Settings, requests: int, inflight: int, counts: tuple[int, ...] = (1, 2)
) -> dict[str, Any]:
    """`fleetline router --processes N` on one port (SO_REUSEPORT) before one replica, the
    registry read from Kafka as deployed: requests/s and latency at `inflight` for each N."""
    from fleetline.streams import kafka as kafka_clients
    from fleetline.streams.serde import default_codec

    replica, address, _ = start_replica(settings, "bench/svc.r0", 0.0)
    topics = Topics(f"bench-{uuid.uuid4().hex[:8]}")
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    codec = default_codec()
    producer = kafka_clients.producer(settings.kafka, {"linger.ms": 0})
    record = endpoint("bench/svc.r0", address)
    producer.produce(
        topics.replicas,
        key=record["replica"].encode(),
        value=codec.encode(topics.record_of(topics.replicas), record),
    )
    producer.flush(10)
    env = {**os.environ, **settings.kafka.as_env()}
    figures: dict[str, Any] = {}
    try:
        for count in counts:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            router = subprocess.Popen(
                [
                    sys.executable, "-m", "fleetline.cli", "router", "--processes", str(count),
                    "--port", str(port), "--host", "127.0.0.1", "--open", "--no-report",
                    "--topic-prefix", topics.prefix,
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            url = f"http://127.0.0.1:{port}/v1/services/bench/svc/infer"
            try:
                deadline = time.monotonic() + 60
                while True:  # every process has read the registry: requests succeed
                    try:
                        asyncio.run(closed_loop(url, 4 * count, 1))
                        break
                    except (OSError, AssertionError) as exc:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{count} router processes never answered") from exc
                        time.sleep(0.2)
                client(url, 500, inflight)  # warm up
                before = cpu_s(router.pid), cpu_s(replica.pid), 0.0
                routed = client(url, requests, inflight)
                after = cpu_s(router.pid), cpu_s(replica.pid), routed["cpu_s"]
            finally:
                router.send_signal(signal.SIGTERM)
                router.wait(30)
            figures[f"router_{count}_processes_rps"] = routed["rps"]
            figures[f"router_{count}_processes_p50_ms"] = routed["p50_ms"]
            figures[f"router_{count}_processes_p99_ms"] = routed["p99_ms"]
            # Where the CPU goes, per request: the bound on a machine the three share.
            router_ms, replica_ms, client_ms = (
                (a - b) * 1000 / requests for a, b in zip(after, before, strict=True)
            )
            figures[f"router_{count}_processes_cpu_ms_per_request"] = round(router_ms, 3)
            figures[f"router_{count}_processes_client_cpu_ms_per_request"] = round(client_ms, 3)
            figures[f"router_{count}_processes_replica_cpu_ms_per_request"] = round(replica_ms, 3)
            cores = os.cpu_count() or 1
            figures[f"router_{count}_processes_rps_bound_sharing_{cores}_cores"] = round(
                cores * 1000 / (router_ms + client_ms + replica_ms)
            )
            figures[f"router_{count}_processes_cores_for_5000_rps"] = round(5 * router_ms, 2)
        figures["router_processes_target"] = ">= 5000 requests/s, p99 < 20 ms"
    finally:
        replica.terminate()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--inflight", type=int, default=32)
    parser.add_argument("--client", nargs=3, metavar=("URL", "REQUESTS", "INFLIGHT"))
    args = parser.parse_args()
    if args.client:
        url, requests, inflight = args.client
        began = time.process_time()
        result = asyncio.run(closed_loop(url, int(requests), int(inflight)))
        # The loop's own CPU (the process's start-up is not the client's cost per request).
        print(json.dumps({**result, "cpu_s": time.process_time() - began}))
        return
    figures: dict[str, Any] = {}
    fixed, tidal = tidal_day(False), tidal_day(True)
    figures |= {f"fixed_{k}": v for k, v in fixed.items()}
    figures |= {f"tidal_{k}": v for k, v in tidal.items()}
    figures["tidal_utilisation_gain"] = tidal["utilisation"] / fixed["utilisation"] - 1
    figures["published_gain_lyra"] = 0.25
    settings = Settings.from_env()
    with local_services(settings) as settings:
        figures |= router_figures(settings, args.requests, args.inflight)
        figures |= router_processes_figures(settings, args.requests, args.inflight * 2)
    report("serving", figures)


if __name__ == "__main__":
    main()
