"""The NVML collector's mapping from NVML values to GpuSample fields, with NVML faked at the
library boundary only (the real thing runs in tests/gpu/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetline.agents.devices import DeviceError
from fleetline.agents.devices.nvml import NvmlDevices, RdmaCounters
from fleetline.streams.serde import default_codec
from tests.fake_nvml import FakeNvml, hgx_gpu

codec = default_codec()


def collector(gpus: list[dict], rdma_root: Path = Path("/nonexistent")) -> tuple:
    fake = FakeNvml(gpus)
    return NvmlDevices(nvml=fake, rdma=RdmaCounters(rdma_root)).open(), fake


def test_units_and_names_follow_dcgm() -> None:
    nvml, _ = collector([hgx_gpu(i) for i in range(8)])
    sample = nvml.sample()[2]
    assert sample["gpu_uuid"] == "GPU-00000002"
    assert sample["model"] == "NVIDIA H100 80GB HBM3"
    assert (sample["gpu_util_pct"], sample["mem_copy_util_pct"]) == (55.0, 30.0)
    assert (sample["fb_used_mib"], sample["fb_total_mib"]) == (40 * 1024, 80 * 1024)
    assert (sample["power_w"], sample["power_limit_w"]) == (412.5, 700.0)
    assert (sample["ecc_sbe_total"], sample["ecc_dbe_total"]) == (3, 0)
    assert sample["pcie_tx_bytes_per_s"] == 1000 * 1024.0
    assert (sample["sm_clock_mhz"], sample["mem_clock_mhz"]) == (1980, 2619)
    assert sample["nvlink_links_active"] == 18
    assert sample["nvlink_errors_total"] == 0


def test_nvlink_rates_come_from_differencing_cumulative_counters() -> None:
    nvml, fake = collector([hgx_gpu(0)])
    first = nvml.sample()[0]
    assert first["nvlink_tx_bytes_per_s"] is None  # one reading is no rate
    fake.gpus[0]["nvlink_kib"] = (1_000_000 + 500_000, 2_000_000 + 250_000)
    fake.clock_us += 2_000_000
    second = nvml.sample()[0]
    assert second["nvlink_tx_bytes_per_s"] == pytest.approx(500_000 * 1024 / 2)
    assert second["nvlink_rx_bytes_per_s"] == pytest.approx(250_000 * 1024 / 2)
    fake.gpus[0]["nvlink_kib"] = (10, 10)  # driver reload: counters reset
    fake.clock_us += 1_000_000
    assert nvml.sample()[0]["nvlink_tx_bytes_per_s"] is None


def test_missing_capabilities_are_absent_never_zero() -> None:
    pcie_only = hgx_gpu(
        0, links=None, nvlink_kib=None, pcie_kbps=None, clocks=None, limit_mw=None, util=None
    )
    nvml, _ = collector([pcie_only])
    sample = nvml.sample()[0]
    for name in (
        "nvlink_tx_bytes_per_s",
        "nvlink_rx_bytes_per_s",
        "nvlink_errors_total",
        "nvlink_links_active",
        "rdma_packet_loss_ratio",
        "pcie_tx_bytes_per_s",
        "sm_clock_mhz",
        "power_limit_w",
        "mem_copy_util_pct",
    ):
        assert sample[name] is None, name
    topology = nvml.topology()
    assert topology["nvlink_islands"] == [[0]] and topology["nvlink_peers"] == {"0": []}


def test_xids_are_events_attributed_to_their_gpu() -> None:
    nvml, fake = collector([hgx_gpu(i) for i in range(4)])
    fake.pending_xids = [(2, 79), (2, 48), (0, 13)]
    samples = nvml.sample()
    assert [s["xid_codes"] for s in samples] == [[13], [], [79, 48], []]
    assert [s["xid_codes"] for s in nvml.sample()] == [[], [], [], []]


def test_topology_from_nvlink_peers_and_numa() -> None:
    nvml, _ = collector([hgx_gpu(i) for i in range(8)])
    topology = nvml.topology()
    assert topology["nvlink_islands"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topology["nvlink_peers"]["5"] == [4, 6, 7]
    assert topology["gpu_numa_nodes"] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_rdma_loss_from_infiniband_counters(tmp_path: Path) -> None:
    port = tmp_path / "mlx5_0" / "ports" / "1"
    (port / "counters").mkdir(parents=True)
    (port / "hw_counters").mkdir()

    def write(sent: int, received: int, out_of_seq: int) -> None:
        (port / "counters" / "port_xmit_packets").write_text(f"{sent}\n")
        (port / "counters" / "port_rcv_packets").write_text(f"{received}\n")
        (port / "hw_counters" / "out_of_sequence").write_text(f"{out_of_seq}\n")

    write(1000, 1000, 0)
    nvml, _ = collector([hgx_gpu(0)], rdma_root=tmp_path)
    assert nvml.sample()[0]["rdma_packet_loss_ratio"] is None  # first reading
    write(6000, 6000, 100)
    assert nvml.sample()[0]["rdma_packet_loss_ratio"] == pytest.approx(100 / 10_000)


def test_samples_fit_the_schema() -> None:
    nvml, _ = collector([hgx_gpu(i) for i in range(8)])
    nvml.sample()
    record = {
        "cluster_id": "c",
        "region": "r",
        "node_id": "n",
        "seq": 1,
        "ts": 0,
        "interval_ms": 1000,
        "gpus": nvml.sample(),
        "agent_version": "t",
        "collector": "nvml",
    }
    assert codec.decode(codec.encode("NodeTelemetry", record)).record["gpus"][7]["gpu_index"] == 7


def test_power_cap_goes_to_every_gpu_or_fails_clearly() -> None:
    nvml, fake = collector([hgx_gpu(i) for i in range(2)])
    nvml.set_power_limit(450)
    assert fake.power_limits_set == [(0, 450_000), (1, 450_000)]
    fake.allow_set_power = False
    with pytest.raises(DeviceError, match="450 W power cap"):
        nvml.set_power_limit(450)
    # Outside what a GPU allows: refused before any GPU is touched.
    fake.allow_set_power = True
    fake.gpus[1]["limit_range_mw"] = (300_000, 700_000)
    with pytest.raises(DeviceError, match="250 W power cap is outside GPU 1's allowed 300-700"):
        nvml.set_power_limit(250)
    assert fake.power_limits_set == [(0, 450_000), (1, 450_000)]
    assert nvml.power_limit_range_w() == [(200.0, 700.0), (300.0, 700.0)]


def test_no_driver_is_a_collector_error() -> None:
    import pynvml

    class NoDriver(FakeNvml):
        def nvmlInit(self):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    with pytest.raises(DeviceError, match="NVML is not available"):
        NvmlDevices(nvml=NoDriver([])).open()
