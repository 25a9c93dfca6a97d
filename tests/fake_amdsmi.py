"""A stand-in for the `amdsmi` module at the library boundary, for the AMD adapter's unit tests.

It has the calls, result dicts and enum values of amdsmi 7.0.2 (its `amdsmi_interface.py`): the
readings a GPU cannot give are the string "N/A", as the library returns them, and a failing call
raises an AmdSmiLibraryException with the library's status code. Only the devices are scripted.
"""

from __future__ import annotations

from enum import IntEnum
from types import SimpleNamespace
from typing import Any

STATUS_NOT_SUPPORTED = 2  # AMDSMI_STATUS_NOT_SUPPORTED
STATUS_NO_PERM = 10  # AMDSMI_STATUS_NO_PERM


class AmdSmiException(Exception):
    pass


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int) -> None:
        super().__init__(err_code)
        self.err_code = err_code


class AmdSmiEvtNotificationType(IntEnum):
    NONE = 0
    VMFAULT = 1
    THERMAL_THROTTLE = 2
    GPU_PRE_RESET = 3
    GPU_POST_RESET = 4


class AmdSmiLinkType(IntEnum):
    AMDSMI_LINK_TYPE_INTERNAL = 0
    AMDSMI_LINK_TYPE_PCIE = 1
    AMDSMI_LINK_TYPE_XGMI = 2
    AMDSMI_LINK_TYPE_NOT_APPLICABLE = 3
    AMDSMI_LINK_TYPE_UNKNOWN = 4


class AmdSmiClkType(IntEnum):
    SYS = 0
    GFX = 0
    DF = 1
    DCEF = 2
    SOC = 3
    MEM = 4


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1
    VRAM = 2


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0


def mi300x_gpu(index: int, **changes: Any) -> dict[str, Any]:
    """One MI300X of an 8-GPU platform, its readings as AMD SMI gives them; a key set to None
    makes that call fail as not supported."""
    gpu: dict[str, Any] = {
        "market_name": "AMD Instinct MI300X",
        "uuid": f"{index:02x}ff74a1-0000-1000-8000-00000000000{index}",
        "vram_size": 196592,  # MB
        "activity": {"gfx_activity": 71, "umc_activity": 38, "mm_activity": "N/A"},
        "vram_usage": {"vram_total": 196592, "vram_used": 65536},
        "power": {"current_socket_power": 611, "average_socket_power": "N/A"},
        "cap": {
            "power_cap": 750_000_000,
            "default_power_cap": 750_000_000,
            "min_power_cap": 400_000_000,
            "max_power_cap": 750_000_000,
        },
        "ecc": {"correctable_count": 4, "uncorrectable_count": 0, "deferred_count": 0},
        "gfx_clock": {"clk": 2100},
        "mem_clock": {"clk": 1300},
        "hotspot_c": 68,
        "numa": index // 4,
        "hive": 0,
    }
    gpu.update(changes)
    return gpu


class FakeEventReader:
    def __init__(self, smi: FakeAmdSmi, handle: SimpleNamespace, kinds: list) -> None:
        self.smi, self.handle, self.kinds = smi, handle, kinds
        smi.readers.append(self)
        self.stopped = False

    def read(self, timestamp: int, num_elem: int = 10) -> list[dict[str, Any]]:
        mine = [e for e in self.smi.pending_events if e[0] == self.handle.index]
        self.smi.pending_events = [e for e in self.smi.pending_events if e not in mine]
        return [
            {"processor_handle": self.handle, "event": kind.name, "message": "fake"}
            for _, kind in mine
            if kind in self.kinds
        ]

    def stop(self) -> None:
        self.stopped = True


