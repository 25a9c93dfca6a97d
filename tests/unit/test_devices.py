"""The device port: each vendor's adapter against a stand-in for its library, a node whose
library is missing, and a mixed simulated fleet folded into one view."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetline.agents.devices import DeviceError, NoDevices, open_devices
from fleetline.agents.devices.amd import AmdSmiDevices, load_amdsmi
from fleetline.agents.devices.simulated import PROFILES
from fleetline.agents.simulator import ClusterSpec, Fault, FleetSimulator, cluster_info
from fleetline.errors import ConfigError
from fleetline.processors.view.accelerators import Accelerator
from fleetline.processors.view.fold import gpu_health
from fleetline.processors.view.model import DEGRADED, FAILED, HealthPolicy
from fleetline.processors.view.read import node_data
from fleetline.streams.serde import default_codec
from tests.fake_amdsmi import AmdSmiEvtNotificationType, FakeAmdSmi, mi300x_gpu
from tests.fake_nvml import hgx_collector, node_agent_offline
from tests.fleet_events import fold
from tests.support import BASE_MS

codec = default_codec()


def amd(gpus: list[dict] | None = None) -> tuple[AmdSmiDevices, FakeAmdSmi]:
    fake = FakeAmdSmi(gpus if gpus is not None else [mi300x_gpu(i) for i in range(8)])
    return AmdSmiDevices(amdsmi=fake).open(), fake


def test_amd_readings_map_onto_the_records_fields() -> None:
    devices, _ = amd()
    assert devices.collector == "amdsmi" and devices.gpu_count == 8
    assert devices.accelerator() == Accelerator("amd", "mi300x", 196592)
    sample = devices.sample()[3]
    assert sample["vendor"] == "amd" and sample["model"] == "AMD Instinct MI300X"
    assert (sample["gpu_util_pct"], sample["mem_copy_util_pct"]) == (71.0, 38.0)
    assert (sample["fb_used_mib"], sample["fb_total_mib"]) == (65536, 196592)
    # average_socket_power is "N/A" on this part: the current reading is the one given.
    assert (sample["power_w"], sample["power_limit_w"]) == (611.0, 750.0)
    assert (sample["ecc_sbe_total"], sample["ecc_dbe_total"]) == (4, 0)
    assert (sample["sm_clock_mhz"], sample["mem_clock_mhz"], sample["temperature_c"]) == (
        2100,
        1300,
        68.0,
    )
    codec.encode("NodeTelemetry", _telemetry(devices))  # the record the agent sends is valid


def _telemetry(devices) -> dict:
    return {
        "cluster_id": "c",
        "region": "r",
        "node_id": "n",
        "seq": 1,
        "ts": BASE_MS,
        "interval_ms": 1000,
        "gpus": devices.sample(),
        "agent_version": "t",
        "collector": devices.collector,
    }


def test_an_amd_board_s_xgmi_hives_are_its_interconnect_domains() -> None:
    devices, _ = amd([mi300x_gpu(i, hive=i // 4) for i in range(8)])
    topology = devices.topology()
    assert topology["nvlink_islands"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topology["nvlink_peers"]["5"] == [4, 6, 7]
    assert topology["gpu_numa_nodes"] == [0, 0, 0, 0, 1, 1, 1, 1]
    one_mesh, _ = amd()
    assert one_mesh.topology()["nvlink_islands"] == [list(range(8))]


def test_amd_readings_a_gpu_cannot_give_are_absent_never_zero() -> None:
    gpu = mi300x_gpu(
        0,
        activity={"gfx_activity": 12, "umc_activity": "N/A", "mm_activity": "N/A"},
        power={"current_socket_power": "N/A", "average_socket_power": 250},
        gfx_clock=None,
        cap=None,
    )
    devices, _ = amd([gpu])
    sample = devices.sample()[0]
    assert sample["mem_copy_util_pct"] is None
    assert sample["power_w"] == 250.0
    assert sample["sm_clock_mhz"] is None and sample["power_limit_w"] is None
    assert sample["nvlink_tx_bytes_per_s"] is None and sample["rdma_packet_loss_ratio"] is None


def test_amd_driver_events_are_reported_in_amd_s_numbering() -> None:
    devices, fake = amd()
    fake.pending_events = [
        (2, AmdSmiEvtNotificationType.GPU_PRE_RESET),
        (5, AmdSmiEvtNotificationType.THERMAL_THROTTLE),
        (5, AmdSmiEvtNotificationType.VMFAULT),  # the application's, not read
    ]
    codes = {s["gpu_index"]: s["xid_codes"] for s in devices.sample()}
    assert (codes[2], codes[5], codes[0]) == ([3], [2], [])
    assert devices.sample()[2]["xid_codes"] == []  # an event, reported once
    devices.close()
    assert fake.shut_down and all(reader.stopped for reader in fake.readers)


def test_amd_power_caps_are_checked_against_every_gpu_then_set_in_microwatts() -> None:
    devices, fake = amd([mi300x_gpu(0), mi300x_gpu(1)])
    assert devices.power_limit_range_w() == [(400.0, 750.0), (400.0, 750.0)]
    with pytest.raises(DeviceError, match="a 300 W power cap is outside GPU 0's allowed 400-750"):
        devices.set_power_limit(300)
    assert fake.caps_set == []
    devices.set_power_limit(500)
    assert fake.caps_set == [(0, 0, 500_000_000), (1, 0, 500_000_000)]
    fake.allow_set_power = False
    with pytest.raises(DeviceError, match="setting a 450 W power cap"):
        devices.set_power_limit(450)


def test_without_amd_s_library_opening_amd_devices_says_so() -> None:
    # amdsmi is not a dependency: on this machine it is not installed.
    with pytest.raises(DeviceError, match="amdsmi is not usable here"):
        load_amdsmi()


def failing(reason: str):
    def open_() -> NoDevices:
        raise DeviceError(reason)

    return open_


def test_a_node_whose_device_libraries_fail_is_reported_without_accelerators(
    tmp_path: Path,
) -> None:
    devices = open_devices(
        "auto", {"nvml": failing("NVML is not available here"), "amdsmi": failing("no ROCm")}
    )
    assert isinstance(devices, NoDevices)
    assert devices.reason == "nvml: NVML is not available here; amdsmi: no ROCm"
    with pytest.raises(DeviceError, match="no accelerators to cap at 300 W: nvml: NVML"):
        devices.set_power_limit(300)
    agent = node_agent_offline(devices, "cpu-host-1", tmp_path)
    state, telemetry = agent.state(BASE_MS), agent.telemetry(BASE_MS + 1000)
    assert state["accelerator"] is None and state["topology"]["gpu_count"] == 0
    assert telemetry["gpus"] == [] and telemetry["collector"] == "none"
    codec.encode("NodeState", state)
    codec.encode("NodeTelemetry", telemetry)
    view = fold([("NodeState", state), ("NodeTelemetry", telemetry)])
    assert node_data(view, view.nodes["cpu-host-1"])["gpu_count"] == 0


def test_auto_takes_the_first_library_that_finds_devices() -> None:
    found = open_devices(
        "auto", {"nvml": failing("no driver"), "amdsmi": lambda: amd()[0], "other": hgx_collector}
    )
    assert found.collector == "amdsmi"
    assert open_devices("nvml", {"nvml": hgx_collector}).collector == "nvml"
    with pytest.raises(ConfigError, match="--devices 'rocm': one of auto, nvml, amdsmi"):
        open_devices("rocm")


def test_an_amd_gpu_reset_fails_it_and_a_thermal_throttle_degrades_it(tmp_path: Path) -> None:
    devices, fake = amd()
    agent = node_agent_offline(devices, "mi300x-host-1", tmp_path)
    events: list[tuple[str, dict]] = [("NodeState", agent.state(BASE_MS))]
    fake.pending_events = [
        (1, AmdSmiEvtNotificationType.GPU_PRE_RESET),
        (6, AmdSmiEvtNotificationType.THERMAL_THROTTLE),
    ]
    events.append(("NodeTelemetry", agent.telemetry(BASE_MS + 1000)))
    view = fold(events)
    node = view.nodes["mi300x-host-1"]
    assert gpu_health(node, node.gpus[1]) == (FAILED, "amd event 3")
    assert gpu_health(node, node.gpus[6]) == (DEGRADED, "amd event 2")
    # NVIDIA's XID 79 would fail an NVIDIA GPU; on an AMD GPU code 79 means nothing.
    assert HealthPolicy().codes("amd")[1] == frozenset({3})


MIXED = [
    ClusterSpec("eu-west-a", "eu-west", 2),
    ClusterSpec("us-east-a", "us-east", 2, model="AMD Instinct MI300X"),
    ClusterSpec("ap-south-a", "ap-south", 2, model="SimNPU N1 64GB"),
    ClusterSpec("us-east-b", "us-east", 2, model="SimTPU T1 16GB"),
]


def mixed_view(faults: list[Fault] | None = None):
    sim = FleetSimulator(MIXED, seed=5, faults=faults or [])
    events: list[tuple[str, dict]] = [
        ("ClusterInfo", cluster_info(c, 1, BASE_MS)) for c in sim.clusters
    ]
    events += [("NodeState", r) for r in sim.initial_states(BASE_MS)]
    for t in range(1, 4):
        events += [("NodeTelemetry", r) for r in sim.telemetry(BASE_MS + t * 1000)]
    for name, record in events:
        codec.encode(name, record)
    return fold(events)


def test_a_mixed_simulated_fleet_folds_into_one_view_with_each_node_s_chip() -> None:
    view = mixed_view()
    seen = {}
    for node in view.nodes.values():
        data = node_data(view, node)
        seen[node.cluster_id] = (
            data["accelerator"]["vendor"],
            data["accelerator"]["model"],
            data["accelerator"]["memory_mib"],
            data["gpu_count"],
            data["nvlink_islands"],
        )
        assert len(data["gpus"]) == data["gpu_count"]
        # The catalogue's figures for its model ride with the node.
        assert data["capability"]["model"] == data["accelerator"]["model"]
    assert seen == {
        "eu-west-a": ("nvidia", "h100-80gb-hbm3", 81559, 8, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        "us-east-a": ("amd", "mi300x", 196592, 8, [list(range(8))]),
        "ap-south-a": ("simnpu", "simnpu-n1-64gb", 65536, 8, [list(range(8))]),
        "us-east-b": ("simtpu", "simtpu-t1-16gb", 16384, 4, [[0, 1, 2, 3]]),
    }
    # Each profile plays its own power: a TPU-like chip never draws past its 200 W.
    tpu = view.nodes["us-east-b-n0000"]
    assert all(g.sample.power_w <= 200 for g in tpu.gpus.values())


def test_a_simulated_vendor_s_fatal_event_fails_its_chip_by_that_vendor_s_numbering() -> None:
    faults = [
        Fault("xid", "ap-south-a-n0000/2", BASE_MS + 2000, value=201),
        Fault("xid", "eu-west-a-n0000/2", BASE_MS + 2000, value=201),  # no XID 201 at NVIDIA
    ]
    view = mixed_view(faults)
    npu, h100 = view.nodes["ap-south-a-n0000"], view.nodes["eu-west-a-n0000"]
    assert gpu_health(npu, npu.gpus[2]) == (FAILED, "simnpu event 201")
    assert gpu_health(h100, h100.gpus[2])[0] != FAILED


def test_the_simulator_refuses_a_chip_it_does_not_play() -> None:
    with pytest.raises(ConfigError, match="the simulator plays no chip called 'NVIDIA B300'"):
        FleetSimulator([ClusterSpec("x", "eu-west", 1, model="NVIDIA B300")], seed=1)
    assert {p.vendor for p in PROFILES.values()} == {"nvidia", "amd", "simnpu", "simtpu"}
