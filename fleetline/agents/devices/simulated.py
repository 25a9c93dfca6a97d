"""The chips the simulated fleet plays (agents/simulator.py), each as its driver would describe it.

Two real parts beside the NVIDIA ones, so a mixed fleet runs anywhere: AMD's MI300X (eight on a
board, all on one xGMI mesh), and a simulated vendor family standing for chips with their own
interconnect and memory: `simnpu` (an NPU-like part, eight per node on one mesh, 64 GB) and
`simtpu` (a TPU-like part, four per host on one ICI slice, 16 GB). The sim parts' names say they
are simulated; their figures in the capability catalogue are modelled on public parts of their
kind and say so.

A profile is what the simulator needs to play telemetry: chips per node, interconnect domain
size and links, memory, power at idle and at full load, its limit and clocks. A scripted `xid`
fault on a sim chip raises the code it is given; the view's HealthPolicy.vendor_codes says
which of the family's codes fail or degrade it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetline.errors import ConfigError


@dataclass(frozen=True)
class ChipProfile:
    vendor: str
    device_name: str  # as its driver names it (the catalogue's model is this, normalised)
    memory_mib: int  # what the driver reports as the memory total
    per_node: int
    domain_size: int  # chips per interconnect domain on a node (NVLink island, xGMI mesh, ...)
    links: int  # scale-up links per chip
    link_bytes_per_s: float  # per chip and direction at full load
    idle_w: float
    busy_w: float  # added at full load
    power_limit_w: float
    sm_clock_mhz: int
    mem_clock_mhz: int


PROFILES: dict[str, ChipProfile] = {
    p.device_name: p
    for p in (
        ChipProfile(
            "nvidia",
            "NVIDIA H100 80GB HBM3",
            81559,
            8,
            4,
            18,
            180e9,
            90.0,
            600.0,
            700.0,
            1980,
            2619,
        ),
        ChipProfile(
            "nvidia", "NVIDIA H200", 143771, 8, 4, 18, 180e9, 90.0, 600.0, 700.0, 1980, 2619
        ),
        ChipProfile(
            "nvidia",
            "NVIDIA A100-SXM4-80GB",
            81920,
            8,
            4,
            12,
            120e9,
            60.0,
            330.0,
            400.0,
            1410,
            1593,
        ),
        ChipProfile(
            "amd", "AMD Instinct MI300X", 196592, 8, 8, 7, 110e9, 140.0, 600.0, 750.0, 2100, 1300
        ),
        ChipProfile(
            "simnpu", "SimNPU N1 64GB", 65536, 8, 8, 7, 50e9, 70.0, 320.0, 400.0, 1800, 1600
        ),
        ChipProfile(
            "simtpu", "SimTPU T1 16GB", 16384, 4, 4, 4, 45e9, 40.0, 150.0, 200.0, 1500, 1600
        ),
    )
}


def profile(device_name: str) -> ChipProfile:
    """The profile of a chip the simulator plays, by its driver name."""
    found = PROFILES.get(device_name)
    if found is None:
        raise ConfigError(
            f"the simulator plays no chip called {device_name!r}: one of {', '.join(PROFILES)}"
        )
    return found
