"""The NVIDIA adapter of the device port: a node's GPUs through NVML (nvidia-ml-py).

Field names follow the DCGM exporter's metric names where one exists. A capability the GPU or
host lacks (no NVLink, no RDMA, a counter the driver does not expose) is None, never zero.
NVLink throughput comes from `nvmlDeviceGetFieldValues` (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX,
cumulative KiB): a rate needs two readings, so the first sample after start has none. Public
collectors disagree on whether the value is per link or GPU-wide; we read it once per GPU
(scope 0) as GPU-wide, and the check in tests/gpu/ compares it with link 1's reading on real
hardware. XIDs are events drained from an NVML event set, not a gauge of the last XID.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from fleetline.agents.devices import DeviceError, check_power_cap, node_topology
from fleetline.processors.view.accelerators import Accelerator
from fleetline.schemas.records import GpuSample, NodeTopology

log = logging.getLogger(__name__)

MIB = 1024 * 1024
NVML_ERROR_TIMEOUT = 10


def load_nvml() -> ModuleType:
    try:
        import pynvml
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise DeviceError(f"nvidia-ml-py is not installed: {exc}") from None
    return pynvml  # type: ignore[no-any-return]  # the module has no type information


@dataclass
class RdmaCounters:
    """Packet loss on the host's RDMA NICs, from /sys/class/infiniband counters.

    Loss ratio over an interval = (out-of-sequence + packet-sequence errors + local ACK
    timeouts, i.e. retransmit causes) / packets sent and received. None without RDMA devices or
    before two readings.
    """

    root: Path = Path("/sys/class/infiniband")
    _previous: tuple[int, int] | None = field(default=None, init=False)

    _LOSS = (
        "hw_counters/out_of_sequence",
        "hw_counters/packet_seq_err",
        "hw_counters/local_ack_timeout_err",
    )
    _PACKETS = ("counters/port_xmit_packets", "counters/port_rcv_packets")

    def _read(self) -> tuple[int, int] | None:
        if not self.root.is_dir():
            return None
        lost = packets = 0
        found = False
        for port in sorted(self.root.glob("*/ports/*")):
            for name in self._PACKETS:
                path = port / name
                if path.exists():
                    packets += int(path.read_text().strip() or 0)
                    found = True
            for name in self._LOSS:
                path = port / name
                if path.exists():
                    lost += int(path.read_text().strip() or 0)
        return (lost, packets) if found else None

    def loss_ratio(self) -> float | None:
        current = self._read()
        previous, self._previous = self._previous, current
        if current is None or previous is None:
            return None
        lost, packets = current[0] - previous[0], current[1] - previous[1]
        if packets <= 0 or lost < 0:
            return None
        return min(1.0, lost / packets)


@dataclass
class NvmlDevices:
    """One node's GPUs through NVML. `nvml` is the pynvml module (a stand-in in unit tests)."""

    nvml: Any = None
    rdma: RdmaCounters = field(default_factory=RdmaCounters)
    vendor: str = "nvidia"
    _handles: list[Any] = field(default_factory=list, init=False)
    _links: list[list[int]] = field(default_factory=list, init=False)
    _previous_nvlink: dict[int, tuple[int, int, int]] = field(default_factory=dict, init=False)
    _events: Any = field(default=None, init=False)

    def open(self) -> NvmlDevices:
        self.nvml = self.nvml or load_nvml()
        nv = self.nvml
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            raise DeviceError(f"NVML is not available here: {exc}") from None
        self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        self._links = [self._active_links(h) for h in self._handles]
        try:
            self._events = nv.nvmlEventSetCreate()
            for handle in self._handles:
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, self._events)
        except nv.NVMLError as exc:
            log.warning("XID events unavailable: %s", exc)
            self._events = None
        return self

    def close(self) -> None:
        if self.nvml is not None:
            try:
                if self._events is not None:
                    self.nvml.nvmlEventSetFree(self._events)
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError:
                pass

    def _try(self, call: Callable[..., Any], *args: Any) -> Any:
        """An NVML reading, or None where the GPU or driver does not support it."""
        try:
            return call(*args)
        except self.nvml.NVMLError as exc:
            log.debug("%s%r: %s", getattr(call, "__name__", call), args[1:], exc)
            return None

    def _active_links(self, handle: Any) -> list[int]:
        links = []
        for link in range(self.nvml.NVML_NVLINK_MAX_LINKS):
            state = self._try(self.nvml.nvmlDeviceGetNvLinkState, handle, link)
            if state is None:
                break  # past the last link, or no NVLink at all
            if state == self.nvml.NVML_FEATURE_ENABLED:
                links.append(link)
        return links

    @property
    def collector(self) -> str:
        return "nvml"

    @property
    def gpu_count(self) -> int:
        return len(self._handles)

    def topology(self) -> NodeTopology:
        """NodeTopology fields this collector can know: islands, peers, NUMA nodes."""
        nv = self.nvml
        bus = {}
        for index, handle in enumerate(self._handles):
            info = self._try(nv.nvmlDeviceGetPciInfo, handle)
            if info is not None:
                bus[_bus_id(info.busId)] = index
        peers: dict[str, list[int]] = {}
        for index, handle in enumerate(self._handles):
            reached = set()
            for link in self._links[index]:
                remote = self._try(nv.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
                if remote is not None and _bus_id(remote.busId) in bus:
                    reached.add(bus[_bus_id(remote.busId)])
            reached.discard(index)
            peers[str(index)] = sorted(reached)
        numa = []
        for handle in self._handles:
            getter = getattr(nv, "nvmlDeviceGetNumaNodeId", None)
            node = self._try(getter, handle) if getter else None
            numa.append(-1 if node is None else int(node))
        return node_topology(peers, numa)

    def accelerator(self) -> Accelerator | None:
        """What the node's GPUs are, from the driver: GPU 0's name and the smallest memory (a
        node of mixed GPUs is rare and is scheduled as its weakest; its names are logged)."""
        nv = self.nvml
        names = []
        memory = []
        for handle in self._handles:
            name = self._try(nv.nvmlDeviceGetName, handle)
            names.append(_text(name) if name is not None else "")
            info = self._try(nv.nvmlDeviceGetMemoryInfo, handle)
            if info is not None:
                memory.append(int(info.total) // MIB)
        if not names:
            return None
        if len(set(names)) > 1:
            log.warning("mixed GPU models on one node: %s; scheduled as %s", names, names[0])
        return Accelerator.of_device(self.vendor, names[0], min(memory, default=0))

    def _xids(self) -> dict[int, list[int]]:
        found: dict[int, list[int]] = {}
        if self._events is None:
            return found
        nv = self.nvml
        while True:
            try:
                event = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) != NVML_ERROR_TIMEOUT:
                    log.warning("reading XID events: %s", exc)
                return found
            for index, handle in enumerate(self._handles):
                if _same_handle(event.device, handle):
                    found.setdefault(index, []).append(int(event.eventData))

    def _nvlink_rates(self, index: int, handle: Any) -> tuple[float | None, float | None]:
        nv = self.nvml
        values = self._try(
            nv.nvmlDeviceGetFieldValues,
            handle,
            [
                (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0),
                (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 0),
            ],
        )
        if values is None or any(v.nvmlReturn != 0 for v in values):
            return None, None
        tx, rx, stamp = (
            int(values[0].value.ullVal),
            int(values[1].value.ullVal),
            int(values[0].timestamp),
        )
        previous = self._previous_nvlink.get(index)
        self._previous_nvlink[index] = (tx, rx, stamp)
        if previous is None or stamp <= previous[2] or tx < previous[0] or rx < previous[1]:
            return None, None  # first reading, or the counters reset
        seconds = (stamp - previous[2]) / 1e6
        return (tx - previous[0]) * 1024 / seconds, (rx - previous[1]) * 1024 / seconds

    def _nvlink_errors(self, handle: Any, links: list[int]) -> int | None:
        nv = self.nvml
        total, any_read = 0, False
        for link in links:
            for counter in (
                nv.NVML_NVLINK_ERROR_DL_REPLAY,
                nv.NVML_NVLINK_ERROR_DL_RECOVERY,
                nv.NVML_NVLINK_ERROR_DL_CRC_FLIT,
                nv.NVML_NVLINK_ERROR_DL_CRC_DATA,
            ):
                value = self._try(nv.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter)
                if value is not None:
                    total += int(value)
                    any_read = True
        return total if any_read else None

    def sample(self) -> list[GpuSample]:
        """One GpuSample (v2 fields) per GPU."""
        nv = self.nvml
        xids = self._xids()
        rdma_loss = self.rdma.loss_ratio()
        samples: list[GpuSample] = []
        for index, handle in enumerate(self._handles):
            util = self._try(nv.nvmlDeviceGetUtilizationRates, handle)
            memory = self._try(nv.nvmlDeviceGetMemoryInfo, handle)
            power = self._try(nv.nvmlDeviceGetPowerUsage, handle)
            limit = self._try(nv.nvmlDeviceGetEnforcedPowerLimit, handle)
            pcie_tx = self._try(nv.nvmlDeviceGetPcieThroughput, handle, nv.NVML_PCIE_UTIL_TX_BYTES)
            pcie_rx = self._try(nv.nvmlDeviceGetPcieThroughput, handle, nv.NVML_PCIE_UTIL_RX_BYTES)
            links = self._links[index]
            tx, rx = self._nvlink_rates(index, handle) if links else (None, None)
            name = self._try(nv.nvmlDeviceGetName, handle)
            samples.append(
                {
                    "gpu_index": index,
                    "gpu_uuid": _text(nv.nvmlDeviceGetUUID(handle)),
                    "vendor": self.vendor,
                    "model": _text(name) if name is not None else "unknown",
                    "gpu_util_pct": float(util.gpu) if util is not None else 0.0,
                    "mem_copy_util_pct": float(util.memory) if util is not None else None,
                    "fb_used_mib": int(memory.used) // MIB if memory is not None else 0,
                    "fb_total_mib": int(memory.total) // MIB if memory is not None else 0,
                    "nvlink_tx_bytes_per_s": tx,
                    "nvlink_rx_bytes_per_s": rx,
                    "nvlink_errors_total": self._nvlink_errors(handle, links) if links else None,
                    "rdma_packet_loss_ratio": rdma_loss,
                    "temperature_c": float(
                        self._try(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
                        or 0.0
                    ),
                    "power_w": power / 1000 if power is not None else 0.0,
                    "ecc_sbe_total": int(
                        self._try(
                            nv.nvmlDeviceGetTotalEccErrors,
                            handle,
                            nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                            nv.NVML_VOLATILE_ECC,
                        )
                        or 0
                    ),
                    "ecc_dbe_total": int(
                        self._try(
                            nv.nvmlDeviceGetTotalEccErrors,
                            handle,
                            nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                            nv.NVML_VOLATILE_ECC,
                        )
                        or 0
                    ),
                    "xid_codes": xids.get(index, []),
                    # NVML reports PCIe throughput in KB/s.
                    "pcie_tx_bytes_per_s": pcie_tx * 1024.0 if pcie_tx is not None else None,
                    "pcie_rx_bytes_per_s": pcie_rx * 1024.0 if pcie_rx is not None else None,
                    "sm_clock_mhz": self._try(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM),
                    "mem_clock_mhz": self._try(
                        nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_MEM
                    ),
                    "power_limit_w": limit / 1000 if limit is not None else None,
                    "nvlink_links_active": len(links) if links else None,
                }
            )
        return samples

    def power_limit_range_w(self) -> list[tuple[float, float] | None]:
        """Each GPU's allowed power limits (min, max) in watts, as NVML states them (None where
        the GPU does not say)."""
        out: list[tuple[float, float] | None] = []
        for handle in self._handles:
            try:
                low, high = self.nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
            except self.nvml.NVMLError:
                out.append(None)
            else:
                out.append((low / 1000, high / 1000))
        return out

    def set_power_limit(self, watts: float) -> None:
        """Cap every GPU's power; needs root. A cap outside a GPU's allowed range is refused
        before any GPU is touched (so a node never ends up half capped); otherwise NVML's
        refusal is raised as a DeviceError with its reason."""
        check_power_cap(watts, self.power_limit_range_w())
        for handle in self._handles:
            try:
                self.nvml.nvmlDeviceSetPowerManagementLimit(handle, int(watts * 1000))
            except self.nvml.NVMLError as exc:
                raise DeviceError(f"setting a {watts:.0f} W power cap: {exc}") from None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bus_id(value: Any) -> str:
    # NVML pads bus ids differently in PCI info and NVLink remote info; compare the tail.
    return _text(value).lower()[-12:]


def _address(handle: Any) -> int:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value or 0
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


def _same_handle(a: Any, b: Any) -> bool:
    """NVML device handles are ctypes pointers: equal when they point at one device."""
    return a is b or _address(a) == _address(b)