class FakeAmdSmi:
    """`gpus`: one dict per GPU (`mi300x_gpu`)."""

    AmdSmiException = AmdSmiException
    AmdSmiLibraryException = AmdSmiLibraryException
    AmdSmiEvtNotificationType = AmdSmiEvtNotificationType
    AmdSmiLinkType = AmdSmiLinkType
    AmdSmiClkType = AmdSmiClkType
    AmdSmiTemperatureType = AmdSmiTemperatureType
    AmdSmiTemperatureMetric = AmdSmiTemperatureMetric

    def __init__(self, gpus: list[dict[str, Any]]) -> None:
        self.gpus = gpus
        self.handles = [SimpleNamespace(index=i) for i in range(len(gpus))]
        self.readers: list[FakeEventReader] = []
        self.pending_events: list[tuple[int, AmdSmiEvtNotificationType]] = []
        self.caps_set: list[tuple[int, int, int]] = []
        self.allow_set_power = True
        self.shut_down = False

    def _gpu(self, handle: SimpleNamespace, key: str) -> Any:
        value = self.gpus[handle.index].get(key)
        if value is None:
            raise AmdSmiLibraryException(STATUS_NOT_SUPPORTED)
        return value

    def AmdSmiEventReader(self, handle: SimpleNamespace, kinds: list) -> FakeEventReader:
        return FakeEventReader(self, handle, kinds)

    def amdsmi_init(self, flag: int = 0) -> None: ...

    def amdsmi_shut_down(self) -> None:
        self.shut_down = True

    def amdsmi_get_processor_handles(self) -> list[SimpleNamespace]:
        return self.handles

    def amdsmi_get_gpu_asic_info(self, h: SimpleNamespace) -> dict[str, Any]:
        return {
            "market_name": self._gpu(h, "market_name"),
            "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
        }

    def amdsmi_get_gpu_vram_info(self, h: SimpleNamespace) -> dict[str, Any]:
        return {"vram_type": 7, "vram_vendor": "N/A", "vram_size": self._gpu(h, "vram_size")}

    def amdsmi_get_gpu_device_uuid(self, h: SimpleNamespace) -> str:
        return self._gpu(h, "uuid")

    def amdsmi_get_gpu_activity(self, h: SimpleNamespace) -> dict[str, Any]:
        return self._gpu(h, "activity")

    def amdsmi_get_gpu_vram_usage(self, h: SimpleNamespace) -> dict[str, Any]:
        return self._gpu(h, "vram_usage")

    def amdsmi_get_power_info(self, h: SimpleNamespace) -> dict[str, Any]:
        return self._gpu(h, "power")

    def amdsmi_get_power_cap_info(self, h: SimpleNamespace) -> dict[str, Any]:
        return self._gpu(h, "cap")

    def amdsmi_get_gpu_total_ecc_count(self, h: SimpleNamespace) -> dict[str, Any]:
        return self._gpu(h, "ecc")

    def amdsmi_get_clock_info(self, h: SimpleNamespace, kind: int) -> dict[str, Any]:
        return self._gpu(h, "mem_clock" if kind == AmdSmiClkType.MEM else "gfx_clock")

    def amdsmi_get_temp_metric(self, h: SimpleNamespace, sensor: int, metric: int) -> int:
        return self._gpu(h, "hotspot_c")

    def amdsmi_topo_get_numa_node_number(self, h: SimpleNamespace) -> int:
        return self._gpu(h, "numa")

    def amdsmi_topo_get_link_type(self, a: SimpleNamespace, b: SimpleNamespace) -> dict[str, int]:
        hive_a, hive_b = self.gpus[a.index].get("hive"), self.gpus[b.index].get("hive")
        if hive_a is not None and hive_a == hive_b:
            return {"hops": 1, "type": AmdSmiLinkType.AMDSMI_LINK_TYPE_XGMI}
        return {"hops": 2, "type": AmdSmiLinkType.AMDSMI_LINK_TYPE_PCIE}

    def amdsmi_set_power_cap(self, h: SimpleNamespace, sensor: int, cap: int) -> None:
        if not self.allow_set_power:
            raise AmdSmiLibraryException(STATUS_NO_PERM)
        self.caps_set.append((h.index, sensor, cap))
