"""The real NVML collector on a machine with NVIDIA GPUs; skipped, with the reason, elsewhere.

Run alone on a GPU machine: `python -m pytest tests/gpu -v -s`.
"""

from __future__ import annotations

import time

import pytest

from fleetline.agents.devices import DeviceError
from fleetline.agents.devices.nvml import NvmlDevices
from fleetline.streams.serde import default_codec


@pytest.fixture(scope="module")
def nvml():
    try:
        collector = NvmlDevices().open()
    except DeviceError as exc:
        pytest.skip(f"no NVIDIA GPU here: {exc}")
    if collector.gpu_count == 0:
        pytest.skip("NVML loaded but reports no GPU")
    yield collector
    collector.close()


def test_readings_are_sane(nvml) -> None:
    first = nvml.sample()
    time.sleep(1.0)
    second = nvml.sample()
    assert len(second) == nvml.gpu_count
    for before, gpu in zip(first, second, strict=True):
        assert 0.0 <= gpu["gpu_util_pct"] <= 100.0
        assert gpu["fb_total_mib"] > 0 and 0 <= gpu["fb_used_mib"] <= gpu["fb_total_mib"]
        assert 0 < gpu["power_w"] < 2000 and 0 < gpu["temperature_c"] < 120
        assert gpu["ecc_sbe_total"] >= before["ecc_sbe_total"]
        if gpu["nvlink_links_active"]:
            assert gpu["nvlink_errors_total"] >= before["nvlink_errors_total"]
            assert gpu["nvlink_tx_bytes_per_s"] is not None and gpu["nvlink_tx_bytes_per_s"] >= 0
        else:
            assert gpu["nvlink_tx_bytes_per_s"] is None
        print(
            f"gpu {gpu['gpu_index']} {gpu['model']}: util {gpu['gpu_util_pct']}% "
            f"fb {gpu['fb_used_mib']}/{gpu['fb_total_mib']} MiB power {gpu['power_w']} W "
            f"links {gpu['nvlink_links_active']} nvlink tx {gpu['nvlink_tx_bytes_per_s']}"
        )


def test_nvlink_throughput_counters_are_monotonic_and_scope_is_reported(nvml) -> None:
    nv = nvml.nvml
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    if not nvml._links[0]:
        pytest.skip("GPU 0 has no active NVLink")
    fields = [
        (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0),
        (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nvml._links[0][-1]),
    ]
    readings = []
    for _ in range(3):
        values = nv.nvmlDeviceGetFieldValues(handle, fields)
        readings.append([int(v.value.ullVal) for v in values])
        time.sleep(0.5)
    assert [r[0] for r in readings] == sorted(r[0] for r in readings)
    same = all(r[0] == r[1] for r in readings)
    scope = "equal (GPU-wide)" if same else "differ (per link)"
    print(f"NVLink throughput field, scope 0 vs last link: {scope}: {readings}")


def test_topology_is_consistent(nvml) -> None:
    topology = nvml.topology()
    count = topology["gpu_count"]
    assert sorted(i for island in topology["nvlink_islands"] for i in island) == list(range(count))
    for gpu, peers in topology["nvlink_peers"].items():
        for peer in peers:
            assert int(gpu) in topology["nvlink_peers"][str(peer)], (gpu, peer)
    assert len(topology["gpu_numa_nodes"]) == count
    print(f"topology: {topology}")


def test_a_real_record_encodes(nvml) -> None:
    record = {
        "cluster_id": "gpu-check",
        "region": "local",
        "node_id": "this-node",
        "seq": 1,
        "ts": int(time.time() * 1000),
        "interval_ms": 1000,
        "gpus": nvml.sample(),
        "agent_version": "check",
        "collector": "nvml",
    }
    codec = default_codec()
    assert len(codec.decode(codec.encode("NodeTelemetry", record)).record["gpus"]) == nvml.gpu_count


