"""What a node's accelerators are, as the view and the scheduler know them. Pure.

A node agent reads the chip's own name (NVML's `nvmlDeviceGetName`, e.g. "NVIDIA H100 80GB
HBM3") and memory; `normalise_model` makes the name a model id (`h100-80gb-hbm3`) and its first
word the family (`h100`). A spec names a model or a family, and it matches exactly one of the
two: `H100` takes every H100 whatever its memory or form factor (memory is asked for with
`min_gpu_memory_gb`), `h100-80gb-hbm3` only that one, and `h10` nothing. Matching by substring,
as the view once did with a label, made `H10` an H100 and `A100` an `A100X`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from fleetline.schemas.records import NodeAccelerator

# Brand words that come before the model in vendors' device names and say nothing a spec would
# choose by ("NVIDIA Tesla V100-SXM2-16GB" is a v100-sxm2-16gb; "AMD Instinct MI300X" an mi300x).
_BRANDS = frozenset({"nvidia", "tesla", "geforce", "amd", "instinct", "intel"})
_SEPARATORS = re.compile(r"[^a-z0-9.]+")
MIB_PER_GB = 1000**3 / 2**20  # GB as vendors and specs count it (10^9 bytes), in MiB


def normalise_model(name: str) -> str:
    """A model id from a device or spec name: lower case, words joined by '-', brand words
    dropped (`NVIDIA H100 80GB HBM3` -> `h100-80gb-hbm3`); '' for an empty name."""
    words = [w for w in _SEPARATORS.split(name.strip().lower()) if w]
    while len(words) > 1 and words[0] in _BRANDS:
        words.pop(0)
    return "-".join(words)


@dataclass(frozen=True, order=True)
class Accelerator:
    """A node's GPUs: who makes them, which model, and the memory of its smallest GPU."""

    vendor: str
    model: str  # normalised (`normalise_model`)
    memory_mib: int  # per GPU; 0 where the node did not say
    # The device's own name, for people: not compared, so a scheduler that reads the summaries
    # (which do not carry it) sees the same facts as one that reads the whole view.
    name: str = field(default="", compare=False)

    @cached_property
    def family(self) -> str:
        return self.model.split("-", 1)[0]

    @cached_property
    def names(self) -> frozenset[str]:
        """What a spec may call it: its model or its family."""
        return frozenset({self.model, self.family})

    @property
    def memory_gb(self) -> float:
        return self.memory_mib / MIB_PER_GB

    def describe(self) -> str:
        memory = f" {self.memory_mib / 1024:.0f} GiB" if self.memory_mib else ""
        return f"{self.vendor} {self.model}{memory}"

    def as_record(self) -> NodeAccelerator:
        """The NodeState `accelerator` field (and the snapshot's)."""
        return {
            "vendor": self.vendor,
            "model": self.model,
            "name": self.name,
            "memory_mib": self.memory_mib,
        }

    @classmethod
    def of_device(cls, vendor: str, device_name: str, memory_mib: int) -> Accelerator:
        """From what a driver says of a GPU (NVML's name and memory total); the simulator
        states its GPUs through this too, so both make the same facts."""
        return cls(
            vendor=vendor.lower() or "unknown",
            model=normalise_model(device_name) or "unknown",
            memory_mib=memory_mib,
            name=device_name or "unknown",
        )

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> Accelerator:
        return cls(
            vendor=record["vendor"],
            model=normalise_model(record["model"]),
            memory_mib=int(record["memory_mib"]),
            name=record.get("name") or record["model"],
        )


UNKNOWN = Accelerator(vendor="unknown", model="", memory_mib=0)


def of_node_state(record: Mapping[str, Any]) -> Accelerator:
    """A NodeState's accelerator. Records written before NodeState v3 had only the
    `accelerator` label the simulator set (no vendor, no memory): read that, so old logs replay."""
    declared = record.get("accelerator")
    if declared is not None:
        return Accelerator.of_record(declared)
    label = record.get("labels", {}).get("accelerator", "")
    if not label:
        return UNKNOWN
    return Accelerator(vendor="unknown", model=normalise_model(label), memory_mib=0, name=label)


def wanted(accelerator: str | Iterable[str] | None) -> tuple[str, ...]:
    """A spec's `accelerator` as normalised names, sorted (empty: any model)."""
    if accelerator is None:
        return ()
    names = [accelerator] if isinstance(accelerator, str) else list(accelerator)
    return tuple(sorted({normalise_model(n) for n in names if normalise_model(n)}))


def suits(accelerator: Accelerator, models: tuple[str, ...], min_memory_mib: int = 0) -> bool:
    """Whether GPUs of this kind may take work that asks for `models` (empty: any) with at least
    `min_memory_mib` each."""
    if models and accelerator.model not in models and accelerator.family not in models:
        return False
    return accelerator.memory_mib >= min_memory_mib


def did_you_mean(name: str, known: Iterable[Accelerator]) -> str:
    """' (did you mean h100?)' from the models and families seen, or ''."""
    choices = sorted({n for a in known for n in a.names if n})
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""
