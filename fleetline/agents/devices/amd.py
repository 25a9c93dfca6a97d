"""The AMD adapter of the device port: Instinct GPUs through AMD SMI's Python library (`amdsmi`).

`amdsmi` is imported only when an agent opens AMD devices (it loads ROCm's libamd_smi at import,
so it is not a dependency of fleetline; install it on AMD nodes). What it reads, in the records'
vocabulary:

- the model from the ASIC's market name ("AMD Instinct MI300X" -> `mi300x`), memory from the VRAM
  size (MB);
- the interconnect domains from `amdsmi_topo_get_link_type`: GPUs one xGMI hop apart are peers,
  and a hive's connected GPUs one domain (as NVLink islands are);
- per GPU: graphics and memory-controller activity, VRAM in use, socket power and the power
  cap, hotspot temperature, the graphics clock, ECC counts (correctable as single-bit,
  uncorrectable as double-bit, as NVML names them);
- error events from the driver's event notification, as AMD numbers them
  (`AmdSmiEvtNotificationType`), in `xid_codes`. The view's HealthPolicy maps them for vendor
  `amd`: 3 (GPU_PRE_RESET: the driver resets the GPU after a hang or a fatal RAS error) fails
  the GPU; 2 (THERMAL_THROTTLE) degrades it. Page faults and VM faults are the application's,
  not the hardware's, and are not read.

AMD SMI reports a reading a GPU cannot give as "N/A"; it becomes None, never zero. xGMI
throughput is not read yet (`amdsmi_get_link_metrics` counts per link; the NVLink rate fields
stay None on AMD nodes).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from fleetline.agents.devices import DeviceError, check_power_cap, node_topology
from fleetline.processors.view.accelerators import Accelerator
from fleetline.schemas.records import GpuSample, NodeTopology

log = logging.getLogger(__name__)

# The driver events read, by their names in AmdSmiEvtNotificationType.
EVENTS = ("THERMAL_THROTTLE", "GPU_PRE_RESET")


def load_amdsmi() -> ModuleType:
    try:
        import amdsmi  # type: ignore[import-not-found]  # only on AMD nodes
    except (ImportError, OSError) as exc:  # not installed, or ROCm's library not found
        raise DeviceError(f"amdsmi is not usable here: {exc}") from None
    return amdsmi  # type: ignore[no-any-return]


def _number(value: Any) -> float | None:
    """A reading, or None where AMD SMI says "N/A"."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass
class AmdSmiDevices:
    """One node's AMD GPUs. `amdsmi` is the module (a stand-in in unit tests)."""

    amdsmi: Any = None
    vendor: str = "amd"
    _handles: list[Any] = field(default_factory=list, init=False)
    _names: list[str] = field(default_factory=list, init=False)  # market names, read at open
    _readers: list[Any] = field(default_factory=list, init=False)

    @property
    def collector(self) -> str:
        return "amdsmi"

    def open(self) -> AmdSmiDevices:
        self.amdsmi = self.amdsmi or load_amdsmi()
        smi = self.amdsmi
        try:
            smi.amdsmi_init()
            self._handles = list(smi.amdsmi_get_processor_handles())
        except smi.AmdSmiException as exc:
            raise DeviceError(f"AMD SMI did not start: {exc}") from None
        self._names = [self._name(h) for h in self._handles]
        kinds = [smi.AmdSmiEvtNotificationType[name] for name in EVENTS]
        for handle in self._handles:
            try:
                self._readers.append(smi.AmdSmiEventReader(handle, kinds))
            except smi.AmdSmiException as exc:
                log.warning("AMD GPU events unavailable: %s", exc)
                self._readers.append(None)
        return self

    def close(self) -> None:
        if self.amdsmi is None:
            return
        for reader in self._readers:
            if reader is not None:
                with contextlib.suppress(self.amdsmi.AmdSmiException):
                    reader.stop()
        with contextlib.suppress(self.amdsmi.AmdSmiException):
            self.amdsmi.amdsmi_shut_down()

    def _try(self, call: Any, *args: Any) -> Any:
        """A reading, or None where the GPU or driver does not give it."""
        try:
            return call(*args)
        except self.amdsmi.AmdSmiException as exc:
            log.debug("%s: %s", getattr(call, "__name__", call), exc)
            return None

    @property
    def gpu_count(self) -> int:
        return len(self._handles)

    def topology(self) -> NodeTopology:
        smi = self.amdsmi
        xgmi = smi.AmdSmiLinkType.AMDSMI_LINK_TYPE_XGMI
        peers: dict[str, list[int]] = {}
        for index, handle in enumerate(self._handles):
            reached = []
            for other, remote in enumerate(self._handles):
                if other == index:
                    continue
                link = self._try(smi.amdsmi_topo_get_link_type, handle, remote)
                if link is not None and link["type"] == xgmi and link["hops"] == 1:
                    reached.append(other)
            peers[str(index)] = reached
        numa = []
        for handle in self._handles:
            node = self._try(smi.amdsmi_topo_get_numa_node_number, handle)
            numa.append(-1 if node is None else int(node))
        return node_topology(peers, numa)

    def _name(self, handle: Any) -> str:
        asic = self._try(self.amdsmi.amdsmi_get_gpu_asic_info, handle)
        name = asic.get("market_name") if asic else None
        return name if isinstance(name, str) and name != "N/A" else ""

    def accelerator(self) -> Accelerator | None:
        """GPU 0's name and the smallest VRAM (a node of mixed GPUs is scheduled as its
        weakest)."""
        if not self._handles:
            return None
        names = self._names
        memory = []
        for handle in self._handles:
            vram = self._try(self.amdsmi.amdsmi_get_gpu_vram_info, handle)
            size = _number(vram.get("vram_size")) if vram else None
            if size is not None:
                memory.append(int(size))
        if len(set(names)) > 1:
            log.warning("mixed GPU models on one node: %s; scheduled as %s", names, names[0])
        return Accelerator.of_device(self.vendor, names[0], min(memory, default=0))

    def _events(self) -> dict[int, list[int]]:
        smi = self.amdsmi
        found: dict[int, list[int]] = {}
        for index, reader in enumerate(self._readers):
            if reader is None:
                continue
            events = self._try(reader.read, 0) or []
            for event in events:
                found.setdefault(index, []).append(
                    int(smi.AmdSmiEvtNotificationType[event["event"]])
                )
        return found

    def sample(self) -> list[GpuSample]:
        smi = self.amdsmi
        events = self._events()
        samples: list[GpuSample] = []
        for index, handle in enumerate(self._handles):
            activity = self._try(smi.amdsmi_get_gpu_activity, handle) or {}
            vram = self._try(smi.amdsmi_get_gpu_vram_usage, handle) or {}
            power = self._try(smi.amdsmi_get_power_info, handle) or {}
            cap = self._try(smi.amdsmi_get_power_cap_info, handle) or {}
            ecc = self._try(smi.amdsmi_get_gpu_total_ecc_count, handle) or {}
            clock = self._try(smi.amdsmi_get_clock_info, handle, smi.AmdSmiClkType.GFX) or {}
            memory_clock = self._try(smi.amdsmi_get_clock_info, handle, smi.AmdSmiClkType.MEM) or {}
            temperature = self._try(
                smi.amdsmi_get_temp_metric,
                handle,
                smi.AmdSmiTemperatureType.HOTSPOT,
                smi.AmdSmiTemperatureMetric.CURRENT,
            )
            watts = _number(power.get("current_socket_power"))
            if watts is None:
                watts = _number(power.get("average_socket_power"))
            cap_uw = _number(cap.get("power_cap"))
            sm_clock, mem_clock = _number(clock.get("clk")), _number(memory_clock.get("clk"))
            samples.append(
                {
                    "gpu_index": index,
                    "gpu_uuid": str(self._try(smi.amdsmi_get_gpu_device_uuid, handle) or ""),
                    "vendor": self.vendor,
                    "model": self._names[index] or "unknown",
                    "gpu_util_pct": _number(activity.get("gfx_activity")) or 0.0,
                    "mem_copy_util_pct": _number(activity.get("umc_activity")),
                    "fb_used_mib": int(_number(vram.get("vram_used")) or 0),
                    "fb_total_mib": int(_number(vram.get("vram_total")) or 0),
                    "nvlink_tx_bytes_per_s": None,
                    "nvlink_rx_bytes_per_s": None,
                    "nvlink_errors_total": None,
                    "rdma_packet_loss_ratio": None,
                    "temperature_c": _number(temperature) or 0.0,
                    "power_w": watts or 0.0,
                    "ecc_sbe_total": int(_number(ecc.get("correctable_count")) or 0),
                    "ecc_dbe_total": int(_number(ecc.get("uncorrectable_count")) or 0),
                    "xid_codes": events.get(index, []),
                    "pcie_tx_bytes_per_s": None,
                    "pcie_rx_bytes_per_s": None,
                    "sm_clock_mhz": int(sm_clock) if sm_clock is not None else None,
                    "mem_clock_mhz": int(mem_clock) if mem_clock is not None else None,
                    # Caps are in microwatts on bare-metal Linux.
                    "power_limit_w": cap_uw / 1e6 if cap_uw is not None else None,
                    "nvlink_links_active": None,
                }
            )
        return samples

    def power_limit_range_w(self) -> list[tuple[float, float] | None]:
        out: list[tuple[float, float] | None] = []
        for handle in self._handles:
            cap = self._try(self.amdsmi.amdsmi_get_power_cap_info, handle) or {}
            low, high = _number(cap.get("min_power_cap")), _number(cap.get("max_power_cap"))
            out.append((low / 1e6, high / 1e6) if low is not None and high is not None else None)
        return out

    def set_power_limit(self, watts: float) -> None:
        """Cap every GPU's power (root); a cap outside a GPU's range is refused before any GPU
        is touched, as on NVIDIA nodes."""
        check_power_cap(watts, self.power_limit_range_w())
        for handle in self._handles:
            try:
                self.amdsmi.amdsmi_set_power_cap(handle, 0, int(watts * 1e6))
            except self.amdsmi.AmdSmiException as exc:
                raise DeviceError(f"setting a {watts:.0f} W power cap: {exc}") from None