def test_dcgm_named_gauges_equal_the_collector_s_readings(nvml) -> None:
    """What an agent's /metrics shows under the DCGM exporter's names is what NVML read."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    from fleetline.observability import metrics

    record = {
        "node_id": "this-node",
        "cluster_id": "gpu-check",
        "region": "local",
        "gpus": nvml.sample(),
    }
    registry = CollectorRegistry()
    collector = metrics.DcgmCollector(metrics.telemetry_readings(lambda: [record]))
    metrics.register_collector("gpu-check", collector, registry)
    text = metrics.exposition(registry)[0].decode()
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    for name, field in (
        ("DCGM_FI_DEV_GPU_UTIL", "gpu_util_pct"),
        ("DCGM_FI_DEV_FB_USED", "fb_used_mib"),
        ("DCGM_FI_DEV_POWER_USAGE", "power_w"),
        ("DCGM_FI_DEV_GPU_TEMP", "temperature_c"),
    ):
        shown = {int(s.labels["gpu"]): s.value for s in families[name]}
        assert shown == {g["gpu_index"]: float(g[field]) for g in record["gpus"]}, name
    uuids = {s.labels["UUID"] for s in families["DCGM_FI_DEV_GPU_UTIL"]}
    assert uuids == {g["gpu_uuid"] for g in record["gpus"]}
    print("\n".join(line for line in text.splitlines() if line.startswith("DCGM_FI_DEV_")))


def test_readings_follow_a_real_load(nvml) -> None:
    """Under a matrix-multiply load (PyTorch, where installed) NVML's utilisation and power
    rise, and the DCGM-named gauge follows them."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    import threading

    idle = nvml.sample()[0]
    stop = threading.Event()

    def load() -> None:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        while not stop.is_set():
            for _ in range(20):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        time.sleep(3.0)
        busy = [nvml.sample()[0] for _ in range(3) if not time.sleep(1.0)]
    finally:
        stop.set()
        worker.join(30)
    print(
        f"idle: util {idle['gpu_util_pct']}% {idle['power_w']} W; busy: "
        + ", ".join(
            f"util {b['gpu_util_pct']}% {b['power_w']} W fb {b['fb_used_mib']} MiB" for b in busy
        )
    )
    assert max(b["gpu_util_pct"] for b in busy) >= 50
    assert max(b["power_w"] for b in busy) > idle["power_w"] + 20
    assert max(b["fb_used_mib"] for b in busy) > idle["fb_used_mib"]


def test_a_power_cap_outside_the_gpu_s_range_is_refused_before_nvml_is_asked(nvml) -> None:
    """Operations' SET_POWER_CAP on a real GPU: the allowed range comes from NVML, and a cap
    outside it is refused with that range before any GPU is touched (this test changes no
    setting: the one cap it asks for is below the minimum)."""
    ranges = nvml.power_limit_range_w()
    assert len(ranges) == nvml.gpu_count
    before = [g["power_limit_w"] for g in nvml.sample()]
    for allowed, limit in zip(ranges, before, strict=True):
        if allowed is None:
            continue
        low, high = allowed
        assert 0 < low < high < 2000
        assert low <= limit <= high + 1  # the enforced limit lies in the allowed range
        print(f"allowed power limits {low:.0f}-{high:.0f} W, enforced {limit} W")
    known = [r for r in ranges if r is not None]
    if not known:
        pytest.skip("NVML states no power limit range for these GPUs")
    too_low = min(low for low, _ in known) - 50
    with pytest.raises(DeviceError, match=r"outside GPU \d+.s allowed"):
        nvml.set_power_limit(too_low)
    assert [g["power_limit_w"] for g in nvml.sample()] == before


def test_the_real_node_receives_a_job(nvml, tmp_path) -> None:
    """What `fleetline agent nvml` states of this node (no simulator label anywhere), folded by
    the view, takes a job that names its GPUs' family and memory, and one that names no model."""
    from fleetline.agents.simulator import ClusterSpec, cluster_info
    from fleetline.processors.scheduling.specs import parse_spec
    from tests.fake_nvml import node_agent_offline
    from tests.fleet_events import fold
    from tests.scheduling_support import Driver, training

    agent = node_agent_offline(nvml, "this-node", tmp_path)
    now = int(time.time() * 1000)
    state = agent.state(now)
    accelerator = state["accelerator"]
    print(f"this node's accelerator: {accelerator}")
    assert accelerator["vendor"] == "nvidia" and accelerator["model"] not in ("", "unknown")
    assert accelerator["memory_mib"] > 0
    view = fold(
        [
            ("ClusterInfo", cluster_info(ClusterSpec("lab-a", "eu-west", 1), 1, now)),
            ("NodeState", state),
            ("NodeTelemetry", agent.telemetry(now + 1000)),
        ]
    )
    family = accelerator["model"].split("-")[0]
    memory_gb = int(accelerator["memory_mib"] * 2**20 / 1e9)
    driver = Driver(view, now_ms=now + 2000)
    jobs = {
        "acme/named": training(
            "named",
            per_worker=nvml.gpu_count,
            tensor=nvml.gpu_count,
            accelerator=family.upper(),
            min_gpu_memory_gb=memory_gb,
        ),
        "acme/any": training(
            "any", per_worker=nvml.gpu_count, tensor=nvml.gpu_count, accelerator=None
        ),
    }
    named = jobs["acme/named"]
    assert parse_spec(named).spec.accelerators == (family,)
    driver.submit(named)
    placed = driver.last("acme/named")
    assert placed.outcome == "PLACED", placed.reason
    assert driver.nodes_of("acme/named") == {"this-node"}
    print(f"placed: {placed.reason}")
    # The node is full now; deleting the first job frees it for the one that names no model.
    driver.delete("acme/named")
    driver.submit(jobs["acme/any"])
    assert driver.last("acme/any").outcome == "PLACED", driver.last("acme/any").reason
