"""A stand-in for the pynvml module at the library boundary, for the collector's unit tests.

It carries pynvml's real constants and error class; only the device calls are scripted.
"""

from __future__ import annotations

from types import SimpleNamespace

import pynvml

NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT


class FakeNvml:
    """`gpus` is a list of dicts describing each GPU; missing keys are 'not supported'."""

    def __init__(self, gpus: list[dict]) -> None:
        self.gpus = gpus
        self.handles = [SimpleNamespace(index=i) for i in range(len(gpus))]
        self.pending_xids: list[tuple[int, int]] = []
        self.power_limits_set: list[tuple[int, int]] = []
        self.clock_us = 1_000_000
        self.allow_set_power = True
        for name in dir(pynvml):
            if name.startswith(("NVML_", "nvmlEventType")):
                setattr(self, name, getattr(pynvml, name))
        self.NVMLError = pynvml.NVMLError

    def _gpu(self, handle, key):
        value = self.gpus[handle.index].get(key)
        if value is None:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return value

    def nvmlInit(self): ...
    def nvmlShutdown(self): ...
    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.handles[i]

    def nvmlDeviceGetUUID(self, h):
        return self._gpu(h, "uuid")

    def nvmlDeviceGetName(self, h):
        return self._gpu(h, "name")

    def nvmlDeviceGetUtilizationRates(self, h):
        gpu, mem = self._gpu(h, "util")
        return SimpleNamespace(gpu=gpu, memory=mem)

    def nvmlDeviceGetMemoryInfo(self, h):
        used, total = self._gpu(h, "memory")
        return SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self._gpu(h, "temp")

    def nvmlDeviceGetPowerUsage(self, h):
        return self._gpu(h, "power_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._gpu(h, "limit_mw")

    def nvmlDeviceGetPowerManagementLimitConstraints(self, h):
        return list(self._gpu(h, "limit_range_mw"))

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        sbe, dbe = self._gpu(h, "ecc")
        return sbe if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else dbe

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        tx, rx = self._gpu(h, "pcie_kbps")
        return tx if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else rx

    def nvmlDeviceGetClockInfo(self, h, clock):
        sm, mem = self._gpu(h, "clocks")
        return sm if clock == pynvml.NVML_CLOCK_SM else mem

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"00000000:{0x10 + h.index:02X}:00.0".encode())

    def nvmlDeviceGetNumaNodeId(self, h):
        return self._gpu(h, "numa")

    def nvmlDeviceGetNvLinkState(self, h, link):
        links = self.gpus[h.index].get("links")
        if links is None:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        if link >= len(links):
            raise pynvml.NVMLError(INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        peer = self.gpus[h.index]["links"][link]
        return SimpleNamespace(busId=f"0000:{0x10 + peer:02X}:00.0".encode())

    def nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter):
        return self.gpus[h.index].get("link_errors", 0)

    def nvmlDeviceGetFieldValues(self, h, fields):
        tx, rx = self._gpu(h, "nvlink_kib")
        values = []
        for field_id, _scope in fields:
            value = tx if field_id == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX else rx
            values.append(
                SimpleNamespace(
                    nvmlReturn=0, timestamp=self.clock_us, value=SimpleNamespace(ullVal=value)
                )
            )
        return values

    def nvmlEventSetCreate(self):
        return "event-set"

    def nvmlEventSetFree(self, event_set): ...
    def nvmlDeviceRegisterEvents(self, h, types, event_set): ...

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        if not self.pending_xids:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        index, code = self.pending_xids.pop(0)
        return SimpleNamespace(device=self.handles[index], eventData=code)

    def nvmlDeviceSetPowerManagementLimit(self, h, milliwatts):
        if not self.allow_set_power:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        self.power_limits_set.append((h.index, milliwatts))


def hgx_gpu(index: int, **overrides) -> dict:
    island = range(0, 4) if index < 4 else range(4, 8)
    gpu = {
        "uuid": f"GPU-{index:08d}",
        "name": b"NVIDIA H100 80GB HBM3",
        "util": (55, 30),
        "memory": (40 * 2**30, 80 * 2**30),
        "temp": 61,
        "power_mw": 412_500,
        "limit_mw": 700_000,
        "limit_range_mw": (200_000, 700_000),
        "ecc": (3, 0),
        "pcie_kbps": (1000, 2000),
        "clocks": (1980, 2619),
        "numa": index // 4,
        "links": [p for p in island if p != index] * 6,
        "nvlink_kib": (1_000_000, 2_000_000),
        "link_errors": 0,
    }
    gpu.update(overrides)
    return gpu


def hgx_collector(device: str = "NVIDIA H100 80GB HBM3", memory_gib: int = 80, count: int = 8):
    """An opened NvmlDevices over `count` GPUs of one kind (an HGX board: two NVLink islands
    of four), as `fleetline agent nvml` would open one on such a node."""
    from pathlib import Path

    from fleetline.agents.devices.nvml import NvmlDevices, RdmaCounters

    gpus = [hgx_gpu(i, name=device.encode(), memory=(0, memory_gib * 2**30)) for i in range(count)]
    return NvmlDevices(nvml=FakeNvml(gpus), rdma=RdmaCounters(Path("/nonexistent"))).open()


def node_agent_offline(collector, node_id: str, state_dir, cluster_id: str = "lab-a", **identity):
    """A NodeAgent over `collector` whose records are read, not sent: its publisher is only the
    spool that `state` reports on (for folding what an agent would send, without Kafka)."""
    from types import SimpleNamespace

    from fleetline.agents.commands import ControlStore
    from fleetline.agents.fleet import SequenceStore
    from fleetline.agents.node import NodeAgent, NodeIdentity
    from fleetline.agents.spool import DiskSpool

    return NodeAgent(
        NodeIdentity(cluster_id, "eu-west", node_id, **identity),
        collector,
        SimpleNamespace(spool=DiskSpool(state_dir / node_id / "spool")),
        ControlStore(state_dir / node_id / "controls.json"),
        SequenceStore(state_dir / node_id / "sequences.json"),
    )
