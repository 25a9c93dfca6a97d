"""Prometheus metrics: the series every long-running process exposes at `/metrics`.

Counters and histograms are bumped where the work happens (the stream loop, the sinks, the
API); gauges that describe the fleet are read at scrape time by collectors, so a scrape costs
the scraper, not the fold. GPU gauges carry the DCGM exporter's names and labels
(`DCGM_FI_DEV_GPU_UTIL{gpu,UUID,modelName,Hostname}`), so Grafana dashboards made for
dcgm-exporter work on fleetline unchanged; `cluster` and `region` are added beside them.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# -- the stream loop (every processor and sink) ------------------------------------------------

STREAM_MESSAGES = Counter(
    "fleetline_stream_messages", "Messages handed to a loop's step (events folded).", ["loop"]
)
STREAM_BATCHES = Counter("fleetline_stream_batches", "Batches a loop processed.", ["loop"])
STREAM_DEAD_LETTERS = Counter(
    "fleetline_stream_dead_letters",
    "Messages a loop sent to the dead-letter topic, by the reason's error type.",
    ["loop", "reason"],
)
STREAM_ABORTS = Counter(
    "fleetline_stream_aborts", "Transactions a loop aborted and retried.", ["loop"]
)
STREAM_PROCESS_SECONDS = Histogram(
    "fleetline_stream_process_seconds",
    "Time a loop's step took to turn one batch into outputs.",
    ["loop"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
STREAM_STORE_SECONDS = Histogram(
    "fleetline_stream_store_seconds",
    "Time an effect-first loop took to make one batch durable (a sink's insert latency).",
    ["loop"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
CONSUMER_LAG = Gauge(
    "fleetline_consumer_lag",
    "Messages behind the partition's end, per consumer group and partition (librdkafka's "
    "statistics, refreshed every few seconds).",
    ["group", "topic", "partition"],
)
SINK_ROWS = Counter("fleetline_sink_rows", "Rows a sink stored.", ["sink"])

# -- the scheduler ---------------------------------------------------------------------------

DECISIONS = Counter("fleetline_scheduler_decisions", "Scheduling decisions.", ["outcome"])
DECISION_LATENCY = Histogram(
    "fleetline_scheduler_decision_seconds",
    "From a request's append to the request log to the scheduler's decisions on it.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

# -- tiering, the API -------------------------------------------------------------------------

TIER_RUNS = Counter("fleetline_tier_runs", "Tiering passes, by outcome.", ["outcome"])
TIER_PARTITIONS = Counter(
    "fleetline_tier_partitions_moved",
    "Partitions moved into a tier (hours to warm, days to cold).",
    ["tier"],
)
TIER_ROWS = Counter("fleetline_tier_rows_moved", "Rows moved out of the hot tier.")
TIER_LAST_SUCCESS = Gauge(
    "fleetline_tier_last_success_timestamp_seconds", "When the last tiering pass succeeded."
)
API_REQUESTS = Counter(
    "fleetline_api_requests", "API requests by route and status.", ["method", "route", "status"]
)
API_SECONDS = Histogram(
    "fleetline_api_request_seconds",
    "API request duration by route.",
    ["method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)


def consumer_statistics(group: str) -> Callable[[str], None]:
    """A librdkafka `stats_cb` that keeps CONSUMER_LAG of `group` current."""

    def on_statistics(document: str) -> None:
        try:
            stats = json.loads(document)
            for topic, t in (stats.get("topics") or {}).items():
                for partition, p in (t.get("partitions") or {}).items():
                    lag = p.get("consumer_lag", -1)
                    if partition != "-1" and lag >= 0:
                        CONSUMER_LAG.labels(group, topic, partition).set(lag)
        # A malformed statistics document must not stop the consumer that delivered it.
        except (ValueError, AttributeError, TypeError) as exc:
            log.debug("unreadable librdkafka statistics: %s", exc)

    return on_statistics


# -- GPU gauges under the DCGM exporter's names ----------------------------------------------

# (DCGM field name, help, our reading's name in a GPU sample: the same unit as DCGM's)
DCGM_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "gpu_util_pct"),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", "mem_copy_util_pct"),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "fb_used_mib"),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temperature_c"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w"),
    ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "Power management limit (in W).", "power_limit_w"),
    (
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "Total number of single-bit volatile ECC errors.",
        "ecc_sbe_total",
    ),
    (
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "Total number of double-bit volatile ECC errors.",
        "ecc_dbe_total",
    ),
    (
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "Total number of NVLink bandwidth counters for all lanes (bytes/s, tx + rx).",
        "nvlink_bytes_per_s",
    ),
)
DCGM_LABELS = ("gpu", "UUID", "modelName", "Hostname", "cluster", "region")


class GpuReading:
    """What the DCGM collector needs of one GPU: its labels and its latest readings."""

    __slots__ = ("labels", "readings")

    def __init__(self, labels: tuple[str, ...], readings: Mapping[str, Any]) -> None:
        self.labels = labels
        self.readings = readings


def gpu_reading(node_id: str, cluster: str, region: str, sample: Mapping[str, Any]) -> GpuReading:
    """A GPU sample (the NodeTelemetry `gpus` item or the view's readings) as DCGM series."""
    readings = dict(sample)
    readings["nvlink_bytes_per_s"] = (sample.get("nvlink_tx_bytes_per_s") or 0) + (
        sample.get("nvlink_rx_bytes_per_s") or 0
    )
    xids = sample.get("xid_codes") or []
    # DCGM reports the value of the last XID seen (0: none).
    readings["xid_last"] = xids[-1] if xids else 0
    labels = (
        str(sample["gpu_index"]),
        str(sample["gpu_uuid"]),
        str(sample.get("model") or ""),
        node_id,
        cluster,
        region,
    )
    return GpuReading(labels, readings)


def telemetry_readings(
    records: Callable[[], Iterable[Mapping[str, Any]]],
) -> Callable[[], Iterator[GpuReading]]:
    """DCGM readings from NodeTelemetry records (an agent's latest)."""

    def readings() -> Iterator[GpuReading]:
        for record in records():
            for gpu in record["gpus"]:
                yield gpu_reading(record["node_id"], record["cluster_id"], record["region"], gpu)

    return readings


class DcgmCollector(Collector):
    """GPU gauges at scrape time from `readings()` (the view's latest samples, or an agent's)."""

    def __init__(self, readings: Callable[[], Iterable[GpuReading]]) -> None:
        self.readings = readings

    def describe(self) -> Iterable[Metric]:
        return []  # collected lazily: the registry must not call `collect` on registration

    def collect(self) -> Iterator[Metric]:
        families = [
            (GaugeMetricFamily(name, doc, labels=DCGM_LABELS), field)
            for name, doc, field in DCGM_FIELDS
        ]
        xid = GaugeMetricFamily(
            "DCGM_FI_DEV_XID_ERRORS",
            "Value of the last XID error encountered.",
            labels=DCGM_LABELS,
        )
        for gpu in self.readings():
            for family, field in families:
                value = gpu.readings.get(field)
                if value is not None:
                    family.add_metric(gpu.labels, float(value))
            xid.add_metric(gpu.labels, float(gpu.readings["xid_last"]))
        for family, _ in families:
            yield family
        yield xid


class CallbackCollector(Collector):
    """Gauges read at scrape time: `read()` -> {name: [(labels, value)]} for gauges declared
    as (name, help, label names)."""

    def __init__(
        self,
        gauges: Iterable[tuple[str, str, tuple[str, ...]]],
        read: Callable[[], Mapping[str, Iterable[tuple[tuple[str, ...], float]]]],
    ) -> None:
        self.gauges = tuple(gauges)
        self.read = read

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        values = self.read()
        for name, doc, labels in self.gauges:
            family = GaugeMetricFamily(name, doc, labels=labels)
            for label_values, value in values.get(name, ()):
                family.add_metric(label_values, value)
            yield family


_registered: dict[str, Collector] = {}
_lock = threading.Lock()


def register_collector(
    name: str, collector: Collector, registry: CollectorRegistry = REGISTRY
) -> None:
    """Register `collector` under `name`, replacing the one registered before under that name
    (a process that builds its services again, as tests do, keeps one of each)."""
    with _lock:
        old = _registered.pop(name, None)
        if old is not None:
            registry.unregister(old)
        registry.register(collector)
        _registered[name] = collector


def exposition(registry: CollectorRegistry = REGISTRY) -> tuple[bytes, str]:
    """The registry in Prometheus text format, and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def serve_metrics(host: str, port: int) -> int:
    """Serve `/metrics` over HTTP on `host:port` in a daemon thread (port 0: any free one);
    the port it listens on."""
    server, _ = start_http_server(port, addr=host)
    return int(server.server_address[1])


# -- per process: what each long-running process adds to its registry --------------------------


def cluster_agent_collector(
    cluster_id: str, status: Callable[[], Mapping[str, Any]]
) -> CallbackCollector:
    """A cluster agent's workloads, reserved GPUs and peers, read from its status."""

    def read() -> dict[str, list[tuple[tuple[str, ...], float]]]:
        now = status()
        states: dict[str, int] = {"Running": 0, "Stopping": 0}
        for w in now["workloads"]:
            states[w["state"]] = states.get(w["state"], 0) + 1
        return {
            "fleetline_cluster_agent_workloads": [
                ((cluster_id, state), float(n)) for state, n in sorted(states.items())
            ],
            "fleetline_cluster_agent_gpus_reserved": [((cluster_id,), float(now["gpus_reserved"]))],
            "fleetline_cluster_agent_loop_passes": [((cluster_id,), float(now["passes"]))],
            "fleetline_cluster_agent_workload_step": [
                ((cluster_id, w["job"]), float(w["step"]))
                for w in now["workloads"]
                if w.get("step") is not None
            ],
            "fleetline_cluster_agent_peer_reachable": [
                ((cluster_id, p["cluster_id"]), 1.0 if p["reachable"] else 0.0)
                for p in now["peers"]
            ],
        }

    return CallbackCollector(
        (
            (
                "fleetline_cluster_agent_workloads",
                "Workload processes this agent runs, by state.",
                ("cluster", "state"),
            ),
            (
                "fleetline_cluster_agent_gpus_reserved",
                "GPUs reserved by the workloads this agent runs.",
                ("cluster",),
            ),
            (
                "fleetline_cluster_agent_loop_passes",
                "Passes of the agent's loop since it started (orders read, the manager "
                "refreshed, runs reconciled).",
                ("cluster",),
            ),
            (
                "fleetline_cluster_agent_workload_step",
                "The last training step each workload reported.",
                ("cluster", "job"),
            ),
            (
                "fleetline_cluster_agent_peer_reachable",
                "Whether this cluster reaches a peer cluster (1) or not (0).",
                ("cluster", "peer"),
            ),
        ),
        read,
    )


def spool_collector(spools: Callable[[], Mapping[str, Mapping[str, int]]]) -> CallbackCollector:
    """Node agents' spools by cluster (records waiting, bytes, dropped by the bound, resent)."""

    def read() -> dict[str, list[tuple[tuple[str, ...], float]]]:
        now = spools()
        return {
            name: [((cluster,), float(s[field])) for cluster, s in sorted(now.items())]
            for name, _, _, field in _SPOOL
        }

    return CallbackCollector(((n, d, ("cluster",)) for n, d, _, _ in _SPOOL), read)


_SPOOL = (
    (
        "fleetline_agent_spool_depth",
        "Records in the agent's spool not yet acknowledged by Kafka.",
        "gauge",
        "records",
    ),
    ("fleetline_agent_spool_bytes", "Bytes the agent's spool holds on disk.", "gauge", "bytes"),
    (
        "fleetline_agent_spool_dropped",
        "Records the spool's bound dropped unsent (a counter since the agent started).",
        "gauge",
        "dropped",
    ),
    (
        "fleetline_agent_spool_unspooled",
        "Records kept in memory only because the spool's disk was full (since the agent "
        "started); lost only if the agent dies before Kafka acknowledges them.",
        "gauge",
        "unspooled",
    ),
    (
        "fleetline_agent_resent",
        "Records sent again after a failed delivery (since the agent started).",
        "gauge",
        "resent",
    ),
)
