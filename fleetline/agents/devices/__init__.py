"""The node agent's port to its accelerators: one module per vendor's library behind `Devices`.

Each adapter reports the same facts, in the records' vocabulary: who makes the chips and which
model (`accelerator()`), how they are wired (`topology()`: the interconnect domains in
`nvlink_islands` and `nvlink_peers`, whatever the link is called: NVLink, xGMI, ICI), one
GpuSample per chip (`sample()`: utilisation, memory, power and its limit, temperature, ECC, the
chip's error events as its vendor numbers them, which the view's HealthPolicy maps per vendor),
and power capping. `nvml.py` reads NVIDIA GPUs, `amd.py` AMD Instinct GPUs through amdsmi; the
simulated fleet (`agents/simulator.py`) plays the same facts for the chips in `simulated.py`.

A library that is missing or fails to start does not stop the agent: `open_devices` says which
and why, and the node is reported with no accelerators (it then takes no GPU work).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from fleetline.errors import ConfigError, FleetlineError
from fleetline.processors.view.accelerators import Accelerator
from fleetline.schemas.records import GpuSample, NodeTopology

log = logging.getLogger(__name__)


class DeviceError(FleetlineError):
    """A device library cannot start or act (not installed, no driver, no permission)."""


class Devices(Protocol):
    """One node's accelerators, opened."""

    @property
    def collector(self) -> str:
        """The library read, as NodeTelemetry's `collector` names it (nvml, amdsmi, none)."""
        ...

    @property
    def gpu_count(self) -> int: ...

    def topology(self) -> NodeTopology:
        """The NodeTopology fields a library can know: domains, peers, NUMA nodes."""
        ...

    def accelerator(self) -> Accelerator | None:
        """What the chips are (None: the node has none)."""
        ...

    def sample(self) -> list[GpuSample]: ...

    def power_limit_range_w(self) -> list[tuple[float, float] | None]: ...

    def set_power_limit(self, watts: float) -> None: ...

    def close(self) -> None: ...


@dataclass
class NoDevices:
    """A node whose accelerators could not be read: it reports none, and says why."""

    reason: str
    collector: str = "none"

    @property
    def gpu_count(self) -> int:
        return 0

    def topology(self) -> NodeTopology:
        return node_topology({}, [])

    def accelerator(self) -> Accelerator | None:
        return None

    def sample(self) -> list[GpuSample]:
        return []

    def power_limit_range_w(self) -> list[tuple[float, float] | None]:
        return []

    def set_power_limit(self, watts: float) -> None:
        raise DeviceError(f"no accelerators to cap at {watts:.0f} W: {self.reason}")

    def close(self) -> None:
        pass


def interconnect_domains(peers: dict[str, list[int]], count: int) -> list[list[int]]:
    """Connected groups of chips over their scale-up links (NVLink, xGMI, ICI); a chip with no
    such link is a domain of one."""
    seen: set[int] = set()
    islands = []
    for start in range(count):
        if start in seen:
            continue
        group, todo = set(), [start]
        while todo:
            gpu = todo.pop()
            if gpu in group:
                continue
            group.add(gpu)
            todo.extend(peers.get(str(gpu), []))
        seen |= group
        islands.append(sorted(group))
    return islands


def node_topology(peers: dict[str, list[int]], numa: list[int]) -> NodeTopology:
    """The NodeTopology fields a library reads: each chip's scale-up peers on the node (by
    index, as strings), the domains they make, and each chip's NUMA node (-1: unknown)."""
    return {
        "gpu_count": len(numa),
        "nvlink_islands": interconnect_domains(peers, len(numa)),
        "gpu_numa_nodes": numa,
        "nvlink_peers": peers,
    }


def check_power_cap(watts: float, allowed: list[tuple[float, float] | None]) -> None:
    """Refuse a cap outside any chip's allowed range before any chip is touched, so a node
    never ends up half capped."""
    for index, bounds in enumerate(allowed):
        if bounds is not None and not bounds[0] <= watts <= bounds[1]:
            raise DeviceError(
                f"a {watts:.0f} W power cap is outside GPU {index}'s allowed "
                f"{bounds[0]:.0f}-{bounds[1]:.0f} W"
            )


def _nvml() -> Devices:
    from fleetline.agents.devices.nvml import NvmlDevices

    return NvmlDevices().open()


def _amdsmi() -> Devices:
    from fleetline.agents.devices.amd import AmdSmiDevices

    return AmdSmiDevices().open()


# The libraries an agent can read, in the order `auto` tries them.
LIBRARIES: dict[str, Callable[[], Devices]] = {"nvml": _nvml, "amdsmi": _amdsmi}


def open_devices(
    library: str = "auto", libraries: dict[str, Callable[[], Devices]] | None = None
) -> Devices:
    """The node's accelerators through `library` (`auto`: the first library that finds any).
    A library missing or failing is logged with its reason and the node reports none."""
    libraries = LIBRARIES if libraries is None else libraries
    if library != "auto" and library not in libraries:
        raise ConfigError(f"--devices {library!r}: one of auto, {', '.join(libraries)}")
    names = list(libraries) if library == "auto" else [library]
    reasons = []
    for name in names:
        try:
            devices = libraries[name]()
        except DeviceError as exc:
            reasons.append(f"{name}: {exc}")
            continue
        if devices.gpu_count or library != "auto":
            return devices
        devices.close()
        reasons.append(f"{name}: no devices")
    reason = "; ".join(reasons)
    log.warning("no accelerators read (%s): the node is reported without any", reason)
    return NoDevices(reason)
