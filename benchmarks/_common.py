"""What every benchmark script shares: the local services, the sample sink and the results file."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fleetline.agents.simulator import ClusterSpec, FleetSimulator, cluster_info
from fleetline.config import Settings
from fleetline.infra import LocalServices
from fleetline.infra.kafka_access import ADMIN
from fleetline.processors.scheduling.codec import order_report
from fleetline.processors.scheduling.effects import WorkloadOrder
from fleetline.processors.view.fold import apply, fold_telemetry
from fleetline.processors.view.model import ResourceView, gpu_sample
from fleetline.storage.hot_sink import HotSampleSink, HotSampleStore
from fleetline.streams.loop import StreamLoop
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@contextlib.contextmanager
def local_services(settings: Settings) -> Iterator[Settings]:
    """Use the configured broker and S3 server, starting (then stopping) them if they are down;
    the settings to reach them with. A broker started secured (as `fleetline run` and the tests
    leave it) takes the benchmark as its admin: in the settings, and in the environment its child
    processes inherit."""
    services = LocalServices.from_settings(settings)
    started = not all(services.status().values())
    if started:
        services.start()
    secrets = services.kafka.secrets
    signed_in = secrets.client_conf(ADMIN) if secrets is not None else {}
    exported = secrets.client_env(ADMIN) if secrets is not None else {}
    before = {name: os.environ.get(name) for name in exported}
    os.environ.update(exported)
    try:
        yield replace(
            settings,
            kafka=replace(
                settings.kafka,
                client_overrides={**settings.kafka.client_overrides, **signed_in},
            ),
        )
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if started:
            services.stop()


def sample_sink_loop(
    settings: Settings,
    store: HotSampleStore,
    topics: Topics,
    max_messages: int,
    group: str | None = None,
    metrics: bool = True,
) -> StreamLoop:
    """The hot sample sink's loop as `fleetline serve` runs it (decoding a batch while the
    previous one is inserted)."""
    return StreamLoop(
        settings.kafka,
        group or f"{topics.prefix}.sink",
        [topics.telemetry],
        HotSampleSink(default_codec(), store, topics.telemetry),
        topics.dead_letter,
        max_messages=max_messages,
        max_wait_s=1.0,
        overlap=True,
        metrics=metrics,
    )


@contextlib.contextmanager
def running_sample_sink(
    settings: Settings, store: HotSampleStore, topics: Topics, max_messages: int
) -> Iterator[HotSampleSink]:
    """The hot sample sink in a thread from its partitions' assignment until the block ends;
    the group join is start-up, not throughput, so it is waited for before yielding."""
    sink = sample_sink_loop(settings, store, topics, max_messages)
    step = sink.step
    assert isinstance(step, HotSampleSink)
    stop = threading.Event()
    thread = threading.Thread(target=sink.run, args=(stop,), daemon=True)
    thread.start()
    try:
        if not sink.ready.wait(60):
            raise SystemExit("the sink was never assigned its partitions")
        yield step
    finally:
        stop.set()
        thread.join(30)


def rss_mib(pid: int | str = "self") -> float | None:
    """A process's resident memory now (None when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        return None
    return None


def children(pid: int) -> list[int]:
    """A process's children (those its main thread started)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def cpu_s(pid: int) -> float:
    """CPU seconds of a process and its descendants still running (from /proc)."""
    ticks, todo = 0, [pid]
    while todo:
        at = todo.pop()
        try:
            fields = Path(f"/proc/{at}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # it ended meanwhile
        ticks += int(fields[11]) + int(fields[12])  # utime + stime
        todo += children(at)
    return ticks / os.sysconf("SC_CLK_TCK")


def report(name: str, figures: dict[str, object]) -> None:
    rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
    full = {
        "machine": f"{platform.machine()} {platform.python_implementation()} "
        f"{platform.python_version()}, {os.cpu_count()} cores",
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **rounded,
    }
    for key, value in full.items():
        print(f"{key:44} {value}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(full, indent=2) + "\n")
    # Every run kept, one line each: a figure is told as the range of the last runs.
    with (RESULTS_DIR / f"{name}.runs.jsonl").open("a") as runs:
        runs.write(json.dumps(full) + "\n")
    print(f"written to {path}")


def recent_runs(name: str, count: int = 3, **size: object) -> list[dict[str, Any]]:
    """The last `count` runs of a benchmark (as `report` kept them here), oldest first; with
    `size`, only runs whose figures have those values (a smaller trial run is not counted)."""
    path = RESULTS_DIR / f"{name}.runs.jsonl"
    if not path.exists():
        return []
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    sized = [r for r in runs if all(r.get(k) == v for k, v in size.items())]
    return sized[-count:]


def fold_telemetry_records(view: ResourceView, records: Iterable[dict[str, Any]]) -> None:
    """Fold NodeTelemetry records as the view's batch path does (GPU tuples, no Avro)."""
    for r in records:
        fold_telemetry(
            view,
            r["cluster_id"],
            r["region"],
            r["node_id"],
            r["seq"],
            r["ts"],
            [gpu_sample(g) for g in r["gpus"]],
        )


def simulated_view(clusters: list[ClusterSpec], base_ms: int, seed: int = 1) -> ResourceView:
    """The view of a simulated fleet after its first interval: cluster facts, node states and
    one telemetry record per node, folded as the processor would."""
    codec = default_codec()
    sim = FleetSimulator(clusters, seed=seed)
    view = ResourceView()
    for c in clusters:
        apply(view, codec.decode(codec.encode("ClusterInfo", cluster_info(c, 1, base_ms))))
    for record in sim.initial_states(base_ms):
        apply(view, codec.decode(codec.encode("NodeState", record)))
    fold_telemetry_records(view, sim.telemetry(base_ms + 1000))
    return view


def progress_report(order: WorkloadOrder, phase: str, now: int) -> dict[str, Any]:
    """A cluster agent's PROGRESS report on the run an order started (the benchmarks' agents
    report every RUN at once)."""
    return order_report(order, phase, now, f"p-{order.job}-{order.epoch}-{order.attempt}-{phase}")


def serve_scheduler(
    view_of: Callable[..., ResourceView],
    view_args: tuple[Any, ...],
    prefix: str,
    started: Any,
    stop: Any,
) -> None:
    """The scheduler in a process of its own, as `fleetline serve` runs it, over the fleet
    `view_of(*view_args)` makes (in the child: a multiprocessing target, `started` and `stop`
    its events)."""
    from fleetline.processors.scheduling.capacity import observe
    from fleetline.processors.scheduling.runtime import SchedulerService
    from fleetline.processors.view.read import StaticView
    from fleetline.processors.view.runtime import tune_gc_for_large_state

    tune_gc_for_large_state()
    view = view_of(*view_args)
    service = SchedulerService(
        Settings.from_env().kafka,
        Topics(prefix=prefix),
        StaticView(view),
        lambda offsets: observe(view),
        tick_interval_s=1.0,
    )
    halt = threading.Event()
    runner = threading.Thread(target=service.run, args=(halt,), daemon=True)
    runner.start()
    if service.ready.wait(120):
        started.set()
    stop.wait()
    halt.set()
    runner.join(60)
